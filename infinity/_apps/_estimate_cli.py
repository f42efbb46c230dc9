"""``python -m infinity.estimate``: the command line of the estimator, its report and the
config it suggests."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

from .._offload._drives import rank_bandwidth
from .._runtime._accelerator import device_count
from .._runtime._tiers import Tier
from ..config import AioConfig
from ..errors import InvariantError
from . import _plan as pl
from . import _runmodel as rm
from ._endurance import TB
from ._estimate_model import _NVME_PATH_PLACEHOLDER, EstimateError, _config_dict, _format_count, vocab_of
from ._estimator import Estimate, Given, PlacementEstimate, estimate, resolve

# --------------------------------------------------------------------------- CLI

def _yaml(config: dict) -> str:
    """The config as YAML in the style of examples/configs: leaf mappings on one line."""
    def flow(mapping: dict) -> str:
        return "{" + ", ".join(f"{k}: {flow(v) if isinstance(v, dict) else v}" for k, v in mapping.items()) + "}"

    lines = []
    for key, value in config.items():
        if not any(isinstance(v, dict) for v in value.values()):
            lines.append(f"{key}: {flow(value)}")
            continue
        lines.append(f"{key}:")
        lines += [f"  {k}: {flow(v) if isinstance(v, dict) else v}" for k, v in value.items()]
    return "\n".join(lines)


def _report(est: Estimate, args=None) -> str:
    """The table (the row --offload, --step-time or --steps speak of marked), what fits, the row --offload
    asks for, and the recommended config."""
    rec, (row, _) = est.recommended, _chosen(est, args) if args is not None else (None, "")
    fitting = ", ".join(p.label for p in est.rows if p.fits)
    out = [est.table(row, _mark(args)), "", "fits: " + (fitting or "nothing"), ""]
    if row is not None and args.offload is not None:
        out += _asked_lines(est, args, row)
    if rec is None:
        tiled = est.tiling_needed
        if tiled is not None:
            out.append(f"no placement fits untiled; one fits with tiling factor {tiled.tiling_factor} "
                       f"(zero.tiling.max_tile_params = {tiled.max_tile_params}): the largest operator "
                       f"({_format_count(est.shape.largest_operator_numel)} params) and every other one above it in "
                       f"tiles, each a fetch unit of its own:")
            out += ["recommended config:", _yaml(tiled.recommended.config)] + _how_to_run(tiled)
            return "\n".join(out)
        out.append("no placement fits: add GPUs or nodes, host memory or NVMe space, or lower "
                   "micro-batch / raise ckpt-interval")
    else:
        out += ["recommended config:", _yaml(rec.config)]
        if rec.placement not in est.fitting:  # no whole tier fits: a split does
            out.append("# no placement on whole tiers fits; this split does: " + (
                f"the auto row's ({rec.placement.label}: device: auto in both offload sections plans it here)"
                if rec.placement.auto else rec.placement.label))
        if est.nvme_path is None and Tier.NVME in (rec.placement.param_tier,
                                                   rec.placement.optimizer_tier):
            out.append(f"# set nvme_path to a directory on a local NVMe drive "
                       f"({_NVME_PATH_PLACEHOLDER} is a placeholder)")
        out += _how_to_run(est)
    return "\n".join(out)


def _mark(args) -> str:
    """What the marked row of the table is (``_chosen``): the flag that names it."""
    if args is None:
        return ""
    if args.offload is not None:
        return f"--offload {args.offload}"
    return "--offload-split" if args.offload_split else "--step-time" if args.step_time else "--steps"


def _asked_lines(est: Estimate, args, row: PlacementEstimate) -> list:
    """--offload's row, said: whether it fits, and its config where it is not the recommended one."""
    rec = est.recommended
    said = f"--offload {args.offload}: {row.label}, the row marked <-: " + ("fits" if row.fits else
                                                                          f"does not fit ({row.fit_text[4:]})")
    if rec is not None and rec.placement is row:
        return [said + "; the recommended placement (its config below)", ""]
    config, notes = est._config_for(row), []
    if row.auto:  # as asked: device auto, with a drive it may plan a share on
        auto = {"device": "auto", "nvme_path": est.nvme_path or _NVME_PATH_PLACEHOLDER}
        config["zero"].update(offload_param=auto, offload_optimizer=dict(auto))
        notes.append("# device: auto plans params {}, optimizer {} on this node (the row marked <-)".format(
            *(pl.offload_word(*where) for where in row.spec[1:])))
    if est.nvme_path is None and (row.auto or Tier.NVME in (row.param_tier, row.optimizer_tier)):
        notes.append(f"# set nvme_path to a directory on a local NVMe drive ({_NVME_PATH_PLACEHOLDER} is a placeholder)")
    return [said + "; its config:", _yaml(config), *notes, ""]


