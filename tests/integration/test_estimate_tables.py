"""infinity.estimate: the paper's memory figures, placements that fit, the CLI."""
import contextlib
import io
import json
import subprocess

import psutil
import pytest
import torch
import yaml

import infinity
from infinity._apps._estimate_cli import main
from infinity._apps._estimate_model import decoder
from infinity._apps._estimator import EstimateError, estimate, parse_count, parse_size

TiB, GiB = 2**40, 2**30
DGX2 = dict(gpus=16, gpu_mem="32GB", cpu_mem="1.5TB", nvme="28TB")   # 002 Fig. 2b, one node

# 002 Figure 2a: layers, hidden, heads | params (T), model states (TB), activation checkpoints
# at batch 32 (TB), MSWM (GB), AWM at batch 4 per GPU (GB); the paper's TB/GB are 2^40 / 2^30.
FIG_2A = [
    (80, 10 * 1024, 128, 0.10, 1.83, 0.05, 1.56, 1.63),
    (100, 20 * 1024, 160, 0.50, 9.16, 0.12, 6.25, 2.50),
    (128, 25 * 1024, 256, 1.01, 18.31, 0.20, 9.77, 3.56),
    (195, 64 * 1024, 512, 10.05, 182.81, 0.76, 64.00, 8.00),
    (315, 160 * 1024, 1024, 101.47, 1845.70, 3.08, 400.00, 18.00),
]


@pytest.mark.parametrize("nl,hd,heads,params_t,states_tb,ckpt_tb,mswm_gb,awm_gb", FIG_2A)
def test_figure_2a_columns(nl, hd, heads, params_t, states_tb, ckpt_tb, mswm_gb, awm_gb):
    batch32 = estimate(layers=nl, hidden=hd, heads=heads, micro_batch=32, **DGX2)
    batch4 = estimate(layers=nl, hidden=hd, heads=heads, micro_batch=4, **DGX2)
    # The paper's Ψ is 12·nl·hd²; the estimate counts the decoder it plans (Note [the planned
    # decoder] in infinity/_apps/_estimate_model.py): a Llama of that shape with its embedding and head
    # (2·vocab·hd) and its MLP width rounded up to a multiple of 256, up to 1.9% more.
    assert batch32.params == sum(p.numel() for p in decoder(batch32.shape).parameters())
    assert batch32.params / 1e12 == pytest.approx(params_t, rel=0.02)
    assert batch32.terms.model_states == 20 * batch32.params
    assert batch32.terms.model_states / TiB == pytest.approx(states_tb, rel=0.02)
    # The paper prints two decimals; the checkpoint column is at the edge of that rounding.
    assert batch32.terms.activation_checkpoints / TiB == pytest.approx(ckpt_tb, abs=0.005)
    assert batch32.terms.model_state_working / GiB == pytest.approx(mswm_gb, abs=0.005)
    assert batch4.terms.activation_working / GiB == pytest.approx(awm_gb, abs=0.005)


def test_shape_from_count_follows_the_papers_models():
    est = estimate(1e12, **DGX2)
    assert (est.shape.layers, est.shape.hidden, est.shape.heads) == (128, 25600, 256)
    assert est.shape.derived
    assert est.params == pytest.approx(10**12, rel=0.02)  # the decoder of that shape, embeddings included
    assert est.terms.model_states == 20 * est.params   # 20 bytes per parameter, 002 §3


def test_one_trillion_on_one_dgx2_needs_nvme_and_tiling():
    """A trillion parameters on one DGX-2 fit with every state on NVMe and the operators tiled
    (002 §5.1.3): untiled, the largest fetch unit (a whole layer, 7.9B parameters) gathered with
    the next one and its gradient is 44 GiB, more than a 32 GB V100 holds."""
    est = estimate("1T", **DGX2)
    assert not est.fitting
    without_nvme = [p for p in est.tiling_needed.placements
                    if "nvme" not in (p.param_tier.value, p.optimizer_tier.value)]
    assert len(without_nvme) == 8
    assert not any(p.fits for p in without_nvme)
    assert est.tiling_needed.tiling_factor == 2
    rec = est.tiling_needed.recommended
    assert (rec.placement.stage, rec.placement.param_tier, rec.placement.optimizer_tier) == (
        3, "nvme", "nvme")
    assert rec.config["zero"]["offload_param"]["device"] == "nvme"
    assert rec.config["zero"]["offload_optimizer"]["device"] == "nvme"
    assert rec.config["zero"]["offload_param"]["nvme_path"]


