"""A checkpoint is data, never code (Note [data, never code] in infinity/_checkpoint/_files.py).

Every kind of file a checkpoint holds, replaced by a pickle whose unpickling would create a
marker file, with the manifest's size and CRC-32 updated to match (what anyone who can write
the directory can do), is refused by ``load_checkpoint``, by ``infinity.export`` and by
``verify_checkpoint``, naming the file, and the marker never appears: nothing on those paths
unpickles. A checkpoint in the format of versions 1 and 2 (``extra.pt`` and ``rng.pt``
pickles, written here as that code wrote them) is refused by all three with the remedy, loads
bit for bit with ``trust_pickle=True`` and, converted once, loads without it. ``from_pretrained``
of a pickled ``.bin`` under ``infinity.Init`` goes through transformers' ``weights_only`` load
and runs nothing either.
"""
import json
import os
import pickle
import random
import shutil
import zlib

import pytest
import torch
from _configs import zero_config
from _models import build
from safetensors.torch import load_file
from test_checkpoint import KIND, N, _first_half, _second_half, client_state, same
from test_checkpoint import _cfg as ck_cfg

import infinity
from infinity._checkpoint._files import parse_tensors, rng_states
from infinity.errors import InfinityError, StorageError, UsageError
from infinity.export import export_checkpoint
from infinity.export import main as export_main
from infinity.testing import run_ranks, verify_checkpoint

HF_KIND = "gpt2"  # a Hugging Face model: its checkpoint has hf/config.json too
COMBO = (3, "nvme", "cpu")