def _how_to_run(est: Estimate) -> list:
    """YAML comments after the recommended config: how to load it, and the activation
    checkpointing the estimate counted on, which is the model's to turn on (no config key does)."""
    return ["# save these lines as a .yaml file; load it with infinity.Config.from_file(path) "
            "(or: python -m infinity.train --config path)",
            f"# the estimate assumes activation checkpointing every {est.ckpt_interval} layer(s) (--ckpt-interval); "
            f"turn it on in the model:",
            "#   Hugging Face: model.activation_checkpointing_enable() (gradient_checkpointing_enable() in older "
            "transformers; the Trainer's argument of that name); other models: torch.utils.checkpoint around each block"]


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
    _drive_flags(hw)
    run.add_argument("--tiling-factor", type=int, default=1,
                     help="the largest operator split into this many tiles (zero.tiling)")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    st = p.add_argument_group("step time and host memory of one run (stage 3; Note [run model] in _runmodel.py)")
    st.add_argument("--step-time", action="store_true", help="predict the step time, its bottleneck and peak RSS")
    st.add_argument("--offload", help="parameter tier,optimizer tier: none|cpu|nvme|auto (the config's words, "
                                      "zero.offload_*.device; auto,auto: the table's auto row): the row the table "
                                      "marks (at --stage) and gives the config of, and the placement of --step-time, "
                                      "--steps and --plan; default: for --step-time the recommended placement where "
                                      "it is stage 3, else the fastest stage-3 row that fits; nvme,nvme for --steps "
                                      "and --plan")
    st.add_argument("--offload-split", action="append", metavar="STATE=TIER:FRACTION,...",
                    help="a state (params or optimizer) over host memory and NVMe, as zero.offload_<state>.split: "
                         "{cpu: a, nvme: b} (Note [split tiers] in _offload/_split.py), e.g. optimizer=cpu:0.5,nvme:0.5 "
                         "(again for the other state): its rows in the table, beside every tier of the other state, "
                         "and the placement of --plan, --step-time and --steps with --offload's tiers (left out: the "
                         "split's slowest tier for the split state, nvme for the other)")
    st.add_argument("--rates", default="measured", choices=("measured", "dgx2", "h100"),
                    help="FLOP rate, NVMe and Adam bandwidths: measured here (under --nvme-path), the paper's "
                         "DGX-2, or an 8xH100 node with NVMe RAID")
    ssd = p.add_argument_group(
        "SSD endurance of a planned run (the --offload placement; Note [endurance budget] in _endurance.py)")
    ssd.add_argument("--steps", type=int, help="optimizer steps of the run: the TB it writes to each node's NVMe")
    ssd.add_argument("--endurance-tbw", type=float,
                     help="the drive's rated endurance in TB written (aio.endurance_tbw): the run's share of it")
    _plan_flags(p)
    st.add_argument("--hardware", choices=("dgx2", "h100x8"),
                    help="a whole node: its GPUs, memories and NVMe for the estimate and its rates for --step-time "
                         "(the paper's DGX-2, or an 8xH100 node with NVMe RAID; figures in _runmodel.py)")
    return p


def _plan_flags(p: argparse.ArgumentParser) -> None:
    own = p.add_argument_group("the engine's own plan (Note [planned by the engine] in _plan.py)")
    own.add_argument("--plan", action="store_true",
                     help="build the model on the meta device and run the engine's planner for the node (--gpus x "
                          "--nodes ranks, --drives, --nvme-layout): fetch units, each rank's bytes by tier, swap "
                          "files, buffers and host memory, each drive's swap bytes; nothing is allocated")
    own.add_argument("--arch", choices=pl.ARCHS,
                     help="the decoder a shape (--layers, --hidden, --params) is built as, for the table and --plan "
                          "(default: llama, whose Linear layers zero.tiling tiles)")
    own.add_argument("--stage", type=int, choices=(1, 2, 3), default=3,
                     help="--plan: the ZeRO stage planned, and the stage of the row --offload marks in the table "
                          "(stages 1-2 keep the parameters whole on the device: --offload none,OPTIMIZER)")
    own.add_argument("--config", help="--plan: the infinity config to plan (its tiers, dtype, buffers) instead of "
                                      "stage 3 at --offload in --dtype")


