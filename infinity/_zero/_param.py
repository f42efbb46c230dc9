"""Partitioned parameters: the state enum, the side-object registry and the placeholder.

Note [partitioned parameter]: a stage-3 parameter keeps its identity (the same
``nn.Parameter`` object the model and autograd hold) while its ``.data`` is swapped between
the full gathered tensor (AVAILABLE) and an empty placeholder (every other state). Its class
becomes ``PartitionedParameter``, whose ``__torch_function__`` makes the placeholder safe:
- metadata queries (``shape``, ``size()``, ``numel()``, ``dim()``, dtype, device, ...)
  answer with the full tensor's metadata in every state;
- any other use of a parameter that is not AVAILABLE either gathers it on demand (inside a
  managed forward: that is how external parameters are detected) or raises
  ``ParameterNotAvailableError`` pointing to ``infinity.GatheredParameters``; the empty
  placeholder never reaches an operator, so it can never silently broadcast.
Engine state lives in ``ParamInfo`` side objects, reached only through ``register`` and
``info_of`` (Note [parameter side objects]), never as attributes probed on the parameter.

Note [parameter side objects]: the parameter owns its side object, in the one private
``__dict__`` entry ``_INFO`` that only ``register`` and ``info_of`` touch. A table
outside the parameter cannot own it: the side object reaches its unit and the unit its
parameters, so a global table's strong reference kept every parameter (and with it every
model and engine) ever initialized alive, and a weak one would let the side object die
while its placeholder parameter lived on. Owned by the parameter, the parameters, units,
engine and model form cycles the collector frees when the user lets go of them. The entry
pickles and deep-copies as None: a copy of a parameter is not managed.
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, NamedTuple, Optional, Protocol

import torch
from torch import nn

from ..errors import ParameterNotAvailableError, UsageError

if TYPE_CHECKING:
    from ._ledger import Hold


class ParamState(enum.Enum):
    """Where a managed parameter's data is; exactly one at a time (Note [partitioned parameter])."""

    RELEASED = "released"  # only the shard exists, on its home tier
    HOST = "host"  # the shard is staged in a host buffer (offload tiers)
    DEVICE = "device"  # the shard is on the device, ready to all-gather
    GATHERING = "gathering"  # the all-gather is in flight
    AVAILABLE = "available"  # param.data is the full tensor


class ParamOwner(Protocol):
    """Note [parameter owners]: a managed parameter belongs to a ``FetchUnit`` (after
    ``initialize``) or to an ``InitUnit`` (built under ``infinity.Init``, not yet initialized).
    Both hold their parameters' shards, acquire and release them for ``GatheredParameters``,
    and answer an operator that reached a released parameter."""

    index: int
    world_size: int
    module_name: str
    params: List[nn.Parameter]

    @property
    def state(self) -> "ParamState": ...

    def acquire(self, why: Hold) -> None: ...

    def release(self, why: Hold) -> None: ...

    def on_unavailable(self, func, args, kwargs, infos): ...


@dataclass
class ParamInfo:
    """The engine's side object for one managed parameter."""

    name: str  # qualified name in the model, for messages
    shape: torch.Size  # the full shape
    numel: int  # elements of the full tensor
    padded_numel: int  # numel rounded up to a multiple of the world size
    shard_offset: int  # where this parameter's shard starts in its unit's shard
    unit: ParamOwner  # the unit that owns the storage: a FetchUnit or an InitUnit

    @property
    def shard_numel(self) -> int:
        """Elements of this parameter held by each rank."""
        return self.padded_numel // self.unit.world_size

    @property
    def state(self) -> ParamState:
        return self.unit.state

    def __reduce__(self):
        return type(None), ()  # Note [parameter side objects]: a pickled or copied parameter is not managed


_INFO = "_infinity_info"  # Note [parameter side objects]


def register(param: nn.Parameter, info: ParamInfo) -> None:
    param.__dict__[_INFO] = info


def info_of(param) -> Optional[ParamInfo]:
    """The side object of a managed parameter, or None."""
    return getattr(param, "__dict__", {}).get(_INFO)


def set_data(param: nn.Parameter, data: torch.Tensor) -> None:
    """Swap ``param.data`` without going through the placeholder's guard. Where torch cannot
    swap the data in place (a host parameter given data of a device that is a tensor subclass,
    as the emulated accelerator's), the parameter object is kept and its whole tensor swapped
    (``torch.utils.swap_tensors``, as ``Module.to`` does for such devices); this happens once,
    when ``initialize`` moves the parameter, before any hook is registered on it."""
    with torch._C.DisableTorchFunctionSubclass():
        if torch._has_compatible_shallow_copy_type(param, data):
            param.data = data
            return
    info, partitioned = info_of(param), isinstance(param, PartitionedParameter)
    make_plain(param)
    new = nn.Parameter(data.detach(), requires_grad=param.requires_grad)
    torch.utils.swap_tensors(param, new)
    if info is not None:
        register(param, info)
    if partitioned:
        make_partitioned(param)


def raw_data(param: nn.Parameter) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return param.data


