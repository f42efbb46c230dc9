"""The parts of the NVMe optimizer store, each built alone from small real parts (a swap
directory, the files, aio handles) and driven directly: the host cache's states and the
transitions that refuse the wrong one (Note [host cache] in _nvme_optimizer_store.py), the gradient shards
and how their norm is known, the swap pipeline's chunks and I/O (Note [optimizer swapper], [phased swap I/O]
in _nvme_optimizer_store.py), the checkpoint staging of compressed moments (Note [compressed moments on disk]
in _nvme_optimizer_store.py), and the master file both stores share (Note [parameters from the master] in
_placement.py, [write ordering] in _ordered_writes.py).
In process, no engine."""
import os

import pytest
import torch

import infinity
from infinity._offload._grad_shards import GradShards, GradStats
from infinity._offload._head_cache import HeadCache, HeadState
from infinity._offload._moment_staging import MomentStaging
from infinity._offload._nvme_optimizer_store import NvmeOptimizerStore
from infinity._offload._nvme_param_store import NvmeParamStore
from infinity._offload._optimizer_files import OptimizerFiles
from infinity._offload._ordered_writes import MasterFile
from infinity._offload._swap import SwapDir, new_aio
from infinity._offload._swap_pipeline import SwapPipeline, TailState
from infinity.errors import InvariantError

CHUNK = 4096
TOTAL = 3 * CHUNK + 1024  # three whole chunks and a short one
AIO = infinity.Config.from_dict({}).aio


@pytest.fixture
def swap(tmp_path):
    return SwapDir(str(tmp_path), 0)


def _files(swap, moments="fp32", grads_in_memory=False, master=None):
    return OptimizerFiles(TOTAL, CHUNK, swap, AIO, grads_in_memory=grads_in_memory, moments=moments, master=master)


def _write_states(files, values: dict):
    """Each state's values into its file, chunk by chunk (compressed moments encoded)."""
    io = new_aio(AIO)
    for name, v in values.items():
        for off in range(0, TOTAL, CHUNK):
            part = v[off : off + CHUNK].clone()
            if name in files.packed:
                part = files.encode(name, part, files.record_set("other")).clone()
            files.write(io, name, off, part)
            files.wait(io, "test writes")


def _read(files, name, off, n):
    io, out = new_aio(AIO), torch.empty(n)
    files.read(io, name, off, out)
    files.wait(io, "test read")
    return out


# ------------------------------------------------------------------ the host cache

def test_the_host_cache_moves_through_its_states_and_refuses_the_wrong_one(swap):
    files = _files(swap)
    cache = HeadCache(files, 2 * CHUNK, AIO)
    assert len(cache.sets) == 2 and cache.state is HeadState.EMPTY
    for wrong in (cache.land, cache.release):  # nothing read yet
        with pytest.raises(InvariantError, match="EMPTY"):
            wrong()
    master = torch.arange(TOTAL, dtype=torch.float32)
    _write_states(files, {"master": master})
    cache.start_reads()
    assert cache.state is HeadState.READING
    with pytest.raises(InvariantError, match="READING"):
        cache.start_reads()  # reads already in flight
    with pytest.raises(InvariantError, match="READING"):
        cache.release()  # nothing loaded to give back
    cache.land()
    assert cache.state is HeadState.LOADED
    torch.testing.assert_close(torch.cat([s["master"] for s in cache.sets]), master[: 2 * CHUNK], rtol=0, atol=0)
    cache.land()  # LOADED stays LOADED: only the write-back is waited for
    with pytest.raises(InvariantError, match="LOADED"):
        cache.start_reads()
    cache.release()
    assert cache.state is HeadState.EMPTY
    cache.start_reads()
    cache.invalidate()  # the files were rewritten: from any state
    assert cache.state is HeadState.EMPTY
    cache.close()


def test_the_host_cache_expands_compressed_moments_as_it_lands(swap):
    files = _files(swap, moments="bf16")
    cache = HeadCache(files, CHUNK, AIO)
    g = torch.Generator().manual_seed(0)
    states = {"master": torch.randn(TOTAL, generator=g), "exp_avg": torch.randn(TOTAL, generator=g),
              "exp_avg_sq": torch.rand(TOTAL, generator=g)}
    _write_states(files, states)
    cache.start_reads()
    cache.land()
    for name in ("exp_avg", "exp_avg_sq"):  # bf16 codes: within bf16's rounding of the values written
        torch.testing.assert_close(cache.sets[0][name], states[name][:CHUNK], rtol=1e-2, atol=1e-2)
    assert cache.within(CHUNK - 10, 100) == 10 and cache.within(CHUNK, 5) == 0
    assert [(lo, n, at) for _, lo, n, at in cache.pieces(CHUNK - 10, 100)] == [(CHUNK - 10, 10, 0)]
    cache.close()