def _drive_flags(hw) -> None:
    hw.add_argument("--drives", type=int, help="--step-time: NVMe drives per node, each as fast as --drive-bandwidth, "
                    "else as one of the --hardware / --rates node's, else as the one measured under --nvme-path "
                    "(Note [many drives] in _offload/_drives.py)")
    hw.add_argument("--drive-bandwidth", metavar="READ[,WRITE]",
                    help="--step-time and --plan: GB/s one drive reads (and writes; default: as it reads), instead "
                         "of measuring (--step-time) or the --hardware node's (--plan)")
    hw.add_argument("--nvme-layout", default="per_rank", choices=("per_rank", "stripe"),
                    help="--step-time with --drives: each rank on its drive, or every file striped (zero.nvme_layout)")


def offload_tiers(offload: str) -> list:
    """--offload PARAMS,OPTIMIZER in the config's words (none, cpu, nvme, auto; ``device``, the table's
    word before, as an alias of none)."""
    return pl.offload_tiers(offload)


def offload_splits(values: Optional[Sequence[str]]) -> Dict[str, Dict[str, float]]:
    """--offload-split STATE=TIER:FRACTION,... (params or optimizer, then the tiers and fractions of
    the config's zero.offload_<state>.split), each checked as the config checks a split."""
    out: Dict[str, Dict[str, float]] = {}
    for value in values or ():
        state, _, spec = (part.strip() for part in value.partition("="))
        pairs = [tuple(t.strip() for t in pair.partition(":")) for pair in spec.split(",")] if spec else []
        if not state or not pairs or any(not sep or not tier for tier, sep, _ in pairs):
            raise EstimateError(f"offload-split: {value!r} must be STATE=TIER:FRACTION,...: params or optimizer, then "
                                f"the tiers and fractions of its zero.offload_*.split, e.g. optimizer=cpu:0.5,nvme:0.5")
        name = {"param": "params"}.get(state, state)
        if name in out or len({tier for tier, _, _ in pairs}) < len(pairs):
            raise EstimateError(f"offload-split: {value!r} gives the {name} split, or one of its tiers, twice; give "
                                f"each state once, each tier once: e.g. --offload-split params=cpu:0.5,nvme:0.5 "
                                f"--offload-split optimizer=cpu:0.25,nvme:0.75")
        fractions = {tier: _number(f) for tier, _, f in pairs}
        try:
            out[name] = pl.checked_split(name, fractions)
        except EstimateError as err:
            key = pl.SPLIT_STATES.get(name)  # the section the flag's words are
            said = f" (zero.{key}.split: {{{', '.join(f'{t}: {f}' for t, f in fractions.items())}}})" if key else ""
            raise EstimateError(f"offload-split {value}{said}: {err}") from None
    return out


def _number(text: str):
    """A fraction of --offload-split as a number, else as given (the config's check names what it is)."""
    try:
        return float(text)
    except ValueError:
        return text


def _tiers(args, fallback: str) -> List[str]:
    """--offload's tiers (else ``fallback``'s), a split state's its split's slowest where --offload is left out."""
    tiers, splits = offload_tiers(args.offload or fallback), _splits(args)
    if args.offload is None:
        tiers = [pl.slowest_tier(splits[s]) if s in splits else t for s, t in zip(_STATES, tiers)]
    return tiers


_STATES = ("params", "optimizer")


def _splits(args) -> Dict[str, Dict[str, float]]:
    """--offload-split's splits, by state (params, optimizer)."""
    return offload_splits(args.offload_split)


def _row_of(est: Estimate, args) -> PlacementEstimate:
    """The row of the table --step-time and --steps speak of (``_chosen``)."""
    row, _ = _chosen(est, args, for_run=True)
    if row is None:  # for_run always chooses one
        raise InvariantError("the run model's row was not chosen")
    return row


_RUN_MODEL = "the run model is of stage 3 only (Note [run model] in infinity/_apps/_runmodel.py)"
_MARKED = " (marked <-)"