def test_seventy_billion_fits_with_params_and_optimizer_on_cpu():
    est = estimate("70B", **DGX2)
    assert est.params == 68_976_648_192  # the Llama-2 70B shape's decoder (Note [the planned decoder] in _estimate_model.py)
    assert est.placement(3, "cpu", "cpu").fits                 # 002 Fig. 6a, ZeRO-Inf-CPU
    assert not any(p.fits for p in est.placements if p.optimizer_tier.value == "device")
    rec = est.recommended.placement
    assert rec.optimizer_tier.value == "cpu"
    assert rec.param_tier.value in ("device", "cpu")
    # and a 1T model does not fit that way: the CPU holds 1.5 TB, the model states 20 TB
    assert not estimate("1T", **DGX2).placement(3, "cpu", "cpu").fits


def test_small_model_stays_on_device_with_stage_2():
    est = estimate("1B", **DGX2)
    rec = est.recommended
    assert rec.config["zero"] == {"stage": 2, "offload_param": {"device": "none"},
                                  "offload_optimizer": {"device": "none"}}


def test_per_stage_partitioning_matches_zero_paper():
    # 000 §5 with infinity's stores (16 bytes/param on the optimizer's tier: fp32 master, m, v and
    # gradient shard; the compute-dtype gradient is never stored, only reduce-scattered), as the
    # engine plans each row: stage 1: 2Ψ + 2Ψ + 16Ψ/N (the whole parameters and gradients), stage
    # 2: 2Ψ + 16Ψ/N + the gradient of the largest unit, stage 3: 18Ψ/N + the working memory.
    n = 64
    est = estimate(7.5e9, layers=32, hidden=4096, heads=32, gpus=8, nodes=8, gpu_mem="80GB",
                   cpu_mem="1TB", nvme="10TB")
    psi, t = est.params, est.terms
    activations = t.activation_checkpoints + t.activation_working
    rows = {stage: est.placement(stage, "none", "none") for stage in (1, 2, 3)}
    largest = {stage: p.plan.largest_unit[1] for stage, p in rows.items()}
    assert largest[2] == largest[3] == 50257 * 4096  # the embedding (a layer less its norms: 202M)
    persistent = 2 * (2 * 32 + 1) * 4096  # the layers' norms and the final one stay gathered at stage 3
    expected = {1: 4 * psi + 16 * psi / n,
                2: 2 * psi + 16 * psi / n + 2 * largest[2],
                3: 18 * psi / n + 3 * 2 * largest[3] + persistent}
    for stage, model_state_bytes in expected.items():
        p = rows[stage]
        assert p.device_bytes - activations == pytest.approx(model_state_bytes, rel=1e-4)
        assert p.host_bytes == 0 and p.nvme_bytes == 0
    assert rows[3].plan.persistent == persistent


