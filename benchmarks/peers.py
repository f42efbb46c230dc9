"""The head-to-head on one GPU: infinity beside plain PyTorch, DeepSpeed and FSDP2.

Every contender trains the same GPT-2 (``_models.gpt2``, the same weights) on the same random
batches (8 x 1024 tokens by default) the same way (``_trainers``: bf16 compute with fp32 master
weights, AdamW lr 1e-4 and weight decay 0.01, clipping at ``--clip``, 1.0 by default, which each record's
``extra`` names), each in a process of its own (``_harness``), at each size of ``--sizes`` (124m: 12 x 768;
1.5b: GPT-2 XL, 48 x 1600):

  plain                   the whole model on the GPU, torch's fused AdamW on fp32 masters
  infinity-none           infinity ZeRO-3, nothing offloaded
  infinity-cpu            infinity ZeRO-3, offload_param and offload_optimizer on cpu
  infinity-nvme           the same on NVMe (a temporary folder under --nvme-path)
  deepspeed-cpu           DeepSpeed ZeRO-3, offload_param and offload_optimizer on cpu
  deepspeed-nvme          DeepSpeed ZeRO-Infinity, both on NVMe (its defaults otherwise: max_in_cpu keeps
                          up to 1e9 parameter elements in host memory, so a 124M model's parameters never
                          leave it)
  deepspeed-nvme-swapped  the same with max_in_cpu 0: parameters really swapped (DeepSpeed 0.19.8 on the
                          CPU accelerator fails it: "Not enough buffers 0 for swapping 1" in its parameter
                          swapper, or bf16 buffers for an fp32 model, its Init._set_dtype turning the fp32
                          it is given into bf16 where the accelerator lacks fp16)
  fsdp2-cpu               torch FSDP2, fully_shard with CPUOffloadPolicy, one rank

One JSON record per contender and size (the schema in ``_harness``): the median step time over
``--steps`` steps after ``--warmup`` warm-ups (each timed between device synchronizes; the last
waits for infinity's overlapped update), its min and max, TFLOP/s, GPU and host peaks over the
training steps, first and last loss, the error if any; ``extra`` holds the set-up's time and
peaks and the disk bytes per step (``/proc/self/io``). Then ratio lines: every contender against
plain, and infinity and FSDP2 against DeepSpeed at the same placement. Without CUDA the default
dtype is fp32, DeepSpeed runs only with ``DS_ACCELERATOR=cpu`` and FSDP2 is skipped; a contender
that cannot run here (DeepSpeed not installed, no GPU) is recorded as skipped with the reason.
``--deepspeed-venv DIR`` runs the DeepSpeed cells in a virtual environment of their own
(``--system-site-packages``, so this torch), installing DeepSpeed there on first use (with
DS_BUILD_OPS=0: its ops build just in time, async_io against libaio-dev, installed as root where
missing), never into this environment. On a CPU, for the head-to-head against DeepSpeed that the
development machines ran::

    DS_ACCELERATOR=cpu python -m benchmarks.peers --sizes 124m --dtype fp32 --micro-batch 4 --seq-len 256 \
        --threads 2 --rounds 2 --steps 2 --warmup 1 --deepspeed-venv ~/.cache/infinity/deepspeed-0.19.8 \
        --only plain,deepspeed-cpu,infinity-cpu,deepspeed-nvme,infinity-nvme,deepspeed-nvme-swapped

    python -m benchmarks.peers [--sizes 124m,1.5b] [--only plain,infinity-cpu,fsdp2-cpu@1.5b]
                               [--steps 4 --warmup 2 --rounds 1] [--budget S] [--out FILE]
    python -m benchmarks.peers --smoke      # tiny GPT-2, 2 steps after 1, fp32: seconds on a CPU

``--only`` entries may carry a size (``infinity-nvme@124m``): that contender runs at that size only.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from typing import List, Optional

from . import _flags, _harness, _models, _trainers
from ._harness import Cell

BENCH = "peers"
CONTENDERS = ("plain", "infinity-none", "infinity-cpu", "infinity-cpu-speculative", "infinity-cpu-serial",
              "infinity-nvme", "deepspeed-cpu", "deepspeed-nvme", "deepspeed-nvme-swapped", "fsdp2-cpu")
# infinity-cpu-speculative: every state in host memory with the speculative update on (Note [speculative update] in
# infinity/_zero/_speculative_update.py); infinity-cpu-serial: with it off, as infinity-cpu is now by default (on
# 2026-12-04 the default speculated and this cell was the one without)
VS_DEEPSPEED = (("infinity-cpu-speculative", "infinity-cpu"), ("infinity-cpu", "infinity-cpu-serial"),
                ("infinity-cpu", "deepspeed-cpu"), ("infinity-nvme", "deepspeed-nvme"),
                ("infinity-nvme", "deepspeed-nvme-swapped"), ("fsdp2-cpu", "deepspeed-cpu"))
PAIRS = tuple((name, "plain") for name in CONTENDERS if name != "plain") + VS_DEEPSPEED  # every ratio it records
DEEPSPEED = "0.19.8"  # what --deepspeed-venv installs: works with torch 2.13's CPU build
GB = 1e9


# ------------------------------------------------------------------ a contender's process


def make_trainer(spec: dict, model):
    """(trainer, the device its batches go to) for the spec's contender."""
    import torch

    kind, dtype = spec["contender"], spec["dtype"]
    cuda = torch.cuda.is_available()
    if kind == "plain":
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        return _trainers.PlainTrainer(model, device, dtype), device
    tier = kind.split("-")[1]
    if kind.startswith("infinity-"):
        import infinity

        speculate = {"-serial": "off", "-speculative": "on"}.get(kind[len(f"infinity-{tier}"):])
        more = {"zero": {"offload_optimizer": {"speculate": speculate}}} if speculate else {}
        cfg = _trainers.infinity_config(tier, dtype, spec["scratch"], **more)
        return _trainers.InfinityTrainer(model, cfg), infinity.device()
    if kind.startswith("deepspeed-"):
        cfg = _trainers.deepspeed_config(tier, dtype, spec["micro_batch"], spec["scratch"], pin=cuda)
        if kind == "deepspeed-nvme-swapped":
            cfg["zero_optimization"]["offload_param"]["max_in_cpu"] = 0
        trainer = _trainers.DeepSpeedTrainer(model, cfg, backend="nccl" if cuda else "gloo")
        return trainer, trainer.engine.device
    return _trainers.Fsdp2Trainer(model, dtype), torch.device("cuda", 0)


