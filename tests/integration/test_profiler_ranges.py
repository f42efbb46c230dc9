"""The engine's work is named in a torch profiler trace (Note [profiler ranges] in
_telemetry_counters.py): every transfer it issues and every wait on the critical path, counted
once per event, and nothing at all when no profiler records."""
from __future__ import annotations

import collections

import torch
from _configs import streamed_nvme_config
from _models import batches, gpt2
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile

import infinity
from infinity._runtime._telemetry_counters import range_kind, span


def _step(model, opt, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    opt.wait_step()


def test_a_stage3_nvme_step_names_its_transfers_and_waits(tmp_path):
    cfg = streamed_nvme_config(str(tmp_path))  # every shard read from its swap file every step
    with infinity.Init(config=cfg):
        model = gpt2()
    model, opt = infinity.initialize(model, config=cfg)
    data = batches(2)
    _step(model, opt, data[0])  # records the trace; the profiled step follows it
    infinity.telemetry(model)  # counters afresh: the next read is the profiled step's
    every_thread = _ExperimentalConfig(profile_all_threads=True)  # the overlapped update's thread too
    with profile(activities=[ProfilerActivity.CPU], experimental_config=every_thread) as prof:
        _step(model, opt, data[1])
    tele = infinity.telemetry(model)
    names = [e.name for e in prof.events() if e.name.startswith("infinity::")]
    counts = collections.Counter(range_kind(n) for n in names)
    for name in ("infinity::read", "infinity::copy_to_device", "infinity::all_gather", "infinity::reduce_scatter",
                 "infinity::update_chunk", "infinity::wait:nvme_read", "infinity::wait:optimizer_io"):
        assert counts[name] > 0, (name, dict(counts))
    assert set(k.split(":", 3)[-1] for k in counts if k.startswith("infinity::wait:")) <= set(tele["stall_s"])
    assert counts["infinity::wait:nvme_read"] >= counts["infinity::read"]  # each submission's own wait, and landings'
    # named after the unit: every unit is gathered for forward, each range saying which; reads, copies and update
    # chunks name units too (some shards come from the step's hand-off instead of a read)
    labels = {u.label for u in opt.ops.units}

    def units_of(kind: str) -> set:
        return {n[len(kind) + 1:] for n in names if range_kind(n) == kind}

    assert units_of("infinity::all_gather") == labels
    for kind in ("infinity::read", "infinity::copy_to_device", "infinity::update_chunk", "infinity::wait:nvme_read"):
        assert units_of(kind) and units_of(kind) <= labels | {""}, (kind, units_of(kind), labels)


def test_range_kinds_drop_the_unit():
    assert range_kind("infinity::all_gather:transformer.h.0") == "infinity::all_gather"
    assert range_kind("infinity::wait:nvme_read:<root>") == "infinity::wait:nvme_read"
    assert range_kind("infinity::wait:optimizer_io") == "infinity::wait:optimizer_io"
    assert range_kind("infinity::reduce_scatter:lm_head, transformer.ln_f") == "infinity::reduce_scatter"


def test_no_range_without_a_profiler():
    assert not torch.autograd.profiler._is_profiler_enabled
    with span("infinity::read") as inside:
        assert inside is None  # a nullcontext: no record_function entered
