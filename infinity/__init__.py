"""infinity: ZeRO stages 1-3 with CPU and NVMe offload (the ZeRO-Infinity system).

The package exports the public API (``__all__``) and nothing else.
"""
from . import aio, optim
from ._apps._estimator import estimate
from ._checkpoint import load_checkpoint, save_checkpoint
from ._runtime._accelerator import device
from ._runtime._log import logger
from ._zero._gathered import GatheredParameters, register_external_parameter
from ._zero._init_context import Init
from ._zero._initialize import close, initialize, telemetry
from ._zero._param import ParameterNotAvailableError
from ._zero._tiling import TiledLinear
from .config import Config, ConfigError
from .errors import InfinityError

__all__ = [
    "Config", "ConfigError", "InfinityError", "aio", "device", "optim", "GatheredParameters", "Init",
    "ParameterNotAvailableError", "close", "estimate", "initialize", "load_checkpoint",
    "logger", "register_external_parameter", "save_checkpoint", "telemetry", "TiledLinear",
]
__version__ = "0.1.0"
