"""The command line of ``python -m infinity.train``: its flags, the embedded default run, and
the config they resolve to (a ``--config`` file or the default, with the flags on top)."""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import types
from typing import Any, Dict, List, Optional

from .._offload._drives import configured_drives
from ..config import Config, _looks_like_deepspeed, _read_file
from ._train_model import PRESETS, TrainError, model_config

EXIT_BAD_INPUT = 2
EXIT_SIGINT = 130  # 128 + SIGINT, as shells report it; SIGTERM exits 143 (Note [preemption] in _checkpoint/_train.py)


def default_nvme_path() -> str:
    return os.path.join(tempfile.gettempdir(), "infinity_nvme")


def default_config() -> dict:
    """The embedded default run: every state on NVMe under the temp dir, a few minutes here."""
    nvme = default_nvme_path()
    return {
        "zero": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                 "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
        "precision": {"dtype": "auto"},  # bf16 where the machine runs it natively, else fp32
        "optimizer": {"type": "adamw", "lr": 1.0e-3, "weight_decay": 0.01},
        "gradient_clipping": 1.0,
        "seed": 1234,
        "train": {"model": "gpt2-tiny", "data": None, "steps": 60, "micro_batch_size": 8, "seq_len": 128,
                  "output_dir": os.path.join("runs", "train-" + time.strftime("%Y%m%d-%H%M%S")),
                  "save": True, "log_every": 20, "lr_warmup_steps": 10},
    }


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m infinity.train",
        description="Fine-tune a GPT-style causal LM with ZeRO and CPU/NVMe offload. Without --config, "
                    "runs the embedded default (tiny GPT-2, built-in corpus, everything on NVMe).")
    p.add_argument("--config", help="a YAML or JSON config (a DeepSpeed JSON is accepted too)")
    p.add_argument("--steps", type=int, help="optimizer steps (train.steps)")
    p.add_argument("--model", help="a preset (" + ", ".join(PRESETS) + "), a local model directory, "
                   "or a JSON object of Hugging Face config fields with model_type (train.model)")
    p.add_argument("--data", help="a .txt or .jsonl file (train.data); default: the built-in corpus")
    p.add_argument("--output-dir", help="where telemetry and the fine-tuned weights go (train.output_dir)")
    p.add_argument("--no-save", action="store_true", help="do not save the fine-tuned weights")
    p.add_argument("--stage", type=int, choices=(1, 2, 3), help="ZeRO stage (zero.stage)")
    p.add_argument("--offload", choices=("none", "cpu", "nvme"),
                   help="tier of parameters (stage 3) and optimizer states")
    p.add_argument("--nvme-path", help="directory for NVMe swap files, or several separated by commas, one per drive "
                   "(zero.offload_*.nvme_path)")
    p.add_argument("--nvme-layout", choices=("per_rank", "stripe"),
                   help="with several drives: per_rank = each local rank on its own drive, stripe = every swap file "
                        "spread over all of them (zero.nvme_layout)")
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16", "fp16"),
                   help="training precision (precision.dtype); auto = bf16 where the machine runs it natively")
    p.add_argument("--save-every", type=int, metavar="N",
                   help="save a checkpoint every N steps (and after the last) under --output-dir/checkpoints")
    p.add_argument("--resume", metavar="auto|DIR",
                   help="resume from a checkpoint: auto = the latest complete one under --output-dir/checkpoints")
    p.add_argument("--trust-pickle", action="store_true",
                   help="let --resume read a checkpoint of format version 1 or 2, whose extra.pt and rng.pt are "
                        "pickles: reading them runs any code their writer put in them, so pass it only if you trust "
                        "every writer (python -m infinity.export --convert-old DIR --trust-pickle converts one once)")
    p.add_argument("--keep-last", type=int, metavar="N", help="keep only the newest N checkpoints")
    p.add_argument("--save-async", action="store_true",
                   help="--save-every saves without stopping training: the states are snapshotted at the save "
                        "(NVMe states cloned where the filesystem can) and written while the next steps run")
    p.add_argument("--save-on-signal", action="store_true",
                   help="on SIGTERM (what cluster schedulers send before they kill) or SIGINT, finish the step in "
                        "flight, save a checkpoint under --output-dir/checkpoints and exit 0; a second signal stops at "
                        "once. Without it either signal stops the job at once, saving nothing (exit 130 for SIGINT, "
                        "143 for SIGTERM)")
    p.add_argument("--strict", action="store_true",
                   help="a DeepSpeed --config: refuse keys that only tune DeepSpeed (default: accept them with "
                        "one warning)")
    return p.parse_args(argv)


