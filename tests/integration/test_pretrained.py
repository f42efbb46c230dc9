"""from_pretrained under infinity.Init: Hugging Face's own loader, streamed per rank into the
tiers (Note [streamed load] in _pretrained.py), bit-identical to a plain from_pretrained; preflight refusals."""
import json
import os
import subprocess
import sys

import pytest
import torch
from test_aio_errors import mounted

import infinity
from infinity.errors import InsufficientResourcesError
from infinity.testing import run_ranks, write_checkpoint

TIERS = ("none", "cpu", "nvme")


def _config(kind):
    from transformers import GPT2Config, LlamaConfig

    if kind == "gpt2":  # tied input and output embeddings
        return GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                          eos_token_id=0)
    return LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=0,
                       eos_token_id=0)


def _save(kind, directory, dtype=torch.float32, shard=None):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(kind)).to(dtype)
    model.save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
    return directory


def _tensor_bytes(directory):
    from infinity._zero._pretrained import read_header

    files = [os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".safetensors")]
    return sum(s.numel * s.dtype.itemsize for f in files for s in read_header(f).values())


def _load_and_compare(directory, offload, nvme, dtype):
    """Runs on each rank: load under Init, gather, compare with a plain from_pretrained."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    with infinity.Init(offload=offload, nvme_path=nvme) as init:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    tied = getattr(model.config, "tie_word_embeddings", False)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    names = []
    with infinity.GatheredParameters(list(model.parameters())):
        for (name, p), (rname, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
            assert name == rname and p.dtype == q.dtype and torch.equal(p, q), name
            names.append(name)
    return init.reader.bytes_read, names


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("offload", TIERS)
def test_weights_bit_identical_to_plain_from_pretrained(tmp_path, kind, offload):
    directory = _save(kind, str(tmp_path / "ckpt"))
    read, names = _load_and_compare(directory, offload, str(tmp_path / "swap"), None)
    assert read == _tensor_bytes(directory)  # one rank reads each tensor once
    assert len(names) > 10


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_log_counts_each_loaded_parameter_once(tmp_path, infinity_logs, kind):
    """Parameters built on the meta device and then given the checkpoint's values are one parameter
    each in Init's count (tied ones once), as many as the plain model has."""
    from transformers import AutoModelForCausalLM

    directory = _save(kind, str(tmp_path / "ckpt"))
    with infinity.Init(offload="cpu"):
        model = AutoModelForCausalLM.from_pretrained(directory)
    n = len(list(model.parameters()))
    counts = [r.getMessage() for r in infinity_logs.records if "parameters partitioned over" in r.getMessage()]
    assert counts == [f"Init: {n} parameters partitioned over 1 rank(s) on tier cpu"]


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_two_ranks_each_read_their_own_shards(tmp_path, offload):
    directory = _save("llama", str(tmp_path / "ckpt"), shard="20KB")
    assert os.path.exists(os.path.join(directory, "model.safetensors.index.json"))
    results = run_ranks(_load_and_compare, 2, directory, offload, str(tmp_path / "swap"), None)
    total = _tensor_bytes(directory)
    reads = [r[0] for r in results]
    assert sum(reads) == total  # every byte read once, by the rank that keeps it
    assert all(r <= total / 2 + 64 * 4 for r in reads), reads


@pytest.mark.parametrize("stored,wanted", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                           (torch.float32, torch.bfloat16), (torch.bfloat16, None)])
def test_any_file_dtype_into_any_parameter_dtype(tmp_path, stored, wanted):
    directory = _save("gpt2", str(tmp_path / "ckpt"), dtype=stored)
    _load_and_compare(directory, "nvme", str(tmp_path / "swap"), wanted)


def _first_losses(directory, nvme, steps):
    from transformers import AutoModelForCausalLM

    cfg = {"zero": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                    "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
           "optimizer": {"lr": 1e-3}, "gradient_clipping": 0.0}
    with infinity.Init(config=cfg):
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model, opt = infinity.initialize(model, cfg)
    ids = torch.arange(24).view(2, 12) % 96
    out = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    opt.engine.close()
    return out


