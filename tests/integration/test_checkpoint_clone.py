"""Checkpoints cloned from the swap files where the filesystem shares extents (Note [cloned
checkpoints] in infinity/_checkpoint/_clone.py), on a loop-mounted XFS the test makes itself.

A cloned save resumes bit for bit, stays unchanged while training rewrites the swap files
(copy-on-write), records the CRC32C combined from the swap files' block sums, and a kill -9
during cloned saves leaves ``latest`` at a checkpoint that loads. Where the filesystem cannot
share extents the save copies, as before, and says why.
"""
import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from _models import batches, build
from _xfs import xfs_mount
from test_checkpoint import KIND, _cfg, _params, _train  # the same model, config and training loop

import infinity
from infinity._checkpoint import CheckpointReader
from infinity.aio._checksum import crc32c
from infinity.aio._clone import clone_range, clone_support
from infinity.aio._crc_combine import combine_blocks
from infinity.testing import run_ranks

N = 3
COMBOS = [(3, "nvme", "nvme"), (1, None, "nvme")]
ARRAYS = ("params", "master", "exp_avg", "exp_avg_sq")


def _digests(path):
    out = {}
    for root, _, names in os.walk(path):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.relpath(os.path.join(root, name), path)] = hashlib.sha256(f.read()).hexdigest()
    return out


# ---------------------------------------------------------------------------------------- pieces


@pytest.mark.parametrize("nbytes", [1, 4096, 4097, 5 * 4096 + 17, 333 * 4096, 1000 * 4096 + 5])
def test_combined_block_sums_equal_the_crc32c_of_the_bytes(nbytes):
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    sums = np.array([crc32c(data[k : k + 4096]) for k in range(0, nbytes, 4096)], dtype=np.uint32)
    assert combine_blocks(sums, 4096, nbytes - (len(sums) - 1) * 4096) == crc32c(data)


def test_block_sums_entries_read_back_and_vouch_for_a_copy(tmp_path):
    """The table's entries are the CRC32C of each block written; set on another file's table,
    they are checked on its reads (a wrong one fails the read)."""
    from infinity.aio import AsyncIO, CorruptionError, aligned_empty
    from infinity.aio._checksum import checksummed, sums_of

    nbytes = 5 * 4096
    src = checksummed(str(tmp_path / "a.swp"), nbytes, True)
    data = aligned_empty(nbytes)
    data.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)))
    with AsyncIO() as h:
        h.pwrite(data, src, 0)
        h.wait()
    entries = sums_of(src).entries(0, 5)
    raw = data.numpy().tobytes()
    assert [int(e) & 0xFFFFFFFF for e in entries] == [crc32c(raw[k : k + 4096]) for k in range(0, nbytes, 4096)]
    assert all(int(e) >> 32 == 4096 for e in entries)
    dst = checksummed(str(tmp_path / "b.swp"), nbytes, True)
    with open(dst, "wb") as f:
        f.write(raw)
    sums_of(dst).set_entries(0, entries)
    out = aligned_empty(nbytes)
    with AsyncIO() as h:
        h.pread(out, dst, 0)
        h.wait()
        assert torch.equal(out, data)
        wrong = entries.copy()
        wrong[2] ^= np.uint64(1)
        sums_of(dst).set_entries(0, wrong)
        h.pread(out, dst, 0)
        with pytest.raises(CorruptionError):
            h.wait()


def test_clone_support_says_why_not_across_filesystems(tmp_path):
    with xfs_mount(str(tmp_path)) as xfs:
        os.makedirs(os.path.join(xfs, "a"))
        assert clone_support(os.path.join(xfs, "a"), xfs).ok
        other = clone_support(str(tmp_path), xfs)
        assert not other.ok and "different filesystems" in other.reason


def test_clone_shares_blocks_and_copy_on_write_keeps_the_clone(tmp_path):
    with xfs_mount(str(tmp_path)) as xfs:
        src, dst = os.path.join(xfs, "src"), os.path.join(xfs, "dst")
        data = os.urandom(3 * 4096 + 100)
        with open(src, "wb") as f:
            f.write(data)
        clone_range(src, 0, dst, 0, len(data))
        with open(src, "r+b") as f:  # the source rewritten after the clone
            f.write(b"\xff" * 8192)
        with open(dst, "rb") as f:
            assert f.read() == data
        filefrag = subprocess.run(["filefrag", "-v", dst], capture_output=True, text=True)
        if filefrag.returncode == 0:
            assert "shared" in filefrag.stdout  # the untouched blocks are still shared