# Descriptors whose getters only read metadata: allowed in every state (getattr: two are not in torch's stubs).
_META_ATTRS = {
    torch._C.TensorBase.dtype, torch._C.TensorBase.device, torch._C.TensorBase.requires_grad,
    torch._C.TensorBase.grad, torch._C.TensorBase.is_leaf, torch._C.TensorBase.grad_fn,
    torch._C.TensorBase.layout, torch._C.TensorBase.is_cuda, torch._C.TensorBase.is_sparse,
    torch._C.TensorBase.is_meta, torch._C.TensorBase.is_quantized,
    torch._C.TensorBase._backward_hooks, getattr(torch._C.TensorBase, "_post_accumulate_grad_hooks"),
    torch._C.TensorBase.is_nested, getattr(torch._C.TensorBase, "name"), torch._C.TensorBase._base,
    torch._C.TensorBase.retains_grad, torch._C.TensorBase.itemsize,
}
_META_METHODS = {
    torch.Tensor.element_size, torch.Tensor.is_floating_point, torch.Tensor.is_complex,
    torch.Tensor.get_device, torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook,
    torch.Tensor.requires_grad_, torch.Tensor.is_contiguous, torch.Tensor.__format__,
}


def _shape_query(func, info: ParamInfo, args, kwargs):
    """Answer shape/size/numel/dim from the full shape; None if ``func`` is not one of them."""
    owner = getattr(func, "__self__", None)
    if owner is torch._C.TensorBase.shape:
        return info.shape
    if owner is torch._C.TensorBase.ndim:
        return len(info.shape)
    if func is torch.Tensor.size:
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        return info.shape if dim is None else info.shape[dim]
    if func is torch.Tensor.numel:
        return info.numel
    if func is torch.Tensor.dim:
        return len(info.shape)
    if owner is torch._C.TensorBase.nbytes:
        return info.numel * args[0].element_size()
    return None


def _iter_params(obj, depth=0):
    """The partitioned parameters an operator's arguments hold, those behind a ``ParamView`` included."""
    if isinstance(obj, PartitionedParameter):
        yield obj
    elif isinstance(obj, ParamView):
        yield from obj.bases
    elif depth < 2 and isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _iter_params(x, depth + 1)
    elif depth < 2 and isinstance(obj, dict):
        for x in obj.values():
            yield from _iter_params(x, depth + 1)


def first_arg(args, kwargs):
    """The tensor an operator acts on: its first argument (``torch.nn.init`` passes it by name)."""
    if args:
        return args[0]
    return kwargs.get("tensor", kwargs.get("input", kwargs.get("self")))


