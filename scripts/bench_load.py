"""Load a pretrained checkpoint larger than host memory under infinity.Init, then fine-tune one.

    python scripts/bench_load.py --nvme-path /path/on/nvme [--params-b 13] [--finetune-b 3]

1. Writes a Llama-shaped safetensors checkpoint of ``--params-b`` billion parameters in bf16,
   in 2 GB shards, without ever holding it (``infinity.testing.write_checkpoint``); checks the
   free disk first and says what it needs.
2. Reference: reads every shard once through ``infinity.aio`` (O_DIRECT, 64 MiB requests),
   which is the disk's read speed for this file.
3. Ours, in a fresh process: ``with infinity.Init(offload="nvme"): from_pretrained(dir,
   dtype=bfloat16)``, reporting the wall time, the bytes this rank read against the file size,
   the read bandwidth against the reference, and the peak RSS (VmHWM, reset at the start) against
   the host memory.
4. Fine-tunes a ``--finetune-b`` billion parameter checkpoint written the same way with
   ``python -m infinity.train --model DIR`` (the same loading path), everything on NVMe,
   fp32 compute, for ``--steps`` steps.
The page cache is dropped before each read (root) so no figure is served from memory. The
big files are removed at the end unless ``--keep``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GB = 1e9
GiB = float(1 << 30)

_LOAD = r"""
import json, sys, time
import torch
from transformers import AutoModelForCausalLM
import infinity
from infinity.testing import peak_rss, reset_peak_rss, rss_now
torch.set_num_threads(2)
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(sys.argv[1]))]  # import the model's code before timing
import os
with infinity.Init(offload="cpu"):  # warm up the loader's own imports on a tiny model
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=8, hidden_size=8, intermediate_size=8,
                                                          num_hidden_layers=1, num_attention_heads=1))
