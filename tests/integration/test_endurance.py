"""SSD write endurance as a budget (Note [endurance budget] in _endurance.py): the
train job counts the bytes written to each nvme_path per step and per run (swap files and
checkpoints) in its telemetry and summary, and warns after its first step when the run is
projected past aio.endurance_warn_fraction of aio.endurance_tbw. A step writes only what it
changed, and a cloned checkpoint writes none of the swap files' bytes."""
import json
import os

import torch
from _configs import zero_config
from _xfs import xfs_mount
from test_train import read_jsonl, run_cli, tiny_config, write_config

import infinity
from infinity._apps._endurance import SsdLedger
from infinity.config import Config, ConfigError
from infinity.testing import run_ranks


def _nvme_config(nvme, tbw):
    cfg = tiny_config(steps=3)
    cfg["zero"].update({"offload_param": {"device": "nvme", "nvme_path": nvme},
                        "offload_optimizer": {"device": "nvme", "nvme_path": nvme}})
    cfg["aio"] = {"endurance_tbw": tbw, "endurance_warn_fraction": 0.1}
    return cfg


def test_ssd_writes_counted_and_a_run_over_budget_warned(tmp_path):
    nvme, out = str(tmp_path / "nvme"), str(tmp_path / "run")
    # 1e-6 TB = 1 MB: three steps of the tiny model's states exceed a tenth of it
    cfg = write_config(tmp_path / "c.json", _nvme_config(nvme, 1e-6))
    proc = run_cli(["--config", cfg, "--output-dir", out, "--save-every", "2", "--no-save"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "projected to write" in proc.stderr and "aio.endurance_tbw" in proc.stderr
    steps = [r for r in read_jsonl(os.path.join(out, "telemetry.jsonl")) if r["event"] == "step"]
    assert len(steps) == 3 and all(r["ssd_written_bytes"] > 0 for r in steps)
    summary = next(r for r in read_jsonl(os.path.join(out, "telemetry.jsonl")) if r["event"] == "summary")
    (path, total), = summary["ssd_written_bytes"].items()
    assert path == nvme
    ck = os.path.join(out, "checkpoints", "step3")
    with open(os.path.join(ck, "manifest.json")) as f:
        ck_bytes = sum(e["bytes"] for e in json.load(f)["files"].values())
    assert total >= sum(r["ssd_written_bytes"] for r in steps)
    assert f"SSD writes to {nvme}" in proc.stdout
    assert ck_bytes > 0


def test_no_warning_within_budget(tmp_path):
    cfg = write_config(tmp_path / "c.json", _nvme_config(str(tmp_path / "nvme"), 600.0))
    proc = run_cli(["--config", cfg, "--output-dir", str(tmp_path / "run"), "--no-save"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "projected to write" not in proc.stderr


def test_warn_fraction_is_checked():
    try:
        Config.from_dict({"aio": {"endurance_warn_fraction": 0}})
    except ConfigError as e:
        assert "aio.endurance_warn_fraction" in str(e)
    else:
        raise AssertionError("a fraction of 0 was accepted")


# ---------------------------------------------------------------------------------------- nothing unchanged


class _ThreeLayers(torch.nn.Module):
    """Three fetch units of 64 x 64 = 4096 elements (four 4 KiB blocks of fp32): one trained,
    one frozen, one that forward never uses (no gradient)."""

    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(64, 64, bias=False)
        self.frozen = torch.nn.Linear(64, 64, bias=False)
        self.unused = torch.nn.Linear(64, 64, bias=False)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.used(self.frozen(x))


def _bytes_per_step(base, nvme):
    """Bytes the ledger counts for each of three steps, and for a checkpoint saved under ``base``."""
    torch.manual_seed(0)
    cfg = zero_config(3, param="nvme", optim="nvme", nvme=nvme, dtype="bf16", chunk=4096)
    model, opt = infinity.initialize(_ThreeLayers(), cfg)
    ledger = SsdLedger(opt.engine, [nvme])
    steps = []
    for _ in range(3):
        before = ledger.written()[nvme]
        model(torch.randn(4, 64, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()
        opt.engine.settle_writes()
        steps.append(ledger.written()[nvme] - before)
    path = infinity.save_checkpoint(f"{base}/ck", model, opt, tag="t")
    ledger.add_checkpoint(path)
    with open(os.path.join(path, "manifest.json")) as f:
        files = json.load(f)["files"]
    opt.engine.close()
    return steps, ledger.checkpoints[nvme], files


def test_a_step_writes_only_what_it_changed(tmp_path):
    """Note [unchanged ranges are not written] in _swap_pipeline.py: per step, the trained layer's master weights
    and both moments (3 x 4 bytes x 4096) and its bf16 shard (2 x 4096) reach the disk; the
    frozen layer's shard and the states of the layer without a gradient are not rewritten; a
    checkpoint cloned from the swap files writes none of their bytes."""
    with xfs_mount(str(tmp_path)) as xfs:
        steps, ck_bytes, files = run_ranks(_bytes_per_step, 1, xfs, f"{xfs}/nvme", timeout=120)[0]
    assert steps == [3 * 4 * 4096 + 2 * 4096] * 3
    cloned = [rel for rel, e in files.items() if "crc32c" in e]
    assert sorted(cloned) == [f"rank0/{a}.bin" for a in ("exp_avg", "exp_avg_sq", "master", "params")]
    assert ck_bytes == sum(e["bytes"] for rel, e in files.items() if rel not in cloned)  # RNG, extra: small files
