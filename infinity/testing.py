"""Run a function on N gloo ranks in their own processes, for tests (and for users' own tests).

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes (Note [ranks from a
forkserver]), each with its torch threads set, a gloo process group over loopback, and the
torchrun environment variables.
It returns every rank's return value (rank order), re-raises a failing rank's traceback,
and fails instead of hanging when a rank hangs, dies or exits early.

Beside it, what tests, benchmarks and the tools in ``scripts/`` measure or check with: the
resident set (``rss_now``, ``peak_rss``), I/O fault injection, checkpoints written without a
model (``write_checkpoint``) and checked file by file (``verify_checkpoint``), the bytes under
a swap directory (``dir_bytes``), and the run model that ``infinity.estimate --step-time``
predicts with (``Run``, ``Rates``, ``step_time``, ``host_memory``, ``compute_rate``,
``adam_rate``: Note [run model] in _apps/_runmodel.py).

And what the benchmarks in ``scripts/`` read or drive below the public API, each for one reason:

- ``CheckpointReader``: a checkpoint's manifest and files, read without a model.
- ``new_aio``: an ``AsyncIO`` handle set up from an ``aio`` config section as the swap files' are.
- ``chunk_elems``: elements per optimizer swap chunk, as the engine picks them.
- ``host_account``: this process's host memory by category now (``telemetry`` gives it per engine).
- ``use_block_cache``, ``stop_block_cache``, ``RELEASE_CACHE_CAP``: the block cache turned on and
  off between steps, to compare it with glibc's allocator.
- ``is_parameter_like``: which saved tensors activation offload leaves where they are.
- ``collective_calls``: how many of each collective this process has issued.
- ``range_kind``: an engine profiler range's kind, its unit's name dropped (the step profile's trace table).
- ``parse_bytes``: a size as the config reads one ("24GB", "512MiB", bytes).
- ``checksummed``, ``crc32c_hardware``, ``native_aio``: the swap files' block sums, whether CRC32C
  runs in hardware here, and the aio library's cffi module (``ffi``, ``lib``), for the checksum bench.
- ``clone_support``, ``fs_type``: whether a directory's filesystem clones ranges, and its type.
- ``device_memory_allocated``, ``device_memory_peak``, ``reset_device_memory_peak``,
  ``cap_device_memory``: the device's allocated bytes (CUDA's ``memory_allocated``, the emulated
  device's) and their peak, and a cap past which its allocations raise ``torch.OutOfMemoryError``
  (the GPU check's out-of-memory phase); ``device_memory_settled`` and ``wait_device_memory``: the
  allocated bytes with nothing in flight or unreferenced, and those bytes once back to a level.
"""
from __future__ import annotations

import gc
import io
import json
import multiprocessing as mp
import multiprocessing.forkserver
import os
import queue
import socket
import struct
import time
import traceback
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from ._apps._runmodel import Rates, Run, adam_rate, compute_rate, host_memory, step_time  # noqa: F401
from ._checkpoint import CheckpointReader
from ._checkpoint._legacy import is_legacy, refuse
from ._offload._memory_plan import RELEASE_CACHE_CAP, host_account, stop_block_cache, use_block_cache  # noqa: F401
from ._offload._optimizer_store import chunk_elems  # noqa: F401
from ._offload._swap import dir_bytes, new_aio  # noqa: F401 - dir_bytes: the bytes under a swap directory
from ._runtime import _accelerator as acc
from ._runtime import _comm
from ._runtime._accelerator import cap_memory as cap_device_memory  # noqa: F401
from ._runtime._accelerator import max_memory_allocated as device_memory_peak  # noqa: F401
from ._runtime._accelerator import memory_allocated as device_memory_allocated  # noqa: F401
from ._runtime._accelerator import reset_peak_memory_stats as reset_device_memory_peak  # noqa: F401
from ._runtime._telemetry_counters import range_kind  # noqa: F401
from ._zero._activation_offload import _is_parameter_like as is_parameter_like  # noqa: F401
from ._zero._pretrained import _DTYPES
from .aio import _native as native_aio  # noqa: F401
from .aio._checksum import checksummed, crc32c_hardware  # noqa: F401
from .aio._clone import clone_support, fs_type  # noqa: F401
from .aio._inject import inject as inject_io_fault  # noqa: F401 - fault injection at the I/O layer
from .aio._inject import io_fault  # noqa: F401
from .config import _parse_bytes as parse_bytes  # noqa: F401
from .errors import UsageError


def device_memory_settled() -> int:
    """The device's allocated bytes once its queued work and copies landed and nothing
    unreferenced is left (a queued copy holds its tensors, as CUDA's allocator keeps a block
    recorded on a stream until the stream is past it)."""
    acc.synchronize()
    gc.collect()
    return acc.memory_allocated()


