"""The native libraries at their own interfaces, below the Python wrappers.

native/aio through its C ABI (``infinity_aio_*`` in native/aio/infinity_aio.h, called through
the cffi module ``infinity._aio_cffi``): bad arguments are ``-EINVAL`` and create nothing, bytes
round-trip at every alignment on each backend, a failed request reports its piece in an
``infinity_aio_error``, the block-sum table records writes and catches a corrupt block, CRC32C
has its published value on both implementations, the aligned allocator's pages are given back,
and a request held back by an injected stall is seen in flight.

native/cpu_adam through its binding (``infinity._cpu_adam.step``: raw addresses, counts and
dtype codes; nothing there knows torch) against the Adam formula written out in numpy float32,
one operation at a time in the kernel's order: the scalar path equals it bit for bit, the SIMD
paths stay close to it, low-precision gradients widen and outputs round as the reference
conversions do, and bad arguments are refused before any element is touched."""
from __future__ import annotations

import errno
import os
import zlib

import numpy as np
import pytest
import torch

aio_cffi = pytest.importorskip("infinity._aio_cffi", reason="native/aio is not built")
ffi, lib = aio_cffi.ffi, aio_cffi.lib

KiB, MiB = 1 << 10, 1 << 20
READ, WRITE = 0, 1  # INFINITY_AIO_READ, INFINITY_AIO_WRITE
URING, THREADS = 1, 2  # INFINITY_AIO_URING, INFINITY_AIO_THREADS
FAULT_STALL = 3  # INFINITY_AIO_FAULT_STALL


# ---------------------------------------------------------------- native/aio


def _handle(backend: int, block_size: int = 64 * KiB):
    out, why = ffi.new("infinity_aio **"), ffi.new("char[256]")
    rc = lib.infinity_aio_create(backend, block_size, 16, 2, out, why, 256)
    if rc < 0 and backend == URING:
        pytest.skip(f"io_uring is not available here: {ffi.string(why).decode()}")
    assert rc == 0, (rc, ffi.string(why))
    return ffi.gc(out[0], lib.infinity_aio_destroy)


def _backends():
    return [THREADS] + ([URING] if lib.infinity_aio_has_uring() else [])


