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
from infinity._offload._split import opt_host_upto

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
        row = rows[(stage, params, optimizer)]  # the config's words: offload_param.device none
        assert plan["params"] == table["params"]
        assert row["nvme_bytes"] == plan["per_node"]["nvme"], (stage, params, optimizer)
        assert row["host_bytes"] == plan["per_node"]["host"], (stage, params, optimizer)
        assert row["device_bytes"] == plan["per_rank"]["device"] + activations, (stage, params, optimizer)
        assert row["host_plan"] == {k: 2 * v for k, v in plan["per_rank"]["categories"]["host"].items()}
        swapped |= set(plan["per_rank"]["swap_files"])
    if model == "bare":  # the "auto" rule of the gradients, planned alike
        assert ("grad.swp" in swapped) is (host == "512MB")


SPLITS = ["--offload-split", "optimizer=cpu:0.5,nvme:0.5", "--offload-split", "params=cpu:0.25,nvme:0.75"]


def _words(offload: str) -> str:
    """A row's place of a state as --offload (its tier) says it: the split's slowest tier, auto's auto."""
    return "auto" if offload.startswith("auto") else "nvme" if "nvme" in offload else offload


def _split_flags(row: dict) -> list:
    """The --plan flags of a row with a split or of the auto row: --offload and --offload-split."""
    flags = ["--offload", ",".join(_words(row["offload"][s]) for s in ("params", "optimizer"))]
    for state, fraction in zip(("params", "optimizer"), row["splits"]):
        if fraction is not None and not row["auto"]:
            flags += ["--offload-split", f"{state}=cpu:{fraction:g},nvme:{1 - fraction:g}"]
    return flags


@pytest.mark.parametrize("host", ["64GB", "16GB"])  # 16 GB: device auto splits the optimizer of 1.5B
@pytest.mark.parametrize("model", ["bare", "config"])
def test_each_split_row_and_the_auto_row_is_the_plan_of_its_placement(model, host, gpt2_config, tmp_path):
    """The rows of ``--offload-split`` and the auto row are ``--plan``'s of that placement too,
    split for split (the elements each keeps in host memory) and word for word; and ``--config``
    with the same split in the config's own keys plans the same."""
    what = {"bare": ["--params", "1.5B"], "config": ["--model", gpt2_config]}[model]
    hw = [*what, "--gpus", "2", "--gpu-mem", "16GB", "--cpu-mem", host, "--nvme", "1TB"]
    table = _json(*hw, *SPLITS)
    activations = table["terms"]["activation_checkpoints"] + table["terms"]["activation_working"]
    rows = table["split_placements"] + [table["auto"]]
    assert len(rows) == 10
    for row in rows:
        plan = _json(*hw, "--plan", "--stage", str(row["stage"]), *_split_flags(row))
        assert row["nvme_bytes"] == plan["per_node"]["nvme"], row["label"]
        assert row["host_bytes"] == plan["per_node"]["host"], row["label"]
        assert row["device_bytes"] == plan["per_rank"]["device"] + activations, row["label"]
        assert row["host_plan"] == {k: 2 * v for k, v in plan["per_rank"]["categories"]["host"].items()}
        assert row["offload"] == plan["offload"] and row["splits"] == [plan["host_fractions"][s]
                                                                        for s in ("params", "optimizer")]
    auto = table["auto"]  # the config's model is tiny: its states fit in any host memory beside the NVMe buffers
    assert (auto["splits"][1] is not None) is (host == "16GB" and model == "bare"), auto["label"]
    both = rows[-2]  # both states split, written as a config
    (tmp_path / "split.yaml").write_text(
        "zero:\n  stage: 3\n"
        "  offload_param: {device: nvme, nvme_path: /tmp/drive, split: {cpu: 0.25, nvme: 0.75}}\n"
        "  offload_optimizer: {device: nvme, nvme_path: /tmp/drive, split: {cpu: 0.5, nvme: 0.5}}\n"
        "precision: {dtype: bf16}\n")
    plan = _json(*hw, "--plan", "--config", str(tmp_path / "split.yaml"))
    assert (both["nvme_bytes"], both["host_bytes"]) == (plan["per_node"]["nvme"], plan["per_node"]["host"])
    assert plan["offload"] == {"params": "cpu 0.25 / nvme 0.75", "optimizer": "cpu 0.5 / nvme 0.5"}


