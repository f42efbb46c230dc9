"""The main job: ``python -m infinity.train [--config CONFIG] [overrides]``.

Fine-tunes a GPT-style causal LM from Hugging Face ``transformers`` with ZeRO (and offload,
as the config asks) on a text or JSONL file, on any number of ranks under ``torchrun``.
With no arguments it runs an embedded default (``default_config()``): a small GPT-2 built
from a preset, a generated corpus, the byte-level tokenizer and every model state on NVMe
under the system temp dir. Rank 0 shows a progress bar, writes telemetry and the weights,
and ends with a summary table. Bad input exits with status 2 and a message saying what to
change. This module is not imported by ``infinity/__init__``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F

from ._apps._train_data import (
    Batches,
    ByteTokenizer,
    builtin_corpus,
    has_tokenizer_files,
    load_hf_tokenizer,
    read_texts,
    token_windows,
)
from ._offload._preflight import InsufficientResourcesError
from ._offload._swap import PROBE_PREFIX
from ._runtime import _accelerator as acc
from ._runtime import _comm as comm
from ._runtime._log import logger
from ._runtime._schedule import make_scheduler
from ._runtime._telemetry import (
    StepStats,
    Telemetry,
    flatten,
    fmt_bytes,
    fmt_count,
    fmt_rate,
    mean,
    render_table,
    stall_seconds,
    tier_traffic,
)
from .config import Config
from .errors import InfinityError, NonFiniteError, UsageError

EXIT_BAD_INPUT = 2
PROBE_BYTES = 64 * 1024 * 1024
PROBE_REPS = 3
GPT2_POSITIONS = 1024  # GPT-2's position table: the most the gpt2-tiny preset sizes its own to

# Named model presets: fields of transformers.GPT2Config. "gpt2-tiny" matches the byte tokenizer.
PRESETS: Dict[str, dict] = {
    "gpt2-tiny": dict(n_layer=4, n_embd=256, n_head=4, vocab_size=ByteTokenizer.vocab_size,
                      bos_token_id=ByteTokenizer.eos_token_id, eos_token_id=ByteTokenizer.eos_token_id,
                      pad_token_id=ByteTokenizer.pad_token_id, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "gpt2-small": {},  # GPT2Config defaults: 124M parameters
    "gpt2-medium": dict(n_layer=24, n_embd=1024, n_head=16),  # 355M parameters
}


class TrainError(UsageError):
    """Bad input to the train job; the message says what to change."""


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


# ---------------------------------------------------------------------------------------------
# Command line and config


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
    p.add_argument("--nvme-path", help="directory for NVMe swap files (zero.offload_*.nvme_path)")
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16", "fp16"),
                   help="training precision (precision.dtype); auto = bf16 where the machine runs it natively")
    p.add_argument("--save-every", type=int, metavar="N",
                   help="save a checkpoint every N steps (and after the last) under --output-dir/checkpoints")
    p.add_argument("--resume", metavar="auto|DIR",
                   help="resume from a checkpoint: auto = the latest complete one under --output-dir/checkpoints")
    p.add_argument("--keep-last", type=int, metavar="N", help="keep only the newest N checkpoints")
    p.add_argument("--save-async", action="store_true",
                   help="--save-every saves without stopping training: the states are snapshotted at the save "
                        "(NVMe states cloned where the filesystem can) and written while the next steps run")
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


def resolve_config(args: argparse.Namespace) -> Config:
    cfg = Config.from_file(args.config, strict=args.strict) if args.config else Config.from_dict(default_config())
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
    if args.nvme_path is not None:
        updates["zero.offload_param.nvme_path"] = args.nvme_path
        updates["zero.offload_optimizer.nvme_path"] = args.nvme_path
    elif args.offload == "nvme":
        for key in ("offload_param", "offload_optimizer"):
            if getattr(cfg.zero, key).nvme_path is None:
                updates[f"zero.{key}.nvme_path"] = default_nvme_path()
    return cfg.with_overrides(updates) if updates else cfg


def nvme_paths(cfg: Config) -> List[str]:
    paths = []
    for section in (cfg.zero.offload_param, cfg.zero.offload_optimizer):
        if section.device == "nvme" and section.nvme_path not in paths:
            paths.append(section.nvme_path)
    return paths


# ---------------------------------------------------------------------------------------------
# Model and tokenizer


@dataclass
class ModelSpec:
    model: torch.nn.Module
    tokenizer: Any
    description: str
    source_dir: Optional[str] = None


def _positions(config) -> Optional[int]:
    for name in ("n_positions", "max_position_embeddings"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    return None


def _check_fits(config, tokenizer, seq_len: int, what: str, micro_batch: int = 1) -> None:
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and vocab < tokenizer.vocab_size:
        raise TrainError(f"{what}: vocab_size {vocab} is smaller than the tokenizer's {tokenizer.vocab_size} "
                         f"({tokenizer.name}); set vocab_size >= {tokenizer.vocab_size}")
    positions = _positions(config)
    if positions is not None and positions < seq_len:
        raise TrainError(f"{what}: the model takes at most {positions} positions but train.seq_len is "
                         f"{seq_len}; lower train.seq_len or raise n_positions/max_position_embeddings")
    _check_activations(config, seq_len, micro_batch, what)


def activation_bytes(config, seq_len: int, micro_batch: int) -> int:
    """Bytes of activations one fp32 micro-batch keeps for backward: ZeRO-Infinity's eq. 5
    (seed 002) without checkpointing, ``bsz·seq·layers·(16·hidden + 2·heads·seq)`` 2-byte
    elements (doubled for fp32), the ``heads·seq²`` attention scores only where the attention
    stores them (eager; sdpa/flash kernels do not), plus the logits, their fp32 copy and
    gradient (3 x bsz·seq·vocab x 4 bytes)."""
    layers = getattr(config, "n_layer", None) or getattr(config, "num_hidden_layers", None) or 1
    hidden = getattr(config, "n_embd", None) or getattr(config, "hidden_size", None) or 0
    heads = getattr(config, "n_head", None) or getattr(config, "num_attention_heads", None) or 1
    vocab = getattr(config, "vocab_size", None) or 0
    scores = 2 * heads * seq_len if getattr(config, "_attn_implementation", None) == "eager" else 0
    return 2 * micro_batch * seq_len * layers * (16 * hidden + scores) + 12 * micro_batch * seq_len * vocab


def _check_activations(config, seq_len: int, micro_batch: int, what: str) -> None:
    """Refuse, before the model is built, a micro-batch whose activations cannot fit the
    memory they live in (host memory on a CPU-only run)."""
    if acc.device().type != "cpu":
        return  # device memory: the engine's device budget and the estimator speak for it
    import psutil

    need, have = activation_bytes(config, seq_len, micro_batch), psutil.virtual_memory().available
    if need > have:
        raise TrainError(f"{what}: train.seq_len {seq_len} x train.micro_batch_size {micro_batch} needs about "
                         f"{fmt_bytes(need)} of activations for one micro-batch (estimate) but only "
                         f"{fmt_bytes(have)} of host memory is available; lower train.seq_len or "
                         f"train.micro_batch_size (gradient_accumulation_steps keeps the batch)")


def _causal_lm_from_config(config, what: str):
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(config)
    except ValueError as err:
        raise TrainError(f"{what}: {type(config).__name__} has no causal-LM head in transformers ({err}); "
                         f"use a GPT-style model_type such as gpt2 or llama") from None


def build_model(spec_value, seq_len: int, init=None, micro_batch: int = 1) -> ModelSpec:
    """A preset name, a dict of HF config fields with model_type, or a local directory (built
    under ``init``, the ``infinity.Init`` in effect, if any)."""
    from transformers import AutoConfig, GPT2Config

    byte_tok = ByteTokenizer()
    if isinstance(spec_value, dict):
        fields = dict(spec_value)
        model_type = fields.pop("model_type")
        try:
            config = AutoConfig.for_model(model_type, **fields)
        except (ValueError, KeyError, TypeError) as err:
            raise TrainError(f"train.model: cannot build a {model_type!r} config from {fields}: {err}") from None
        _check_fits(config, byte_tok, seq_len, "train.model", micro_batch)
        return ModelSpec(_causal_lm_from_config(config, "train.model"), byte_tok, f"{model_type} from config")
    if spec_value in PRESETS:
        fields = dict(PRESETS[spec_value])
        if spec_value == "gpt2-tiny":  # its position table fits the run, up to GPT-2's 1024 (refused above)
            fields["n_positions"] = min(max(256, seq_len), GPT2_POSITIONS)
        config = GPT2Config(**fields)
        _check_fits(config, byte_tok, seq_len, f"preset {spec_value}", micro_batch)
        return ModelSpec(_causal_lm_from_config(config, spec_value), byte_tok, f"{spec_value} (preset)")
    return _model_from_dir(spec_value, seq_len, init, micro_batch)


def _model_from_dir(directory: str, seq_len: int, init=None, micro_batch: int = 1) -> ModelSpec:
    from transformers import AutoConfig, AutoModelForCausalLM

    if not os.path.isdir(directory):
        raise TrainError(f"train.model {directory!r} is neither a preset ({', '.join(PRESETS)}) nor an "
                         f"existing directory; give a preset name or a directory with config.json")
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise TrainError(f"model directory {directory!r} has no config.json; give a directory saved by "
                         f"save_pretrained (config.json + *.safetensors)")
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except Exception as err:  # transformers raises OSError, ValueError, JSON errors...
        raise TrainError(f"model directory {directory!r}: config.json cannot be read: {err}") from None
    tokenizer = load_hf_tokenizer(directory) if has_tokenizer_files(directory) else ByteTokenizer()
    _check_fits(config, tokenizer, seq_len, f"model directory {directory!r}", micro_batch)
    weights = [f for f in os.listdir(directory) if f.endswith(".safetensors")]
    if not weights:
        logger.warning("model directory %s has no *.safetensors weights: starting from random weights", directory)
        return ModelSpec(_causal_lm_from_config(config, directory), tokenizer, f"{directory} (config only)", directory)
    try:
        # Under infinity.Init each rank streams its own chunks into the tiers (Note [streamed load]).
        model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32)
    except InfinityError:
        raise
    except Exception as err:
        raise TrainError(f"model directory {directory!r}: cannot load the weights: {err}") from None
    how = f"{len(weights)} safetensors file(s)"
    if init is not None:
        how += f", streamed from the files into {init.store.tier.value} partitions, each rank reading its own chunks"
        logger.info("model %s: %s", directory, how)
    return ModelSpec(model, tokenizer, f"{directory} ({how})", directory)


def build_partitioned(cfg: Config) -> ModelSpec:
    """Build the model under ``infinity.Init`` for stage 3: partitioned while it is built (a
    model directory is streamed from its files), each chunk checked against the room on its
    tier before it is stored (Note [Init preflight])."""
    import infinity

    t = cfg.train
    sizes = _fresh_param_sizes(t.model)  # on the meta device, outside Init (which would take them)
    with infinity.Init(config=cfg, enabled=cfg.zero.stage == 3) as init:
        if sizes is not None:
            _check_build_room(sizes, init if init.enabled else None, t.model)
        return build_model(t.model, t.seq_len, init if init.enabled else None, t.micro_batch_size)


def _fresh_param_sizes(spec_value) -> Optional[List[int]]:
    """The parameter sizes of a model built from scratch (a preset, a dict, a directory without
    weights), counted on the meta device; None when it is loaded from weights (the loader
    checks those before reading: Note [Init preflight] in _init_context.py) or cannot be built (the
    build reports why)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config

    try:
        if isinstance(spec_value, dict):
            fields = dict(spec_value)
            config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        elif spec_value in PRESETS:
            config = GPT2Config(**PRESETS[spec_value])
        elif any(f.endswith(".safetensors") for f in os.listdir(spec_value)):
            return None
        else:
            config = AutoConfig.from_pretrained(spec_value, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return [p.numel() for p in model.parameters()]
    except Exception:  # noqa: BLE001 - whatever it is, build_model names it
        return None


def _check_build_room(sizes: List[int], init, what) -> None:
    """Refuse a model whose build would not fit before a single parameter exists: under Init
    this rank's fp32 chunks against Init's room on its tier, else the whole fp32 model
    against the available host memory."""
    import psutil

    n = sum(sizes)
    label = f"train.model ({n:,} parameters, counted before building)"
    if init is not None:
        world = comm.world_size()
        init.store.check_room(sum(init.store.slot_bytes(-(-k // world), torch.float32) for k in sizes), label)
        return
    need, have = 4 * n, psutil.virtual_memory().available
    if need > have:
        raise InsufficientResourcesError(
            f"{label}: building it in fp32 needs {fmt_bytes(need)} of host memory, {fmt_bytes(have)} available; "
            f"use ZeRO stage 3 (zero.stage: 3), which builds each rank's part only, with "
            f"zero.offload_param.device: nvme, or a smaller model")


# ---------------------------------------------------------------------------------------------
# Disk probe


def probe_disk(path: str, aio_cfg, nbytes: int = PROBE_BYTES) -> Optional[Dict[str, float]]:
    """Median O_DIRECT write and read bandwidth (bytes/s) of ``path`` through infinity.aio."""
    from .aio import AsyncIO, aligned_empty

    os.makedirs(path, exist_ok=True)
    target = os.path.join(path, f"{PROBE_PREFIX}{os.getpid()}.bin")  # reclaimed if this run crashes
    buf = aligned_empty(nbytes, torch.uint8)
    buf.copy_(torch.arange(nbytes, dtype=torch.int64).to(torch.uint8))  # not all zeros
    writes, reads = [], []
    try:
        with AsyncIO(aio_cfg.block_size, aio_cfg.queue_depth, aio_cfg.threads, direct=aio_cfg.direct) as h:
            for _ in range(PROBE_REPS):
                t = time.perf_counter()
                h.pwrite(buf, target, 0)
                h.wait()
                writes.append(nbytes / (time.perf_counter() - t))
                t = time.perf_counter()
                h.pread(buf, target, 0)
                h.wait()
                reads.append(nbytes / (time.perf_counter() - t))
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(target)
    return {"write": sorted(writes)[len(writes) // 2], "read": sorted(reads)[len(reads) // 2]}


# ---------------------------------------------------------------------------------------------
# Training


@dataclass
class Run:
    cfg: Config
    spec: ModelSpec
    n_params: int
    batches: Batches
    model: Any = None
    optimizer: Any = None
    scheduler: Any = None
    disk: Optional[Dict[str, float]] = None
    stats: StepStats = field(default_factory=StepStats)
    telemetry: Optional[Telemetry] = None
    export: Any = None
    export_s: float = 0.0
    first_step: int = 1  # after a resume: the step after the checkpoint's
    checkpoints: Any = None  # _checkpoint._train.TrainCheckpoints
    ssd: Any = None  # _endurance.SsdLedger, with NVMe offload (Note [endurance budget])
    ssd_seen: Dict[str, int] = field(default_factory=dict)  # its counts at the end of the last step

    @property
    def rank0(self) -> bool:
        return comm.rank() == 0

    @property
    def tokens_per_step(self) -> int:
        return self.batches.global_batch * self.cfg.train.seq_len


def _loss(model, inputs, targets) -> torch.Tensor:
    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def _engine_counters(engine) -> Dict[str, float]:
    # The prefetcher's per-step counters, once the engine has them (Note [engine telemetry keys]).
    return flatten(engine.telemetry()) if hasattr(engine, "telemetry") else {}


def _disk_io() -> Dict[str, int]:
    """Bytes this process read from and wrote to storage (O_DIRECT and io_uring included)."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(": ") for line in f.read().splitlines() if ": " in line)
        return {"read": int(fields["read_bytes"]), "write": int(fields["write_bytes"])}
    except (OSError, KeyError, ValueError):  # not Linux, or a kernel without task I/O accounting
        return {"read": 0, "write": 0}


def _comm_bytes() -> int:
    return sum(comm.counters.snapshot()["bytes"].values())


def train_step(run: Run, step: int) -> dict:
    model, opt = run.model, run.optimizer
    times = {"forward_s": 0.0, "backward_s": 0.0, "optimizer_s": 0.0}
    comm_before, disk_before = _comm_bytes(), _disk_io()
    t_step = time.perf_counter()
    losses = []
    dev = acc.device()
    for inputs, targets in run.batches.step(step - 1):
        inputs, targets = inputs.to(dev), targets.to(dev)
        t = time.perf_counter()
        loss = _loss(model, inputs, targets)
        opt.note_loss(loss)  # checked with the gradients in step(): Note [non-finite steps] in _zero_optimizer.py
        acc.synchronize()  # the device's work, not only its launch, inside the phase's time
        times["forward_s"] += time.perf_counter() - t
        t = time.perf_counter()
        loss.backward()
        acc.synchronize()
        times["backward_s"] += time.perf_counter() - t
        losses.append(loss.detach().float())
    t = time.perf_counter()
    lr = opt.param_groups[0]["lr"]
    opt.step()
    opt.zero_grad()
    run.scheduler.step()
    acc.synchronize()
    times["optimizer_s"] = time.perf_counter() - t
    mean_loss = torch.stack(losses).mean().reshape(1)
    comm.all_reduce(mean_loss, "sum", what="loss report")
    step_s = time.perf_counter() - t_step
    engine = _engine_counters(opt.engine)
    record = {"event": "step", "step": step, "loss": mean_loss.item() / comm.world_size(), "lr": lr,
              "grad_norm": opt.last_grad_norm, "skipped": bool(opt.skipped), "tokens": run.tokens_per_step,
              "step_s": step_s, **times, "stall_s": stall_seconds(engine),
              "tokens_per_s": run.tokens_per_step / step_s, "comm_bytes": _comm_bytes() - comm_before,
              "rss_bytes": _rss_now()}
    disk = _disk_io()
    record["disk_read_bytes"] = disk["read"] - disk_before["read"]
    record["disk_write_bytes"] = disk["write"] - disk_before["write"]
    record.update({f"engine.{k}": v for k, v in engine.items()})
    tiers = tier_traffic(engine)
    if "nvme" not in tiers and nvme_paths(run.cfg):  # measured by the kernel for this process
        r, w = record["disk_read_bytes"], record["disk_write_bytes"]
        tiers["nvme"] = {"read": float(r), "write": float(w), "total": float(r + w)}
    record["_tiers"] = tiers
    for tier, entry in tiers.items():
        record[f"tier.{tier}.read_bytes"] = entry["read"]
        record[f"tier.{tier}.write_bytes"] = entry["write"]
    return record


def _rss_now() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _postfix(record: dict) -> Dict[str, str]:
    out = {"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tokens_per_s']:.0f}"}
    for tier, entry in record["_tiers"].items():
        out[tier] = fmt_rate(entry["total"] / record["step_s"])
    out["net"] = fmt_rate(record["comm_bytes"] / record["step_s"])
    return out


def _count_ssd(run: Run, step: int, record: dict) -> None:
    """The bytes this step wrote to the SSDs; after the first, the run's projection against
    the endurance budget (Note [endurance budget] in _endurance.py)."""
    if run.ssd is None:
        return
    written = run.ssd.written()
    this_step = {p: n - run.ssd_seen.get(p, 0) for p, n in written.items()}
    record["ssd_written_bytes"] = float(sum(this_step.values()))
    if step == run.first_step and run.rank0:
        from ._apps._endurance import budget_warning

        warning = budget_warning(run.cfg.aio, this_step, run.cfg.train.steps - run.first_step + 1)
        if warning:
            logger.warning(warning)
    run.ssd_seen = written


def train_loop(run: Run) -> None:
    from tqdm import tqdm

    cfg = run.cfg.train
    bar = tqdm(total=cfg.steps, initial=run.first_step - 1, disable=not run.rank0, desc="train", unit="step",
               dynamic_ncols=True, file=sys.stderr, mininterval=0.5)
    try:
        for step in range(run.first_step, cfg.steps + 1):
            record = train_step(run, step)
            _count_ssd(run, step, record)
            run.stats.add(record)
            if run.rank0:
                run.telemetry.step({k: v for k, v in record.items() if not k.startswith("_")})
                bar.set_postfix(_postfix(record), refresh=False)
                bar.update(1)
                if step % cfg.log_every == 0 or step == cfg.steps:
                    bar.write(f"step {step:>5}/{cfg.steps}  loss {record['loss']:.4f}  "
                              f"lr {record['lr']:.2e}  {record['tokens_per_s']:.0f} tokens/s")
            if run.checkpoints is not None and run.checkpoints.after_step(run, step, cfg.steps):
                break  # a signal asked to stop: saved (Note [preemption] in _checkpoint/_train.py)
    finally:
        bar.close()


def setup(cfg: Config) -> Run:
    comm.configure(cfg)  # Note [comm timeout] in _comm.py: before the process group is made
    comm.ensure_initialized()
    torch.manual_seed(cfg.seed)
    t = cfg.train
    texts = read_texts(t.data) if t.data else [builtin_corpus()]  # bad data fails before the model is built
    spec = build_partitioned(cfg)
    if hasattr(spec.model.config, "use_cache"):
        spec.model.config.use_cache = False
    spec.model.train()
    windows = token_windows(texts, spec.tokenizer, t.seq_len)
    batches = Batches(windows, t.micro_batch_size, cfg.gradient_accumulation_steps, comm.world_size(),
                      comm.rank(), cfg.seed)
    n_params = sum(p.numel() for p in spec.model.parameters())
    return Run(cfg, spec, n_params, batches)


def start(run: Run) -> None:
    import infinity

    cfg = run.cfg
    run.model, run.optimizer = infinity.initialize(run.spec.model, config=cfg)
    run.scheduler = make_scheduler(run.optimizer, cfg, cfg.train.steps, cfg.train.lr_warmup_steps)
    paths = nvme_paths(cfg)
    if paths:
        from ._apps._endurance import SsdLedger

        run.ssd = SsdLedger(run.optimizer.engine, paths)
        run.ssd_seen = run.ssd.written()  # what initialize wrote is not a step's
    if run.rank0 and paths:
        # The probe file lives in this run's directory: removed with it, reclaimed with it after a crash.
        where = run.optimizer.engine.swap_dirs.under(paths[0]).path
        free = shutil.disk_usage(where).free
        if free < 2 * PROBE_BYTES:  # a measurement must not fill the disk (the preflight did not count it)
            logger.warning("disk bandwidth probe of %s skipped: it writes %s and only %s is free", paths[0],
                           fmt_bytes(PROBE_BYTES), fmt_bytes(free))
        else:
            try:
                run.disk = probe_disk(where, cfg.aio)
            except Exception as err:  # a failed probe must not stop the training it only annotates
                logger.warning("disk bandwidth probe of %s failed: %s", paths[0], err)
    out = cfg.train.output_dir
    path = cfg.telemetry.path or (os.path.join(out, "telemetry.jsonl") if out else None)
    tb_dir = os.path.join(os.path.dirname(os.path.abspath(path)), "tensorboard") if path else None
    run.telemetry = Telemetry(path if run.rank0 else None, cfg.telemetry.every, tb_dir if run.rank0 else None)
    run.telemetry.event({"event": "start", "time": time.time(), "world_size": comm.world_size(),
                         "model": run.spec.description, "parameters": run.n_params,
                         "tokens_per_step": run.tokens_per_step, "disk_probe": run.disk,
                         "config": cfg.to_dict()})


def save(run: Run) -> None:
    from ._checkpoint._safetensors_export import export_safetensors

    out = run.cfg.train.output_dir
    if not (run.cfg.train.save and out):
        return
    t = time.perf_counter()
    directory = os.path.join(out, "model")
    run.export = export_safetensors(run.model, directory)
    if run.rank0 and run.spec.source_dir and has_tokenizer_files(run.spec.source_dir):
        run.spec.tokenizer.tok.save_pretrained(directory)
    run.export_s = time.perf_counter() - t


# ---------------------------------------------------------------------------------------------
# Summary


def _state_rows(per_rank: List[dict]) -> List[tuple]:
    """Bytes each tier holds for model states, staging pools included, summed over ranks."""
    rows = [("bytes per tier", "device", "cpu", "nvme")]
    totals = {t: sum(r["tiers"].get(t, 0) for r in per_rank) for t in ("device", "host", "nvme")}
    rows.append(("  model states, all ranks", *(fmt_bytes(totals[t]) for t in ("device", "host", "nvme"))))
    return rows


def _time_rows(stats: StepStats) -> List[tuple]:
    recs = stats.measured()
    step = mean(r["step_s"] for r in recs) or 1e-12
    rows = [("step time (mean)", "s/step", "share")]
    parts = [("forward", "forward_s"), ("backward", "backward_s"), ("optimizer", "optimizer_s")]
    accounted = 0.0
    for label, key in parts:
        value = mean(r[key] for r in recs)
        accounted += value
        rows.append((f"  {label}", f"{value:.4f}", f"{100 * value / step:.0f}%"))
    stall = mean(r["stall_s"] for r in recs)
    rows.append(("  other (data, logging)", f"{step - accounted:.4f}", f"{100 * (step - accounted) / step:.0f}%"))
    rows.append(("  stall (inside the above)", f"{stall:.4f}", f"{100 * stall / step:.0f}%"))
    rows.append(("  total", f"{step:.4f}", "100%"))
    return rows


def _disk_rows(run: Run, per_rank: List[dict]) -> List[tuple]:
    elapsed = sum(r["step_s"] for r in run.stats.records) or 1e-12
    rows = [("disk bandwidth (nvme)", "achieved", "measured")]
    for direction in ("read", "write"):
        moved = sum(r["nvme"].get(direction, 0.0) for r in per_rank)
        achieved = fmt_rate(moved / elapsed) if moved else "no traffic"
        measured = fmt_rate(run.disk[direction]) if run.disk else "not probed"
        rows.append((f"  {direction}", achieved, measured))
    moved = sum(r["nvme"].get("total", 0.0) for r in per_rank)
    rows.append(("  moved in training", f"{fmt_bytes(moved)} ({fmt_bytes(moved / max(1, len(run.stats.records)))} per step)"))
    steps = max(1, len(run.stats.records))
    tbw = run.cfg.aio.endurance_tbw
    for path in sorted({p for r in per_rank for p in r.get("ssd", {})}):
        written = sum(r["ssd"].get(path, 0) for r in per_rank)
        share = f", {100 * written / (tbw * 1e12):.2g}% of aio.endurance_tbw" if tbw else ""
        rows.append((f"  SSD writes to {path}", f"{fmt_bytes(written)} this run, initialize and checkpoints "
                                                f"included ({fmt_bytes(written / steps)} per step{share})"))
    return rows


def summary_text(run: Run, per_rank: List[dict]) -> str:
    cfg, stats = run.cfg, run.stats
    losses = stats.column("loss")
    tail = losses[-max(1, len(losses) // 10):]
    comm_step = mean(r["comm_bytes"] for r in stats.measured())
    head = [
        ("model", run.spec.description),
        ("parameters", f"{fmt_count(run.n_params)} ({run.n_params:,})"),
        ("run", f"{len(losses)} steps, {comm.world_size()} rank(s), ZeRO stage {cfg.zero.stage}, "
                f"{cfg.precision.dtype}, offload param={cfg.zero.offload_param.device} "
                f"optimizer={cfg.zero.offload_optimizer.device}"),
        ("batch", f"{run.batches.global_batch} x {cfg.train.seq_len} tokens per step"),
        ("loss", f"{losses[0]:.4f} -> {losses[-1]:.4f} (mean of last {len(tail)}: {mean(tail):.4f})"),
        ("throughput", f"{stats.median('tokens_per_s'):.0f} tokens/s (median step {stats.median('step_s'):.3f} s)"),
        ("communication", f"{fmt_bytes(comm_step)} per step"),
    ]
    skipped = sum(1 for r in stats.records if r.get("skipped"))
    if skipped:
        why = "fp16 overflow" if cfg.precision.dtype == "fp16" else "inf/NaN loss or gradients"
        head.append(("skipped steps", f"{skipped} of {len(losses)} ({why}; parameters left unchanged)"))
    rss = [r["peak_rss"] for r in per_rank]
    memory = _state_rows(per_rank) + [
        ("peak RSS", f"{fmt_bytes(max(rss))} (max of {len(rss)} rank(s); rank 0 {fmt_bytes(rss[0])})"),
        ("engine device peak", fmt_bytes(max(r["device_peak"] for r in per_rank))),
    ] + ([("device allocator peak", f"{fmt_bytes(max(r['allocator_peak'] for r in per_rank))} (all of the device's "
                                     f"memory the run used, activations included)")]
         if acc.has_accelerator() else [])
    sections = [head, memory, _time_rows(stats), _disk_rows(run, per_rank)]
    engine_keys = sorted({k for r in stats.records for k in r if k.startswith("engine.")})
    if engine_keys:
        sections.append([("engine telemetry", "mean/step", "total")] +
                        [(f"  {k[7:]}", f"{mean(stats.column(k)):.4g}", f"{sum(stats.column(k)):.4g}")
                         for k in engine_keys])
    sections.append([("saved", _saved_text(run)), ("telemetry", run.telemetry.path or "off (no output_dir)")])
    return render_table("infinity.train summary", sections)


def _saved_text(run: Run) -> str:
    if run.export is None:
        return "not saved (--no-save or no output_dir)"
    return (f"{run.export.directory} ({len(run.export.files)} safetensors file(s), "
            f"{fmt_bytes(run.export.total_bytes)}, {run.export_s:.1f} s)")


def finish(run: Run) -> Optional[str]:
    engine = run.optimizer.engine
    mine = {"peak_rss": _peak_rss(), "tiers": engine.tier_bytes(),
            "device_peak": engine.device_budget.stats().peak, "allocator_peak": acc.max_memory_allocated(),
            "nvme": run.stats.tier_totals().get("nvme", {}), "ssd": run.ssd.written() if run.ssd is not None else {}}
    per_rank = comm.all_gather_object(mine)
    if not run.rank0:
        return None
    text = summary_text(run, per_rank)
    run.telemetry.event({"event": "summary", "peak_rss_per_rank": [r["peak_rss"] for r in per_rank],
                         "disk_probe": run.disk, "tier_totals": run.stats.tier_totals(),
                         "ssd_written_bytes": {p: sum(r["ssd"].get(p, 0) for r in per_rank)
                                               for p in sorted({p for r in per_rank for p in r["ssd"]})},
                         "skipped_steps": sum(1 for r in run.stats.records if r.get("skipped")),
                         "export": run.export.__dict__ if run.export else None})
    return text


# ---------------------------------------------------------------------------------------------
# Entry point


def run_job(cfg: Config, checkpoints=None) -> Optional[str]:
    """Train as ``cfg`` says, resuming and saving checkpoints as ``checkpoints`` says; return
    the summary text on rank 0 (None elsewhere)."""
    run = setup(cfg)
    run.checkpoints = checkpoints
    try:
        start(run)
        if checkpoints is not None:
            run.first_step = checkpoints.resume_into(run)
            with checkpoints.on_signals():
                train_loop(run)
            checkpoints.wait(run)  # the last asynchronous save is committed (or its error raised)
        else:
            train_loop(run)
        if checkpoints is None or checkpoints.stopped_by is None:
            save(run)
        return finish(run)
    finally:
        if run.telemetry is not None:
            run.telemetry.close()
        if run.optimizer is not None:
            run.optimizer.engine.close()  # hooks off, this run's swap files removed


def _exit_on_sigterm(signum, frame):
    # torchrun and job schedulers stop workers with SIGTERM: unwind so the swap files go too.
    raise SystemExit(128 + signum)


def main(argv: Optional[List[str]] = None) -> int:
    t0 = time.perf_counter()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    finished = False
    try:
        args = parse_args(argv)
        cfg = resolve_config(args)
        from ._checkpoint._train import TrainCheckpoints

        checkpoints = TrainCheckpoints.from_args(args.save_every, args.resume, args.keep_last, cfg.train.output_dir,
                                                  save_async=args.save_async)
        text = run_job(cfg, checkpoints)
        finished = True
    except (UsageError, InsufficientResourcesError) as err:  # TrainError, DataError, ConfigError among them
        print(f"infinity.train: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except NonFiniteError as err:  # precision.on_nonfinite: error; not bad input, but no traceback either
        print(f"infinity.train: error: {err}", file=sys.stderr)
        return 1
    finally:
        if comm.is_distributed():
            if finished:
                comm.barrier()  # no rank tears its sockets down while another still talks
            torch.distributed.destroy_process_group()
    if text is not None:
        print(text)
        print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