def test_every_stage_3_placement_holds_the_whole_model_once():
    est = estimate(2**34, gpus=4, nodes=2, gpu_mem="1TB", cpu_mem="10TB", nvme="100TB")
    psi = est.params
    states = lambda p: p.device_bytes - est.terms.activation_checkpoints - (  # noqa: E731
        est.terms.activation_working + p.plan.working_memory)
    everywhere = est.placement(3, "none", "none")
    assert states(everywhere) * 8 == pytest.approx(18 * psi, rel=1e-4)  # bf16 2 + fp32 16 (master, m, v, gradient)
    on_cpu = est.placement(3, "cpu", "cpu")
    assert on_cpu.host_bytes * 2 == pytest.approx(18 * psi, rel=1e-4) and states(on_cpu) == 0
    split = est.placement(3, "cpu", "nvme")
    assert split.nvme_bytes * 2 == pytest.approx(12 * psi, rel=1e-4)  # master, m, v: the gradients stay in host memory
    # host, per GPU: the parameters, the gradients, and the optimizer swapper's (NvmeOptimizerStore.plan):
    # 3 buffer sets x 4 fp32 arrays x a 2^22-element chunk, the host cache of the first unit (3 fp32 arrays)
    plan = split.plan
    per_gpu = 2 * plan.param_total + 4 * plan.opt_total + 3 * 16 * 2**22 + 12 * plan.head
    assert plan.head == -(-50257 * 4992 // 8 // 2**22) * 2**22  # the embedding's shard, in whole chunks
    assert split.host_bytes == 4 * per_gpu


def test_fp32_needs_sixteen_bytes_per_param():
    est = estimate(10**9, dtype="fp32", **DGX2)
    assert est.terms.model_states == 16 * est.params
    assert est.recommended.config["precision"] == {"dtype": "fp32"}


def test_model_config_forms_give_the_same_count(tmp_path):
    fields = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 1000,
              "n_positions": 128, "bos_token_id": 0, "eos_token_id": 0}
    (tmp_path / "config.json").write_text(json.dumps(fields))
    # GPT-2: tied embeddings, positions, per layer 12·hd² + 13·hd, the final LayerNorm
    hd, nl = 64, 2
    gpt2 = 1000 * hd + 128 * hd + nl * (12 * hd * hd + 13 * hd) + 2 * hd
    from transformers import GPT2Config

    for model in (fields, tmp_path, tmp_path / "config.json", GPT2Config(**fields)):
        est = estimate(model=model, **DGX2)
        assert est.params == gpt2
        assert (est.shape.layers, est.shape.hidden, est.shape.heads) == (2, 64, 4)
        # the largest operator of this model is the embedding, not the MLP
        assert est.terms.model_state_working == 4 * 1000 * hd


def test_config_without_architecture_plans_the_decoder_of_its_shape():
    """Note [the planned decoder] in _estimate_model.py: a config transformers cannot build (no
    model_type) is planned as the GPT-2 of its shape: tied embedding, 1024 positions, per layer
    12·hd² + 13·hd, the final LayerNorm."""
    est = estimate(model={"num_hidden_layers": 4, "hidden_size": 256, "vocab_size": 500},
                   **DGX2)
    hd = 256
    assert est.params == 500 * hd + 1024 * hd + 4 * (12 * hd * hd + 13 * hd) + 2 * hd
    assert est.shape.heads == 2


def test_sizes_are_read_from_this_machine(tmp_path):
    est = estimate(10**6, nvme_path=str(tmp_path))
    hw = est.hardware
    assert set(hw.detected) == {"gpus", "gpu_mem", "cpu_mem", "nvme"}
    assert hw.cpu_mem == psutil.virtual_memory().total
    assert hw.nvme > 0
    if not torch.cuda.is_available():
        assert hw.device_is_host and hw.gpus_per_node == 1
    assert est.recommended is not None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only device tier")
def test_without_accelerator_device_and_host_share_memory():
    # 24 GiB of RAM: the device tier is that same RAM, so device + host must fit in it together
    est = estimate("1B", cpu_mem="24GiB", nvme="1TB")
    assert est.hardware.device_is_host
    assert est.placement(2, "device", "device").fits            # 20 GB of model states
    big = estimate("2B", cpu_mem="24GiB", nvme="1TB")
    for p in (big.placement(2, "device", "device"), big.placement(3, "cpu", "cpu"),
              big.placement(3, "device", "cpu")):
        assert not p.fits
    assert big.placement(3, "nvme", "nvme").fits


def test_sizes_and_counts_parse():
    assert parse_size("32GB") == 32 * 10**9
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5TB") == 1_500_000_000_000
    assert parse_size("1e9") == 10**9
    assert parse_size(4096) == 4096
    assert parse_count("1e12") == 10**12
    assert parse_count("70B") == 70 * 10**9
    assert parse_count("1.5T") == 1_500_000_000_000
    assert parse_count(350_000_000) == 350_000_000


@pytest.mark.parametrize("kwargs,message", [
    (dict(params=-5), "positive"),
    (dict(params=0), "positive"),
    (dict(params="lots"), "cannot read"),
    (dict(params=1e9, gpu_mem="12XB"), "unknown unit 'XB'"),
    (dict(params=1e9, cpu_mem="-1GB"), "cannot read"),
    (dict(params=1e9, dtype="int8"), "bf16, fp16 or fp32"),
    (dict(params=1e9, gpus=0), "gpus"),
    (dict(params=1e9, micro_batch=0), "micro_batch"),
    (dict(), "parameter count"),
    (dict(model={"vocab_size": 10}), "number of layers"),
    (dict(model="/nonexistent/dir"), "config.json"),
])
def test_bad_input_says_what_to_change(kwargs, message):
    with pytest.raises(EstimateError, match=message) as info:
        estimate(**{"gpus": 1, "gpu_mem": "1GB", "cpu_mem": "1GB", "nvme": "1GB", **kwargs})
    assert isinstance(info.value, ValueError)


