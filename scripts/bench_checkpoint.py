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

``--contenders`` measures instead, for each filesystem (a loop-mounted XFS with reflink that
the script makes under --dir, with the loop device in direct-I/O mode, when run as root with
xfsprogs; and the filesystem of --dir itself), in one process per filesystem, against today's
copy (``clone=False``, blocking) in the same run: the cloned save and load (Note [cloned
checkpoints] in infinity/_checkpoint/_clone.py), and the asynchronous save (Note [asynchronous
saves] in infinity/_checkpoint/_async.py): the time of the call, the step that runs while it
is in flight, the wait left at the end, and the training time lost per save (call + the
step's slowdown + that wait) against a step without a save. Goals: a cloned save under 5% of
the copy's time, an asynchronous save costing under 10% of a step.

    python scripts/bench_checkpoint.py [--big] [--repeats 3] [--dir DIR]
    python scripts/bench_checkpoint.py --contenders [--repeats 3] [--dir DIR] [--xfs-gib 16]
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
    from infinity.config import Config
    from infinity.testing import CheckpointReader, peak_rss, reset_peak_rss, rss_now
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

    from infinity.testing import CheckpointReader

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


# ---------------------------------------------------------------------------------------- contenders


def _sh(*cmd: str) -> str:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=True, timeout=120).stdout.strip()


def mount_xfs(base: str, gib: int):
    """(mount point, cleanup) of a fresh XFS with reflink on a sparse image under ``base``,
    its loop device in direct-I/O mode (the image's own page cache would flatter every
    write); None with the reason when this machine cannot."""
    if os.geteuid() != 0 or shutil.which("mkfs.xfs") is None:
        return None, "needs root and xfsprogs (mkfs.xfs)"
    image, point = os.path.join(base, "xfs.img"), os.path.join(base, "xfs")
    os.makedirs(point, exist_ok=True)
    with open(image, "wb") as f:
        f.truncate(gib * GiB)
    try:
        _sh("mkfs.xfs", "-q", "-f", "-m", "reflink=1", image)
        dev = _sh("losetup", "-f", "--show", "--direct-io=on", image)
    except (subprocess.CalledProcessError, OSError) as e:
        return None, f"cannot make or attach the XFS image: {e}"

    def cleanup():
        subprocess.run(["umount", point], capture_output=True)
        subprocess.run(["losetup", "-d", dev], capture_output=True)
        os.remove(image)

    try:
        _sh("mount", dev, point)
    except subprocess.CalledProcessError as e:
        cleanup()
        return None, f"cannot mount the XFS image: {e.stderr}"
    return (point, cleanup), ""


def _train_step(model, opt, ids) -> float:
    t = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t