def test_loaded_model_trains_from_the_pretrained_loss(tmp_path):
    from transformers import AutoModelForCausalLM

    directory = _save("llama", str(tmp_path / "ckpt"))
    plain = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    ids = torch.arange(24).view(2, 12) % 96
    expected = plain(input_ids=ids, labels=ids).loss.item()
    losses = _first_losses(directory, str(tmp_path / "swap"), 2)
    assert losses[0] == pytest.approx(expected, rel=1e-6)
    assert losses[1] < losses[0]
    assert not (tmp_path / "swap").exists()  # made by Init, gone with the run's last swap directory


def _big_llama(hidden, layers, vocab=320):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                       num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, tie_word_embeddings=False,
                       max_position_embeddings=256)


_RSS_SCRIPT = """
import json, sys
import torch
from transformers import AutoModelForCausalLM
import infinity
from infinity._offload._preflight import plan
from infinity.testing import peak_rss, reset_peak_rss, rss_now
torch.set_num_threads(2)
base = rss_now()
reset_peak_rss()
nvme = sys.argv[2]
cfg = {"zero": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}}
with infinity.Init(config=cfg) as init:
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
loaded_peak = peak_rss()
model, opt = infinity.initialize(model, cfg)
print(json.dumps({"base": base, "loaded_peak": loaded_peak, "peak": peak_rss(), "read": init.reader.bytes_read,
                  "host_plan": plan(opt.placement, opt.cfg)["host"]}))
opt.engine.close()
"""


def test_load_of_a_1gb_model_on_nvme_keeps_host_memory_bounded(tmp_path):
    """~250M parameters (1 GB in fp32) loaded and initialized with everything on NVMe: the
    host holds the engine's planned buffers and a few chunks at a time, never the model."""
    cfg = _big_llama(1024, 15)
    info = write_checkpoint(cfg, str(tmp_path / "ckpt"), torch.float32, shard_bytes=400 << 20)
    largest = 4 * 1024 * 4096 * 4  # the MLP matrices
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(tmp_path / "ckpt"), str(tmp_path / "swap")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    # initialize reads each chunk from the checkpoint once, for the fp32 master weights: in fp32 they
    # are the compute-dtype shards too (Note [parameters from the master] in _placement.py; other dtypes
    # read it again for the shard: Note [shards left in the checkpoint] in _init_context.py); nothing else reads it.
    assert info["bytes"] > 0.95e9 and r["read"] == info["bytes"]
    # Stated bound: the loader's fixed overhead (256 MiB), plus a few copies of the largest tensor
    # (read buffer, cast, shard), plus what the preflight planned for host memory - not the model.
    assert r["loaded_peak"] - r["base"] < (256 << 20) + 3 * largest
    grown = r["peak"] - r["base"]
    bound = (256 << 20) + 3 * largest + r["host_plan"]
    assert grown < bound, (f"RSS grew {grown / 2**20:.0f} MiB (bound {bound / 2**20:.0f} MiB) "
                           f"for a {info['bytes'] / 2**30:.2f} GiB model")


def _sparse_checkpoint(tmp_path, params_b):
    """A Llama checkpoint of about ``params_b`` billion fp32 parameters whose file is all holes."""
    hidden = 4096
    layers = max(1, round(params_b * 1e9 / (12 * hidden * hidden)))
    directory = str(tmp_path / "big")
    info = write_checkpoint(_big_llama(hidden, layers), directory, torch.float32, shard_bytes=8 << 30, fill="sparse")
    return directory, info


def test_host_memory_preflight_refuses_before_reading(tmp_path):
    import psutil
    from transformers import AutoModelForCausalLM

    avail = psutil.virtual_memory().available
    directory, info = _sparse_checkpoint(tmp_path, avail / 4 / 1e9 * 1.3)  # more fp32 bytes than available
    assert info["bytes"] > avail
    with pytest.raises(InsufficientResourcesError, match=r"host memory.*Init\(offload='nvme'") as err:
        with infinity.Init(offload="cpu") as init:
            AutoModelForCausalLM.from_pretrained(directory)
    assert init.reader.bytes_read == 0 and "loading the checkpoint" in str(err.value)
    assert "in bfloat16 they need half" in str(err.value)  # the checkpoint is float32: say how to store half


