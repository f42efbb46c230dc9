"""The optimizer store's host cache (Note [host cache] in infinity/_offload/_nvme_optimizer_store.py).

With the optimizer states on NVMe, the first chunks of the flat space (by default the first
fetch unit's range) keep their master weights and moments in host memory as a write-through
cache, and their gradient shards in memory only. Training must not notice: every cache size,
with gradient accumulation, clipping, an edit through GatheredParameters and two ranks, gives
the no-offload result; the swap files stay complete; the cached gradients never reach the disk.
The same holds with every gradient shard in host memory (Note [gradients in host memory] in _nvme_optimizer_store.py):
then no gradient touches the disk at all.
"""
import pytest
import torch
from _configs import zero_config
from _models import batches, build, loss_of, train_accumulated, train_losses

import infinity
from infinity._offload._preflight import plan
from infinity.testing import run_ranks

STEPS = 3
CACHES = {"off": 0, "auto": None, "all": 10**9}


def _config(nvme, stage=3, host_cache=None, accumulation=1, gradients="nvme"):
    return zero_config(stage, param="nvme" if stage == 3 and nvme else None, optim="nvme" if nvme else "none",
                       nvme=nvme, chunk=2048, bucket=3000, clip=0.5, accumulation=accumulation,
                       optim_extra={"host_cache": host_cache, "gradients": gradients})


def _edit_and_train(kind, cfg):
    """Train, scale the (cached) embedding through GatheredParameters, train on, read it back."""
    model, opt = infinity.initialize(build(kind), cfg)
    losses = train_losses(model, opt, kind, STEPS)
    emb = model.transformer.wte.weight if kind == "gpt2" else model.emb.weight
    with infinity.GatheredParameters([emb], modifier_rank=0):
        emb.data.mul_(0.5)
    losses += train_losses(model, opt, kind, STEPS)
    with infinity.GatheredParameters(list(model.parameters())):
        params = [p.detach().clone() for p in model.parameters()]
    head = getattr(opt.store, "head", None)
    opt.engine.close()
    return losses, params, head


def _all_caches(nvme):
    out = {}
    for kind in ("gpt2", "custom"):
        out[(kind, "base")] = _edit_and_train(kind, _config(None))
        for name, cache in CACHES.items():
            out[(kind, name)] = _edit_and_train(kind, _config(nvme, host_cache=cache))
        out[(kind, "stage2")] = _edit_and_train(kind, _config(nvme, stage=2))
        out[(kind, "grads_in_memory")] = _edit_and_train(kind, _config(nvme, gradients="cpu"))
        out[(kind, "grads_in_memory_stage2")] = _edit_and_train(kind, _config(nvme, stage=2, gradients="cpu"))
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"world{w}")
def trained(request, tmp_path_factory):
    nvme = str(tmp_path_factory.mktemp(f"cache{request.param}"))
    return run_ranks(_all_caches, request.param, nvme, timeout=600)[0]


@pytest.mark.parametrize("kind", ["gpt2", "custom"])
@pytest.mark.parametrize("cache", list(CACHES) + ["stage2", "grads_in_memory", "grads_in_memory_stage2"])
def test_every_cache_size_matches_no_offload(trained, kind, cache):
    """Losses match training without offload; the weights match the uncached store's.

    The weights are compared with the uncached store rather than with the in-memory optimizer:
    the two Adam kernels differ in the last bits, and Adam turns that into ~1e-6 steps on weights
    whose gradient is near zero. The cache must not add even that.
    """
    base_losses, _, _ = trained[(kind, "base")]
    _, ref_params, _ = trained[(kind, "off")]
    losses, params, head = trained[(kind, cache)]
    if cache == "off":
        assert head == 0
    else:
        assert head > 0, "the cache was empty: the test lost its point"
    assert losses == pytest.approx(base_losses, rel=1e-5, abs=1e-6)
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_accumulation_with_the_cache_matches_the_uncached_store(tmp_path):
    """Later micro-batches add to the cached gradients in memory and to the rest on disk (or,
    with the gradients in host memory, to the rest in memory)."""
    results = []
    for cache, gradients in ((0, "nvme"), (None, "nvme"), (None, "cpu"), (0, "cpu")):
        model, opt = infinity.initialize(build("gpt2"), _config(str(tmp_path), host_cache=cache, accumulation=2,
                                                                gradients=gradients))
        assert (opt.store.head == 0) if cache == 0 else (0 < opt.store.head < opt.store.total)
        assert (opt.store.grad_mem is not None) == (gradients == "cpu")
        results.append(train_accumulated(model, opt, "gpt2"))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_files_stay_complete_and_cached_grads_stay_off_disk(tmp_path):
    model, opt = infinity.initialize(build("gpt2"), _config(str(tmp_path)))
    store = opt.store
    assert 0 < store.head < store.total
    unit_elems = sum(u.shard_numel for u in opt.engine.units)
    cached_elems = sum(max(0, min(u.opt_offset + u.shard_numel, store.head) - u.opt_offset)
                       for u in opt.engine.units)
    for ids in batches(2):
        before = store.files.io["grad"][1]
        loss_of(model, "gpt2", ids).backward()
        opt.step()
        opt.zero_grad()
        assert store.files.io["grad"][1] - before == 4 * (unit_elems - cached_elems)  # only the uncached shards
    opt.wait_step()
    on_disk = store.read_master(0, store.head)  # from the file, after the write-through landed
    cached = torch.cat([s["master"] for s in store.head_sets])[: store.head]
    assert torch.equal(on_disk, cached)
    opt.engine.close()


def test_gradients_in_host_memory_never_touch_the_disk(tmp_path):
    """gradients: cpu: no gradient swap file, no gradient byte read or written; the preflight
    and the store count the host tensor instead of the file; auto picks it for a small model."""
    model, opt = infinity.initialize(build("gpt2"), _config(str(tmp_path), gradients="cpu"))
    store = opt.store
    assert store.grad_mem is not None and store.grad_mem.numel() == store.total  # the host cache holds none of its own
    assert "grad" not in store.paths and not list(tmp_path.rglob("grad.swp"))
    train_losses(model, opt, "gpt2", 2)
    opt.wait_step()
    assert store.files.io["grad"] == [0, 0]
    need = plan(opt.placement, opt.cfg)
    # fp32: the parameters are master.swp (Note [parameters from the master] in _placement.py): no file of their own
    assert store.nbytes()["nvme"] == 12 * store.total == sum(need["nvme"].values())
    assert store.nbytes()["host"] == (store.SETS * store.chunk + store.head) * 16 + 4 * (store.total - store.head)
    opt.engine.close()
    model, opt = infinity.initialize(build("gpt2"), _config(str(tmp_path), gradients="auto"))
    assert opt.store.grad_mem is not None  # a few MB: far below a quarter of host memory
    opt.engine.close()


def test_preflight_counts_the_cache(tmp_path):
    sizes = {}
    for name, cache in CACHES.items():
        model, opt = infinity.initialize(build("gpt2"), _config(str(tmp_path), host_cache=cache))
        sizes[name] = plan(opt.placement, opt.cfg)["host"]
        assert opt.store.nbytes()["host"] == (opt.store.SETS * opt.store.chunk + opt.store.head) * 16
        opt.engine.close()
    assert sizes["off"] < sizes["auto"] < sizes["all"]
