"""The training loop of ``python -m infinity.train``: the run's state (``Run``), its setup
(data, model, ``infinity.initialize``, the scheduler, the SSD ledger, the disk probe, the
telemetry), one step with its measurements, the loop with its progress bar, and the
save of the fine-tuned weights."""
from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import psutil
import torch
import torch.nn.functional as F
from tqdm import tqdm

from .._checkpoint._safetensors_export import export_safetensors
from .._runtime import _accelerator as acc
from .._runtime import _comm as comm
from .._runtime._log import logger
from .._runtime._schedule import make_scheduler
from .._runtime._telemetry import StepStats, Telemetry, flatten, fmt_bytes, fmt_rate, stall_seconds, tier_traffic
from .._zero._initialize import initialize
from ..config import Config
from ._disk_probe import PROBE_BYTES, probe_disk
from ._endurance import SsdLedger, budget_warning, sharing
from ._train_cli import nvme_paths
from ._train_data import Batches, builtin_corpus, has_tokenizer_files, read_texts, token_windows
from ._train_model import ModelSpec, build_partitioned


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
    step: int = 0  # the step in flight (the last one begun)
    checkpoints: Any = None  # _checkpoint._train.TrainCheckpoints
    ssd: Any = None  # _endurance.SsdLedger, with NVMe offload (Note [endurance budget] in _endurance.py)
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
    engine = flatten(opt.engine.telemetry())  # Note [engine telemetry keys] in _telemetry.py
    record = {"event": "step", "step": step, "loss": mean_loss.item() / comm.world_size(), "lr": lr,
              "grad_norm": opt.last_grad_norm, "skipped": bool(opt.skipped), "tokens": run.tokens_per_step,
              "step_s": step_s, **times, "stall_s": stall_seconds(engine),
              "tokens_per_s": run.tokens_per_step / step_s, "comm_bytes": _comm_bytes() - comm_before,
              "rss_bytes": _rss_now()}
    disk = _disk_io()
    record["disk_read_bytes"] = disk["read"] - disk_before["read"]
    record["disk_write_bytes"] = disk["write"] - disk_before["write"]
    record.update({f"engine.{k}": v for k, v in engine.items()})
    for key in [k for k in engine if k.startswith("drive") and k.endswith("_bytes")]:  # Note [many drives] in _drives.py
        record[f"{key[:-len('_bytes')]}_gb_per_s"] = engine[key] / step_s / 1e9  # drive<k>_read_gb_per_s, ...
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
    return psutil.Process().memory_info().rss


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
        warning = budget_warning(run.cfg.aio, this_step, run.cfg.train.steps - run.first_step + 1, sharing(run.cfg))
        if warning:
            logger.warning(warning)
    run.ssd_seen = written


def train_loop(run: Run) -> None:
    cfg = run.cfg.train
    bar = tqdm(total=cfg.steps, initial=run.first_step - 1, disable=not run.rank0, desc="train", unit="step",
               dynamic_ncols=True, file=sys.stderr, mininterval=0.5)
    try:
        for step in range(run.first_step, cfg.steps + 1):
            run.step = step
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
    cfg = run.cfg
    run.model, run.optimizer = initialize(run.spec.model, config=cfg)
    run.scheduler = make_scheduler(run.optimizer, cfg, cfg.train.steps, cfg.train.lr_warmup_steps)
    paths = nvme_paths(cfg)
    if paths:
        run.ssd = SsdLedger(run.optimizer.engine, paths)
        run.ssd_seen = run.ssd.written()  # what initialize wrote is not a step's
    mine = list(run.optimizer.engine.swap_dirs.values())
    if run.rank0 and mine:
        # The probe file lives in this run's directory on a drive this rank writes to (Note [many drives] in
        # _drives.py): removed with it, reclaimed with it after a crash.
        where = mine[0].path
        free = shutil.disk_usage(where).free
        if free < 2 * PROBE_BYTES:  # a measurement must not fill the disk (the preflight did not count it)
            logger.warning("disk bandwidth probe of %s skipped: it writes %s and only %s is free", where,
                           fmt_bytes(PROBE_BYTES), fmt_bytes(free))
        else:
            try:
                run.disk = probe_disk(where, cfg.aio)
            except Exception as err:  # a failed probe must not stop the training it only annotates
                logger.warning("disk bandwidth probe of %s failed: %s", where, err)
    out = cfg.train.output_dir
    path = cfg.telemetry.path or (os.path.join(out, "telemetry.jsonl") if out else None)
    tb_dir = os.path.join(os.path.dirname(os.path.abspath(path)), "tensorboard") if path else None
    run.telemetry = Telemetry(path if run.rank0 else None, cfg.telemetry.every, tb_dir if run.rank0 else None)
    run.telemetry.event({"event": "start", "time": time.time(), "world_size": comm.world_size(),
                         "model": run.spec.description, "parameters": run.n_params,
                         "tokens_per_step": run.tokens_per_step, "disk_probe": run.disk,
                         "config": cfg.to_dict()})
    if run.rank0:
        print(outputs_line(run), file=sys.stderr, flush=True)


def outputs_line(run: Run) -> str:
    """Where this run writes, said once at its start: swap files, telemetry, weights, checkpoints."""
    out = run.cfg.train.output_dir
    parts = [f"swap files in {d} (removed at exit)"
             for d in sorted({os.path.dirname(s.path) for s in run.optimizer.engine.swap_dirs.values()})]
    if run.telemetry.path:
        parts.append(f"telemetry to {run.telemetry.path}" + (" and tensorboard/ beside it" if run.telemetry.tb else ""))
    if run.cfg.train.save and out:
        parts.append(f"weights to {os.path.join(out, 'model')}")
    if run.checkpoints is not None and run.checkpoints.save_every:
        parts.append(f"checkpoints to {run.checkpoints.directory}")
    return "infinity.train writes " + ("; ".join(parts) if parts else "nothing to disk")


def save(run: Run) -> None:
    out = run.cfg.train.output_dir
    if not (run.cfg.train.save and out):
        return
    t = time.perf_counter()
    directory = os.path.join(out, "model")
    run.export = export_safetensors(run.model, directory)
    if run.rank0 and run.spec.source_dir and has_tokenizer_files(run.spec.source_dir):
        run.spec.tokenizer.tok.save_pretrained(directory)
    run.export_s = time.perf_counter() - t