def test_disk_preflight_refuses_before_writing(tmp_path):
    """On NVMe the loaded chunks stay in the checkpoint until initialize, whose preflight refuses
    a disk too small for the swap files before writing any."""
    from transformers import AutoModelForCausalLM

    directory = _save("llama", str(tmp_path / "ckpt"))
    with mounted("tmpfs", tmp_path / "small", "size=64k") as small:
        cfg = {"zero": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(small)},
                        "offload_optimizer": {"device": "nvme", "nvme_path": str(small)}}}
        with infinity.Init(config=cfg):
            model = AutoModelForCausalLM.from_pretrained(directory)
        with pytest.raises(InsufficientResourcesError, match="disk under"):
            infinity.initialize(model, cfg)
        assert sum(f.stat().st_size for f in small.rglob("*.swp")) == 0


def test_a_checkpoint_changed_before_initialize_is_refused_by_name(tmp_path):
    from transformers import AutoModelForCausalLM

    directory = _save("llama", str(tmp_path / "ckpt"))
    with infinity.Init(offload="nvme", nvme_path=str(tmp_path / "swap")):
        model = AutoModelForCausalLM.from_pretrained(directory)
    _save("llama", directory)  # overwritten in place
    with pytest.raises(OSError, match=r"model\.safetensors changed after it was loaded"):
        infinity.initialize(model, {"zero": {"stage": 3, "offload_param": {"device": "nvme",
                                                                             "nvme_path": str(tmp_path / "swap")}}})


def test_eager_build_on_a_small_disk_is_refused_with_the_parameter(tmp_path):
    """Without from_pretrained (no meta build) each chunk is checked before it is written."""
    from torch import nn

    with mounted("tmpfs", tmp_path / "small", "size=1m") as small:
        with pytest.raises(InsufficientResourcesError, match=r"parameter Linear\.weight.*disk under") as err:
            with infinity.Init(offload="nvme", nvme_path=str(small)):
                nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])  # 2 MiB of fp32
        assert "point nvme_path at a larger disk" in str(err.value)


def test_a_refusal_for_the_disk_leaves_no_directory_behind(tmp_path):
    """nvme_path is made by the first chunk written, not before the room is checked."""
    from torch import nn

    with mounted("tmpfs", tmp_path / "small", "size=64k") as small:
        with pytest.raises(InsufficientResourcesError, match="disk under"):
            with infinity.Init(offload="nvme", nvme_path=str(small / "swap")):
                nn.Linear(256, 256)  # 257 KiB of fp32
        assert not (small / "swap").exists()


def test_initialize_refused_after_init_names_inits_shards_and_leaves_no_directory(tmp_path):
    """The quick start's flow on a disk too small for the states: Init made nvme_path and holds its
    shards there; initialize's refusal says they are this process's (not another run's), and once
    the model is gone nothing of either is left, nvme_path included."""
    import gc

    from torch import nn

    with mounted("tmpfs", tmp_path / "small", "size=1m") as small:
        path = small / "swap"
        cfg = {"zero": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(path)},
                        "offload_optimizer": {"device": "nvme", "nvme_path": str(path)}}, "precision": {"dtype": "fp32"}}
        with infinity.Init(offload="nvme", nvme_path=str(path)):
            model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))  # 514 KiB of fp32 shards
        assert any(path.rglob("init.swp"))
        with pytest.raises(InsufficientResourcesError, match="disk under") as err:
            infinity.initialize(model, config=cfg)
        assert "this process's own" in str(err.value) and "other run director" not in str(err.value)
        del model, err
        gc.collect()
        assert not path.exists()