def measure_contenders(name: str, work: str, repeats: int) -> dict:
    """One filesystem: copy vs clone (save, load) and the asynchronous save (module doc)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import infinity
    from infinity.testing import CheckpointReader, clone_support, fs_type

    torch.set_num_threads(2)
    torch.manual_seed(0)
    layers, hidden = MODELS[name]
    nvme, ck = os.path.join(work, "nvme"), os.path.join(work, "ck")
    os.makedirs(nvme, exist_ok=True)
    os.makedirs(ck, exist_ok=True)
    cfg = config(nvme)
    with infinity.Init(config=cfg):
        model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=hidden, n_head=hidden // 64, use_cache=False))
    model, opt = infinity.initialize(model, cfg)
    ids = torch.randint(0, 50257, (4, 256))
    _train_step(model, opt, ids)  # the swap files written once
    support = clone_support(nvme, ck)
    out = {"model": name, "fs": fs_type(work), "clone_ok": support.ok, "clone_reason": support.reason}
    timed: dict = {k: [] for k in ("copy_save", "clone_save", "copy_load", "clone_load", "step", "tail", "async_call",
                                   "async_step", "async_wait", "async_lost")}
    k = 0
    for _ in range(repeats):
        for kind, clone in (("copy", False), ("clone", True)):
            t = time.perf_counter()
            path = infinity.save_checkpoint(ck, model, opt, tag=f"{kind}{k}", keep_last=1, clone=clone)
            timed[f"{kind}_save"].append(time.perf_counter() - t)
            k += 1
            t = time.perf_counter()
            infinity.load_checkpoint(ck, model, opt, clone=clone)
            timed[f"{kind}_load"].append(time.perf_counter() - t)
        timed["step"].append(_train_step(model, opt, ids))
        t = time.perf_counter()
        opt.engine.settle_writes()  # the step's overlapped tail: any save (or the next forward) waits for it
        timed["tail"].append(time.perf_counter() - t)
        t = time.perf_counter()
        handle = infinity.save_checkpoint(ck, model, opt, tag=f"async{k}", keep_last=1, blocking=False)
        timed["async_call"].append(time.perf_counter() - t)
        k += 1
        timed["async_step"].append(_train_step(model, opt, ids))
        t = time.perf_counter()
        path = handle.wait()
        timed["async_wait"].append(time.perf_counter() - t)
        timed["step"].append(_train_step(model, opt, ids))
    step = statistics.median(timed["step"])
    timed["async_lost"] = [c + max(0.0, s - step) + w for c, s, w in
                           zip(timed["async_call"], timed["async_step"], timed["async_wait"])]
    out.update({key: statistics.median(v) for key, v in timed.items()})
    out["runs"] = {key: [round(x, 3) for x in v] for key, v in timed.items()}
    reader = CheckpointReader(path)
    out["bytes"] = sum(f["bytes"] for f in reader.manifest["files"].values())
    reader.close()
    opt.engine.close()
    return out


def report_contenders(r: dict) -> None:
    print(f"\n{r['model']} on {r['fs']} (checkpoint {r['bytes'] / GiB:.2f} GiB, every state on NVMe): "
          f"{'cloning' if r['clone_ok'] else 'no cloning'}: {r['clone_reason']}")
    print(f"  save: today's copy {r['copy_save']:.3f} s, ours {r['clone_save']:.3f} s -> "
          f"{100 * r['clone_save'] / r['copy_save']:.1f}% of the copy's time (goal < 5%)   runs {r['runs']['copy_save']} "
          f"vs {r['runs']['clone_save']}")
    print(f"  load: today's copy {r['copy_load']:.3f} s, ours {r['clone_load']:.3f} s -> "
          f"{100 * r['clone_load'] / r['copy_load']:.1f}%")
    print(f"  step {r['step']:.2f} s (its overlapped tail, which a save joins first, {r['tail']:.2f} s, counted in "
          f"neither save); asynchronous save: call {r['async_call']:.3f} s, the step during it "
          f"{r['async_step']:.2f} s, wait left after it {r['async_wait']:.3f} s   steps without a save "
          f"{r['runs']['step']}, during one {r['runs']['async_step']}")
    print(f"  training time lost per save: blocking copy {r['copy_save']:.3f} s = {100 * r['copy_save'] / r['step']:.1f}% "
          f"of a step; asynchronous {r['async_lost']:.3f} s = {100 * r['async_lost'] / r['step']:.1f}% of a step "
          f"(goal < 10%); ratio async / copy {r['async_lost'] / r['copy_save']:.3f}")


def contenders(args) -> int:
    base = tempfile.mkdtemp(prefix="infinity-bench-ck-", dir=args.dir)
    targets = []
    mounted, reason = mount_xfs(base, args.xfs_gib) if args.only in (None, "xfs") else (None, "--only own")
    if mounted is None:
        print(f"loop XFS: skipped ({reason})")
    else:
        targets.append(mounted[0])
    if args.only in (None, "own"):
        targets.append(os.path.join(base, "own"))
    models = ["gpt2-124M"] * (not args.big_only) + ["gpt-1.3B"] * (args.big or args.big_only)
    try:
        for work in targets:
            os.makedirs(work, exist_ok=True)
            for name in models:
                proc = subprocess.run([sys.executable, __file__, "--model", name, "--dir", work, "--contenders",
                                       "--repeats", str(args.repeats)], capture_output=True, text=True)
                if proc.returncode != 0:
                    print(proc.stderr[-4000:], file=sys.stderr)
                    return 1
                report_contenders(json.loads(proc.stdout.strip().splitlines()[-1]))
    finally:
        if mounted is not None:
            mounted[1]()
        shutil.rmtree(base, ignore_errors=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--big", action="store_true", help="also the ~1.3B model (about 60 GB of disk)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", help="scratch directory on the disk to measure (default: the temp dir)")
    p.add_argument("--contenders", action="store_true", help="cloned and asynchronous saves against the copy")
    p.add_argument("--xfs-gib", type=int, default=16, help="size of the loop XFS image (sparse)")
    p.add_argument("--only", choices=("xfs", "own"), help="--contenders on one filesystem only")
    p.add_argument("--big-only", action="store_true", help="only the ~1.3B model")
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.model:  # one model, in its own process
        fn = measure_contenders if args.contenders else measure
        print(json.dumps(fn(args.model, args.dir, args.repeats)))
        return 0
    if args.contenders:
        return contenders(args)
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
