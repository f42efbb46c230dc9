"""``save_checkpoint(..., blocking=False)``: the states as of the call, while training goes on
(Note [asynchronous saves] in infinity/_checkpoint/_async.py, Note [save fence] in
infinity/_runtime/_save_fence.py).

An asynchronous save holds the same bytes as a blocking save at the same moment, although the
next steps run while it is written (a stalled read of the swap file keeps it in flight), and
resumes bit for bit; a second save and ``close`` wait for it; a failure in the background
raises at ``wait()`` and at the next save on every rank, leaving ``latest`` where it was; an
unknown keyword is a TypeError naming it.
"""
import errno
import hashlib
import os
import subprocess
import sys

import pytest
import torch
from _models import batches, build
from _xfs import xfs_mount
from test_checkpoint import KIND, _cfg, _params, _train  # the same model, config and training loop

import infinity
from infinity._checkpoint import CheckpointReader
from infinity.aio._inject import clear, inject
from infinity.errors import InfinityError
from infinity.testing import run_ranks

N = 3
COMBOS = [(3, "nvme", "nvme"), (1, None, "cpu"), (2, None, "nvme")]
STALL_MS = 1500


def _bins(path):
    """Digest of every shard file and the step counts of the manifest."""
    reader = CheckpointReader(path)
    out = {"steps": [p["step"] for p in reader.manifest["params"]], "step": reader.manifest["step"]}
    reader.close()
    for rel in sorted(os.listdir(os.path.join(path, f"rank{torch.distributed.get_rank()}"))):
        if rel.endswith(".bin"):
            with open(os.path.join(path, f"rank{torch.distributed.get_rank()}", rel), "rb") as f:
                out[rel] = hashlib.sha256(f.read()).hexdigest()
    return out


def _swap_file(opt):
    """A swap file the background copy reads (None where the states are in memory)."""
    paths = getattr(opt.store, "paths", None)
    return str(paths["master"]) if paths else None


def _save_both_ways(base, nvme, combo, i):
    """N steps, a blocking save and an asynchronous one of the same states, N steps while the
    latter is in flight; the digests of both and the run's losses and weights."""
    steps = batches(2 * N)
    model, opt = infinity.initialize(build(KIND), _cfg(*combo, nvme))
    _train(model, opt, steps[:N])
    blocking = infinity.save_checkpoint(f"{base}/blocking{i}", model, opt, tag="t", client_state={"at": N})
    swap = _swap_file(opt)
    if swap is not None:
        inject(swap, "read", "stall", nth=1, count=1, arg=STALL_MS)  # the background copy's first read waits
    handle = infinity.save_checkpoint(f"{base}/async{i}", model, opt, tag="t", client_state={"at": N},
                                      blocking=False)
    in_flight = not handle.done()
    losses = _train(model, opt, steps[N:])  # steps during the save
    path = handle.wait()
    clear()
    weights = _params(model)
    opt.engine.close()
    return in_flight or swap is None, _bins(blocking), _bins(path), losses, weights


def _resume(base, nvme, combo, i):
    steps = batches(2 * N)
    model, opt = infinity.initialize(build(KIND, seed=5), _cfg(*combo, nvme))
    extra = infinity.load_checkpoint(f"{base}/async{i}", model, opt)
    losses = _train(model, opt, steps[N:])
    weights = _params(model)
    opt.engine.close()
    return extra, losses, weights


def _check(results, resumed):
    for (in_flight, blocking, saved, losses, weights), (extra, losses2, weights2) in zip(results, resumed):
        assert in_flight  # the save was still running when training went on
        assert saved == blocking  # the steps during the save did not change what it holds
        assert extra == {"at": N}
        assert losses == losses2
        for name, p in weights.items():
            assert torch.equal(p, weights2[name]), name


def _phase(fn, base, nvme):
    return [fn(base, nvme, combo, i) for i, combo in enumerate(COMBOS)]


def test_async_save_holds_the_states_of_the_call(tmp_path):
    """Swap files copied in the background (this machine's disk), host states staged."""
    base, nvme = str(tmp_path), str(tmp_path / "nvme")
    results = run_ranks(_phase, 1, _save_both_ways, base, nvme, timeout=240)[0]
    resumed = run_ranks(_phase, 1, _resume, base, nvme, timeout=240)[0]
    _check(results, resumed)


def test_async_cloned_save_holds_the_states_of_the_call(tmp_path):
    with xfs_mount(str(tmp_path)) as xfs:
        nvme = f"{xfs}/nvme"
        results = run_ranks(_phase, 1, _save_both_ways, xfs, nvme, timeout=240)[0]
        resumed = run_ranks(_phase, 1, _resume, xfs, nvme, timeout=240)[0]
    _check(results, resumed)


def _two_ranks(base):
    """Two ranks: an asynchronous save, steps, a second save that waits for the first."""
    steps = batches(2 * N)
    model, opt = infinity.initialize(build(KIND), _cfg(3, "nvme", "nvme", f"{base}/nvme"))
    _train(model, opt, steps[:N])
    first = infinity.save_checkpoint(f"{base}/ck", model, opt, tag="a", blocking=False)
    _train(model, opt, steps[N:])
    second = infinity.save_checkpoint(f"{base}/ck", model, opt, tag="b", blocking=False)
    opt.engine.close()  # waits for the second
    assert first.done() and second.done()
    return first.wait(), second.wait(), _bins(first.wait())


