"""End-to-end checksums of swap files (Note [swap checksums] in infinity/aio/_checksum.py).

The CRC32C itself (SSE4.2 against the scalar reference), then AsyncIO on a checksummed path
(every corruption of a written block is caught on read, with the file and block offset), then
real training of a tiny GPT-2 with every state on NVMe: bytes of each swap file corrupted
between steps (a flipped bit, a random 4 KiB block, a punched hole) end in CorruptionError
naming the file, the offset and what it holds, before any step uses them; never a NaN loss.
With ``aio.checksums: false`` the same corruption goes unnoticed, as before.
"""
import ctypes
import errno
import math
import os

import pytest
import torch
from _configs import streamed_nvme_config
from _models import gpt2, train_into

import infinity
from infinity.aio import AsyncIO, CorruptionError
from infinity.aio._checksum import BlockSums, SwapPath, checksummed, crc32c, crc32c_hardware, sums_of
from infinity.errors import NonFiniteError
from infinity.testing import io_fault

BLOCK = 4096
BACKENDS = ["io_uring", "threads"]
_libc = ctypes.CDLL(None, use_errno=True)


def punch_hole(path, offset, length):
    fd = os.open(path, os.O_RDWR)
    try:
        if _libc.fallocate(fd, 3, ctypes.c_long(offset), ctypes.c_long(length)) != 0:  # PUNCH_HOLE | KEEP_SIZE
            pytest.skip(f"fallocate(PUNCH_HOLE) unsupported here: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


def corrupt(path, offset, how, seed=99):
    """Damage the file at ``offset``: flip one bit, overwrite its 4 KiB block with random
    bytes, or punch the block out (it then reads as zeros)."""
    block = offset // BLOCK * BLOCK
    if how == "hole":
        punch_hole(path, block, BLOCK)
        return block
    fd = os.open(path, os.O_RDWR)
    try:
        if how == "flip":
            byte = os.pread(fd, 1, offset)
            os.pwrite(fd, bytes([byte[0] ^ 0x10]), offset)
        else:
            g = torch.Generator().manual_seed(seed)
            os.pwrite(fd, torch.randint(0, 256, (BLOCK,), generator=g, dtype=torch.uint8).numpy().tobytes(), block)
        os.fsync(fd)
    finally:
        os.close(fd)
    return block


# ------------------------------------------------------------------ CRC32C


def test_crc32c_known_value_and_hardware_matches_scalar():
    assert crc32c(b"123456789") == crc32c(b"123456789", scalar=True) == 0xE3069283
    g = torch.Generator().manual_seed(0)
    for n in (0, 1, 7, 8, 9, 4095, 4096, 4097, 3 * 4096 + 5, 1 << 20):
        data = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).numpy().tobytes()
        assert crc32c(data) == crc32c(data, scalar=True), n
        half = n // 2
        assert crc32c(data[half:], crc32c(data[:half])) == crc32c(data)  # continues a running sum
    assert isinstance(crc32c_hardware(), bool)


def test_block_sums_match_the_reference():
    from infinity.aio._native import ffi, lib

    data = _data(7 * BLOCK, seed=5).numpy().tobytes()
    out = ffi.new("uint32_t[]", 7)
    lib.infinity_aio_crc32c_blocks(ffi.from_buffer(data), 7, out)
    assert list(out) == [crc32c(data[i * BLOCK:(i + 1) * BLOCK], scalar=True) for i in range(7)]


# ------------------------------------------------------------------ AsyncIO on a checksummed path


@pytest.fixture(params=BACKENDS)
def handle(request):
    with AsyncIO(block_size=64 << 10, queue_depth=8, backend=request.param) as h:
        yield h


def _data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)


def _swap(tmp_path, nbytes, name="f.swp"):
    path = str(tmp_path / name)
    with open(path, "wb") as f:
        f.truncate(nbytes)
    return SwapPath(path, BlockSums(nbytes, name))


