"""Memory-centric tiling (paper 002 §5.1.3): one large linear operator as a grid of small ones.

Note [tiles are fetch units]: ``TiledLinear`` holds its weight as an ``out_splits x in_splits``
grid of ``nn.Linear`` tiles, each a submodule of its own in an ``nn.ModuleList``. Every child of
a module list is a block of its own (Note [fetch unit grouping] in _unit_plan.py), also inside a
transformer block, and with ``zero.fetch_units.group: module`` every module is: so each tile is
one fetch unit either way: its
pre-forward hook gathers it, its post-forward hook releases it, and the tiles run one after
another, so only the tile in use (plus the prefetch window) is gathered at a time. In
backward each tile's output hook re-gathers it just before its own backward node runs, and
its post-accumulate-grad hook hands its gradient to the reduce-scatter as soon as that tile
is done (autograd runs a parameter's AccumulateGrad node right after the node that produced
the gradient). The working memory of the operator is then that of its largest tile.

Note [tiled numerics]: tile (o, i) maps input columns ``in_bounds[i]`` to output columns
``out_bounds[o]``. With ``in_splits == 1`` each output column is computed by the same dot
products as in ``nn.Linear`` (the inner dimension is untouched), so the forward output equals
``nn.Linear`` bitwise on this machine's BLAS (tested); the input gradient is then a sum over
``out_splits`` partial products ``g_o @ W_o``, rounded per partial sum: equal within fp32
rounding, not bitwise. With ``in_splits > 1`` the forward output is the sum of ``in_splits``
partial products (rounded once per partial sum; ``nn.Linear`` rounds the whole dot product in
one GEMM, with its own blocking), so it is equal within fp32 rounding: |error| <= a few ulp
of the sum of |x_k w_k|, tested at rtol 1e-5 / atol 1e-5 on O(1) data. Weight and bias
gradients are the same products over the batch dimension, per tile.

Note [untiled names]: a model that was tiled must still save and export as the model it was:
``state_dict`` of a ``TiledLinear`` has ``weight`` (out_features, in_features) and ``bias``
(out_features,), assembled from the tiles, and ``load_state_dict`` accepts those and cuts
them into the tiles. The tiles' own names never appear in a state dict.
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
from torch import nn

from .._runtime._accelerator import DeviceOutOfMemory
from .._runtime._log import logger
from ..errors import TiledWeightError, TokenIdError, UsageError
from ._init_context import InitUnit
from ._param import info_of, set_data

_NO_WHOLE = ("{cls} holds its {name} as tiles, not one tensor (zero.tiling): read state_dict()['{name}'] "
             "(inside infinity.GatheredParameters in stage 3), or leave this module untiled (zero.tiling.min_params)")


def split_bounds(n: int, splits: int) -> List[Tuple[int, int]]:
    """``splits`` contiguous ranges covering ``range(n)``; sizes differ by at most one (the
    first ``n % splits`` ranges are one longer), as ``torch.tensor_split`` cuts."""
    base, extra = divmod(n, splits)
    out, lo = [], 0
    for k in range(splits):
        hi = lo + base + (1 if k < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def _on_meta(device) -> bool:
    return device is not None and torch.device(device).type == "meta"


def _linear(n_in: int, n_out: int, bias: bool, device, dtype) -> nn.Linear:
    """A tile, uninitialized on the meta device (nothing to draw; a plan there makes thousands)."""
    if not _on_meta(device):
        return nn.Linear(n_in, n_out, bias=bias, device=device, dtype=dtype)
    tile = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(tile)
    tile.in_features, tile.out_features = n_in, n_out
    tile.weight = nn.Parameter(torch.empty(n_out, n_in, device=device, dtype=dtype))
    tile.register_parameter("bias", nn.Parameter(torch.empty(n_out, device=device, dtype=dtype)) if bias else None)
    return tile


def _check_splits(what: str, features: int, splits: int) -> None:
    if not isinstance(splits, int) or isinstance(splits, bool) or splits < 1:
        raise UsageError(f"TiledLinear: {what}_splits must be a positive int, got {splits!r}")
    if splits > features:
        raise UsageError(f"TiledLinear: {what}_splits={splits} exceeds {what}_features={features}; every tile "
                         f"needs at least one {what}put feature, so use at most {features}")


class TiledLinear(nn.Module):
    """``nn.Linear(in_features, out_features, bias)`` held as ``out_splits x in_splits`` tiles
    run one after another (Note [tiles are fetch units]). Tile (o, i) is ``tiles[o * in_splits
    + i]``; only the tiles of the first input split carry a bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, in_splits: int = 1,
                 out_splits: int = 1, device=None, dtype=None):
        super().__init__()
        _check_splits("in", in_features, in_splits)
        _check_splits("out", out_features, out_splits)
        self.in_features, self.out_features = in_features, out_features
        self.in_splits, self.out_splits = in_splits, out_splits
        self.in_bounds = split_bounds(in_features, in_splits)
        self.out_bounds = split_bounds(out_features, out_splits)
        self.has_bias = bias
        self.tiles = nn.ModuleList(
            _linear(ihi - ilo, ohi - olo, bias and i == 0, device, dtype)
            for olo, ohi in self.out_bounds for i, (ilo, ihi) in enumerate(self.in_bounds))
        if not _on_meta(device):  # nothing to draw on the meta device (from_linear copies the values in)
            self.reset_parameters()
        self.register_state_dict_post_hook(_untiled_state_dict)
        self.register_load_state_dict_pre_hook(_tiled_load_state_dict)

    def reset_parameters(self) -> None:
        """The distribution ``nn.Linear`` draws from, fan-in of the whole operator (so a tiled
        model starts from the same distribution; the values differ from an untiled one's)."""
        bound = 1.0 / math.sqrt(self.in_features) if self.in_features else 0.0
        with torch.no_grad():
            for tile in self.tiles:
                tile.weight.uniform_(-bound, bound)
                if tile.bias is not None:
                    tile.bias.uniform_(-bound, bound)

    def tile(self, o: int, i: int) -> nn.Linear:
        return self.tiles[o * self.in_splits + i]

    def __getattr__(self, name: str):
        if name in ("weight", "bias"):
            raise TiledWeightError(_NO_WHOLE.format(cls=type(self).__name__, name=name))
        return super().__getattr__(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise UsageError(f"TiledLinear: input has {x.shape[-1]} features in its last dimension, expected "
                             f"{self.in_features}")
        xs = [x[..., lo:hi] for lo, hi in self.in_bounds] if self.in_splits > 1 else [x]
        outs = []
        for o in range(self.out_splits):
            y = self.tile(o, 0)(xs[0])
            for i in range(1, self.in_splits):  # Note [tiled numerics]
                y = y + self.tile(o, i)(xs[i])
            outs.append(y)
        return torch.cat(outs, dim=-1) if self.out_splits > 1 else outs[0]

    @classmethod
    def from_linear(cls, linear: nn.Linear, in_splits: int = 1, out_splits: int = 1) -> "TiledLinear":
        """A TiledLinear computing what ``linear`` computes, with copies of its values (same
        dtype, device and ``requires_grad``)."""
        if not isinstance(linear, nn.Linear):
            raise UsageError(f"TiledLinear.from_linear expects an nn.Linear, got {type(linear).__name__}")
        w = linear.weight
        out = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, in_splits=in_splits,
                  out_splits=out_splits, device="meta")
        out.to_empty(device=w.device)
        out.to(w.dtype)
        out.copy_from(w.detach(), None if linear.bias is None else linear.bias.detach())
        out.requires_grad_(False)
        for tile in out.tiles:
            tile.weight.requires_grad_(w.requires_grad)
            if tile.bias is not None:
                tile.bias.requires_grad_(linear.bias.requires_grad)
        return out

    def copy_from(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        """Cut a whole ``(out_features, in_features)`` weight (and bias) into the tiles."""
        with torch.no_grad():
            for o, (olo, ohi) in enumerate(self.out_bounds):
                for i, (ilo, ihi) in enumerate(self.in_bounds):
                    t = self.tile(o, i)
                    t.weight.copy_(weight[olo:ohi, ilo:ihi])
                    if t.bias is not None:
                        t.bias.copy_(bias[olo:ohi])

    def full_weight(self) -> torch.Tensor:
        """The whole weight assembled from the (gathered) tiles: a new tensor."""
        rows = [torch.cat([self.tile(o, i).weight for i in range(self.in_splits)], dim=1)
                for o in range(self.out_splits)]
        return torch.cat(rows, dim=0)

    def full_bias(self) -> Optional[torch.Tensor]:
        if not self.has_bias:
            return None
        return torch.cat([self.tile(o, 0).bias for o in range(self.out_splits)])

    def to_linear(self) -> nn.Linear:
        """An ``nn.Linear`` with the tiles' current values (the tiles must be gathered)."""
        w = self.full_weight().detach()
        lin = nn.Linear(self.in_features, self.out_features, bias=self.has_bias, device="meta")
        lin.weight = nn.Parameter(w.clone(), requires_grad=self.tile(0, 0).weight.requires_grad)
        if self.has_bias:
            lin.bias = nn.Parameter(self.full_bias().detach().clone(), requires_grad=self.tile(0, 0).bias.requires_grad)
        return lin

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.has_bias}, "
                f"in_splits={self.in_splits}, out_splits={self.out_splits}")