def _fds(path: str):
    """(fd_direct or -1 where the file system refuses O_DIRECT, fd_buffered)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        direct = os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError:
        direct = -1
    return direct, fd


def _close(*fds):
    for fd in fds:
        if fd >= 0:
            os.close(fd)


def _wait(h, max_errs: int = 4):
    """(completed, [errors], horizon) of infinity_aio_wait."""
    errs, n_errs, horizon = ffi.new(f"infinity_aio_error[{max_errs}]"), ffi.new("int32_t *"), ffi.new("int64_t *")
    done = lib.infinity_aio_wait(h, errs, max_errs, n_errs, horizon)
    return done, [errs[i] for i in range(min(n_errs[0], max_errs))], horizon[0]


def test_bad_arguments_are_einval_and_create_nothing(tmp_path):
    out, why = ffi.new("infinity_aio **"), ffi.new("char[64]")
    for backend, block, depth, threads in [(THREADS, 1000, 8, 1), (THREADS, 0, 8, 1), (THREADS, 4 * KiB, 0, 1),
                                           (THREADS, 4 * KiB, 8, 0), (3, 4 * KiB, 8, 1), (-1, 4 * KiB, 8, 1)]:
        assert lib.infinity_aio_create(backend, block, depth, threads, out, why, 64) == -errno.EINVAL
        assert out[0] == ffi.NULL
    assert lib.infinity_aio_create(THREADS, 4 * KiB, 8, 1, ffi.NULL, why, 64) == -errno.EINVAL

    h = _handle(THREADS)
    direct, fd = _fds(str(tmp_path / "f"))
    buf = ffi.new("char[]", 4 * KiB)
    try:
        for op, fd_direct, fd_buffered, b, length, offset in [
                (2, direct, fd, buf, 4 * KiB, 0),          # no such op
                (READ, direct, -1, buf, 4 * KiB, 0),       # the buffered descriptor is required
                (READ, -2, fd, buf, 4 * KiB, 0),           # -1 is "no O_DIRECT", nothing below it
                (READ, direct, fd, buf, -1, 0),
                (READ, direct, fd, buf, 4 * KiB, -4096),
                (WRITE, direct, fd, ffi.NULL, 4 * KiB, 0)]:
            assert lib.infinity_aio_submit(h, op, fd_direct, fd_buffered, b, length, offset, ffi.NULL) == -errno.EINVAL
            err = ffi.new("infinity_aio_error *")
            assert lib.infinity_aio_rw(h, op, fd_direct, fd_buffered, b, length, offset, ffi.NULL, err) == -errno.EINVAL
        assert lib.infinity_aio_in_flight(h) == 0
        assert _wait(h) == (0, [], 0)  # nothing was queued: no id was taken
    finally:
        _close(direct, fd)

    sums = ffi.new("infinity_aio_sums **")
    assert lib.infinity_aio_sums_create(-1, sums) == -errno.EINVAL
    assert lib.infinity_aio_sums_create(MiB, ffi.NULL) == -errno.EINVAL
    assert lib.infinity_aio_sums_create(MiB, sums) == 0
    table = ffi.gc(sums[0], lib.infinity_aio_sums_destroy)
    entries = ffi.new("uint64_t[4]")
    assert lib.infinity_aio_sums_get(table, -1, 4, entries) == -errno.EINVAL
    assert lib.infinity_aio_sums_get(table, 0, 4, ffi.NULL) == -errno.EINVAL
    assert lib.infinity_aio_sums_set(table, 0, -1, entries) == -errno.EINVAL

    huge = ffi.new("int32_t *")
    p = lib.infinity_aio_alloc(64 * KiB, 0, huge)
    try:
        assert lib.infinity_aio_release(p, 64 * KiB, 1000) == -errno.EINVAL  # not a page size
        assert lib.infinity_aio_release(ffi.NULL, 64 * KiB, 4096) == -errno.EINVAL
        assert lib.infinity_aio_resident(ffi.cast("char *", p) + 1, 4 * KiB) == -errno.EINVAL  # not page aligned
    finally:
        lib.infinity_aio_free(p, 64 * KiB, 0)


@pytest.mark.parametrize("backend", _backends(), ids=lambda b: {URING: "io_uring", THREADS: "threads"}[b])
@pytest.mark.parametrize("mem_shift, offset, length", [
    (0, 0, 256 * KiB),                 # whole blocks, aligned memory: straight through O_DIRECT
    (0, 4 * KiB, 200 * KiB + 123),     # a partial block at the end
    (1, 100, 3 * 64 * KiB + 1),        # unaligned memory and offset: bounce buffers, partial blocks at both ends
    (0, 7, 10),                        # inside one block
])
def test_bytes_round_trip_at_every_alignment(tmp_path, backend, mem_shift, offset, length):
    h = _handle(backend)
    direct, fd = _fds(str(tmp_path / "f"))
    data = np.random.default_rng(length).integers(0, 256, length, dtype=np.uint8).tobytes()
    src = ffi.new("char[]", length + 8)
    dst = ffi.new("char[]", length + 8)
    ffi.memmove(src + mem_shift, data, length)
    try:
        first = lib.infinity_aio_submit(h, WRITE, direct, fd, src + mem_shift, length, offset, ffi.NULL)
        assert first >= 0
        assert _wait(h) == (1, [], first + 1)  # the horizon: the first id this wait did not cover
        assert os.pread(fd, length, offset) == data
        err = ffi.new("infinity_aio_error *")
        assert lib.infinity_aio_rw(h, READ, direct, fd, dst + mem_shift, length, offset, ffi.NULL, err) == 0
        assert ffi.buffer(dst + mem_shift, length)[:] == data
        assert lib.infinity_aio_in_flight(h) == 0
        assert lib.infinity_aio_ring_error(h) == 0
    finally:
        _close(direct, fd)


@pytest.mark.parametrize("backend", _backends(), ids=lambda b: {URING: "io_uring", THREADS: "threads"}[b])
def test_a_failed_request_reports_its_piece(tmp_path, backend):
    h = _handle(backend, block_size=4 * KiB)
    direct, fd = _fds(str(tmp_path / "f"))
    os.pwrite(fd, b"x" * (8 * KiB), 0)  # two blocks; the read asks for four
    buf = ffi.new("char[]", 16 * KiB)
    try:
        ok = lib.infinity_aio_submit(h, READ, direct, fd, buf, 4 * KiB, 0, ffi.NULL)
        rid = lib.infinity_aio_submit(h, READ, direct, fd, buf, 16 * KiB, 0, ffi.NULL)
        assert (ok, rid) == (0, 1)
        done, errs, horizon = _wait(h)
        assert (done, horizon) == (2, 2) and len(errs) >= 1
        for e in errs:  # each failed piece lies past the end of the file, and belongs to the second request
            assert (e.id, e.op, e.err) == (rid, READ, errno.ENODATA)
            assert 8 * KiB <= e.offset < 16 * KiB and 0 < e.length <= 16 * KiB - e.offset
            assert 0 <= e.transferred < e.length
        assert _wait(h) == (0, [], 2)  # the errors were handed over once

        closed = os.open(str(tmp_path / "g"), os.O_RDWR | os.O_CREAT, 0o644)
        os.close(closed)
        err = ffi.new("infinity_aio_error *")
        rc = lib.infinity_aio_rw(h, WRITE, -1, closed, buf, 4 * KiB, 0, ffi.NULL, err)
        assert rc == -errno.EBADF and (err.err, err.op, err.offset) == (errno.EBADF, WRITE, 0)
    finally:
        _close(direct, fd)


def test_crc32c_has_its_published_value_on_both_implementations():
    check = b"123456789"  # the CRC catalogue's check value for CRC-32C (Castagnoli)
    for impl in (0, 1):
        assert lib.infinity_aio_crc32c(0, check, len(check), impl) == 0xE3069283
        assert lib.infinity_aio_crc32c(0, b"", 0, impl) == 0
    assert lib.infinity_aio_crc32c_hardware() in (0, 1)
    data = np.random.default_rng(0).integers(0, 256, 3 * 4096 + 77, dtype=np.uint8).tobytes()
    for n in (1, 7, 8, 63, 4096, len(data)):
        fast, ref = (lib.infinity_aio_crc32c(0, data, n, impl) for impl in (0, 1))
        assert fast == ref, n
        head = lib.infinity_aio_crc32c(0, data, n // 3, 0)  # continuing a sum is summing the whole
        assert lib.infinity_aio_crc32c(head, data[n // 3:], n - n // 3, 0) == fast
    blocks = ffi.new("uint32_t[3]")
    lib.infinity_aio_crc32c_blocks(data, 3, blocks)
    assert list(blocks) == [lib.infinity_aio_crc32c(0, data[i * 4096:], 4096, 1) for i in range(3)]
    assert lib.infinity_aio_crc32c(0, data, 100, 0) != zlib.crc32(data[:100])  # Castagnoli, not zlib's polynomial


def test_block_sums_record_writes_and_catch_a_corrupt_block(tmp_path):
    h = _handle(THREADS, block_size=4 * KiB)
    out = ffi.new("infinity_aio_sums **")
    assert lib.infinity_aio_sums_create(MiB, out) == 0
    table = ffi.gc(out[0], lib.infinity_aio_sums_destroy)
    assert lib.infinity_aio_sums_bytes(table) >= 0
    direct, fd = _fds(str(tmp_path / "f"))
    data = np.random.default_rng(1).integers(0, 256, 3 * 4096, dtype=np.uint8).tobytes()
    buf = ffi.new("char[]", len(data))
    ffi.memmove(buf, data, len(data))
    try:
        assert lib.infinity_aio_submit(h, WRITE, direct, fd, buf, len(data), 0, table) == 0
        assert _wait(h)[1] == []
        entries = ffi.new("uint64_t[4]")
        assert lib.infinity_aio_sums_get(table, 0, 4, entries) == 0
        for i in range(3):  # Note [block sums] in sums.h: the CRC32C low, the length it covers above
            assert entries[i] & 0xFFFFFFFF == lib.infinity_aio_crc32c(0, data[i * 4096:], 4096, 1)
            assert entries[i] >> 32 == 4096
        assert entries[3] == 0  # never written: nothing known
        assert lib.infinity_aio_sums_unrecorded(table) == 0

        os.pwrite(fd, bytes([data[4096 + 5] ^ 1]), 4096 + 5)  # one bit of the second block, behind its back
        err = ffi.new("infinity_aio_error *")
        rc = lib.infinity_aio_rw(h, READ, direct, fd, buf, len(data), 0, table, err)
        assert rc == -errno.EBADMSG and (err.err, err.offset, err.length) == (errno.EBADMSG, 4096, 4096)
        assert lib.infinity_aio_sums_mismatches(table) == 1

        entries[1] = (4096 << 32) | lib.infinity_aio_crc32c(0, os.pread(fd, 4096, 4096), 4096, 0)
        assert lib.infinity_aio_sums_set(table, 1, 1, entries + 1) == 0  # vouch for the block as it is now
        assert lib.infinity_aio_rw(h, READ, direct, fd, buf, len(data), 0, table, err) == 0
    finally:
        _close(direct, fd)


@pytest.mark.parametrize("hugepage, align", [(0, 4 * KiB), (1, 2 * MiB)])
def test_aligned_memory_is_given_back_and_faulted_in_again(hugepage, align):
    n = 4 * MiB
    huge = ffi.new("int32_t *")
    p = lib.infinity_aio_alloc(n, hugepage, huge)
    assert p != ffi.NULL and int(ffi.cast("uintptr_t", p)) % align == 0
    try:
        ffi.memmove(p, b"\x01" * n, n)
        assert lib.infinity_aio_resident(p, n) == n
        assert lib.infinity_aio_release(p, n, align) == n
        assert lib.infinity_aio_resident(p, n) < n
        assert ffi.buffer(p, n)[:] == bytes(n)  # released pages read as zeros
        ffi.buffer(p, 1)[0] = b"\x02"  # and are faulted in again when touched
        assert lib.infinity_aio_resident(p, 4 * KiB) == 4 * KiB
    finally:
        lib.infinity_aio_free(p, n, hugepage)


def test_a_stalled_request_is_seen_in_flight(tmp_path):
    h = _handle(THREADS, block_size=4 * KiB)
    path = str(tmp_path / "f")
    direct, fd = _fds(path)
    os.pwrite(fd, bytes(4 * KiB), 0)
    st = os.stat(path)
    buf = ffi.new("char[]", 4 * KiB)
    ids = ffi.new("int64_t[4]")
    assert lib.infinity_aio_wait_for(h, 0) == 1  # nothing submitted: everything has completed
    rule = lib.infinity_aio_inject(st.st_dev, st.st_ino, READ, 1, 1, FAULT_STALL, 300)
    assert rule >= 0
    try:
        rid = lib.infinity_aio_submit(h, READ, direct, fd, buf, 4 * KiB, 0, ffi.NULL)
        assert lib.infinity_aio_wait_for(h, 0) == 0
        assert lib.infinity_aio_in_flight(h) == 1
        assert lib.infinity_aio_in_flight_ids(h, ids, 4) == 1 and ids[0] == rid
        assert lib.infinity_aio_wait_for(h, 10_000) == 1
        assert _wait(h) == (1, [], rid + 1)
        assert lib.infinity_aio_inject_hits(rule) == 1
    finally:
        lib.infinity_aio_inject_clear()
        _close(direct, fd)


# ---------------------------------------------------------------- native/cpu_adam

cpu_adam = pytest.importorskip("infinity._cpu_adam", reason="native/cpu_adam is not built")

F32, BF16, F16, NONE = 0, 1, 2, -1  # the dtype codes of native/cpu_adam/cpu_adam.h
DECOUPLED, L2 = 0, 1
FEATURES = cpu_adam.cpu_features()
PATHS = {"scalar": 0} | {name: code for name, code in (("avx2", 1), ("avx512", 2)) if FEATURES[name]}
B1, B2, EPS, LR = 0.9, 0.999, 1e-8, 1e-2
f32 = np.float32


def _reference(p, g, m, v, *, step, wd, decay):
    """One Adam step in float32, each operation rounded as the scalar kernel rounds it."""
    p, g, m, v = (np.array(a, dtype=f32) for a in (p, g, m, v))
    step_size, inv_bc2 = f32(LR / (1 - B1 ** step)), f32(1 / np.sqrt(1 - B2 ** step))
    if decay == L2:
        g = g + f32(wd) * p
    else:
        p = p * f32(1 - LR * wd)
    m = m + f32(1 - B1) * (g - m)
    v = v * f32(B2) + f32(1 - B2) * g * g
    p = p - step_size * (m / (np.sqrt(v) * inv_bc2 + f32(EPS)))
    return p, m, v


IN_PLACE = (0, 0, 0)  # a segment's sources: none, the states are read where they are written


def _native(p, g, m, v, *, step, wd, decay, isa, grad_dtype=F32, out=None, threads=1, sources=None):
    """The same step through the binding: addresses of torch tensors, counts and codes;
    ``sources`` (p, m, v): read there, the results written to ``p``, ``m``, ``v``."""
    out_dtype = {None: NONE, torch.bfloat16: BF16, torch.float16: F16}[None if out is None else out.dtype]
    ins = IN_PLACE if sources is None else tuple(t.data_ptr() for t in sources)
    segment = (p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), 0 if out is None else out.data_ptr(),
               p.numel(), LR / (1 - B1 ** step), 1 / (1 - B2 ** step) ** 0.5, *ins)
    cpu_adam.step([segment], B1, B2, EPS, 1 - LR * wd if decay == DECOUPLED else 1.0, wd if decay == L2 else 0.0,
                  decay, grad_dtype, out_dtype, isa, False, threads)


def _states(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    p, g, m = (torch.randn(n, generator=gen) for _ in range(3))
    v = torch.rand(n, generator=gen) * 1e-2
    v[: n // 8] = 0.0  # fresh moments, where eps dominates the denominator
    return p, g, m * 1e-2, v


def _assert_formula(path: str, got: np.ndarray, ref: np.ndarray):
    if path == "scalar":  # the reference the SIMD paths are held to: bit for bit
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    else:  # fused multiply-adds (tests/unit/test_cpu_adam.py holds them to the scalar path alike)
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("decay, wd", [(DECOUPLED, 0.0), (DECOUPLED, 0.1), (L2, 0.1)], ids=["adam", "adamw", "adam+l2"])
@pytest.mark.parametrize("path", list(PATHS))
def test_the_kernel_is_the_formula(path, decay, wd):
    n = 4099  # a tail after every vector width
    for step in (1, 7):
        p, g, m, v = _states(n, seed=step)
        want = _reference(p.numpy(), g.numpy(), m.numpy(), v.numpy(), step=step, wd=wd, decay=decay)
        _native(p, g, m, v, step=step, wd=wd, decay=decay, isa=PATHS[path], threads=3)
        for got, ref in zip((p.numpy(), m.numpy(), v.numpy()), want):
            _assert_formula(path, got, ref)


@pytest.mark.parametrize("path", list(PATHS))
def test_out_of_place_writes_the_in_place_bits_and_leaves_its_sources(path):
    """Note [second state set] in infinity/_offload/_optimizer_store.py: states read from one set
    and written to another are the bits the step in place gives, tails and threads included."""
    n = 4099
    p, g, m, v = _states(n, seed=9)
    sources = tuple(t.clone() for t in (p, m, v))
    kept = tuple(t.clone() for t in sources)
    outs = tuple(torch.full((n,), float("nan")) for _ in range(3))  # every element must be written
    _native(p, g, m, v, step=3, wd=0.01, decay=DECOUPLED, isa=PATHS[path], threads=3)
    _native(*outs[:1], g, *outs[1:], step=3, wd=0.01, decay=DECOUPLED, isa=PATHS[path], threads=3, sources=sources)
    assert all(torch.equal(a, b) for a, b in zip((p, m, v), outs))
    assert all(torch.equal(a, b) for a, b in zip(sources, kept))


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, rounding to nearest even (NaN: the canonical quiet NaN)."""
    u = x.astype(f32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), r)


