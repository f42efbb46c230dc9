"""The validation of a :class:`~infinity.config.Config`: every check of a key, and the errors that name it.

Note [config validation]: one generic walker (``_validate_node``) validates every field of the schema. Each
field carries its rules in ``metadata`` (``help``, bounds ``ge``/``gt``/``le``/``lt``, a ``check`` callable, a
``parse`` callable for size strings), and the field's annotation gives the type (``Literal`` for enumerations,
``Optional`` for nullable keys). The walker converts and checks each leaf, and then, when all of a section's own
fields are fine, runs the section's ``_cross_check`` (keys checked against each other). Every problem becomes a
``(key path, message)`` pair; a :class:`ConfigError` carries all of them at once.

Where a key's check lives: its bounds are written on its field in ``schema.py``; a ``check=`` / ``parse=`` there
and a section's ``_cross_check = ...`` name a function of this module (the ``_check_*`` functions below, one per
key or section). This module imports nothing of the schema: the walker reads the dataclasses it is given.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Optional, Union, get_args, get_origin, get_type_hints

import yaml

from .._runtime._log import logger
from ..errors import ConfigError


class _LeafError(Exception):
    """A problem with one value; the walker adds the key path."""


# ---------------------------------------------------------------------------------------------
# Keys: the ``check=`` and ``parse=`` functions the schema's fields name


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def _parse_bytes(value: Any) -> Any:
    """``8GB`` / ``512MiB`` / ``1024`` -> int bytes; anything else is returned for the type check."""
    if not isinstance(value, str):
        return value
    match = _SIZE_RE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise _LeafError(f"cannot read {value!r} as a size; write an int of bytes or a number "
                         f"with one of the units {', '.join(u for u in _SIZE_UNITS if u)} "
                         f"(case-insensitive), e.g. '8GB' or '512MiB'")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def _check_dir(value: str) -> Optional[str]:
    """An existing path must be a writable directory; a missing one is created by the engine,
    so its nearest existing ancestor must be a writable directory (not a file, not on a
    read-only mount: access(2) reports EROFS even to root)."""
    path = os.path.abspath(value)
    if not os.path.exists(path):
        parent = os.path.dirname(path)
        while parent != os.path.dirname(parent) and not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            return (f"{value!r} cannot be created: {parent!r} is a file, not a directory; give a directory on the "
                    f"NVMe device")
        if not os.access(parent, os.W_OK | os.X_OK):
            return (f"{value!r} cannot be created: {parent!r} is not writable ({_why_not_writable(parent)}); give a "
                    f"writable directory")
        return None
    if not os.path.isdir(path):
        return f"{value!r} exists but is not a directory; give a directory on the NVMe device"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"directory {value!r} is not writable ({_why_not_writable(path)}); give a writable directory"
    return None


def _parse_dirs(value: Any) -> Any:
    """Note [many drives] in _drives.py: a list of directories, one per drive, each a string and
    none twice (a list of one is one drive); anything else is returned for the type check."""
    if not isinstance(value, (list, tuple)):
        return value
    if not value:
        raise _LeafError("an empty list names no drive; give a directory, or a list of one directory per drive")
    seen: dict = {}
    for i, d in enumerate(value):
        if not isinstance(d, (str, os.PathLike)):
            raise _LeafError(f"[{i}]: expected a directory (str), got {_describe(d)}")
        key = os.path.abspath(os.fspath(d))
        if key in seen:
            raise _LeafError(f"[{i}] {os.fspath(d)!r} is [{seen[key]}] again; list each drive's directory once")
        seen[key] = i
    return tuple(os.fspath(d) for d in value)


def _check_dirs(value: Union[str, tuple]) -> Optional[str]:
    """``_check_dir`` of one directory, or of each of a list, naming the index."""
    if isinstance(value, str):
        return _check_dir(value)
    for i, d in enumerate(value):
        message = _check_dir(d)
        if message:
            return f"[{i}]: {message}"
    return None


def _check_stripe_size(value: int) -> Optional[str]:
    if value % 4096:
        return (f"{value} is not a multiple of 4096 (an extent holds whole 4 KiB blocks, each with its checksum), "
                f"e.g. 8388608 (8 MiB)")
    return None


def _why_not_writable(path: str) -> str:
    try:
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    return "it is on a read-only file system" if read_only else "not by this user"


def _check_data_path(value: str) -> Optional[str]:
    if not value.endswith((".txt", ".jsonl")):
        return f"{value!r} must be a .txt or .jsonl file (or null for the built-in corpus)"
    return None


def _check_model(value: Any) -> Optional[str]:
    if isinstance(value, str):
        return None if value.strip() else "must be a model name or a directory, not empty"
    if not isinstance(value.get("model_type"), str):
        return ("a model given as a dict of Hugging Face config fields must contain "
                "'model_type' (a string such as 'gpt2' or 'llama')")
    return None


def _check_block_size(value: int) -> Optional[str]:
    if value % 4096:
        return f"{value} is not a multiple of 4096 (O_DIRECT needs aligned requests), e.g. 1048576"
    return None


def _check_numa(value: Any) -> Optional[str]:
    if isinstance(value, int) and value < 0:
        return f"{value} is not a NUMA node; write a node number (0, 1, ...), auto or off"
    return None


def _check_betas(value: tuple) -> Optional[str]:
    if not all(0.0 <= b < 1.0 for b in value):
        return f"{list(value)} out of range; both betas must be in [0, 1), e.g. [0.9, 0.999]"
    return None


# ---------------------------------------------------------------------------------------------
# Sections: keys checked against each other (a section's ``_cross_check``), run once its own keys are fine


SPLIT_TIERS = ("device", "cpu", "nvme")  # fastest first (Note [split tiers] in _offload/_split.py)


def split_fractions(split: Any) -> Optional[dict]:
    """{tier name: fraction} of a ``split`` section (missing tiers 0), or None when none is given."""
    given = {t: getattr(split, t) for t in SPLIT_TIERS}
    if all(v is None for v in given.values()):
        return None
    return {t: float(v or 0.0) for t, v in given.items()}


def _check_split_section(split: Any, prefix: str) -> list:
    fr = split_fractions(split)
    if fr is None:
        return []
    total = sum(fr.values())
    if abs(total - 1.0) > 1e-6:
        return [(prefix, f"fractions {_fractions_text(fr)} sum to {total:g}; they must sum to 1 (e.g. cpu: "
                 f"{fr['cpu'] / total if total else 0.5:.2f}, nvme: {fr['nvme'] / total if total else 0.5:.2f})")]
    if fr["device"]:
        return [(f"{prefix}.device", f"{fr['device']:g}: a device share of an offloaded state is not supported yet "
                 f"(the device part would need its own update on the device); move it to cpu (cpu: "
                 f"{fr['cpu'] + fr['device']:g}) or keep the whole state on the device with device: none")]
    return []


def _fractions_text(fr: dict) -> str:
    return "{" + ", ".join(f"{t}: {v:g}" for t, v in fr.items() if v) + "}"


def _check_offload_section(offload: Any, prefix: str) -> list:
    fr = split_fractions(offload.split)
    if fr is not None:  # Note [split tiers] in _offload/_split.py
        slowest = "nvme" if fr["nvme"] else "cpu"
        if offload.device == "auto":
            return [(f"{prefix}.split", "is given while device is auto, which plans the split itself; remove "
                     "split, or set device to " + slowest)]
        if offload.device != slowest:
            return [(f"{prefix}.device", f"is {offload.device} while split {_fractions_text(fr)} puts part of the "
                     f"state on {slowest}; set device to {slowest}, the split's slowest tier")]
    if offload.device == "nvme" and offload.nvme_path is None:
        return [(f"{prefix}.nvme_path", f"is required when {prefix}.device is nvme; "
                 "give a directory on a local NVMe drive")]
    return []


def tierless_offload_paths(data: Any) -> list:
    """An offload section of a config dict that gives an nvme_path but no device (a device key left out or
    misspelt) would train with nothing offloaded: a problem each. An explicit ``device: none`` beside a path
    is the user's choice (a template that keeps its path) and stands, said once a process as a warning."""
    zero = data.get("zero") if isinstance(data, Mapping) else None
    problems = []
    for section in ("offload_param", "offload_optimizer"):
        raw = zero.get(section) if isinstance(zero, Mapping) else None
        if isinstance(raw, Mapping) and raw.get("nvme_path") is not None and "device" not in raw:
            problems.append((f"zero.{section}.device", "is not given while this section's nvme_path is, so it "
                             "would be none (the default) and nothing would be offloaded; set device to nvme (or "
                             "cpu) in this section, or remove its nvme_path"))
        elif isinstance(raw, Mapping) and raw.get("nvme_path") is not None and raw.get("device") == "none" \
                and section not in _SAID_IDLE_PATH:
            _SAID_IDLE_PATH.add(section)
            logger.warning("zero.%s.device is none beside nvme_path %s: this state stays in device memory and the "
                           "path is not used; set device to nvme to offload it there", section, raw["nvme_path"])
    return problems


