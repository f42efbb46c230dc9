"""infinity's checkpoints against the disk and against torch.save, side by side in one process.

For each size of ``--sizes`` (GPT-2 124M; 1.3b, 24 x 2048, about 60 GB of disk): built under
infinity.Init, stage 3, bf16, every state on NVMe (parameters, fp32 master weights, both
moments), one rank, one cell whose process measures on one disk (Note [contenders side by
side] in _harness.py):

  save_checkpoint  ``--steps`` saves; the checkpoint's B bytes read from the swap files and written
  load_checkpoint  ``--steps`` loads: every file verified (B read), then copied into the swap files
  torch.save       the same states held in memory, to a file on the same disk, fsynced (where they
  torch.load       fit in RAM; the page cache dropped before each load): the usual way
  copy-bound       the disk's time for a copy of B bytes, B / read + B / durable write, from an
                   O_DIRECT probe (``infinity.train.probe_disk``) and a write ended by ``fsync``
  load-bound       the disk's time for a load, B / read + the copy bound
  export           ``python -m infinity.export`` of the checkpoint in its own process;
                   ``extra`` its peak RSS against the largest tensor

Ratios: ours against torch's and against the disk (the target: within 1 / 0.7 of the bound).

``--clone-async``: for each filesystem of ``--filesystems`` (``xfs``: a loop-mounted XFS with
reflink made under ``--nvme-path``, the loop device in direct-I/O mode, when run as root with
xfsprogs; ``own``: the filesystem of ``--nvme-path``), against the copy (``clone=False``,
blocking) in the same process: the cloned save and load (Note [cloned checkpoints] in
infinity/_checkpoint/_clone.py), and the asynchronous save (Note [asynchronous saves] in
infinity/_checkpoint/_async.py) as the training time lost per save: the call, the step's
slowdown while it is in flight, and the wait left at the end. Contenders ``copy-save``,
``clone-save``, ``copy-load``, ``clone-load``, ``async-save-lost``, ``step``,
``step-during-async-save``. Goals: a cloned save under 5% of the copy's time, an asynchronous
save costing under 10% of a step.

    python -m benchmarks.checkpoint [--sizes 124m,1.3b] [--steps 3] [--nvme-path DIR]
    python -m benchmarks.checkpoint --clone-async [--filesystems xfs,own] [--xfs-gib 16]
"""
from __future__ import annotations

import copy
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from . import _flags, _harness, _models
from ._harness import Cell

BENCH = "checkpoint"
GiB = 2**30
COPY = ("save_checkpoint", "load_checkpoint", "torch.save", "torch.load", "copy-bound", "load-bound", "export")
CLONE = ("copy-save", "clone-save", "copy-load", "clone-load", "async-save-lost", "step", "step-during-async-save")
PAIRS = (("save_checkpoint", "torch.save"), ("load_checkpoint", "torch.load"), ("save_checkpoint", "copy-bound"),
         ("load_checkpoint", "load-bound"), ("clone-save", "copy-save"), ("clone-load", "copy-load"),
         ("async-save-lost", "copy-save"), ("async-save-lost", "step"), ("step-during-async-save", "step"))


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def durable_write(directory: str, nbytes: int, repeats: int = 3) -> float:
    """O_DIRECT write of a preallocated file through infinity.aio, then fsync: the disk's
    bandwidth for data that must survive a crash (median, bytes/s)."""
    from infinity.aio import AsyncIO, aligned_empty

    buf = aligned_empty(nbytes)
    buf.fill_(1)
    path = os.path.join(directory, "durable.bin")
    times = []
    for _ in range(repeats):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.posix_fallocate(fd, 0, nbytes)
        os.close(fd)
        with AsyncIO() as h:
            times.append(_harness.timed(lambda: (h.pwrite(buf, path, 0), h.wait(), fsync_file(path))))
        os.remove(path)
    return nbytes / statistics.median(times)


