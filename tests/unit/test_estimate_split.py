"""``python -m infinity.estimate`` speaks of splits and of ``device: auto`` in the config's words
(Note [split tiers], Note [planned split] in infinity/_offload/_split.py): the table's auto row is
what ``device: auto`` plans for the node estimated for, a split asked for with ``--offload-split``
adds its rows, and bad input is refused with the config's own words for what to change. Each
row is the engine's plan (tests/integration/test_estimate_plan.py checks ``--plan`` agrees)."""
import inspect
import json

import pytest
from _estimate_run import run_estimate

import infinity
from infinity._apps import _plan as pl
from infinity._apps._estimate_cli import offload_splits
from infinity._apps._estimator import estimate
from infinity._offload._split import plan_auto
from infinity._runtime._tiers import Tier
from infinity.errors import EstimateError

# 1.5B on a 24 GB GPU: its states fit 64 GB of host memory; 16 GB takes part of the optimizer to NVMe
GPU = dict(gpus=1, gpu_mem="24GB", nvme="1TB")
HALF = {"cpu": 0.5, "nvme": 0.5}


@pytest.mark.parametrize("host, params, optimizer", [
    ("64GB", (Tier.CPU, None), (Tier.CPU, None)),          # everything in host memory
    ("16GB", (Tier.CPU, None), (Tier.NVME, 0.25)),         # the parameters first, then a quarter of the optimizer
    ("8GB", (Tier.CPU, None), (Tier.NVME, None)),          # the parameters only
])
def test_the_auto_row_is_what_device_auto_plans_for_the_node(host, params, optimizer):
    est = estimate("1.5B", cpu_mem=host, **GPU)
    auto = est.auto
    assert auto is not None and auto.auto and auto.stage == 3
    assert auto.spec[1:] == (params, optimizer)
    assert est.placement(3, "auto", "auto") is auto
    assert auto.plan.placement.describe().startswith("optimizer " + ("split" if optimizer[1] else optimizer[0].value))
    assert auto not in est.placements and len(est.placements) == 15  # the grid stays the grid


def test_the_auto_row_is_labelled_in_the_configs_words():
    est = estimate("1.5B", cpu_mem="16GB", **GPU)
    assert est.auto.words == ("auto -> cpu", "auto -> cpu 0.25 / nvme 0.75")
    assert est.auto.label == "stage 3 auto -> params cpu, optimizer cpu 0.25 / nvme 0.75"
    table = est.table()
    row = next(line for line in table.splitlines() if line.startswith("3") and "auto ->" in line)
    assert row.split()[:9] == ["3", "auto", "->", "cpu", "auto", "->", "cpu", "0.25", "/"]
    assert "auto: device: auto (zero.offload_param, zero.offload_optimizer) plans params cpu, optimizer cpu 0.25 / " \
           "nvme 0.75 on this node" in table and "zero.host_memory_limit sets it" in table


def test_the_auto_rows_words_written_as_a_split_plan_the_same_bytes():
    """The label is the config that reproduces the plan: the split it names, asked for, is the same row."""
    auto = estimate("1.5B", cpu_mem="16GB", **GPU).auto
    fraction = auto.splits[1]
    asked = estimate("1.5B", cpu_mem="16GB", splits={"optimizer": {"cpu": fraction, "nvme": 1 - fraction}}, **GPU)
    row = asked.placement(3, "cpu", {"cpu": fraction, "nvme": 1 - fraction})
    assert (row.device_bytes, row.host_bytes, row.nvme_bytes, row.host_plan) == \
           (auto.device_bytes, auto.host_bytes, auto.nvme_bytes, auto.host_plan)
    assert row.plan.host_upto == auto.plan.host_upto


def test_the_auto_fractions_are_those_plan_auto_tries():
    assert inspect.signature(plan_auto).parameters["steps"].default == pl.AUTO_STEPS


def test_a_split_adds_its_rows_beside_every_tier_of_the_other_state():
    est = estimate("1.5B", cpu_mem="64GB", splits={"optimizer": HALF, "param": {"cpu": 0.25, "nvme": 0.75}}, **GPU)
    specs = [(p.stage, *p.words) for p in est.split_placements]
    split, psplit = "cpu 0.5 / nvme 0.5", "cpu 0.25 / nvme 0.75"
    assert specs == [(1, "none", split), (2, "none", split), (3, "none", split), (3, "cpu", split),
                     (3, "nvme", split), (3, psplit, "none"), (3, psplit, "cpu"), (3, psplit, "nvme"),
                     (3, psplit, split)]
    whole_cpu, whole_nvme = est.placement(3, "cpu", "cpu"), est.placement(3, "cpu", "nvme")
    half = est.placement(3, "cpu", HALF)
    assert half.optimizer_tier is Tier.NVME and half.splits == (None, 0.5)
    assert whole_nvme.host_bytes < half.host_bytes < whole_cpu.host_bytes
    assert 0 < half.nvme_bytes < whole_nvme.nvme_bytes
    assert "3      cpu                   cpu 0.5 / nvme 0.5" in est.table()
    with pytest.raises(EstimateError, match="the splits asked for"):
        est.placement(3, "cpu", {"cpu": 0.75, "nvme": 0.25})