_SAID_IDLE_PATH: set = set()  # the sections whose unused nvme_path was warned of, once a process


def _check_optimizer_offload_section(offload: Any, prefix: str) -> list:
    if offload.moments != "fp32" and offload.device != "nvme":  # Note [compressed moments] in _moments.py
        return [(f"{prefix}.moments", f"{offload.moments} applies to nvme only (compressed moments shrink the swap "
                 f"files; {prefix}.device is {offload.device}, where the moments stay fp32); set {prefix}.moments "
                 f"to fp32 or {prefix}.device to nvme")]
    if offload.speculate != "off" and (offload.device != "cpu" or offload.overlap_step == "off"):
        return [(f"{prefix}.speculate", f"{offload.speculate} needs the optimizer states in host memory and the "
                 f"overlapped step ({prefix}.device is {offload.device}, {prefix}.overlap_step {offload.overlap_step}: Note "
                 f"[speculative update] in _zero/_speculative_update.py); set {prefix}.device to cpu and "
                 f"overlap_step to auto or on, or speculate to off")]
    if offload.overlap_step == "on" and offload.device == "none":  # Note [overlapped step] in _zero_optimizer.py
        return [(f"{prefix}.overlap_step", f"on needs the optimizer states off the device ({prefix}.device is none: "
                 f"the update runs on the device, in step()); set {prefix}.device to cpu or nvme, or overlap_step to "
                 f"auto")]
    return _check_offload_section(offload, prefix)


