"""Striped swap files (Note [striped swap files] in infinity/aio/_stripe.py) and the drives a
rank uses (Note [many drives] in infinity/_offload/_drives.py).

The offset mapping against a byte-by-byte reference; ``AsyncIO`` on a striped, checksummed
path over two directories: what lands in each member file, reads at any offset and length,
a corrupt block named by its member file with the logical offset described, bytes counted per
drive; ``SwapDirs`` giving each rank its drive or a striped file, with the same run directory
name on every drive.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from infinity._offload._drives import node_bytes_per_drive, rank_drives
from infinity._offload._swap import StripedSwap, SwapDir, SwapDirs
from infinity.aio import AsyncIO, CorruptionError, aligned_empty
from infinity.aio._checksum import SwapPath, checksummed, sums_of
from infinity.aio._stripe import DriveTally, StripedPath, member_bytes, unlink
from infinity.errors import UsageError

EXTENT = 8192


def _reference(n: int, size: int, extent: int = EXTENT):
    """(member, member offset) of every logical byte, dealt extent by extent."""
    out = []
    for b in range(size):
        k = b // extent
        out.append((k % n, (k // n) * extent + b % extent))
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_pieces_map_every_byte_as_the_reference(n):
    size = 7 * EXTENT + 123
    ref = _reference(n, size)
    path = StripedPath([f"/d{i}/f" for i in range(n)], EXTENT)
    for offset, length in [(0, size), (1, 5), (EXTENT - 3, 7), (3 * EXTENT, 2 * EXTENT + 9), (size - 1, 1), (5, 0)]:
        got = []
        for member, at, start, count in path.pieces(offset, length):
            assert start == len(got) and 0 < count <= EXTENT
            got += [(member, at + j) for j in range(count)]
        assert got == ref[offset : offset + length]
    for b in range(0, size, 997):  # logical() inverts the mapping
        assert path.logical(*ref[b]) == b
    for i in range(n):  # each member holds exactly its bytes
        assert member_bytes(size, EXTENT, n, i) == sum(1 for m, _ in ref if m == i)


def test_a_striped_path_is_no_file_and_refuses_bad_shapes():
    path = StripedPath(["/a/f", "/b/f"], EXTENT)
    assert str(path) == "/a/f|/b/f" and not os.path.exists(path)
    with pytest.raises(UsageError, match="two members"):
        StripedPath(["/a/f"], EXTENT)
    with pytest.raises(UsageError, match="multiple of 4096"):
        StripedPath(["/a/f", "/b/f"], 5000)


def _striped(tmp_path, size: int, tallies):
    dirs = [tmp_path / "d0", tmp_path / "d1"]
    for d in dirs:
        d.mkdir()
    members = [SwapPath(str(d / "x.swp"), None, t) for d, t in zip(dirs, tallies)]
    return checksummed(StripedPath(members, EXTENT), size, True)


def test_aio_on_a_striped_checksummed_file(tmp_path):
    size = 6 * EXTENT
    tallies = [DriveTally("d0"), DriveTally("d1")]
    path = _striped(tmp_path, size, tallies)
    data = torch.from_numpy(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8))
    src = aligned_empty(size)
    src.copy_(data)
    with AsyncIO(block_size=4096) as h:
        h.pwrite(src, path, 0)
        h.wait()
        member0 = open(path.members[0], "rb").read()
        assert member0[:EXTENT] == data[:EXTENT].numpy().tobytes()  # extent 0 on drive 0
        assert member0[EXTENT : 2 * EXTENT] == data[2 * EXTENT : 3 * EXTENT].numpy().tobytes()  # extent 2 too
        assert open(path.members[1], "rb").read()[:EXTENT] == data[EXTENT : 2 * EXTENT].numpy().tobytes()
        assert [t.written for t in tallies] == [size // 2, size // 2]
        for offset, length in [(0, size), (4096, 3 * 4096), (EXTENT, EXTENT)]:
            out = aligned_empty(length)
            h.pread(out, path, offset)
            h.wait()
            assert torch.equal(out, data[offset : offset + length])
        out = aligned_empty(2 * EXTENT)
        assert h.sync_pread(out, path, EXTENT) == 2 * EXTENT and torch.equal(out, data[EXTENT : 3 * EXTENT])
        h.fsync(path)
    sums = sums_of(path)
    sums.describe = lambda offset: f"logical byte {offset}"
    fd = os.open(path.members[1], os.O_RDWR)  # member 1's second block: logical extent 1, block 1
    os.pwrite(fd, b"\xff" * 16, 4096)
    os.close(fd)
    with AsyncIO(block_size=4096) as h:
        out = aligned_empty(size)
        h.pread(out, path, 0)
        with pytest.raises(CorruptionError) as err:
            h.wait()
    assert path.members[1] in str(err.value) and f"logical byte {EXTENT + 4096}" in str(err.value)
    assert sums.mismatches == 1
    unlink(path)
    assert not any(os.path.exists(m) for m in path.members)


def test_rank_drives_and_node_bytes():
    paths = ("/n0", "/n1")
    assert [rank_drives(paths, "per_rank", r) for r in range(3)] == [("/n0",), ("/n1",), ("/n0",)]
    assert rank_drives(paths, "stripe", 5) == paths and rank_drives("/n0", "stripe", 1) == ("/n0",)
    assert node_bytes_per_drive(paths, "per_rank", 100, 3) == {"/n0": 200, "/n1": 100}
    assert node_bytes_per_drive(paths, "stripe", 100, 3) == {"/n0": 150, "/n1": 150}


def test_swap_dirs_give_a_rank_its_drive_or_a_striped_file(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    os.mkdir(a)
    os.mkdir(b)
    ranked = SwapDirs(rank=1, layout="per_rank", rank_on_node=1)
    try:
        swap = ranked.under((a, b))
        assert isinstance(swap, SwapDir) and swap.path.startswith(b)
        assert ranked.under(b) is swap  # one directory per drive
    finally:
        ranked.remove()
    striped = SwapDirs(rank=0, layout="stripe", stripe_size=EXTENT)
    try:
        swap = striped.under([a, b])
        assert isinstance(swap, StripedSwap)
        first, second = swap.file("m.swp", 3 * EXTENT), swap.file("v.swp", 3 * EXTENT)
        assert [os.path.dirname(os.path.dirname(m))[: len(a)] for m in first.members] == [a, b]
        assert [os.path.dirname(os.path.dirname(m))[: len(a)] for m in second.members] == [b, a]  # rotated
        assert [os.path.getsize(m) for m in first.members] == [2 * EXTENT, EXTENT]
        assert len({os.path.basename(os.path.dirname(d.path)) for d in striped.values()}) == 1  # one run id
        assert set(striped.drive_bytes()) == {a, b}
    finally:
        striped.remove()
    assert os.listdir(a) == [] and os.listdir(b) == []


def test_a_ranks_bandwidth_over_its_nodes_drives():
    """The estimate's rates (infinity.estimate --drives --drive-bandwidth): the busiest drive sets the pace."""
    import argparse

    from infinity._apps import _runmodel as rm
    from infinity._apps._estimate_cli import _drive_rates
    from infinity._apps._estimate_model import EstimateError
    from infinity._offload._drives import rank_bandwidth

    assert rank_bandwidth(1.0, 8, "per_rank", 8) == 1.0 and rank_bandwidth(1.0, 8, "per_rank", 16) == 0.5
    assert rank_bandwidth(1.0, 8, "stripe", 2) == 4.0 and rank_bandwidth(1.0, 2, "per_rank", 1) == 1.0
    measured = rm.Rates(flops=1e12, nvme_read=2e9, nvme_write=1e9, adam=1e9)

    def args(**kw):
        return argparse.Namespace(**{"drives": None, "drive_bandwidth": None, "nvme_layout": "per_rank", **kw})

    assert _drive_rates(measured, args(), 8) is measured  # neither flag: as measured
    striped = _drive_rates(measured, args(drives=4, nvme_layout="stripe"), 2)
    assert (striped.nvme_read, striped.nvme_write) == (4e9, 2e9)  # the measured drive, times 4 drives / 2 ranks
    given = _drive_rates(measured, args(drives=8, drive_bandwidth="6.5,3.5"), 8)
    assert (given.nvme_read, given.nvme_write) == (6.5e9, 3.5e9)
    with pytest.raises(EstimateError, match="READ or READ,WRITE in GB/s"):
        _drive_rates(measured, args(drive_bandwidth="fast"), 1)
    with pytest.raises(EstimateError, match="drives: 0 must be at least 1"):
        _drive_rates(measured, args(drives=0), 1)


