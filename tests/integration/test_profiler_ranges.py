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
from infinity._runtime._telemetry_counters import span


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
    counts = collections.Counter(e.name for e in prof.events() if e.name.startswith("infinity::"))
    for name in ("infinity::read", "infinity::copy_to_device", "infinity::all_gather", "infinity::reduce_scatter",
                 "infinity::update_chunk", "infinity::wait:nvme_read", "infinity::wait:optimizer_io"):
        assert counts[name] > 0, (name, dict(counts))
    assert set(n.split(":", 3)[-1] for n in counts if n.startswith("infinity::wait:")) <= set(tele["stall_s"])
    assert counts["infinity::wait:nvme_read"] >= counts["infinity::read"]  # each submission's own wait, and landings'


def test_no_range_without_a_profiler():
    assert not torch.autograd.profiler._is_profiler_enabled
    with span("infinity::read") as inside:
        assert inside is None  # a nullcontext: no record_function entered
