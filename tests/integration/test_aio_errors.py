"""infinity.aio failures: each is an AioError naming the path, nothing is left in flight, and
the handle keeps working; a failure of the system (no threads for the pool) comes back as -errno
at the C ABI, never a C++ exception reaching std::terminate. Also the fallbacks: O_DIRECT refused,
io_uring disabled, a build without liburing. Real file systems are mounted where a failure needs one (tests run as root).
"""
import contextlib
import errno
import fcntl
import importlib.util
import logging
import os
import struct
import subprocess
import sys
import textwrap

import pytest
import torch

from infinity._runtime._log import logger
from infinity.aio import AioError, AsyncIO

BACKENDS = ["io_uring", "threads"]
MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@contextlib.contextmanager
def mounted(fstype: str, where, options: str = ""):
    where.mkdir()
    cmd = ["mount", "-t", fstype] + (["-o", options] if options else []) + [fstype, str(where)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a {fstype} for this test ({' '.join(cmd)}): {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.fixture
def warnings_seen():
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def assert_usable(h: AsyncIO, path) -> None:
    """After an error: nothing in flight, and a fresh round trip works."""
    assert h.in_flight() == 0
    assert h.wait() == 0
    data = torch.arange(3000, dtype=torch.int16)
    h.pwrite(data, path, 1)
    assert h.wait() == 1
    back = torch.empty_like(data)
    h.pread(back, path, 1)
    h.wait()
    assert torch.equal(back, data)


def test_missing_directory(backend, tmp_path):
    path = tmp_path / "no" / "such" / "dir" / "f.bin"
    with AsyncIO(backend=backend) as h:
        with pytest.raises(AioError, match="No such file or directory") as info:
            h.pwrite(torch.zeros(10), path, 8)
        e = info.value
        assert e.errno == errno.ENOENT and e.filename == str(path) and str(path) in str(e)
        assert (e.op, e.offset, e.length) == ("write", 8, 40)
        with pytest.raises(AioError, match="missing.bin"):
            h.pread(torch.zeros(10), tmp_path / "missing.bin")
        assert_usable(h, tmp_path / "ok.bin")


@pytest.mark.parametrize("file_size", [3 * MiB, 3 * MiB + 100])
def test_read_past_end_of_file(backend, tmp_path, file_size):
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(file_size))
    with AsyncIO(block_size=MiB, backend=backend) as h:
        good = torch.empty(MiB, dtype=torch.uint8)
        h.pread(good, path, 0)
        h.pread(torch.empty(4 * MiB, dtype=torch.uint8), path, 0)
        h.pread(torch.empty(1, dtype=torch.uint8), path, 10 * MiB)
        with pytest.raises(AioError, match="end of file") as info:
            h.wait()
        e = info.value
        assert e.errno == errno.ENODATA and e.filename == str(path)
        assert (e.op, e.offset, e.length) in {("read", 0, 4 * MiB), ("read", 10 * MiB, 1)}
        assert "1 more request(s) failed" in str(e)
        assert_usable(h, tmp_path / "ok.bin")


def test_wait_with_timeout_still_reports_failures(backend, tmp_path):
    """The timed part of wait consumes nothing: the failure is raised by the same call."""
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(MiB))
    with AsyncIO(backend=backend) as h:
        h.pread(torch.empty(2 * MiB, dtype=torch.uint8), path, 0)
        with pytest.raises(AioError, match="end of file") as info:
            h.wait(timeout=60, what="a read past the end")
        assert info.value.filename == str(path) and info.value.length == 2 * MiB
        assert_usable(h, tmp_path / "ok.bin")


def test_permission_error_for_root(backend, tmp_path):
    """An immutable file (chattr +i) refuses writes even to root."""
    path = tmp_path / "locked.bin"
    path.write_bytes(b"x" * 100)
    FS_IOC_GETFLAGS, FS_IOC_SETFLAGS, FS_IMMUTABLE_FL = 0x80086601, 0x40086602, 0x10
    fd = os.open(path, os.O_RDONLY)
    try:
        flags = struct.unpack("i", fcntl.ioctl(fd, FS_IOC_GETFLAGS, struct.pack("i", 0)))[0]
        fcntl.ioctl(fd, FS_IOC_SETFLAGS, struct.pack("i", flags | FS_IMMUTABLE_FL))
    except OSError as e:
        os.close(fd)
        pytest.skip(f"the file system under {tmp_path} cannot mark files immutable: {e}")
    try:
        with AsyncIO(backend=backend) as h:
            with pytest.raises(AioError, match="Operation not permitted") as info:
                h.pwrite(torch.ones(4), path)
            assert info.value.errno == errno.EPERM and str(path) in str(info.value)
            back = torch.empty(100, dtype=torch.uint8)
            h.pread(back, path)  # reading stays allowed
            h.wait()
            assert bytes(back.numpy()) == b"x" * 100
            assert_usable(h, tmp_path / "ok.bin")
    finally:
        fcntl.ioctl(fd, FS_IOC_SETFLAGS, struct.pack("i", flags))
        os.close(fd)


def test_read_only_file_system(backend, tmp_path):
    with mounted("tmpfs", tmp_path / "ro", "ro,size=1m"), AsyncIO(backend=backend) as h:
        with pytest.raises(AioError, match="Read-only file system") as info:
            h.pwrite(torch.ones(4), tmp_path / "ro" / "f.bin")
        assert info.value.errno == errno.EROFS