def drop_cache(path: str) -> None:
    """Evict ``path``'s pages (so a buffered read goes to the disk, like our O_DIRECT reads)."""
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def nvme_trainer(spec: dict, nvme: str):
    import torch

    import infinity

    from ._trainers import InfinityTrainer, infinity_config

    torch.set_num_threads(2)
    cfg = infinity_config("nvme", "bf16", nvme, clip=None, optimizer={"lr": 1e-4})
    with infinity.Init(config=cfg):
        model = _models.build(_models.shape_of(spec["size"]))
    return InfinityTrainer(model, cfg), cfg


def checkpoint_bytes(path: str) -> tuple:
    """(the checkpoint's bytes, its largest tensor's bf16 bytes)."""
    from infinity.testing import CheckpointReader

    reader = CheckpointReader(path)
    manifest = reader.manifest
    reader.close()
    return sum(f["bytes"] for f in manifest["files"].values()), max(p["numel"] for p in manifest["params"]) * 2


def torch_reference(path: str, work: str, steps: int) -> dict:
    """torch.save / torch.load of the same states (one rank: whole flat arrays) in memory."""
    import torch

    from infinity.testing import CheckpointReader

    reader = CheckpointReader(path)
    states = {rel: torch.from_file(reader.file(rel), size=f["bytes"], dtype=torch.uint8)
              for rel, f in reader.manifest["files"].items() if rel.endswith(".bin")}
    reader.close()
    target = os.path.join(work, "torch_save.pt")
    saves, loads = [], []
    for _ in range(steps):
        saves.append(_harness.timed(lambda: (torch.save(states, target), fsync_file(target))))
        drop_cache(target)
        loads.append(_harness.timed(lambda: torch.load(target, weights_only=True)))
    os.remove(target)
    return {"torch.save": _harness.sample(saves), "torch.load": _harness.sample(loads)}


def export_run(ck: str, out: str) -> dict:
    """``python -m infinity.export`` in its own process: its seconds and peak RSS (VmHWM), and after its imports."""
    code = ("import sys, time; from infinity.testing import peak_rss; from infinity.export import main; "
            "base = peak_rss(); t = time.perf_counter(); main([sys.argv[1], sys.argv[2]]); "
            "print(peak_rss(), base, time.perf_counter() - t)")
    proc = subprocess.run([sys.executable, "-c", code, ck, out], capture_output=True, text=True, check=True,
                          env=dict(os.environ, PYTHONPATH=_harness.ROOT))
    rss, base, seconds = proc.stdout.split()[-3:]
    shutil.rmtree(out, ignore_errors=True)
    return _harness.sample([float(seconds)], extra={"peak_rss_mib": int(rss) >> 20, "import_rss_mib": int(base) >> 20})


def measure_copy(spec: dict) -> dict:
    import psutil

    import infinity
    from infinity.config import Config
    from infinity.testing import peak_rss, reset_peak_rss, rss_now
    from infinity.train import probe_disk

    work, steps = spec["scratch"], spec["steps"]
    trainer, cfg = nvme_trainer(spec, os.path.join(work, "nvme"))
    os.makedirs(os.path.join(work, "probe"), exist_ok=True)
    disk = probe_disk(os.path.join(work, "probe"), Config.from_dict(cfg).aio, spec["probe_bytes"])
    disk["durable_write"] = durable_write(os.path.join(work, "probe"), spec["probe_bytes"])
    ck, model, opt = os.path.join(work, "ck"), trainer.model, trainer.opt
    rss_before = rss_now()  # the engine's pools and host cache
    reset_peak_rss()
    saves = [_harness.timed(lambda: infinity.save_checkpoint(ck, model, opt, tag=f"r{i}", keep_last=1))
             for i in range(steps)]
    path = os.path.join(ck, f"r{steps - 1}")
    b, largest = checkpoint_bytes(path)
    loads = [_harness.timed(lambda: infinity.load_checkpoint(ck, model, opt)) for _ in range(steps)]
    copy_bound = b / disk["read"] + b / disk["durable_write"]  # B read + B written, one disk, not overlapped
    figures = {"bytes": b, "rss_before_mib": rss_before >> 20, "peak_rss_mib": peak_rss() >> 20,
               "read_gbps": round(disk["read"] / 1e9, 3), "write_gbps": round(disk["write"] / 1e9, 3),
               "durable_write_gbps": round(disk["durable_write"] / 1e9, 3)}
    out = {"save_checkpoint": _harness.sample(saves, extra=figures), "load_checkpoint": _harness.sample(loads, extra=figures),
           "copy-bound": _harness.sample([copy_bound], extra=figures),
           "load-bound": _harness.sample([b / disk["read"] + copy_bound], extra=figures)}
    fits = psutil.virtual_memory().available > 2.5 * b
    out.update(torch_reference(path, work, steps) if fits else {
        k: _harness.skipped("the states do not fit in the memory available") for k in ("torch.save", "torch.load")})
    trainer.close()
    out["export"] = export_run(ck, os.path.join(work, "hf"))
    out["export"]["extra"]["largest_tensor_mib"] = round(largest / 2**20, 1)
    return _harness.side_by_side(out)


