"""Know before you run: the host memory and the step time of one run, from the engine's own bytes.

Note [run model]: for a model shape, a batch and a stage-3 placement on one node, this
predicts (1) the peak resident set of a rank and (2) the time of a training step and its
bottleneck, from the same numbers the engine uses:

- Host memory: the stores' plan (Note [one memory model] in _memory_plan.py, the very function
  the preflight calls, with a layout made from the shape; from ``infinity.estimate --step-time``,
  the plan of the table's row itself, ``Run.figures``: Note [planned by the engine] in _plan.py), the gathered buffers of the
  prefetch window and the largest unit's full gradient (002 eq. 4, MSWM), the activations
  and a baseline (interpreter, torch, transformers: ``BASELINE``). Activations without
  checkpointing, measured for Hugging Face GPT-2 blocks in fp32 (``scripts/check_run_model.py``
  prints the fit): at the peak of backward about ``ACT_PER_LAYER``·hd bytes per token and
  layer (forward saves ~22·hd floats; backward's transients add the rest) and
  ``ACT_LOGITS``·vocab for the logits, their log-softmax and their gradients; with
  checkpointing, 002 eq. 3 + eq. 5, the logits on top (the row's plan gives the largest unit's
  working memory and the table its eq. 3 + eq. 5, so that --step-time counts what the table
  counts). The hand-off outputs count as the parameter space or their
  cap, whichever is smaller (their typical figure, not the preflight's cap). The sum is the
  bytes in use; with glibc's heap (``zero.host_allocator: keep``) its retained pages come on
  top (0.5-0.7 GiB at the peak of GPT-2 124M on NVMe, Note [allocator retained pages] in
  _memory_plan.py); with the block cache (``release``, the default: Note [block cache] in
  native/host_alloc/host_alloc.cpp) at most 256 MiB of freed blocks do.
- Step time (002 §4): compute 6·Ψ·tokens + 12·nl·bsz·seq²·hd FLOPs per rank (8 and 16 with
  activation checkpointing: the forward runs twice), the blocks' share at the FLOP rate of a
  GPT-2 block (layer norms, attention, GELU MLP) forward and backward at the run's hidden size
  and sequence, the LM head's share (6·vocab·hd·tokens) at the rate of the logits' matmuls with
  their cross-entropy (a single MLP matmul, the earlier probe, leaves out attention, the norms
  and the 50257-wide softmax, which run below a matmul's rate on a CPU); the optimizer's Adam over the
  trainable shard at the measured elements/s; the NVMe bytes a step moves, counted as the stores
  move them (parameters: backward re-reads every unit and the step writes every shard, while
  the forward takes the step's hand-off; the optimizer: master weights and moments read past
  the host cache and all written; gradients written and read unless in host memory) at the
  measured read and write bandwidths. With an accelerator (Note [overlapped step] in
  _zero_optimizer.py): the forward takes the longer of its compute and the host->device copy
  of the parameter shards, the backward the longest of its compute, that copy again and the
  device->host copy of the fp32 gradient shards (separate copy engines, beside the kernels),
  at the measured PCIe rate; with the optimizer states off the device the host's Adam over
  the shard runs beside the next forward but for the first unit's (the token embedding's,
  updated inside ``step()``), so a step takes backward + Adam(head) + max(forward, Adam(rest))
  (backward + forward + Adam where it cannot overlap), and the disk's time hides under all of
  it: the step is the longer of the two. Without one (the device is the CPU) compute and Adam share the cores, so
  they add, and the disk's time hides under them only as far as the measured ``overlap``
  allows (a read beside a matmul loop: the share of the read's time the loop lost nothing
  to; on the 2-core machine of the figures, O_DIRECT at 2 GB/s slows the loop 1.7x):
  predicted = cpu + disk - overlap·min(cpu, disk). The host's own work comes on top, as two
  terms: the gradients' landing in their fp32 shards and the clipping norm's pass over them
  (12 bytes an element of the shard, at the measured rate of a large host copy, ``host_copy``),
  and the engine's work per fetch unit and step (hooks, holds, the trace, the reducer's and the
  update's bookkeeping: ``unit_s``, the slope of a step's seconds over its units between two
  models of tiny units through a real engine, times the run's ``units``, plus what is left at
  no unit, ``step_s``: the step's thread, its norm's agreement, its gate); without an
  accelerator both share the cores
  with compute and Adam; with one the landing runs beside backward, the units' work is issued
  beside the device's compute (each pass the longer of the two) and the norm is serial.
  Every term is a measured rate times a counted FLOP, element, byte or unit; nothing is fitted
  to the measured steps.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .._offload._layout import ALIGN_ELEMS, ParamSource, round_up
from .._offload._memory_plan import PARAM_HANDOFF
from .._offload._moments import file_bytes
from .._offload._optimizer_store import chunk_elems, head_elems
from .._offload._placement import GATHERED_REUSE, gradients_in_host, param_cache_elems
from .._offload._preflight import staging_buffers, store_plan
from .._offload._split import opt_host_upto
from .._runtime import _accelerator as acc
from .._runtime._log import logger
from .._runtime._tiers import Tier
from .._zero._zero_optimizer import _native_adam
from ..aio import aligned_empty
from ..config import AioConfig, Config
from ..optim._functional import torch_adam_step
from ._disk_probe import probe_disk
from ._estimate_model import _format_count

BASELINE = 450 << 20  # bytes: python + torch + transformers + the model's objects, measured on CPU hosts
ACT_PER_LAYER = 28 * 4  # bytes per token per layer per hidden unit, fp32 (Note [run model])
ACT_LOGITS = 1.6 * 4  # bytes per token per vocabulary entry, fp32 (Note [run model])
GiB = float(1 << 30)


@dataclass(frozen=True)
class Rates:
    """Per rank: FLOP/s of the device on the model's own layers, NVMe read / write bytes/s of
    its share of the node's drives, Adam elements/s of its share of the host's cores, and how
    much of the disk's time hides under computation (``overlap``: 1 with an accelerator, whose
    copies and the host's I/O run beside its kernels; measured where the device is the CPU),
    and the bytes/s of one direction of host<->device copies from pinned memory (``pcie``;
    unbounded where the device is the host)."""

    flops: float
    nvme_read: float
    nvme_write: float
    adam: float
    overlap: float = 1.0
    name: str = "measured"
    pcie: float = float("inf")
    host_copy: float = float("inf")  # bytes/s (read + written) of a large copy in host memory
    unit_s: float = 0.0  # seconds of the engine's host work per fetch unit and step
    step_s: float = 0.0  # seconds of the engine's host work per step, beside its units'

    @classmethod
    def measure(cls, nvme_path: Optional[str], run: Optional["Run"] = None, probe_bytes: int = 256 << 20) -> "Rates":
        """This machine, now (Note [run model]): the FLOP rate of one transformer block's
        forward and backward and of the LM head with its loss at the run's shapes, the native
        Adam over 8M elements, O_DIRECT reads and writes of ``probe_bytes`` under
        ``nvme_path``, and the share of a disk read that overlaps a matmul loop."""
        run = run or Run(params=0, layers=1, hidden=768, heads=12, vocab=50257, micro_batch=4, seq_len=256)
        flops = compute_rate(run)
        adam = adam_rate(out_dtype=torch.float32 if run.dtype == "fp32" else torch.bfloat16)
        host_copy, (unit_s, step_s) = host_copy_rate(), unit_seconds()
        pcie = pcie_rate() if acc.has_accelerator() else float("inf")
        read = write = float("inf")
        overlap = 1.0
        if nvme_path:
            bw = probe_disk(nvme_path, AioConfig(), probe_bytes)
            read, write = bw["read"], bw["write"]
            overlap = io_overlap(nvme_path, read, write, probe_bytes)
        return cls(flops=flops, nvme_read=read, nvme_write=write, adam=adam, overlap=overlap, pcie=pcie,
                   host_copy=host_copy, unit_s=unit_s, step_s=step_s)


def _rate(fn, reps: int = 3) -> float:
    """Calls per second: the median of ``reps`` timed calls after one untimed (a loaded
    machine's bursts move a median less than a mean or a best)."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1.0 / sorted(times)[len(times) // 2]


def adam_rate(n: int = 8 << 20, out_dtype: torch.dtype = torch.float32) -> float:
    """Elements/s of the step's Adam on this host, on the threads the engine gives it (its
    default: this rank's share of the cores, Note [rank placement] in _topology.py), writing the
    compute-dtype copy where the run's dtype is not fp32. With an accelerator over 64M elements
    (1 GiB of states: from memory, as a large model's are), else 8M (the CPU runs' models)."""
    native = _native_adam()
    n = max(n, 64 << 20) if acc.has_accelerator() else n
    p, g, m, v = (torch.rand(n) for _ in range(4))
    hyper = dict(step=1, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw=True)
    if native is None:
        return n * _rate(lambda: torch_adam_step(p, g, m, v, **hyper))
    out = None if out_dtype == torch.float32 else torch.empty(n, dtype=out_dtype)
    return n * _rate(lambda: native(p, g, m, v, params_out=out, **hyper))


def pcie_rate(nbytes: int = 256 << 20) -> float:
    """Bytes/s of one direction of host<->device copies from and to pinned memory (the slower
    of the two)."""
    host = aligned_empty(nbytes, torch.uint8, what="other")  # pinned: the engine's own host buffers are
    dev = torch.empty(nbytes, dtype=torch.uint8, device=acc.device())

    def copy(dst, src):
        def run():
            dst.copy_(src, non_blocking=True)
            acc.synchronize()
        return run

    return nbytes * min(_rate(copy(dev, host)), _rate(copy(host, dev)))


def host_copy_rate(nbytes: int = 256 << 20) -> float:
    """Bytes/s, read and written together, of a copy between two large host tensors (what
    landing a gradient in its shard moves)."""
    src, dst = torch.rand(nbytes // 4), torch.empty(nbytes // 4)
    return 2 * nbytes * _rate(lambda: dst.copy_(src))


UNIT_PROBE = ((8, 32), 384)  # tiny fetch units: linear layers of 384 x 384 (above the persistence threshold)


def unit_seconds() -> tuple:
    """(seconds per fetch unit and step, seconds per step) of the engine's host work (Note [run
    model]): steps of models of tiny linear layers at stage 3, every state in host memory, their
    compute negligible, through ``infinity.initialize`` itself, at two depths: the slope per unit
    and what is left at no unit (the step's own work: its thread, the norm's agreement, the gate)."""
    (few, many), width = UNIT_PROBE
    (u1, t1), (u2, t2) = _probe_step(few, width), _probe_step(many, width)
    per_unit = max(0.0, (t2 - t1) / max(1, u2 - u1))
    return per_unit, max(0.0, t1 - u1 * per_unit)


def _probe_step(layers: int, width: int, steps: int = 3) -> tuple:
    """(fetch units, median seconds of a step) of ``layers`` linear layers through the engine."""
    from .._zero._initialize import close, initialize  # the engine itself, built only when rates are measured

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    cfg = {"zero": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
           "precision": {"dtype": "fp32"}}
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))  # a probe's engine: its placement lines are not the run's
    try:
        model, opt = initialize(model, config=cfg)
    finally:
        logger.setLevel(level)
    x = torch.rand(2, width, device=acc.device())

    def step():
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        opt.wait_step()

    try:
        return len(opt.ops.units), 1.0 / _rate(step, reps=steps)
    finally:
        close(model)