def wait_device_memory(level: int, *, at_most: bool = False, timeout: float = 30.0) -> int:
    """The settled bytes once they are back to ``level`` (``at_most``: to it or below), or after
    ``timeout`` seconds: the device's autograd thread drops what a failed backward left queued a
    moment after the caller got the exception (as on CUDA). The caller compares; never a timing."""
    deadline = time.monotonic() + timeout
    while True:
        now = device_memory_settled()
        if (now <= level if at_most else now == level) or time.monotonic() > deadline:
            return now
        time.sleep(0.01)


class RankFailure(AssertionError):
    """A rank raised, died or exited without finishing; the message holds its traceback."""


class RankTimeout(RankFailure):
    """Some ranks did not finish within the timeout."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def _rank_main(fn, rank, world_size, port, threads, env, args, kwargs, results):
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        torch.set_num_threads(threads)
        _comm.release_captured_groups()  # Note [process group at exit] in _comm.py: imported before the group
        acc.set_device()  # this rank's GPU before the group: NCCL binds to it
        # the backend a torchrun job gets (cpu:gloo,cuda:nccl on CUDA; gloo elsewhere)
        dist.init_process_group(acc.comm_backend(), rank=rank, world_size=world_size, device_id=acc.comm_device_id())
        try:
            value = fn(*args, **kwargs)
            # Report before teardown: a peer closing its sockets first must not cost the result.
            results.put((rank, "ok", _dumps(value)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every failure is reported to the parent
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn: Callable, world_size: int, *args, timeout: float = 180.0, threads: int | None = None,
              env: dict | None = None, **kwargs) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks (gloo, with NCCL for CUDA tensors);
    return their results. ``env`` is set in each rank before its process group is made, but after
    ``fn``'s module (and so infinity) is imported: what is read at import, such as
    ``INFINITY_ACCELERATOR``, comes from this process's environment; a rank computes on the
    emulated device by entering ``_accelerator.using("emulated")`` in ``fn``.

    ``fn`` must be importable (a module-level function). ``threads`` defaults to the
    machine's cores divided among the ranks, at least one, so ranks don't fight for cores.
    """
    if world_size < 1:
        raise UsageError(f"world_size must be >= 1, got {world_size}")
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    ctx = _rank_context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world_size, port, threads, dict(env or {}), args, kwargs, results),
                    daemon=True, name=f"rank{r}")
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        return _collect(procs, results, world_size, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)


# Note [ranks from a forkserver]
# Most of a rank's start is importing torch (and the model library a test builds). Ranks are
# forked from multiprocessing's forkserver, which imports ``_PRELOAD`` once, instead of each
# being a fresh interpreter. Infinity itself is never preloaded: it reads its environment at
# import (INFINITY_ACCELERATOR, the log level), and a rank must read the environment of the
# run_ranks call that starts it. The forkserver is a fresh interpreter started with the
# environment of its first use, and its children inherit that environment, so it is restarted
# whenever this process's environment (or the preload list) differs from the one it was started
# with (all but PYTEST_CURRENT_TEST, which pytest changes at every test: a rank sees the value
# of the server's start). With CUDA the ranks are spawned as before: a forked rank must not
# inherit a process that touched the driver, and what a model library does at import is not
# ours to vouch for.
_PRELOAD: List[str] = ["torch", "torch.distributed"]
_server_started_with: Optional[tuple] = None


def preload_in_ranks(*modules: str) -> None:
    """Import ``modules`` once in the process ranks are forked from (Note [ranks from a
    forkserver]), so that each rank of ``run_ranks`` starts with them imported. A module that
    is missing is skipped. Infinity's own modules are refused: they read the environment at
    import, and each rank's must be its own."""
    for m in modules:
        if m == "infinity" or m.startswith("infinity."):
            raise UsageError(f"preload_in_ranks({m!r}): infinity reads its environment at import, so each "
                             "rank imports it itself; preload only the libraries under it (torch, transformers)")
        if m not in _PRELOAD:
            _PRELOAD.append(m)


def _rank_context():
    """The multiprocessing context ranks start from: the forkserver, restarted when the
    environment or the preload list changed since it started; spawn with CUDA."""
    global _server_started_with
    if acc.has_cuda():
        return mp.get_context("spawn")
    started_with = (tuple(_PRELOAD), tuple(sorted((k, v) for k, v in os.environ.items()
                                                  if k != "PYTEST_CURRENT_TEST")))
    if _server_started_with is not None and started_with != _server_started_with:
        multiprocessing.forkserver._forkserver._stop()  # the next rank starts a server with this environment
    _server_started_with = started_with
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


def _collect(procs, results, world_size, timeout):
    deadline = time.monotonic() + timeout
    values: dict = {}
    exited_at: dict = {}
    while len(values) < world_size:
        try:
            rank, status, payload = results.get(timeout=0.1)
        except queue.Empty:
            rank = None
        if rank is not None:
            if status == "error":
                raise RankFailure(f"rank {rank} of {world_size} raised:\n{payload}")
            values[rank] = _loads(payload)
            continue
        now = time.monotonic()
        for r, p in enumerate(procs):
            if r in values or p.is_alive():
                continue
            # Give the queue's feeder a moment: a rank may have reported just before exiting.
            exited_at.setdefault(r, now)
            if now - exited_at[r] > 2.0:
                raise RankFailure(f"rank {r} of {world_size} exited with code {p.exitcode} before finishing")
        if now > deadline:
            hung = [r for r in range(world_size) if r not in values]
            raise RankTimeout(f"ranks {hung} of {world_size} did not finish within {timeout:.0f}s (hung or deadlocked)")
    return [values[r] for r in range(world_size)]


