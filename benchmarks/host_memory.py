"""Where host memory goes: GPT-2 124M, fp32, 4 x 256 tokens, everything on NVMe, against plain PyTorch.

Each contender runs in its own process (its peak resident set is its own), rounds rotated
(Note [contender rounds] in _harness.py):

  plain    plain PyTorch with glibc's default allocator, as users run it (fp32 AdamW and clipping;
           in bf16, fp32 weights and AdamW under autocast, as the Hugging Face Trainer runs it)
  before   with --before-tree: infinity from that checkout (e.g. ``git archive <commit>`` with the
           native libraries copied in), ``zero.host_allocator`` --before-allocator
  release  infinity from this checkout, the default ``zero.host_allocator``: the block cache of
           Note [block cache] in native/host_alloc/host_alloc.cpp keeping at most 256 MiB of freed
           blocks, and the optimizer's host cache released through forward
  cache    the block cache keeping every freed block
  keep     glibc's heap (Note [allocator retained pages] in infinity/_offload/_memory_plan.py)

Every step is timed, with its minor page faults (the cost of releasing: ``extra.minor_faults``).
``host_peak_gib`` is the whole process's peak, ``Init`` and ``initialize`` included
(``extra.host_peak_since`` "start"). ``extra.accounts`` (Note [one memory model] in
infinity/_offload/_memory_plan.py): the host account after the first measured forward and step,
at the peak of the resident set (a thread samples it every 20 ms) and at the end: the engine's
buffers by category as resident and mapped (Note [released pages] in infinity/aio/_memory.py),
the C heap in use and retained, the block cache's blocks in use and cached, the rest; and the
plan's figures. Ratios: each against plain, each against keep, release against before.

``--toggle-steps N``: also N pairs of steps in one process each (the default configuration),
alternating torch's blocks from the block cache and from glibc's heap (contenders
``blocks-from-cache``, ``blocks-from-heap``), then the optimizer's host cache released through
forward and kept (``host-cache-released``, ``host-cache-kept``).

    python -m benchmarks.host_memory [--rounds 2] [--steps 3] [--micro-batch 4 --seq-len 256] [--before-tree DIR]
    python -m benchmarks.host_memory --rounds 1 --steps 2 --only plain,release --model-defaults [--dtype bf16]
"""
from __future__ import annotations

import resource
import sys
import time

from . import _flags, _harness, _models
from ._harness import Cell

BENCH = "host_memory"
ALLOCATOR = {"release": "release", "cache": "cache", "keep": "keep"}  # contender -> zero.host_allocator
CONTENDERS = ("plain", "before", "release", "cache", "keep")
TOGGLES = {"allocator": ("blocks-from-cache", "blocks-from-heap"), "host_cache": ("host-cache-released", "host-cache-kept")}
PAIRS = tuple((k, "plain") for k in CONTENDERS[1:]) + (("release", "keep"), ("cache", "keep"), ("release", "before")) \
    + tuple(TOGGLES.values())


class PeakSampler:
    """Samples the host account every ``period`` seconds on a thread and keeps the sample of
    the largest resident set: the account at the peak, not at the end of a phase."""

    def __init__(self, period: float = 0.02):
        import threading

        self.period, self.best = period, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from infinity.testing import host_account

        while not self._stop.wait(self.period):
            acct = host_account()
            if self.best is None or acct["rss"] > self.best["rss"]:
                self.best = acct

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return self.best


def toggle(spec: dict, opt, i: int) -> None:
    """Before step ``i`` of a toggling run: odd steps the second way, even steps the first."""
    if spec.get("toggle") == "allocator":  # odd: torch's blocks from glibc's heap; even: from the block cache
        from infinity.testing import RELEASE_CACHE_CAP, stop_block_cache, use_block_cache

        if i % 2:
            stop_block_cache()
        elif i:  # the engine installed it for step 0
            use_block_cache(RELEASE_CACHE_CAP)
    elif spec.get("toggle") == "host_cache":  # odd: the host cache kept through forward; even: released and
        opt.engine.opt_store.release_cache = not i % 2  # read again (Note [host cache] in _nvme_optimizer_store.py)


def contender_of(spec: dict):
    import torch

    shape = _models.Shape.of(spec["layers"], spec["hidden"])
    if spec["kind"] == "plain":
        model = _models.build(shape, user_defaults=spec["model_defaults"])
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    import infinity

    from ._trainers import InfinityTrainer, infinity_config

    # release, the default, is Note [block cache] in host_alloc.cpp
    cfg = infinity_config("nvme", spec["dtype"], spec["scratch"], optimizer={"lr": 1e-4},
                          zero={"host_allocator": spec["allocator"]})
    with infinity.Init(config=cfg):
        model = _models.build(shape, user_defaults=spec["model_defaults"])
    trainer = InfinityTrainer(model, cfg)
    return trainer.model, trainer.opt