@pytest.mark.parametrize("path", list(PATHS))
def test_low_precision_grads_widen_and_outputs_round_as_the_reference(path):
    n = 1031
    p, g, m, v = _states(n, seed=3)
    g[:3] = torch.tensor([65504.0, 6e-8, -3.0e-5])  # fp16's largest, a subnormal, a small negative
    for grad_dtype, code in ((torch.bfloat16, BF16), (torch.float16, F16)):
        for out_dtype in (torch.bfloat16, torch.float16):
            pp, mm, vv = p.clone(), m.clone(), v.clone()
            low = g.to(grad_dtype)
            bits = low.view(torch.int16).numpy().view(np.uint16)
            wide = ((bits.astype(np.uint32) << 16).view(f32) if grad_dtype == torch.bfloat16
                    else bits.view(np.float16).astype(f32))  # both widenings are exact
            ref_p = _reference(pp.numpy(), wide, mm.numpy(), vv.numpy(), step=2, wd=0.0, decay=DECOUPLED)[0]
            out = torch.empty(n, dtype=out_dtype)
            _native(pp, low, mm, vv, step=2, wd=0.0, decay=DECOUPLED, isa=PATHS[path], grad_dtype=code, out=out)
            got_bits = out.view(torch.int16).numpy().view(np.uint16)
            want_bits = (_bf16_bits(pp.numpy()) if out_dtype == torch.bfloat16
                         else pp.numpy().astype(np.float16).view(np.uint16))  # numpy rounds to nearest even
            assert np.array_equal(got_bits, want_bits)  # the output is the updated master, rounded once
            _assert_formula(path, pp.numpy(), ref_p)


