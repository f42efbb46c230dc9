"""InfinityTrainer (transformers.Trainer on infinity): same losses as the plain Trainer with
AdamW, save / kill / resume continuing exactly, a normal Hugging Face directory from
save_model, and generate() at two stage-3 ranks whose sequences end at different lengths."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import infinity
from infinity.errors import UsageError

pytest.importorskip("transformers")

from _trainer_job import dataset, losses, tiny_llama, training_args  # noqa: E402

from infinity.integrations.transformers import InfinityTrainer  # noqa: E402
from infinity.testing import run_ranks  # noqa: E402

HERE = Path(__file__).resolve().parents[1]  # tests/: the job script and the helpers


def _nvme_config(path: str) -> dict:
    return {"zero": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": path},
                     "offload_optimizer": {"device": "nvme", "nvme_path": path}},
            "precision": {"dtype": "fp32"}}


def test_a_plain_trainer_trains_where_the_emulated_device_is_registered(tmp_path):
    """accelerate empties the device cache through ``torch.accelerator`` at the start of every
    ``train`` (Note [emulated accelerator in torch.accelerator] in _emulated_torch.py): with the emulator registered, as in
    every test process, a plain Trainer trains on the CPU."""
    from transformers import Trainer

    assert torch.accelerator.current_accelerator().type == "emu"
    trainer = Trainer(model=tiny_llama(), args=training_args(str(tmp_path), optim="adamw_torch", max_steps=2),
                      train_dataset=dataset())
    out = trainer.train()
    assert out.global_step == 2 and torch.isfinite(torch.tensor(out.training_loss))


def test_same_losses_as_plain_trainer_with_adamw(tmp_path):
    from transformers import Trainer

    plain = Trainer(model=tiny_llama(), args=training_args(str(tmp_path / "plain"), optim="adamw_torch"),
                    train_dataset=dataset())
    plain.train()
    ours = InfinityTrainer(model=tiny_llama(), args=training_args(str(tmp_path / "ours")), train_dataset=dataset(),
                           infinity_config=_nvme_config(str(tmp_path / "nvme")))
    ours.train()
    expected, got = losses(plain), losses(ours)
    assert len(expected) == len(got) == 4
    assert got == pytest.approx(expected, rel=0, abs=2e-5)
    norms = [[h["grad_norm"] for h in t.state.log_history if "loss" in h] for t in (plain, ours)]
    assert norms[1] == pytest.approx(norms[0], rel=1e-4)  # the pre-clip norm, logged after infinity's step
    groups = ours.optimizer.param_groups  # the Trainer's groups: no decay on norms
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    no_decay = {id(p) for p in groups[1]["params"]}
    assert all(id(p) in no_decay for n, p in ours.model.named_parameters() if "norm" in n)
    assert ours.optimizer.engine.cfg.zero.offload_param.device == "nvme"


def test_fp16_step_skipped_on_overflow_does_not_step_the_scheduler(tmp_path):
    cfg = {"zero": {"stage": 2}, "precision": {"dtype": "fp16", "loss_scale": 1.0e30}}  # every step overflows
    args = training_args(str(tmp_path / "run"), max_steps=3, lr_scheduler_type="linear", warmup_steps=2)
    ours = InfinityTrainer(model=tiny_llama(), args=args, train_dataset=dataset(), infinity_config=cfg)
    before = [p.detach().half().float() for p in ours.model.parameters()]  # the fp16 cast, nothing more
    ours.train()
    assert ours.optimizer.skipped
    assert [h["learning_rate"] for h in ours.state.log_history if "loss" in h] == [0.0, 0.0, 0.0]
    assert all(torch.equal(a, p.detach().float()) for a, p in zip(before, ours.model.parameters()))


def test_refuses_an_optimizer_of_its_own(tmp_path):
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(Exception, match="builds the optimizer"):
        InfinityTrainer(model=model, args=training_args(str(tmp_path)), train_dataset=dataset(), optimizers=(opt, None))


def test_model_init_builds_under_init_and_evaluates(tmp_path):
    from transformers import Trainer

    args = training_args(str(tmp_path / "a"), max_steps=2)
    plain = Trainer(model_init=lambda: tiny_llama(), args=args, train_dataset=dataset(), eval_dataset=dataset(8, seed=3))
    plain.train()
    ours = InfinityTrainer(model_init=lambda: tiny_llama(), args=training_args(str(tmp_path / "b"), max_steps=2),
                           train_dataset=dataset(), eval_dataset=dataset(8, seed=3), infinity_config={"zero": {"stage": 3}})
    ours.train()
    assert losses(ours) == pytest.approx(losses(plain), abs=2e-5)
    assert ours.evaluate()["eval_loss"] == pytest.approx(plain.evaluate()["eval_loss"], abs=2e-5)


def test_save_model_writes_a_hugging_face_directory(tmp_path):
    from transformers import AutoModelForCausalLM

    ours = InfinityTrainer(model=tiny_llama(), args=training_args(str(tmp_path / "run"), max_steps=2),
                           train_dataset=dataset(), infinity_config={"zero": {"stage": 3}})
    ours.train()
    out = str(tmp_path / "hf")
    ours.save_model(out)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.arange(12).view(1, 12)
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, ours.model(input_ids=ids).logits, atol=1e-5)


def _run_job(out: str, nvme: str, steps: int, resume: bool = False, save_async: bool = False) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE)]))
    cmd = [sys.executable, str(HERE / "_trainer_job.py"), out, nvme, str(steps)] + (["resume"] if resume else []) \
        + (["async"] if save_async else [])
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _complete_checkpoints(out: str) -> list:
    found = []
    for name in os.listdir(out) if os.path.isdir(out) else []:
        if name.startswith("checkpoint-") and os.path.exists(os.path.join(out, name, "trainer_state.json")):
            found.append(int(name.split("-")[1]))
    return sorted(found)


def _step_losses(path: str) -> dict:
    return {h["step"]: h["loss"] for h in json.loads(Path(path).read_text())}


STEPS = 6


@pytest.fixture(scope="module")
def uninterrupted_job(tmp_path_factory):
    """The output directory of one uninterrupted ``STEPS``-step job (blocking saves), shared by
    the tests that compare a killed and resumed job with it: copy it before changing it."""
    root = tmp_path_factory.mktemp("uninterrupted")
    job = _run_job(str(root / "run"), str(root / "nvme"), STEPS)
    assert job.wait(timeout=300) == 0, job.stderr.read().decode()[-3000:]
    return root / "run"


@pytest.mark.parametrize("save_async", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["blocking", "async"])
def test_save_kill_resume_continues_exactly(tmp_path, save_async, uninterrupted_job):
    steps = STEPS
    expected = _step_losses(str(uninterrupted_job / "losses.json"))
    out = str(tmp_path / "run")
    job = _run_job(out, str(tmp_path / "nvme"), steps, save_async=save_async)
    deadline = time.monotonic() + 300
    while not _complete_checkpoints(out) or _complete_checkpoints(out)[-1] < 2:
        assert job.poll() is None, "the job ended before it was killed"
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.05)
    job.send_signal(signal.SIGKILL)
    job.wait(timeout=60)
    assert job.returncode == -signal.SIGKILL
    saved = _complete_checkpoints(out)[-1]
    assert saved < steps
    resumed = _run_job(out, str(tmp_path / "nvme"), steps, resume=True, save_async=save_async)
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read().decode()[-3000:]
    got = _step_losses(os.path.join(out, "losses.json"))
    after = [s for s in range(1, steps + 1) if s > saved]
    assert after and [got[s] for s in after] == [expected[s] for s in after]
    assert len(_complete_checkpoints(out)) <= 2  # save_total_limit


def _whole_checkpoints(out: str) -> list:
    """The checkpoint-N that a resume could use: infinity's states committed and the Trainer's state."""
    return [n for n in _complete_checkpoints(out)
            if os.path.exists(os.path.join(out, f"checkpoint-{n}", "infinity", "manifest.json"))]


def test_async_saves_with_save_total_limit_1_always_leave_a_whole_checkpoint(tmp_path):
    """Note [rotation after the commit] in transformers.py: with save_total_limit=1 and save_async, a save every
    step, and each background copy stalled so that it is still in flight when the Trainer's
    save returns, a whole checkpoint exists after every save but the first, and the run ends
    with exactly the last one."""
    from transformers import TrainerCallback

    from infinity.aio._inject import clear, inject

    out = str(tmp_path / "run")
    seen = []

    class Watch(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            inject(trainer.optimizer.store.paths["master"], "read", "stall", nth=1, count=0, arg=400)

        def on_save(self, args, state, control, **kwargs):
            pending = trainer.optimizer.engine.save_fence.pending
            seen.append((state.global_step, pending is not None and not pending.done(), _whole_checkpoints(out)))

    args = training_args(out, max_steps=4, save_strategy="steps", save_steps=1, save_total_limit=1)
    trainer = InfinityTrainer(model=tiny_llama(), args=args, train_dataset=dataset(),
                              infinity_config=_nvme_config(str(tmp_path / "nvme")), save_async=True,
                              callbacks=[Watch()])
    try:
        trainer.train()
    finally:
        clear()
    assert [step for step, _, _ in seen] == [1, 2, 3, 4]
    assert all(in_flight for _, in_flight, _ in seen), seen  # each save was still being written
    assert all(whole for step, _, whole in seen if step > 1), seen  # never without a whole checkpoint
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-4"]
    assert _whole_checkpoints(out) == [4]


def _generate_two_ranks(nvme: str):
    from infinity._runtime import _comm as comm
    from infinity.integrations.transformers import synced_generate

    reference = tiny_llama(seed=0).eval()
    model = tiny_llama(seed=0).eval()
    cfg = {"zero": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                    "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
                    "prefetch": {"persistence_threshold": 0}}}
    model, _ = infinity.initialize(model, config=cfg)
    rank = comm.rank()
    synced_generate(model)
    prompt = torch.tensor([[5 + rank, 17, 3, 40 + rank]])
    new_tokens = 3 if rank == 0 else 9  # rank 0 stops first and must keep stepping with rank 1
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        want = reference.generate(prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out.tolist(), want.tolist()


def test_generate_two_stage3_ranks_with_different_lengths_finishes(tmp_path):
    results = run_ranks(_generate_two_ranks, 2, str(tmp_path / "nvme"), timeout=240)
    for rank, (out, want) in enumerate(results):
        assert out == want
        assert len(out[0]) == 4 + (3 if rank == 0 else 9)


def _trainer_two_ranks(out: str, nvme: str):
    from transformers import Trainer

    plain = Trainer(model=tiny_llama(), args=training_args(out + "/plain", optim="adamw_torch"), train_dataset=dataset())
    plain.train()
    ours = InfinityTrainer(model=tiny_llama(), args=training_args(out + "/ours"), train_dataset=dataset(),
                           infinity_config=_nvme_config(nvme))
    ours.train()
    wrapped = type(ours.model_wrapped).__name__
    return losses(plain), losses(ours), wrapped, ours.optimizer.engine.world_size, plain.args.world_size


@pytest.mark.slow  # 80 s on two shared cores
def test_two_ranks_same_losses_as_plain_trainer_with_ddp(tmp_path):
    results = run_ranks(_trainer_two_ranks, 2, str(tmp_path), str(tmp_path / "nvme"), timeout=300)
    for expected, got, wrapped, world, plain_world in results:
        assert world == plain_world == 2 and wrapped == "LlamaForCausalLM"  # no DDP around it: infinity reduces the gradients
        assert len(got) == 4 and got == pytest.approx(expected, rel=0, abs=2e-5)


def test_activation_checkpointing_through_training_arguments(tmp_path):
    from transformers import Trainer

    over = dict(max_steps=3, activation_checkpointing=True)
    plain = Trainer(model=tiny_llama(), args=training_args(str(tmp_path / "a"), optim="adamw_torch", **over),
                    train_dataset=dataset())
    plain.train()
    ours = InfinityTrainer(model=tiny_llama(), args=training_args(str(tmp_path / "b"), **over), train_dataset=dataset(),
                           infinity_config={"zero": {"stage": 3}})
    ours.train()
    assert ours.model.is_activation_checkpointing
    assert losses(ours) == pytest.approx(losses(plain), abs=2e-5)


def test_deepspeed_json_path_resolved_from_the_model_and_arguments(tmp_path):
    path = Path(__file__).resolve().parents[2] / "examples" / "deepspeed" / "ds_zero3_bf16_cpu_auto.json"
    model = tiny_llama()
    args = training_args(str(tmp_path), learning_rate=2e-4, max_grad_norm=0.5, weight_decay=0.0)
    trainer = InfinityTrainer(model=model, args=args, train_dataset=dataset(), infinity_config=str(path))
    cfg = trainer.infinity_config(model)
    assert trainer.infinity_config(model) is cfg  # built (and logged) once
    assert (cfg.zero.reduce_bucket_size, cfg.zero.prefetch.bucket_size, cfg.zero.prefetch.persistence_threshold) == \
        (32 * 32, int(0.9 * 32 * 32), 320)
    assert (cfg.optimizer.lr, cfg.gradient_clipping, cfg.gradient_accumulation_steps) == (2e-4, 0.5, 2)
    assert (cfg.zero.offload_param.device, cfg.precision.dtype, cfg.scheduler.type) == ("cpu", "fp32", "WarmupDecayLR")


def test_model_init_logs_the_auto_values_once_with_the_models(tmp_path, infinity_logs):
    """Under ``model_init`` the config is built for ``Init`` before the model exists and again with
    it: the auto values are logged once, the model's (issue 52, point 6), not infinity's defaults first."""
    path = Path(__file__).resolve().parents[2] / "examples" / "deepspeed" / "ds_zero3_bf16_cpu_auto.json"
    trainer = InfinityTrainer(model_init=lambda: tiny_llama(), args=training_args(str(tmp_path), max_steps=1),
                              train_dataset=dataset(), infinity_config=str(path))
    trainer.train()
    lines = [r.getMessage() for r in infinity_logs.records if "DeepSpeed 'auto' values" in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"reduce_bucket_size={32 * 32}" in lines[0] and "infinity's default" not in lines[0]


def test_deepspeed_schedule_steps_must_agree_with_the_run(tmp_path):
    ds = {"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5, "total_num_steps": 4}}}
    trainer = InfinityTrainer(model=tiny_llama(), args=training_args(str(tmp_path)), train_dataset=dataset(),
                              infinity_config=ds)
    with pytest.raises(Exception, match="warmup_num_steps=5 differs from the run's 1") as err:
        trainer.train()
    assert "total_num_steps" not in str(err.value)  # 4 = max_steps agrees


def test_resume_true_skips_a_checkpoint_cut_short_by_a_crash(tmp_path, infinity_logs):
    from infinity.integrations.transformers import CHECKPOINT_TAG, last_complete_checkpoint

    for n, whole in ((2, True), (3, True), (4, False), (10, False)):
        d = tmp_path / f"checkpoint-{n}"
        (d / CHECKPOINT_TAG).mkdir(parents=True) if whole else d.mkdir()
        if whole:
            (d / "trainer_state.json").write_text("{}")
    assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-3")  # not 10 (numeric order), not 4
    assert "checkpoint-10, checkpoint-4 in" in infinity_logs.text and "not saved whole" in infinity_logs.text
    with pytest.raises(UsageError, match="no complete checkpoint-N"):
        last_complete_checkpoint(str(tmp_path / "checkpoint-10"))


def test_resume_after_a_kill_between_infinitys_commit_and_the_trainers_state(tmp_path, uninterrupted_job):
    """A kill after infinity committed checkpoint-N but before the Trainer wrote its state leaves
    checkpoint-N partial: the resumed run starts from the one before and saves step N again."""
    steps = STEPS
    out, nvme = str(tmp_path / "run"), str(tmp_path / "nvme")
    shutil.copytree(uninterrupted_job, out)  # an uninterrupted job's directory, changed below
    expected = _step_losses(os.path.join(out, "losses.json"))
    last = _complete_checkpoints(out)[-1]
    os.remove(os.path.join(out, f"checkpoint-{last}", "trainer_state.json"))  # as if killed there
    before = _complete_checkpoints(out)[-1]
    assert before < last
    resumed = _run_job(out, nvme, steps, resume=True)
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read().decode()[-3000:]
    got = _step_losses(os.path.join(out, "losses.json"))
    assert [got[s] for s in range(before + 1, steps + 1)] == [expected[s] for s in range(before + 1, steps + 1)]
    assert _complete_checkpoints(out)[-1] == last  # saved whole this time
