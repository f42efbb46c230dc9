"""infinity.Config: loading, validation messages, DeepSpeed mapping, reference table."""
import dataclasses
import json
import logging
import os
from pathlib import Path

import pytest
import yaml

import infinity
import infinity.config as config_mod
from infinity.config import Config, ConfigError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"


@pytest.fixture
def nvme_dir(tmp_path):
    path = tmp_path / "nvme"
    path.mkdir()
    return str(path)


def _error(loader, data) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        loader(data)
    return info.value


# ------------------------------------------------------------------------------------------
# Defaults, round trips, files


def test_default_config_is_stage3_no_offload_fp32():
    cfg = Config()
    assert cfg.zero.stage == 3
    assert cfg.zero.offload_param.device == "none"
    assert cfg.zero.offload_optimizer.device == "none"
    assert cfg.precision.dtype == "fp32"
    assert cfg.optimizer.type == "adamw" and cfg.optimizer.betas == (0.9, 0.999)
    assert cfg.train.model == "gpt2-tiny" and cfg.seed == 1234
    assert Config.from_dict({}) == cfg


def test_design_example_loads_and_round_trips(nvme_dir):
    data = {
        "zero": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme_dir},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_dir},
            "reduce_bucket_size": 50_000_000,
            "prefetch": {"enabled": True, "depth": 3, "bucket_size": 50_000_000,
                         "max_live_parameters": 1_000_000_000, "persistence_threshold": 100_000},
        },
        "precision": {"dtype": "bf16"},
        "optimizer": {"type": "adamw", "lr": 1.0e-4, "betas": [0.9, 0.999], "eps": 1.0e-8,
                      "weight_decay": 0.01},
        "gradient_clipping": 1.0,
        "gradient_accumulation_steps": 1,
        "aio": {"block_size": 1048576, "queue_depth": 32, "threads": 1},
    }
    cfg = Config.from_dict(data)
    assert cfg.zero.offload_param.nvme_path == nvme_dir
    assert cfg.precision.dtype == "bf16"
    plain = cfg.to_dict()
    assert plain["optimizer"]["betas"] == [0.9, 0.999]
    assert json.loads(json.dumps(plain)) == plain  # plain JSON types only
    assert Config.from_dict(plain) == cfg
    for section, values in data.items():
        if isinstance(values, dict):
            for key, value in values.items():
                if not isinstance(value, dict):
                    assert plain[section][key] == value


def test_int_accepted_for_float_and_normalised():
    cfg = Config.from_dict({"optimizer": {"lr": 1, "weight_decay": 0}, "gradient_clipping": 0})
    assert isinstance(cfg.optimizer.lr, float) and cfg.optimizer.lr == 1.0
    assert cfg.gradient_clipping == 0.0


@pytest.mark.parametrize("text,expected", [
    ("8GB", 8 * 10**9), ("512MiB", 512 * 2**20), ("1.5GiB", 3 * 2**29), ("4096", 4096),
    (1 << 30, 1 << 30), ("2 tb", 2 * 10**12),
])
def test_device_memory_limit_sizes(text, expected):
    assert Config.from_dict({"device_memory_limit": text}).device_memory_limit == expected


def test_yaml_file(tmp_path, nvme_dir):
    path = tmp_path / "run.yaml"
    path.write_text(f"""
zero:
  stage: 3
  offload_param: {{device: nvme, nvme_path: {nvme_dir}}}
  reduce_bucket_size: 50_000_000
precision: {{dtype: fp16, initial_scale_power: 12}}
optimizer: {{lr: 1.0e-4}}
device_memory_limit: 8GB
train:
  model: {{model_type: gpt2, n_layer: 2, n_embd: 64, n_head: 2}}
""")
    cfg = Config.from_file(path)
    assert cfg.zero.offload_param.device == "nvme"
    assert cfg.zero.reduce_bucket_size == 50_000_000
    assert cfg.precision.initial_scale_power == 12
    assert cfg.optimizer.lr == 1.0e-4
    assert cfg.device_memory_limit == 8 * 10**9
    assert cfg.train.model["n_layer"] == 2
    assert Config.from_file(str(path)) == cfg
    assert Config.coerce(path) == cfg