def test_table_lists_every_placement():
    est = estimate("1T", tiling_factor=2, **DGX2)
    table = est.table()
    assert len(est.placements) == 15
    assert f"{20 * est.params / 2**40:.2f} TiB" in table  # 20 bytes per parameter of model states
    body = table.splitlines()[table.splitlines().index("") + 1:]
    assert body[0].split()[:3] == ["stage", "params", "optimizer"]
    assert len(body) == 18  # the header, the 15 placements, the auto row and the line that says what it is
    assert sum(line.endswith("yes") for line in body) == 2  # all on NVMe, and device: auto's split of the parameters
    assert body[16].startswith("3      auto -> cpu 0.375 / nvme 0.625  auto -> nvme") and body[16].endswith("yes")
    assert body[17].startswith("auto: device: auto (zero.offload_param, zero.offload_optimizer) plans params cpu "
                               "0.375 / nvme 0.625, optimizer nvme on this node")
    json.dumps(est.to_dict())               # serializable as is


def _cli(*args):
    """What ``python -m infinity.estimate ARGS`` exits with and prints, run through its ``main``
    in this process (the command itself: tests/integration/test_estimate_command.py)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code
    return subprocess.CompletedProcess(["infinity.estimate", *args], code, out.getvalue(), err.getvalue())


def test_cli_recommends_nvme_for_one_trillion():
    run = _cli("--params", "1e12", "--gpus", "16", "--gpu-mem", "32GB", "--cpu-mem", "1.5TB",
               "--nvme", "28TB", "--tiling-factor", "2")
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "fits: stage 3 params=nvme optimizer=nvme, stage 3 auto -> params cpu 0.375 / nvme 0.625, optimizer " \
           "nvme\n" in out  # the recommendation is on whole tiers where one fits
    config = yaml.safe_load(out.split("recommended config:\n", 1)[1])
    assert config["zero"] == {"stage": 3,
                              "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"},
                              "offload_optimizer": {"device": "nvme",
                                                    "nvme_path": "/local_nvme"},
                              "tiling": {"enabled": True, "max_tile_params": 1_310_720_000}}
    untiled = _cli("--params", "1e12", "--gpus", "16", "--gpu-mem", "32GB", "--cpu-mem", "1.5TB", "--nvme", "28TB")
    assert "fits: nothing" in untiled.stdout and "one fits with tiling factor 2 " in untiled.stdout
    assert "  offload_param: {device: nvme, nvme_path: /local_nvme}" in out


def test_cli_json_and_model_config(tmp_path):
    fields = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 1000,
              "n_positions": 128, "bos_token_id": 0, "eos_token_id": 0}
    (tmp_path / "config.json").write_text(json.dumps(fields))
    run = _cli("--model", str(tmp_path / "config.json"), "--gpus", "1", "--gpu-mem", "1GB",
               "--cpu-mem", "4GB", "--nvme", "10GB", "--json")
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    assert data["params"] == 172_288
    assert data["recommended"]["config"]["zero"]["stage"] == 2
    assert len(data["placements"]) == 15


@pytest.mark.parametrize("args,message", [
    (["--params", "-5"], "params: '-5' must be a positive number"),
    (["--params", "1e9", "--gpu-mem", "12XB"], "gpu_mem: unknown unit 'XB'"),
])
def test_cli_bad_input_exits_2(args, message):
    run = _cli(*args, "--gpus", "1", "--cpu-mem", "1GB", "--nvme", "1GB")
    assert run.returncode == 2
    assert message in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("params", ["1B", "70B", "1T"])
def test_recommended_config_loads_as_an_infinity_config(params, tmp_path):
    from infinity.config import Config

    est = estimate(params, nvme_path=str(tmp_path), **DGX2)
    rec = est.recommended or est.tiling_needed.recommended
    zero = Config.from_dict(rec.config).zero
    as_config = {"device": "none", "cpu": "cpu", "nvme": "nvme"}
    assert zero.stage == rec.placement.stage
    assert zero.offload_param.device == as_config[rec.placement.param_tier.value]
    assert zero.offload_optimizer.device == as_config[rec.placement.optimizer_tier.value]


def test_importing_the_command_module_keeps_infinity_estimate_callable():
    import importlib

    importlib.import_module("infinity.estimate")  # binds the module as infinity.estimate
    assert infinity.estimate("1B", gpus=1, gpu_mem="16GB", cpu_mem="64GB", nvme="1TB").params == pytest.approx(10**9, rel=0.05)


def test_cli_steps_projects_the_ssd_writes_against_the_rating():
    """Note [endurance budget] in _endurance.py: --steps N gives the planned run's TB written per node (the run
    model's bytes per rank and step, times the node's ranks and the steps) and, with
    --endurance-tbw, its share of the drive's rating, warning past the default fraction."""
    from infinity._apps._estimate_cli import _parser, _run_of
    from infinity._apps._runmodel import nvme_bytes

    hw = ["--params", "1.3B", "--gpus", "2", "--gpu-mem", "80GB", "--cpu-mem", "128GB", "--nvme", "4TB"]
    run = _cli(*hw, "--steps", "1000", "--endurance-tbw", "600", "--json")
    assert run.returncode == 0, run.stderr
    writes = json.loads(run.stdout)["ssd_writes"]
    per_rank = nvme_bytes(_run_of(estimate("1.3B", gpus=2, gpu_mem="80GB", cpu_mem="128GB", nvme="4TB"),
                                  _parser().parse_args(hw)))["write"]
    assert writes["bytes_per_rank_step"] == per_rank > 12 * 1.3e9 / 2  # master and both moments at least
    assert writes["tb_per_node"] == pytest.approx(per_rank * 2 * 1000 / 1e12)
    assert writes["share"] == pytest.approx(writes["tb_per_node"] / 600)
    text = _cli(*hw, "--steps", "1000", "--endurance-tbw", "600").stdout
    assert f"= {writes['tb_per_node']:.3g} TB per node, {100 * writes['share']:.3g}% of the drive's rated 600 TB" in text
    assert "compressed moments" not in text  # within a tenth of the rating
    many = _cli(*hw, "--steps", "100000", "--endurance-tbw", "600").stdout
    assert "more than 10% (aio.endurance_warn_fraction's default): compressed moments (--moments bf16)" in many
    unrated = _cli(*hw, "--steps", "10").stdout
    assert "give --endurance-tbw" in unrated
    bad = _cli(*hw, "--steps", "0")
    assert bad.returncode == 2 and "steps: 0 must be at least 1" in bad.stderr