def _check_prefetch_section(prefetch: Any, prefix: str) -> list:
    # A unit moves NVMe -> host -> device -> gathered in order, so each stage can run
    # at most as far ahead as the one before it.
    if prefetch.device_depth > prefetch.depth:
        return [(f"{prefix}.device_depth", f"({prefetch.device_depth}) exceeds {prefix}.depth ({prefetch.depth}): a "
                 f"unit is copied to the device only after its NVMe read; set device_depth <= depth")]
    if prefetch.gather_depth > prefetch.device_depth:
        return [(f"{prefix}.gather_depth", f"({prefetch.gather_depth}) exceeds {prefix}.device_depth "
                 f"({prefetch.device_depth}): a unit is gathered only once its shard is on the device; set "
                 f"gather_depth <= device_depth")]
    return []


def _check_zero_section(zero: Any, prefix: str) -> list:
    if zero.stage < 3 and zero.offload_param.device != "none":
        return [(f"{prefix}.offload_param.device",
                 f"parameter offload needs stage 3 (stage is {zero.stage}); set {prefix}.stage "
                 f"to 3 or {prefix}.offload_param.device to none")]
    if zero.stage < 3 and zero.offload_optimizer.overlap_step == "on":  # Note [overlapped step] in _zero_optimizer.py
        return [(f"{prefix}.offload_optimizer.overlap_step",
                 f"on needs stage 3 (stage is {zero.stage}: stages 1-2 all-gather the whole updated parameters "
                 f"inside step()); set {prefix}.stage to 3 or overlap_step to auto")]
    if zero.stage == 3 and zero.tiling.enabled and zero.tiling.max_tile_params < zero.prefetch.persistence_threshold:
        # a unit below the threshold stays gathered between uses: every tile would, and the
        # tiled operator would be as large on the device as untiled
        return [(f"{prefix}.tiling.max_tile_params",
                 f"({zero.tiling.max_tile_params}) is below {prefix}.prefetch.persistence_threshold "
                 f"({zero.prefetch.persistence_threshold}), so every tile would stay gathered; lower "
                 f"persistence_threshold below max_tile_params or raise max_tile_params")]
    return []


