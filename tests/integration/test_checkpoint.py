"""Checkpoints: resume exactly, at another world size and placement, and never half-written.

Each phase runs in fresh gloo rank processes (``run_ranks``), so a resume is always a new
process. One rank in fp32 resumes bit for bit (losses and weights) against an uninterrupted
run; two ranks within 1e-6; over stage x tier; the client state, nested data and tensors,
comes back as it was saved (Note [data, never code] in _checkpoint/_files.py). Resharding is checked state by state: a
checkpoint saved at one world size / placement, loaded at another and saved again holds the
same bytes for every parameter's weights, master weights, moments and step count.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from _configs import zero_config
from _models import batches, build, loss_of, rank_losses

import infinity
from infinity._checkpoint import CheckpointReader
from infinity.errors import StorageError, UsageError
from infinity.testing import run_ranks

N = 3  # steps before and after the save
KIND = "custom"  # odd shapes no world size divides, a tied weight, a shared module
GRID = [(1, None, "none"), (1, None, "cpu"), (1, None, "nvme"), (2, None, "none"), (2, None, "nvme"),
        (3, "none", "none"), (3, "cpu", "cpu"), (3, "nvme", "nvme"), (3, "none", "nvme"), (3, "nvme", "cpu")]
ARRAYS = ("params", "master", "exp_avg", "exp_avg_sq")


def _cfg(stage, param, optim, nvme):
    return zero_config(stage, param=param, optim=optim, nvme=nvme, lr=2e-3, weight_decay=0.01, adam="adamw",
                       bucket=2000, chunk=4096)


def _train(model, opt, steps):
    return rank_losses(model, opt, steps, lambda m, ids: loss_of(m, KIND, ids))


def _params(model):
    with infinity.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def client_state(position):
    """Everything a client state may hold: JSON values, nested, tuples, int keys and tensors."""
    return {"data_position": position, "scheduler": {"last_epoch": position, "base_lrs": [2e-3, 1e-3], "_last_lr":
            [0.1 + 0.2, float("inf"), -0.0], "verbose": False, "name": "warmup", "lr_lambdas": [None]},
            "big": 2 ** 70, "pair": (1, "a", [None]), "by_step": {3: "three", 10: [1.5]},
            "tensors": [torch.arange(6, dtype=torch.float64).view(2, 3) / 7, {"mask": torch.tensor([True, False]),
                        "half": torch.full((3,), 1 / 3, dtype=torch.bfloat16), "empty": torch.zeros(0, 4)}]}


def same(a, b) -> bool:
    """``a`` and ``b`` hold the same values of the same types, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return repr(a) == repr(b) if isinstance(a, float) else a == b  # repr: -0.0, inf and nan as they are


def _run(combo, steps, nvme, *, seed=0, load=None, save=None, tag=None, trust_pickle=False):
    """Build, optionally load, train ``steps``, optionally save; losses and weights."""
    model, opt = infinity.initialize(build(KIND, seed=seed), _cfg(*combo, nvme))
    extra = infinity.load_checkpoint(load, model, opt, tag=tag, trust_pickle=trust_pickle) if load else None
    losses = _train(model, opt, steps)
    if save:
        infinity.save_checkpoint(save, model, opt, tag=tag, client_state=client_state(len(steps)))
    out = losses, _params(model), extra
    opt.engine.close()
    return out


def _first_half(tmp, combos):
    """Per combo: the uninterrupted 2N-step run, and N steps then a save."""
    steps = batches(2 * N)
    out = {}
    for i, combo in enumerate(combos):
        ref = _run(combo, steps, f"{tmp}/nvme")
        _run(combo, steps[:N], f"{tmp}/nvme", save=f"{tmp}/ck{i}")
        out[combo] = ref[:2]
    return out


def _second_half(tmp, combos, seed=7, trust_pickle=False):
    """Per combo, in new processes: a differently initialized model, load, N more steps."""
    steps = batches(2 * N)
    return {combo: _run(combo, steps[N:], f"{tmp}/nvme", seed=seed, load=f"{tmp}/ck{i}", trust_pickle=trust_pickle)
            for i, combo in enumerate(combos)}


@pytest.mark.parametrize("world", [1, 2], ids=lambda w: f"world{w}")
def test_resume_matches_uninterrupted_run(tmp_path, world):
    refs = run_ranks(_first_half, world, str(tmp_path), GRID, timeout=300)[0]
    resumed = run_ranks(_second_half, world, str(tmp_path), GRID, timeout=300)[0]
    for combo in GRID:
        (ref_losses, ref_params), (losses, params, extra) = refs[combo], resumed[combo]
        assert same(extra, client_state(N)), extra
        assert len(losses) == N
        if world == 1:  # bit for bit
            assert ref_losses[N:] == losses, combo
            for name, p in ref_params.items():
                assert torch.equal(p, params[name]), (combo, name)
        else:
            assert ref_losses[N:] == pytest.approx(losses, abs=1e-6, rel=0), combo
            for name, p in ref_params.items():
                torch.testing.assert_close(params[name], p, atol=1e-6, rtol=0, msg=lambda m: f"{combo} {name}: {m}")


