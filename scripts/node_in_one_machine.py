"""A node in one machine: N ranks under torchrun (gloo on the CPU, NCCL where there are GPUs) train a
tiny GPT-2 with infinity, ZeRO stage 3, parameters and optimizer states on NVMe spread over the
given drives, each rank on its share of the cores (Note [rank placement] in
infinity/_runtime/_topology.py), and rank 0 checks every step's loss and the trained parameters
against plain PyTorch AdamW on the whole global batch.

    python scripts/node_in_one_machine.py                         # 8 ranks, two drive directories under /tmp
    python scripts/node_in_one_machine.py --ranks 8 --drives /mnt/nvme0,/mnt/nvme1 --steps 3

Run it from the repository root with infinity installed (``pip install -e .``, or ``PYTHONPATH=.``).
It starts torchrun itself (``python -m torch.distributed.run --standalone --nproc-per-node N``),
which sets LOCAL_RANK and LOCAL_WORLD_SIZE in each rank as on a real node. Prints where each rank
runs (its threads, CPUs, NUMA node) and the largest differences from plain PyTorch; exits 1 when
they pass the tolerances (fp32: 1e-5 relative on losses, 1e-5 on parameters).
"""
import argparse
import os
import subprocess
import sys
import tempfile

STEPS, LR, CLIP, VOCAB, SEQ = 3, 2e-3, 0.5, 96, 12


def _build(layers: int, hidden: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=hidden, n_layer=layers, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    model.config.use_cache = False
    return model


def _batches(steps: int, rows: int):
    import torch

    g = torch.Generator().manual_seed(1)
    pool = [torch.randint(0, VOCAB, (rows, SEQ), generator=g) for _ in range(2)]
    return [pool[i % 2] for i in range(steps)]


def _config(drives):
    return {"zero": {"stage": 3, "reduce_bucket_size": 3000,
                     "offload_param": {"device": "nvme", "nvme_path": drives},
                     "offload_optimizer": {"device": "nvme", "nvme_path": drives, "chunk_size": 4096}},
            "precision": {"dtype": "fp32"}, "optimizer": {"type": "adamw", "lr": LR, "weight_decay": 0.01},
            "gradient_clipping": CLIP}


def _reference(args, rows):
    import torch

    model = _build(args.layers, args.hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for ids in _batches(args.steps, rows):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def rank_main(args) -> int:
    import torch
    import torch.distributed as dist

    import infinity

    drives = args.drives.split(",")
    model, opt = infinity.initialize(_build(args.layers, args.hidden), _config(drives if len(drives) > 1 else drives[0]))
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = _batches(args.steps, world)  # a row a rank
    losses = []
    for ids in batches:
        loss = model(input_ids=ids.chunk(world)[rank], labels=ids.chunk(world)[rank]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = torch.tensor([loss.item()])
        dist.all_reduce(t)
        losses.append(t.item() / world)
    opt.wait_step()
    with infinity.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    placement = infinity.telemetry(model).get("placement", {})
    infinity.close(model)
    where = [None] * world
    dist.all_gather_object(where, (os.environ.get("LOCAL_RANK"), placement))
    if rank != 0:
        return 0
    for r, (local, p) in enumerate(where):
        node = "no NUMA node" if p.get("node", -1) < 0 else f"NUMA node {p['node']}"
        print(f"rank {r} (LOCAL_RANK {local}): {p.get('threads')} thread(s) on CPUs {p.get('cpus')}, "
              f"{p.get('cores')} core(s), {node} ({'pinned' if p.get('pinned') else 'not pinned'})")
    ref_losses, ref_params = _reference(args, world)
    loss_diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
    param_diff = max((params[n] - p).abs().max().item() for n, p in ref_params.items())
    print(f"losses     infinity {[round(x, 6) for x in losses]}\n           plain    {[round(x, 6) for x in ref_losses]}")
    print(f"largest relative loss difference {loss_diff:.2e}, largest parameter difference {param_diff:.2e}")
    ok = loss_diff <= 1e-5 and param_diff <= 1e-5 + 1e-5 * max(p.abs().max().item() for p in ref_params.values())
    print("matches plain PyTorch" if ok else "DOES NOT match plain PyTorch")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=8, help="ranks on this machine (torchrun's --nproc-per-node)")
    ap.add_argument("--drives", default=None, help="comma-separated swap directories, one per drive (default: "
                                                   "--drive-count fresh directories under the temporary directory)")
    ap.add_argument("--drive-count", type=int, default=2, help="drive directories made when --drives is not given")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=600, help="seconds before the job is stopped")
    args = ap.parse_args()
    if "LOCAL_RANK" in os.environ:
        return rank_main(args)
    with tempfile.TemporaryDirectory(prefix="infinity-node-") as tmp:
        if args.drives is None:
            args.drives = ",".join(os.path.join(tmp, f"drive{i}") for i in range(args.drive_count))
            for d in args.drives.split(","):
                os.mkdir(d)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
               os.path.abspath(__file__), "--drives", args.drives, "--steps", str(args.steps), "--layers",
               str(args.layers), "--hidden", str(args.hidden)]
        print(" ".join(cmd), flush=True)
        try:
            return subprocess.run(cmd, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            print(f"the job did not finish within {args.timeout:.0f} s", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
