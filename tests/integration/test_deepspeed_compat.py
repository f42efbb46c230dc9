"""DeepSpeed configs as people write them (examples/deepspeed/): tuning keys accepted with one
warning, result-changing keys refused, "auto" resolved as transformers resolves it, --strict,
and the scheduler section following DeepSpeed's formulas (values computed by hand)."""
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _jobs import Jobs

from infinity._runtime._schedule import make_scheduler
from infinity.config import Config, ConfigError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "deepspeed"
NVME_TUNING = ["zero_optimization.offload_optimizer.buffer_count", "zero_optimization.offload_optimizer.fast_init",
               "zero_optimization.stage3_max_reuse_distance"]  # offload_param.max_in_cpu: the parameter cache
CASES = {  # file: (tuning keys warned about, precision, scheduler)
    "ds_zero3_nvme_auto.json": (NVME_TUNING, "fp32", "WarmupLR"),
    "ds_zero3_bf16_cpu_auto.json": (["zero_optimization.stage3_max_reuse_distance"], "fp32", "WarmupDecayLR"),
    "accelerate_zero2_fp16.json": (["zero_optimization.allgather_bucket_size"], "fp16", "WarmupDecayLR"),
}


def _messages(logs, level):
    return [r.getMessage() for r in logs.records if r.levelno == level]


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_loads_by_default_with_one_warning(name, infinity_logs, monkeypatch):
    from infinity._runtime import _accelerator

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(_accelerator, "_cpu_flags", set)  # a CPU without native bf16 (AVX2), on every machine
    tuning, dtype, scheduler = CASES[name]
    cfg = Config.from_file(EXAMPLES / name)
    assert sorted(cfg.unsupported) == sorted(tuning)
    warnings = [w for w in _messages(infinity_logs, logging.WARNING) if "DeepSpeed keys" in w]
    assert len(warnings) == 1 and all(k in warnings[0] for k in tuning)
    assert cfg.precision.dtype == dtype  # bf16 auto follows precision.dtype auto: fp32 without native bf16 here
    assert cfg.scheduler.type == scheduler
    infos = [m for m in _messages(infinity_logs, logging.INFO) if "'auto' values" in m]
    assert len(infos) == 1 and "optimizer.params.lr=0.0001" in infos[0]
    with pytest.raises(ConfigError) as err:
        Config.from_file(EXAMPLES / name, strict=True)
    assert sorted(err.value.keys) == sorted(tuning)


def test_auto_resolved_from_model_and_training_args(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    args = TrainingArguments(output_dir=str(tmp_path), learning_rate=3e-5, adam_beta1=0.8, adam_beta2=0.95,
                             adam_epsilon=1e-6, weight_decay=0.05, per_device_train_batch_size=3,
                             gradient_accumulation_steps=5, max_grad_norm=0.7, use_cpu=True, report_to=[])
    data = json.loads((EXAMPLES / "ds_zero3_nvme_auto.json").read_text())
    cfg = Config.from_deepspeed(data, model=model, training_args=args)
    z = cfg.zero
    assert (z.reduce_bucket_size, z.prefetch.bucket_size, z.prefetch.persistence_threshold) == (48 * 48, 2073, 480)
    o = cfg.optimizer
    assert (o.lr, o.betas, o.eps, o.weight_decay) == (3e-5, (0.8, 0.95), 1e-6, 0.05)
    assert (cfg.train.micro_batch_size, cfg.gradient_accumulation_steps, cfg.gradient_clipping) == (3, 5, 0.7)
    assert cfg.precision.dtype == "fp32" and cfg.scheduler.warmup_max_lr == 3e-5
    data["optimizer"]["params"]["lr"] = 1e-3  # not "auto" and not what the arguments say: refused, as transformers does
    with pytest.raises(ConfigError) as err:
        Config.from_deepspeed(data, model=model, training_args=args)
    assert err.value.keys == ["optimizer.params.lr"] and "'auto'" in str(err.value)


@pytest.mark.parametrize("data,key", [
    ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, "optimizer.type"),
    ({"scheduler": {"type": "OneCycle", "params": {}}}, "scheduler.type"),
    ({"scheduler": {"type": "WarmupLR", "params": {"cos_min_ratio": 0.1}}}, "scheduler.params.cos_min_ratio"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "zero_optimization.zero_quantized_weights"),
    ({"curriculum_learning": {"enabled": True}}, "curriculum_learning"),
])
def test_keys_that_change_the_result_stay_errors(data, key):
    with pytest.raises(ConfigError) as err:
        Config.from_deepspeed(data)
    assert key in err.value.keys


