"""Two drives end to end (Note [many drives] in infinity/_offload/_drives.py, Note [striped swap
files] in infinity/aio/_stripe.py).

The drives are two directories on two filesystems: a loop-mounted XFS made by the test
(tests/_xfs.py; where this machine cannot mount one, a second directory on the root disk) and
one on the root disk. A tiny GPT-2 at stage 3 with every state on NVMe trains exactly as plain
PyTorch AdamW with each layout: ``rank`` on two gloo ranks (each rank's swap files on its own
drive), ``stripe`` on one rank and on two (every swap file over both drives, in 8 KiB extents);
the bytes each drive moved are counted, and every drive is left empty. Then the train job on
both drives, striped on one rank and (``-m slow``) each of two torchrun ranks on its drive: saved
every 3 steps, every process killed with SIGKILL, resumed, it logs the same losses and ends with the same
weights, bit for bit, as an uninterrupted run; the resumed run reclaims what the killed one left
on both drives, and its summary and telemetry give each drive's bytes.
The preflight checks every drive for the node's ranks: a 256 KiB tmpfs as the second drive is
refused on both ranks, naming it, before anything is written.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from _hf_models import build
from _xfs import skip_reason, xfs_mount
from test_exact_training import Cell, _named_params, check_matches_reference, global_losses
from test_train import TIMEOUT, _env, load_saved, read_jsonl, run_cli, tiny_config, write_config

import infinity
from infinity.testing import run_ranks

EXTENT = 8192  # zero.nvme_stripe_size: the tiny model's 120 KB files span both drives


@pytest.fixture(scope="module")
def drives(tmp_path_factory):
    """(a directory on a loop-mounted XFS, or on the root disk where none can be mounted; one on the root disk)."""
    base = tmp_path_factory.mktemp("drives")
    root = base / "root-drive"
    root.mkdir()
    with contextlib.ExitStack() as stack:
        if skip_reason():
            other = base / "second-drive"
            other.mkdir()
        else:
            other = os.path.join(stack.enter_context(xfs_mount(str(base))), "drive")
            os.mkdir(other)
        yield str(other), str(root)


@dataclasses.dataclass(frozen=True)
class DriveCell(Cell):
    layout: str = "per_rank"

    def config(self, nvme) -> dict:
        cfg = super().config(nvme)
        cfg["zero"].update(nvme_layout=self.layout, nvme_stripe_size=EXTENT)
        cfg["aio"] = {"block_size": EXTENT}
        return cfg


CELLS = [DriveCell("gpt2", "none", 3, "nvme", "nvme", persist=0, clip=1.0, layout=layout) for layout in ("per_rank", "stripe")]


def _train(cell: DriveCell, nvme):
    """On each rank: the global mean loss of each step, the final weights, and the bytes the
    rank's swap files moved on each drive."""
    import torch.distributed as dist

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    model, opt = infinity.initialize(build(cell.kind, cell.mode), config=cell.config(nvme))
    try:
        losses = global_losses(model, opt, cell.kind, rank, world)
        with infinity.GatheredParameters(list(model.parameters())):
            params = _named_params(model)
        moved = opt.engine.swap_dirs.drive_bytes()
        telemetry = {k: v for k, v in infinity.telemetry(model).items() if k.startswith("drive")}
    finally:
        infinity.close(model)
    return (losses, params, None), moved, telemetry


def _check(cell, result, nvme, used) -> None:
    exact, moved, telemetry = result
    check_matches_reference(cell, exact)
    assert sorted(moved) == sorted(used), moved  # the drives this rank wrote to
    assert all(r > 0 and w > 0 for r, w in moved.values()), moved
    assert telemetry and all(k.startswith(("drive0_", "drive1_")) for k in telemetry), telemetry


@pytest.mark.parametrize("layout", ["per_rank", "stripe"])
def test_two_ranks_on_two_drives_match_plain_adamw(drives, layout):
    cell = next(c for c in CELLS if c.layout == layout)
    results = run_ranks(_train, 2, cell, list(drives), timeout=240, threads=1)
    for rank, result in enumerate(results):
        _check(cell, result, drives, [drives[rank]] if layout == "per_rank" else drives)
    assert [os.listdir(d) for d in drives] == [[], []]  # every rank's swap files removed on each drive


def test_one_rank_striped_over_two_drives_matches_plain_adamw(drives):
    cell = next(c for c in CELLS if c.layout == "stripe")
    _check(cell, _train(cell, list(drives)), drives, drives)
    assert [os.listdir(d) for d in drives] == [[], []]


# ------------------------------------------------------------------ the train job: kill -9, resume, reclaim