def _tile_keys(module: TiledLinear, prefix: str):
    for k, tile in enumerate(module.tiles):
        yield f"{prefix}tiles.{k}.weight", tile.weight
        if tile.bias is not None:
            yield f"{prefix}tiles.{k}.bias", tile.bias


def _untiled_state_dict(module: TiledLinear, state_dict: dict, prefix: str, local_metadata) -> None:
    """Note [untiled names]: replace the tiles' entries by ``weight`` / ``bias``. Tiles that are
    not gathered (stage 3 between uses) hold empty placeholders, as an untiled parameter
    would: the entry is then an empty tensor too."""
    keep_vars = any(isinstance(v, nn.Parameter) for k, v in state_dict.items() if k.startswith(prefix + "tiles."))
    gathered = all(tile.weight.numel() > 0 for tile in module.tiles)
    for key, _ in _tile_keys(module, prefix):
        state_dict.pop(key, None)
    w0 = module.tile(0, 0).weight
    if gathered:
        weight, bias = module.full_weight(), module.full_bias()
    else:
        weight = w0.new_empty(0)
        bias = w0.new_empty(0) if module.has_bias else None
    state_dict[prefix + "weight"] = weight if keep_vars else weight.detach()
    if bias is not None:
        state_dict[prefix + "bias"] = bias if keep_vars else bias.detach()