def measure_clone(spec: dict) -> dict:
    import infinity
    from infinity.testing import clone_support, fs_type

    work = spec["scratch"]
    nvme, ck = os.path.join(work, "nvme"), os.path.join(work, "ck")
    os.makedirs(ck, exist_ok=True)
    trainer, _ = nvme_trainer(spec, nvme)
    model, opt = trainer.model, trainer.opt
    batches = _models.batches(spec["size"], 4, 256 if spec["size"] != "tiny" else 32, 3 * spec["steps"] + 1)
    trainer.step(batches.pop())  # the swap files written once
    support = clone_support(nvme, ck)
    timed = {k: [] for k in CLONE + ("async-call", "async-wait")}
    for k in range(spec["steps"]):
        for kind, clone in (("copy", False), ("clone", True)):
            timed[f"{kind}-save"].append(_harness.timed(lambda: infinity.save_checkpoint(
                ck, model, opt, tag=f"{kind}{k}", keep_last=1, clone=clone)))
            timed[f"{kind}-load"].append(_harness.timed(lambda: infinity.load_checkpoint(ck, model, opt, clone=clone)))
        timed["step"].append(_harness.timed(lambda: trainer.step(batches.pop())))
        opt.engine.settle_writes()  # the step's overlapped tail: any save (or the next forward) waits for it
        handle = []
        timed["async-call"].append(_harness.timed(lambda: handle.append(infinity.save_checkpoint(
            ck, model, opt, tag=f"async{k}", keep_last=1, blocking=False))))
        timed["step-during-async-save"].append(_harness.timed(lambda: trainer.step(batches.pop())))
        timed["async-wait"].append(_harness.timed(lambda: handle[0].wait()))
        timed["step"].append(_harness.timed(lambda: trainer.step(batches.pop())))
    step = statistics.median(timed["step"])
    timed["async-save-lost"] = [c + max(0.0, s - step) + w for c, s, w in
                                zip(timed["async-call"], timed["step-during-async-save"], timed["async-wait"])]
    figures = {"fs": fs_type(work), "cloning": support.ok, "clone_reason": support.reason,
               "async_call_s": round(statistics.median(timed["async-call"]), 4),
               "async_wait_s": round(statistics.median(timed["async-wait"]), 4)}
    trainer.close()
    return _harness.side_by_side({name: _harness.sample(timed[name], extra=figures) for name in CLONE})


def measure(spec: dict) -> dict:
    return measure_clone(spec) if spec["mode"] == "clone-async" else measure_copy(spec)