def test_full_disk(backend, tmp_path):
    with mounted("tmpfs", tmp_path / "small", "size=1m") as small:
        path = small / "big.bin"
        with AsyncIO(block_size=256 * 1024, backend=backend) as h:
            h.pwrite(torch.ones(MiB, dtype=torch.float32), path)  # 4 MiB into 1 MiB
            h.pwrite(torch.ones(1000, dtype=torch.uint8), path, 4 * MiB + 1)
            with pytest.raises(AioError, match="No space left on device") as info:
                h.wait()
            e = info.value
            assert e.errno == errno.ENOSPC and e.filename == str(path) and e.op == "write"
            assert h.in_flight() == 0
            os.truncate(path, 0)  # the handle keeps the file open: free its blocks
            assert_usable(h, small / "after.bin")


def test_o_direct_refused_falls_back(backend, tmp_path, warnings_seen):
    """ramfs refuses O_DIRECT (EINVAL): buffered I/O with one logged warning, correct data."""
    with mounted("ramfs", tmp_path / "ram") as ram:
        data = torch.randint(0, 256, (3 * MiB + 7,), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(0))
        with AsyncIO(backend=backend) as h:
            h.pwrite(data, ram / "f.bin", 3)
            h.wait()
            back = torch.empty_like(data)
            h.pread(back, ram / "f.bin", 3)
            h.wait()
        assert torch.equal(back, data)
        assert (ram / "f.bin").read_bytes()[3:] == data.numpy().tobytes()
    if not any("refuses O_DIRECT" in m for m in warnings_seen):
        # Logged once per process: another test may have seen this file system first.
        from infinity.aio._handle import _WARNED

        assert any("refuses O_DIRECT" in m for m in _WARNED)


@pytest.mark.machine  # writes a machine-wide sysctl: opt in with -m machine
def test_io_uring_disabled_falls_back(tmp_path, warnings_seen):
    knob = "/proc/sys/kernel/io_uring_disabled"
    try:
        with open(knob) as f:
            old = f.read().strip()
        with open(knob, "w") as f:
            f.write("2")
    except OSError as e:
        pytest.skip(f"cannot set kernel.io_uring_disabled for this test: {e}")
    try:
        h = AsyncIO()
        with pytest.raises(RuntimeError, match="backend 'io_uring' is unavailable: io_uring_queue_init failed"):
            AsyncIO(backend="io_uring")
    finally:
        with open(knob, "w") as f:
            f.write(old)
    with h:
        assert h.backend == "threads"
        assert_usable(h, tmp_path / "ok.bin")
    from infinity.aio._handle import _WARNED

    assert any("io_uring unavailable" in m and "io_uring_disabled" in m for m in _WARNED + warnings_seen)


def test_build_without_liburing(tmp_path, monkeypatch):
    """The same sources built with INFINITY_AIO_NO_URING=1: auto picks threads and says why."""
    monkeypatch.setenv("INFINITY_AIO_NO_URING", "1")
    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location("aio_build", os.path.join(ROOT, "native/aio/build.py"))
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    assert not build._URING
    so = build.ffibuilder.compile(tmpdir=str(tmp_path))
    spec = importlib.util.spec_from_file_location("nouring._aio_cffi", so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ffi, lib = mod.ffi, mod.lib
    assert lib.infinity_aio_has_uring() == 0
    out, why = ffi.new("infinity_aio **"), ffi.new("char[256]")
    assert lib.infinity_aio_create(1, MiB, 8, 1, out, why, 256) == -errno.ENOSYS
    assert lib.infinity_aio_create(0, MiB, 8, 1, out, why, 256) == 0
    assert b"liburing" in ffi.string(why) and lib.infinity_aio_backend(out[0]) == 2
    path = str(tmp_path / "f.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    data = bytearray(os.urandom(MiB + 5))
    rid = lib.infinity_aio_submit(out[0], 1, -1, fd, ffi.from_buffer(data), len(data), 0, ffi.NULL)
    n_errs, horizon = ffi.new("int32_t *"), ffi.new("int64_t *")
    errs = ffi.new("infinity_aio_error[4]")
    assert rid == 0 and lib.infinity_aio_wait(out[0], errs, 4, n_errs, horizon) == 1
    assert n_errs[0] == 0 and horizon[0] == 1
    lib.infinity_aio_destroy(out[0])
    os.close(fd)
    with open(path, "rb") as f:
        assert f.read() == bytes(data)


_NO_THREADS = textwrap.dedent("""
    import resource
    from infinity.aio import AsyncIO
    from infinity.errors import EngineError
    # Address space for what is mapped now and a little more: a 64-thread pool's stacks do not fit.
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (96 << 20), resource.RLIM_INFINITY))
    try:
        AsyncIO(backend="threads", threads=8, queue_depth=8)
    except EngineError as e:
        print("refused:", e)
    else:
        print("created")
""")


def test_thread_creation_failure_is_an_error_not_an_abort():
    r = subprocess.run([sys.executable, "-c", _NO_THREADS], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, f"the process died ({r.returncode}): {r.stderr[-2000:]}"
    out = r.stdout.strip()
    if out == "created":
        pytest.skip("the address-space limit did not stop thread creation here")
    assert out.startswith("refused:") and ("Resource temporarily unavailable" in out or "memory" in out), out
