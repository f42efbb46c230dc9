"""torch's device-generic API on the emulated device (Note [emulated accelerator in
torch.accelerator] in _emulated_torch.py): every memory, cache and synchronize call that
accelerate, transformers, TRL and torch make through ``torch.accelerator`` or the device
module answers from the emulator's ledger and streams, instead of torch's internal assertion."""
from __future__ import annotations

import time

import pytest
import torch

from infinity._runtime import _accelerator as acc
from infinity._runtime._accelerator import _emulated

MiB = 1 << 20


@pytest.fixture
def emu(emulated):
    assert torch.accelerator.current_accelerator().type == "emu"
    return emulated


def test_memory_calls_answer_from_the_ledger(emu):
    before = torch.accelerator.memory_allocated()
    assert before == _emulated.memory_allocated()
    x = torch.empty(MiB, dtype=torch.float32, device=emu)  # 4 MiB of device storage
    assert torch.accelerator.memory_allocated() == before + 4 * MiB
    assert torch.accelerator.memory_allocated(0) == before + 4 * MiB  # by index, as callers pass it
    assert torch.accelerator.max_memory_allocated() >= before + 4 * MiB
    assert torch.accelerator.memory_reserved() == torch.accelerator.memory_allocated()  # nothing cached
    del x
    assert torch.accelerator.memory_allocated() == before
    torch.accelerator.reset_peak_memory_stats()
    assert torch.accelerator.max_memory_allocated() == before
    assert torch.accelerator.max_memory_reserved() == before


def test_memory_stats_has_the_keys_cuda_reports(emu):
    torch.accelerator.reset_accumulated_memory_stats()
    y = torch.empty(256, dtype=torch.float32, device=emu)
    stats = torch.accelerator.memory_stats()
    for key in ("allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
                "active_bytes.all.current", "allocation.all.current", "num_ooms", "num_alloc_retries"):
        assert key in stats, key
    assert stats["allocated_bytes.all.current"] == _emulated.memory_allocated()
    assert stats["allocated_bytes.all.allocated"] == 1024  # since the reset: y's bytes alone
    assert stats["num_device_alloc"] == 1
    del y
    assert torch.accelerator.memory_stats()["allocated_bytes.all.freed"] == 1024
    torch.accelerator.reset_accumulated_memory_stats()
    assert torch.accelerator.memory_stats()["allocated_bytes.all.freed"] == 0


def test_an_out_of_memory_is_counted(emu):
    torch.accelerator.reset_accumulated_memory_stats()
    _emulated.set_capacity(_emulated.memory_allocated() + MiB)
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(MiB, dtype=torch.float32, device=emu)
    assert torch.accelerator.memory_stats()["num_ooms"] == 1


def test_memory_info_is_free_and_capacity(emu):
    free, total = torch.accelerator.get_memory_info()
    assert total == _emulated.total_memory()
    assert free == total - _emulated.memory_allocated()


def test_cache_calls_and_device_queries(emu):
    torch.accelerator.empty_cache()  # accelerate's free_memory, at the start of every Trainer.train
    t = torch.ones(8, device=emu)
    torch.accelerator.empty_host_cache()  # with a device tensor alive (torch's own crashes the process)
    assert t.sum().item() == 8
    assert torch.accelerator.device_count() == 1
    assert torch.accelerator.current_device_index() == 0
    assert torch.accelerator.is_available()
    assert torch.accelerator.current_stream().device.type == "emu"


def test_synchronize_waits_for_queued_work(emu):
    landed = []
    acc.current_stream().enqueue(lambda: (time.sleep(0.05), landed.append(True)))
    torch.accelerator.synchronize()
    assert landed == [True]


def test_the_device_module_has_cuda_names(emu):
    mod = torch.get_device_module("emu")
    z = torch.empty(1024, dtype=torch.uint8, device=emu)
    assert mod.memory_allocated() == _emulated.memory_allocated()
    assert mod.max_memory_allocated() >= mod.memory_allocated()
    mod.reset_peak_memory_stats()
    assert mod.max_memory_allocated() == mod.memory_allocated()
    assert mod.memory_stats()["allocated_bytes.all.current"] == mod.memory_allocated()
    assert mod.mem_get_info() == torch.accelerator.get_memory_info()
    mod.empty_cache()
    mod.synchronize()
    assert mod.device_count() == 1 and mod.is_available() and mod.current_device() == 0
    del z


def test_accelerate_frees_memory_through_torch_accelerator(emu):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.utils.memory import clear_device_cache

    clear_device_cache(garbage_collection=True)
    accelerate.Accelerator(cpu=True).free_memory()