def test_where_no_whole_tier_fits_a_split_is_recommended(capsys, tmp_path):
    """Neither host memory (22 GiB) holds the optimizer states (23 GiB) nor NVMe (15 GiB): half of each does."""
    args = ["--params", "1.5B", "--gpus", "1", "--gpu-mem", "24GB", "--cpu-mem", "24GB", "--nvme", "16GB"]
    code, out, err = run_estimate(capsys, *args)
    assert code == 0, err
    assert "fits: stage 3 auto -> params cpu, optimizer cpu 0.5 / nvme 0.5\n" in out
    assert "no placement on whole tiers fits; this split does: the auto row's" in out
    printed = out.split("recommended config:\n", 1)[1]
    (tmp_path / "split.yaml").write_text(printed)
    cfg = infinity.Config.from_file(tmp_path / "split.yaml")
    assert cfg.zero.offload_param.device == "cpu" and cfg.zero.offload_optimizer.device == "nvme"
    assert (cfg.zero.offload_optimizer.split.cpu, cfg.zero.offload_optimizer.split.nvme) == (0.5, 0.5)


def test_offload_split_takes_the_configs_vocabulary():
    assert offload_splits(["optimizer=cpu:0.5,nvme:0.5", "param=cpu:0.25, nvme:0.75"]) == {
        "optimizer": {"cpu": 0.5, "nvme": 0.5}, "params": {"cpu": 0.25, "nvme": 0.75}}
    assert offload_splits(["params=nvme:1"]) == {"params": {"cpu": 0.0, "nvme": 1.0}}
    assert pl.offload_tiers("auto,auto") == ["auto", "auto"] and pl.offload_tiers("device,cpu") == ["none", "cpu"]


@pytest.mark.parametrize("value, words", [
    ("optimizer=cpu:0.5,nvme:0.4", "(zero.offload_optimizer.split: {cpu: 0.5, nvme: 0.4}): zero.offload_optimizer."
                                   "split: fractions {cpu: 0.5, nvme: 0.4} sum to 0.9; they must sum to 1"),
    ("optimizer=gpu:0.5,nvme:0.5", "zero.offload_optimizer.split.gpu: unknown key; did you mean"),
    ("params=cpu:half,nvme:0.5", "zero.offload_param.split.cpu: expected float, got str 'half'"),
    ("optimizer=device:0.5,nvme:0.5", "a device share of an offloaded state is not supported yet"),
    ("optimizer=cpu:1.5", "1.5 is out of range"),
    ("grads=cpu:0.5,nvme:0.5", "the states are params and optimizer"),
    ("optimizer:cpu=0.5", "must be STATE=TIER:FRACTION,...: params or optimizer"),
    ("optimizer=cpu:0.5,cpu:0.5", "each tier once"),
])
def test_a_bad_split_is_refused_with_what_to_change(capsys, value, words):
    code, out, err = run_estimate(capsys, "--params", "20M", "--gpus", "1", "--cpu-mem", "1GB", "--nvme", "1TB",
                          "--offload-split", value)
    assert code == 2 and out == ""
    assert words in err


@pytest.mark.parametrize("args, words", [
    (["--plan", "--offload", "cpu,cpu"], "zero.offload_optimizer.device: is cpu while split {cpu: 0.5, nvme: 0.5} "
                                         "puts part of the state on nvme; set device to nvme"),
    (["--plan", "--offload", "cpu,auto"], "is given while device is auto, which plans the split itself"),
    (["--plan", "--config", "any.yaml"], "leave out --offload-split, or --config"),
    (["--steps", "10", "--offload", "nvme,cpu"], "set device to nvme"),
])
def test_a_split_that_contradicts_offload_is_refused(capsys, args, words):
    code, out, err = run_estimate(capsys, "--params", "20M", "--gpus", "1", "--cpu-mem", "1GB", "--nvme", "1TB",
                          "--offload-split", "optimizer=cpu:0.5,nvme:0.5", *args)
    assert code == 2 and out == ""
    assert words in err


def test_one_state_auto_is_planned_by_plan_not_by_the_table(capsys):
    code, out, err = run_estimate(capsys, "--params", "20M", "--gpus", "1", "--cpu-mem", "1GB", "--nvme", "1TB",
                          "--steps", "10", "--offload", "auto,nvme")
    assert code == 2 and "the table's auto row is stage 3 with auto for both states" in err


def test_compressed_moments_have_no_auto_row():
    est = estimate("1.5B", cpu_mem="16GB", moments="int8", **GPU)
    assert est.auto is None and "device: auto keeps the moments fp32" in est.table()


def test_the_json_has_the_split_rows_and_the_auto_row(capsys):
    code, out, err = run_estimate(capsys, "--params", "1.5B", "--gpus", "1", "--gpu-mem", "24GB", "--cpu-mem", "16GB",
                          "--nvme", "1TB", "--offload-split", "optimizer=cpu:0.5,nvme:0.5", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert len(data["placements"]) == 15 and len(data["split_placements"]) == 5
    assert data["split_placements"][3]["offload"] == {"params": "cpu", "optimizer": "cpu 0.5 / nvme 0.5"}
    auto = data["auto"]
    assert auto["label"] == "stage 3 auto -> params cpu, optimizer cpu 0.25 / nvme 0.75"
    assert auto["splits"] == [None, 0.25] and auto["host_budget"] == int(16e9 * 0.75)
