"""Benchmark of infinity's checkpoints against the disk and against torch.save, in one run.

For each model (GPT-2 124M, and a ~1.3B GPT with --big): built under infinity.Init, stage 3,
bf16, every state on NVMe (parameters, fp32 master weights, both moments), one rank. In the
same process, on the same disk:

- the disk: O_DIRECT sequential write and read bandwidth through infinity.aio (the train
  job's probe, 1 GiB);
- save_checkpoint: median time of --repeats saves; the checkpoint's bytes B are read from
  the swap files and written to the checkpoint (a copy: B read + B written on one disk);
- load_checkpoint: median time; it verifies every file it reads (B read), then copies them
  into the swap files (B read + B written);
- torch.save / torch.load of the same states held in memory (where they fit in RAM), to a
  file on the same disk, fsynced: the usual way, for reference;
- python -m infinity.export of the checkpoint in its own process: its peak RSS against the
  largest tensor.

Prints our throughput against the disk bandwidth (target >= 70%) and against torch.save,
as ratios of medians.

    python scripts/bench_checkpoint.py [--big] [--repeats 3] [--dir DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's infinity

GiB = 2**30
MODELS = {"gpt2-124M": (12, 768), "gpt-1.3B": (24, 2048)}


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9


def config(nvme: str) -> dict:
    return {"zero": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                     "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
            "precision": {"dtype": "bf16"}, "optimizer": {"lr": 1e-4}}


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def durable_write(directory: str, nbytes: int = GiB, repeats: int = 3) -> float:
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
        t = time.perf_counter()
        with AsyncIO() as h:
            h.pwrite(buf, path, 0)
            h.wait()
        fsync_file(path)
        times.append(time.perf_counter() - t)
        os.remove(path)
    return nbytes / statistics.median(times)


def drop_cache(path: str) -> None:
    """Evict ``path``'s pages (so a buffered read goes to the disk, like our O_DIRECT reads)."""
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def measure(name: str, work: str, repeats: int) -> dict:
    import psutil
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import infinity
    from infinity._checkpoint import CheckpointReader
    from infinity.config import Config
    from infinity.testing import peak_rss, reset_peak_rss, rss_now
    from infinity.train import probe_disk

    torch.set_num_threads(2)
    layers, hidden = MODELS[name]
    cfg = config(os.path.join(work, "nvme"))
    os.makedirs(os.path.join(work, "nvme"), exist_ok=True)
    disk = probe_disk(os.path.join(work, "probe"), Config.from_dict(cfg).aio, GiB)
    disk["durable_write"] = durable_write(os.path.join(work, "probe"))
    with infinity.Init(config=cfg):
        model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=hidden, n_head=hidden // 64, use_cache=False))
    model, opt = infinity.initialize(model, cfg)
    out = {"model": name, "params": sum(p.numel() for p in model.parameters()), "disk": disk}
    ck = os.path.join(work, "ck")
    saves, loads = [], []
    out["rss_before"] = rss_now()
    reset_peak_rss()
    for i in range(repeats):
        t = time.perf_counter()
        path = infinity.save_checkpoint(ck, model, opt, tag=f"r{i}", keep_last=1)
        saves.append(time.perf_counter() - t)
    manifest = CheckpointReader(path).manifest
    out["bytes"] = sum(f["bytes"] for f in manifest["files"].values())
    out["largest_tensor"] = max(p["numel"] for p in manifest["params"]) * 2
    for _ in range(repeats):
        t = time.perf_counter()
        infinity.load_checkpoint(ck, model, opt)
        loads.append(time.perf_counter() - t)
    out["rss_peak_save_load"] = peak_rss()
    out.update(save_s=statistics.median(saves), load_s=statistics.median(loads), saves=saves, loads=loads)
    if psutil.virtual_memory().available > 2.5 * out["bytes"]:
        out.update(torch_reference(path, work, repeats))
    opt.engine.close()
    out["export"] = export_rss(ck, os.path.join(work, "hf"))
    return out


def torch_reference(path: str, work: str, repeats: int) -> dict:
    """torch.save / torch.load of the same states (one rank: whole flat arrays) in memory."""
    import torch

    from infinity._checkpoint import CheckpointReader

    reader = CheckpointReader(path)
    states = {}
    for rel in reader.manifest["files"]:
        if rel.endswith(".bin"):
            states[rel] = torch.from_file(reader.file(rel), size=reader.manifest["files"][rel]["bytes"],
                                          dtype=torch.uint8)
    reader.close()
    target = os.path.join(work, "torch_save.pt")
    saves, loads = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        torch.save(states, target)
        fsync_file(target)
        saves.append(time.perf_counter() - t)
        drop_cache(target)
        t = time.perf_counter()
        torch.load(target, weights_only=True)
        loads.append(time.perf_counter() - t)
    os.remove(target)
    return {"torch_save_s": statistics.median(saves), "torch_load_s": statistics.median(loads)}


