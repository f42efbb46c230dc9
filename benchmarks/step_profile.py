"""Where a step's time goes on a GPU: infinity's step in its parts, with the engine's telemetry
and the GPU's busy time, for variants each in a process of its own.

The parts: forward, backward and the step() call (and the parts of that call: the previous step
joined, parameter copies, the gradients landing, the norm, the update or its launch); the
telemetry: bytes and stalls per stage, the update's seconds, elements and threads; the GPU's busy
time from torch.profiler. The variants: the overlapped step on and off
(``zero.offload_optimizer.overlap_step``), the prefetcher on and off (``zero.prefetch.enabled``),
and the speculative update (``zero.offload_optimizer.speculate: on``, unclipped).

    python -m benchmarks.step_profile --only 1.5b/cpu/overlap,1.5b/cpu/no-overlap
    python -m benchmarks.step_profile --only 124m/nvme/prefetch,124m/nvme/no-prefetch
    python -m benchmarks.step_profile --smoke

Cells are size/offload/variant, each in a process of its own (benchmarks/_harness.py); a
cell's record is contender ``infinity-<offload>-<variant>`` at its size, ``step_s`` the whole
step and ``extra`` the rest: the parts (``forward_s``, ``backward_s``, ``step_call_s``, medians),
``variant``, ``offload``, the telemetry's figures, the engine's profiler ranges in one profiled
step summed by kind (``trace_ranges_s``, and its waits by stage, ``trace_wait_s``; ``--trace DIR``
writes that step's Chrome trace, each range named after its unit), and the run model's
prediction for the same run from rates measured in the child (``predicted_step_s``). Each phase is timed between device
synchronizations, which serialise the GPU at the phase edges; the step time of record is
benchmarks.peers's, without them. ``gpu_busy_s``: the union of the GPU's kernel intervals in
one profiled step, ``gpu_idle_s`` the rest of that step's wall time.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Optional

from benchmarks import _flags, _harness, _models
from benchmarks._harness import Cell
from benchmarks._harness import sync_device as sync

BENCH = "step_profile"

VARIANTS = {
    "overlap": {"overlap_step": "auto", "prefetch": True},
    "no-overlap": {"overlap_step": "off", "prefetch": True},
    "prefetch": {"overlap_step": "auto", "prefetch": True},
    "no-prefetch": {"overlap_step": "auto", "prefetch": False},
    # Note [speculative update] in infinity/_zero/_speculative_update.py: unclipped, where its guess can stand
    "speculate": {"overlap_step": "auto", "prefetch": True, "speculate": "on", "clip": 0.0},
}


def variant_config(offload: str, nvme_path: str, variant: str, dtype: str = "bf16") -> dict:
    from benchmarks._trainers import infinity_config

    v = VARIANTS[variant]
    optimizer = {"overlap_step": v["overlap_step"], "speculate": v.get("speculate", "off")}
    return infinity_config(offload, dtype, nvme_path, clip=v.get("clip", -1.0),
                           zero={"offload_optimizer": optimizer, "prefetch": {"enabled": v["prefetch"]}})


def _profiled_step(step, trace: Optional[str] = None) -> dict:
    """Run ``step`` under torch.profiler, every thread recorded (the update's too: Note [profiler
    ranges] in infinity/_runtime/_telemetry_counters.py): the engine's ranges summed by kind
    (``trace_ranges_s``, ``trace_wait_s`` by stage: the telemetry's stalls as the trace saw them)
    and, with CUDA, the union of the GPU's kernel intervals and of its copies', beside the step's
    wall time. ``trace``: the Chrome trace written there too."""
    import torch
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        sync()
        start = time.perf_counter()
        step()
        sync()
        wall = time.perf_counter() - start
    if trace:
        prof.export_chrome_trace(trace)
    out = {"profiled_step_s": round(wall, 4), **trace_table(prof.events())}
    if not cuda:
        return out
    kernels, copies = [], []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = (e.time_range.start, e.time_range.end)
        (copies if e.name.startswith(("Memcpy", "Memset")) else kernels).append(span)
    busy = _union(kernels) / 1e6
    return {**out, "gpu_busy_s": round(busy, 4), "gpu_idle_s": round(wall - busy, 4),
            "gpu_copy_s": round(_union(copies) / 1e6, 4)}


def trace_table(events) -> dict:
    """The engine's ranges in a profiler's events summed by kind, in seconds (their unit names
    dropped: ``range_kind``); the waits apart, by stage."""
    from infinity.testing import range_kind

    ranges: dict = {}
    for e in events:
        if e.name.startswith("infinity::") and e.device_type == e.device_type.CPU:
            kind = range_kind(e.name)
            ranges[kind] = ranges.get(kind, 0.0) + (e.time_range.end - e.time_range.start) / 1e6
    waits = {k[len("infinity::wait:"):]: round(v, 4) for k, v in ranges.items() if k.startswith("infinity::wait:")}
    return {"trace_ranges_s": {k[len("infinity::"):]: round(v, 4) for k, v in sorted(ranges.items())
                               if not k.startswith("infinity::wait:")},
            "trace_wait_s": dict(sorted(waits.items()))}


def _union(spans) -> float:
    total, end = 0.0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def telemetry_figures(telemetry: list) -> dict:
    """The timed steps' telemetry, per step: stalls by stage, GB by stage, the step() call's parts, the update."""
    n = len(telemetry)
    update = {k: sum(t["update"][k] for t in telemetry) / n for k in ("seconds", "elements", "background_seconds")}
    parts = sorted({k for t in telemetry for k in t.get("step_call_s", {})})
    return {"stall_s": {k: round(sum(t["stall_s"][k] for t in telemetry) / n, 4) for k in telemetry[0]["stall_s"]},
            "gb_per_step": {k: round(sum(t["bytes"].get(k, 0) for t in telemetry) / n / 1e9, 3) for k in
                            ("host_to_device", "grad_offload", "nvme_read", "param_cache", "param_handoff")},
            "step_call_parts_s": {k: round(sum(t.get("step_call_s", {}).get(k, 0.0) for t in telemetry) / n, 4)
                                  for k in parts},
            "update_s": round(update["seconds"], 4), "update_background_s": round(update["background_seconds"], 4),
            "update_threads": max(t["update"]["peak_threads"] for t in telemetry),
            "update_gelems_per_s": round(update["elements"] / update["seconds"] / 1e9, 3) if update["seconds"] else None}


def measure(spec: dict) -> dict:
    import torch

    import infinity

    model = _models.gpt2(spec["size"], seed=0)
    params = _models.param_count(model)
    model, opt = infinity.initialize(model, config=variant_config(spec["offload"], spec["scratch"], spec["variant"],
                                                               spec["dtype"]))
    dev = infinity.device() if hasattr(infinity, "device") else next(model.parameters()).device
    batches = _models.batches(spec["size"], spec["micro_batch"], spec["seq_len"], spec["warmup"] + spec["steps"] + 1)
    phases = {"forward_s": [], "backward_s": [], "step_call_s": [], "step_s": []}
    telemetry, losses = [], []

    def one(ids, record: bool):
        ids = ids.to(dev)
        sync()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        sync()
        t3 = time.perf_counter()
        losses.append(loss.item())
        if record:
            for key, value in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                phases[key].append(value)

    engine = opt.engine  # the engine's telemetry and close (public names: infinity.telemetry / infinity.close)
    for i, ids in enumerate(batches[:-1]):
        if i == spec["warmup"]:
            engine.telemetry(reset=True)
        one(ids, i >= spec["warmup"])
        if i >= spec["warmup"]:
            telemetry.append(engine.telemetry(reset=True))
    trace = os.path.join(spec["trace"], f"{spec['size']}-{spec['offload']}-{spec['variant']}.json") \
        if spec.get("trace") else None
    gpu = _profiled_step(lambda: one(batches[-1], False), trace)
    opt.wait_step()
    engine.close()
    extra = {"variant": spec["variant"], "offload": spec["offload"],
             **{k: round(statistics.median(v), 4) for k, v in phases.items() if k != "step_s"},
             **telemetry_figures(telemetry), "torch_threads": torch.get_num_threads(),
             "cpus": len(os.sched_getaffinity(0)), **gpu}
    v = VARIANTS[spec["variant"]]
    extra.update(_predicted(spec, params, v["overlap_step"] == "auto", v.get("speculate", "off") != "off",
                            units=len(opt.ops.units), clip=v.get("clip", -1.0) != 0.0))
    if extra.get("predicted_step_s"):
        extra["predicted_over_measured"] = round(extra["predicted_step_s"] / statistics.median(phases["step_s"]), 3)
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return _harness.sample(phases["step_s"], losses=losses, params=params, dtype=spec["dtype"],
                           tokens_per_step=spec["micro_batch"] * spec["seq_len"], device=f"{dev.type}: {name}",
                           gpu_peak=torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
                           extra=extra)


def _predicted(spec: dict, params: int, overlapped: bool, speculate: bool = False, units: int = 0,
               clip: bool = True) -> dict:
    """The run model's step (Note [run model] in infinity/_apps/_runmodel.py) for this run, from
    rates measured here and now: the device's FLOP rate on the model's layers, PCIe, the host's
    Adam on the threads the engine gives it, the disk under --nvme-path."""
    import torch

    from infinity.testing import Rates, Run, step_time

    shape = _models.shape_of(spec["size"])
    run = Run(params=params, layers=shape.layers, hidden=shape.hidden, heads=shape.heads, vocab=shape.vocab,
              micro_batch=spec["micro_batch"], seq_len=spec["seq_len"], dtype=spec["dtype"], param_tier=spec["offload"],
              optimizer_tier=spec["offload"], device_is_host=not torch.cuda.is_available(), speculate=speculate,
              units=units, clip=clip)
    rates = Rates.measure(spec["scratch"] if spec["offload"] == "nvme" else None, run,
                          probe_bytes=_harness.disk_probe_bytes(spec["smoke"]))
    st = step_time(run, rates)
    step = st["predicted"]
    if not overlapped and not run.device_is_host:  # the update inside step(): the terms add
        step = max(st["backward"] + st["forward"] + st["adam"] + st["norm"], st["nvme_read"] + st["nvme_write"])
    terms = {k: round(st[k], 4) for k in ("compute", "forward", "backward", "adam", "h2d", "d2h", "nvme_read",
                                          "nvme_write", "grad_landing", "norm", "units") if k in st}
    return {"predicted_step_s": round(step, 4), "run_model_terms_s": terms,
            "rates": {"tflops": round(rates.flops / 1e12, 1), "adam_gelems": round(rates.adam / 1e9, 2),
                      "pcie_gbps": None if rates.pcie == float("inf") else round(rates.pcie / 1e9, 1),
                      "nvme_read_gbps": None if rates.nvme_read == float("inf") else round(rates.nvme_read / 1e9, 2),
                      "nvme_write_gbps": None if rates.nvme_write == float("inf") else round(rates.nvme_write / 1e9, 2),
                      "host_copy_gbps": round(rates.host_copy / 1e9, 1), "unit_ms": round(rates.unit_s * 1e3, 3),
                      "step_ms": round(rates.step_s * 1e3, 2)}}


COLUMNS = (("contender", "contender"), ("size", "size"), ("step s", "step_s"))
EXTRA = ("predicted_step_s", "forward_s", "backward_s", "step_call_s", "update_s", "update_background_s",
         "update_threads", "gpu_busy_s", "gpu_idle_s")


def main(argv=None) -> int:
    p = _flags.parser(__doc__, steps=3, warmup=2, seq_len=1024, micro_batch=8,
                      only="1.5b/cpu/overlap,1.5b/cpu/no-overlap", budget=3600.0, timeout=240.0)
    p.add_argument("--trace", metavar="DIR", help="write each cell's profiled step as a Chrome trace "
                   "(DIR/<size>-<offload>-<variant>.json): the engine's ranges named after their units")
    args = _harness.parse(p, measure, argv)
    cells = [tuple(c.split("/")) for c in _flags.parse_list(args.only)]  # size/offload/variant
    for cell in cells:
        if len(cell) != 3 or cell[1] not in ("cpu", "nvme") or cell[2] not in VARIANTS:
            p.error(f"--only: {'/'.join(cell)!r} is not size/offload/variant (offload cpu or nvme; variant one of "
                    f"{', '.join(VARIANTS)})")
        _models.shape_of(cell[0])
    if args.smoke:
        cells = [("tiny", offload, variant) for _, offload, variant in cells]
        args.steps, args.warmup, args.seq_len, args.micro_batch = 2, 1, 32, 2
    import torch

    # bf16 with CUDA (not in --smoke), else fp32, as benchmarks.peers chooses: never by this CPU's features
    dtype = "bf16" if torch.cuda.is_available() and not args.smoke else "fp32"
    of = {f"infinity-{offload}-{variant}": (offload, variant) for _, offload, variant in cells}
    spec = {"dtype": dtype, "steps": args.steps, "warmup": args.warmup, "seq_len": args.seq_len,
            "micro_batch": args.micro_batch, "smoke": args.smoke,
            "trace": os.path.abspath(args.trace) if args.trace else None}
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    records = _harness.run_cells(BENCH, "benchmarks.step_profile", [Cell(f"infinity-{o}-{v}", size) for size, o, v in cells],
                                 lambda cell, scratch: dict(spec, size=cell.size, offload=of[cell.contender][0],
                                                      variant=of[cell.contender][1], scratch=scratch), args, dtype=dtype)
    return _harness.finish(BENCH, records, args, columns=COLUMNS, extra=EXTRA)


if __name__ == "__main__":
    sys.exit(main())