# ------------------------------------------------------------------ the gradient shards

def _grads(swap, head, in_memory=False, accumulation_steps=1, ranges=None):
    files = _files(swap, grads_in_memory=in_memory)
    cache = HeadCache(files, head, AIO)
    ranges = ranges or [(0, 5000), (5000, 4000), (9000, TOTAL - 9000)]
    shards = GradShards(files, cache, ranges, in_memory=in_memory, accumulation_steps=accumulation_steps,
                        aio_cfg=AIO, scratch=torch.empty(CHUNK))
    return files, cache, shards


@pytest.mark.parametrize("in_memory", [False, True])
def test_gradient_shards_fold_their_norm_until_a_range_is_accumulated_again(swap, in_memory):
    files, cache, shards = _grads(swap, head=CHUNK, in_memory=in_memory)
    g = torch.Generator().manual_seed(1)
    first = torch.randn(5000, generator=g)
    shards.accumulate(0, first, 0.5)  # a range straddling the cache's end
    assert shards.stats is GradStats.FOLDED
    assert files.io["grad"][1] == (0 if in_memory else 4 * (5000 - CHUNK))  # only the uncached part hits the file
    shards.finalize()  # the other ranges got none: zeros
    sq, finite = shards.grad_stats()
    assert finite and sq == pytest.approx(float((0.5 * first).double().square().sum()), rel=1e-6)
    again = torch.randn(5000, generator=g)
    shards.accumulate(0, again, 1.0)  # a second micro-batch over the same range
    assert shards.stats is GradStats.READ_PASS
    want = 0.5 * first + again
    sq, finite = shards.grad_stats()  # measured by reading every gradient back
    assert finite and sq == pytest.approx(float(want.double().square().sum()), rel=1e-6)
    got = shards.mem[:5000] if in_memory else torch.cat([cache.sets[0]["grad"], _read(files, "grad", CHUNK, 5000 - CHUNK)])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    shards.accumulate(9000, torch.full((TOTAL - 9000,), float("inf")), 1.0)
    assert not shards.grad_stats()[1]
    shards.zero()
    assert shards.stats is GradStats.FOLDED and shards.grad_stats() == (0.0, True)
    shards.close()
    cache.close()


def test_gradient_shards_with_several_micro_batches_always_read_their_norm(swap):
    _, cache, shards = _grads(swap, head=0, accumulation_steps=2)
    assert shards.stats is GradStats.READ_PASS  # a first micro-batch's values are not the step's
    values = torch.ones(4000)
    shards.accumulate(5000, values, 1.0)
    shards.finalize()
    assert shards.grad_stats() == (pytest.approx(4000.0), True)
    shards.close()
    cache.close()


# ------------------------------------------------------------------ the swap pipeline

@pytest.mark.parametrize("phased", [False, True])
def test_the_swap_pipeline_updates_each_tail_chunk_once_in_order_and_writes_it_back(swap, phased):
    files = _files(swap)
    head = CHUNK
    pipeline = SwapPipeline(files, head, AIO, phased=phased, grads_in_memory=False)
    g = torch.Generator().manual_seed(2)
    states = {n: torch.randn(TOTAL, generator=g) for n in ("master", "exp_avg", "exp_avg_sq", "grad")}
    _write_states(files, states)
    seen = []

    def fn(chunk):  # clipping's coefficient (0.5) is the update's to apply as it reads the gradients
        seen.append((chunk.offset, chunk.master.numel()))
        torch.testing.assert_close(chunk.grad, states["grad"][chunk.offset : chunk.offset + chunk.grad.numel()])
        chunk.master.add_(chunk.grad, alpha=0.5)
        chunk.exp_avg.mul_(2)

    pipeline.prime()
    assert pipeline.state is TailState.PRIMED
    pipeline.prime()  # once per update: a second call submits nothing more
    reads, written = files.io["step"]
    pipeline.run(fn, lambda bufs, off, n: bufs)
    assert pipeline.state is TailState.IDLE
    assert seen == [(CHUNK, CHUNK), (2 * CHUNK, CHUNK), (3 * CHUNK, 1024)]  # the head is not the pipeline's
    tail = TOTAL - head
    assert files.io["step"][0] - reads == 4 * 4 * tail - 4 * 4 * CHUNK  # the primed first chunk was read before
    assert files.io["step"][1] - written == 3 * 4 * tail  # master and both moments written back; gradients consumed
    torch.testing.assert_close(_read(files, "master", head, tail), (states["master"] + 0.5 * states["grad"])[head:])
    torch.testing.assert_close(_read(files, "exp_avg", head, tail), 2 * states["exp_avg"][head:])
    torch.testing.assert_close(_read(files, "master", 0, head), states["master"][:head])  # untouched
    pipeline.close()