def test_json_file_and_yml_extension(tmp_path):
    data = {"zero": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "seed": 7}
    (tmp_path / "a.json").write_text(json.dumps(data))
    (tmp_path / "b.yml").write_text(yaml.safe_dump(data))
    a, b = Config.from_file(tmp_path / "a.json"), Config.from_file(tmp_path / "b.yml")
    assert a == b and a.zero.stage == 2 and a.seed == 7
    (tmp_path / "empty.yaml").write_text("")
    assert Config.from_file(tmp_path / "empty.yaml") == Config()


def test_yaml_empty_section_means_defaults(tmp_path):
    (tmp_path / "c.yaml").write_text("zero:\naio:\n")
    assert Config.from_file(tmp_path / "c.yaml") == Config()


def test_coerce_accepts_none_config_dict_and_deepspeed_dict():
    cfg = Config.from_dict({"seed": 3})
    assert Config.coerce(None) == Config()
    assert Config.coerce(cfg) is cfg
    assert Config.coerce({"seed": 3}) == cfg
    assert Config.coerce({"zero_optimization": {"stage": 2}}).zero.stage == 2
    assert "got int 5" in str(_error(Config.coerce, 5))


def test_with_overrides_validates():
    cfg = Config().with_overrides({"zero.stage": 2, "train.steps": 3})
    assert (cfg.zero.stage, cfg.train.steps) == (2, 3)
    err = _error(Config().with_overrides, {"zero.stgae": 2})
    assert err.keys == ["zero.stgae"] and "'zero.stage'" in str(err)


def test_direct_construction_is_validated_too():
    with pytest.raises(ConfigError, match=r"zero\.stage"):
        Config(zero=config_mod.ZeroConfig(stage=5))
    with pytest.raises(ConfigError, match=r"optimizer\.lr"):
        dataclasses.replace(Config(), optimizer=config_mod.OptimizerConfig(lr=0.0))


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().zero.stage = 2


def test_fp16_knobs_with_other_dtype_warn(infinity_logs):
    Config.from_dict({"precision": {"dtype": "bf16", "hysteresis": 4}})
    assert "precision.hysteresis is only used with fp16" in infinity_logs.text


# ------------------------------------------------------------------------------------------
# Bad configs: each names its key path (and the nearest valid key for unknown keys)