def collective_calls() -> dict:
    """How many of each collective (all_gather, reduce_scatter, ...) this process has issued."""
    return dict(_comm.counters.snapshot()["calls"])


def rss_now() -> int:
    """This process's resident set, in bytes (VmRSS)."""
    return _status_bytes("VmRSS")


def peak_rss() -> int:
    """This process's peak resident set since start or the last ``reset_peak_rss``, in bytes (VmHWM)."""
    return _status_bytes("VmHWM")


def reset_peak_rss() -> None:
    """Restart the peak resident set from the current one (Linux: ``/proc/self/clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def verify_checkpoint(path: str, *, trust_pickle: bool = False) -> dict:
    """Check every file of the checkpoint at ``path`` (a tag's directory) against its manifest,
    kind, size and checksum, without a process group or a model, parsing nothing before its
    bytes are checked (Note [data, never code] in _checkpoint/_files.py); return the manifest.
    A file that is missing, of another size or kind, fails its checksum or does not parse as
    its kind raises ``StorageError`` naming it. A checkpoint of format version 1 or 2 (whose
    extra.pt and rng.pt are pickles, which this never reads) is refused unless ``trust_pickle``."""
    reader = CheckpointReader(path)
    try:
        if is_legacy(reader.manifest) and not trust_pickle:
            raise refuse(os.fspath(path), reader.manifest, "verify_checkpoint")
        reader.verify(reader.manifest["files"])
    finally:
        reader.close()
    return reader.manifest


def write_checkpoint(config, out_dir: str, dtype=None, shard_bytes: int = 2 << 30, fill: str = "random",
                     seed: int = 0) -> dict:
    """Write a Hugging Face checkpoint directory for ``config`` (``config.json``, safetensors
    shards, ``model.safetensors.index.json`` when sharded) without ever holding the model:
    tensors are written one by one, from a fixed random block (``fill="random"``: N(0, 0.02)
    for matrices, ones for vectors) or as holes in sparse files (``fill="sparse"``: reads
    return zeros, the disk holds nothing). For benchmarks and tests of loading models larger
    than host memory. Returns {"files": [...], "bytes": tensor bytes, "params": count}."""
    from transformers import AutoModelForCausalLM  # optional (the hf extra) and slow to import

    if fill not in ("random", "sparse"):
        raise UsageError(f"fill must be 'random' or 'sparse', got {fill!r}")
    dtype = dtype or torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors, seen = [], set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            tensors.append((name, tuple(p.shape), p.numel() * dtype.itemsize))
    shards = _shards_of(tensors, shard_bytes)
    os.makedirs(out_dir, exist_ok=True)
    config.save_pretrained(out_dir)
    gen = torch.Generator().manual_seed(seed)
    fills = {"matrix": (torch.randn(1 << 22, generator=gen) * 0.02).to(dtype).view(torch.uint8),
             "vector": torch.ones(1, dtype=dtype).view(torch.uint8)} if fill == "random" else None
    files, weight_map = [], {}
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        files.append(_write_shard(os.path.join(out_dir, fname), shard, _DTYPE_NAMES[dtype], fills))
        weight_map.update((name, fname) for name, _, _ in shard)
    total = sum(t[2] for t in tensors)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    return {"files": files, "bytes": total, "params": total // dtype.itemsize}


_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}  # torch dtype -> safetensors' name


def _shards_of(tensors: list, shard_bytes: int) -> List[list]:
    """(name, shape, bytes) of each tensor, cut in order into shards of at most ``shard_bytes``
    (a tensor larger than that alone in its shard)."""
    shards, current, size = [], [], 0
    for t in tensors:
        if current and size + t[2] > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += t[2]
    shards.append(current)
    return shards


def _write_shard(path: str, shard: list, dtype_name: str, fills: Optional[dict]) -> str:
    """One safetensors file of ``shard``'s tensors: its header, then each tensor's bytes
    repeated from ``fills`` (``matrix`` / ``vector``), or left a hole (``fills`` None)."""
    header, offset = {}, 0
    for name, shape, nbytes in shard:
        header[name] = {"dtype": dtype_name, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape, nbytes in shard:
            if fills is None:
                f.seek(nbytes, os.SEEK_CUR)
                continue
            src = fills["vector"].repeat(nbytes // fills["vector"].numel()) if len(shape) == 1 else fills["matrix"]
            left = nbytes
            while left:
                n = min(left, src.numel())
                f.write(memoryview(src[:n].numpy()))
                left -= n
        f.truncate(f.tell())
    return path