# ---------------------------------------------------------------------------------------- training


def _run(combo, steps, nvme, *, seed=0, load=None, save=None, more=()):
    """Build, optionally load, train, optionally save and train ``more`` steps after it; the
    losses, the weights at the save, the manifest's checksum kinds, and the checkpoint's file
    digests right after the save and after the further steps."""
    model, opt = infinity.initialize(build(KIND, seed=seed), _cfg(*combo, nvme))
    if load:
        infinity.load_checkpoint(load, model, opt)
    losses = _train(model, opt, steps)
    kinds = before = after = None
    if save:
        path = infinity.save_checkpoint(save, model, opt, tag="t", client_state={"data_position": len(steps)})
        reader = CheckpointReader(path)
        kinds = {rel: "crc32c" if "crc32c" in e else "crc32" for rel, e in reader.manifest["files"].items()}
        kinds["version"] = reader.manifest["version"]
        reader.close()
        before = _digests(path)
        weights = _params(model)
        _train(model, opt, more)
        after = _digests(path)
    else:
        weights = _params(model)
    opt.engine.close()
    return losses, weights, kinds, before, after


def _phases(base, combos):
    steps = batches(2 * N)
    out = {}
    for i, combo in enumerate(combos):
        ref = _run(combo, steps, f"{base}/nvme")
        saved = _run(combo, steps[:N], f"{base}/nvme", save=f"{base}/ck{i}", more=steps[N:])
        out[combo] = ref, saved
    return out


def _resume(base, combos):
    steps = batches(2 * N)
    return {combo: _run(combo, steps[N:], f"{base}/nvme", seed=7, load=f"{base}/ck{i}")
            for i, combo in enumerate(combos)}


def test_cloned_save_resumes_bit_for_bit_and_stays_unchanged(tmp_path):
    with xfs_mount(str(tmp_path)) as xfs:
        first = run_ranks(_phases, 1, xfs, COMBOS, timeout=240)[0]
        resumed = run_ranks(_resume, 1, xfs, COMBOS, timeout=240)[0]
    for combo in COMBOS:
        (ref_losses, ref_weights, *_), (_, _, kinds, before, after) = first[combo]
        losses, weights, *_ = resumed[combo]
        on_nvme = [f"rank0/{a}.bin" for a in ARRAYS if a != "params" or combo[1] == "nvme"]
        assert all(kinds[rel] == "crc32c" for rel in on_nvme), (combo, kinds)  # cloned, checksummed from the sums
        assert kinds["version"] == 3  # CRC32Cs, no pickle (Note [manifest versions] in _format.py)
        assert before == after, combo  # training on after the save did not change the checkpoint
        assert ref_losses[N:] == losses, combo
        for name, p in ref_weights.items():
            assert torch.equal(p, weights[name]), (combo, name)


def _save_copied(base, nvme):
    model, opt = infinity.initialize(build(KIND), _cfg(3, "nvme", "nvme", nvme))
    _train(model, opt, batches(1))
    path = infinity.save_checkpoint(f"{base}/ck", model, opt, tag="t")
    reader = CheckpointReader(path)
    kinds = sorted({"crc32c" if "crc32c" in e else "crc32" for e in reader.manifest["files"].values()})
    version = reader.manifest["version"]
    reader.close()
    opt.engine.close()
    return kinds, version


def test_save_across_filesystems_copies(tmp_path):
    with xfs_mount(str(tmp_path)) as xfs:  # swap files on the machine's disk, the checkpoint on XFS
        kinds, version = run_ranks(_save_copied, 1, xfs, str(tmp_path / "nvme"), timeout=120)[0]
    assert kinds == ["crc32"] and version == 3  # every file copied, CRC-32s only; version 3: no pickle


KILL_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "checkpoint_kill_loop.py")


def test_kill_during_cloned_saves_leaves_latest_complete(tmp_path):
    with xfs_mount(str(tmp_path)) as xfs:
        out = subprocess.run([sys.executable, KILL_SCRIPT, "--trials", "3", "--dir", xfs, "--seed", "2"],
                             capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3/3 trials" in out.stdout