class _Payload:
    """Unpickled, it creates ``marker``: what a hostile pickle would do instead of anything worse."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def payload(marker) -> bytes:
    return pickle.dumps(_Payload(str(marker)))


def _cfg(nvme):
    return zero_config(COMBO[0], param=COMBO[1], optim=COMBO[2], nvme=nvme, lr=1e-2)


def _weights(model):
    with infinity.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _save_hf(tmp, out):
    import _hf_models

    model, opt = infinity.initialize(_hf_models.build(HF_KIND), _cfg(f"{tmp}/nvme"))
    for ids, targets in _hf_models.batches(HF_KIND, 2):
        _hf_models.loss_of(model, HF_KIND, ids, targets).backward()
        opt.step()
        opt.zero_grad()
    infinity.save_checkpoint(out, model, opt, client_state=client_state(2))
    opt.engine.close()


def _load_each(tmp, sources):
    """Per source: (the load's error or None, whether the model kept its weights)."""
    import _hf_models

    model, opt = infinity.initialize(_hf_models.build(HF_KIND, seed=5), _cfg(f"{tmp}/nvme"))
    before, out = _weights(model), []
    for src in sources:
        try:
            infinity.load_checkpoint(src, model, opt)
            out.append((None, None))
        except InfinityError as e:
            after = _weights(model)
            out.append((str(e), all(torch.equal(before[n], after[n]) for n in before)))
    opt.engine.close()
    return out


@pytest.fixture(scope="module")
def saved_hf(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("saved")
    run_ranks(_save_hf, 2, str(tmp), str(tmp / "ck"), timeout=180)
    return tmp / "ck"


def _tampered(saved, dst, rel, marker):
    """A copy of the run directory ``saved`` with ``rel`` (in its checkpoint, or ``latest``)
    replaced by the payload and, for a file the manifest lists, the manifest updated to match."""
    shutil.copytree(saved, dst)
    tag = (dst / "latest").read_text().strip()
    data = payload(marker)
    if rel == "latest":
        (dst / "latest").write_bytes(data)
        return dst, dst / "latest"
    path = dst / tag / rel
    path.write_bytes(data)
    if rel != "manifest.json":
        manifest = json.loads((dst / tag / "manifest.json").read_text())
        manifest["files"][rel] = {"bytes": len(data), "crc32": zlib.crc32(data)}
        (dst / tag / "manifest.json").write_text(json.dumps(manifest))
    return dst, path


def test_the_payload_runs_when_unpickled(tmp_path):
    marker = tmp_path / "ran"
    pickle.loads(payload(marker)).close()  # the control: the marker shows a payload that ran
    assert marker.exists()


def test_every_tampered_file_kind_is_refused_and_runs_nothing(tmp_path, saved_hf):
    tag = (saved_hf / "latest").read_text().strip()
    rels = sorted(json.loads((saved_hf / tag / "manifest.json").read_text())["files"]) + ["manifest.json", "latest"]
    assert {"client_state.json", "client_state.safetensors", "buffers.safetensors", "rank0/rng.safetensors",
            "rank1/params.bin", "rank1/master.bin", "rank0/exp_avg.bin", "rank0/exp_avg_sq.bin",
            "hf/config.json"} <= set(rels)
    marker = tmp_path / "ran"
    copies = [_tampered(saved_hf, tmp_path / f"ck{i}", rel, marker) for i, rel in enumerate(rels)]
    loads = run_ranks(_load_each, 2, str(tmp_path), [str(run) for run, _ in copies], timeout=300)[0]
    for rel, (run, path), (error, untouched) in zip(rels, copies, loads):
        named = "latest" if rel == "latest" else str(path)
        assert error is not None and named in error, (rel, error)
        assert untouched, rel  # refused before any state changed
        with pytest.raises(InfinityError, match=named):
            export_checkpoint(str(run), str(tmp_path / "out"))
        assert export_main([str(run), str(tmp_path / "out")]) == 2
        if rel != "latest":  # verify takes a checkpoint directory
            with pytest.raises(StorageError, match=named):
                verify_checkpoint(str(run / tag))
    assert not marker.exists()


# ---------------------------------------------------------------------------------------- versions 1 and 2


def _old_format(path):
    """Rewrite the checkpoint at ``path`` as the code of versions 1 and 2 wrote it: the client
    state and buffers in one pickle, extra.pt; each rank's RNG states in rank<r>/rng.pt."""
    manifest = json.loads((path / "manifest.json").read_text())
    files = manifest["files"]
    extra = {"extra": client_state(N), "buffers": load_file(str(path / "buffers.safetensors"))}
    news = {"extra.pt": extra}
    for r in range(manifest["world_size"]):
        rel = f"rank{r}/rng.safetensors"
        states = rng_states(*parse_tensors((path / rel).read_bytes(), rel), rel)
        news[f"rank{r}/rng.pt"] = states
    for rel in ("client_state.json", "client_state.safetensors", "buffers.safetensors") + tuple(
            f"rank{r}/rng.safetensors" for r in range(manifest["world_size"])):
        os.remove(path / rel)
        del files[rel]
    for rel, obj in news.items():
        torch.save(obj, path / rel)
        data = (path / rel).read_bytes()
        files[rel] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    (path / "manifest.json").write_text(json.dumps(dict(manifest, version=1, files=dict(sorted(files.items())))))


def _load_old(tmp, combo, src, trust):
    model, opt = infinity.initialize(build(KIND, seed=3), ck_cfg(*combo, f"{tmp}/nvme"))
    try:
        infinity.load_checkpoint(src, model, opt, trust_pickle=trust)
    except UsageError as e:
        return str(e)
    finally:
        opt.engine.close()
    return None


def test_old_format_loads_with_trust_pickle_and_is_refused_without(tmp_path):
    combos = [(3, "nvme", "nvme")]
    refs = run_ranks(_first_half, 1, str(tmp_path), combos, timeout=180)[0]
    ck = tmp_path / "ck0"
    path = ck / (ck / "latest").read_text().strip()
    _old_format(path)
    assert sorted(os.listdir(path / "rank0")) == ["exp_avg.bin", "exp_avg_sq.bin", "master.bin", "params.bin",
                                                  "rng.pt"]
    error = run_ranks(_load_old, 1, str(tmp_path), combos[0], str(ck), False, timeout=120)[0]
    assert "format version 1, which holds pickles" in error and "--convert-old" in error and "trust_pickle=True" in error
    for call in (lambda: verify_checkpoint(str(path)), lambda: export_checkpoint(str(ck), str(tmp_path / "hf"))):
        with pytest.raises(UsageError, match="trust_pickle=True"):
            call()
    assert verify_checkpoint(str(path), trust_pickle=True)["version"] == 1
    assert export_main([str(ck), str(tmp_path / "hf"), "--trust-pickle"]) == 0

    pristine = tmp_path / "pristine"
    shutil.copytree(ck, pristine)
    trusted = _resumed(tmp_path, combos, trust=True)  # bit for bit, as the checkpoint was saved
    _check_resume(refs, trusted, combos)

    assert export_main([str(ck), "--convert-old"]) == 2  # converting reads the pickles: --trust-pickle
    assert export_main([str(ck), "--convert-old", "--trust-pickle"]) == 0
    assert not (path / "extra.pt").exists() and not (path / "rank0" / "rng.pt").exists()
    assert verify_checkpoint(str(path))["version"] == 3
    _check_resume(refs, _resumed(tmp_path, combos, trust=False), combos)  # converted: no opt-in, same states
    assert export_main([str(ck), "--convert-old", "--trust-pickle"]) == 0  # nothing left to convert

    marker = tmp_path / "ran"  # an old checkpoint's pickle is not read without the opt-in
    (pristine / path.name / "extra.pt").write_bytes(payload(marker))
    manifest = json.loads((pristine / path.name / "manifest.json").read_text())
    manifest["files"]["extra.pt"] = {"bytes": len(payload(marker)), "crc32": zlib.crc32(payload(marker))}
    (pristine / path.name / "manifest.json").write_text(json.dumps(manifest))
    error = run_ranks(_load_old, 1, str(tmp_path), combos[0], str(pristine), False, timeout=120)[0]
    assert "trust_pickle=True" in error
    assert export_main([str(pristine), str(tmp_path / "hf2")]) == 2
    with pytest.raises(UsageError):
        verify_checkpoint(str(pristine / path.name))
    assert not marker.exists()


def _resumed(tmp_path, combos, trust):
    return run_ranks(_second_half, 1, str(tmp_path), combos, 7, trust, timeout=180)[0]


def _check_resume(refs, resumed, combos):
    for combo in combos:
        (ref_losses, ref_params), (losses, params, extra) = refs[combo], resumed[combo]
        assert same(extra, client_state(N)), extra
        assert ref_losses[N:] == losses, combo
        for name, p in ref_params.items():
            assert torch.equal(p, params[name]), (combo, name)


# ---------------------------------------------------------------------------------------- from_pretrained


def _pretrained_bin(directory, nvme):
    from transformers import AutoModelForCausalLM

    with infinity.Init(config=zero_config(3, param="cpu", optim="cpu", nvme=nvme)):
        try:
            AutoModelForCausalLM.from_pretrained(directory)
        except Exception as e:  # noqa: BLE001 - whatever transformers raises, the payload must not have run
            return f"{type(e).__name__}: {e}"
    return None


def test_from_pretrained_of_a_pickled_bin_under_init_runs_nothing(tmp_path):
    import _hf_models

    directory = tmp_path / "model"
    _hf_models.build(HF_KIND).config.save_pretrained(directory)
    marker = tmp_path / "ran"
    (directory / "pytorch_model.bin").write_bytes(payload(marker))
    error = run_ranks(_pretrained_bin, 1, str(directory), str(tmp_path / "nvme"), timeout=120)[0]
    assert error is not None and "weights_only" in error, error  # transformers' safe torch.load refused it
    assert not marker.exists()


def test_random_state_round_trips_exactly():
    """The RNG file holds every generator's state as data: restoring it continues each stream."""
    from infinity._checkpoint._files import current_rng, rng_bytes, set_rng

    random.seed(3)
    torch.manual_seed(3)
    import numpy as np

    np.random.seed(3)
    random.gauss(0, 1)  # python's cached gaussian is part of the state
    data = rng_bytes(current_rng())
    want = (random.random(), random.gauss(0, 1), torch.rand(3), np.random.rand(2))
    set_rng(rng_states(*parse_tensors(data, "rng"), "rng"))
    got = (random.random(), random.gauss(0, 1), torch.rand(3), np.random.rand(2))
    assert want[:2] == got[:2] and torch.equal(want[2], got[2]) and (want[3] == got[3]).all()
