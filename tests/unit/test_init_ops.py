"""Every kind of operation initialization code applies to a parameter partitioned by infinity.Init
has exactly its effect without Init (Note [touched placeholders] in _init_ops.py), or is refused
at once, naming the parameter and the operation. Each case builds the same modules with the same
seed plainly and under Init, runs the same code on them, and compares every parameter bit for bit."""
import math

import pytest
import torch
from torch import nn

import infinity
from infinity.errors import ParameterNotAvailableError, UsageError


def _gathered(module):
    params = list(module.parameters())
    with infinity.GatheredParameters(params):
        return {n: p.detach().clone() for n, p in module.named_parameters()}


def _both(build, seed=0):
    """``build()`` plainly and under Init with the same seed: the modules' parameters, and the modules."""
    torch.manual_seed(seed)
    plain = build()
    torch.manual_seed(seed)
    with infinity.Init(offload="cpu"):
        part = build()
    return plain, part


def _assert_same(plain, part):
    want, got = dict(plain.named_parameters()), _gathered(part)
    assert want.keys() == got.keys()
    for name, p in want.items():
        assert p.dtype == got[name].dtype and p.shape == got[name].shape, name
        assert torch.equal(p.detach(), got[name]), name


class Edited(nn.Module):
    """An embedding and a linear, then ``edit(self)`` run at the end of ``__init__``, as Hugging
    Face's ``post_init`` runs ``_init_weights`` on modules already built (and so partitioned)."""

    def __init__(self, edit):
        super().__init__()
        self.emb = nn.Embedding(12, 6, padding_idx=2)
        self.lin = nn.Linear(6, 5)
        with torch.no_grad():
            edit(self)