def test_async_saves_on_two_ranks_commit_in_order(tmp_path):
    out = run_ranks(_two_ranks, 2, str(tmp_path), timeout=180)
    first, second, _ = out[0]
    for path in (first, second):
        assert os.path.exists(os.path.join(path, "manifest.json"))
    with open(tmp_path / "ck" / "latest") as f:
        assert f.read().strip() == "b"
    reader = CheckpointReader(first)
    reader.verify(reader.manifest["files"])
    assert reader.manifest["step"] == N
    reader.close()


def _failing(base):
    model, opt = infinity.initialize(build(KIND), _cfg(3, "nvme", "nvme", f"{base}/nvme"))
    _train(model, opt, batches(1))
    infinity.save_checkpoint(f"{base}/ck", model, opt, tag="good")
    inject(_swap_file(opt), "read", "errno", nth=1, count=0, arg=errno.EIO)
    handle = infinity.save_checkpoint(f"{base}/ck", model, opt, tag="bad", blocking=False)
    errors = []
    try:
        handle.wait()
    except InfinityError as e:
        errors.append(str(e))
    clear()
    _train(model, opt, batches(1))
    try:
        infinity.save_checkpoint(f"{base}/ck", model, opt, tag="next")
    except InfinityError as e:
        errors.append(str(e))
    handle = infinity.save_checkpoint(f"{base}/ck", model, opt, tag="after", blocking=False)
    opt.engine.close()
    return errors, handle.done(), sorted(os.listdir(f"{base}/ck"))


def test_async_failure_raises_at_wait_and_at_the_next_save(tmp_path):
    errors, done, listing = run_ranks(_failing, 1, str(tmp_path), timeout=120)[0]
    assert len(errors) == 2, errors
    assert "Input/output error" in errors[0] or "EIO" in errors[0], errors[0]
    assert "asynchronous save before this call failed" in errors[1], errors[1]
    assert done
    assert [n for n in listing if not n.startswith(".")] == ["after", "good", "latest"]
    with open(tmp_path / "ck" / "latest") as f:
        assert f.read().strip() == "after"


HEADROOM = 96 << 20  # what the memory cgroup leaves the rank: less than its host states


def _save_under_a_memory_limit(base, nvme):
    """Stage 1 with the states in host memory (~270 MB): an asynchronous save with the host's
    memory, then one in a memory cgroup that leaves HEADROOM; the warnings each logged, whether
    the second was done at the call, and both checkpoints' digests."""
    from _cgroup import memory_limit
    from _logs import kept_logs

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)])
    model, opt = infinity.initialize(model, _cfg(1, None, "cpu", nvme))
    model(torch.randn(4, 2048)).pow(2).mean().backward()
    opt.step()
    with kept_logs() as caught:
        roomy = infinity.save_checkpoint(f"{base}/ck", model, opt, tag="roomy", blocking=False).wait()
        warned_roomy = caught.messages
        caught.records.clear()
        with memory_limit(HEADROOM) as cgroup:
            handle = infinity.save_checkpoint(f"{base}/ck", model, opt, tag="limited", blocking=False)
            done_at_call = handle.done()
    numel = sum(p.numel() for p in model.parameters())
    host_states = numel * (torch.empty((), dtype=opt.engine.dtype).element_size() + 3 * 4)  # weights, master, moments
    opt.engine.close()
    return warned_roomy, caught.messages, cgroup, done_at_call, host_states, _bins(roomy), _bins(handle.wait())


def test_async_save_whose_host_copy_cannot_fit_saves_blocking_and_says_why(tmp_path):
    """Note [staged copies preflighted] in _save.py: under a real memory cgroup limit the save's staging
    copy would not fit, so it is made blocking (the same checkpoint), with the bytes, the
    cgroup and what to change in the log; with the host's memory it stays asynchronous."""
    from _cgroup import skip_unless_memory_limits

    skip_unless_memory_limits()
    roomy, limited, cgroup, done_at_call, host_states, digests, digests_limited = run_ranks(
        _save_under_a_memory_limit, 1, str(tmp_path), str(tmp_path / "nvme"), timeout=180)[0]
    assert not any("saves blocking instead" in m for m in roomy), roomy
    assert len(limited) == 1 and "saves blocking instead" in limited[0], limited
    assert f"would copy {host_states} bytes of states" in limited[0]
    assert f"the memory cgroup {cgroup} leaves" in limited[0] and "offload the states to NVMe" in limited[0]
    assert done_at_call  # saved before the call returned
    assert digests_limited == digests  # the same states, the same files


def _unknown_keyword(base):
    model, opt = infinity.initialize(build(KIND), _cfg(1, None, "cpu", f"{base}/nvme"))
    try:
        infinity.save_checkpoint(f"{base}/ck", model, opt, data_position=3)
    except TypeError as e:
        return str(e)
    finally:
        opt.engine.close()
    return ""


def test_unknown_keyword_is_a_type_error_naming_it(tmp_path):
    message = run_ranks(_unknown_keyword, 1, str(tmp_path), timeout=60)[0]
    assert "data_position" in message
    assert not os.path.exists(tmp_path / "ck")


@pytest.mark.parametrize("value", ["yes", None])
def test_blocking_must_be_a_bool(value):
    with pytest.raises(TypeError):
        infinity.save_checkpoint("unused", torch.nn.Linear(1, 1), None, blocking=value)


KILL_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "checkpoint_kill_loop.py")


def test_kill_during_async_saves_leaves_latest_complete(tmp_path):
    """kill -9 while asynchronous saves run beside the steps: ``latest`` names a complete
    checkpoint that loads."""
    out = subprocess.run([sys.executable, KILL_SCRIPT, "--trials", "2", "--dir", str(tmp_path), "--seed", "3",
                          "--async"], capture_output=True, text=True, timeout=220)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2/2 trials" in out.stdout