def test_step_time_runs_the_plan_of_a_split_row_and_of_the_auto_row():
    """``--step-time`` and ``--steps`` of a split (or of auto) predict that row's run: its plan, and the
    share of each state the split keeps off the disk, which the run neither reads nor writes."""
    hw = ["--params", "1.5B", "--gpus", "1", "--gpu-mem", "16GB", "--cpu-mem", "16GB", "--nvme", "1TB"]
    est = estimate("1.5B", gpus=1, gpu_mem="16GB", cpu_mem="16GB", nvme="1TB",
                   splits={"optimizer": {"cpu": 0.5, "nvme": 0.5}})
    runs = {}
    for name, flags in (("whole", ["--offload", "cpu,nvme"]), ("split", SPLITS[:2] + ["--offload", "cpu,nvme"]),
                        ("auto", ["--offload", "auto,auto"])):
        runs[name] = _run_of(est, _parser().parse_args([*hw, "--step-time", *flags]))
    row, auto = est.placement(3, "cpu", {"cpu": 0.5, "nvme": 0.5}), est.auto
    assert auto.splits[1] == 0.25  # 16 GB of host memory: auto keeps a quarter of the optimizer there
    for run, planned in ((runs["split"], row), (runs["auto"], auto)):
        assert run.figures.categories == planned.plan.categories and run.optimizer_tier == "nvme"
        owned = opt_host_upto(run.opt_host_fraction, run.figures.total, run.figures.chunk)
        assert owned == planned.plan.placement.opt_host_upto > 0
    written = {name: rm.nvme_bytes(run)["write"] for name, run in runs.items()}
    assert written["whole"] > written["auto"] > written["split"] > 0  # auto keeps a quarter, the split a half
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*hw, "--step-time", *SPLITS[:2], "--offload", "cpu,nvme", "--rates", "dgx2", "--steps", "5"]) == 0
    text = out.getvalue()
    assert "step time predicted for stage 3 params=cpu optimizer=cpu 0.5 / nvme 0.5, --offload's row (marked <-)" in text
    assert "SSD writes (params on cpu, optimizer on cpu 0.5 / nvme 0.5)" in text


def test_step_time_runs_the_plan_of_the_table():
    """``--step-time`` predicts the run of the table's row at its tiers: the same parameter count,
    the same layout and the same stores' bytes (its peak RSS adds what the plan does not hold)."""
    hw = ["--params", "50M", "--gpus", "1", "--cpu-mem", "1GB", "--nvme", "1TB"]  # the device is the host
    est = estimate("50M", gpus=1, cpu_mem="1GB", nvme="1TB")
    row = est.placement(3, "nvme", "nvme")
    run = _run_of(est, _parser().parse_args([*hw, "--step-time", "--offload", "nvme,nvme"]))
    assert run.params == est.params == row.plan.params and run.ckpt_interval == est.ckpt_interval
    assert run.figures.total == row.plan.opt_total and run.figures.categories == row.plan.categories
    memory = rm.host_memory(run)
    for category, nbytes in row.host_plan.items():
        if category != "param_handoff":  # the run model's typical hand-off, at most the parameter space; the plan's cap
            assert memory[category] == nbytes, category
    for category, nbytes in row.plan.categories["device"].items():  # the device tier is host memory here
        assert memory[f"device_{category}"] == nbytes, category
    # the largest unit's working memory and the activations: the table's (the header's stage-3 working memory, the
    # checkpoint every --ckpt-interval layer(s) of its batch line), which the row's device bytes add to the plan's
    terms = est.terms
    assert memory["device_working"] == row.plan.working_memory
    assert memory["device_activations"] == terms.activation_checkpoints + terms.activation_working
    device = sum(v for k, v in memory.items() if k.startswith("device_") and k != "device_logits")
    assert device == row.device_bytes  # the logits are the run model's own term, beside them
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