def test_the_swap_pipeline_leaves_a_shared_master_to_the_parameter_store(swap):
    master = MasterFile(swap, TOTAL, AIO)
    files = _files(swap, master=master)
    assert files.paths["master"] == master.path and files.master_shared
    pipeline = SwapPipeline(files, 0, AIO, phased=True, grads_in_memory=False)
    pipeline.run(lambda chunk: chunk.master.fill_(7.0), lambda bufs, off, n: bufs)
    assert files.array_io["master"][1] == 0  # the step's master values are the parameter store's to write
    assert files.array_io["exp_avg"][1] == 4 * TOTAL
    pipeline.close()
    master.close()


# ------------------------------------------------------------------ checkpoint staging

def test_checkpoint_staging_expands_compressed_moments_and_compresses_a_load_back(swap):
    files = _files(swap, moments="bf16")
    pipeline = SwapPipeline(files, 0, AIO, phased=False, grads_in_memory=False)
    reader = new_aio(AIO)
    staging = MomentStaging(files, swap, AIO, pipeline, reader)
    g = torch.Generator().manual_seed(3)
    exp_avg = torch.randn(TOTAL, generator=g).to(torch.bfloat16).float()  # exact in bf16
    _write_states(files, {"exp_avg": exp_avg})
    path = staging.stage("exp_avg")
    assert os.path.getsize(path) == 4 * TOTAL
    staged = torch.from_file(str(path), size=TOTAL, dtype=torch.float32)
    torch.testing.assert_close(staged, exp_avg, rtol=0, atol=0)
    loaded = (2 * exp_avg).contiguous()  # what a checkpoint load writes into the staging file
    with open(str(path), "r+b") as f:
        f.write(loaded.numpy().tobytes())
    staging.compress_back()
    assert not os.path.exists(str(path)) and staging.paths == {}
    records, out = files.record_set("other"), torch.empty(TOTAL)
    for off in range(0, TOTAL, CHUNK):
        n = min(CHUNK, TOTAL - off)
        rec = files.record(records, "exp_avg", n)
        files.read(reader, "exp_avg", off, rec)
        files.wait(reader, "test read")
        files.decode("exp_avg", rec, out[off : off + n])
    torch.testing.assert_close(out, loaded, rtol=0, atol=0)
    pipeline.close()


# ------------------------------------------------------------------ the shared master file

def test_both_stores_share_one_master_file_built_before_them(swap):
    """Built in one direction: the master file first, then each store given it; the optimizer
    store's reads wait for the parameter store's writes, which count as the optimizer's bytes."""
    ranges = [(0, TOTAL)]
    master = MasterFile(swap, TOTAL, AIO)
    opt = NvmeOptimizerStore(TOTAL, ranges, swap, AIO, CHUNK, accumulation_steps=1, host_cache=0, master=master)
    params = NvmeParamStore(torch.float32, TOTAL, swap=swap, aio_cfg=AIO, max_unit=TOTAL, master=master)
    assert params.path == opt.paths["master"] == master.path
    values = torch.randn(TOTAL)
    params.write(0, values)  # the step's hand-off, written by the parameter store
    torch.testing.assert_close(opt.read_master(0, TOTAL), values, rtol=0, atol=0)
    assert params.bytes_written == 0 and opt.bytes_written == 4 * TOTAL == opt.array_io["master"][1]
    assert "params" not in params.checksums()  # master.swp's sums are the optimizer store's
    params.close()
    opt.close()