def disk_bytes() -> dict:
    """This process's block I/O so far (O_DIRECT included), from /proc/self/io."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(": ") for line in f.read().splitlines())
        return {"read": int(fields["read_bytes"]), "write": int(fields["write_bytes"])}
    except (OSError, KeyError, ValueError):
        return {"read": 0, "write": 0}


def nvme_traffic(telemetry: dict) -> dict:
    """The engine's NVMe bytes read and written, from its telemetry's ``nvme_*_bytes`` counters."""
    out = {"read": 0, "write": 0}
    for key, value in telemetry.items():
        if key.startswith("nvme_") and key.endswith("_bytes") and isinstance(value, (int, float)):
            out["read" if "_read_" in key else "write"] += value
    return out


def measure(spec: dict) -> dict:
    """The child: build, set up, train; the sample the harness summarizes."""
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    _trainers.set_clip(spec.get("clip", _trainers.CLIP))
    start = time.perf_counter()
    model = _models.gpt2(spec["size"], seed=0)
    params = _models.param_count(model)
    trainer, device = make_trainer(spec, model)
    del model
    count = spec["warmup"] + spec["steps"]
    batches = [b.to(device) for b in _models.batches(spec["size"], spec["micro_batch"], spec["seq_len"], count)]
    setup_peaks = _harness.peaks()
    extra = {"clip": _trainers.CLIP, "setup_s": round(time.perf_counter() - start, 2),
             "gpu_setup_peak_gib": _harness.gib(setup_peaks["gpu"]),
             "host_setup_peak_gib": _harness.gib(setup_peaks["host"]),
             "host_peak_since": "setup" if _harness.reset_peaks() else "start"}
    telemetry = trainer.telemetry if isinstance(trainer, _trainers.InfinityTrainer) else None
    disk = {}

    def at_timed() -> None:  # counters start at the first timed step
        disk.update(disk_bytes())
        if telemetry is not None:
            telemetry()

    steps = _harness.timed_steps(trainer, batches, spec["warmup"], spec["steps"], at_timed=at_timed)
    after, peaks = disk_bytes(), _harness.peaks()
    n, seconds = len(steps["times"]), sum(steps["times"])
    extra.update(disk_read_gb_per_step=round((after["read"] - disk["read"]) / n / GB, 3),
                 disk_write_gb_per_step=round((after["write"] - disk["write"]) / n / GB, 3))
    if telemetry is not None and spec["contender"].endswith("-nvme"):
        moved = nvme_traffic(telemetry())
        extra.update(nvme_read_gb_per_step=round(moved["read"] / n / GB, 3),
                     nvme_write_gb_per_step=round(moved["write"] / n / GB, 3),
                     nvme_gbps=round((moved["read"] + moved["write"]) / seconds / GB, 3))
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    sample = {**steps, "params": params, "tokens_per_step": spec["micro_batch"] * spec["seq_len"],
              "device": f"{device.type}: {name}", "dtype": spec["dtype"], "gpu_peak": peaks["gpu"],
              "host_peak": peaks["host"], "extra": extra}
    try:
        trainer.close()
    except Exception as e:  # the figures are taken; a failed close is reported beside them
        extra["close_error"] = f"{type(e).__name__}: {e}"[:300]
    return sample


# ------------------------------------------------------------------ the parent


def wait_for_ops(cell: Cell, deadline: float, args) -> None:
    """Before a DeepSpeed cell: wait for ``--deepspeed-ops-ready`` (gpu_check builds DeepSpeed's
    JIT ops in the background while the first cells run), until the budget's deadline."""
    ready = args.deepspeed_ops_ready
    if not ready or not cell.contender.startswith("deepspeed-") or os.path.exists(ready):
        return
    start = time.time()
    while not os.path.exists(ready) and time.time() < deadline - _harness.MIN_CELL_SECONDS:
        time.sleep(1.0)
    print(f"[{BENCH}] waited {time.time() - start:.0f} s for {ready}", file=sys.stderr, flush=True)