def _plan_json(*args) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--plan", "--json", "--gpus", "4", "--gpu-mem", "16GB", "--cpu-mem", "64GB", "--nvme", "1TB",
                     *args]) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("layout", ["per_rank", "stripe"])
def test_cli_plan_of_a_model_config_over_drives(tmp_path, layout):
    """Note [planned by the engine] in infinity/_apps/_plan.py: the model of a config.json built
    on the meta device and planned by the engine for 4 ranks over 2 drives."""
    fields = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 1000,
              "n_positions": 128}
    (tmp_path / "config.json").write_text(json.dumps(fields))
    data = _plan_json("--model", str(tmp_path / "config.json"), "--drives", "2", "--nvme-layout", layout)
    assert data["params"] == data["trainable"] == 172_288
    assert data["units"] == 5  # wte and wpe, two blocks, ln_f (the head is tied to wte)
    rank = data["per_rank"]
    assert sum(rank["swap_files"].values()) == rank["bytes"]["nvme"] > 0
    assert set(rank["swap_files"]) == {"params.swp", "master.swp", "exp_avg.swp", "exp_avg_sq.swp"}  # gradients: host
    # 4 ranks, 2 drives: two ranks' files on each (rank), or half of every rank's files on each (stripe)
    assert data["per_node"]["drives"] == {"nvme0": 2 * rank["bytes"]["nvme"], "nvme1": 2 * rank["bytes"]["nvme"]}
    assert data["node"]["nvme_layout"] == layout


