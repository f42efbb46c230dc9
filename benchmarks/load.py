"""Load a pretrained checkpoint larger than host memory under infinity.Init, against reading it,
then fine-tune one.

``load`` (size ``<--params-b>b``): a Llama-shaped safetensors checkpoint of ``--params-b``
billion parameters in bf16, in ``--shard-gb`` GB shards, is written without ever being held
(``infinity.testing.write_checkpoint``; the free disk is checked first), untimed; then, the page
cache dropped before each read (as root) so no figure is served from memory:

  aio-read         the reference: every shard read once through infinity.aio (O_DIRECT, 64 MiB
  aio-copy         requests): the disk's read speed for these files; and read and written once (a
                   copy on the same disk), side by side in one process
  from_pretrained  ours, in a process of its own: ``with infinity.Init(offload="nvme"):
                   from_pretrained(dir, dtype=bfloat16)`` then ``initialize`` (frozen, bf16 parameters
                   on NVMe); ``extra``: the bytes read against the file, the load alone, the peak RSS
                   (VmHWM, reset at the start) against the host memory

Ratios: from_pretrained against both references. ``finetune`` (size ``<--finetune-b>b``): a
checkpoint written the same way fine-tuned with ``python -m infinity.train --model DIR`` (the
same loading path), everything on NVMe, fp32 compute, ``--train-steps`` steps; its steps are
the train job's. The big files are removed at the end unless ``--keep``.

    python -m benchmarks.load --nvme-path /path/on/nvme [--params-b 13] [--finetune-b 3] [--only load,finetune]
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from . import _flags, _harness
from ._harness import Cell

BENCH = "load"
GB = 1e9
REFERENCES = ("aio-read", "aio-copy")
PAIRS = (("from_pretrained", "aio-read"), ("from_pretrained", "aio-copy"))


def llama_config(params_b: float):
    """A Llama shape of about ``params_b`` billion parameters (13B: 5120 x 40 layers)."""
    from transformers import LlamaConfig

    hidden = 5120 if params_b >= 10 else 3200 if params_b >= 2.5 else 2048 if params_b >= 0.1 else 256
    inter = int(hidden * 2.7) // 256 * 256
    per_layer = 4 * hidden * hidden + 3 * hidden * inter
    vocab = 32000
    layers = max(1, round((params_b * 1e9 - 2 * vocab * hidden) / per_layer))
    heads = hidden // 128 if hidden % 128 == 0 else hidden // 100
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=2048,
                       tie_word_embeddings=False)


def llama_params(cfg) -> int:
    h, i, v, n = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    return n * (4 * h * h + 3 * h * i + 2 * h) + 2 * v * h + h


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def read_once(files, copy_to=None, block=64 << 20) -> float:
    """Seconds to read ``files`` once through infinity.aio (O_DIRECT, ``block``-sized requests, 4
    in flight), and with ``copy_to`` to also write them there (a copy on the same disk)."""
    from infinity.aio import AsyncIO, aligned_empty

    bufs = [aligned_empty(block) for _ in range(4)]
    t = time.perf_counter()
    with AsyncIO(block_size=1 << 20, queue_depth=64) as h:
        for path in files:
            size = os.path.getsize(path) // 4096 * 4096
            off = 0
            while off < size:
                batch = []
                for b in bufs:
                    if off >= size:
                        break
                    n = min(block, size - off)
                    h.pread(b[:n], path, off)
                    batch.append((b[:n], off))
                    off += n
                h.wait()
                if copy_to is not None:
                    for b, o in batch:
                        h.pwrite(b, copy_to, o)
                    h.wait()
    return time.perf_counter() - t


def need_disk(where: str, nbytes: float, what: str) -> None:
    free = shutil.disk_usage(where).free
    if nbytes > free:
        sys.exit(f"benchmarks.load: {what} needs {nbytes / GB:.1f} GB under {where}, {free / GB:.1f} GB free; "
                 f"use --nvme-path on a larger disk or lower --params-b")


def write_llama(params_b: float, shard_gb: float, where: str) -> dict:
    """A bf16 checkpoint of ``params_b`` billion parameters written under ``where``: write_checkpoint's info."""
    import torch

    from infinity.testing import write_checkpoint

    return write_checkpoint(llama_config(params_b), where, torch.bfloat16, shard_bytes=int(shard_gb * GB))


def measure_references(spec: dict) -> dict:
    files = sorted(os.path.join(spec["checkpoint"], n) for n in os.listdir(spec["checkpoint"]))
    copy = os.path.join(spec["scratch"], "copy.bin")
    out = {name: [] for name in REFERENCES}
    for _ in range(spec["steps"]):
        dropped = drop_caches()
        out["aio-read"].append(read_once(files))
        out["aio-copy"].append(read_once(files, copy_to=copy))
        os.remove(copy)
    nbytes = sum(os.path.getsize(f) for f in files)
    return _harness.side_by_side({k: _harness.sample(v, extra={"file_bytes": nbytes, "page_cache_dropped": dropped})
                                  for k, v in out.items()})