def _check_config(config: Any, prefix: str) -> list:
    """Keys of different sections checked against each other (the whole config)."""
    zero, aio = config.zero, config.aio
    if zero.nvme_layout == "stripe" and zero.nvme_stripe_size % aio.block_size:
        # a request of one aio block never spans two drives
        return [("zero.nvme_stripe_size", f"{zero.nvme_stripe_size} is not a multiple of aio.block_size "
                 f"({aio.block_size}); set zero.nvme_stripe_size to a multiple of it, e.g. "
                 f"{max(1, zero.nvme_stripe_size // aio.block_size) * aio.block_size}")]
    return []


FP16_KNOBS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")


def _check_precision_section(precision: Any, prefix: str) -> list:
    """Not an error: fp16's knobs set with another dtype are warned about (a shared config may carry them)."""
    if precision.dtype != "fp16":
        defaults = type(precision).__dataclass_fields__
        changed = [k for k in FP16_KNOBS if getattr(precision, k) != defaults[k].default]
        for knob in changed:
            logger.warning("%s.%s is only used with fp16; ignored with dtype %s",
                           prefix, knob, precision.dtype)
    return []


# ---------------------------------------------------------------------------------------------
# The generic walker


_INTERNAL = "internal"  # metadata of a field that is not a config key (Config.unsupported, resolved_auto)


def _is_section(hint: Any) -> bool:
    """A field's type that is a nested section (a dataclass), not a key."""
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _fields(cls) -> list:
    hints = get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls) if not f.metadata.get(_INTERNAL)]


def _leaf_fields(cls, prefix: str = ""):
    for f, hint in _fields(cls):
        path = f"{prefix}{f.name}"
        if _is_section(hint):
            yield from _leaf_fields(hint, path + ".")
        else:
            yield path, hint, f


def _validate_node(node: Any, prefix: str, problems: list) -> None:
    """Type- and range-check every field of ``node`` (normalising values in place), then run
    the node's ``_cross_check`` if its own fields were all fine."""
    before = len(problems)
    for f, hint in _fields(type(node)):
        path = f"{prefix}{f.name}"
        value = getattr(node, f.name)
        if _is_section(hint):
            if isinstance(value, hint):
                _validate_node(value, path + ".", problems)
            else:
                problems.append((path, f"must be a {hint.__name__} section, got {_describe(value)}"))
            continue
        try:
            object.__setattr__(node, f.name, _check_leaf(value, hint, f.metadata))
        except _LeafError as err:
            problems.append((path, str(err)))
    cross = getattr(node, "_cross_check", None)
    if cross is not None and len(problems) == before:
        problems.extend(cross(prefix[:-1] if prefix else ""))


def _check_leaf(value: Any, hint: Any, meta: Mapping) -> Any:
    if "parse" in meta:
        value = meta["parse"](value)
    value = _check_type(value, hint)
    if value is None:
        return value
    for rule, ok, word in (("gt", lambda v, b: v > b, ">"), ("ge", lambda v, b: v >= b, ">="),
                           ("lt", lambda v, b: v < b, "<"), ("le", lambda v, b: v <= b, "<=")):
        if rule in meta and not ok(value, meta[rule]):
            raise _LeafError(f"{value!r} is out of range; allowed: {_bounds_text(meta)}")
    if "check" in meta:
        message = meta["check"](value)
        if message:
            raise _LeafError(message)
    return value