@pytest.mark.parametrize("how", ["flip", "random", "hole"])
@pytest.mark.parametrize("where", [0, 5 * BLOCK + 17, 300 * 1024 + 1])
def test_every_corrupted_block_is_caught(tmp_path, handle, how, where):
    n = 320 * 1024 + 777  # several 64 KiB pieces and a partial block at the end
    path = _swap(tmp_path, 1 << 20)
    data = _data(n)
    handle.pwrite(data, path, 0)
    handle.wait()
    out = torch.empty(n, dtype=torch.uint8)
    handle.pread(out, path, 0)
    handle.wait()
    assert torch.equal(out, data)
    block = corrupt(path, where, how)
    handle.pread(out, path, 0)
    with pytest.raises(CorruptionError, match=rf"f\.swp' at byte offset {block} ") as e:
        handle.wait()
    assert e.value.bad_offset == block and e.value.errno == errno.EBADMSG and isinstance(e.value, OSError)
    assert path.sums.mismatches == 1
    assert handle.in_flight() == 0


@pytest.mark.parametrize("sync", [False, True])
def test_a_partial_read_is_widened_to_check_its_last_block(tmp_path, handle, sync):
    """A read that ends inside a block whose sum covers more (a unit's shard after the step
    wrote its whole slot) still checks that block: the rest of it is read on the side."""
    path = _swap(tmp_path, 4 * BLOCK)
    handle.pwrite(_data(3 * BLOCK), path, 0)
    handle.wait()
    corrupt(path, BLOCK + 3000, "flip")  # past the end of the read below, inside its last block
    out = torch.empty(BLOCK + 100, dtype=torch.uint8)
    with pytest.raises(CorruptionError, match=f"at byte offset {BLOCK} "):
        if sync:
            handle.sync_pread(out, path, 0)
        else:
            handle.pread(out, path, 0)
            handle.wait()
    inner = torch.empty(BLOCK - 200, dtype=torch.uint8)  # starts inside block 0, which is intact
    handle.sync_pread(inner, path, 100)
    assert torch.equal(inner, _data(3 * BLOCK)[100:BLOCK - 100])


def test_unaligned_writes_are_summed_where_they_can_be(tmp_path, handle):
    """Writes that continue one another keep a block checkable; one that starts inside a
    block whose sum covers other bytes makes that block unchecked (never a false alarm)."""
    path = _swap(tmp_path, 4 * BLOCK)
    data = _data(3 * BLOCK)
    handle.sync_pwrite(data[:1000], path, 0)
    handle.sync_pwrite(data[1000:], path, 1000)  # continues block 0's sum
    corrupt(path, 10, "flip")
    with pytest.raises(CorruptionError, match="at byte offset 0 "):
        handle.sync_pread(torch.empty(3 * BLOCK, dtype=torch.uint8), path, 0)
    handle.sync_pwrite(data[:BLOCK], path, 0)
    handle.sync_pwrite(data[:10], path, 500)  # overwrites the middle of a summed block
    out = torch.empty(3 * BLOCK, dtype=torch.uint8)
    handle.sync_pread(out, path, 0)  # block 0 unchecked now, the others still checked
    assert torch.equal(out[500:510], data[:10])


def test_checksums_off_reads_corrupt_bytes_as_before(tmp_path, handle):
    path = checksummed(str(tmp_path / "f.swp"), 1 << 20, enabled=False)
    assert type(path) is str
    handle.sync_pwrite(_data(2 * BLOCK), path, 0)
    corrupt(path, 5, "flip")
    out = torch.empty(2 * BLOCK, dtype=torch.uint8)
    handle.sync_pread(out, path, 0)
    assert not torch.equal(out, _data(2 * BLOCK))


def test_the_table_costs_8_bytes_per_block_written(tmp_path, handle):
    path = _swap(tmp_path, 1 << 30)
    small = path.sums.nbytes
    assert small < 4096  # the directory only, until a write reaches a leaf
    handle.sync_pwrite(_data(BLOCK), path, 0)
    assert path.sums.nbytes - small == BlockSums.bytes_for(64 << 20)  # one leaf: 64 MiB of file
    assert BlockSums.bytes_for(1 << 30) == (1 << 30) // 512


# ------------------------------------------------------------------ training on NVMe


def _config(nvme, checksums=True):
    return streamed_nvme_config(nvme, checksums=checksums)


def _target(opt, kind):
    """(swap file, a byte offset inside the largest unit's range in it, past its first block)."""
    unit = max((u for u in opt.engine.units if u.trainable), key=lambda u: u.shard_numel)
    if kind == "params":
        return opt.param_store.path, unit.param_offset * opt.param_store.itemsize + BLOCK + 123
    return opt.store.paths[kind], unit.opt_offset * 4 + BLOCK + 123


