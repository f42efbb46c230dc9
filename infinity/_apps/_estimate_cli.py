"""``python -m infinity.estimate``: the command line of the estimator, its report and the
config it suggests."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from typing import Optional, Sequence

from .._runtime._tiers import Tier
from . import _runmodel as rm
from ._estimate_model import _NVME_PATH_PLACEHOLDER, EstimateError, _format_count
from ._estimator import Estimate, estimate

# --------------------------------------------------------------------------- CLI

def _yaml(config: dict) -> str:
    """The config as YAML in the style of DESIGN §1: leaf mappings on one line."""
    def flow(mapping: dict) -> str:
        return "{" + ", ".join(f"{k}: {v}" for k, v in mapping.items()) + "}"

    lines = []
    for key, value in config.items():
        if not any(isinstance(v, dict) for v in value.values()):
            lines.append(f"{key}: {flow(value)}")
            continue
        lines.append(f"{key}:")
        lines += [f"  {k}: {flow(v) if isinstance(v, dict) else v}" for k, v in value.items()]
    return "\n".join(lines)


def _report(est: Estimate) -> str:
    rec = est.recommended
    fitting = ", ".join(f"stage {p.stage} params={p.param_tier} optimizer={p.optimizer_tier}"
                        for p in est.fitting)
    out = [est.table(), "", "fits: " + (fitting or "nothing"), ""]
    if rec is None:
        tiled = est.tiling_needed
        if tiled is not None:
            out.append(f"no placement fits untiled; the largest operator ({_format_count(est.shape.largest_operator_numel)} "
                       f"params) fits with tiling factor {tiled.tiling_factor} (zero.tiling.max_tile_params = "
                       f"{tiled.max_tile_params}):")
            out += ["recommended config:", _yaml(tiled.recommended.config)]
            return "\n".join(out)
        out.append("no placement fits: add GPUs or nodes, host memory or NVMe space, or lower "
                   "micro-batch / raise ckpt-interval")
    else:
        out += ["recommended config:", _yaml(rec.config)]
        if est.nvme_path is None and Tier.NVME in (rec.placement.param_tier,
                                                   rec.placement.optimizer_tier):
            out.append(f"# set nvme_path to a directory on a local NVMe drive "
                       f"({_NVME_PATH_PLACEHOLDER} is a placeholder)")
    return "\n".join(out)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m infinity.estimate",
        description="Memory per tier (device, host, NVMe) for each ZeRO stage and offload "
                    "choice, which placements fit, and the recommended config. Sizes: 32GB "
                    "(10^9), 512MiB (2^20), 1.5TB, or bytes; left out, they are read from "
                    "this machine.")
    what = p.add_argument_group("model (a count, a config, or layers + hidden)")
    what.add_argument("--params", help="parameter count: 1e12, 70B, 1.5T")
    what.add_argument("--model", help="a config.json, or a directory holding one")
    what.add_argument("--layers", type=int)
    what.add_argument("--hidden", type=int)
    what.add_argument("--heads", type=int)
    what.add_argument("--trainable", help="trained parameter count (LoRA, frozen layers); default: all")
    run = p.add_argument_group("training")
    run.add_argument("--seq-len", type=int, default=1024)
    run.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU")
    run.add_argument("--ckpt-interval", type=int, default=1,
                     help="transformer layers between activation checkpoints")
    run.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    run.add_argument("--moments", default="fp32", choices=("fp32", "bf16", "int8"),
                     help="zero.offload_optimizer.moments: Adam's moments on NVMe in fp32, bf16 or int8")
    hw = p.add_argument_group("hardware")
    hw.add_argument("--gpus", type=int, help="GPUs per node")
    hw.add_argument("--nodes", type=int, default=1)
    hw.add_argument("--gpu-mem", help="memory per GPU")
    hw.add_argument("--cpu-mem", help="host memory per node")
    hw.add_argument("--nvme", help="NVMe space per node")
    hw.add_argument("--nvme-path", help="NVMe directory (measured when --nvme is left out)")
    run.add_argument("--tiling-factor", type=int, default=1,
                     help="the largest operator split into this many tiles (zero.tiling)")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    st = p.add_argument_group("step time and host memory of one run (stage 3; Note [run model] in _runmodel.py)")
    st.add_argument("--step-time", action="store_true", help="predict the step time, its bottleneck and peak RSS")
    st.add_argument("--offload", default="nvme,nvme", help="parameter tier,optimizer tier: none|cpu|nvme (nvme,nvme)")
    st.add_argument("--rates", default="measured", choices=("measured", "dgx2", "h100"),
                    help="FLOP rate, NVMe and Adam bandwidths: measured here (under --nvme-path), the paper's "
                         "DGX-2, or an 8xH100 node with NVMe RAID")
    st.add_argument("--hardware", choices=("dgx2", "h100x8"),
                    help="a whole node: its GPUs, memories and NVMe for the estimate and its rates for --step-time "
                         "(the paper's DGX-2, or an 8xH100 node with NVMe RAID; figures in _runmodel.py)")
    return p


def _step_report(est: Estimate, args) -> str:
    tiers = [t.strip() for t in args.offload.split(",")]
    if len(tiers) != 2 or not set(tiers) <= {"none", "cpu", "nvme"}:
        raise EstimateError(f"offload: {args.offload!r} must be two of none, cpu, nvme: e.g. nvme,nvme or cpu,cpu")
    tiers = ["device" if t == "none" else t for t in tiers]
    hw = est.hardware
    s = est.shape
    run = rm.Run(params=est.params, layers=s.layers, hidden=s.hidden, heads=s.heads, vocab=s.vocab or 0,
                 micro_batch=est.micro_batch, seq_len=est.seq_len, dtype=est.precision.name, param_tier=tiers[0],
                 optimizer_tier=tiers[1], ranks=hw.ranks, device_is_host=hw.device_is_host,
                 ckpt_interval=args.ckpt_interval if args.ckpt_interval > 1 or not hw.device_is_host else 0,
                 host_mem=0 if hw.device_is_host else hw.cpu_mem,  # the CPU runs here train without checkpoints
                 moments=est.precision.moments)
    rates = {"dgx2": rm.DGX2, "h100": rm.H100_RAID}.get(args.rates)
    if args.hardware:
        rates = rm.NODES[args.hardware][0]
    if rates is None:
        rates = rm.Rates.measure(args.nvme_path or (tempfile.gettempdir() if "nvme" in tiers else None), run)
    return rm.describe(run, rates)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.hardware:  # the node's sizes, unless given
        _, gpus, gpu_mem, cpu_mem, nvme = rm.NODES[args.hardware]
        args.gpus, args.gpu_mem = args.gpus or gpus, args.gpu_mem or gpu_mem
        args.cpu_mem, args.nvme = args.cpu_mem or cpu_mem, args.nvme or nvme
    try:
        est = estimate(args.params, model=args.model, layers=args.layers, hidden=args.hidden,
                       heads=args.heads, seq_len=args.seq_len, micro_batch=args.micro_batch,
                       ckpt_interval=args.ckpt_interval, gpus=args.gpus, nodes=args.nodes,
                       gpu_mem=args.gpu_mem, cpu_mem=args.cpu_mem, nvme=args.nvme,
                       dtype=args.dtype, moments=args.moments, nvme_path=args.nvme_path, trainable=args.trainable,
                       tiling_factor=args.tiling_factor)
    except EstimateError as exc:
        parser.error(str(exc))     # exits 2 with the usage and the message
    text = json.dumps(est.to_dict(), indent=2) if args.json else _report(est)
    if args.step_time:
        try:
            text = _step_report(est, args)
        except EstimateError as exc:
            parser.error(str(exc))
    sys.stdout.write(text + "\n")
    return 0