def test_cli_plan_drive_bandwidth_sets_each_drive_rates(tmp_path):
    """--drive-bandwidth READ,WRITE (GB/s) is each drive's in the plan, as in --step-time; READ alone is both."""
    data = _plan_json("--layers", "2", "--hidden", "64", "--drives", "2", "--drive-bandwidth", "6.5,3.5")
    assert (data["node"]["drive_read"], data["node"]["drive_write"]) == (6.5e9, 3.5e9)
    data = _plan_json("--layers", "2", "--hidden", "64", "--drives", "2", "--drive-bandwidth", "2")
    assert (data["node"]["drive_read"], data["node"]["drive_write"]) == (2e9, 2e9)


@pytest.mark.parametrize("args,message", [
    (["--drives", "0"], "drives: 0 must be at least 1"),
    (["--step-time", "--trainable", "1000"], "--plan: --step-time, --trainable belong to the estimate"),
    (["--steps", "10"], "--plan: --steps belong to the estimate"),
    (["--config", "/no/such/plan.yaml"], "config file '/no/such/plan.yaml' does not exist"),
])
def test_cli_plan_bad_input_exits_2(capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        main(["--plan", "--layers", "2", "--hidden", "64", "--gpus", "1", "--cpu-mem", "1GB", "--nvme", "1GB", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("drives", ["1", "2"])
def test_cli_plan_names_drives_that_need_not_exist_here(tmp_path, monkeypatch, drives):
    """The planned node's drives (nvme0, ... or the placeholder) are names, not this machine's
    directories: a plan run where one of those names is a file (or the directory is read-only)
    plans as anywhere else."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nvme0").write_text("not a drive")
    data = _plan_json("--layers", "2", "--hidden", "64", "--drives", drives)
    assert set(data["per_node"]["drives"]) == ({"nvme0", "nvme1"} if drives == "2" else {"/local_nvme"})
    assert sum(data["per_node"]["drives"].values()) == 4 * data["per_rank"]["bytes"]["nvme"] > 0


def test_cli_plan_of_a_config_takes_its_drives_and_layout(tmp_path, capsys):
    cfg = {"zero": {"stage": 3, "nvme_layout": "stripe",
                    "offload_param": {"device": "nvme", "nvme_path": ["/a", "/b", "/c"]},
                    "offload_optimizer": {"device": "cpu"}}, "precision": {"dtype": "bf16"}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    data = _plan_json("--layers", "2", "--hidden", "64", "--config", str(tmp_path / "cfg.yaml"))
    files = data["per_rank"]["swap_files"]
    assert list(files) == ["params.swp"] and data["node"]["nvme_layout"] == "stripe"
    assert data["per_node"]["drive_ranks"] == {d: [0, 1, 2, 3] for d in ("/a", "/b", "/c")}
    striped = sum(data["per_node"]["drives"].values())  # a third of each rank's file on each drive, rounded down
    assert 0 <= 4 * files["params.swp"] - striped < 4 * 3
    with pytest.raises(SystemExit) as exc:
        main(["--plan", "--layers", "2", "--hidden", "64", "--gpus", "1", "--cpu-mem", "1GB", "--nvme", "1GB",
              "--config", str(tmp_path / "cfg.yaml"), "--drives", "2"])
    assert exc.value.code == 2 and "leave out --drives, or --config" in capsys.readouterr().err


@pytest.mark.parametrize("args,read,write", [
    (["--hardware", "h100x8"], 6.5, 3.5),  # the node's own 8 drives
    (["--hardware", "h100x8", "--drives", "4"], 3.25, 1.75),  # half its drives: two ranks on each
    (["--hardware", "h100x8", "--drive-bandwidth", "3"], 3.0, 3.0),  # its 8 drives at 3 GB/s
    (["--hardware", "dgx2", "--drives", "16"], 3.125, 3.125),  # a drive per rank at the node's per-drive rate
    # 2 nodes of 8 ranks: each node's 8 ranks share its 2 drives, not the 16 ranks of the job
    (["--rates", "h100", "--gpus", "8", "--nodes", "2", "--gpu-mem", "80GB", "--cpu-mem", "1TB", "--nvme", "10TB",
      "--drives", "2", "--drive-bandwidth", "4"], 1.0, 1.0),
])
def test_cli_step_time_drives_apply_to_a_preset_node(args, read, write):
    """--drives and --drive-bandwidth are a rank's NVMe rates with the rates of --hardware or
    --rates too (a preset node's drives at its own per-drive bandwidth where not given), the
    node's ranks sharing its drives."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--step-time", "--layers", "4", "--hidden", "512", "--offload", "nvme,nvme", *args]) == 0
    line = next(r for r in out.getvalue().splitlines() if r.startswith("rates"))
    assert f"NVMe read {read:.2f} GB/s, write {write:.2f} GB/s" in line


def test_cli_plan_drive_table_keeps_its_columns_for_long_names_and_rank_lists(tmp_path):
    """The plan's drive table: each column starts where its heading does, however long a drive's
    path or its list of ranks (16 ranks over 2 drives: eight ranks each)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--plan", "--hardware", "dgx2", "--layers", "2", "--hidden", "64", "--drives", "2"]) == 0
    lines = out.getvalue().splitlines()
    head = next(i for i, r in enumerate(lines) if r.strip().startswith("drive "))
    rows = lines[head + 1:head + 3]
    assert [r.split()[1] for r in rows] == ["0,2,4,6,8,10,12,14", "1,3,5,7,9,11,13,15"]
    for heading in ("ranks", "read once"):
        assert len({r.index(r.split()[1 if heading == "ranks" else 4]) for r in rows}) == 1
    end = lines[head].index("swap bytes") + len("swap bytes")
    assert all(r[end - 3:end] == "MiB" for r in rows)


def test_bare_70b_takes_the_published_llama_shape():
    shape = estimate("70B", gpus=8, gpu_mem="80GB", cpu_mem="1TB", nvme="10TB").shape
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.ffn) == (80, 8192, 64, 8, 28672)
    assert "Llama-2/3 70B's shape" in _cli("--params", "70B", "--gpus", "8", "--gpu-mem", "80GB", "--cpu-mem", "1TB",
                                           "--nvme", "10TB").stdout


def test_the_table_and_offload_speak_the_configs_words():
    hw = ["--params", "1.3B", "--gpus", "1", "--gpu-mem", "24GB", "--cpu-mem", "64GB", "--nvme", "1TB"]
    table = _cli(*hw)
    rows = [line.split() for line in table.stdout.splitlines() if line[:1].isdigit() and "GiB" in line]
    assert rows and {r[1] for r in rows[:-1]} == {"none", "cpu", "nvme"} and "device" not in {r[2] for r in rows}
    assert rows[-1][1:7] == ["auto", "->", "cpu", "auto", "->", "cpu"]  # device: auto's row, and its choice
    steps = {off: json.loads(_cli(*hw, "--steps", "10", "--offload", off, "--json").stdout)["ssd_writes"]
             for off in ("none,nvme", "device,nvme")}  # device: the table's word before, kept as an alias
    assert steps["none,nvme"] == steps["device,nvme"] and steps["none,nvme"]["param_tier"] == "none"


def test_the_json_speaks_the_configs_words():
    """Each row of --json places its states in the config's words (offload_*.device: none, cpu, nvme; auto's
    row auto, its split as the config writes it), the recommended placement's too."""
    hw = ["--params", "1.3B", "--gpus", "1", "--gpu-mem", "24GB", "--cpu-mem", "64GB", "--nvme", "1TB"]
    data = json.loads(_cli(*hw, "--json", "--offload-split", "optimizer=cpu:0.5,nvme:0.5").stdout)
    rows = data["placements"] + data["split_placements"] + [data["auto"]]
    assert {r["param_tier"] for r in data["placements"]} == {"none", "cpu", "nvme"}
    assert all("device" not in (r["param_tier"], r["optimizer_tier"]) for r in rows)
    rec = data["recommended"]["placement"]
    assert (rec["param_tier"], rec["optimizer_tier"]) == ("none", "cpu")
    assert rec["zero"] == {"stage": 2, "offload_param": {"device": "none"}, "offload_optimizer": {"device": "cpu"}}
    assert {k: data["recommended"]["config"]["zero"][k] for k in rec["zero"]} == rec["zero"]
    split = next(r for r in data["split_placements"] if r["stage"] == 3 and r["param_tier"] == "cpu")
    assert split["optimizer_tier"] == "nvme"  # a split's section names its slowest tier, as the config does
    assert split["zero"]["offload_optimizer"] == {"device": "nvme", "split": {"cpu": 0.5, "nvme": 0.5}}
    assert data["auto"]["zero"] == {"stage": 3, "offload_param": {"device": "auto"},
                                    "offload_optimizer": {"device": "auto"}}
    assert (data["auto"]["param_tier"], data["auto"]["optimizer_tier"]) == ("cpu", "cpu")  # what auto planned


@pytest.mark.parametrize("flags,row,mark", [
    (["--offload", "nvme,nvme"], ["3", "nvme", "nvme"], "<- --offload nvme,nvme"),
    (["--offload", "none,cpu", "--stage", "2"], ["2", "none", "cpu"], "<- --offload none,cpu"),
    (["--offload", "auto,auto"], ["3", "auto", "->"], "<- --offload auto,auto"),
    (["--offload", "cpu,nvme", "--offload-split", "optimizer=cpu:0.5,nvme:0.5"], ["3", "cpu", "cpu", "0.5"],
     "<- --offload cpu,nvme"),
])
def test_offload_alone_marks_its_row_of_the_table(flags, row, mark):
    """--offload without --plan, --step-time or --steps is the row it names: marked in the table, said whether it
    fits, with its config (the recommended one follows as ever); --json gives the row."""
    hw = ["--params", "1.3B", "--gpus", "1", "--gpu-mem", "24GB", "--cpu-mem", "64GB", "--nvme", "1TB"]
    run = _cli(*hw, *flags)
    assert run.returncode == 0, run.stderr
    marked = [line for line in run.stdout.splitlines() if line.endswith(mark)]
    assert len(marked) == 1 and marked[0].split()[:len(row)] == row, run.stdout
    said = next(line for line in run.stdout.splitlines() if line.startswith(f"--offload {flags[1]}: "))
    assert "the row marked <-" in said and ("fits" in said)
    assert "recommended config:" in run.stdout
    if said.endswith("its config:"):  # not the recommended placement: its own config, which loads
        from infinity.config import Config

        block = run.stdout.split(said + "\n", 1)[1].split("\n\n", 1)[0]
        zero = Config.from_dict(yaml.safe_load(block)).zero
        assert zero.stage == int(row[0]) and zero.offload_param.device == ("auto" if "auto" in flags[1] else row[1])
    data = json.loads(_cli(*hw, *flags, "--json").stdout)
    assert data["offload_placement"]["label"] in said and data["offload_placement"]["stage"] == int(row[0])
    plain = _cli(*hw).stdout
    assert "<-" not in plain  # nothing asked for: nothing marked


def test_offload_alone_refuses_a_placement_the_table_has_not():
    run = _cli("--params", "1.3B", "--gpus", "1", "--gpu-mem", "24GB", "--cpu-mem", "64GB", "--nvme", "1TB",
               "--offload", "nvme,cpu", "--stage", "2")
    assert run.returncode == 2 and "parameters leave the device only at stage 3" in run.stderr


def test_step_time_prints_the_table_and_predicts_the_recommended_placement():
    hw = ["--params", "1.3B", "--gpus", "1", "--gpu-mem", "24GB", "--cpu-mem", "64GB", "--nvme", "1TB"]
    run = _cli(*hw, "--step-time", "--rates", "h100")
    assert run.returncode == 0, run.stderr
    unmarked = "\n".join(line.split("  <- ")[0].rstrip() for line in run.stdout.splitlines())
    assert unmarked.startswith(_cli(*hw).stdout.rstrip("\n"))  # the table and the recommended config first
    # the recommended placement is stage 2 (none, cpu): the run model is of stage 3 only, so it predicts the fastest
    # stage-3 row that fits, and says so
    assert "step time predicted for stage 3 params=none optimizer=cpu, the fastest stage-3 row that fits (marked <-): " \
           "the run model is of stage 3 only (Note [run model] in infinity/_apps/_runmodel.py), not of the " \
           "recommended stage 2 params=none optimizer=cpu" in run.stdout, run.stdout
    assert "recommended placement's" not in run.stdout and "offload_param none, offload_optimizer cpu" in run.stdout
    assert "parameters in 0.000 s a pass" in run.stdout  # the parameters stay on the device: no copy in
    marked = [line.split()[:3] for line in run.stdout.splitlines() if line.endswith("<- --step-time")]
    assert marked == [["3", "none", "cpu"]]
    small = [*hw[:4], "--gpu-mem", "2GB", *hw[6:]]  # stage 3 is the recommended placement: that row
    text = _cli(*small, "--step-time", "--rates", "h100").stdout
    assert "step time predicted for stage 3 params=cpu optimizer=cpu, the recommended placement (marked <-):" in text