def test_a_parameter_missing_from_the_checkpoint_is_initialized_like_plain(tmp_path):
    """Keys absent from the file are initialized by Hugging Face's own _init_weights, as without Init."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    directory = _save("llama", str(tmp_path / "ckpt"))
    path = os.path.join(directory, "model.safetensors")
    state = load_file(path)
    del state["lm_head.weight"]
    save_file(state, path, metadata={"format": "pt"})
    with infinity.Init(offload="cpu"):
        model = AutoModelForCausalLM.from_pretrained(directory)
    with infinity.GatheredParameters([model.lm_head.weight, model.model.layers[0].mlp.up_proj.weight]):
        assert 0.01 < model.lm_head.weight.std().item() < 0.03  # initializer_range 0.02, not zeros or garbage
        assert torch.equal(model.model.layers[0].mlp.up_proj.weight, state["model.layers.0.mlp.up_proj.weight"])


def test_train_cli_streams_a_model_directory_and_starts_from_its_loss(tmp_path):
    """``python -m infinity.train --model DIR``: built under Init, each chunk read from the files;
    the first step's loss is the pretrained model's loss on the same batch, evaluated plainly."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from infinity.train import Batches, ByteTokenizer, _loss, read_texts, token_windows

    cfg = GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    directory = str(tmp_path / "ckpt")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(directory)
    data = tmp_path / "data.txt"
    data.write_text("hello world, this is a tiny corpus for a tiny model. " * 40)
    config = tmp_path / "run.json"
    nvme = str(tmp_path / "swap")
    config.write_text(json.dumps({"zero": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                                           "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
                                  "precision": {"dtype": "fp32"},
                                  "train": {"seq_len": 16, "micro_batch_size": 2, "save": False}}))
    out = subprocess.run(
        [sys.executable, "-m", "infinity.train", "--config", str(config), "--model", directory, "--data", str(data),
         "--steps", "2", "--output-dir", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "streamed from the files into nvme partitions" in out.stdout + out.stderr
    steps = [json.loads(line) for line in open(tmp_path / "out" / "telemetry.jsonl")]
    first = [r for r in steps if r.get("event") == "step"][0]["loss"]
    windows = token_windows(read_texts(str(data)), ByteTokenizer(), 16)
    inputs, targets = next(iter(Batches(windows, 2, 1, 1, 0, 1234).step(0)))
    plain = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).train()
    with torch.no_grad():
        assert first == pytest.approx(_loss(plain, inputs, targets).item(), rel=1e-6)


def test_train_cli_refuses_a_model_that_does_not_fit_before_reading_it(tmp_path):
    """A checkpoint bigger than the disk under nvme_path: exit 2 with the numbers, nothing read or written."""
    directory, info = _sparse_checkpoint(tmp_path, 0.5)
    with mounted("tmpfs", tmp_path / "small", "size=64m") as small:
        out = subprocess.run(
            [sys.executable, "-m", "infinity.train", "--model", directory, "--steps", "1", "--nvme-path", str(small),
             "--no-save"], capture_output=True, text=True, timeout=300)
        assert out.returncode == 2, out.stderr[-3000:]
        assert "disk under" in out.stderr and "does not fit" in out.stderr
        assert sum(f.stat().st_size for f in small.rglob("*.swp")) == 0


def test_meta_parameter_never_loaded_is_refused_by_initialize(tmp_path):
    from torch import nn

    with infinity.Init(offload="cpu"):
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="never given values"):
        infinity.initialize(model, {"zero": {"stage": 3}})




def test_load_state_dict_under_init_keeps_the_values(tmp_path):
    from transformers import AutoModelForCausalLM

    directory = _save("gpt2", str(tmp_path / "ckpt"))
    ref = AutoModelForCausalLM.from_pretrained(directory)
    with infinity.Init(offload="nvme", nvme_path=str(tmp_path / "swap")):
        model = AutoModelForCausalLM.from_config(_config("gpt2"))
    model.load_state_dict(ref.state_dict())
    with infinity.GatheredParameters(list(model.parameters())):
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q), name