def _model_arg(text: str):
    if text.lstrip().startswith("{"):
        try:
            return json.loads(text)
        except ValueError as err:
            raise TrainError(f"--model looks like JSON but is not valid JSON: {err}") from None
    return text


def _base_config(args: argparse.Namespace) -> Config:
    """The ``--config`` file or the embedded default, with ``--dtype`` in place before the
    config is built: ``precision.dtype: auto`` is resolved (and its choice logged) only where
    it is in effect. A DeepSpeed config's hidden-size "auto" values (``reduce_bucket_size``,
    ``stage3_prefetch_bucket_size``, ``stage3_param_persistence_threshold``) come from the
    model the run trains, as transformers' integration resolves them."""
    data = _read_file(args.config) if args.config else default_config()
    if _looks_like_deepspeed(data):
        spec = _model_arg(args.model) if args.model is not None else Config().train.model
        shape = model_config(spec)  # read only: the model is built once the config is known
        return Config.from_deepspeed(data, strict=args.strict,
                                     model=types.SimpleNamespace(config=shape) if shape is not None else None)
    precision = data.get("precision", {})
    if args.dtype is not None and isinstance(precision, dict):
        data = {**data, "precision": {**precision, "dtype": args.dtype}}
    return Config.from_dict(data)


def resolve_config(args: argparse.Namespace) -> Config:
    cfg = _base_config(args)
    updates: Dict[str, Any] = {}
    for flag, key in (("steps", "train.steps"), ("data", "train.data"), ("output_dir", "train.output_dir"),
                      ("stage", "zero.stage"), ("dtype", "precision.dtype")):
        if getattr(args, flag) is not None:
            updates[key] = getattr(args, flag)
    if args.model is not None:
        updates["train.model"] = _model_arg(args.model)
    if args.no_save:
        updates["train.save"] = False
    stage = updates.get("zero.stage", cfg.zero.stage)
    if args.offload is not None:
        updates["zero.offload_optimizer.device"] = args.offload
        updates["zero.offload_param.device"] = args.offload if stage == 3 else "none"
    elif stage < 3 and cfg.zero.offload_param.device != "none":
        updates["zero.offload_param.device"] = "none"  # --stage 1/2 on a config offloading parameters
    if args.nvme_layout is not None:
        updates["zero.nvme_layout"] = args.nvme_layout
    if args.nvme_path is not None:
        drives = [d.strip() for d in args.nvme_path.split(",") if d.strip()]  # Note [many drives] in _drives.py
        if not drives:
            raise TrainError(f"--nvme-path names no directory ({args.nvme_path!r}): give a directory on an NVMe "
                             f"drive, or several separated by commas, one per drive")
        for key in ("offload_param", "offload_optimizer"):  # not beside a tier of none: the config refuses that
            if updates.get(f"zero.{key}.device", getattr(cfg.zero, key).device) != "none":
                updates[f"zero.{key}.nvme_path"] = drives[0] if len(drives) == 1 else drives
    elif args.offload == "nvme":
        for key in ("offload_param", "offload_optimizer"):
            if getattr(cfg.zero, key).nvme_path is None:
                updates[f"zero.{key}.nvme_path"] = default_nvme_path()
    return cfg.with_overrides(updates) if updates else cfg


def nvme_paths(cfg: Config) -> List[str]:
    """Every drive the NVMe sections name, each once (Note [many drives] in _drives.py)."""
    return list(configured_drives(cfg))
