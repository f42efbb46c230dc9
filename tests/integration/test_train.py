"""The main job, ``python -m infinity.train``, as a user runs it.

One 1-rank CLI run on a tiny config (stage 3, no offload, fp32) is shared by the checks of
its output: exit status, summary, JSON lines, warm-up, and safetensors that load back into
transformers. A 2-rank run under torchrun on the same global batch must give the same
losses and weights. The exported weights equal the trained ones exactly, sharded or not,
with tied embeddings saved once. Bad input exits with status 2 and says what to change.
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from _jobs import Jobs

import infinity
from infinity import train
from infinity._apps._train_data import Batches, ByteTokenizer, DataError, read_texts, token_windows
from infinity._checkpoint._safetensors_export import INDEX_FILE, export_safetensors

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 4
TINY_MODEL = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 258,
              "n_positions": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
TIMEOUT = 240


def tiny_config(micro_batch_size=2, **train_overrides):
    return {"zero": {"stage": 3, "reduce_bucket_size": 20000}, "precision": {"dtype": "fp32"},
            "optimizer": {"type": "adamw", "lr": 3e-3}, "gradient_clipping": 1.0, "seed": 7,
            "train": {"model": TINY_MODEL, "steps": STEPS, "micro_batch_size": micro_batch_size, "seq_len": 32,
                      "lr_warmup_steps": 2, "log_every": 2, **train_overrides}}


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("RANK", None)
    return env


def run_cli(args, launcher=None, cwd=None, env=None):
    cmd = (launcher or [sys.executable]) + ["-m", "infinity.train"] + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env or _env(), cwd=cwd)


def run_clis(*jobs):
    """Independent one-rank jobs side by side (tests/_jobs.py), each ``args`` or ``(args, env)``;
    their results in order, as ``run_cli`` gives them."""
    with tempfile.TemporaryDirectory() as out, Jobs(Path(out)) as started:
        for i, job in enumerate(jobs):
            args, env = job if isinstance(job, tuple) else (job, None)
            started.start(str(i), [sys.executable, "-m", "infinity.train"] + args, env=env or _env())
        return [started.result(str(i), timeout=TIMEOUT) for i in range(len(jobs))]


def write_config(path, cfg):
    with open(path, "w") as f:
        json.dump(cfg, f)
    return str(path)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def step_losses(run_dir):
    return [r["loss"] for r in read_jsonl(os.path.join(run_dir, "telemetry.jsonl")) if r["event"] == "step"]


def load_saved(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("one_rank")
    cfg = write_config(d / "tiny.json", tiny_config(micro_batch_size=2))
    out = d / "run"
    proc = run_cli(["--config", cfg, "--output-dir", str(out)])
    return proc, str(out)


# ---------------------------------------------------------------------------------------------
# The CLI end to end


def test_cli_runs_prints_summary_and_exits_0(one_rank_run):
    proc, _ = one_rank_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "infinity.train summary" in out
    for row in ("parameters", "bytes per tier", "peak RSS", "forward", "backward", "optimizer", "stall",
                "disk bandwidth", "saved"):
        assert row in out, f"summary row {row!r} missing:\n{out}"
    assert f"step {STEPS:>5}/{STEPS}  loss" in out


def test_cli_writes_json_lines(one_rank_run):
    proc, out = one_rank_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_jsonl(os.path.join(out, "telemetry.jsonl"))
    assert [r["event"] for r in records] == ["start"] + ["step"] * STEPS + ["summary"]
    steps = records[1:-1]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        for key in ("loss", "lr", "grad_norm", "step_s", "forward_s", "backward_s", "optimizer_s", "stall_s",
                    "tokens_per_s", "comm_bytes", "rss_bytes"):
            assert isinstance(r[key], (int, float)), (key, r)
        assert r["step_s"] >= r["forward_s"] + r["backward_s"] + r["optimizer_s"] - 1e-6
        assert r["tokens"] == 2 * 32
    # linear warm-up over 2 steps, then constant
    assert [r["lr"] for r in steps] == pytest.approx([1.5e-3, 3e-3, 3e-3, 3e-3])
    assert records[0]["config"]["zero"]["stage"] == 3
    assert records[-1]["peak_rss_per_rank"][0] > 0


def test_cli_saves_safetensors_that_transformers_loads(one_rank_run):
    proc, out = one_rank_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    model_dir = os.path.join(out, "model")
    assert os.path.isfile(os.path.join(model_dir, "model.safetensors"))
    assert os.path.isfile(os.path.join(model_dir, "config.json"))
    loaded = load_saved(model_dir)
    assert loaded.config.n_layer == 2 and loaded.config.vocab_size == 258
    # the run trained: its weights differ from the seeded initial ones
    torch.manual_seed(7)
    initial = train.build_model(TINY_MODEL, 32).model
    moved = max((a - b).abs().max().item() for a, b in zip(loaded.state_dict().values(), initial.state_dict().values())
                if a.is_floating_point())
    assert moved > 1e-4
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # still tied


def test_two_ranks_match_one_rank_on_the_same_global_batch(one_rank_run, tmp_path):
    proc1, out1 = one_rank_run
    assert proc1.returncode == 0, proc1.stderr[-3000:]
    cfg = write_config(tmp_path / "tiny2.json", tiny_config(micro_batch_size=1))
    out2 = str(tmp_path / "run2")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc2 = run_cli(["--config", cfg, "--output-dir", out2], launcher=launcher)
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    assert proc2.stdout.count("infinity.train summary") == 1  # rank 0 alone prints it
    assert "2 rank(s)" in proc2.stdout
    assert step_losses(out2) == pytest.approx(step_losses(out1), rel=1e-5)
    one, two = load_saved(os.path.join(out1, "model")), load_saved(os.path.join(out2, "model"))
    for (name, a), b in zip(one.state_dict().items(), two.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)


# ---------------------------------------------------------------------------------------------
# The embedded default


def test_default_config_runs_with_everything_on_nvme(tmp_path):
    cfg = infinity.Config.from_dict(train.default_config())
    assert cfg.zero.offload_param.device == "nvme" and cfg.zero.offload_optimizer.device == "nvme"
    assert cfg.zero.offload_param.nvme_path == train.default_nvme_path()
    assert train.default_nvme_path().startswith(tempfile.gettempdir())
    out = str(tmp_path / "run")
    proc = run_cli(["--steps", "2", "--output-dir", out])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "offload param=nvme optimizer=nvme" in proc.stdout
    assert "not probed" not in proc.stdout  # the disk was measured
    steps = [r for r in read_jsonl(os.path.join(out, "telemetry.jsonl")) if r["event"] == "step"]
    assert sum(r["tier.nvme.read_bytes"] + r["tier.nvme.write_bytes"] for r in steps) > 0
    assert os.path.isfile(os.path.join(out, "model", "model.safetensors"))


# ---------------------------------------------------------------------------------------------
# Export


def _train_in_process(cfg_dict, tmp_path):
    cfg = infinity.Config.from_dict(cfg_dict)
    run = train.setup(cfg)
    train.start(run)
    train.train_loop(run)
    return run


@pytest.mark.parametrize("max_shard_bytes", [10**9, 60_000])
def test_export_equals_the_trained_weights(tmp_path, max_shard_bytes):
    run = _train_in_process(tiny_config(steps=2), tmp_path)
    try:
        out = str(tmp_path / "export")
        result = export_safetensors(run.model, out, max_shard_bytes=max_shard_bytes)
        names = [n for n, _ in run.model.named_parameters()]
        with infinity.GatheredParameters(list(run.model.parameters())):
            trained = {n: p.detach().clone() for n, p in run.model.named_parameters()}
        other = str(tmp_path / "reexport")  # a later export with another shard count replaces every file
        export_safetensors(run.model, other, max_shard_bytes=10**9 + 60_000 - max_shard_bytes)
        export_safetensors(run.model, other, max_shard_bytes=max_shard_bytes)
        assert sorted(f for f in os.listdir(other) if "safetensors" in f) == \
            sorted(result.files + ([INDEX_FILE] if len(result.files) > 1 else []))
    finally:
        run.telemetry.close()
        run.optimizer.engine.close()
    from safetensors import safe_open

    saved = {}
    for f in result.files:
        assert os.path.getsize(os.path.join(out, f)) <= max(max_shard_bytes, 258 * 64 * 4) + 10_000
        with safe_open(os.path.join(out, f), "pt") as sf:
            saved.update({k: sf.get_tensor(k) for k in sf.keys()})
    assert (len(result.files) > 1) == os.path.exists(os.path.join(out, INDEX_FILE)) == (max_shard_bytes < 10**9)
    assert "lm_head.weight" not in saved and "lm_head.weight" not in names  # tied: saved once
    for n in names:
        assert torch.equal(saved[n], trained[n]), n
    loaded = load_saved(out)
    for n in names:
        assert torch.equal(dict(loaded.named_parameters())[n], trained[n]), n
    assert torch.equal(loaded.lm_head.weight, trained["transformer.wte.weight"])


# ---------------------------------------------------------------------------------------------
# Bad input


def _main_fails(capsys, args):
    code = train.main(args)
    err = capsys.readouterr().err
    assert code == train.EXIT_BAD_INPUT, err
    return err


def test_missing_data_file(capsys, tmp_path):
    err = _main_fails(capsys, ["--data", str(tmp_path / "nope.txt"), "--output-dir", str(tmp_path)])
    assert "nope.txt" in err and "does not exist" in err


def test_jsonl_without_text_field(capsys, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    err = _main_fails(capsys, ["--data", str(data), "--output-dir", str(tmp_path)])
    assert "d.jsonl:2" in err and '"text"' in err


def test_bad_model_dirs(capsys, tmp_path):
    empty = tmp_path / "empty_model"
    empty.mkdir()
    assert "no config.json" in _main_fails(capsys, ["--model", str(empty), "--no-save"])
    broken = tmp_path / "broken_model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert "config.json cannot be read" in _main_fails(capsys, ["--model", str(broken), "--no-save"])
    assert "neither a preset" in _main_fails(capsys, ["--model", str(tmp_path / "missing"), "--no-save"])


def test_model_that_cannot_take_the_tokens(capsys, tmp_path):
    small_vocab = json.dumps({**TINY_MODEL, "vocab_size": 100})
    assert "vocab_size 100" in _main_fails(capsys, ["--model", small_vocab, "--no-save"])
    err = _main_fails(capsys, ["--model", json.dumps({**TINY_MODEL, "model_type": "no-such-model"}), "--no-save"])
    assert "no-such-model" in err


def test_bad_flags_combination(capsys, tmp_path):
    cfg = write_config(tmp_path / "c.json", tiny_config())
    err = _main_fails(capsys, ["--config", cfg, "--steps", "0"])
    assert "train.steps" in err


def test_subprocess_exit_status_on_bad_input(tmp_path):
    proc = run_cli(["--data", str(tmp_path / "missing.jsonl"), "--no-save"])
    assert proc.returncode == train.EXIT_BAD_INPUT
    assert "infinity.train: error:" in proc.stderr and "missing.jsonl" in proc.stderr
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------------------------
# Data


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "ZeRO-Infinity ∞ über"
    assert tok.decode(tok.encode(text)) == text
    assert max(tok.encode(text)) < 256 and tok.eos_token_id == 256


def test_ranks_split_each_global_batch_without_overlap():
    windows = torch.arange(40 * 5).view(40, 5)
    one = Batches(windows, micro_batch_size=4, accumulation=2, world_size=1, rank=0, seed=3)
    two = [Batches(windows, micro_batch_size=2, accumulation=2, world_size=2, rank=r, seed=3) for r in range(2)]
    for step in range(7):  # crosses epoch boundaries (8 windows a step, 40 windows)
        whole = [x for x, _ in one.step(step)]
        parts = [[x for x, _ in b.step(step)] for b in two]
        for a in range(2):
            rows = torch.cat([parts[0][a], parts[1][a]])
            assert sorted(rows[:, 0].tolist()) == sorted(whole[a][:, 0].tolist())
    x, y = next(one.step(0))
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one


def test_windows_and_text_files(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 10)
    (tmp_path / "b.jsonl").write_text('{"text": "one"}\n\n{"text": "two"}\n')
    assert read_texts(str(tmp_path / "b.jsonl")) == ["one", "two"]
    w = token_windows(read_texts(str(tmp_path / "a.txt")), ByteTokenizer(), 16)
    assert w.shape == (121 // 17, 17)
    with pytest.raises(DataError, match="fewer than one window"):
        token_windows(["hi"], ByteTokenizer(), 16)
    with pytest.raises(DataError, match="unknown extension"):
        (tmp_path / "c.csv").write_text("x")
        read_texts(str(tmp_path / "c.csv"))


# ---------------------------------------------------------------------------------------------
# Plots


def test_plot_run_makes_pngs(one_rank_run, tmp_path):
    proc, out = one_rank_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    plots = tmp_path / "plots"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plot_run.py"), out, "--out", str(plots)],
                          capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    if done.returncode == 3:
        pytest.skip("matplotlib is not installed and could not be installed: " + done.stderr.strip())
    assert done.returncode == 0, done.stderr
    for name in ("loss.png", "step_time.png", "bandwidth.png"):
        path = plots / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert path.stat().st_size > 5000, name


def test_accumulation_matches_a_bigger_micro_batch(tmp_path):
    losses = []
    for micro, accum in ((2, 1), (1, 2)):
        cfg = tiny_config(micro_batch_size=micro, steps=3)
        cfg["gradient_accumulation_steps"] = accum
        run = _train_in_process(cfg, tmp_path)
        run.optimizer.engine.close()
        losses.append(run.stats.column("loss"))
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_fine_tunes_from_a_saved_model_directory(one_rank_run, tmp_path):
    proc, out = one_rank_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = tiny_config(steps=1)
    cfg["train"]["model"] = os.path.join(out, "model")
    run = _train_in_process(cfg, tmp_path)
    run.optimizer.engine.close()
    assert "1 safetensors file(s)" in run.spec.description
    # the same first batch as the run that saved the weights: its trained weights do better on it
    assert run.stats.column("loss")[0] < step_losses(out)[0] - 0.1


def test_the_job_trains_the_same_on_the_emulated_device(tmp_path):
    """The train job on an accelerator (the emulated one: copies land late, host and device
    tensors do not mix) puts its batches on the device and trains exactly as on the CPU, stage
    3 with every state on NVMe."""
    cfg = tiny_config(micro_batch_size=2)
    cfg["zero"].update({"offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "nvme")},
                        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "nvme")}})
    kinds, path = ("cpu", "emulated"), write_config(tmp_path / "nvme.json", cfg)
    jobs = [(["--config", path, "--output-dir", str(tmp_path / k), "--no-save"], dict(_env(), INFINITY_ACCELERATOR=k))
            for k in kinds]
    runs = {}
    for kind, done in zip(kinds, run_clis(*jobs)):
        assert done.returncode == 0, done.stderr[-3000:]
        runs[kind] = step_losses(str(tmp_path / kind))
    assert len(runs["emulated"]) == STEPS
    assert runs["emulated"] == pytest.approx(runs["cpu"], rel=1e-5, abs=1e-5)