for name in os.listdir(sys.argv[1]):  # the checkpoint is read from the disk, not the page cache
    fd = os.open(os.path.join(sys.argv[1], name), os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
base = rss_now()
reset_peak_rss()
t = time.perf_counter()
with infinity.Init(offload="nvme", nvme_path=sys.argv[2]) as init:
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
load_s = time.perf_counter() - t
for p in model.parameters():  # frozen: no optimizer states, only the bf16 parameters on NVMe
    p.requires_grad_(False)
cfg = {"zero": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": sys.argv[2]}},
       "precision": {"dtype": "bf16"}}
model, opt = infinity.initialize(model, cfg)
wall = time.perf_counter() - t
print(json.dumps({"load_s": load_s, "wall_s": wall, "read_bytes": init.reader.bytes_read, "base_rss": base,
                  "peak_rss": peak_rss(), "written_bytes": opt.param_store.bytes_written}))
opt.engine.close()
"""


def llama_config(params_b: float):
    """A Llama shape of about ``params_b`` billion parameters (13B: 5120 x 40 layers)."""
    from transformers import LlamaConfig

    hidden = 5120 if params_b >= 10 else (3200 if params_b >= 2.5 else 2048)
    inter = int(hidden * 2.7) // 256 * 256
    per_layer = 4 * hidden * hidden + 3 * hidden * inter
    vocab = 32000
    layers = max(1, round((params_b * 1e9 - 2 * vocab * hidden) / per_layer))
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=hidden // 128 if hidden % 128 == 0 else hidden // 100,
                       num_key_value_heads=hidden // 128 if hidden % 128 == 0 else hidden // 100,
                       max_position_embeddings=2048, tie_word_embeddings=False)


def param_count(cfg) -> int:
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
        sys.exit(f"bench_load: {what} needs {nbytes / GB:.1f} GB under {where}, {free / GB:.1f} GB free; "
                 f"use --nvme-path on a larger disk or lower --params-b")


def bench_load(args) -> dict:
    import torch

    from infinity.testing import write_checkpoint

    cfg = llama_config(args.params_b)
    n = param_count(cfg)
    file_bytes = 2 * n
    need_disk(args.nvme_path, file_bytes * 2.05,
              f"a {n / 1e9:.1f}B-parameter bf16 checkpoint and its bf16 partitions (or a copy of it)")
    ckpt = tempfile.mkdtemp(prefix="bench-load-", dir=args.nvme_path)
    try:
        t = time.perf_counter()
        info = write_checkpoint(cfg, ckpt, torch.bfloat16, shard_bytes=int(args.shard_gb * GB))
        write_s = time.perf_counter() - t
        print(f"wrote {len(info['files'])} shards, {info['bytes'] / GB:.1f} GB ({info['params'] / 1e9:.2f}B parameters) "
              f"in {write_s:.0f} s; host memory {psutil.virtual_memory().total / GiB:.1f} GiB")
        dropped = drop_caches()
        ref_s = read_once(info["files"])
        print(f"reference: reading the files once through infinity.aio: {ref_s:.1f} s, "
              f"{info['bytes'] / ref_s / GB:.2f} GB/s" + ("" if dropped else " (page cache NOT dropped: not root)"))
        copy = os.path.join(args.nvme_path, "bench-load-copy.bin")
        try:
            copy_s = read_once(info["files"], copy_to=copy)
        finally:
            if os.path.exists(copy):
                os.remove(copy)
        print(f"reference: reading and writing them once (a copy on the same disk): {copy_s:.1f} s")
        drop_caches()
        swap = os.path.join(args.nvme_path, "bench-load-swap")
        out = subprocess.run([sys.executable, "-c", _LOAD, ckpt, swap], capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"bench_load: the load failed:\n{out.stderr[-4000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r.update(file_bytes=info["bytes"], ref_s=ref_s, copy_s=copy_s, host_bytes=psutil.virtual_memory().total)
        print(f"ours: Init(offload='nvme') + from_pretrained(dtype=bfloat16): {r['load_s']:.1f} s; + initialize "
              f"(frozen, bf16 parameters on NVMe): {r['wall_s']:.1f} s in all = {r['wall_s'] / ref_s:.2f}x the "
              f"reference read, {r['wall_s'] / copy_s:.2f}x the reference copy")
        print(f"this rank read {r['read_bytes'] / GB:.2f} GB of the {info['bytes'] / GB:.2f} GB checkpoint "
              f"({r['read_bytes'] / info['bytes']:.3f}x) and wrote {r['written_bytes'] / GB:.2f} GB of partitions; "
              f"{r['read_bytes'] / r['wall_s'] / GB:.2f} GB/s read against {info['bytes'] / ref_s / GB:.2f} GB/s "
              f"for infinity.aio alone")
        print(f"peak RSS {r['peak_rss'] / GiB:.2f} GiB (process at start {r['base_rss'] / GiB:.2f} GiB) for a "
              f"{info['bytes'] / GiB:.1f} GiB checkpoint on a {r['host_bytes'] / GiB:.1f} GiB machine")
        return r
    finally:
        if not args.keep:
            shutil.rmtree(ckpt, ignore_errors=True)


def bench_finetune(args) -> None:
    import torch

    from infinity.testing import write_checkpoint

    cfg = llama_config(args.finetune_b)
    n = param_count(cfg)
    # file (bf16) + Init chunks (fp32) + master, moments, gradients (fp32) + parameters (fp32)
    need_disk(args.nvme_path, n * (2 + 4 + 16 + 4) * 1.05, f"fine-tuning {n / 1e9:.1f}B parameters on NVMe")
    ckpt = tempfile.mkdtemp(prefix="bench-finetune-", dir=args.nvme_path)
    swap = os.path.join(args.nvme_path, "bench-finetune-swap")
    out_dir = tempfile.mkdtemp(prefix="bench-finetune-out-")
    try:
        write_checkpoint(cfg, ckpt, torch.bfloat16, shard_bytes=int(args.shard_gb * GB))
        run_cfg = {"zero": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": swap},
                            "offload_optimizer": {"device": "nvme", "nvme_path": swap}},
                   "precision": {"dtype": "fp32"},
                   "train": {"seq_len": 64, "micro_batch_size": 1, "save": False, "log_every": 1}}
        cfg_path = os.path.join(out_dir, "run.json")
        with open(cfg_path, "w") as f:
            json.dump(run_cfg, f)
        drop_caches()
        t = time.perf_counter()
        res = subprocess.run([sys.executable, "-m", "infinity.train", "--config", cfg_path, "--model", ckpt,
                              "--steps", str(args.steps), "--output-dir", out_dir], capture_output=True, text=True)
        wall = time.perf_counter() - t
        if res.returncode != 0:
            sys.exit(f"bench_load: the fine-tune failed:\n{res.stderr[-4000:]}")
        steps = [json.loads(x) for x in open(os.path.join(out_dir, "telemetry.jsonl"))]
        steps = [s for s in steps if s.get("event") == "step"]
        print(f"fine-tune {n / 1e9:.2f}B parameters, everything on NVMe, fp32: {wall:.0f} s in all "
              f"(load + initialize + {len(steps)} steps)")
        for s in steps:
            print(f"  step {s['step']}: loss {s['loss']:.4f}, {s['step_s']:.1f} s, RSS {s['rss_bytes'] / GiB:.2f} GiB, "
                  f"disk read {s['disk_read_bytes'] / GB:.1f} GB, written {s['disk_write_bytes'] / GB:.1f} GB")
    finally:
        if not args.keep:
            shutil.rmtree(ckpt, ignore_errors=True)
        shutil.rmtree(out_dir, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nvme-path", required=True, help="a directory on the disk to measure")
    p.add_argument("--params-b", type=float, default=13.0, help="billions of parameters of the checkpoint to load")
    p.add_argument("--shard-gb", type=float, default=2.0)
    p.add_argument("--finetune-b", type=float, default=3.0, help="billions of parameters to fine-tune (0: skip)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--skip-load", action="store_true")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    args = p.parse_args()
    os.makedirs(args.nvme_path, exist_ok=True)
    if not args.skip_load:
        bench_load(args)
    if args.finetune_b > 0:
        bench_finetune(args)


if __name__ == "__main__":
    main()
