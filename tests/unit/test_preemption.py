"""The train job's signal handling (Note [preemption] in infinity/_checkpoint/_train.py), with
real signals sent to this process: with ``--save-on-signal`` the first SIGTERM or SIGINT only
asks the loop to save and stop, a second stops at once as without the flag; without it the
handlers are left as they are."""
import os
import signal

import pytest
import torch.distributed as dist

from infinity._checkpoint._train import TrainCheckpoints, _stopped_text, interrupted_text
from infinity.errors import UsageError


def _send(sig) -> None:
    os.kill(os.getpid(), sig)  # the handler runs before the next bytecode


@pytest.mark.parametrize("sig,stops", [(signal.SIGTERM, SystemExit), (signal.SIGINT, KeyboardInterrupt)])
def test_the_first_signal_asks_the_second_stops(tmp_path, sig, stops):
    ck = TrainCheckpoints.from_args(None, None, None, str(tmp_path), save_on_signal=True)
    before = signal.getsignal(sig)
    with ck.on_signals():
        _send(sig)
        assert ck._flag and ck._signum == sig and ck.stopped_by is None  # named once the ranks agree to stop
        with pytest.raises(stops) as e:
            _send(sig)
    if stops is SystemExit:
        assert e.value.code == 128 + sig
    assert signal.getsignal(sig) is before  # restored after the loop


def test_a_signal_in_the_last_step_lets_the_job_end_as_it_would(tmp_path):
    """The last step's end is no stop: the job ends as it would, its weights exported, since
    ``run_job`` exports unless the job was stopped."""
    ck = TrainCheckpoints.from_args(None, None, None, str(tmp_path), save_on_signal=True)
    with ck.on_signals():
        _send(signal.SIGTERM)
    assert ck.after_step(None, 3, 3) is False and ck.stopped_by is None


def test_the_resume_command_keeps_the_launch(tmp_path, monkeypatch):
    """The command that resumes a job stopped by a signal launches as many ranks as it had."""
    monkeypatch.setattr("sys.argv", ["infinity.train", "--steps", "9", "--resume", "x", "--save-on-signal"])
    for world, local, launch in [(None, None, "python -m"), ("2", "2", "torchrun --nproc-per-node 2 -m"),
                                 ("16", "8", "the launcher's command for the same 16 ranks, each running -m")]:
        for key, value in (("WORLD_SIZE", world), ("LOCAL_WORLD_SIZE", local)):
            monkeypatch.delenv(key, raising=False) if value is None else monkeypatch.setenv(key, value)
        text = _stopped_text("SIGTERM", 5, str(tmp_path / "step5"))
        assert text.endswith(f"Resume with: {launch} infinity.train --steps 9 --save-on-signal --resume auto"), text


def test_without_the_flag_the_handlers_stay(tmp_path):
    ck = TrainCheckpoints.from_args(1, None, None, str(tmp_path))
    before = signal.getsignal(signal.SIGINT)
    with ck.on_signals():
        assert signal.getsignal(signal.SIGINT) is before
    with pytest.raises(UsageError, match="--save-on-signal saves a checkpoint under --output-dir"):
        TrainCheckpoints.from_args(None, None, None, None, save_on_signal=True)


def test_what_a_job_stopped_at_once_says(tmp_path):
    ck = TrainCheckpoints.from_args(2, None, None, str(tmp_path))
    text = interrupted_text(ck, "SIGINT", 3)
    assert "stopped by SIGINT in step 3, without saving (--save-on-signal" in text
    assert "no checkpoint is complete yet (--save-every 2" in text  # not told to pass the flag it passed
    text = interrupted_text(TrainCheckpoints.from_args(None, None, None, str(tmp_path)), "SIGINT", 3)
    assert "no checkpoint was saved (--save-every N" in text


def test_without_the_flag_a_step_issues_no_collective(tmp_path):
    """The ranks' all-reduce of the stop flags runs only with ``--save-on-signal``: without it
    no signal asks for a stop, and a step's end is no synchronisation point of the ranks."""
    from infinity._runtime import _comm as comm

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        before = comm._issued  # collectives this process issued (Note [one rank failing] in _comm.py)
        assert TrainCheckpoints.from_args(None, None, None, str(tmp_path)).after_step(None, 1, 3) is False
        assert comm._issued == before
        ck = TrainCheckpoints.from_args(None, None, None, str(tmp_path), save_on_signal=True)
        assert ck.after_step(None, 1, 3) is False
        assert comm._issued == before + 1  # with the flag: one all-reduce, no stop asked
    finally:
        dist.destroy_process_group()
