"""One computation behind ``python -m infinity.estimate``: every row of its table is the engine's
own plan of that placement (Note [planned by the engine] in infinity/_apps/_plan.py) for the
model ``--plan`` builds (Note [the planned decoder] in infinity/_apps/_estimate_model.py), so the
table, ``--plan`` and ``--step-time`` agree on every number they share."""
import contextlib
import io
import json

import pytest
import torch

from infinity._apps import _plan as pl
from infinity._apps import _runmodel as rm
from infinity._apps._estimate_cli import _parser, _run_of, main
from infinity._apps._estimate_model import Shape, decoder
from infinity._apps._estimator import estimate

GPT2_CONFIG = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 1000, "n_positions": 128}
# (stage, offload_param, offload_optimizer): the parameters leave the device at stage 3 only
PLACEMENTS = [(2, "none", "cpu"), (2, "none", "nvme"), (3, "cpu", "cpu"), (3, "cpu", "nvme"), (3, "nvme", "cpu"),
              (3, "nvme", "nvme")]


def _json(*args) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*args, "--json"]) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("shape", [Shape(3, 96, 4, vocab=1000, kv_heads=2), Shape(2, 128, 8, ffn=300)])
@pytest.mark.parametrize("max_tile", [None, 10_000])
def test_the_decoder_of_a_shape_has_the_units_transformers_builds(arch, shape, max_tile):
    """The estimator's decoder (built without transformers) has the fetch units, tiles and shards
    of the model ``--plan`` builds with transformers."""
    cfg = pl.plan_config("nvme,nvme", "bf16", max_tile_params=max_tile)

    def units(model):
        return [(s.module_name, s.shard_numel, s.trainable, s.persistent) for s in pl.tiled_specs(model, cfg, 4)]

    assert units(decoder(shape, arch)) == units(pl.build_meta(shape=shape, arch=arch))


@pytest.fixture
def gpt2_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GPT2_CONFIG))
    return str(tmp_path / "config.json")


@pytest.mark.parametrize("host", ["64GB", "512MB"])  # 512 MB: 2 ranks' gradient shards of 50M go to a swap file
@pytest.mark.parametrize("model", ["bare", "shape", "config"])
def test_each_row_of_the_table_is_the_plan_of_its_placement(model, host, gpt2_config):
    """For every placement, each tier's bytes in the table are what ``--plan`` of that placement
    says: NVMe and host memory per node, and per GPU the device's before activations plus the
    activation terms the table adds (the plan knows no batch)."""
    what = {"bare": ["--params", "50M"], "shape": ["--layers", "4", "--hidden", "256", "--arch", "gpt2"],
            "config": ["--model", gpt2_config]}[model]
    hw = [*what, "--gpus", "2", "--gpu-mem", "16GB", "--cpu-mem", host, "--nvme", "1TB"]
    table = _json(*hw)
    rows = {(p["stage"], p["param_tier"], p["optimizer_tier"]): p for p in table["placements"]}
    activations = table["terms"]["activation_checkpoints"] + table["terms"]["activation_working"]
    swapped = set()
    for stage, params, optimizer in PLACEMENTS:
        plan = _json(*hw, "--plan", "--stage", str(stage), "--offload", f"{params},{optimizer}")
        row = rows[(stage, {"none": "device"}.get(params, params), optimizer)]
        assert plan["params"] == table["params"]
        assert row["nvme_bytes"] == plan["per_node"]["nvme"], (stage, params, optimizer)
        assert row["host_bytes"] == plan["per_node"]["host"], (stage, params, optimizer)
        assert row["device_bytes"] == plan["per_rank"]["device"] + activations, (stage, params, optimizer)
        assert row["host_plan"] == {k: 2 * v for k, v in plan["per_rank"]["categories"]["host"].items()}
        swapped |= set(plan["per_rank"]["swap_files"])
    if model == "bare":  # the "auto" rule of the gradients, planned alike
        assert ("grad.swp" in swapped) is (host == "512MB")


def test_step_time_runs_the_plan_of_the_table():
    """``--step-time`` predicts the run of the table's row at its tiers: the same parameter count,
    the same layout and the same stores' bytes (its peak RSS adds what the plan does not hold)."""
    hw = ["--params", "50M", "--gpus", "1", "--cpu-mem", "1GB", "--nvme", "1TB"]  # the device is the host
    est = estimate("50M", gpus=1, cpu_mem="1GB", nvme="1TB")
    row = est.placement(3, "nvme", "nvme")
    run = _run_of(est, _parser().parse_args([*hw, "--step-time", "--offload", "nvme,nvme"]))
    assert run.params == est.params == row.plan.params
    assert run.figures.total == row.plan.opt_total and run.figures.categories == row.plan.categories
    memory = rm.host_memory(run)
    for category, nbytes in row.host_plan.items():
        if category != "param_handoff":  # the run model's typical hand-off, at most the parameter space; the plan's cap
            assert memory[category] == nbytes, category
    for category, nbytes in row.plan.categories["device"].items():  # the device tier is host memory here
        assert memory[f"device_{category}"] == nbytes, category
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*hw, "--step-time", "--offload", "nvme,nvme", "--rates", "dgx2"]) == 0
    text = out.getvalue()
    count = text.split("model: ", 1)[1].split(" parameters", 1)[0]
    assert f"run: {count} parameters" in text and "offload_param nvme, offload_optimizer nvme" in text


def test_a_bare_count_plans_a_decoder_of_about_that_many_parameters():
    """A bare 7B is a Llama decoder of 7.0B parameters, its embedding and head included, and
    ``--plan`` builds that same decoder (its count is the table's)."""
    est = estimate("7B", gpus=1, gpu_mem="80GB", cpu_mem="512GB", nvme="4TB")
    assert est.arch == "llama" and est.params == pytest.approx(7e9, rel=0.02)
    with torch.device("meta"):
        assert est.params == sum(p.numel() for p in decoder(est.shape, "llama").parameters())