def _close(opt):
    swap = [d.path for d in opt.engine.swap_dirs.values()]
    try:
        opt.engine.close()
    except CorruptionError:
        pass  # the overlapped step's error, seen again
    assert not any(os.path.exists(p) for p in swap), "swap directory left behind"


@pytest.mark.parametrize("how", ["flip", "random", "hole"])
@pytest.mark.parametrize("kind", ["params", "master", "exp_avg", "exp_avg_sq"])
def test_corrupt_swap_file_stops_training_with_a_named_error(tmp_path, kind, how):
    model, opt = infinity.initialize(gpt2(), _config(str(tmp_path)))
    losses = []
    train_into(model, opt, 2, losses)
    path, offset = _target(opt, kind)
    block = corrupt(path, offset, how, seed=3)
    with pytest.raises(CorruptionError) as e:
        train_into(model, opt, 3, losses)
    msg = str(e.value)
    assert f"{os.path.basename(path)}' at byte offset {block} " in msg, msg
    assert "fetch unit" in msg and "rank 0" in msg and "optimizer step" in msg, msg
    if kind != "params":
        assert f"optimizer state '{kind}'" in msg and "optimizer range [" in msg, msg
    assert all(math.isfinite(x) for x in losses), losses
    _close(opt)


def test_corrupt_gradient_write_is_caught_by_the_step(tmp_path):
    """A gradient shard damaged on its way to disk (a bit flipped in the file right after the
    write, by the I/O layer's fault injection) is caught when the step reads it."""
    model, opt = infinity.initialize(gpt2(), _config(str(tmp_path)))
    losses = []
    train_into(model, opt, 1, losses)
    with io_fault(opt.store.paths["grad"], "write", "flip", nth=2, arg=BLOCK + 5) as rule:
        with pytest.raises(CorruptionError, match=r"grad\.swp' at byte offset \d+ .*optimizer state 'grad'"):
            train_into(model, opt, 2, losses)
        assert rule.hits == 1
    assert all(math.isfinite(x) for x in losses)
    _close(opt)


def test_corrupt_init_store_is_caught_by_initialize(tmp_path):
    cfg = _config(str(tmp_path))
    with infinity.Init(config=cfg):
        model = gpt2()
    path = _init_swap(tmp_path)
    corrupt(path, 2 * BLOCK + 9, "random")
    with pytest.raises(CorruptionError, match=r"init\.swp' at byte offset 8192 .*shard of parameter "):
        infinity.initialize(model, cfg)


def _init_swap(tmp_path):
    found = [os.path.join(root, f) for root, _, files in os.walk(tmp_path) for f in files if f == "init.swp"]
    assert len(found) == 1, found
    return found[0]


def test_checksums_off_trains_on_the_corrupt_bytes(tmp_path):
    """The old behaviour stays possible: no check, and the damage reaches the weights. NaNs
    then reach the gradients, where the non-finite guard (precision.on_nonfinite: error) is
    the only thing that stops the run: no CorruptionError, a NonFiniteError naming the step."""
    model, opt = infinity.initialize(gpt2(), _config(str(tmp_path), checksums=False))
    losses = []
    train_into(model, opt, 2, losses)
    path, offset = _target(opt, "master")
    assert sums_of(path) is None  # a swap file's path carries its drive's byte tally, and no table of sums
    fd = os.open(path, os.O_RDWR)
    os.pwrite(fd, torch.full((BLOCK // 4,), float("nan")).numpy().tobytes(), offset // BLOCK * BLOCK)
    os.fsync(fd)
    os.close(fd)
    with pytest.raises(NonFiniteError, match=r"step \d+: inf or NaN"):
        train_into(model, opt, 3, losses)
    _close(opt)


@pytest.mark.parametrize("section,message", [
    ({"checksums": "yes"}, "aio.checksums: expected bool"),
    ({"timeout": 0}, "aio.timeout: 0.0 is out of range"),
])
def test_the_config_keys_are_validated(section, message):
    with pytest.raises(infinity.ConfigError, match=message):
        infinity.Config.from_dict({"aio": section})
    assert infinity.Config.from_dict({}).aio.checksums is True  # on by default