EDITS = {
    # in-place operators on views and slices
    "index_row": lambda m: m.emb.weight[m.emb.padding_idx].zero_(),
    "slice_columns": lambda m: m.emb.weight[:, :3].normal_(0, 5.0),
    "data_index": lambda m: m.emb.weight.data[4].fill_(7.0),
    "data_setitem": lambda m: m.emb.weight.data.__setitem__((slice(1, 3), slice(None)), 3.0),
    "setitem": lambda m: m.emb.weight.__setitem__(0, torch.arange(6.0)),
    "narrow": lambda m: m.lin.weight.narrow(1, 2, 3).uniform_(-1, 1),
    "select": lambda m: m.lin.weight.select(0, 1).mul_(10.0),
    "view_of_view": lambda m: m.emb.weight[3:][1][2:].add_(100.0),
    "transpose": lambda m: m.lin.weight.t()[0].zero_(),
    "view": lambda m: m.lin.weight.view(-1)[::7].fill_(-1.0),
    "split": lambda m: [t.mul_(i + 2.0) for i, t in enumerate(m.emb.weight.split(5))],
    "unbind": lambda m: m.lin.weight.unbind(0)[4].fill_(0.5),
    "detach": lambda m: m.lin.bias.detach().sub_(1.0),
    "same_dtype_to": lambda m: m.lin.bias.to(torch.float32).mul_(3.0),
    "data_data": lambda m: m.lin.bias.data.data.zero_(),
    "iadd": lambda m: m.lin.bias.__iadd__(1.5),
    "out_kwarg": lambda m: torch.add(m.lin.bias, 1.0, out=m.lin.bias.data),
    # copy_ of computed values and of another partitioned parameter
    "copy_computed": lambda m: m.emb.weight.copy_(torch.sin(torch.arange(72.0).view(12, 6) / 7)),
    "copy_between": lambda m: m.lin.weight[:, :5].copy_(m.emb.weight[:5, :5].t()),
    "setitem_from_view": lambda m: m.emb.weight.data.__setitem__(slice(0, 5), m.lin.weight.data),
    # torch.nn.init on whole parameters and on views
    "fill": lambda m: m.lin.weight.fill_(0.25),
    "zero": lambda m: m.lin.bias.zero_(),
    "normal": lambda m: nn.init.normal_(m.emb.weight, std=0.3),
    "trunc_normal": lambda m: nn.init.trunc_normal_(m.lin.weight, std=0.5, a=-0.4, b=0.4),
    "uniform": lambda m: nn.init.uniform_(m.emb.weight[1:4], -2, 2),
    "orthogonal": lambda m: nn.init.orthogonal_(m.lin.weight, gain=1.5),
    "constant": lambda m: nn.init.constant_(m.lin.bias, 0.125),
    "xavier": lambda m: nn.init.xavier_uniform_(m.lin.weight),
    "kaiming": lambda m: nn.init.kaiming_normal_(m.emb.weight[:, 1:]),
    "eye": lambda m: nn.init.eye_(m.lin.weight),
    "sparse": lambda m: nn.init.sparse_(m.lin.weight, sparsity=0.5),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_an_edit_under_init_has_its_effect_without_init(edit):
    plain, part = _both(lambda: Edited(EDITS[edit]))
    _assert_same(plain, part)


def test_a_view_kept_writes_through_after_the_operation_that_made_it():
    """A view outlives the operator that made it: a later write through it, and a read, reach
    the parameter's chunks (it holds no values of its own)."""
    def build():
        m = Edited(lambda m: None)
        row = m.emb.weight[5]
        with torch.no_grad():
            row.fill_(9.0)
            m.emb.weight.mul_(2.0)
            row.add_(1.0)
        m.seen = float(row.sum())
        return m

    plain, part = _both(build)
    _assert_same(plain, part)
    assert part.seen == plain.seen == 6 * 19.0
    assert type(part.emb.weight[5]).__name__ == "ParamView" and part.emb.weight[5].shape == (6,)


def test_tied_and_shared_weights_are_initialized_once_and_stay_tied():
    def build():
        torch.nn.Linear(3, 3)  # draws from the RNG as a module built before would
        emb = nn.Embedding(10, 4, padding_idx=0)
        head = nn.Linear(4, 10, bias=False)
        head.weight = emb.weight
        with torch.no_grad():
            nn.init.normal_(head.weight, std=0.7)
            emb.weight[emb.padding_idx].zero_()
        return nn.ModuleDict({"emb": emb, "head": head})

    plain, part = _both(build)
    assert part.head.weight is part.emb.weight
    _assert_same(plain, part)
    with infinity.GatheredParameters([part.emb.weight]):
        assert torch.count_nonzero(part.emb.weight[0]) == 0 and torch.count_nonzero(part.emb.weight[1:]) == 36


def test_hugging_face_initialized_flags_are_honoured():
    """transformers' guarded init functions skip a parameter flagged ``_is_hf_initialized`` (a
    loaded one); the flag lives on the parameter, so it is read the same under Init."""
    from transformers import initialization as hf_init

    def build():
        m = Edited(lambda m: None)
        m.lin.weight._is_hf_initialized = True
        hf_init.normal_(m.lin.weight, std=3.0)  # skipped
        hf_init.zeros_(m.emb.weight[m.emb.padding_idx])  # a view carries no flag: zeroed
        hf_init.copy_(m.lin.bias, torch.arange(5.0))
        return m

    plain, part = _both(build)
    _assert_same(plain, part)


def test_data_assignment_may_change_shape_and_dtype():
    """``param.data = t`` (``resize_token_embeddings`` assigns a larger matrix; ``.T`` swaps the
    shape; a cast changes the dtype): the parameter's partition is remade for it."""
    def build():
        m = Edited(lambda m: None)
        m.emb.weight.data = torch.cat([m.emb.weight.data, torch.randn(3, 6)])
        m.lin.weight.data = m.lin.weight.data.T
        m.lin.bias.data = m.lin.bias.data.to(torch.float64) * 3
        return m

    plain, part = _both(build)
    _assert_same(plain, part)
    assert part.emb.weight.shape == (15, 6) and part.lin.weight.shape == (6, 5)
    assert part.lin.bias.dtype == torch.float64


def test_resize_token_embeddings_under_init_matches_plain():
    from transformers import OPTConfig, OPTForCausalLM

    def build():  # a config of its own: resizing changes the model's config
        model = OPTForCausalLM(OPTConfig(vocab_size=40, hidden_size=16, word_embed_proj_dim=16, num_hidden_layers=1,
                                         ffn_dim=32, num_attention_heads=2, max_position_embeddings=16, pad_token_id=1))
        model.resize_token_embeddings(52)
        return model

    plain, part = _both(build)
    _assert_same(plain, part)
    assert part.model.decoder.embed_tokens.weight.shape == (52, 16)


@pytest.mark.parametrize("op", ["t_", "resize_", "numpy"])
def test_what_cannot_be_made_exact_is_refused_naming_parameter_and_operation(op):
    with infinity.Init(offload="cpu"):
        lin = nn.Linear(4, 3)
    calls = {"t_": lambda w: w.data.t_(), "resize_": lambda w: w.data.resize_(2, 2),
             "numpy": lambda w: w.data.numpy()}
    with pytest.raises(UsageError, match=rf"(?s){op}.*Linear\.weight|Linear\.weight.*{op}"):
        calls[op](lin.weight)
    with infinity.GatheredParameters([lin.weight]):
        assert lin.weight.shape == (3, 4)  # nothing changed


def test_a_view_used_after_initialize_is_gathered_or_refused():
    """After ``initialize`` the view reaches the engine's parameter: refused outside
    GatheredParameters like the parameter itself, a real view inside (edits kept with modifier_rank)."""
    torch.manual_seed(0)
    with infinity.Init(offload="cpu"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    row = model[0].weight[1]
    model, _ = infinity.initialize(model, {"zero": {"stage": 3}})
    try:
        with pytest.raises(ParameterNotAvailableError, match="GatheredParameters"):
            row.sum()
        with infinity.GatheredParameters([model[0].weight], modifier_rank=0):
            with torch.no_grad():
                row.fill_(4.0)
        with infinity.GatheredParameters([model[0].weight]):
            assert torch.equal(model[0].weight[1], torch.full((4,), 4.0))
    finally:
        model.engine.close() if hasattr(model, "engine") else None


def test_an_operator_that_bypasses_torch_function_is_refused():
    with infinity.Init(offload="cpu"):
        lin = nn.Linear(4, 3)
    view = lin.weight[0]
    with pytest.raises(UsageError, match="view of a partitioned parameter"):
        with torch._C.DisableTorchFunctionSubclass():
            view.zero_()


def test_sinusoidal_positions_copied_into_a_parameter_on_nvme(tmp_path):
    """``copy_`` of computed values, on the NVMe tier (each write a new chunk in init.swp)."""
    def build():
        emb = nn.Embedding(16, 8)
        pos = torch.arange(16.0)[:, None] / torch.pow(10000.0, torch.arange(0, 8, 2) / 8)
        with torch.no_grad():
            emb.weight[:, 0::2].copy_(torch.sin(pos))
            emb.weight[:, 1::2].copy_(torch.cos(pos))
        return emb

    torch.manual_seed(0)
    plain = build()
    torch.manual_seed(0)
    with infinity.Init(offload="nvme", nvme_path=str(tmp_path)) as init:
        part = build()
    with infinity.GatheredParameters([part.weight]):
        assert torch.equal(part.weight, plain.weight)
    assert math.isclose(float(plain.weight[3, 0]), math.sin(3.0), rel_tol=1e-6)
    init.close()


def _decorated(cls):
    """As transformers' ``use_experts_implementation``: wraps the ``__init__`` it finds."""
    inner = cls.__init__

    def __init__(self, *args, **kwargs):
        inner(self, *args, **kwargs)
        self.decorated = True

    cls.__init__ = __init__
    return cls


def test_a_class_defined_and_decorated_inside_init_keeps_its_decorator_after_it():
    """A module class made inside the context (a model module imported on first use) whose
    ``__init__`` a decorator then wraps: partitioned inside, and the decorator still runs after
    the context (restoring the class's first ``__init__`` would drop it)."""
    with infinity.Init(offload="cpu"):
        @_decorated
        class Experts(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.ones(4, 2))

        inside = Experts()
    assert inside.decorated and type(inside.w).__name__ == "PartitionedParameter"
    after = Experts()
    assert after.decorated and type(after.w) is nn.Parameter
