"""SSD write endurance as a budget (Note [endurance budget] in infinity/_endurance.py): the
train job counts the bytes written to each nvme_path per step and per run (swap files and
checkpoints) in its telemetry and summary, and warns after its first step when the run is
projected past aio.endurance_warn_fraction of aio.endurance_tbw."""
import json
import os

from test_train import read_jsonl, run_cli, tiny_config, write_config

from infinity.config import Config, ConfigError


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