def mount_xfs(base: str, gib: int):
    """(mount point, cleanup) of a fresh XFS with reflink on a sparse image under ``base``,
    its loop device in direct-I/O mode (the image's own page cache would flatter every
    write); (None, the reason) when this machine cannot."""
    def sh(*cmd: str) -> str:
        return subprocess.run(list(cmd), capture_output=True, text=True, check=True, timeout=120).stdout.strip()

    if os.geteuid() != 0 or shutil.which("mkfs.xfs") is None:
        return None, "needs root and xfsprogs (mkfs.xfs)"
    image, point = os.path.join(base, "xfs.img"), os.path.join(base, "xfs")
    os.makedirs(point, exist_ok=True)
    with open(image, "wb") as f:
        f.truncate(gib * GiB)
    try:
        sh("mkfs.xfs", "-q", "-f", "-m", "reflink=1", image)
        dev = sh("losetup", "-f", "--show", "--direct-io=on", image)
    except (subprocess.CalledProcessError, OSError) as e:
        return None, f"cannot make or attach the XFS image: {e}"

    def cleanup():
        subprocess.run(["umount", point], capture_output=True)
        subprocess.run(["losetup", "-d", dev], capture_output=True)
        os.remove(image)

    try:
        sh("mount", dev, point)
    except subprocess.CalledProcessError as e:
        cleanup()
        return None, f"cannot mount the XFS image: {e.stderr}"
    return (point, cleanup), ""


def clone_async(args, sizes: list) -> list:
    """The cells of ``--clone-async``, one run of the harness per filesystem (its scratch on it)."""
    base = tempfile.mkdtemp(prefix="infinity-bench-ck-", dir=args.nvme_path)
    mounted, reason = (None, "not in --filesystems")
    records = []
    try:
        filesystems = _flags.parse_list(args.filesystems)
        if "xfs" in filesystems:
            mounted, reason = mount_xfs(base, args.xfs_gib)
        for fs in filesystems:
            where = {"xfs": mounted[0] if mounted else None, "own": os.path.join(base, "own")}[fs]
            skip = None if where else f"loop XFS: {reason}"
            fs_args = copy.copy(args)
            fs_args.nvme_path = where or base
            cells = [Cell("clone-async", f"{size}-{fs}", skip, CLONE) for size in sizes]
            records += _harness.run_cells(BENCH, "benchmarks.checkpoint", cells, lambda cell, scratch: {
                "mode": "clone-async", "size": cell.size.rsplit("-", 1)[0], "steps": args.steps, "scratch": scratch},
                fs_args, dtype="bf16")
    finally:
        if mounted:
            mounted[1]()
        shutil.rmtree(base, ignore_errors=True)
    return records


def main(argv=None) -> int:
    p = _flags.parser(__doc__, steps=3, warmup=0, timeout=7200.0, budget=4 * 3600.0)
    p.add_argument("--sizes", default="124m", help=f"model sizes, of {', '.join(_models.SHAPES)}")
    p.add_argument("--clone-async", action="store_true", help="cloned and asynchronous saves against the copy")
    p.add_argument("--filesystems", default="xfs,own", help="--clone-async: of xfs (a loop XFS, as root) and own")
    p.add_argument("--xfs-gib", type=int, default=16, help="size of the loop XFS image (sparse)")
    args = _harness.parse(p, measure, argv)
    if args.smoke:
        args.sizes, args.steps = "tiny", 1
    sizes = _flags.parse_list(args.sizes)
    for size in sizes:
        _models.shape_of(size)
    if args.clone_async:
        records = clone_async(args, sizes)
    else:
        probe = (64 << 20) if args.smoke else GiB
        records = _harness.run_cells(BENCH, "benchmarks.checkpoint", [Cell("copy", s, side_by_side=COPY) for s in sizes],
                                     lambda cell, scratch: {"mode": "copy", "size": cell.size, "steps": args.steps,
                                                      "scratch": scratch, "probe_bytes": probe}, args, dtype="bf16")
    return _harness.finish(BENCH, records, args, PAIRS, extra=("bytes", "peak_rss_mib", "largest_tensor_mib"))


if __name__ == "__main__":
    sys.exit(main())