# ---------------------------------------------------------------------------------------- reshard


def _save_at(tmp, combo, out):
    _run(combo, batches(N), f"{tmp}/nvme", save=out)


def _load_and_save(tmp, combo, src, out):
    """Load ``src`` at this world size and placement, save it again unchanged; the loaded weights."""
    model, opt = infinity.initialize(build(KIND, seed=11), _cfg(*combo, f"{tmp}/nvme"))
    infinity.load_checkpoint(src, model, opt)
    params = _params(model)
    infinity.save_checkpoint(out, model, opt)
    opt.engine.close()
    return params


def _states(path):
    """Every array of every parameter, whole, and its step count, read without a process group."""
    reader = CheckpointReader(os.path.join(path, open(os.path.join(path, "latest")).read().strip()))
    try:
        out = {}
        for name, p in reader.params.items():
            arrays = ARRAYS if p["trainable"] else ARRAYS[:1]
            out[name] = [reader.read(name, a) for a in arrays] + [p["step"]]
        return out, reader.manifest
    finally:
        reader.close()


@pytest.mark.parametrize("src_world,src_combo,dst_world,dst_combo", [
    (2, (3, "nvme", "nvme"), 1, (3, "cpu", "cpu")),
    (1, (3, "cpu", "cpu"), 2, (3, "nvme", "nvme")),
    (2, (2, None, "cpu"), 3, (3, "nvme", "none")),
], ids=["2to1-nvme-to-cpu", "1to2-cpu-to-nvme", "2to3-stage2-to-stage3"])
def test_reshard_keeps_every_state(tmp_path, src_world, src_combo, dst_world, dst_combo):
    run_ranks(_save_at, src_world, str(tmp_path), src_combo, str(tmp_path / "a"), timeout=180)
    loaded = run_ranks(_load_and_save, dst_world, str(tmp_path), dst_combo, str(tmp_path / "a"),
                       str(tmp_path / "b"), timeout=180)[0]
    before, m_before = _states(str(tmp_path / "a"))
    after, m_after = _states(str(tmp_path / "b"))
    assert (m_before["world_size"], m_after["world_size"]) == (src_world, dst_world)
    assert before.keys() == after.keys()
    for name in before:
        assert len(before[name]) == len(after[name])
        for x, y in zip(before[name], after[name]):
            assert torch.equal(torch.as_tensor(x), torch.as_tensor(y)), name
        assert torch.equal(loaded[name], before[name][0]), name
    assert m_after["step"] == m_before["step"] == N


# ---------------------------------------------------------------------------------------- integrity


def _load_each(tmp, combo, sources):
    """Per source: the load's error and whether the model kept its weights."""
    model, opt = infinity.initialize(build(KIND, seed=3), _cfg(*combo, f"{tmp}/nvme"))
    before, out = _params(model), []
    for src in sources:
        try:
            infinity.load_checkpoint(src, model, opt)
            out.append((None, None))
        except StorageError as e:
            after = _params(model)
            out.append((str(e), all(torch.equal(before[n], after[n]) for n in before)))
    opt.engine.close()
    return out


COMBO = (3, "nvme", "nvme")


