"""Does the disk read and write at once as fast as it reads and writes in turns? (issue 23 item 5)

The optimizer swapper streams chunks: chunk k is read while chunk k - 1 is written back, so the
disk serves reads and writes at once. This writes a working set of ``--gb`` GB in 5 files (as
many as the swapper's), then per round measures over it through infinity.aio (O_DIRECT, 16 MiB
requests per file, the swapper's chunk): a read pass, a write pass, the two at once (the
swapper's pattern, ``bench_large_model._mixed_pass``), and "phased" passes that read ``burst``
chunks of every file, wait, then write them back, wait (reads and writes never at once). Prints
GB/s of each (read and written bytes together for the last two) and the harmonic mean of the
read and write passes, what a half-read, half-write stream would reach if the two did not
interfere.

    python scripts/bench_disk_mix.py [--gb 48] [--rounds 2] [--nvme-path DIR]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's infinity
from bench_large_model import working_set_bandwidth  # noqa: E402 - after the path insert
from bench_offload import check_disk  # noqa: E402

GB = 1e9
CHUNK = 16 << 20
FILES = 5


def create(root: str, total: float, aio_cfg) -> list:
    """``FILES`` files of ``total`` bytes together, every byte written (an unwritten extent reads as zeros without I/O)."""
    import torch

    from infinity.aio import aligned_empty
    from infinity.testing import new_aio

    size = int(total) // FILES // CHUNK * CHUNK
    files = [(os.path.join(root, f"f{i}.swp"), size) for i in range(FILES)]
    h, buf = new_aio(aio_cfg), aligned_empty(CHUNK, torch.uint8)
    buf.fill_(7)
    try:
        for path, n in files:
            with open(path, "wb") as f:
                f.truncate(n)
            for k, off in enumerate(range(0, n, CHUNK)):
                h.pwrite(buf, path, off)
                if k % 8 == 7:
                    h.wait()
            h.wait()
    finally:
        h.close()
    return files


def phased(files: list, burst: int, aio_cfg) -> float:
    """Read ``burst`` chunks of every file, wait, write them back, wait; bytes/s of both."""
    import torch

    from infinity.aio import aligned_empty
    from infinity.testing import new_aio

    rh, wh = new_aio(aio_cfg), new_aio(aio_cfg)
    bufs = [[aligned_empty(CHUNK, torch.uint8) for _ in files] for _ in range(burst)]
    offs = list(range(0, max(n for _, n in files), CHUNK))
    try:
        moved, t = 0, time.perf_counter()
        for b in range(0, len(offs), burst):
            for handle, op in ((rh, "pread"), (wh, "pwrite")):
                for j, off in enumerate(offs[b : b + burst]):
                    for (path, _), buf in zip(files, bufs[j]):
                        getattr(handle, op)(buf, path, off)
                        moved += CHUNK
                handle.wait()
        return moved / (time.perf_counter() - t)
    finally:
        rh.close()
        wh.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=48.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--nvme-path", default=tempfile.gettempdir())
    args = ap.parse_args()
    smallest = FILES * CHUNK / GB
    if args.gb < smallest:
        ap.error(f"--gb {args.gb:g}: the working set is {FILES} files of whole {CHUNK >> 20} MiB chunks, so at least "
                 f"{smallest:.2f} GB; larger sets spread the requests over more of the drive")
    from infinity.config.schema import AioConfig

    aio = AioConfig()
    root = tempfile.mkdtemp(prefix="bench_disk_mix_", dir=args.nvme_path)
    try:
        check_disk(root, int(args.gb * GB))
        t = time.perf_counter()
        files = create(root, args.gb * GB, aio)
        print(f"working set: {FILES} files, {sum(n for _, n in files) / GB:.1f} GB, written in "
              f"{time.perf_counter() - t:.1f} s; load average {os.getloadavg()[0]:.1f}", flush=True)
        for r in range(args.rounds):
            ws = working_set_bandwidth(files, CHUNK, 1, aio)
            harmonic = 2 / (1 / ws["read"] + 1 / ws["write"])
            line = (f"round {r}: read {ws['read'] / GB:.2f} GB/s, write {ws['write'] / GB:.2f} GB/s (harmonic "
                    f"{harmonic / GB:.2f}); at once {ws['mixed'] / GB:.2f} GB/s")
            for burst in (1, 4):
                line += f"; phased x{burst} {phased(files, burst, aio) / GB:.2f} GB/s"
            print(line, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