def skip_reason(contender: str, cuda: bool, venv: Optional[str] = None) -> Optional[str]:
    if contender.startswith("deepspeed-"):
        if venv is None and importlib.util.find_spec("deepspeed") is None:
            return "DeepSpeed is not installed (--deepspeed-venv DIR installs it there)"
        if not cuda and os.environ.get("DS_ACCELERATOR") != "cpu":
            return "no CUDA (DS_ACCELERATOR=cpu runs DeepSpeed on the CPU)"
    if contender == "fsdp2-cpu" and not cuda:
        return "no CUDA: FSDP2's CPUOffloadPolicy offloads from a GPU"
    return None


def plan(only: List[str], sizes: List[str], smoke: bool, cuda: bool, venv: Optional[str] = None) -> List[Cell]:
    """The cells in run order: by size, then in --only's order; ``name@size`` at that size only."""
    cells: List[Cell] = []
    for size in sizes:
        for entry in only:
            name, _, at = entry.partition("@")
            if name not in CONTENDERS:
                raise SystemExit(f"--only: unknown contender {name!r}; choose from {', '.join(CONTENDERS)}")
            if (not at or at == size or smoke) and all(c.contender != name or c.size != size for c in cells):
                cells.append(Cell(name, size, skip_reason(name, cuda, venv)))
    return cells