def _chosen(est: Estimate, args, for_run: bool = False) -> Tuple[Optional[PlacementEstimate], str]:
    """The row of the table --offload, --step-time and --steps speak of, and why that one: --offload's
    tiers with --offload-split's splits where either is given (nvme,nvme for the tiers left out; at --stage
    for the table, at stage 3 for the run model's --step-time and --steps); else, for --step-time, the
    recommended placement where it is stage 3, else the fastest stage-3 row that fits (the run model is of
    stage 3 only); nvme,nvme where none fits, and for --steps. (None, "") where nothing asks for a row and
    it is not ``for_run`` (the run model's: stage 3, nvme,nvme where not asked for)."""
    rec, splits, run = est.recommended, _splits(args), for_run or args.step_time or args.steps is not None
    if args.offload is None and not run:
        return None, ""
    if run and args.stage != 3:
        raise EstimateError(f"--stage {args.stage}: --step-time and --steps run the run model, and {_RUN_MODEL}; "
                            f"leave out --stage (the table marks --offload's row at --stage without them)")
    if args.offload is None and not splits and args.step_time:
        best = est.fastest(stage=3)
        if rec is not None and rec.placement is best:
            return best, f"the recommended placement{_MARKED}"
        if best is not None and rec is not None:
            return best, f"the fastest stage-3 row that fits{_MARKED}: {_RUN_MODEL}, not of the recommended " \
                         f"{rec.placement.label}"
        return est.placement(3, "nvme", "nvme"), f"every state on NVMe{_MARKED}: " + (
            "nothing fits" if rec is None else f"no stage-3 row fits, and {_RUN_MODEL}")
    tiers = _tiers(args, "nvme,nvme")
    if splits:  # refused as the config refuses it: a split's section on its slowest tier
        pl.plan_config(",".join(tiers), est.precision.name, splits=splits)
    row = est.placement(args.stage if not run else 3, *(splits.get(s, t) for s, t in zip(_STATES, tiers)))
    return row, ("--offload's row" if args.offload is not None else "--offload-split's row" if splits else
                 "every state on NVMe (--offload left out)") + _MARKED


def _run_of(est: Estimate, args):
    """The stage-3 run of the run model (Note [run model] in _runmodel.py) of the table's row
    (``_row_of``): its tiers and splits, its plan's layout and stores' bytes."""
    hw, s, t, row = est.hardware, est.shape, est.terms, _row_of(est, args)
    placement = row.plan.placement if row.plan is not None else None
    if row.plan is None or placement is None:
        raise EstimateError(f"{row.label}: the run model is of the table's plans")
    layout = placement.layout
    # the table's numbers: its plan, its checkpoint interval and activations (Note [planned by the engine] in _plan.py)
    figures = pl.figures_of(row.plan, activations=t.activation_checkpoints + t.activation_working)
    return rm.Run(params=est.params, layers=s.layers, hidden=s.hidden, heads=s.heads, vocab=vocab_of(s),
                  micro_batch=est.micro_batch, seq_len=est.seq_len, dtype=est.precision.name,
                  param_tier=pl.tier_name(row.param_tier), optimizer_tier=pl.tier_name(row.optimizer_tier),
                  ranks=hw.ranks, device_is_host=hw.device_is_host, ckpt_interval=est.ckpt_interval,
                  host_mem=hw.cpu_mem, moments=est.precision.moments, figures=figures, units=row.plan.units,
                  # a split's host share, as the run model cuts it: whole chunks of this fraction, int(fraction x
                  # elements) of the parameters (half an element more than the plan's cut: the same count)
                  opt_host_fraction=placement.opt_host_upto / max(layout.opt_total, 1),
                  param_host_fraction=(placement.param_host_upto + 0.5) / layout.param_total
                  if placement.param_host_upto else 0.0)


def _ssd_writes(est: Estimate, args) -> dict:
    """Note [endurance budget] in _endurance.py: the bytes the planned run writes to each node's NVMe (the swap
    files, as the run model counts a step's writes; checkpoints come on top: a cloned save
    writes none of the states, a copied one all of them), and its share of the drive's rating."""
    if args.steps < 1:
        raise EstimateError(f"steps: {args.steps} must be at least 1")
    if args.endurance_tbw is not None and args.endurance_tbw <= 0:
        raise EstimateError(f"endurance_tbw: {args.endurance_tbw:g} must be a positive number of TB")
    run, words = _run_of(est, args), _row_of(est, args).words
    per_rank = rm.nvme_bytes(run)["write"]
    ranks = est.hardware.gpus_per_node
    total = per_rank * ranks * args.steps
    return {"param_tier": run.param_tier, "optimizer_tier": run.optimizer_tier, "offload": dict(zip(_STATES, words)),
            "bytes_per_rank_step": per_rank,
            "ranks_per_node": ranks, "steps": args.steps, "tb_per_node": total / TB,
            "endurance_tbw": args.endurance_tbw,
            "share": None if args.endurance_tbw is None else total / (args.endurance_tbw * TB)}