def test_segments_keep_their_own_bias_correction():
    p, g, m, v = _states(64, seed=4)
    q, h, mq, vq = (t.clone() for t in (p, g, m, v))
    ref_p = _reference(p[:32].numpy(), g[:32].numpy(), m[:32].numpy(), v[:32].numpy(), step=1, wd=0.0, decay=0)[0]
    ref_q = _reference(q[32:].numpy(), h[32:].numpy(), mq[32:].numpy(), vq[32:].numpy(), step=50, wd=0.0, decay=0)[0]
    segs = [(t[0].data_ptr(), t[1].data_ptr(), t[2].data_ptr(), t[3].data_ptr(), 0, 32,
             LR / (1 - B1 ** step), 1 / (1 - B2 ** step) ** 0.5, *IN_PLACE)
            for t, step in (((p[:32], g[:32], m[:32], v[:32]), 1), ((q[32:], h[32:], mq[32:], vq[32:]), 50))]
    cpu_adam.step(segs, B1, B2, EPS, 1.0, 0.0, DECOUPLED, F32, NONE, 0, False, 2)
    assert np.array_equal(p[:32].numpy(), ref_p) and np.array_equal(q[32:].numpy(), ref_q)


@pytest.mark.parametrize("change, match", [
    (dict(threads=0), "threads must be >= 1"),
    (dict(decay_mode=2), "bad decay mode"),
    (dict(isa=3), "bad isa code"),
    (dict(grad_dtype=5), "bad dtype code for grad"),
    (dict(grad_dtype=NONE), "bad dtype code for grad"),
    (dict(out_dtype=F32), "param_out must be bf16 or fp16"),
    (dict(n=-1), "negative element count"),
    (dict(grad=0), "null data pointer"),
    (dict(out_dtype=BF16), "null data pointer"),  # an output dtype without an output
])
def test_bad_arguments_are_refused_before_any_element_is_touched(change, match):
    p, g, m, v = _states(16, seed=5)
    before = p.clone()
    args = dict(grad=g.data_ptr(), n=16, decay_mode=DECOUPLED, grad_dtype=F32, out_dtype=NONE, isa=0, threads=1)
    args.update(change)
    segment = (p.data_ptr(), args["grad"], m.data_ptr(), v.data_ptr(), 0, args["n"], LR, 1.0, *IN_PLACE)
    with pytest.raises(ValueError, match=match):
        cpu_adam.step([segment], B1, B2, EPS, 1.0, 0.0, args["decay_mode"], args["grad_dtype"], args["out_dtype"],
                      args["isa"], False, args["threads"])
    assert torch.equal(p, before)
    cpu_adam.step([(0, 0, 0, 0, 0, 0, LR, 1.0, *IN_PLACE)], B1, B2, EPS, 1.0, 0.0, DECOUPLED, F32, NONE, 0, False,
                  1)  # empty: fine
