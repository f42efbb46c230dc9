"""``python -m infinity.estimate``: memory per tier and the recommended placement.

The logic lives in ``infinity._estimate``; this module only runs it, so that importing the
package never imports the command line.
"""
import sys

from ._estimate import main

if __name__ == "__main__":
    sys.exit(main())