PROBE_MAX_HIDDEN = 2048  # wider blocks are probed at this width (their matmuls only run faster)
PROBE_MAX_TOKENS = 4096


def compute_flops(run: "Run") -> tuple:
    """(FLOPs of the blocks, FLOPs of the LM head) of one step (002 §4): 6 per parameter and
    token, the attention's 12·bsz·seq²·hd per layer, twice the forward's under checkpointing."""
    passes = 8 if run.ckpt_interval else 6  # forward, backward (2x), and the forward again under checkpointing
    head = passes * run.vocab * run.hidden * run.tokens
    blocks = passes * max(0, run.params - run.vocab * run.hidden) * run.tokens
    blocks += 2 * passes * run.layers * run.micro_batch * run.seq_len**2 * run.hidden
    return blocks, head


def compute_rate(run: "Run") -> float:
    """FLOP/s of this run's own arithmetic on this machine: a GPT-2 block (layer norms, fused
    qkv, causal attention, the 4·hd MLP with GELU) forward and backward at the run's hidden
    size, batch and sequence, and the LM head with its cross-entropy at the run's vocabulary;
    each timed alone, weighted by its share of the step's FLOPs (Note [run model])."""
    hd = min(run.hidden, PROBE_MAX_HIDDEN)
    bsz = max(1, min(run.micro_batch, PROBE_MAX_TOKENS // max(1, run.seq_len)))
    seq = min(run.seq_len, PROBE_MAX_TOKENS)
    probe = Run(params=12 * hd * hd + (run.vocab or 0) * hd, layers=1, hidden=hd, heads=max(1, hd // 64), vocab=run.vocab or 0,
                micro_batch=bsz, seq_len=seq, ckpt_interval=0)
    g = torch.Generator().manual_seed(0)
    dev = acc.device()  # the accelerator's rate where there is one, in the run's dtype
    dtype = torch.float32 if run.dtype == "fp32" or not acc.has_accelerator() else torch.bfloat16

    def leaf(*shape, scale=0.02):
        return (torch.randn(*shape, generator=g) * scale).to(dev, dtype).requires_grad_()

    w = {n: leaf(*s) for n, s in (("qkv", (hd, 3 * hd)), ("proj", (hd, hd)), ("fc", (hd, 4 * hd)), ("out", (4 * hd, hd)))}
    x = leaf(bsz, seq, hd, scale=1.0)
    heads = probe.heads

    def block():
        h = F.layer_norm(x, (hd,))
        q, k, v = (h @ w["qkv"]).view(bsz, seq, 3, heads, hd // heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(bsz, seq, hd)
        y = x + a @ w["proj"]
        y = y + F.gelu(F.layer_norm(y, (hd,)) @ w["fc"], approximate="tanh") @ w["out"]
        y.sum().backward()
        acc.synchronize()

    t_block = 1.0 / _rate(block)
    blocks, head = compute_flops(probe)
    t_head = 0.0
    if run.vocab:
        emb = leaf(run.vocab, hd)
        labels = torch.randint(run.vocab, (bsz * seq,), generator=g).to(dev)

        def lm_head():
            F.cross_entropy((x.view(-1, hd) @ emb.t()).float(), labels).backward()
            acc.synchronize()

        t_head = 1.0 / _rate(lm_head)
    # The run's FLOPs at the probe's rates: blocks at the block's, the head at the head's.
    run_blocks, run_head = compute_flops(run)
    seconds = run_blocks * t_block / blocks + (run_head * t_head / head if head else 0.0)
    return (run_blocks + run_head) / seconds


def io_overlap(nvme_path: str, read: float, write: float, nbytes: int = 256 << 20) -> float:
    """The share of an O_DIRECT read's time that a matmul loop on the same cores hides: 1 when
    the loop runs no slower beside the read, 0 when the two take as long as one after the other
    (Note [run model]). ``read`` and ``write``: the disk's bytes/s alone."""
    a, b = torch.randn(1024, 768), torch.randn(768, 3072)
    alone = _rate(lambda: [a @ b for _ in range(8)], reps=5)  # loops/s
    done, loops = threading.Event(), [0]

    def spin():
        while not done.is_set():
            [a @ b for _ in range(8)]
            loops[0] += 1

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    start = time.perf_counter()
    probe_disk(nvme_path, AioConfig(), nbytes)
    wall = time.perf_counter() - start
    done.set()
    t.join()
    disk = 3 * nbytes * (1 / read + 1 / write)  # the probe's I/O alone (PROBE_REPS writes and reads)
    lost = max(0.0, wall - loops[0] / alone)  # the compute the loop did not get done in the window
    return float(min(1.0, max(0.0, 1.0 - lost / disk)))


# Projections (per GPU; Note [run model]). DGX-2 as ZeRO-Infinity states it (002 §5.2, §6.1,
# footnote 6, Fig. 2b, Fig. 5c): 16 V100 with 32 GB, 1.5 TB of host memory; 70 TFLOP/s peak
# achievable, of which its largest single-node models reached 40-49 (we use 45); NVMe about
# 25 GB/s per node, 1.6 GB/s per GPU when all read at once (the paper gives no separate write
# figure: the same is assumed). CPU Adam (an assumption: the paper gives no rate): memory-bound
# at ~28 bytes per element over about half of two sockets' DDR4 (~256 GB/s), ~4e9 elements/s
# per node.
# V100s on PCIe Gen3 x16: ~12 GB/s each way from pinned memory.
DGX2 = Rates(flops=45e12, nvme_read=25e9 / 16, nvme_write=25e9 / 16, adam=4e9 / 16, name="DGX-2 (002)", pcie=12e9)
# 8 x H100 SXM 80 GB, 2 TB host (DGX H100 datasheet); ~400 TFLOP/s of 989 dense bf16 reached
# (an assumed 40% of peak); its 8 x 3.84 TB U.2 PCIe Gen4 NVMe (datasheet) in RAID 0 at an
# assumed ~6.5 GB/s read and ~3.5 GB/s write per drive (Gen4 data-center drives' sequential
# figures), ~52 / 28 GB/s together; CPU Adam over two sockets' DDR5 (~600 GB/s), ~1e10/s.
# PCIe Gen5 x16 per GPU: ~45 GB/s each way from pinned memory (of 64 GB/s raw).
H100_RAID = Rates(flops=400e12, nvme_read=52e9 / 8, nvme_write=28e9 / 8, adam=1e10 / 8, name="8xH100 + NVMe RAID",
                  pcie=45e9)
# The nodes themselves, for the memory estimate of the same run: (GPUs, GPU memory, host memory, NVMe).
NODES = {"dgx2": (DGX2, 16, "32GB", "1.5TB", "28TB"), "h100x8": (H100_RAID, 8, "80GB", "2TB", "30.72TB")}


@dataclass(frozen=True)
class Figures:
    """A planned placement's figures (``figures_of`` in _plan.py: the plan the estimator's table
    shows), which a run of a shape otherwise derives (``_layout``): the optimizer's flat
    elements, the largest unit (full) and its shard, the swap chunk, the host cache, whether
    gradients stay in host memory, the parameter cache, the parameter source and the stores'
    bytes (tier -> category -> bytes); and the device's working memory of the largest unit and the
    activations, as the table counts them (None: the run model's own figures)."""

    total: int
    largest: int
    max_shard: int
    chunk: int
    head: int
    grads_in_memory: bool
    param_cache: int
    param_source: str
    categories: dict
    working: Optional[int] = None  # the plan's (Note [operator working memory] in _zero/_tiling.py)
    activations: Optional[int] = None  # the table's: 002 eq. 3 and eq. 5 at the run's checkpoint interval


@dataclass(frozen=True)
class Run:
    """One stage-3 run per rank: model shape, batch, dtype, where the states live."""

    params: int
    layers: int
    hidden: int
    heads: int
    vocab: int
    micro_batch: int
    seq_len: int
    dtype: str = "fp32"
    param_tier: str = "nvme"
    optimizer_tier: str = "nvme"
    ranks: int = 1
    device_is_host: bool = True
    ckpt_interval: int = 0  # 0: no activation checkpointing
    host_mem: int = 0  # bytes of host memory per node, for the gradients' "auto" rule; 0: this machine's
    moments: str = "fp32"  # zero.offload_optimizer.moments (Note [compressed moments] in _moments.py)
    host_allocator: str = "release"  # zero.host_allocator: with release the host cache is read again each step
    opt_host_fraction: float = 0.0  # an NVMe optimizer tier's host share (Note [split tiers] in _offload/_split.py)
    param_host_fraction: float = 0.0  # an NVMe parameter tier's host share
    speculate: bool = False  # zero.offload_optimizer.speculate: the update begins during backward
    units: int = 0  # fetch units (0: a GPT's, two a block and three more: Note [fetch unit grouping] in _unit_plan.py)
    clip: bool = True  # gradient_clipping set: the step computes the gradients' norm
    figures: Optional[Figures] = None  # the estimator's plan of this run, where it made one

    def __post_init__(self) -> None:
        for name in ("param_tier", "optimizer_tier"):  # the config's words: none for the device tier
            object.__setattr__(self, name, {"device": "none"}.get(getattr(self, name), getattr(self, name)))

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "fp32" else 2

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len


def _layout(run: Run):
    """The numbers a real layout would give the store plan: shard sizes, the largest unit
    (the embedding of a GPT, or the MLP's 4·hd² matrix), the chunk, the host cache."""
    z = Config().zero
    f = run.figures
    if f is not None:  # the plan the estimator made
        return z, f.total, f.largest, f.max_shard, f.chunk, f.head, f.grads_in_memory
    largest = max(run.vocab * run.hidden, 4 * run.hidden * run.hidden)
    shard = math.ceil(run.params / run.ranks)
    total = round_up(shard, ALIGN_ELEMS)
    max_shard = math.ceil(largest / run.ranks)
    chunk = chunk_elems(z.offload_optimizer.chunk_size, total)
    head = head_elems(z.offload_optimizer.host_cache, [(0, max_shard)], chunk, total)
    if run.host_mem:  # the rule of gradients_in_host, for another machine
        grads_in_memory = run.optimizer_tier == "nvme" and 4 * total * run.ranks <= run.host_mem // 4
    else:
        grads_in_memory = run.optimizer_tier == "nvme" and gradients_in_host("auto", total)
    return z, total, largest, max_shard, chunk, head, grads_in_memory


def host_memory(run: Run) -> dict:
    """Bytes of a rank's peak resident set by category (Note [run model])."""
    z, total, largest, max_shard, chunk, head, gim = _layout(run)
    isz = run.itemsize
    direct = run.ranks == 1 and run.device_is_host
    plan = run.figures.categories if run.figures is not None else store_plan(
        opt_tier=Tier.of(run.optimizer_tier), param_tier=Tier.of(run.param_tier), opt_total=total, param_total=total,
        itemsize=isz, overlapped=run.param_tier == "nvme" or run.optimizer_tier == "nvme", lazy_grad=False,
        chunk=chunk, head=head, grads_in_memory=gim, staging_numel=max_shard,
        staging_count=0 if direct else staging_buffers(z), param_source=_param_source(run),
        param_cache=_param_cache(run, total), gathered_bytes=GATHERED_REUSE * largest * isz if run.device_is_host else 0,
        moments=run.moments, opt_host_upto=opt_host_upto(run.opt_host_fraction, total, chunk) if run.optimizer_tier ==
        "nvme" else 0, param_host_upto=int(run.param_host_fraction * total) if run.param_tier == "nvme" else 0)
    out = dict(plan["host"])
    if PARAM_HANDOFF in out:
        out[PARAM_HANDOFF] = min(out[PARAM_HANDOFF], total * isz)  # typical: at most the parameter space
    device = dict(plan["device"])
    # The largest unit's full gradient (heap), and gathered units beyond what the recycler keeps:
    # the largest unit and the prefetch window of block matrices (4·hd² each); the plan's, where it made one.
    window = (largest + (z.prefetch.depth + 1) * 4 * run.hidden**2) * isz
    f = run.figures
    own = largest * isz + max(0, window - device.get("gathered", 0))
    device["working"] = own if f is None or f.working is None else f.working
    device["activations"] = activation_bytes(run) if f is None or f.activations is None else f.activations
    device["logits"] = logits_bytes(run)
    if run.device_is_host:
        out.update({f"device_{k}": v for k, v in device.items()})
    out["baseline"] = BASELINE
    return out


def activation_bytes(run: Run) -> int:
    """The blocks' activations at the peak of backward, per rank (Note [run model]; the logits: ``logits_bytes``)."""
    if run.ckpt_interval:  # 002 eq. 3 (the checkpoints) and eq. 5 (one interval recomputed), 2-byte figures
        ckpt = 2 * run.tokens * run.hidden * math.ceil(run.layers / run.ckpt_interval)
        awm = run.tokens * run.ckpt_interval * (16 * run.hidden + 2 * run.heads * run.seq_len)
        return int((ckpt + awm) * run.itemsize / 2)
    return int(run.tokens * run.itemsize / 4 * ACT_PER_LAYER * run.layers * run.hidden)


def logits_bytes(run: Run) -> int:
    """The logits, their log-softmax and their gradients at the peak of backward, per rank (Note [run model])."""
    return int(ACT_LOGITS * run.vocab * run.tokens * run.itemsize / 4)


def _param_cache(run: Run, total: int) -> int:
    """Elements of the automatic parameter cache (Note [parameter cache] in _nvme_param_store.py)."""
    if run.figures is not None:
        return run.figures.param_cache
    if run.param_tier != "nvme" or _param_source(run) is ParamSource.MASTER:
        return 0
    return param_cache_elems(None, total, run.itemsize, available=run.host_mem or None, ranks=run.ranks)


def _param_source(run: Run) -> ParamSource:
    """Where the run's parameter shards are kept, by the engine's own rule (Note [parameters
    from the master] in _placement.py), for a model without frozen parameters."""
    if run.figures is not None:
        return ParamSource(run.figures.param_source)
    return ParamSource.of(partitioned=True, fp32=run.dtype == "fp32", same_spaces=True,
                          opt_tier=Tier.of(run.optimizer_tier), param_tier=Tier.of(run.param_tier),
                          device_is_host=run.device_is_host)


def nvme_bytes(run: Run) -> dict:
    """NVMe bytes a rank moves per step, as its stores move them (Note [run model])."""
    _, total, _, _, chunk, head, gim = _layout(run)
    per_elem = 4 + 2 * file_bytes(run.moments, total, chunk) / total  # master + both moments as stored
    read = write = 0
    source = _param_source(run)
    if run.param_tier == "nvme" and source is not ParamSource.MASTER:
        # backward's re-reads of what the parameter cache does not hold; the forward takes the step's hand-off;
        # a split's host share is neither read nor written (Note [split tiers] in _offload/_split.py)
        on_disk = total - int(run.param_host_fraction * total)
        read += max(0, on_disk - _param_cache(run, total)) * run.itemsize
        write += 0 if source is ParamSource.MASTER_FILE else on_disk * run.itemsize  # the optimizer's master write
    if run.optimizer_tier == "nvme":
        owned = opt_host_upto(run.opt_host_fraction, total, chunk)  # in host memory only
        cached = max(min(head, total), owned) - owned  # the head is whole chunks: it may end past the last element
        states = int(per_elem * (total - owned - cached))
        read += states
        if run.host_allocator == "release":  # the host cache gave its pages back through forward: read again
            read += int(per_elem * cached)  # before the update (Note [host cache] in _nvme_optimizer_store.py)
        # the host cache is write-through (Note [host cache] in _nvme_optimizer_store.py)
        write += states + int(per_elem * cached)
        if not gim:
            read += 4 * (total - owned - cached)
            write += 4 * (total - owned - cached)
    return {"read": read, "write": write}


def step_time(run: Run, rates: Rates) -> dict:
    """Seconds per step: each term, the prediction and the bottleneck (Note [run model])."""
    flops = sum(compute_flops(run))
    io = nvme_bytes(run)
    shard = math.ceil(run.params / run.ranks)
    host_adam = run.device_is_host or run.optimizer_tier != "none"
    terms = {"compute": flops / rates.flops, "adam": shard / rates.adam if host_adam else 0.0,
             "nvme_read": io["read"] / rates.nvme_read, "nvme_write": io["write"] / rates.nvme_write,
             "grad_landing": 8 * shard / rates.host_copy if host_adam else 0.0,  # read the gradient, write its shard
             "norm": 4 * shard / rates.host_copy if host_adam and run.clip else 0.0,
             "units": (run.units or 2 * run.layers + 3) * rates.unit_s + rates.step_s}
    disk = terms["nvme_read"] + terms["nvme_write"]  # one device: reads and writes share it
    if run.device_is_host:
        cpu = terms["compute"] + terms["adam"] + terms["grad_landing"] + terms["norm"] + terms["units"]  # the same cores
        terms["hidden_io"] = rates.overlap * min(cpu, disk)  # the disk time the cores' work hides
        predicted = cpu + disk - terms["hidden_io"]
        bottleneck = "compute" if terms["compute"] >= max(terms["adam"], disk) else (
            "adam" if terms["adam"] >= disk else "nvme")
    else:
        predicted, bottleneck = _on_accelerator(run, rates, terms, shard, disk)
    return {**terms, "flops": flops, "nvme_bytes": io, "predicted": predicted, "bottleneck": bottleneck,
            "tokens_per_s": run.tokens * run.ranks / predicted, "tflops_per_rank": flops / predicted / 1e12}


def _on_accelerator(run: Run, rates: Rates, terms: dict, shard: int, disk: float) -> tuple:
    """(step seconds, bottleneck) with an accelerator (Note [run model]); adds the forward,
    backward and PCIe terms to ``terms``."""
    forward_share = 2 / 8 if run.ckpt_interval else 1 / 3  # checkpointing runs the forward again inside backward
    h2d = shard * run.itemsize / rates.pcie if run.param_tier != "none" else 0.0  # each pass fetches the shards
    d2h = shard * 4 / rates.pcie if run.optimizer_tier != "none" else 0.0  # the fp32 gradient shards
    units = terms["units"]  # issued by the host while the device computes: each pass takes the longer
    terms.update(h2d=h2d, d2h=d2h, forward=max(terms["compute"] * forward_share, h2d, units * forward_share),
                 backward=max(terms["compute"] * (1 - forward_share), h2d, d2h, terms["grad_landing"],
                              units * (1 - forward_share)))
    overlapped = run.optimizer_tier != "none"  # Note [overlapped step] in _zero_optimizer.py: beside the next forward
    terms["overlapped"] = overlapped
    # the first unit (the token embedding) is updated inside step(), before the rest goes to the background
    terms["adam_head"] = terms["adam"] * min(1.0, run.vocab * run.hidden / max(1, run.params)) if overlapped else 0.0
    rest = terms["adam"] - terms["adam_head"]
    # Note [speculative update] in _zero/_speculative_update.py: the rest's pieces are updated while backward runs,
    # as much of it as backward lasts (the embedding's gradient lands last: its update stays inside step())
    terms["adam_in_backward"] = min(rest, terms["backward"]) if overlapped and run.speculate else 0.0
    host = terms["backward"] + terms["norm"] + (
        terms["adam_head"] + max(terms["forward"], rest - terms["adam_in_backward"]) if overlapped
        else terms["forward"] + terms["adam"])
    work = {"compute": terms["compute"], "pcie": max(h2d, d2h), "adam": terms["adam"]}
    if disk >= host:
        return disk, "nvme"
    return host, max(work.items(), key=lambda kv: kv[1])[0]


def describe(run: Run, rates: Rates) -> str:
    mem = host_memory(run)
    st = step_time(run, rates)
    lines = [f"run: {_format_count(run.params)} parameters, {run.micro_batch} x {run.seq_len} tokens per rank, "
             f"{run.dtype}, offload_param {run.param_tier}, offload_optimizer {run.optimizer_tier}, "
             f"{run.ranks} rank(s)",
             f"rates ({rates.name}): {rates.flops / 1e9:.0f} GFLOP/s, NVMe read {rates.nvme_read / 1e9:.2f} GB/s, "
             f"write {rates.nvme_write / 1e9:.2f} GB/s, Adam {rates.adam / 1e6:.0f} M elements/s",
             f"predicted step: {st['predicted']:.2f} s ({st['tokens_per_s']:.0f} tokens/s, {st['tflops_per_rank']:.2f} "
             f"TFLOP/s per rank), bottleneck: {st['bottleneck']} "
             f"(compute {st['compute']:.2f} s, adam {st['adam']:.2f} s, NVMe read {st['nvme_read']:.2f} s of "
             f"{st['nvme_bytes']['read'] / GiB:.2f} GiB, write {st['nvme_write']:.2f} s of "
             f"{st['nvme_bytes']['write'] / GiB:.2f} GiB; the host's own work: gradients landing "
             f"{st['grad_landing']:.2f} s, norm {st['norm']:.2f} s, per unit and step {st['units']:.2f} s)"]
    if not run.device_is_host:
        lines.append(f"on the accelerator: forward {st['forward']:.3f} s, backward {st['backward']:.3f} s (PCIe "
                     f"{rates.pcie / 1e9:.0f} GB/s: parameters in {st['h2d']:.3f} s a pass, gradients out "
                     f"{st['d2h']:.3f} s), Adam {st['adam']:.3f} s of which {st['adam_head']:.3f} s inside step() and "
                     + ("the rest beside the next forward" if st["overlapped"] else "none beside the forward"))
    if run.device_is_host:
        lines.append(f"predicted peak RSS per rank: {sum(mem.values()) / GiB:.2f} GiB ("
                     + ", ".join(f"{k} {v / GiB:.2f}" for k, v in sorted(mem.items(), key=lambda kv: -kv[1]) if v) + ")")
    return "\n".join(lines)


def to_dict(run: Run, rates: Rates) -> dict:
    return {"run": asdict(run), "rates": asdict(rates), "host_memory": host_memory(run), "step": step_time(run, rates)}