def _check_type(value: Any, hint: Any) -> Any:
    """``value`` converted to ``hint`` (int -> float, Path -> str, list -> tuple) or _LeafError."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise _LeafError(f"expected {_type_name(hint)}, got null")
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check_type(value, arg)
            except _LeafError as err:
                errors.append(err)
        raise errors[0] if len(errors) == 1 else _LeafError(
            f"expected {_type_name(hint)}, got {_describe(value)}")
    if origin is Literal:
        if type(value) not in {type(a) for a in args} or value not in args:  # True is not 1
            raise _LeafError(f"{_describe(value)} is not allowed; allowed values: "
                             f"{', '.join(repr(a) if isinstance(a, str) else str(a) for a in args)}")
        return value
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:  # a list of any length
        if not isinstance(value, (list, tuple)):
            raise _LeafError(f"expected {_type_name(hint)}, got {_describe(value)}")
        return tuple(_check_type(v, args[0]) for v in value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise _LeafError(f"expected {_type_name(hint)}, got {_describe(value)}")
        return tuple(_check_type(v, a) for v, a in zip(value, args))
    return _check_scalar(value, hint)


def _check_scalar(value: Any, hint: type) -> Any:
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise _LeafError(f"expected a finite number, got {value!r}")
        return float(value)
    if hint is str and isinstance(value, (str, os.PathLike)):
        return os.fspath(value)
    if hint is dict and isinstance(value, Mapping):
        return dict(value)
    extra = ""
    if hint in (int, float) and isinstance(value, str) and _is_number(value):
        extra = (" (a number was written as a string; drop the quotes. YAML reads 1e-4 as a "
                 "string: write 1.0e-4)")
    elif hint is int and isinstance(value, float) and value.is_integer():
        extra = f" (write {int(value)})"
    raise _LeafError(f"expected {_type_name(hint)}, got {_describe(value)}{extra}")


def _is_number(text: str) -> bool:
    try:
        float(text.replace("_", ""))
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Messages and files


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _type_name(hint: Any) -> str:
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        if type(None) in args:
            names.append("null")
        return " or ".join(names)
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return f"list of {_type_name(args[0])}"
    if origin is tuple:
        return "[" + ", ".join(_type_name(a) for a in args) + "]"
    return {dict: "mapping", str: "str", int: "int", float: "float", bool: "bool"}.get(
        hint, getattr(hint, "__name__", str(hint)))


def _bounds_text(meta: Mapping) -> str:
    parts = [f"{word} {meta[rule]}" for rule, word in
             (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")) if rule in meta]
    return "values " + " and ".join(parts)


def _rule_text(f) -> str:
    text = f.metadata.get("help", "")
    if any(rule in f.metadata for rule in ("gt", "ge", "lt", "le")):
        text += f" ({_bounds_text(f.metadata)})"
    return text.replace("|", "\\|")


def _read_file(path: Union[str, os.PathLike]) -> dict:
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise ConfigError(f"config file {str(path)!r}: unknown extension {suffix or '(none)'!r}; "
                          "use .json, .yaml or .yml")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except OSError as err:
        raise ConfigError(f"cannot read config file {str(path)!r}: {err}") from None
    try:
        if suffix == ".json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)
    except ValueError as err:  # json.JSONDecodeError
        raise ConfigError(f"config file {str(path)!r} is not valid JSON: {err}") from None
    except Exception as err:  # yaml.YAMLError, or whatever else a malformed file makes the parser raise
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of keys to values, "
                          f"got {_describe(data)}")
    return data


def _base_type(hint: Any) -> Any:
    args = [a for a in get_args(hint) if a is not type(None)]
    return args[0] if get_origin(hint) in (Union, types.UnionType) and len(args) == 1 else hint
