"""infinity: ZeRO stages 1-3 with CPU and NVMe offload (the ZeRO-Infinity system).

The package exports the public API of DESIGN.md and nothing else.
"""
from . import aio, optim
from ._accelerator import device
from ._checkpoint import load_checkpoint, save_checkpoint
from ._estimate import estimate
from ._gathered import GatheredParameters, register_external_parameter
from ._init import Init
from ._initialize import initialize
from ._log import logger
from ._param import ParameterNotAvailableError
from .config import Config, ConfigError
from .errors import InfinityError
from .tiling import TiledLinear

__all__ = [
    "Config", "ConfigError", "InfinityError", "aio", "device", "optim", "GatheredParameters", "Init",
    "ParameterNotAvailableError", "estimate", "initialize", "load_checkpoint",
    "logger", "register_external_parameter", "save_checkpoint", "TiledLinear",
]
__version__ = "0.1.0"