def _ssd_line(w: dict) -> str:

    line = (f"SSD writes (params on {w['offload']['params']}, optimizer on {w['offload']['optimizer']}): "
            f"{w['bytes_per_rank_step'] / 2**30:.2f} GiB per rank per step x {w['ranks_per_node']} rank(s) per node x "
            f"{w['steps']} steps = {w['tb_per_node']:.3g} TB per node")
    if w["share"] is None:
        return line + "; give --endurance-tbw (the drive's rated TB written, from its datasheet) for its share"
    line += f", {100 * w['share']:.3g}% of the drive's rated {w['endurance_tbw']:g} TB (--endurance-tbw)"
    warn = AioConfig().endurance_warn_fraction
    if w["share"] > warn:
        line += (f"; more than {100 * warn:g}% (aio.endurance_warn_fraction's default): compressed moments "
                 f"(--moments bf16), gradients in host memory (zero.offload_optimizer.gradients: cpu), the "
                 f"optimizer states in host memory, or fewer steps would cut it")
    return line


def _step_report(est: Estimate, args) -> str:
    run = _run_of(est, args)
    rates = {"dgx2": rm.DGX2, "h100": rm.H100_RAID}.get(args.rates)
    if args.hardware:
        rates = rm.NODES[args.hardware][0]
    if rates is None and _gpu_described(est, args) and device_count() == 0:
        raise EstimateError("--step-time: --gpus/--gpu-mem describe a GPU, but this machine has none, so the rates it "
                            "would measure are this CPU's; pass --rates h100 (an 8xH100 node's rates per GPU) or --rates "
                            "dgx2, or --hardware h100x8 / dgx2 for a whole node, or leave out --gpus and --gpu-mem to "
                            "predict this machine")
    preset = args.hardware or {"dgx2": "dgx2", "h100": "h100x8"}.get(args.rates)
    if rates is None:
        on_nvme = "nvme" in (run.param_tier, run.optimizer_tier) and args.drive_bandwidth is None
        rates = rm.Rates.measure(args.nvme_path or (tempfile.gettempdir() if on_nvme else None), run)
        preset = None
    row, why = _chosen(est, args)
    placed = f"{row.label}, {why}" if row is not None else ""
    return "\n".join([_report(est, args), "", f"step time predicted for {placed}:",
                      rm.describe(run, _drive_rates(rates, args, est.hardware.gpus_per_node, preset))])


def _drive_rates(rates: "rm.Rates", args, ranks: int, preset: Optional[str] = None) -> "rm.Rates":
    """A rank's NVMe rates from one drive's over ``--drives`` drives shared by the node's
    ``ranks`` ranks (Note [many drives] in _offload/_drives.py): the drive's as given
    (--drive-bandwidth), else a ``preset`` node's (its bandwidth over its drives, which are also
    the count left out), else the one measured here."""
    if args.drives is None and args.drive_bandwidth is None:
        return rates
    if args.drives is not None and args.drives < 1:
        raise EstimateError(f"drives: {args.drives} must be at least 1")
    own = pl.PRESET_DRIVES[preset] if preset else 1  # drives behind the rates' figures
    share = rm.NODES[preset][1] / own if preset else 1.0  # ranks per drive there
    read, write = _drive_bandwidth(args) or (rates.nvme_read * share, rates.nvme_write * share)
    drives = args.drives or own
    return dataclasses.replace(rates, nvme_read=rank_bandwidth(read, drives, args.nvme_layout, ranks),
                               nvme_write=rank_bandwidth(write, drives, args.nvme_layout, ranks))


def _drive_bandwidth(args) -> Optional[Tuple[float, float]]:
    """--drive-bandwidth READ[,WRITE] in bytes/s, or None when not given."""
    if args.drive_bandwidth is None:
        return None
    try:
        figures = [float(x) * 1e9 for x in args.drive_bandwidth.split(",")]
    except ValueError:
        figures = []
    if len(figures) not in (1, 2) or min(figures) <= 0:
        raise EstimateError(f"drive-bandwidth: {args.drive_bandwidth!r} must be READ or READ,WRITE in GB/s, "
                            f"e.g. 6.5,3.5")
    return figures[0], figures[-1]


