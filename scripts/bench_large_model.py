"""The large-model regime (issue 23 item 5): a GPT-style model whose states are several times RAM,
everything on NVMe, against the disk's own bandwidth over the same working set, in one run.

A child process builds the model under infinity.Init (stage 3, parameters and optimizer states on
NVMe), trains --warmup steps, then --steps timed steps (the time from one step's start to the
next's, so the overlapped update of the previous step is inside it), and counts the NVMe bytes each
store moved per step. Then, with the engine idle but its swap files still in place, it measures the
disk over exactly those files (the real working set: every swap file of the run, as large as the
states) through infinity.aio, O_DIRECT, in the swapper's chunks (``zero.offload_optimizer.chunk_size``
elements x 4 bytes per request group, the same number of chunks in flight as the swapper reads
ahead): a full read pass and a full write pass, chunk-interleaved across the files as the step
touches them, then a pass that reads and writes at once (chunk k read while chunk k - 1 is
written, as the swapper streams them), whose bandwidth bounds a step whose reads and writes
overlap. A 256 MiB probe (what the preflight measures) is printed beside it for contrast.

The bound is the step's bytes over that bandwidth: read bytes / read bandwidth + written bytes /
write bandwidth (one device: reads and writes share it). The target: step <= 1.5 x bound.

    python scripts/bench_large_model.py [--params 2e9 | --layers 24 --hidden 2560] [--nvme-path DIR]

Checks the free disk first and removes the swap files afterwards. fp32 by default (bf16 matmuls
crawl on CPUs without native bf16, which would make the step compute-bound; ``--dtype bf16`` halves
the parameter files), 1 x 16 tokens: the regime is the optimizer's traffic, not the compute.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's infinity
from _child import spawn_child  # noqa: E402 - after the path insert
from bench_offload import DISK_BYTES_PER_PARAM, VOCAB, check_disk, fmt_bytes, gpt_param_count, gpt_shape, peak_rss  # noqa: E402

from benchmarks import _models  # noqa: E402

GB = 1e9


def swap_files(root: str) -> list:
    """(path, bytes) of every file of the run under ``root``: its working set on the disk."""
    out = []
    for d, _, names in os.walk(root):
        out += [(os.path.join(d, n), os.path.getsize(os.path.join(d, n))) for n in names]
    return [(p, n) for p, n in out if n > 0]


def working_set_bandwidth(files: list, chunk_bytes: int, inflight: int, aio_cfg) -> dict:
    """Read then write every byte of ``files`` through infinity.aio (O_DIRECT), in requests of
    ``chunk_bytes``, chunk-interleaved across the files (chunk k of every file, then k + 1),
    ``inflight`` chunk groups in flight: bytes/s of each pass."""
    import torch

    from infinity.aio import aligned_empty
    from infinity.testing import new_aio

    bufs = [[aligned_empty(chunk_bytes, torch.uint8) for _ in files] for _ in range(inflight)]
    handles = [new_aio(aio_cfg) for _ in range(inflight)]
    longest = max(n for _, n in files)
    out = {}
    try:
        for op in ("read", "write"):
            moved, t = 0, time.perf_counter()
            for k, off in enumerate(range(0, longest, chunk_bytes)):
                s = k % inflight
                handles[s].wait()  # the group that used this slot inflight chunks ago
                for (path, size), buf in zip(files, bufs[s]):
                    n = min(chunk_bytes, size - off)
                    if n <= 0:
                        continue
                    (handles[s].pread if op == "read" else handles[s].pwrite)(buf[:n], path, off)
                    moved += n
            for h in handles:
                h.wait()
            out[op] = moved / (time.perf_counter() - t)
            out[f"{op}_bytes"] = moved
        out["mixed"] = _mixed_pass(files, chunk_bytes, bufs[0], handles[0], aio_cfg)
    finally:
        for h in handles:
            h.close()
    return out


def _mixed_pass(files: list, chunk_bytes: int, bufs: list, reader, aio_cfg) -> float:
    """Reads and writes at once, as the swapper runs them: chunk k of every file read while
    chunk k - 1 of every file is written back. Bytes/s of both together."""
    import torch

    from infinity.aio import aligned_empty
    from infinity.testing import new_aio

    writer = new_aio(aio_cfg)
    out_bufs = [aligned_empty(chunk_bytes, torch.uint8) for _ in files]
    longest = max(n for _, n in files)
    try:
        moved, t = 0, time.perf_counter()
        for off in range(0, longest + chunk_bytes, chunk_bytes):
            reader.wait()
            writer.wait()
            for (path, size), rbuf, wbuf in zip(files, bufs, out_bufs):
                if off < size:
                    n = min(chunk_bytes, size - off)
                    reader.pread(rbuf[:n], path, off)
                    moved += n
                if 0 <= off - chunk_bytes < size:
                    n = min(chunk_bytes, size - off + chunk_bytes)
                    writer.pwrite(wbuf[:n], path, off - chunk_bytes)
                    moved += n
        reader.wait()
        writer.wait()
        return moved / (time.perf_counter() - t)
    finally:
        writer.close()


def compare_swap_io(model, opt, spec: dict, gen) -> list:
    """Note [phased swap I/O] in _nvme_optimizer_store.py: alternate updates with the swapper's reads and writes overlapped
    and taking turns, on the same files in the same process; each update timed on its own
    (``wait_step`` right after ``step``, nothing beside it). (mode, seconds, NVMe bytes) each."""
    import torch

    out = []
    for _ in range(spec["compare"]):
        for phased in (False, True):
            opt.engine.opt_store.pipeline.phased = phased
            ids = torch.randint(VOCAB, (spec["batch"], spec["seq"]), generator=gen)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.engine.telemetry()  # reset the byte counts: the update's own follow
            t = time.perf_counter()
            opt.step()
            opt.wait_step()
            dt = time.perf_counter() - t
            tel = opt.engine.telemetry()
            moved = sum(v for k, v in tel.items() if k.startswith("nvme_") and k.endswith("_bytes"))
            opt.zero_grad()
            out.append(("phased" if phased else "overlap", dt, moved))
            print(f"  update ({out[-1][0]}): {dt:.1f} s, {moved / GB:.1f} GB", file=sys.stderr, flush=True)
    return out


def child(spec: dict) -> dict:
    import torch

    import infinity
    from infinity.config import AioConfig
    from infinity.testing import chunk_elems
    from infinity.train import probe_disk

    torch.set_num_threads(2)
    torch.manual_seed(0)
    cfg = {"zero": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": spec["nvme"]},
                    "offload_optimizer": {"device": "nvme", "nvme_path": spec["nvme"], "swap_io": spec["swap_io"]}},
           "precision": {"dtype": spec["dtype"]}, "optimizer": {"lr": 1e-4}}
    t0 = time.perf_counter()
    with infinity.Init(config=cfg):
        model = _models.build(_models.Shape.of(spec["layers"], spec["hidden"]))
    model, opt = infinity.initialize(model, cfg)
    out = {"params": sum(p.numel() for p in model.parameters()), "setup_s": time.perf_counter() - t0,
           "tiers": opt.engine.tier_bytes(), "states": opt.engine.model_state_bytes(), "steps": []}
    gen = torch.Generator().manual_seed(1)
    starts, moved, cpu, stalls = [], [], [], []
    n = spec["warmup"] + spec["steps"]
    for i in range(n + 1):
        if i == n:
            opt.wait_step()  # the last timed step's overlapped update ends here
        tel = opt.engine.telemetry()  # the NVMe bytes since the previous boundary, then reset
        starts.append(time.perf_counter())
        t = os.times()
        cpu.append((t.user, t.system))  # the process's CPU seconds, every thread: is the step CPU-bound?
        moved.append({k: v for k, v in tel.items() if k.startswith("nvme_") and k.endswith("_bytes")})
        stalls.append({k: v for k, v in tel["stall_s"].items() if v >= 0.05})  # where the main thread waited
        if i == n:
            break
        ids = torch.randint(VOCAB, (spec["batch"], spec["seq"]), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        fb = time.perf_counter() - starts[-1]
        opt.step()
        opt.zero_grad()
        out["steps"].append({"fwd_bwd": fb})
        print(f"  step {i}: fwd+bwd {fb:.1f} s, peak RSS {peak_rss() / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    # Window i, start(i) .. start(i + 1): step i's forward and backward, the wait for the previous
    # step's overlapped update and the start of its own; the bytes are those moved in that window.
    timed = range(spec["warmup"], n)
    out["step_s"] = [starts[i + 1] - starts[i] for i in timed]
    out["moved"] = [moved[i + 1] for i in timed]
    out["stalls"] = [stalls[i + 1] for i in timed]
    out["cpu_s"] = [[cpu[i + 1][k] - cpu[i][k] for k in (0, 1)] for i in timed]  # user, system
    out["compare"] = compare_swap_io(model, opt, spec, gen) if spec["compare"] else []
    chunk = chunk_elems(None, 1 << 62) * 4  # the swapper's default chunk, in bytes
    aio = AioConfig()
    files = swap_files(spec["nvme"])
    out["working_set"] = {"files": len(files), "bytes": sum(n for _, n in files), "chunk_bytes": chunk}
    out["working_set"].update(working_set_bandwidth(files, chunk, 1, aio))  # 1 group ahead: the swapper reads 1 chunk ahead
    out["small_probe"] = probe_disk(spec["nvme"], aio, 256 << 20)
    out["peak_rss"] = peak_rss()
    opt.engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=2e9)
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=0)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--dtype", default="fp32", choices=("bf16", "fp32"))
    ap.add_argument("--swap-io", default="overlap", choices=("overlap", "phased"),
                    help="zero.offload_optimizer.swap_io (Note [phased swap I/O] in _nvme_optimizer_store.py)")
    ap.add_argument("--compare-swap-io", type=int, default=0, metavar="ROUNDS",
                    help="after the timed steps, ROUNDS pairs of updates timed alone, overlapped and phased in turns")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--nvme-path", default=tempfile.gettempdir())
    ap.add_argument("--timeout", type=float, default=7200)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    layers, hidden = (args.layers, args.hidden) if args.layers and args.hidden else gpt_shape(args.params)
    n = gpt_param_count(layers, hidden)
    root = tempfile.mkdtemp(prefix="bench_large_", dir=args.nvme_path)
    # fp32: the parameters are read from the master file (Note [parameters from the master] in _placement.py), so the
    # disk holds the master, both moments and the gradients, 16 bytes per parameter; bf16 adds its shards.
    per_param = 16 if args.dtype == "fp32" else DISK_BYTES_PER_PARAM
    print(f"GPT-style {layers} x {hidden}, {n / 1e9:.2f} B parameters, {args.dtype}, stage 3, everything on NVMe, "
          f"{args.batch} x {args.seq} tokens, {args.warmup} warm-up + {args.steps} timed steps, swap_io {args.swap_io}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    try:
        check_disk(root, n * per_param)
        spec = dict(layers=layers, hidden=hidden, batch=args.batch, seq=args.seq, dtype=args.dtype,
                    warmup=args.warmup, steps=args.steps, nvme=root, swap_io=args.swap_io,
                    compare=args.compare_swap_io)
        r = spawn_child(__file__, spec, args.timeout, what="the large-model run")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(r)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


def report(r: dict) -> None:
    ws, small = r["working_set"], r["small_probe"]
    print(f"parameters {r['params'] / 1e9:.3f} B; setup {r['setup_s']:.0f} s; peak RSS {fmt_bytes(r['peak_rss'])}")
    print("bytes held per tier: " + ", ".join(f"{t} {fmt_bytes(b)}" for t, b in r["tiers"].items()))
    print(f"disk over the working set ({ws['files']} swap files, {ws['bytes'] / GB:.1f} GB, {ws['chunk_bytes'] >> 20} MiB "
          f"requests): read {ws['read'] / GB:.2f} GB/s, write {ws['write'] / GB:.2f} GB/s; 256 MiB probe: read "
          f"{small['read'] / GB:.2f} GB/s, write {small['write'] / GB:.2f} GB/s; reading and writing at once (as the "
          f"swapper does) {ws['mixed'] / GB:.2f} GB/s together")
    ratios, mixed_ratios = [], []
    cores = os.cpu_count() or 1
    for i, (t, m) in enumerate(zip(r["step_s"], r["moved"])):
        rd = sum(v for k, v in m.items() if k.endswith("_read_bytes"))
        wr = sum(v for k, v in m.items() if k.endswith("_write_bytes"))
        bound = rd / ws["read"] + wr / ws["write"]
        ratios.append(t / bound)
        mixed_ratios.append(t / ((rd + wr) / ws["mixed"]))
        tiers = ", ".join(f"{k[5:-6]} {v / GB:.2f} GB" for k, v in sorted(m.items()))
        print(f"step {i}: {t:.1f} s; NVMe read {rd / GB:.2f} GB, written {wr / GB:.2f} GB ({tiers}); bound "
              f"{bound:.1f} s at the working-set bandwidth; step / bound {t / bound:.2f}x; reading and writing at "
              f"once the disk needs {(rd + wr) / ws['mixed']:.1f} s: step / that {mixed_ratios[-1]:.2f}x")
        user, system = r["cpu_s"][i]
        print("        main thread waited: " + (", ".join(f"{k} {v:.1f} s" for k, v in r["stalls"][i].items()) or "-"))
        print(f"        CPU {user:.1f} s user + {system:.1f} s system = {(user + system) / t:.2f} of {cores} cores "
              f"busy on average (the kernel's I/O work counts as system time)")
    print(f"median step / bound: {statistics.median(ratios):.2f}x (target <= 1.5x); step / the disk reading and "
          f"writing at once: {statistics.median(mixed_ratios):.2f}x")
    if r["compare"]:
        med = {m: statistics.median(t for mm, t, _ in r["compare"] if mm == m) for m in ("overlap", "phased")}
        gbs = {m: statistics.median(b / t for mm, t, b in r["compare"] if mm == m) / GB for m in med}
        print(f"updates timed alone, medians of {len(r['compare']) // 2}: overlap {med['overlap']:.1f} s "
              f"({gbs['overlap']:.2f} GB/s), phased {med['phased']:.1f} s ({gbs['phased']:.2f} GB/s); phased / overlap "
              f"{med['phased'] / med['overlap']:.2f}x")


if __name__ == "__main__":
    main()