def _job_config(tmp_path, drives, steps, layout):
    cfg = tiny_config(steps=steps, log_every=1)
    cfg["zero"].update(offload_param={"device": "nvme", "nvme_path": list(drives)},
                       offload_optimizer={"device": "nvme", "nvme_path": list(drives)},
                       nvme_layout=layout, nvme_stripe_size=EXTENT)
    cfg["aio"] = {"block_size": EXTENT}
    return write_config(tmp_path / f"drives-{layout}-{steps}.json", cfg)


def _losses(out):
    return {r["step"]: r["loss"] for r in read_jsonl(os.path.join(out, "telemetry.jsonl")) if r["event"] == "step"}


def _descendants(pid: int) -> list:
    """Every process below ``pid`` (torchrun starts each rank in a session of its own)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError):
                parents[int(entry)] = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
    out, frontier = [], [pid]
    while frontier:
        below = [p for p, parent in parents.items() if parent in frontier]
        out += below
        frontier = below
    return out


def _gone(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _kill_after_a_save(cmd, out) -> int:
    """Run the job until its first checkpoint is complete, then SIGKILL every process of it (the
    launcher and each rank); the step saved."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env())
    latest = os.path.join(out, "checkpoints", "latest")
    ranks: list = []
    try:
        deadline = time.monotonic() + TIMEOUT
        while not os.path.exists(latest):
            assert proc.poll() is None, f"the job ended before its first save:\n{proc.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "no checkpoint within the timeout"
            time.sleep(0.05)
        ranks = _descendants(proc.pid)
        for pid in ranks + [proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 60
        while not all(_gone(pid) for pid in ranks):  # their locks go with them (Note [swap directories] in _swap.py)
            assert time.monotonic() < deadline, "a killed rank did not die"
            time.sleep(0.05)
    finally:
        for pid in ranks + [proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    return int(open(latest).read().strip()[len("step"):])


# stripe: one rank, every file on both drives; per_rank: two ranks under torchrun, each on its drive
LAUNCHERS = {"stripe": [sys.executable],
             "per_rank": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]}


@pytest.mark.parametrize("layout", ["stripe", pytest.param("per_rank", marks=pytest.mark.slow)])  # three torchruns: ~50 s
def test_train_job_on_two_drives_resumes_after_kill_9(tmp_path, drives, layout):
    final, launcher = 8, LAUNCHERS[layout]
    whole, split = str(tmp_path / "whole"), str(tmp_path / "split")
    ref = run_cli(["--config", _job_config(tmp_path, drives, final, layout), "--output-dir", whole], launcher=launcher)
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = launcher + ["-m", "infinity.train", "--config", _job_config(tmp_path, drives, 10000, layout),
                         "--output-dir", split, "--save-every", "3", "--no-save"]
    saved = _kill_after_a_save(killed, split)
    assert saved < final, f"the killed job saved step {saved}, past the {final} steps compared"
    stale = [[n for n in os.listdir(d) if n.startswith("infinity-")] for d in drives]
    assert all(len(names) == 1 for names in stale), stale  # the killed run's directory on each drive
    resumed = run_cli(["--config", _job_config(tmp_path, drives, final, layout), "--output-dir", split,
                       "--resume", "auto"], launcher=launcher, env=dict(_env(), INFINITY_LOG_ALL_RANKS="1"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"after step {saved}" in resumed.stderr
    for d, names in zip(drives, stale):  # reclaimed on both drives, and the resumed run's own removed at exit
        assert f"under {d} left by crashed runs" in resumed.stderr and names[0] in resumed.stderr, resumed.stderr[-3000:]
        assert os.listdir(d) == []
    ref_losses, losses = _losses(whole), _losses(split)
    assert [losses[s] for s in range(saved + 1, final + 1)] == [ref_losses[s] for s in range(saved + 1, final + 1)]
    ours, theirs = load_saved(os.path.join(split, "model")), load_saved(os.path.join(whole, "model"))
    for (name, p), q in zip(ours.state_dict().items(), theirs.state_dict().values()):
        assert torch.equal(p, q), name  # bit for bit
    # each drive's bytes: in every step's telemetry (rank 0's: both drives when striped) and in the summary
    steps = [r for r in read_jsonl(os.path.join(whole, "telemetry.jsonl")) if r["event"] == "step"]
    for k in (0, 1) if layout == "stripe" else (0,):
        assert all(r[f"engine.drive{k}_read_bytes"] > 0 and r[f"engine.drive{k}_write_bytes"] > 0 for r in steps[1:])
        assert all(r[f"drive{k}_read_gb_per_s"] == r[f"engine.drive{k}_read_bytes"] / r["step_s"] / 1e9 for r in steps)
    summary = next(r for r in read_jsonl(os.path.join(whole, "telemetry.jsonl")) if r["event"] == "summary")
    assert sorted(summary["drive_bytes"]) == sorted(drives)
    assert all(summary["drive_bytes"][d]["write"] > 0 for d in drives), summary["drive_bytes"]
    assert all(summary["drive_gb_per_s"][d]["read"] > 0 for d in drives), summary["drive_gb_per_s"]
    assert "per drive, all ranks" in ref.stdout and all(d in ref.stdout for d in drives), ref.stdout[-3000:]


# ------------------------------------------------------------------ the preflight, per drive


@pytest.fixture
def small_drive(tmp_path):
    """A 256 KiB tmpfs: a drive too small for the tiny model's swap files (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    point = tmp_path / "small"
    point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(point)], capture_output=True,
                             text=True, timeout=60)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield str(point)
    finally:
        subprocess.run(["umount", "-l", str(point)], capture_output=True, timeout=60)


def _mount_tmpfs(point, size: int) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)], capture_output=True,
                             text=True, timeout=60)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")


def test_two_drives_on_one_filesystem_share_its_free_space(drives, tmp_path):
    """Two listed directories on one filesystem (an unmounted drive's mount point on the root
    disk, two directories of one drive) draw on one free space: the preflight checks their
    swap bytes together, so a filesystem with room for each drive's half of a striped rank's
    files but not for both refuses the run naming both, before the first byte."""
    from infinity._offload._preflight import plan

    cell = DriveCell("gpt2", "none", 3, "nvme", "nvme", persist=0, layout="stripe")
    model, opt = infinity.initialize(build("gpt2"), config=cell.config([drives[1], drives[0]]))
    try:
        total = sum(plan(opt.engine.placement, opt.engine.cfg)["nvme"].values())
    finally:
        infinity.close(model)
    point = tmp_path / "one-fs"
    _mount_tmpfs(point, -(-total * 3 // 4 // 4096) * 4096)  # room for either half, not for both
    try:
        a, b = str(point / "a"), str(point / "b")
        said = io.StringIO()
        handler = logging.StreamHandler(said)
        infinity.logger.addHandler(handler)
        try:
            message = _refusal(cell.config([a, b]))
        finally:
            infinity.logger.removeHandler(handler)
        assert f"nvme_path lists {a} and {b}, which are one filesystem" in said.getvalue()
        assert f"disk under {a} and {b} (one filesystem): " in message, message
        assert sorted(os.listdir(point)) == [] or all(os.listdir(point / d) == [] for d in os.listdir(point))
    finally:
        subprocess.run(["umount", "-l", str(point)], capture_output=True, timeout=60)


def _refusal(cfg: dict) -> str:
    from infinity.errors import InsufficientResourcesError

    try:
        model, _ = infinity.initialize(build("gpt2"), config=cfg)
    except InsufficientResourcesError as err:
        return str(err)
    infinity.close(model)
    return "initialized"


@pytest.mark.parametrize("layout", ["per_rank", "stripe"])
def test_the_preflight_checks_every_drive(drives, small_drive, layout):
    """Every listed drive's free space is checked for what the node's ranks put there, also a
    drive this rank does not write to (rank layout: rank 0 is on the first drive, rank 1 of the
    two on this node would be on the small one)."""
    from infinity._offload._preflight import node_need, plan

    cell = DriveCell("gpt2", "none", 3, "nvme", "nvme", persist=0, layout=layout)
    refusals = run_ranks(_refusal, 2, cell.config([drives[1], small_drive]), timeout=120, threads=1)
    for message in refusals:  # each rank checks the node's drives
        assert f"disk under {small_drive}: 2 rank(s) together: " in message, message
    assert os.listdir(small_drive) == [] and os.listdir(drives[1]) == []  # refused before the first byte
    model, opt = infinity.initialize(build("gpt2"), config=cell.config([drives[1], drives[0]]))
    try:
        need = plan(opt.engine.placement, opt.engine.cfg)
        held = opt.engine.tier_bytes()["nvme"]
        assert sum(need["nvme"].values()) == held
        assert sorted(need["nvme"]) == sorted(drives if layout == "stripe" else [drives[1]])
        node = node_need(opt.engine.cfg, need, 2)
        assert node == ({drives[1]: held, drives[0]: held} if layout == "per_rank" else
                        {d: need["nvme"][d] * 2 for d in drives})
    finally:
        infinity.close(model)
