"""Released pages (Note [released pages] in infinity/aio/_memory.py): engine buffers idle through
the activation peak keep their mapping but give their pages back, so the peak holds activations,
not copies of what the disk holds. Counted with mincore (the ledger's ``resident``), never timed;
training stays exact against plain ``torch.optim.AdamW``.
"""
import gc
import threading

import pytest
import torch
from torch import nn

import infinity
from infinity._offload._memory_plan import GRADIENTS, OPT_BUFFERS, OPT_HOST_CACHE, PARAM_HANDOFF
from infinity._runtime import _accelerator as acc
from infinity.aio import aligned_empty
from infinity.aio._memory import HUGE_PAGE, ledger, release_pages
from infinity.testing import run_ranks

E = HUGE_PAGE // 4  # float32 elements per huge page
LR, WD, STEPS, ACCUM = 2e-3, 0.01, 3, 2


def test_release_gives_back_whole_huge_pages_inside_the_tensor():
    t = aligned_empty(4 * E, torch.float32, what="probe_release")
    t.fill_(1.0)
    if acc.has_cuda():  # pinned memory is page-locked: never released
        assert release_pages(t) == 0
        return
    assert ledger.resident()["probe_release"] == 4 * HUGE_PAGE
    assert release_pages(t[E + 1 :]) == 2 * HUGE_PAGE  # starts inside page 1: pages 2 and 3 only
    assert ledger.resident()["probe_release"] == 2 * HUGE_PAGE
    assert bool((t[: 2 * E] == 1).all())  # kept as written
    t[3 * E :].fill_(2.0)  # written again: faulted back in
    assert ledger.resident()["probe_release"] == 3 * HUGE_PAGE
    # A released page reads zeros (checked last: reading maps the shared zero page, which
    # mincore counts as resident though it costs no memory).
    assert not bool(t[2 * E : 3 * E].any())
    assert release_pages(t[: E - 1]) == 0  # no whole page inside


class _Wide(nn.Module):
    """Big enough that every buffer spans whole huge pages: a 1M-element first layer (the cached head)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(1024, 1024)
        self.mid = nn.Linear(1024, 1024)
        self.out = nn.Linear(1024, 8)

    def forward(self, x):
        return self.out(torch.relu(self.mid(torch.relu(self.inp(x))))).pow(2).mean()


def _data():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 1024, generator=g) for _ in range(STEPS * ACCUM)]


def _plain():
    model = _Wide()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for i, x in enumerate(_data()):
        loss = model(x)
        (loss / ACCUM).backward()
        losses.append(loss.item())
        if i % ACCUM == ACCUM - 1:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
    return losses


def _resident(cats):
    r = ledger.resident()
    return {c: r.get(c, 0) for c in cats}


def _train(nvme: str, allocator: str):
    """Everything on NVMe, gradients in host memory, the first unit's optimizer states in the
    host cache. Returns the losses, the resident bytes of the idle categories at the end of
    each forward (the peak's eve) and after each step, less what was resident before, and the
    optimizer's bytes read per step."""
    gc.collect()  # earlier engines' buffers are gone
    cats = (GRADIENTS, OPT_BUFFERS, OPT_HOST_CACHE, PARAM_HANDOFF)
    base = _resident(cats)
    cfg = {"zero": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                    "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "chunk_size": 1 << 20,
                                          "gradients": "cpu"},
                    "host_allocator": allocator},
           "optimizer": {"type": "adamw", "lr": LR, "weight_decay": WD}, "gradient_clipping": 0.5,
           "gradient_accumulation_steps": ACCUM, "precision": {"dtype": "fp32"}}
    model, opt = infinity.initialize(_Wide(), cfg)
    store = opt.engine.opt_store
    assert store.head >= E  # the cache spans whole huge pages
    losses, at_peak, in_step, reads = [], [], [], []
    for i, x in enumerate(_data()):
        loss = model(x)
        at_peak.append({c: v - base[c] for c, v in _resident(cats).items()})
        loss.backward()  # the engine averages over the accumulation steps
        losses.append(loss.item())
        if i % ACCUM == ACCUM - 1:
            opt.step()
            opt.zero_grad()
            opt.wait_step()
            in_step.append({c: v - base[c] for c, v in _resident(cats).items()})
            reads.append(store.array_io["master"][0] - sum(reads))
    head = store.head
    opt.engine.close()
    return losses, at_peak, in_step, reads, head


def _release_in_child(nvme):
    return _train(nvme, "release")  # the allocator setting is process-wide: a process of its own


def test_idle_buffers_hold_no_pages_through_the_peak_and_training_is_exact(tmp_path):
    """At the end of each forward the gradients, the buffer sets and the step's outputs hold
    no whole huge page, nor, with ``host_allocator: release``, the optimizer's host cache
    (read again in backward: one more read of its master weights per step); with ``keep`` the
    cache stays. The step uses them all again; the losses equal plain AdamW's with gradient
    accumulation and clipping, either way."""
    runs = {"keep": _train(str(tmp_path / "keep"), "keep"),
            "release": run_ranks(_release_in_child, 1, str(tmp_path / "release"), timeout=300)[0]}
    plain = _plain()
    for allocator, (losses, at_peak, in_step, _, head) in runs.items():
        assert losses == pytest.approx(plain, rel=1e-5, abs=1e-6), allocator
        idle = (GRADIENTS, OPT_BUFFERS, PARAM_HANDOFF) + ((OPT_HOST_CACHE,) if allocator == "release" else ())
        # The first micro-batch's forward of each step from the second on (the first step's
        # update used them; later micro-batches hold the gradients summed so far and the head
        # read back). Only the partial huge page at a buffer's end stays (whole pages only).
        for seen in at_peak[ACCUM::ACCUM]:
            assert all(seen[c] < HUGE_PAGE for c in idle), (allocator, seen)
            if allocator == "keep":
                assert seen[OPT_HOST_CACHE] >= head * 4 * 3, seen  # master weights and both moments, held
        for seen in in_step:
            assert seen[OPT_HOST_CACHE] >= head * 4 * 3, (allocator, seen)  # resident for the step
        assert at_peak[0][OPT_HOST_CACHE] == 0, allocator  # read first late in the first backward
    # Master weights read per step (forward, backward and the step): the same, but for the
    # head read again after each release.
    keep, release, head = runs["keep"][3], runs["release"][3], runs["keep"][4]
    assert keep[0] == release[0]
    assert [r - k for r, k in zip(release[1:], keep[1:])] == [head * 4] * (STEPS - 1)


def test_step_gate_knows_when_it_is_waited_on():
    from infinity._zero._step_gate import StepGate

    gate = StepGate(0, lambda stage, unit="": _null())
    gate.open()
    assert not gate.waited_on
    t = threading.Thread(target=lambda: gate.wait(10))
    t.start()
    for _ in range(1000):
        if gate.waited_on:
            break
        threading.Event().wait(0.001)
    assert gate.waited_on
    gate.publish(10)
    t.join(5)
    assert not t.is_alive() and not gate.waited_on


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_release_says_how_to_fault_the_allocators_blocks_in_huge_pages(monkeypatch):
    from infinity._offload._memory_plan import huge_page_hint
    from infinity.aio import _memory as aio_memory

    monkeypatch.setattr(aio_memory, "_thp_mode", lambda: "madvise")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert "GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in huge_page_hint()
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1")
    assert huge_page_hint() == ""  # set already
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setattr(aio_memory, "_thp_mode", lambda: "never")
    assert huge_page_hint() == ""  # nothing the kernel would give