@pytest.fixture(scope="module")
def saved_once(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("saved")
    run_ranks(_save_at, 2, str(tmp), COMBO, str(tmp / "ck"), timeout=180)
    return tmp / "ck" / f"step{N}"


def _copy(src, dst):
    import shutil

    shutil.copytree(src.parent, dst)
    return dst / src.name


FLIPPED = ["rank1/exp_avg_sq.bin", "rank0/params.bin", "client_state.json", "client_state.safetensors",
           "buffers.safetensors", "rank1/rng.safetensors"]
MISSING = "rank1/master.bin"


def test_flipped_byte_or_missing_shard_is_refused_naming_the_file(tmp_path, saved_once):
    victims, runs = [], []
    for i, rel in enumerate(FLIPPED + [MISSING]):
        runs.append(str(tmp_path / f"ck{i}"))
        path = _copy(saved_once, tmp_path / f"ck{i}") / rel
        if rel == MISSING:
            os.remove(path)
        else:
            with open(path, "r+b") as f:
                f.seek(os.path.getsize(path) // 2)
                b = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([b[0] ^ 0x10]))
        victims.append(path)
    results = run_ranks(_load_each, 2, str(tmp_path), COMBO, runs, timeout=180)[0]
    for path, (error, untouched) in zip(victims, results):
        assert error is not None and str(path) in error, (path, error)
        assert ("missing" if path.name == "master.bin" else "checksum") in error
        assert untouched  # nothing was loaded


def test_manifest_of_a_copied_save_is_version_3_and_a_newer_version_is_refused(tmp_path, saved_once):
    reader = CheckpointReader(saved_once)  # version 3: no pickle (Note [manifest versions] in _format.py)
    assert reader.manifest["version"] == 3
    assert all("crc32" in e and "crc32c" not in e for e in reader.manifest["files"].values())
    assert not [rel for rel in reader.manifest["files"] if rel.endswith(".pt")]
    reader.close()
    future = _copy(saved_once, tmp_path / "future")
    manifest = json.loads((future / "manifest.json").read_text())
    (future / "manifest.json").write_text(json.dumps(dict(manifest, version=99)))
    with pytest.raises(StorageError, match=r"format version 99; this infinity reads versions 1, 2, 3: upgrade infinity"):
        CheckpointReader(future)
    error = run_ranks(_load_each, 1, str(tmp_path), COMBO, [str(future.parent)], timeout=120)[0][0]
    assert "format version 99" in error[0] and "upgrade infinity" in error[0] and error[1]  # nothing loaded


def _save_twice(tmp, combo, out):
    model, opt = infinity.initialize(build(KIND), _cfg(*combo, f"{tmp}/nvme"))
    _train(model, opt, batches(1))
    infinity.save_checkpoint(out, model, opt, tag="a")
    errors = []
    try:
        infinity.save_checkpoint(out, model, opt, tag="a")
    except UsageError as e:
        errors.append(str(e))
    try:
        infinity.save_checkpoint(out, model, opt, tag="bad", client_state={"callback": lambda: 0})  # not data
    except UsageError as e:
        errors.append(str(e))
    try:
        infinity.save_checkpoint(out, model, opt, tag="bad", client_state={"ok": [1, {"obj": object()}]})
    except UsageError as e:
        errors.append(str(e))
    for tag in ("b", "c", "d"):
        _train(model, opt, batches(1))
        infinity.save_checkpoint(out, model, opt, tag=tag, keep_last=2)
    opt.engine.close()
    return errors


def test_refused_saves_leave_nothing_and_keep_last_prunes_after_commit(tmp_path):
    errors = run_ranks(_save_twice, 2, str(tmp_path), (3, "cpu", "nvme"), str(tmp_path / "ck"), timeout=180)[0]
    assert len(errors) == 3 and "already exists" in errors[0] and "pickle" in errors[1].lower()
    assert "client_state['callback'] is a function" in errors[1]
    assert "client_state['ok'][1]['obj'] is a builtins.object" in errors[2] and "state_dict()" in errors[2]
    assert sorted(os.listdir(tmp_path / "ck")) == ["c", "d", "latest"]
    assert (tmp_path / "ck" / "latest").read_text().strip() == "d"
    reader = CheckpointReader(tmp_path / "ck" / "d")
    reader.verify(reader.manifest["files"])
    assert reader.manifest["step"] == 4
    reader.close()


# ---------------------------------------------------------------------------------------- kill -9

KILL_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "checkpoint_kill_loop.py")


def test_kill_during_save_leaves_latest_complete(tmp_path):
    """Two trials of the script that runs >= 20: SIGKILL at a random moment of a loop of
    saves; ``latest`` always names a complete checkpoint, and it loads."""
    out = subprocess.run([sys.executable, KILL_SCRIPT, "--trials", "2", "--dir", str(tmp_path), "--seed", "1"],
                         capture_output=True, text=True, timeout=220)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2/2 trials" in out.stdout



# ---------------------------------------------------------------------------------------- export


def _train_hf_and_save(tmp, kind, dtype, out):
    import _hf_models

    model = _hf_models.build(kind)
    cfg = zero_config(3, param="nvme", optim="cpu", nvme=f"{tmp}/nvme", dtype=dtype, lr=1e-2)
    model, opt = infinity.initialize(model, cfg)
    for ids, targets in _hf_models.batches(kind, 2):
        _hf_models.loss_of(model, kind, ids, targets).backward()
        opt.step()
        opt.zero_grad()
    infinity.save_checkpoint(out, model, opt)
    weights = _params(model)
    opt.engine.close()
    return weights


@pytest.mark.parametrize("kind,dtype,shard_bytes", [("llama_frozen", "bf16", 50_000)])
def test_export_round_trips_into_transformers(tmp_path, kind, dtype, shard_bytes):
    from transformers import AutoModelForCausalLM

    from infinity.export import main as export_main

    trained = run_ranks(_train_hf_and_save, 2, str(tmp_path), kind, dtype, str(tmp_path / "ck"), timeout=180)[0]
    out = tmp_path / "hf"
    assert export_main([str(tmp_path / "ck"), str(out), "--max-shard-bytes", str(shard_bytes)]) == 0
    assert (out / "config.json").exists()
    assert (out / "model.safetensors.index.json").exists() == (shard_bytes < 10 ** 9)
    loaded = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True, dtype="auto")
    params = dict(loaded.named_parameters())
    assert trained.keys() == params.keys()
    for name, p in trained.items():
        assert params[name].dtype == p.dtype and torch.equal(params[name].detach(), p), name