class PartitionedParameter(nn.Parameter):
    """The class of a stage-3 parameter; see Note [partitioned parameter]."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = getattr(func, "__self__", None)
        if owner in _META_ATTRS or func in _META_METHODS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is torch.Tensor.__repr__:
            info = info_of(args[0])
            if info is not None and info.state is not ParamState.AVAILABLE:
                return (f"PartitionedParameter(name={info.name!r}, shape={tuple(info.shape)}, "
                        f"dtype={args[0].dtype}, state={info.state.name})")
        unavailable = []
        first = first_arg(args, kwargs)
        for p in itertools.chain(_iter_params(args), _iter_params(kwargs)):
            info = info_of(p)
            if info is None or info.state is ParamState.AVAILABLE:
                continue
            answer = _shape_query(func, info, args, kwargs) if p is first else None
            if answer is not None:
                return answer
            unavailable.append((p, info))
        if unavailable:
            owner = unavailable[0][1].unit  # a FetchUnit or an InitUnit: Note [parameter owners]
            return owner.on_unavailable(func, args, kwargs, [info for _, info in unavailable])
        return run_available(func, args, kwargs)

    def __reduce_ex__(self, proto):
        info = info_of(self)
        if info is not None and info.state is not ParamState.AVAILABLE:
            raise ParameterNotAvailableError(not_available_message(info, "pickle/deepcopy"))
        return super().__reduce_ex__(proto)


def not_available_message(info: ParamInfo, op: str) -> str:
    return (
        f"parameter {info.name!r} (shape {tuple(info.shape)}) is partitioned across ranks and is "
        f"{info.state.name} here; '{op}' needs the full tensor. Outside the model's forward/backward, "
        f"wrap the access in `with infinity.GatheredParameters([param]):` (add modifier_rank=0 to "
        f"keep edits); to save the weights, gather them first (e.g. `with infinity.GatheredParameters("
        f"list(model.parameters())): model.save_pretrained(dir)`)."
    )


_PARTITIONED: dict = {}  # the class of a parameter -> its placeholder-safe class
_PLAIN: dict = {PartitionedParameter: nn.Parameter}


def _partitioned_class(cls: type) -> type:
    """PartitionedParameter for a plain parameter; for a device tensor subclass (the emulated
    accelerator's), a class with the guard of the one and the operators of the other."""
    if cls in (nn.Parameter, torch.Tensor):
        return PartitionedParameter
    out = _PARTITIONED.get(cls)
    if out is None:
        out = _PARTITIONED[cls] = type(f"Partitioned{cls.__name__}", (PartitionedParameter, cls), {})
        _PLAIN[out] = cls
    return out


def make_partitioned(param: nn.Parameter) -> None:
    """Give a managed parameter the placeholder-safe class (idempotent)."""
    if not isinstance(param, PartitionedParameter):
        param.__class__ = _partitioned_class(type(param))


def make_plain(param: nn.Parameter) -> None:
    if isinstance(param, PartitionedParameter):
        param.__class__ = _PLAIN[type(param)]


# ------------------------------------------------------------------ views of partitioned parameters


class ViewStep(NamedTuple):
    """How a ``ParamView`` is made from its bases: ``func(*args, **kwargs)``, then ``path`` into a
    (nested) sequence result (``split``, ``unbind``). The arguments hold the bases themselves."""

    func: Callable
    args: tuple
    kwargs: Dict[str, Any]
    path: tuple


class ParamView(torch.Tensor):
    """A view of partitioned parameters (``weight[idx]``, ``weight.data``, ``narrow``, ...) taken
    while they were not gathered: no storage of its own, only the recipe that makes it from the
    full tensors (Note [touched placeholders] in _init_ops.py)."""

    bases: tuple  # the parameters whose full tensors the recipe reads
    step: Optional[ViewStep]  # None: ``bases[0].data``

    @staticmethod
    def of(bases, step: Optional[ViewStep], like: torch.Tensor, device: torch.device) -> "ParamView":
        """A view with the shape, strides and dtype of ``like`` (what the recipe gives)."""
        with torch._C.DisableTorchFunctionSubclass():
            t = torch.Tensor._make_wrapper_subclass(
                ParamView, like.shape, strides=like.stride(), storage_offset=like.storage_offset(), dtype=like.dtype,
                device=device, requires_grad=False)
        t.bases, t.step = tuple(bases), step
        return t

    def replay(self, fulls: Dict[int, torch.Tensor]) -> torch.Tensor:
        """The real view: the recipe run on the full tensors (``fulls``: id of a base -> its full tensor)."""
        with torch._C.DisableTorchFunctionSubclass():
            if self.step is None:
                return fulls[id(self.bases[0])].detach()
            out = self.step.func(*resolve(self.step.args, fulls), **resolve(self.step.kwargs, fulls))
            for i in self.step.path:
                out = out[i]
            return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = getattr(func, "__self__", None)
        if owner in _META_ATTRS or owner in _VIEW_META_ATTRS or func in _META_METHODS or func in _VIEW_META_METHODS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)  # the wrapper carries the view's own metadata
        if owner is torch._C.TensorBase.data:
            if func.__name__ == "__get__":
                return args[0]
            raise UsageError(f"assigning .data of a view of parameter {args[0].bases[0]!r} would not reach the "
                             f"parameter; assign the parameter's own .data")
        if func is torch.Tensor.__repr__:
            me = args[0]
            names = ", ".join(repr(info_of(b).name) if info_of(b) else "?" for b in me.bases)
            return f"ParamView(of={names}, shape={tuple(me.shape)}, dtype={me.dtype})"
        infos = {id(i): i for p in itertools.chain(_iter_params(args), _iter_params(kwargs))
                 if (i := info_of(p)) is not None and i.state is not ParamState.AVAILABLE}
        if infos:
            first = next(iter(infos.values()))
            return first.unit.on_unavailable(func, args, kwargs, list(infos.values()))
        return run_available(func, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise UsageError(f"{func} reached a view of a partitioned parameter without passing through its "
                         f"__torch_function__ (Note [touched placeholders] in _init_ops.py); gather the parameter "
                         f"first: `with infinity.GatheredParameters([param], modifier_rank=0):`")


# Metadata a view answers from its wrapper (a parameter answers these from its ParamInfo: _shape_query).
_VIEW_META_ATTRS = {torch._C.TensorBase.shape, torch._C.TensorBase.ndim, torch._C.TensorBase.nbytes}
_VIEW_META_METHODS = {torch.Tensor.size, torch.Tensor.stride, torch.Tensor.storage_offset, torch.Tensor.numel,
                      torch.Tensor.dim, torch.Tensor.__len__}


def resolve(obj, fulls: Dict[int, torch.Tensor]):
    """``obj`` with each partitioned parameter in ``fulls`` replaced by its full tensor and each
    ``ParamView`` by its real view of them."""
    if isinstance(obj, ParamView):
        return obj.replay(fulls)
    if isinstance(obj, torch.Tensor):
        return fulls.get(id(obj), obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(resolve(x, fulls) for x in obj)
    if isinstance(obj, dict):
        return {k: resolve(v, fulls) for k, v in obj.items()}
    return obj


def run_available(func, args, kwargs):
    """Run ``func`` where every parameter it reads, directly or through a view, is gathered: the
    parameters are used as themselves (autograd records them) and views are replayed on them."""
    fulls = {id(p): p for p in itertools.chain(_iter_params(args), _iter_params(kwargs))}
    with torch._C.DisableTorchFunctionSubclass():
        if fulls:
            args, kwargs = resolve(args, fulls), resolve(kwargs, fulls)
        return func(*args, **kwargs)