def export_rss(ck: str, out: str) -> dict:
    """Peak RSS (VmHWM) of ``python -m infinity.export`` in its own process, and after its imports."""
    here = os.path.abspath(__file__)
    code = ("import sys, time; sys.path.insert(0, sys.argv[3]); from infinity.testing import peak_rss; "
            "from infinity.export import main; base = peak_rss(); t = time.perf_counter(); "
            "main([sys.argv[1], sys.argv[2]]); print(peak_rss(), base, time.perf_counter() - t)")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(here)))
    proc = subprocess.run([sys.executable, "-c", code, ck, out, os.path.dirname(here)], capture_output=True, text=True,
                          env=env, check=True)
    rss, base, seconds = proc.stdout.split()[-3:]
    shutil.rmtree(out, ignore_errors=True)
    return {"peak_rss": int(rss), "import_rss": int(base), "seconds": float(seconds)}


def report(r: dict) -> None:
    b, disk = r["bytes"], r["disk"]
    copy_bound = 1 / (1 / disk["read"] + 1 / disk["durable_write"])  # B read + B written, one disk, not overlapped
    print(f"\n{r['model']}: {r['params'] / 1e6:.0f}M parameters, checkpoint {b / GiB:.2f} GiB "
          f"(bf16 params + fp32 master + 2 moments), every state on NVMe")
    durable = disk["durable_write"]
    print(f"  disk (same run, O_DIRECT): write {disk['write'] / 1e9:.2f} GB/s, with fsync {durable / 1e9:.2f} GB/s, "
          f"read {disk['read'] / 1e9:.2f} GB/s; copy bound (read + durable write) {copy_bound / 1e9:.2f} GB/s")
    save = gbps(b, r["save_s"])
    print(f"  save_checkpoint: {r['save_s']:.2f} s median of {[round(x, 2) for x in r['saves']]} -> {save:.2f} GB/s "
          f"written = {save * 1e9 / durable:.2f} x durable disk write, {save * 1e9 / copy_bound:.2f} x copy bound")
    load = gbps(b, r["load_s"])
    bound = b / disk["read"] + b / copy_bound  # verify (B read) + copy (B read, B written)
    print(f"  load_checkpoint (verify + copy): {r['load_s']:.2f} s median of {[round(x, 2) for x in r['loads']]} -> "
          f"{load:.2f} GB/s of checkpoint; the disk bound for 2B read + B written is {bound:.2f} s: "
          f"{bound / r['load_s']:.2f} x")
    print(f"  peak RSS over the saves and loads {r['rss_peak_save_load'] / 2**20:.0f} MiB "
          f"(RSS before them {r['rss_before'] / 2**20:.0f} MiB: the engine's pools and host cache)")
    if "torch_save_s" in r:
        print(f"  torch.save of the same states (in memory, fsynced): {r['torch_save_s']:.2f} s "
              f"({gbps(b, r['torch_save_s']):.2f} GB/s); ours / torch.save time = {r['save_s'] / r['torch_save_s']:.2f}")
        print(f"  torch.load (cold cache): {r['torch_load_s']:.2f} s; ours (with verification) / torch.load time = "
              f"{r['load_s'] / r['torch_load_s']:.2f}")
    else:
        print("  torch.save: skipped, the states do not fit in the memory available")
    e = r["export"]
    print(f"  export: {e['seconds']:.1f} s, peak RSS {e['peak_rss'] / 2**20:.0f} MiB (after imports "
          f"{e['import_rss'] / 2**20:.0f} MiB; largest tensor {r['largest_tensor'] / 2**20:.0f} MiB; "
          f"growth {(e['peak_rss'] - e['import_rss']) / 2**20:.0f} MiB)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--big", action="store_true", help="also the ~1.3B model (about 60 GB of disk)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", help="scratch directory on the disk to measure (default: the temp dir)")
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.model:  # one model, in its own process
        print(json.dumps(measure(args.model, args.dir, args.repeats)))
        return 0
    names = ["gpt2-124M"] + (["gpt-1.3B"] if args.big else [])
    for name in names:
        work = tempfile.mkdtemp(prefix="infinity-bench-ck-", dir=args.dir)
        try:
            proc = subprocess.run([sys.executable, __file__, "--model", name, "--dir", work,
                                   "--repeats", str(args.repeats)], capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stderr[-4000:], file=sys.stderr)
                return 1
            report(json.loads(proc.stdout.strip().splitlines()[-1]))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