def account_steps(spec: dict, model, opt) -> dict:
    import torch

    from infinity.testing import host_account

    plain = spec["kind"] == "plain"
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=plain and spec["dtype"] == "bf16")
    out = {"times": [], "faults": [], "accounts": {}}
    sampler = PeakSampler()
    batches = _models.batches(_models.Shape.of(spec["layers"], spec["hidden"]), spec["micro_batch"], spec["seq_len"],
                              spec["warmup"] + spec["steps"], seed=0)
    for i, ids in enumerate(batches):
        toggle(spec, opt, i)
        t0, f0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        if not plain and i == spec["warmup"]:
            out["accounts"]["after_forward"] = host_account()
        loss.backward()
        if plain:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        out["times"].append(time.perf_counter() - t0)
        out["faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        if not plain and i == spec["warmup"]:
            out["accounts"]["after_step"] = host_account()
    out["accounts"]["at_peak"] = sampler.stop()
    return out


def measure(spec: dict) -> dict:
    _harness.use_tree(spec.get("tree"))  # "before": infinity from another checkout
    import statistics

    import torch

    from infinity.testing import host_account

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model, opt = contender_of(spec)
    run = account_steps(spec, model, opt)
    extra = {"host_peak_since": "start", "accounts": run["accounts"]}
    if spec["kind"] != "plain":
        opt.wait_step()
        extra["accounts"]["end"] = host_account()
        extra["plan"] = opt.engine.memory_plan["categories"]
        opt.engine.close()
    w = spec["warmup"]
    if spec.get("toggle"):
        first, second = TOGGLES[spec["toggle"]]
        return _harness.side_by_side({first: _harness.sample(run["times"][w::2]),  # even steps, odd steps
                                      second: _harness.sample(run["times"][w + 1::2])})
    extra["minor_faults"] = statistics.median(run["faults"][w:])
    return _harness.sample(run["times"][w:], dtype=spec["dtype"], host_peak=_flags.host_peak_bytes(),
                           tokens_per_step=spec["micro_batch"] * spec["seq_len"], extra=extra)


def fault_cost(mib: int = 256, reps: int = 5) -> float:
    """Seconds per minor page fault on this machine: filling a fresh mapping of ``mib`` MiB
    (every page faults in) minus refilling it, divided by the faults counted; best of ``reps``."""
    import torch

    best = float("inf")
    for _ in range(reps):
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        t = torch.empty(mib << 18)  # float32: mib MiB, above any mmap threshold: a mapping of its own
        t.fill_(1.0)
        fresh, faults = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        t0 = time.perf_counter()
        t.fill_(2.0)
        best = min(best, (fresh - (time.perf_counter() - t0)) / max(faults, 1))
        del t
    return best


def main(argv=None) -> int:
    p = _flags.parser(__doc__, steps=3, warmup=1, seq_len=256, micro_batch=4, only="plain,before,release,cache,keep",
                      rounds=2, timeout=3600.0, budget=4 * 3600.0)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="infinity's precision.dtype; plain PyTorch runs bf16 as fp32 weights under autocast")
    p.add_argument("--model-defaults", action="store_true",
                   help="the model as users build it: GPT2Config()'s dropout and use_cache (default: both off)")
    p.add_argument("--before-tree", help="a checkout of an earlier commit (native libraries built) to run as 'before'")
    p.add_argument("--before-allocator", default="keep", choices=("keep", "release", "cache"),
                   help="zero.host_allocator of 'before' (keep: trees older than the block cache)")
    p.add_argument("--toggle-steps", type=int, default=0, help="also N pairs of alternating steps (module doc)")
    args = _harness.parse(p, measure, argv)
    if args.smoke:
        args.layers, args.hidden, args.steps, args.seq_len, args.micro_batch, args.rounds = 2, 64, 2, 16, 1, 1
    names = [k for k in _flags.parse_list(args.only) if k != "before" or args.before_tree]
    if "plain" not in names:
        names.insert(0, "plain")  # every ratio is against plain PyTorch
    size = f"{args.layers}x{args.hidden}"
    cells = [Cell(k, size) for k in names] + [Cell(t, size, side_by_side=pair) for t, pair in TOGGLES.items()
                                              if args.toggle_steps]
    base = dict(layers=args.layers, hidden=args.hidden, micro_batch=args.micro_batch, seq_len=args.seq_len,
                steps=args.steps, warmup=args.warmup, dtype=args.dtype, model_defaults=args.model_defaults)
    toggles = dict(kind="toggle", allocator="release", steps=2 * args.toggle_steps, warmup=2)

    def spec_of(cell, scratch):
        if cell.side_by_side:
            return dict(base, **toggles, toggle=cell.contender, scratch=scratch)
        return dict(base, kind=cell.contender, scratch=scratch, tree=args.before_tree if cell.contender == "before"
                    else None, allocator=ALLOCATOR.get(cell.contender, args.before_allocator))

    records = _harness.run_cells(BENCH, "benchmarks.host_memory", cells, spec_of, args, dtype=args.dtype)
    print(f"a minor page fault costs {fault_cost() * 1e6:.2f} us here (fresh vs reused 256 MiB, best of 5)")
    return _harness.finish(BENCH, records, args, PAIRS, extra=("minor_faults",), ratio_extra=("minor_faults",))


if __name__ == "__main__":
    sys.exit(main())
