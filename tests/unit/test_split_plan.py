"""Splits of one state over host memory and NVMe, and the automatic plan, before anything is
allocated (Note [split tiers], [planned split] in infinity/_offload/_split.py): the config's
rules, where the cut falls, and the bytes per tier the memory model gives for it."""
import pytest
import torch
from torch import nn

from infinity._offload._placement import Machine
from infinity._offload._preflight import plan
from infinity._offload._split import opt_host_upto, param_host_upto
from infinity._zero._unit_plan import placement_of
from infinity.config import Config, ConfigError

GiB = 1 << 30


def _cfg(opt=None, param=None, **zero):
    z = {"stage": 3, **zero}
    if opt is not None:
        z["offload_optimizer"] = {"nvme_path": "/tmp/never-made", "chunk_size": 4096, **opt}
    if param is not None:
        z["offload_param"] = {"nvme_path": "/tmp/never-made", **param}
    return Config.from_dict({"zero": z, "precision": {"dtype": "bf16"}})


class Stack(nn.Module):
    def __init__(self, blocks=8, width=512):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _placement(cfg, host=64 * GiB):
    with torch.device("meta"):
        model = Stack()
    return placement_of(model, cfg, 1, Machine(False, host, 1))[0]


@pytest.mark.parametrize("split, words", [
    ({"cpu": 0.5, "nvme": 0.4}, "sum to 0.9"),
    ({"cpu": 0.3, "device": 0.2, "nvme": 0.5}, "device share"),
    ({"cpu": 1.5}, "out of range"),
])
def test_a_bad_split_is_refused_with_its_numbers(split, words):
    with pytest.raises(ConfigError, match=words):
        _cfg({"device": "nvme", "split": split})


def test_the_section_names_the_splits_slowest_tier():
    with pytest.raises(ConfigError, match="set device to nvme"):
        _cfg({"device": "cpu", "split": {"cpu": 0.5, "nvme": 0.5}})
    with pytest.raises(ConfigError, match="plans the split itself"):
        _cfg({"device": "auto", "split": {"cpu": 0.5, "nvme": 0.5}})
    cfg = _cfg({"device": "cpu", "split": {"cpu": 1.0}})  # all of it in host memory: the cpu tier
    assert cfg.zero.offload_optimizer.split.cpu == 1.0


def test_deepspeed_ratio_is_a_split_with_a_device_share():
    assert Config.from_deepspeed({"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "cpu", "ratio": 1.0}}}).zero.offload_optimizer.device == "cpu"
    with pytest.raises(ConfigError, match="ratio: 0.3: a device share"):
        Config.from_deepspeed({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.7}}})


def test_the_optimizer_cut_is_whole_chunks_and_the_last_chunk_stays_on_nvme():
    assert opt_host_upto(0.5, 10_000, 1000) == 5000
    assert opt_host_upto(0.26, 10_000, 1000) == 3000  # the nearest whole chunk
    assert opt_host_upto(0.99, 10_500, 1000) == 10_000  # the partial last chunk is the NVMe share
    assert opt_host_upto(0.5, 900, 1000) == 0  # one chunk: nothing to split
    assert opt_host_upto(0.0, 10_000, 1000) == 0


def test_the_parameter_cut_is_at_a_unit_boundary_at_or_below_the_fraction():
    ranges = [(0, 100), (100, 300), (400, 50), (450, 550)]
    assert param_host_upto(0.5, ranges, 1000) == 450
    assert param_host_upto(0.05, ranges, 1000) == 0
    assert param_host_upto(0.0, ranges, 1000) == 0


def test_nvme_bytes_follow_the_nvme_fraction():
    """The swap files of a split hold its NVMe share only: 0.5 of the optimizer's space on
    disk is half the files of all-NVMe, and the host share is optimizer state in host memory."""
    nvme = _cfg({"device": "nvme"}, {"device": "nvme"})
    whole = plan(_placement(nvme), nvme)
    p = _placement(_cfg({"device": "nvme", "split": {"cpu": 0.5, "nvme": 0.5}},
                        {"device": "nvme", "split": {"cpu": 0.25, "nvme": 0.75}}))
    half = plan(p, nvme)
    cats, all_cats = half["categories"], whole["categories"]
    on_disk = 1 - p.opt_host_upto / p.layout.opt_total
    assert cats["nvme"]["optimizer_files"] == pytest.approx(all_cats["nvme"]["optimizer_files"] * on_disk)
    per = 12 if p.grads_in_memory else 16  # master and moments (and the gradients, unless all are in host memory)
    assert cats["host"]["optimizer_states"] == per * p.opt_host_upto
    assert p.param_host_upto and cats["nvme"]["param_files"] == 2 * (p.layout.param_total - p.param_host_upto)
    assert cats["host"]["param_shards"] == 2 * p.param_host_upto
    assert "split cpu 0.50, nvme 0.50" in p.describe()


def test_auto_fills_host_memory_then_nvme():
    """Everything in host memory when it fits the budget; below it, the parameters first and
    then as much of the optimizer states as fits; with no room at all, every state on NVMe."""
    auto = {"device": "auto"}
    roomy = _placement(_cfg(auto, auto))
    assert (roomy.opt_tier.name, roomy.param_tier.name) == ("CPU", "CPU")
    full = plan(roomy, _cfg(auto, auto))["host"]
    tight = _placement(_cfg(auto, auto, host_memory_limit=int(full * 0.7)))
    assert tight.opt_tier.name == "NVME" and tight.param_tier.name == "CPU"
    assert 0 < tight.opt_host_upto < tight.layout.opt_total
    assert plan(tight, _cfg(auto, auto))["host"] <= int(full * 0.7)
    none = _placement(_cfg(auto, auto, host_memory_limit=1))
    assert (none.opt_tier.name, none.param_tier.name, none.opt_host_upto, none.param_host_upto) == \
        ("NVME", "NVME", 0, 0)


def test_auto_without_an_nvme_path_stays_in_host_memory():
    cfg = Config.from_dict({"zero": {"stage": 3, "offload_optimizer": {"device": "auto"},
                                     "host_memory_limit": 1}})
    assert _placement(cfg).opt_tier.name == "CPU"


def test_the_run_model_moves_only_the_nvme_share():
    """The run model's NVMe bytes per step for an optimizer split: the owned chunks are neither
    read nor written (Note [run model] in infinity/_apps/_runmodel.py)."""
    from infinity._apps._runmodel import Run, nvme_bytes

    shape = dict(params=192_096_768, layers=4, hidden=1536, heads=12, vocab=50257, micro_batch=1, seq_len=32,
                 param_tier="cpu", optimizer_tier="nvme", host_mem=24 * GiB)
    whole, half = nvme_bytes(Run(**shape)), nvme_bytes(Run(**shape, opt_host_fraction=0.5))
    assert 0.45 < half["read"] / whole["read"] < 0.55 and 0.45 < half["write"] / whole["write"] < 0.55
