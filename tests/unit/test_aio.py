"""infinity.aio: round trips, many requests in flight, threads, lifetimes, memory; both backends.

Writes are checked with plain file reads and reads against files written with plain file
writes, so a bug that is symmetric in our read and write paths cannot hide.
"""
import gc
import os
import threading
import weakref

import pytest
import torch

from infinity.aio import AioError, AsyncIO, aligned_empty

BACKENDS = ["io_uring", "threads"]
KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def shifted(n: int, shift: int) -> torch.Tensor:
    """A length-n uint8 view starting `shift` bytes into a page-aligned buffer."""
    return aligned_empty(n + shift, hugepage=False)[shift:]


def file_bytes(path, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


# size, file offset, memory shift: aligned, odd sizes, odd offsets, odd buffers, and mixes.
CASES = [
    (1, 0, 0), (1, 4095, 7), (511, 1, 0), (4095, 0, 0), (4096, 0, 0), (4096, 4096, 0),
    (4097, 0, 1), (4096, 1, 1), (4096, 1, 0), (12288, 4096, 100), (MiB + 3, 0, 0),
    (MiB, 4096, 2048), (3 * MiB + 4095, 4097, 3), (8 * MiB, 12345, 12345 % 4096),
    (8 * MiB + 4096, 8192, 0),
]


@pytest.mark.parametrize("size,offset,shift", CASES)
def test_round_trip(backend, tmp_path, size, offset, shift):
    path = tmp_path / "data.bin"
    data = random_bytes(size, seed=size + offset)
    src = shifted(size, shift)
    src.copy_(data)
    with AsyncIO(block_size=256 * KiB, queue_depth=8, backend=backend) as h:
        h.pwrite(src, path, offset)
        assert h.wait() == 1
        assert file_bytes(path, offset, size) == data.numpy().tobytes()
        dst = shifted(size, (shift + 1) % 4096)
        dst.zero_()
        h.pread(dst, path, offset)
        assert h.wait() == 1
        assert torch.equal(dst, data)


def test_read_of_plain_written_file(backend, tmp_path):
    path = tmp_path / "plain.bin"
    data = random_bytes(5 * MiB + 17, seed=3)
    path.write_bytes(data.numpy().tobytes())
    with AsyncIO(block_size=MiB, backend=backend) as h:
        for offset, n in [(0, 5 * MiB + 17), (1, 5 * MiB), (4096, MiB), (5 * MiB, 17)]:
            dst = torch.empty(n, dtype=torch.uint8)
            h.pread(dst, path, offset)
            h.wait()
            assert torch.equal(dst, data[offset:offset + n])


def test_256_mib_round_trip(backend, tmp_path):
    path = tmp_path / "big.bin"
    n = 256 * MiB
    src = aligned_empty(n // 4, torch.float32)
    src.copy_(torch.randn(n // 4, generator=torch.Generator().manual_seed(1)))
    with AsyncIO(block_size=MiB, queue_depth=32, backend=backend) as h:
        h.pwrite(src, path)
        h.wait()
        assert os.path.getsize(path) == n
        dst = aligned_empty(n // 4, torch.float32)
        h.pread(dst, path)
        h.wait()
    assert torch.equal(src, dst)


def test_many_requests_in_flight(backend, tmp_path):
    """128 requests of 64 KiB .. 1 MiB (some odd) at disjoint offsets of two files, one wait."""
    sizes = [64 * KiB * (1 + i % 16) + (i % 3) for i in range(128)]
    offsets = [sum(sizes[:i]) for i in range(128)]
    data = random_bytes(sum(sizes), seed=5)
    paths = [tmp_path / "a.bin", tmp_path / "b.bin"]
    with AsyncIO(block_size=128 * KiB, queue_depth=16, threads=2, backend=backend) as h:
        for i, (n, off) in enumerate(zip(sizes, offsets)):
            h.pwrite(data[off:off + n].clone(), paths[i % 2], off)
        assert h.wait() == 128
        out = torch.zeros_like(data)
        for i, (n, off) in enumerate(zip(sizes, offsets)):
            h.pread(out[off:off + n], paths[i % 2], off)
        assert h.wait() == 128
    for i, (n, off) in enumerate(zip(sizes, offsets)):
        assert torch.equal(out[off:off + n], data[off:off + n]), i


def test_neighbours_sharing_a_block(backend, tmp_path):
    """Adjacent unaligned writes in flight together must not overwrite each other's bytes."""
    path = tmp_path / "mosaic.bin"
    data = random_bytes(64 * 1000, seed=7)
    with AsyncIO(block_size=4096, queue_depth=64, backend=backend) as h:
        for i in range(64):
            h.pwrite(data[i * 1000:(i + 1) * 1000].clone(), path, i * 1000)
        h.wait()
    assert path.read_bytes() == data.numpy().tobytes()


def test_dtypes_and_sync_calls(backend, tmp_path):
    path = tmp_path / "typed.bin"
    g = torch.Generator().manual_seed(11)
    with AsyncIO(backend=backend) as h:
        offset = 0
        for dtype in [torch.float32, torch.bfloat16, torch.float16, torch.int64]:
            t = torch.randn(10_001, generator=g).to(dtype)
            assert h.sync_pwrite(t, path, offset) == t.numel() * t.element_size()
            back = torch.empty_like(t)
            assert h.sync_pread(back, path, offset) == t.numel() * t.element_size()
            assert torch.equal(back, t)
            offset += t.numel() * t.element_size()
        assert h.wait() == 0  # sync calls are not counted by wait


def test_handle_keeps_tensor_alive_until_wait(backend, tmp_path):
    with AsyncIO(backend=backend) as h:
        t = random_bytes(4 * MiB, seed=13)
        expected = t.numpy().tobytes()
        ref = weakref.ref(t)
        h.pwrite(t, tmp_path / "alive.bin")
        del t
        gc.collect()
        assert ref() is not None
        h.wait()
        gc.collect()
        assert ref() is None
    assert (tmp_path / "alive.bin").read_bytes() == expected


def test_wait_from_another_thread(backend, tmp_path):
    data = random_bytes(16 * MiB, seed=17)
    with AsyncIO(block_size=MiB, queue_depth=4, backend=backend) as h:
        for i in range(16):
            h.pwrite(data[i * MiB:(i + 1) * MiB], tmp_path / "bg.bin", i * MiB)
        result = []
        waiter = threading.Thread(target=lambda: result.append(h.wait()))
        waiter.start()
        waiter.join(timeout=60)
        assert not waiter.is_alive() and result == [16]
    assert (tmp_path / "bg.bin").read_bytes() == data.numpy().tobytes()


def test_wait_with_generous_timeout(backend, tmp_path):
    data = random_bytes(8 * MiB + 5, seed=31)
    pieces = [(i * MiB, MiB + (5 if i == 7 else 0)) for i in range(8)]
    with AsyncIO(block_size=256 * KiB, queue_depth=4, backend=backend) as h:
        assert h.wait(timeout=0) == 0  # nothing in flight: done at once
        for off, n in pieces:
            h.pwrite(data[off:off + n], tmp_path / "t.bin", off)
        assert h.wait(timeout=60, what="eight writes") == 8
        back = torch.zeros_like(data)
        for off, n in pieces:
            h.pread(back[off:off + n], tmp_path / "t.bin", off)
        assert h.wait(timeout=float("inf")) == 8
        assert h.wait(timeout=0) == 0
    assert torch.equal(back, data)


def test_wait_timeout_names_the_file_and_keeps_the_handle(backend, tmp_path):
    """A read far larger than 1 ms of any disk can move: wait(timeout=1e-6) gives up (rounded
    up to 1 ms), says on what and for what, and the next wait() collects the read intact.
    Should the read still beat the deadline, the next size is tried."""
    what = "the shard of transformer.h.3 (rank 0)"
    with AsyncIO(block_size=MiB, queue_depth=32, backend=backend) as h:
        for n in (64 * MiB, 256 * MiB):
            path = tmp_path / f"slow{n}.bin"
            src = aligned_empty(n // 8, torch.int64)
            torch.arange(n // 8, out=src)
            h.pwrite(src, path)
            assert h.wait() == 1
            dst = aligned_empty(n // 8, torch.int64)
            dst.zero_()
            h.pread(dst, path)
            try:
                h.wait(timeout=1e-6, what=what)
            except TimeoutError as e:
                message = str(e)
                break
            assert torch.equal(dst, src)  # it beat the deadline: all there, try a bigger one
        else:
            pytest.fail("a 256 MiB read finished within 1 ms twice; the timeout path was never taken")
        assert "1 request(s) still in flight" in message and "timeout=1e-06 s" in message
        assert str(path) in message and f"for {what}" in message and f"{n} bytes" in message
        assert "hung or very slow disk" in message and "raise the timeout" in message
        assert h.wait() == 1
        assert torch.equal(dst, src)
        assert h.in_flight() == 0 and h.wait(timeout=1.0) == 0


def test_wait_timeout_bad_arguments(tmp_path):
    with AsyncIO() as h:
        with pytest.raises(ValueError, match="timeout must be >= 0 seconds"):
            h.wait(timeout=-1)
        with pytest.raises(ValueError, match="timeout must be >= 0 seconds"):
            h.wait(timeout=float("nan"))
        with pytest.raises(TypeError, match="timeout must be a number of seconds or None, got str"):
            h.wait(timeout="5")
        with pytest.raises(TypeError, match="what must be a str"):
            h.wait(timeout=5, what=3)


def test_two_handles_from_two_threads(backend, tmp_path):
    failures = []

    def worker(k: int):
        try:
            with AsyncIO(block_size=256 * KiB, queue_depth=8, backend=backend) as h:
                for rep in range(8):
                    n = 3 * MiB + 1000 * rep + k
                    data = random_bytes(n, seed=100 * k + rep)
                    path = tmp_path / f"t{k}_{rep % 2}.bin"
                    h.pwrite(data, path, 4096 * rep + k)
                    h.wait()
                    back = torch.empty_like(data)
                    h.pread(back, path, 4096 * rep + k)
                    h.wait()
                    if not torch.equal(back, data):
                        failures.append((k, rep))
        except Exception as e:  # surfaced below
            failures.append((k, repr(e)))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert failures == []


def test_fsync_option_and_call(backend, tmp_path):
    data = random_bytes(MiB + 5, seed=19)
    with AsyncIO(fsync=True, backend=backend) as h:
        h.pwrite(data, tmp_path / "durable.bin")
        assert h.wait() == 1
        h.fsync(tmp_path / "durable.bin")
        h.fsync()
        with pytest.raises(ValueError, match="never opened"):
            h.fsync(tmp_path / "other.bin")
    assert (tmp_path / "durable.bin").read_bytes() == data.numpy().tobytes()


def test_buffered_mode(backend, tmp_path):
    data = random_bytes(2 * MiB + 3, seed=23)
    with AsyncIO(direct=False, backend=backend) as h:
        h.pwrite(data[1:], tmp_path / "buffered.bin", 5)
        h.wait()
        back = torch.empty(2 * MiB + 2, dtype=torch.uint8)
        h.pread(back, tmp_path / "buffered.bin", 5)
        h.wait()
    assert torch.equal(back, data[1:])


def test_empty_tensor_and_closed_handle(backend, tmp_path):
    h = AsyncIO(backend=backend)
    h.pwrite(torch.empty(0), tmp_path / "empty.bin")
    assert h.wait() == 1
    assert os.path.getsize(tmp_path / "empty.bin") == 0
    h.close()
    h.close()
    with pytest.raises(ValueError, match="closed"):
        h.pwrite(torch.zeros(1), tmp_path / "empty.bin")


def test_backend_selection(monkeypatch):
    for name in BACKENDS:
        with AsyncIO(backend=name) as h:
            assert h.backend == name
    monkeypatch.setenv("INFINITY_AIO_BACKEND", "threads")
    with AsyncIO() as h:
        assert h.backend == "threads"
    monkeypatch.setenv("INFINITY_AIO_BACKEND", "uring")
    with pytest.raises(ValueError, match="INFINITY_AIO_BACKEND='uring' is not one of"):
        AsyncIO()
    with pytest.raises(ValueError, match="backend='fast' is not one of"):
        AsyncIO(backend="fast")


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="block_size must be .* multiple of 4096"):
        AsyncIO(block_size=1000)
    with pytest.raises(ValueError, match="queue_depth"):
        AsyncIO(queue_depth=0)
    with pytest.raises(TypeError, match="threads must be an int"):
        AsyncIO(threads=1.5)
    with AsyncIO() as h:
        with pytest.raises(ValueError, match="not contiguous"):
            h.pwrite(torch.zeros(4, 4).t(), tmp_path / "x.bin")
        with pytest.raises(ValueError, match="offset must be an int >= 0"):
            h.pread(torch.zeros(4), tmp_path / "x.bin", -1)
        with pytest.raises(TypeError, match="expected a torch.Tensor"):
            h.pwrite(b"abc", tmp_path / "x.bin")


def test_aligned_empty():
    t = aligned_empty(3 * MiB + 1, torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t.shape == (3 * MiB + 1,) and t.is_contiguous()
    assert t.data_ptr() % (2 * MiB) == 0
    t.fill_(1.5)
    assert float(t[-1]) == 1.5
    small = aligned_empty(10, torch.int32, hugepage=False)
    assert small.data_ptr() % 4096 == 0 and small.numel() == 10
    assert aligned_empty(0, torch.float32).numel() == 0
    with pytest.raises(ValueError, match="numel must be >= 0"):
        aligned_empty(-1)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        aligned_empty(4, "float32")


def test_aligned_empty_memory_outlives_views():
    t = aligned_empty(MiB, torch.float32)
    view = t[10:20]
    del t
    gc.collect()
    view.fill_(2.0)  # would fault if the mapping had been released with the first tensor
    assert float(view.sum()) == 20.0


def test_error_is_an_oserror(tmp_path):
    with AsyncIO() as h:
        with pytest.raises(OSError) as info:
            h.pread(torch.zeros(1), tmp_path / "missing.bin")
    assert isinstance(info.value, AioError) and info.value.filename.endswith("missing.bin")


def test_tune_prints_a_config_section(tmp_path, capsys):
    import yaml

    from infinity.aio import tune
    from infinity.config import Config

    args = ["--path", str(tmp_path), "--size", "2M", "--block-sizes", "256K,1M",
            "--queue-depths", "2,4", "--threads", "1,2", "--reps", "1"]
    assert tune.main(args) == 0
    out = capsys.readouterr().out
    section = yaml.safe_load(out[out.index("aio:"):])
    assert set(section["aio"]) == {"block_size", "queue_depth", "threads"}
    assert section["aio"]["block_size"] in (256 << 10, 1 << 20)
    cfg = Config.from_dict(section)
    assert (cfg.aio.block_size, cfg.aio.queue_depth, cfg.aio.threads) == tuple(section["aio"].values())
    assert os.listdir(tmp_path) == []  # the probe file is gone
    with pytest.raises(SystemExit):
        tune.main(["--path", str(tmp_path / "nope")])


def test_garbage_collected_handle_finishes_and_closes(backend, tmp_path):
    fds_before = len(os.listdir("/proc/self/fd"))
    data = random_bytes(2 * MiB + 1, seed=29)
    h = AsyncIO(backend=backend)
    for i in range(4):
        h.pwrite(data, tmp_path / f"gc{i}.bin")
    del h
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == fds_before
    for i in range(4):
        assert (tmp_path / f"gc{i}.bin").read_bytes() == data.numpy().tobytes()