def _lrs(scheduler_params, base_lr, steps):
    """The lr each optimizer step runs with, stepping the scheduler after each step as DeepSpeed does."""
    cfg = Config.from_deepspeed({"optimizer": {"type": "AdamW", "params": {"lr": base_lr}},
                                 "scheduler": scheduler_params})
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=base_lr)
    sched = make_scheduler(opt, cfg, run_steps=None)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_warmup_lr_log_matches_deepspeed_by_hand():
    lrs = _lrs({"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 4}},
               0.5, 6)
    # iteration k-2 at step k: -1 -> min; log(it+1)/log(4) during warm-up; then max
    assert lrs == pytest.approx([0.0, 0.0, 0.05, 0.1 * math.log(3) / math.log(4), 0.1, 0.1])


def test_warmup_decay_lr_linear_matches_deepspeed_by_hand():
    lrs = _lrs({"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.11,
                                                    "warmup_num_steps": 2, "warmup_type": "linear",
                                                    "total_num_steps": 6}}, 0.5, 7)
    assert lrs == pytest.approx([0.01, 0.01, 0.06, 0.11, 0.085, 0.06, 0.035])


def test_warmup_cosine_lr_matches_deepspeed_by_hand():
    lrs = _lrs({"type": "WarmupCosineLR", "params": {"warmup_min_ratio": 0.1, "warmup_num_steps": 2,
                                                     "warmup_type": "linear", "total_num_steps": 6,
                                                     "cos_min_ratio": 0.0}}, 0.2, 6)
    assert lrs == pytest.approx([0.0, 0.02, 0.11, 0.2 * (1 + math.cos(math.pi / 4)) / 2, 0.1,
                                 0.2 * (1 + math.cos(3 * math.pi / 4)) / 2])


def test_train_cli_strict_refuses_tuning_keys(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "infinity.train", "--config", str(EXAMPLES / "ds_zero3_bf16_cpu_auto.json"), "--strict"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "zero_optimization.stage3_max_reuse_distance" in done.stderr and "strict" in done.stderr


def test_train_cli_resolves_hidden_size_autos_from_its_model(tmp_path):
    """A DeepSpeed config's hidden-size "auto" values in ``infinity.train`` come from the model
    the run trains (hidden 256 for gpt2-tiny; a directory's config.json), as transformers'
    integration resolves them, not from infinity's defaults."""
    from transformers import GPT2Config

    from infinity._apps._train_cli import parse_args, resolve_config

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                                    "stage3_prefetch_bucket_size": "auto",
                                                    "stage3_param_persistence_threshold": "auto"}}))
    cfg = resolve_config(parse_args(["--config", str(ds), "--model", "gpt2-tiny"]))
    assert (cfg.zero.reduce_bucket_size, cfg.zero.prefetch.bucket_size) == (256 * 256, int(0.9 * 256 * 256))
    assert cfg.zero.prefetch.persistence_threshold == 10 * 256
    model_dir = tmp_path / "model"
    GPT2Config(n_embd=96, n_layer=1, n_head=2).save_pretrained(model_dir)
    cfg = resolve_config(parse_args(["--config", str(ds), "--model", str(model_dir)]))
    assert cfg.zero.reduce_bucket_size == 96 * 96


EXAMPLE_RUNS = {"ds_zero3_nvme_auto.json": [], "ds_zero3_bf16_cpu_auto.json": [],
                "accelerate_zero2_fp16.json": ["--fp16", "--gradient-accumulation-steps", "1"]}


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory):
    """The example Trainer script run with each config, all started at once (tests/_jobs.py)."""
    root = tmp_path_factory.mktemp("examples")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with Jobs(root) as jobs:
        for name, extra in EXAMPLE_RUNS.items():
            jobs.start(name, [sys.executable, str(ROOT / "examples" / "trainer_finetune.py"), "--config",
                              str(EXAMPLES / name), "--nvme-path", str(root / name / "nvme"), "--output-dir",
                              str(root / name / "out"), "--steps", "3"] + extra, env=env)
        yield root, jobs


@pytest.mark.parametrize("name", list(EXAMPLE_RUNS))
def test_example_trainer_script_runs_each_config(name, example_runs):
    root, jobs = example_runs
    done = jobs.result(name, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(result["losses"]) == 3 and all(math.isfinite(v) for v in result["losses"])
    assert result["dtype"] == CASES[name][1] and result["scheduler"] == CASES[name][2]
    assert (root / name / "out" / "final" / "config.json").exists()


def test_train_job_honours_the_scheduler_section(tmp_path):
    from test_train import read_jsonl, run_cli, tiny_config, write_config

    cfg = tiny_config(lr_warmup_steps=0)
    cfg["scheduler"] = {"type": "WarmupDecayLR", "warmup_min_lr": 0.001, "warmup_max_lr": 0.003,
                        "warmup_num_steps": 2, "warmup_type": "linear", "total_num_steps": None}  # null: train.steps
    out = tmp_path / "run"
    proc = run_cli(["--config", write_config(tmp_path / "c.json", cfg), "--output-dir", str(out), "--no-save"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    lrs = [r["lr"] for r in read_jsonl(out / "telemetry.jsonl") if r["event"] == "step"]
    assert lrs == pytest.approx([0.001, 0.001, 0.002, 0.003])  # step k runs with iteration k-2
