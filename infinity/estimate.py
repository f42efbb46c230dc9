"""``python -m infinity.estimate``: memory per tier and the recommended placement.

The logic lives in ``infinity._apps._estimator``; this module only runs it, so that importing the
package never imports the command line. Importing this module (``python -m``, ``import
infinity.estimate``) binds it as the package's ``estimate`` attribute, in place of the
function of the same name; the module is therefore callable and calls that function, so
``infinity.estimate(...)`` works either way.
"""
import sys
import types

from ._apps._estimate_cli import main
from ._apps._estimator import estimate


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return estimate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