BAD_CONFIGS = [
    # (id, config, key path named, further text the message must contain)
    ("unknown-nested", {"zero": {"stgae": 3}}, "zero.stgae", "'zero.stage'"),
    ("unknown-top-known-elsewhere", {"stage": 3}, "stage", "'zero.stage'"),
    ("unknown-typo-top", {"optimiser": {}}, "optimiser", "'optimizer'"),
    ("unknown-prefetch", {"zero": {"prefetch": {"dept": 2}}}, "zero.prefetch.dept",
     "'zero.prefetch.depth'"),
    ("unknown-deepspeed-name", {"aio": {"thread_count": 2}}, "aio.thread_count", "'aio.threads'"),
    ("unknown-ds-section", {"zero_optimization": {"stage": 3}}, "zero_optimization", "from_deepspeed"),
    ("stage-range", {"zero": {"stage": 4}}, "zero.stage", "1, 2, 3"),
    ("stage-zero", {"zero": {"stage": 0}}, "zero.stage", "1, 2, 3"),
    ("stage-string", {"zero": {"stage": "3"}}, "zero.stage", "1, 2, 3"),
    ("stage-bool", {"zero": {"stage": True}}, "zero.stage", "1, 2, 3"),
    ("device-enum", {"zero": {"offload_param": {"device": "ssd"}}}, "zero.offload_param.device",
     "'none', 'cpu', 'nvme'"),
    ("device-case", {"zero": {"offload_optimizer": {"device": "NVMe"}}},
     "zero.offload_optimizer.device", "'nvme'"),
    ("nvme-without-path", {"zero": {"offload_param": {"device": "nvme"}}},
     "zero.offload_param.nvme_path", "required"),
    ("opt-nvme-without-path", {"zero": {"offload_optimizer": {"device": "nvme"}}},
     "zero.offload_optimizer.nvme_path", "required"),
    ("param-offload-stage2", {"zero": {"stage": 2, "offload_param": {"device": "cpu"}}},
     "zero.offload_param.device", "stage 3"),
    ("section-not-mapping", {"zero": 3}, "zero", "mapping"),
    ("bucket-float", {"zero": {"reduce_bucket_size": 5e7}}, "zero.reduce_bucket_size", "int"),
    ("bucket-zero", {"zero": {"reduce_bucket_size": 0}}, "zero.reduce_bucket_size", "> 0"),
    ("buffer-count-negative", {"zero": {"offload_param": {"buffer_count": -1}}},
     "zero.offload_param.buffer_count", "> 0"),
    ("host-cache-negative", {"zero": {"offload_optimizer": {"host_cache": -1}}},
     "zero.offload_optimizer.host_cache", ">= 0"),
    ("prefetch-enabled-int", {"zero": {"prefetch": {"enabled": 1}}}, "zero.prefetch.enabled", "bool"),
    ("device-depth-over-depth", {"zero": {"prefetch": {"depth": 2, "device_depth": 3}}},
     "zero.prefetch.device_depth", "device_depth <= depth"),
    ("gather-depth-over-device-depth", {"zero": {"prefetch": {"device_depth": 1, "gather_depth": 2}}},
     "zero.prefetch.gather_depth", "gather_depth <= device_depth"),
    ("dtype-enum", {"precision": {"dtype": "float16"}}, "precision.dtype", "'fp32', 'bf16', 'fp16'"),
    ("min-loss-scale", {"precision": {"min_loss_scale": 0}}, "precision.min_loss_scale", "> 0"),
    ("optimizer-type", {"optimizer": {"type": "sgd"}}, "optimizer.type", "'adam', 'adamw'"),
    ("lr-negative", {"optimizer": {"lr": -1e-3}}, "optimizer.lr", "> 0"),
    ("lr-string", {"optimizer": {"lr": "1e-4"}}, "optimizer.lr", "1.0e-4"),
    ("lr-nan", {"optimizer": {"lr": float("nan")}}, "optimizer.lr", "finite"),
    ("lr-bool", {"optimizer": {"lr": True}}, "optimizer.lr", "float"),
    ("betas-range", {"optimizer": {"betas": [0.9, 1.0]}}, "optimizer.betas", "[0, 1)"),
    ("betas-length", {"optimizer": {"betas": [0.9]}}, "optimizer.betas", "[float, float]"),
    ("eps-zero", {"optimizer": {"eps": 0}}, "optimizer.eps", "> 0"),
    ("weight-decay", {"optimizer": {"weight_decay": -0.1}}, "optimizer.weight_decay", ">= 0"),
    ("clipping", {"gradient_clipping": -1}, "gradient_clipping", ">= 0"),
    ("accumulation", {"gradient_accumulation_steps": 0}, "gradient_accumulation_steps", ">= 1"),
    ("block-size-align", {"aio": {"block_size": 1000}}, "aio.block_size", "4096"),
    ("queue-depth", {"aio": {"queue_depth": 0}}, "aio.queue_depth", ">= 1"),
    ("aio-backend", {"aio": {"backend": "libaio"}}, "aio.backend", "'io_uring', 'threads'"),
    ("memory-limit-unit", {"device_memory_limit": "8 gigs"}, "device_memory_limit", "512MiB"),
    ("memory-limit-zero", {"device_memory_limit": 0}, "device_memory_limit", "> 0"),
    ("seed-negative", {"seed": -1}, "seed", ">= 0"),
    ("telemetry-every", {"telemetry": {"every": 0}}, "telemetry.every", ">= 1"),
    ("model-dict-without-type", {"train": {"model": {"n_layer": 2}}}, "train.model", "model_type"),
    ("model-wrong-type", {"train": {"model": 5}}, "train.model", "str or mapping"),
    ("data-extension", {"train": {"data": "corpus.csv"}}, "train.data", ".jsonl"),
    ("steps-null", {"train": {"steps": None}}, "train.steps", "null"),
]