def _plan_report(est: Given, args) -> str:
    """Note [planned by the engine] in _plan.py: the model built on the meta device and planned for the node."""
    others = [flag for flag, given in (("--step-time", args.step_time), ("--steps", args.steps is not None),
                                       ("--trainable", args.trainable is not None)) if given]
    if others:
        raise EstimateError(f"--plan: {', '.join(others)} belong to the estimate, not the plan (which trains every "
                            f"parameter of the model it builds: freeze parameters in a model and pass it to "
                            f"infinity.initialize for that); run them without --plan")
    if args.config is not None and args.drives is not None:
        raise EstimateError("--plan: --config's nvme_path names the drives (and zero.nvme_layout their layout); "
                            "leave out --drives, or --config")
    if args.config is not None and _splits(args):
        raise EstimateError("--plan: --config's offload sections give their splits (zero.offload_*.split); leave "
                            "out --offload-split, or --config")
    drives = pl.drive_names(args.drives, args.hardware, args.nvme_path)
    tiers = _tiers(args, "nvme,nvme")
    if args.stage < 3 and tiers[0] != "none":
        raise EstimateError(f"--stage {args.stage} keeps the parameters whole on the device: --offload none,"
                            f"{tiers[1]}, or --stage 3")
    cfg = pl.plan_config(",".join(tiers), args.dtype, args.config,
                         est.max_tile_params if args.tiling_factor > 1 else None, drives, args.nvme_layout,
                         stage=args.stage, moments=args.moments, splits=_splits(args))
    node = pl.node_of(est.hardware, cfg, args.hardware, _drive_bandwidth(args))
    fields = _config_dict(args.model)[0] if args.model is not None and est.arch == "config" else None
    result = pl.timed_plan(lambda: pl.build_meta(fields, est.shape, est.arch), cfg, node)
    return json.dumps(result.to_dict(), indent=2) if args.json else pl.report(result)


def _gpu_described(est: Estimate, args) -> bool:
    """The user sized a GPU (memory, or a count whose memory is not the host's)."""
    return args.gpu_mem is not None or (args.gpus is not None and not est.hardware.device_is_host)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        splits = offload_splits(args.offload_split)
    except EstimateError as exc:
        parser.error(str(exc))
    if args.hardware:  # the node's sizes, unless given
        _, gpus, gpu_mem, cpu_mem, nvme = rm.NODES[args.hardware]
        args.gpus, args.gpu_mem = args.gpus or gpus, args.gpu_mem or gpu_mem
        args.cpu_mem, args.nvme = args.cpu_mem or cpu_mem, args.nvme or nvme
    try:  # --plan plans its own placement: the table's rows are not planned for it
        est = (resolve if args.plan else estimate)(
            args.params, model=args.model, layers=args.layers, hidden=args.hidden, heads=args.heads,
            seq_len=args.seq_len, micro_batch=args.micro_batch, ckpt_interval=args.ckpt_interval, gpus=args.gpus,
            nodes=args.nodes, gpu_mem=args.gpu_mem, cpu_mem=args.cpu_mem, nvme=args.nvme, dtype=args.dtype,
            moments=args.moments, nvme_path=args.nvme_path, trainable=args.trainable,
            tiling_factor=args.tiling_factor, arch=args.arch, **({} if args.plan else {"splits": splits}))
    except EstimateError as exc:
        parser.error(str(exc))     # exits 2 with the usage and the message
    try:
        writes = _ssd_writes(est, args) if args.steps is not None and not args.plan else None  # --plan refuses --steps
        if args.plan:
            text = _plan_report(est, args)
        elif args.step_time:
            text = _step_report(est, args)
        elif args.json:
            asked = _chosen(est, args)[0] if args.offload is not None else None
            text = json.dumps(dict(est.to_dict(), **({"ssd_writes": writes} if writes else {}),
                                   **({"offload_placement": asked.to_dict()} if asked is not None else {})), indent=2)
        else:
            text = _report(est, args)
        if writes and not (args.json and not args.step_time):
            text += "\n" + _ssd_line(writes)
    except EstimateError as exc:
        parser.error(str(exc))
    sys.stdout.write(text + "\n")
    return 0