def measure_load(spec: dict) -> dict:
    import psutil
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    import infinity
    from infinity.testing import peak_rss, reset_peak_rss, rss_now

    from ._trainers import infinity_config

    torch.set_num_threads(2)
    ck = spec["checkpoint"]
    MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(ck))]  # import the model's code before timing
    with infinity.Init(offload="cpu"):  # warm up the loader's own imports on a tiny model
        AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=8, hidden_size=8, intermediate_size=8,
                                                              num_hidden_layers=1, num_attention_heads=1))
    drop_caches()
    base = rss_now()
    reset_peak_rss()
    t = time.perf_counter()
    with infinity.Init(offload="nvme", nvme_path=spec["scratch"]) as init:
        model = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.bfloat16)
    load_s = time.perf_counter() - t
    for p in model.parameters():  # frozen: no optimizer states, only the bf16 parameters on NVMe
        p.requires_grad_(False)
    model, opt = infinity.initialize(model, infinity_config("nvme", "bf16", spec["scratch"], optimizer_tier="none"))
    wall = time.perf_counter() - t
    file_bytes = sum(os.path.getsize(os.path.join(ck, n)) for n in os.listdir(ck))
    extra = {"load_s": round(load_s, 2), "read_bytes": init.reader.bytes_read, "file_bytes": file_bytes,
             "read_over_file": round(init.reader.bytes_read / file_bytes, 3),
             "written_bytes": opt.param_store.bytes_written, "base_rss_gib": _harness.gib(base),
             "host_gib": _harness.gib(psutil.virtual_memory().total)}
    sample = _harness.sample([wall], dtype="bf16", host_peak=peak_rss(), extra=extra)
    opt.engine.close()
    return sample


def measure_finetune(spec: dict) -> dict:
    ck, swap, out_dir = (os.path.join(spec["scratch"], d) for d in ("checkpoint", "swap", "out"))
    write_llama(spec["params_b"], spec["shard_gb"], ck)
    from ._trainers import infinity_config

    cfg = dict(infinity_config("nvme", "fp32", swap, clip=None, optimizer={"lr": 1e-4}),
               train={"seq_len": 64, "micro_batch_size": 1, "save": False, "log_every": 1})
    os.makedirs(out_dir)
    cfg_path = os.path.join(out_dir, "run.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    drop_caches()
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "infinity.train", "--config", cfg_path, "--model", ck, "--steps",
                          str(spec["train_steps"]), "--output-dir", out_dir], capture_output=True, text=True)
    wall = time.perf_counter() - t
    if res.returncode != 0:
        raise SystemExit(f"benchmarks.load: the fine-tune failed:\n{res.stderr[-4000:]}")
    with open(os.path.join(out_dir, "telemetry.jsonl")) as f:
        steps = [s for s in map(json.loads, f) if s.get("event") == "step"]
    return _harness.sample([s["step_s"] for s in steps], losses=[s["loss"] for s in steps], dtype="fp32",
                           host_peak=max(s["rss_bytes"] for s in steps), extra={
                               "wall_s": round(wall, 1), "disk_read_gb": [round(s["disk_read_bytes"] / GB, 1) for s in steps],
                               "disk_write_gb": [round(s["disk_write_bytes"] / GB, 1) for s in steps]})


def measure(spec: dict) -> dict:
    return {"load": measure_references, "from_pretrained": measure_load, "finetune": measure_finetune}[spec["part"]](spec)


def main(argv=None) -> int:
    p = _flags.parser(__doc__, steps=1, warmup=0, only="load,finetune", timeout=4 * 3600.0, budget=8 * 3600.0)
    p.add_argument("--params-b", type=float, default=13.0, help="billions of parameters of the checkpoint to load")
    p.add_argument("--shard-gb", type=float, default=2.0)
    p.add_argument("--finetune-b", type=float, default=3.0, help="billions of parameters to fine-tune")
    p.add_argument("--train-steps", type=int, default=3, help="steps of the fine-tune")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint loaded")
    args = _harness.parse(p, measure, argv)
    if args.smoke:
        args.params_b, args.finetune_b, args.train_steps, args.shard_gb = 0.005, 0.005, 1, 0.01
    parts = _flags.parse_list(args.only)
    base = {"steps": args.steps, "params_b": args.finetune_b, "shard_gb": args.shard_gb, "train_steps": args.train_steps}
    records, ck = [], None
    try:
        if "load" in parts:
            n = llama_params(llama_config(args.params_b))
            need_disk(args.nvme_path, 2 * n * 2.05, f"a {n / 1e9:.1f}B-parameter bf16 checkpoint and its bf16 partitions")
            ck = tempfile.mkdtemp(prefix="bench-load-", dir=args.nvme_path)
            write_llama(args.params_b, args.shard_gb, ck)
            size = f"{args.params_b:g}b"
            cells = [Cell("load", size, side_by_side=REFERENCES), Cell("from_pretrained", size)]
            records += _harness.run_cells(BENCH, "benchmarks.load", cells, lambda cell, scratch: dict(
                base, part=cell.contender, checkpoint=ck, scratch=scratch), args, dtype="bf16")
        if "finetune" in parts:
            n = llama_params(llama_config(args.finetune_b))  # file (bf16), Init's chunks, master, moments, gradients
            need_disk(args.nvme_path, n * (2 + 4 + 16 + 4) * 1.05, f"fine-tuning {n / 1e9:.1f}B parameters on NVMe")
            records += _harness.run_cells(BENCH, "benchmarks.load", [Cell("finetune", f"{args.finetune_b:g}b")],
                                          lambda cell, scratch: dict(base, part="finetune", scratch=scratch), args,
                                          dtype="fp32")
    finally:
        if ck and not args.keep:
            shutil.rmtree(ck, ignore_errors=True)
    return _harness.finish(BENCH, records, args, PAIRS, extra=("read_over_file", "load_s", "file_bytes"))


if __name__ == "__main__":
    sys.exit(main())