def _tiled_load_state_dict(module: TiledLinear, state_dict: dict, prefix: str, local_metadata, strict,
                           missing_keys, unexpected_keys, error_msgs) -> None:
    """Note [untiled names]: cut ``weight`` / ``bias`` into the tiles' entries, so the tiles
    load them (with torch's own shape checks)."""
    weight = state_dict.pop(prefix + "weight", None)
    bias = state_dict.pop(prefix + "bias", None)
    if weight is None:
        return  # a state dict with the tiles' own names (or missing keys: torch reports them)
    if tuple(weight.shape) != (module.out_features, module.in_features):
        error_msgs.append(f"size mismatch for {prefix}weight: copying a param with shape {tuple(weight.shape)}, "
                          f"the shape in current model is {(module.out_features, module.in_features)}.")
        return
    for o, (olo, ohi) in enumerate(module.out_bounds):
        for i, (ilo, ihi) in enumerate(module.in_bounds):
            k = o * module.in_splits + i
            state_dict[f"{prefix}tiles.{k}.weight"] = weight[olo:ohi, ilo:ihi]
            if module.tile(o, i).bias is not None and bias is not None:
                state_dict[f"{prefix}tiles.{k}.bias"] = bias[olo:ohi]


class TiledEmbedding(nn.Module):
    """``nn.Embedding(num_embeddings, embedding_dim)`` held as ``splits`` tiles of vocabulary
    rows (the input embedding of an LLM is its largest single tensor). Each tile looks up the
    tokens whose ids fall in its rows and writes them into their places of the output: every
    token's row is copied, never summed, so the output and the rows' gradients equal
    ``nn.Embedding``'s (tested bitwise)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, splits: int = 1, padding_idx: Optional[int] = None,
                 device=None, dtype=None):
        super().__init__()
        _check_splits("num_embeddings (rows)", num_embeddings, splits)
        self.num_embeddings, self.embedding_dim, self.splits = num_embeddings, embedding_dim, splits
        self.padding_idx = padding_idx
        self.bounds = split_bounds(num_embeddings, splits)
        self.tiles = nn.ModuleList(
            nn.Embedding(hi - lo, embedding_dim, device=device, dtype=dtype,
                         padding_idx=padding_idx - lo if padding_idx is not None and lo <= padding_idx < hi else None,
                         _weight=torch.empty(hi - lo, embedding_dim, device=device, dtype=dtype) if _on_meta(device) else None)
            for lo, hi in self.bounds)
        self.register_state_dict_post_hook(_untiled_embedding_state_dict)
        self.register_load_state_dict_pre_hook(_tiled_embedding_load_state_dict)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise TokenIdError(f"TiledEmbedding: token ids must be in [0, {self.num_embeddings}), got "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        out = None
        for (lo, hi), tile in zip(self.bounds, self.tiles):
            mine = (ids >= lo) & (ids < hi)
            rows = tile(ids[mine] - lo)  # only this tile's tokens: no activation is held per tile
            if out is None:
                out = rows.new_zeros(*ids.shape, self.embedding_dim)
            out = out.index_put((mine,), rows)
        return out

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, splits: int) -> "TiledEmbedding":
        if not isinstance(emb, nn.Embedding):
            raise UsageError(f"TiledEmbedding.from_embedding expects an nn.Embedding, got {type(emb).__name__}")
        if emb.max_norm is not None or emb.sparse or emb.scale_grad_by_freq:
            raise UsageError("zero.tiling cannot tile an nn.Embedding with max_norm, sparse or scale_grad_by_freq; "
                             "raise zero.tiling.min_params above its size")
        w = emb.weight
        out = cls(emb.num_embeddings, emb.embedding_dim, splits, padding_idx=emb.padding_idx, device="meta")
        out.to_empty(device=w.device)
        out.to(w.dtype)
        with torch.no_grad():
            for (lo, hi), tile in zip(out.bounds, out.tiles):
                tile.weight.copy_(w.detach()[lo:hi])
                tile.weight.requires_grad_(w.requires_grad)
        return out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, splits={self.splits}"

    def __getattr__(self, name: str):
        if name == "weight":
            raise TiledWeightError(_NO_WHOLE.format(cls=type(self).__name__, name=name))
        return super().__getattr__(name)


def _untiled_embedding_state_dict(module: TiledEmbedding, state_dict: dict, prefix: str, local_metadata) -> None:
    keep_vars = any(isinstance(v, nn.Parameter) for k, v in state_dict.items() if k.startswith(prefix + "tiles."))
    for k in range(module.splits):
        state_dict.pop(f"{prefix}tiles.{k}.weight", None)
    w0 = module.tiles[0].weight
    if all(t.weight.numel() > 0 for t in module.tiles):
        weight = torch.cat([t.weight for t in module.tiles])
    else:
        weight = w0.new_empty(0)
    state_dict[prefix + "weight"] = weight if keep_vars else weight.detach()


def _tiled_embedding_load_state_dict(module: TiledEmbedding, state_dict: dict, prefix: str, local_metadata, strict,
                                     missing_keys, unexpected_keys, error_msgs) -> None:
    weight = state_dict.pop(prefix + "weight", None)
    if weight is None:
        return
    if tuple(weight.shape) != (module.num_embeddings, module.embedding_dim):
        error_msgs.append(f"size mismatch for {prefix}weight: copying a param with shape {tuple(weight.shape)}, "
                          f"the shape in current model is {(module.num_embeddings, module.embedding_dim)}.")
        return
    for k, (lo, hi) in enumerate(module.bounds):
        state_dict[f"{prefix}tiles.{k}.weight"] = weight[lo:hi]


# ---------------------------------------------------------------------------------------------
# zero.tiling: which modules are replaced, and how finely

COVERED = (nn.Linear, nn.Embedding)  # Note [what zero.tiling covers]


def linear_splits(in_features: int, out_features: int, bias: bool, max_tile_params: int) -> Tuple[int, int]:
    """(in_splits, out_splits) so that no tile has more than ``max_tile_params`` parameters.
    Output rows are split first (the forward stays bitwise: Note [tiled numerics]); input
    columns only when a single output row is too large."""
    per_row = in_features + (1 if bias else 0)
    if per_row <= max_tile_params:
        rows = max(1, max_tile_params // per_row)
        return 1, -(-out_features // rows)
    cols = max(1, max_tile_params - (1 if bias else 0))
    return -(-in_features // cols), out_features


def embedding_splits(num_embeddings: int, embedding_dim: int, max_tile_params: int) -> int:
    if embedding_dim > max_tile_params:
        raise UsageError(f"zero.tiling.max_tile_params={max_tile_params} is smaller than one embedding row "
                         f"({embedding_dim} parameters); embeddings are tiled by rows, so raise max_tile_params to at "
                         f"least {embedding_dim}")
    rows = max_tile_params // embedding_dim
    return -(-num_embeddings // rows)


def _shared_params(model: nn.Module) -> set:
    counts: dict = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[p] = counts.get(p, 0) + 1
    return {p for p, n in counts.items() if n > 1}


def _materialized(module: nn.Module):
    """Make the module's parameters full tensors: those built under infinity.Init are gathered,
    one module at a time, to be cut into tiles (their chunks stay in the Init store, unread,
    until it closes)."""
    for p in module.parameters(recurse=False):
        info = info_of(p)
        if info is not None and isinstance(info.unit, InitUnit):
            set_data(p, info.unit.materialize())


def tile_model(model: nn.Module, enabled: bool, min_params: int, max_tile_params: int) -> dict:
    """Note [what zero.tiling covers]: replace every module of exact type ``nn.Linear`` or
    ``nn.Embedding`` (subclasses may use their weight in other ways, e.g. attention's
    ``out_proj``) with more than ``min_params`` parameters, and more than ``max_tile_params``,
    by a ``TiledLinear`` / ``TiledEmbedding`` whose tiles have at most ``max_tile_params`` each.
    Other module types (e.g. Hugging Face GPT-2's ``Conv1D``) are not tiled; a parameter of one
    above the limit is named in a warning. Tied weights stay tied: embeddings are tiled first,
    an output layer tied to one gets the same row tiles (its tiles' weights are the embedding
    tiles' parameters) and another embedding tied to it becomes the same module; any other
    sharing is refused. Returns {replaced parameter: its tiles' parameters} for parameter groups."""
    if not enabled:
        return {}
    plan = _TilingPlan(model, min_params, max_tile_params)
    for kind in (nn.Embedding, nn.Linear):  # embeddings first: a head tied to one takes its tiles
        for parent_name, parent in list(model.named_modules()):
            for child_name, child in list(parent.named_children()):
                if type(child) is kind:
                    plan.visit(parent, child_name, f"{parent_name}.{child_name}" if parent_name else child_name)
    plan.warn_uncovered()
    left = {p for p in model.parameters()}
    kept = [p for p in plan.replaced if p in left]
    if kept:  # a replaced weight still used by a module tiling did not cover: the tie would break silently
        name = next(n for n, p in model.named_parameters(remove_duplicate=False) if p is kept[0])
        raise UsageError(f"zero.tiling replaced a weight that {name} still uses (a tie with a module it does not "
                         f"tile); untie them or raise zero.tiling.min_params above its size")
    return plan.replaced


class _TilingPlan:
    def __init__(self, model: nn.Module, min_params: int, max_tile_params: int):
        self.model, self.min_params, self.max_tile = model, min_params, max_tile_params
        self.shared = _shared_params(model)
        self.tiled: dict = {}  # an embedding's original weight -> its TiledEmbedding
        self.replaced: dict = {}

    def visit(self, parent: nn.Module, child_name: str, name: str) -> None:
        child = getattr(parent, child_name)
        total = sum(_numel(p) for p in child.parameters(recurse=False))
        tied = child.weight in self.tiled
        if not tied and (total <= self.min_params or total <= self.max_tile):
            return
        if child.weight in self.shared and not tied and not isinstance(child, nn.Embedding):
            raise UsageError(f"zero.tiling would tile {name} ({type(child).__name__}, {total} parameters) but its "
                             f"weight is shared with another module that zero.tiling cannot tile the same way; untie "
                             f"them or raise zero.tiling.min_params to at least {total}")
        _materialized(child)
        new = self._tied_version(name, child) if tied else self._tiled_version(child)
        olds, news = list(child.parameters()), list(new.parameters())
        setattr(parent, child_name, new)
        for p in olds:  # a weight's tiles are the 2-d parameters, a bias's the 1-d ones
            self.replaced.setdefault(p, [q for q in news if q.ndim == p.ndim])
        if isinstance(new, TiledEmbedding):
            self.tiled[child.weight] = new
        logger.info("zero.tiling: %s -> %s", name, new.extra_repr())

    def _tiled_version(self, module) -> nn.Module:
        if isinstance(module, nn.Embedding):
            return TiledEmbedding.from_embedding(module, embedding_splits(module.num_embeddings, module.embedding_dim,
                                                                          self.max_tile))
        in_splits, out_splits = linear_splits(module.in_features, module.out_features, module.bias is not None,
                                              self.max_tile)
        return TiledLinear.from_linear(module, in_splits=in_splits, out_splits=out_splits)

    def _tied_version(self, name: str, module) -> nn.Module:
        emb = self.tiled[module.weight]
        if isinstance(module, nn.Embedding):
            return emb  # the same module, as before tiling
        if (module.out_features, module.in_features) != (emb.num_embeddings, emb.embedding_dim):
            raise UsageError(f"zero.tiling: {name} shares its weight with an embedding of another shape; untie them "
                             f"or raise zero.tiling.min_params above the embedding's size")
        head = TiledLinear.from_linear(module, out_splits=emb.splits)
        for o, tile in enumerate(emb.tiles):  # tied again, tile by tile
            head.tile(o, 0).weight = tile.weight
        return head

    def warn_uncovered(self) -> None:
        for name, child in self.model.named_modules():
            if isinstance(child, (TiledLinear, TiledEmbedding)) or type(child) in COVERED:
                continue
            big = [pn for pn, p in child.named_parameters(recurse=False) if _numel(p) > self.max_tile]
            if big:
                logger.warning("zero.tiling: %s (%s) is not a covered type (exactly nn.Linear or nn.Embedding); its "
                               "%s is not tiled", name, type(child).__name__, ", ".join(big))


def _numel(p) -> int:
    info = info_of(p)
    return info.numel if info is not None else p.numel()


def retarget_groups(param_groups, replaced: dict):
    """Parameter groups naming a parameter that tiling replaced name its tiles' instead."""
    if not param_groups or not replaced:
        return param_groups
    out = []
    for group in param_groups:
        if not isinstance(group, dict) or "params" not in group:
            out.append(group)  # resolve_groups refuses it with its own message
            continue
        params = [group["params"]] if isinstance(group["params"], torch.Tensor) else list(group["params"])
        out.append({**group, "params": [q for p in params for q in replaced.get(p, [p])]})
    return out


# Note [operator working memory]: in stage 3 the device holds, while a module runs its
# backward, its gathered parameters and their full gradient (paper 002 §5.1.2's MSWM for the
# largest operator), plus the units the prefetcher gathers ahead (zero.prefetch.gather_depth).
# With a device_memory_limit, initialize checks the largest fetch unit against it before any
# store is built: a model whose largest operator cannot fit fails here, naming it and the
# zero.tiling setting that makes it fit, instead of in the middle of the first backward.


def working_memory_bytes(unit_numel: int, itemsize: int, gather_depth: int, persistent_bytes: int = 0) -> int:
    """Device bytes while the largest unit of ``unit_numel`` elements runs: it, the
    ``gather_depth`` units gathered ahead (each at most as large) and its gradient, beside the
    units that stay gathered (below zero.prefetch.persistence_threshold)."""
    return persistent_bytes + (2 + gather_depth) * unit_numel * itemsize


def tile_params_to_fit(limit: int, itemsize: int, gather_depth: int, persistent_bytes: int = 0) -> int:
    """The largest ``max_tile_params`` whose working memory fits in ``limit`` bytes."""
    return max(0, limit - persistent_bytes) // ((2 + gather_depth) * itemsize)


def unit_working_memory(units, itemsize: int, cfg) -> Tuple[str, int, int, int]:
    """(name, parameters, persistent bytes, working memory) of the largest stage-3 unit not persistent; ``units``:
    (name, full count, persistent: Note [persistent parameters] in _unit_plan.py; a pair: below the threshold)."""
    depth = cfg.zero.prefetch.gather_depth if cfg.zero.prefetch.enabled else 0
    threshold = cfg.zero.prefetch.persistence_threshold
    flagged = [(u[0], u[1], u[2] if len(u) > 2 else u[1] < threshold) for u in units]
    persistent = sum(n * itemsize for _, n, kept in flagged if kept)
    name, numel = max(((name, n) for name, n, kept in flagged if not kept), key=lambda u: u[1], default=("", 0))
    return name, numel, persistent, working_memory_bytes(numel, itemsize, depth, persistent) if numel else persistent


def check_working_memory(units, itemsize: int, cfg) -> None:
    """``units``: (module name, full count, persistent) of each stage-3 unit (Note [build order] in _initialize.py)."""
    limit = cfg.device_memory_limit
    if limit is None or not units:
        return
    name, numel, persistent, need = unit_working_memory(units, itemsize, cfg)
    if not numel or need <= limit:
        return
    depth = cfg.zero.prefetch.gather_depth if cfg.zero.prefetch.enabled else 0
    fit = tile_params_to_fit(limit, itemsize, depth, persistent)
    if fit < 1:
        raise DeviceOutOfMemory(
            f"device_memory_limit={limit} bytes cannot hold the {persistent} bytes of parameters that stay gathered "
            f"(below zero.prefetch.persistence_threshold) and one more parameter; raise device_memory_limit or lower "
            f"persistence_threshold")
    hint = ("tiling is on but this unit is not tiled (a type zero.tiling does not cover, or at most "
            "zero.tiling.min_params parameters): lower min_params, or max_tile_params to at most "
            f"{fit}" if cfg.zero.tiling.enabled else
            f"enable zero.tiling with max_tile_params at most {fit} (min_params below {numel})")
    raise DeviceOutOfMemory(
        f"the largest operator, {name or '<root>'} ({numel} parameters), needs {need} bytes of "
        f"device working memory in stage 3 (its gathered parameters, their gradient, {depth} unit(s) gathered "
        f"ahead and {persistent} bytes of parameters that stay gathered) but device_memory_limit is {limit} bytes; "
        f"{hint}, or raise device_memory_limit")


# ---------------------------------------------------------------------------------------------
# Note [untiled export]: checkpoints store each tile as the parameter it is (resume needs the
# same tiling), and record in their manifest, under "tiled", where each tile sits in the whole
# tensor: {untiled name: {"shape": [...], "parts": [[tile name, [[row_lo, row_hi], [col_lo,
# col_hi]]], ...]}} (1-d: one range), parts in row-major order. Both exports (the streamed
# ``python -m infinity.export`` and the live ``export_safetensors``) write the untiled names
# and shapes from it, so an exported tiled model loads into the untiled model.


def untiled_layout(model: nn.Module) -> dict:
    """Note [untiled export]: the layout of every tiled module of ``model``."""
    out = {}
    for mname, m in model.named_modules():
        prefix = f"{mname}." if mname else ""
        if isinstance(m, TiledLinear):
            out[prefix + "weight"] = {"shape": [m.out_features, m.in_features], "parts": [
                [f"{prefix}tiles.{o * m.in_splits + i}.weight", [list(rows), list(cols)]]
                for o, rows in enumerate(m.out_bounds) for i, cols in enumerate(m.in_bounds)]}
            if m.has_bias:
                out[prefix + "bias"] = {"shape": [m.out_features], "parts": [
                    [f"{prefix}tiles.{o * m.in_splits}.bias", [list(rows)]] for o, rows in enumerate(m.out_bounds)]}
        elif isinstance(m, TiledEmbedding):
            out[prefix + "weight"] = {"shape": [m.num_embeddings, m.embedding_dim], "parts": [
                [f"{prefix}tiles.{k}.weight", [list(rows), [0, m.embedding_dim]]] for k, rows in enumerate(m.bounds)]}
    return out


def untiled_names(names: List[str], layout: dict) -> Tuple[List[str], dict]:
    """``names`` (parameter names in order) with each tile's name replaced by its untiled
    name at the first tile's place; and {tile name: untiled name}."""
    owner = {part[0]: whole for whole, spec in layout.items() for part in spec["parts"]}
    out, seen = [], set()
    for n in names:
        n2 = owner.get(n, n)
        if n2 not in seen:
            seen.add(n2)
            out.append(n2)
    return out, owner


def untiled_pieces(spec: dict, tile_pieces: dict, itemsize: int) -> list:
    """The byte pieces of a whole tensor, in its row-major order, from its tiles' pieces
    (``tile_pieces[name]``: (source, byte offset, bytes) in the tile's own row-major order).
    A band of rows held by one tile is its pieces as they are; tiles side by side in a band
    are interleaved row by row."""
    bands: dict = {}
    for name, ranges in spec["parts"]:
        bands.setdefault(tuple(ranges[0]), []).append((ranges[1][0] if len(ranges) > 1 else 0, name, ranges))
    out: list = []
    for (rlo, rhi), parts in sorted(bands.items()):
        parts.sort()
        if len(parts) == 1:
            out.extend(tile_pieces[parts[0][1]])
            continue
        for r in range(rhi - rlo):
            for _, name, ranges in parts:
                row = (ranges[1][1] - ranges[1][0]) * itemsize
                out.extend(_byte_range(tile_pieces[name], r * row, (r + 1) * row))
    return out


def _byte_range(pieces: list, lo: int, hi: int) -> list:
    out, at = [], 0
    for src, off, n in pieces:
        a, b = max(lo, at), min(hi, at + n)
        if a < b:
            out.append((src, off + a - at, b - a))
        at += n
        if at >= hi:
            break
    return out