def test_the_ssd_budget_projects_each_drive_for_the_ranks_writing_there(tmp_path, monkeypatch):
    """Note [endurance budget] in _endurance.py: a drive's projection counts the node's ranks that
    write to it, not every rank of the node."""
    import infinity
    from infinity._apps._endurance import budget_warning, sharing

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")

    def cfg(layout):
        return infinity.Config.from_dict({"zero": {"nvme_layout": layout,
                                                   "offload_optimizer": {"device": "nvme", "nvme_path": [a, b]}},
                                          "aio": {"endurance_tbw": 1.0}})

    assert sharing(cfg("per_rank")) == {a: 2, b: 2} and sharing(cfg("stripe")) == {a: 4, b: 4}
    per_step = {a: 10**9, b: 10**9}  # 1 GB a step: 100 steps x 2 ranks = 20% of 1 TB, x 4 ranks = 40%
    rank_warning = budget_warning(cfg("per_rank").aio, per_step, 100, sharing(cfg("per_rank")))
    assert f"{a}: 0.2 TB (20% of aio.endurance_tbw 1 TB)" in rank_warning
    assert f"{b}: 0.4 TB" in budget_warning(cfg("stripe").aio, per_step, 100, sharing(cfg("stripe")))
    assert budget_warning(cfg("per_rank").aio, {a: 10**8}, 100, sharing(cfg("per_rank"))) is None  # 2% of it


