"""infinity: ZeRO stages 1-3 with CPU and NVMe offload (the ZeRO-Infinity system).

The package exports the public API of DESIGN.md and nothing else.
"""
from ._log import logger

__all__ = ["logger"]
__version__ = "0.1.0"