def ensure_deepspeed(venv: str) -> str:
    """``venv``'s python, DeepSpeed installed there (once); libaio-dev installed as root where
    missing (DeepSpeed's async_io op, its NVMe contenders, builds against it)."""
    if not os.path.exists("/usr/include/libaio.h") and os.geteuid() == 0 and shutil.which("apt-get"):
        print("installing libaio-dev (DeepSpeed's async_io op builds against it)", file=sys.stderr, flush=True)
        subprocess.run(["apt-get", "update", "-qq"], check=False, capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "libaio-dev"], check=False, capture_output=True,
                       env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    python = os.path.join(venv, "bin", "python")
    probe = [python, "-c", f"import deepspeed, sys; sys.exit(deepspeed.__version__ != {DEEPSPEED!r})"]
    if os.path.exists(python) and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"installing DeepSpeed {DEEPSPEED} into {venv} (first use)", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", f"deepspeed=={DEEPSPEED}"], check=True,
                   env=dict(os.environ, DS_BUILD_OPS="0"))
    return python


def decimals(key: str, digits: int):
    """A table column: the record's ``key`` to ``digits`` decimals."""
    return lambda r: "-" if r[key] is None else f"{r[key]:.{digits}f}"


COLUMNS = _harness.COLUMNS + (("TFLOP/s", decimals("tflops", 1)), ("GPU GiB", decimals("gpu_peak_gib", 2)),
                              ("host GiB", decimals("host_peak_gib", 2)), ("loss first", decimals("first_loss", 4)),
                              ("last", decimals("last_loss", 4)))


def main() -> None:
    p = _flags.parser(__doc__, steps=4, warmup=2, seq_len=1024, micro_batch=8, only=",".join(CONTENDERS),
                      budget=3600.0, timeout=900.0)
    p.add_argument("--sizes", default="124m,1.5b", help=f"model sizes, of {', '.join(_models.SHAPES)}")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="auto: bf16 with CUDA (not in --smoke), else fp32")
    p.add_argument("--deepspeed-ops-ready", metavar="FILE",
                   help="before a DeepSpeed contender, wait until FILE exists (DeepSpeed's ops built elsewhere)")
    p.add_argument("--deepspeed-venv", metavar="DIR",
                   help="run the DeepSpeed contenders in this virtual environment, DeepSpeed installed there first")
    p.add_argument("--threads", type=int, default=0, help="torch threads in each contender (0: torch's default)")
    p.add_argument("--clip", type=float, default=_trainers.CLIP,
                   help="every contender clips the gradient norm at this (0: none; the speculative update's guess "
                        "holds only where a step does not clip)")
    args = _harness.parse(p, measure)
    import torch

    cuda = torch.cuda.is_available()
    sizes = _flags.parse_list(args.sizes)
    if args.smoke:
        sizes, args.steps, args.warmup, args.micro_batch, args.seq_len = ["tiny"], 2, 1, 2, 32
    for size in sizes:
        _models.shape_of(size)
    dtype = args.dtype if args.dtype != "auto" else "bf16" if cuda and not args.smoke else "fp32"
    cells = plan(_flags.parse_list(args.only), sizes, args.smoke, cuda, args.deepspeed_venv)
    spec = {"dtype": dtype, "steps": args.steps, "warmup": args.warmup, "micro_batch": args.micro_batch,
            "seq_len": args.seq_len, "threads": args.threads, "clip": args.clip}
    deepspeed_python = sys.executable
    if args.deepspeed_venv and any(c.contender.startswith("deepspeed-") and c.skip is None for c in cells):
        deepspeed_python = ensure_deepspeed(os.path.expanduser(args.deepspeed_venv))
    records = _harness.run_cells(BENCH, "benchmarks.peers", cells,
                                 lambda cell, scratch: dict(spec, contender=cell.contender, size=cell.size, scratch=scratch),
                                 args, dtype=dtype, prepare=lambda cell, deadline: wait_for_ops(cell, deadline, args),
                                 python_of=lambda cell: deepspeed_python if cell.contender.startswith("deepspeed-")
                                 else sys.executable)
    sys.exit(_harness.finish(BENCH, records, args, PAIRS, columns=COLUMNS))


if __name__ == "__main__":
    main()
