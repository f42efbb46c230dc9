"""The typed configuration of infinity: ``infinity.config.Config`` and its sections.

The package is split by what a reader looks for (each module imports only the ones above it in this list):

- ``validate.py``: :class:`ConfigError`, every check of a key (``_check_*``: the functions a field's ``check=`` /
  ``parse=`` and a section's ``_cross_check`` name) and the generic walker that runs them (Note [config
  validation] in validate.py); it reads the dataclasses it is given and imports nothing of the schema;
- ``deepspeed.py``: DeepSpeed configs mapped onto the schema (Note [DeepSpeed keys], Note [auto values] in
  deepspeed.py);
- ``schema.py``: the sections and :class:`Config`: every key with its type, default, help text and bounds, and
  the constructors (``from_dict``, ``from_file``, ``from_deepspeed``, ``coerce``).

To add a key: a field in its section in ``schema.py`` (bounds as ``ge=``/``gt=``/``le=``/``lt=``); a function in
``validate.py`` named by ``check=`` when bounds do not say it, or a line in the section's ``_check_*_section``
when it depends on another key; its DeepSpeed name, if any, in ``deepspeed.RENAMES``; then
``python scripts/update_readme.py`` regenerates the README's table.
"""
from .deepspeed import _looks_like_deepspeed as _looks_like_deepspeed
from .schema import ActivationCheckpointingConfig as ActivationCheckpointingConfig
from .schema import (
    AioConfig,
    Config,
    OffloadConfig,
    OptimizerConfig,
    OptimizerOffloadConfig,
    PrecisionConfig,
    PrefetchConfig,
    TelemetryConfig,
    TrainConfig,
    ZeroConfig,
)
from .schema import CommConfig as CommConfig
from .schema import FetchUnitsConfig as FetchUnitsConfig
from .schema import SchedulerConfig as SchedulerConfig
from .schema import TilingConfig as TilingConfig
from .schema import all_key_paths as all_key_paths
from .validate import ConfigError
from .validate import _parse_bytes as _parse_bytes
from .validate import _read_file as _read_file

# The names written ``X as X`` above are importable from here as before the split, without being part of ``*``.
__all__ = [
    "ConfigError", "Config", "ZeroConfig", "OffloadConfig", "OptimizerOffloadConfig",
    "PrefetchConfig", "PrecisionConfig", "OptimizerConfig", "AioConfig", "TelemetryConfig",
    "TrainConfig",
]