@pytest.mark.parametrize("data,key,text", [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS])
def test_bad_config_names_the_key(data, key, text):
    err = _error(Config.from_dict, data)
    assert key in err.keys
    assert f"{key}:" in str(err)
    assert text in str(err)


def test_at_least_twenty_bad_configs():
    assert len({c[0] for c in BAD_CONFIGS}) >= 20


def test_all_problems_reported_at_once():
    err = _error(Config.from_dict, {"zero": {"stage": 9}, "optimizer": {"type": "sgd"}, "foo": 1})
    assert set(err.keys) == {"zero.stage", "optimizer.type", "foo"}
    assert "3 problems" in str(err)


def test_nvme_path_that_is_a_file(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    err = _error(Config.from_dict, {"zero": {"offload_param": {"device": "nvme", "nvme_path": str(path)}}})
    assert err.keys == ["zero.offload_param.nvme_path"] and "not a directory" in str(err)


def _unwritable_dir(tmp_path) -> str:
    path = tmp_path / "readonly"
    path.mkdir()
    path.chmod(0o555)
    if not os.access(path, os.W_OK):
        return str(path)
    if os.path.isdir("/proc/sys") and not os.access("/proc/sys", os.W_OK):
        return "/proc/sys"  # root ignores mode bits, but not a read-only mount
    pytest.skip("cannot make an unwritable directory here (root on writable mounts)")


def test_nvme_path_not_writable(tmp_path):
    path = _unwritable_dir(tmp_path)
    err = _error(Config.from_dict,
                 {"zero": {"offload_optimizer": {"device": "nvme", "nvme_path": path}}})
    assert err.keys == ["zero.offload_optimizer.nvme_path"] and "not writable" in str(err)


def test_missing_nvme_path_directory_is_accepted(tmp_path):
    path = str(tmp_path / "created-later")
    cfg = Config.from_dict({"zero": {"offload_param": {"device": "nvme", "nvme_path": path}}})
    assert cfg.zero.offload_param.nvme_path == path


def test_nvme_path_takes_a_list_of_drives(tmp_path):
    """Note [many drives] in _drives.py: one string stays one drive; a list is one directory
    per drive, kept in order."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    cfg = Config.from_dict({"zero": {"offload_param": {"device": "nvme", "nvme_path": [a, b]},
                                     "offload_optimizer": {"device": "nvme", "nvme_path": a}}})
    assert cfg.zero.offload_param.nvme_path == (a, b) and cfg.zero.offload_optimizer.nvme_path == a
    assert cfg.zero.nvme_layout == "per_rank" and cfg.zero.nvme_stripe_size == 8 << 20
    assert Config.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("drives,message", [
    ([], "names no drive"),
    (["A", 5], "[1]: expected a directory (str), got int 5"),
    (["A", "A/"], "[1] 'A/' is [0] again"),
    (["A", "FILE"], "[1]: 'FILE' exists but is not a directory"),
])
def test_bad_list_of_drives_names_the_key_and_index(tmp_path, drives, message):
    (tmp_path / "file").write_text("x")
    names = {"A": str(tmp_path), "A/": str(tmp_path) + "/", "FILE": str(tmp_path / "file")}
    drives = [names.get(d, d) for d in drives]
    message = message.replace("'A/'", repr(names["A/"])).replace("'FILE'", repr(names["FILE"]))
    err = _error(Config.from_dict, {"zero": {"offload_optimizer": {"device": "nvme", "nvme_path": drives}}})
    assert err.keys == ["zero.offload_optimizer.nvme_path"] and message in str(err), str(err)


@pytest.mark.parametrize("zero,aio,message", [
    ({"nvme_layout": "rank"}, {}, "allowed values: 'per_rank', 'stripe'"),
    ({"nvme_stripe_size": 5000}, {}, "not a multiple of 4096"),
    ({"nvme_layout": "stripe", "nvme_stripe_size": "1MiB"}, {"block_size": 2 << 20},
     "not a multiple of aio.block_size (2097152)"),
])
def test_bad_nvme_layout_keys(zero, aio, message):
    err = _error(Config.from_dict, {"zero": zero, "aio": aio})
    assert err.keys == [f"zero.{next(iter(zero)) if 'nvme_stripe_size' not in zero else 'nvme_stripe_size'}"]
    assert message in str(err), str(err)


@pytest.mark.parametrize("name,text,message", [
    ("x.toml", "a = 1", "extension"),
    ("bad.json", "{not json", "not valid JSON"),
    ("bad.yaml", "zero: [1, 2", "not valid YAML"),
    ("list.yaml", "- 1\n- 2\n", "mapping"),
])
def test_bad_files(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    err = _error(Config.from_file, tmp_path / name)
    assert name in str(err) and message in str(err)


def test_missing_file(tmp_path):
    assert "does not exist" in str(_error(Config.from_file, tmp_path / "nope.yaml"))


# ------------------------------------------------------------------------------------------
# DeepSpeed


def _zero_infinity_ds(nvme: str) -> dict:
    """A ZeRO-Infinity config in the shape DeepSpeed users write."""
    return {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 8,
        "gradient_clipping": 0.5,
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
        "bf16": {"enabled": True},
        "fp16": {"enabled": False},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme, "pin_memory": True,
                              "buffer_count": 5, "buffer_size": 1e8},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "sub_group_size": 1e9,
            "reduce_bucket_size": 5e7,
            "stage3_prefetch_bucket_size": 4.5e7,
            "stage3_param_persistence_threshold": 1e5,
            "stage3_max_live_parameters": 2e9,
            "stage3_gather_16bit_weights_on_model_save": False,
        },
        "aio": {"block_size": 262144, "queue_depth": 16, "thread_count": 2,
                "single_submit": False, "overlap_events": True},
        "tensorboard": {"enabled": False},
    }


def test_deepspeed_zero_infinity_maps(nvme_dir, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = Config.from_deepspeed(_zero_infinity_ds(nvme_dir))
    expected = Config.from_dict({
        "zero": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme_dir, "buffer_count": 5,
                              "buffer_size": 100_000_000},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_dir, "chunk_size": 10**9},
            "reduce_bucket_size": 50_000_000,
            "prefetch": {"bucket_size": 45_000_000, "persistence_threshold": 100_000,
                         "max_live_parameters": 2 * 10**9},
        },
        "precision": {"dtype": "bf16"},
        "optimizer": {"type": "adamw", "lr": 3e-5, "betas": [0.9, 0.95], "eps": 1e-8,
                      "weight_decay": 0.1},
        "gradient_clipping": 0.5,
        "gradient_accumulation_steps": 8,
        "aio": {"block_size": 262144, "queue_depth": 16, "threads": 2},
        "train": {"micro_batch_size": 4, "log_every": 10},
    })
    assert cfg == expected
    assert cfg.unsupported == []
    assert isinstance(cfg.zero.offload_param.buffer_size, int)


def test_deepspeed_json_file_is_detected(tmp_path, nvme_dir, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(_zero_infinity_ds(nvme_dir)))
    assert Config.from_file(path) == Config.from_deepspeed(path) == Config.from_deepspeed(str(path))
    assert Config.from_file(path).precision.dtype == "bf16"


def test_deepspeed_unsupported_keys_listed_by_full_path(nvme_dir):
    ds = _zero_infinity_ds(nvme_dir)
    ds["zero_optimization"]["stage3_max_reuse_distance"] = 1e9
    ds["zero_optimization"]["offload_param"]["max_in_cpu"] = 1e9
    ds["zero_optimization"]["overlap_comm"] = False
    ds["aio"]["use_gds"] = True
    ds["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}
    ds["optimizer"]["params"]["amsgrad"] = True
    ds["flops_profiler"] = {"enabled": True}
    tuning = ["zero_optimization.stage3_max_reuse_distance",  # offload_param.max_in_cpu is a cap of ours now
              "zero_optimization.overlap_comm", "aio.use_gds", "flops_profiler"]
    err = _error(lambda d: Config.from_deepspeed(d, strict=True), ds)  # strict: every key must count
    assert sorted(err.keys) == sorted(tuning + ["optimizer.params.amsgrad"])
    assert "without strict" in str(err)
    assert "reuse-distance" in str(err)
    err = _error(Config.from_deepspeed, ds)  # by default only what would change the result is refused
    assert err.keys == ["optimizer.params.amsgrad"] and "amsgrad" in str(err)
    del ds["optimizer"]["params"]["amsgrad"]
    assert Config.from_deepspeed(ds).zero.offload_param.max_in_cpu == 10**9  # the parameter cache's cap


def test_deepspeed_non_strict_warns_and_records(nvme_dir, infinity_logs):
    ds = _zero_infinity_ds(nvme_dir)
    ds["zero_optimization"]["stage3_max_reuse_distance"] = 1e9
    ds["zero_optimization"]["allgather_bucket_size"] = 5e8
    cfg = Config.from_deepspeed(ds, strict=False)
    assert sorted(cfg.unsupported) == ["zero_optimization.allgather_bucket_size",
                                       "zero_optimization.stage3_max_reuse_distance"]
    warnings = [r.getMessage() for r in infinity_logs.records if r.levelno == logging.WARNING]
    assert any("zero_optimization.stage3_max_reuse_distance" in w for w in warnings)
    assert any("zero_optimization.allgather_bucket_size" in w for w in warnings)
    assert cfg.zero.stage == 3  # the rest still mapped


@pytest.mark.parametrize("flags,dtype", [((), "fp32"), (("avx512_bf16",), "bf16")], ids=["avx2", "avx512_bf16"])
def test_deepspeed_auto_values_keep_defaults(flags, dtype, monkeypatch):
    """``auto`` keeps every default; bf16 auto follows the CPU (pinned here, so the test reads
    the same on every machine): bf16 where it multiplies bf16 natively, else fp32."""
    from infinity._runtime import _accelerator

    monkeypatch.setattr(_accelerator, "_cpu_flags", lambda: set(flags))
    monkeypatch.delenv("INFINITY_CPU_ISA", raising=False)  # the flags above are the whole CPU
    ds = {
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                              "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto",
                              "stage3_max_live_parameters": "auto",
                              "stage3_max_reuse_distance": "auto", "sub_group_size": "auto"},
    }
    cfg = Config.from_deepspeed(ds)
    assert cfg.precision.dtype == dtype
    assert cfg == Config.from_dict({"precision": {"dtype": dtype}})
    assert cfg.unsupported == []


@pytest.mark.parametrize("adam_w_mode,expected", [(None, "adamw"), (True, "adamw"), (False, "adam")])
def test_deepspeed_adam_follows_adam_w_mode(adam_w_mode, expected):
    params = {"lr": 1e-3} if adam_w_mode is None else {"lr": 1e-3, "adam_w_mode": adam_w_mode}
    cfg = Config.from_deepspeed({"optimizer": {"type": "Adam", "params": params},
                                 "zero_optimization": {"stage": 2}})
    assert cfg.optimizer.type == expected and cfg.optimizer.lr == 1e-3


def test_deepspeed_fp16_section():
    cfg = Config.from_deepspeed({"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                                          "loss_scale_window": 500, "hysteresis": 3,
                                          "min_loss_scale": 2}})
    p = cfg.precision
    assert (p.dtype, p.loss_scale, p.initial_scale_power, p.loss_scale_window, p.hysteresis,
            p.min_loss_scale) == ("fp16", 0.0, 12, 500, 3, 2.0)


def test_deepspeed_bfloat16_spelling_and_stage2_cpu_offload():
    cfg = Config.from_deepspeed({"bfloat16": {"enabled": True}, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}})
    assert (cfg.precision.dtype, cfg.zero.stage, cfg.zero.offload_optimizer.device) == \
        ("bf16", 2, "cpu")


def test_deepspeed_batch_size_derived_and_checked(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = Config.from_deepspeed({"train_batch_size": 16, "gradient_accumulation_steps": 2})
    assert cfg.train.micro_batch_size == 4
    err = _error(Config.from_deepspeed, {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                                         "gradient_accumulation_steps": 1})
    assert err.keys == ["train_batch_size"] and "world size (2)" in str(err)
    monkeypatch.delenv("WORLD_SIZE")
    err = _error(Config.from_deepspeed, {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4})
    assert err.keys == ["train_batch_size"] and "multiple" in str(err)


BAD_DEEPSPEED = [
    ("both-precisions", {"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled", "bf16"),
    ("stage-zero", {"zero_optimization": {"stage": 0}}, "zero_optimization.stage", "1, 2, 3"),
    ("nvme-no-path", {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     "zero_optimization.offload_param.nvme_path", "required"),
    ("param-offload-stage2", {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     "zero_optimization.offload_param.device", "stage 3"),
    ("optimizer-type", {"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, "optimizer.type",
     "Adam, AdamW"),
    ("lr-negative", {"optimizer": {"type": "AdamW", "params": {"lr": -1}}}, "optimizer.params.lr", "> 0"),
    ("thread-count", {"aio": {"thread_count": 0}}, "aio.thread_count", ">= 1"),
    ("enabled-not-bool", {"bf16": {"enabled": "yes"}}, "bf16.enabled", "bool"),
    ("section-not-mapping", {"zero_optimization": 3}, "zero_optimization", "mapping"),
    ("batch-not-int", {"train_batch_size": "big"}, "train_batch_size", "positive int"),
    ("bucket-fraction", {"zero_optimization": {"reduce_bucket_size": 1.5}},
     "zero_optimization.reduce_bucket_size", "int"),
]


@pytest.mark.parametrize("data,key,text", [c[1:] for c in BAD_DEEPSPEED], ids=[c[0] for c in BAD_DEEPSPEED])
def test_bad_deepspeed_names_the_deepspeed_key(data, key, text, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    err = _error(Config.from_deepspeed, data)
    assert key in err.keys
    assert text in str(err)


def test_deepspeed_typo_gets_did_you_mean_not_remove_it(nvme_dir):
    ds = {"zero_optimization": {"stage": 3, "offload_param": {"devcie": "nvme", "nvme_path": nvme_dir}}}
    err = _error(Config.from_deepspeed, ds)
    assert "zero_optimization.offload_param.devcie" in err.keys
    assert "did you mean 'zero_optimization.offload_param.device'?" in str(err)
    assert "remove it" not in dict(err.problems)["zero_optimization.offload_param.devcie"]
    del ds["zero_optimization"]["offload_param"]["devcie"]  # the old advice, followed: no tier, a path
    err = _error(Config.from_deepspeed, ds)
    assert err.keys == ["zero_optimization.offload_param.device"]
    assert "nothing would be offloaded" in str(err) and "set device to nvme" in str(err)


@pytest.mark.parametrize("section", ["offload_param", "offload_optimizer"])
def test_nvme_path_without_a_tier_is_refused(section, nvme_dir):
    err = _error(Config.from_dict, {"zero": {"stage": 3, section: {"nvme_path": nvme_dir}}})
    assert err.keys == [f"zero.{section}.device"] and "remove its nvme_path" in str(err)
    cpu = Config.from_dict({"zero": {"stage": 3, section: {"device": "cpu", "nvme_path": nvme_dir}}})
    assert getattr(cpu.zero, section).device == "cpu"  # DeepSpeed's templates keep a path beside cpu
    nvme = Config.from_dict({"zero": {"stage": 3, section: {"device": "nvme", "nvme_path": nvme_dir}}})
    moved = nvme.with_overrides({f"zero.{section}.device": "none"})  # e.g. --offload none on an NVMe config
    assert getattr(moved.zero, section).nvme_path is None


def test_an_explicit_none_beside_a_path_stands_and_is_warned_of_once(nvme_dir, infinity_logs):
    from infinity.config import validate

    validate._SAID_IDLE_PATH.discard("offload_param")
    data = {"zero": {"stage": 3, "offload_param": {"device": "none", "nvme_path": nvme_dir}}}
    assert Config.from_dict(data).zero.offload_param.device == "none"
    Config.from_dict(data)
    said = [r.getMessage() for r in infinity_logs.records if "beside nvme_path" in r.getMessage()]
    assert len(said) == 1 and "zero.offload_param.device is none" in said[0] and "set device to nvme" in said[0]


def test_from_dict_hints_at_deepspeed():
    err = _error(Config.from_dict, {"train_micro_batch_size_per_gpu": 4})
    assert "from_deepspeed" in str(err) and "'train.micro_batch_size'" in str(err)


# ------------------------------------------------------------------------------------------
# Reference table and examples


def test_reference_markdown_lists_every_key():
    table = Config.reference_markdown()
    paths = config_mod.all_key_paths()
    assert len(paths) >= 40
    for path in paths:
        assert f"| `{path}` |" in table
    assert "`unsupported`" not in table
    assert table.count("\n") == len(paths) + 2


def _example_files():
    return sorted(p for p in EXAMPLES.glob("*") if p.suffix in (".json", ".yaml", ".yml"))


def test_examples_exist():
    assert len(_example_files()) >= 3


@pytest.mark.parametrize("path", _example_files(), ids=lambda p: p.name)
def test_examples_load(path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = Config.from_file(path)
    assert cfg.unsupported == []
    assert Config.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("flags,expected", [({"avx2", "avx512_bf16"}, "bf16"), ({"avx2", "amx_bf16"}, "bf16"),
                                            ({"avx2", "avx512f"}, "fp32")])
def test_dtype_auto_follows_the_cpu_features_of_this_machine(monkeypatch, flags, expected):
    """precision.dtype auto: bf16 only where the CPU multiplies bf16 natively (read at run
    time from its flags), else fp32; resolved once, so the engine sees a concrete dtype."""
    import infinity._runtime._accelerator as acc

    monkeypatch.setattr(acc, "has_cuda", lambda: False)
    monkeypatch.setattr(acc, "_cpu_flags", lambda: flags)
    monkeypatch.delenv("INFINITY_CPU_ISA", raising=False)  # the flags above are the whole CPU
    assert infinity.Config.from_dict({"precision": {"dtype": "auto"}}).precision.dtype == expected


def test_dtype_auto_on_this_machine_matches_its_flags():
    import infinity._runtime._accelerator as acc

    fast, why = acc.native_bf16()
    assert infinity.Config.from_dict({"precision": {"dtype": "auto"}}).precision.dtype == ("bf16" if fast else "fp32")
    assert "bf16" in why

