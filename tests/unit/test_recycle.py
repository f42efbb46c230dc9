"""Recycled host memory (Note [recycled host memory] in _recycle.py): a returned tensor is
handed out again only when nothing else uses its storage, and the engine's hand-off and
gathered buffers really are reused while training stays exact."""
import pytest
import torch
from _models import build, train_losses

import infinity
from infinity._runtime._recycle import Recycler
from infinity.aio import aligned_empty


def _recycler(capacity=1 << 20):
    return Recycler(capacity, aligned_empty)


def test_reused_only_when_nothing_else_uses_it():
    r = _recycler()
    a = r.take(1000, torch.float32)
    a_ptr = a.data_ptr()
    view = a[10:20]
    r.give(a)
    del a
    b = r.take(1000, torch.float32)
    assert b.data_ptr() != a_ptr and r.reused == 0  # a view is alive: the memory is still in use
    del view
    c = r.take(1000, torch.float32)
    assert c.data_ptr() == a_ptr and r.reused == 1


def test_parameter_data_and_saved_views_hold_it():
    r = _recycler()
    buf = r.take(100, torch.float32)
    ptr = buf.data_ptr()
    p = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    p.data = buf.view(10, 10)
    x = torch.ones(3, 10, requires_grad=True)
    y = x @ p.t()  # autograd saves a view of the weight
    r.give(buf)
    del buf
    p.data = torch.empty(0)  # released, as the engine does, but the graph still holds the view
    assert r.take(100, torch.float32).data_ptr() != ptr
    y.sum().backward()
    del y
    assert r.take(100, torch.float32).data_ptr() == ptr


def test_size_dtype_and_capacity():
    r = _recycler(capacity=3 * 4000)
    bufs = [r.take(1000, torch.float32) for _ in range(4)]
    kept = bufs[:3]  # the three the recycler can hold; the newest is let go
    for t in bufs:
        r.give(t)
    del bufs, t
    assert r.pooled_bytes == 3 * 4000
    r.take(1000, torch.bfloat16)  # another dtype is never handed out
    r.take(999, torch.float32)  # nor another size
    assert r.reused == 0
    got = r.take(1000, torch.float32)
    assert r.reused == 1 and any(got is k for k in kept)
    r.give(torch.empty(1000))  # not from take: ignored
    assert r.pooled_bytes == 2 * 4000


@pytest.mark.parametrize("optim", ["nvme", "cpu"])
def test_engine_reuses_handoff_and_gathered_buffers(tmp_path, optim):
    """Params on NVMe: the step's output tensors and the gathered buffers of fetches read
    from disk come back, and the losses equal training without offload. One rank without an
    accelerator reads shards straight into gathered buffers: no staging buffer is ever made."""
    # bf16 with the optimizer in memory: fp32 parameters would be the master tensor itself (Note
    # [parameters from the master] in _placement.py), with nothing on disk to read
    dtype = "bf16" if optim == "cpu" else "fp32"

    def config(param, opt):
        zero = {"stage": 3, "offload_param": {"device": param, "nvme_path": str(tmp_path), "max_in_cpu": 0},
                "offload_optimizer": {"device": opt, "nvme_path": str(tmp_path), "chunk_size": 4096},
                "prefetch": {"persistence_threshold": 0}}  # every unit fetched again in backward, from disk
        return {"zero": zero, "optimizer": {"lr": 2e-3}, "gradient_clipping": 0.5, "precision": {"dtype": dtype}}

    model, opt = infinity.initialize(build("gpt2"), config("none", "none"))
    ref = train_losses(model, opt, "gpt2", 5)
    opt.engine.close()
    model, opt = infinity.initialize(build("gpt2"), config("nvme", optim))
    got = train_losses(model, opt, "gpt2", 5)
    opt.wait_step()
    assert opt.param_store._outputs.reused > 0
    assert opt.engine.gathered_buffers.reused > 0
    assert opt.param_store.bytes_read > 0 and opt.param_store.pool._made == 0
    opt.engine.close()
    assert got == pytest.approx(ref, rel=1e-5, abs=1e-6)