def test_the_train_flags_take_several_drives(tmp_path):
    """``--nvme-path a,b`` is a list of drives for both sections; one path stays a string."""
    from infinity._apps._train_cli import nvme_paths, parse_args, resolve_config

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    cfg = resolve_config(parse_args(["--offload", "nvme", "--nvme-path", f"{a},{b}", "--nvme-layout", "stripe"]))
    assert cfg.zero.offload_param.nvme_path == cfg.zero.offload_optimizer.nvme_path == (a, b)
    assert cfg.zero.nvme_layout == "stripe" and nvme_paths(cfg) == [a, b]
    one = resolve_config(parse_args(["--offload", "nvme", "--nvme-path", a]))
    assert one.zero.offload_optimizer.nvme_path == a and one.zero.nvme_layout == "per_rank"


def test_the_train_flag_refuses_a_list_naming_no_drive(tmp_path, monkeypatch):
    """``--nvme-path ,`` (or empty) names no drive: refused, not a directory named ``,`` made
    where the job runs; spaces after the commas are not part of a name."""
    from infinity._apps._train_cli import parse_args, resolve_config
    from infinity._apps._train_model import TrainError

    monkeypatch.chdir(tmp_path)
    for value in (",", "", " , "):
        with pytest.raises(TrainError, match="--nvme-path names no directory"):
            resolve_config(parse_args(["--offload", "nvme", "--nvme-path", value]))
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    cfg = resolve_config(parse_args(["--offload", "nvme", "--nvme-path", f"{a}, {b}"]))
    assert cfg.zero.offload_param.nvme_path == (a, b)
    assert os.listdir(tmp_path) == []


def test_two_spellings_of_one_directory_are_one_drive(tmp_path):
    """``/a/`` for the parameters and ``/a`` for the optimizer: one swap directory, one drive."""
    a = str(tmp_path / "a")
    os.mkdir(a)
    dirs = SwapDirs(rank=0)
    try:
        assert dirs.under(a + "/") is dirs.under([a]) and list(dirs.drive_bytes()) == [a]
    finally:
        dirs.remove()


def test_the_eight_drive_example_loads(tmp_path):
    """Its placeholders /mnt/nvme* put under a writable directory (a user may not write to /mnt)."""
    import infinity

    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "zero_infinity_8_drives.yaml")
    here = tmp_path / "example.yaml"
    here.write_text(open(path).read().replace("/mnt/", f"{tmp_path}/"))
    cfg = infinity.Config.from_file(str(here))
    drives = cfg.zero.offload_param.nvme_path
    assert len(drives) == 8 and cfg.zero.offload_optimizer.nvme_path == drives and cfg.zero.nvme_layout == "per_rank"
    assert [rank_drives(drives, "per_rank", r)[0] for r in range(8)] == list(drives)  # no two ranks share a drive
