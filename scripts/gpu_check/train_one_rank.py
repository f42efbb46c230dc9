"""Phase (f) of scripts/gpu_check.sh: the train job as one torchrun rank (NCCL on a GPU).

Runs ``torchrun --standalone --nproc_per_node 1 -m infinity.train`` (as ``python -m
torch.distributed.run``, the same program under this interpreter) on the embedded default
config (gpt2-tiny, every state on NVMe) with the loss logged every step, swap files and
telemetry in a temp dir, for ``--steps`` steps; passes its output through and ends with one
JSON line: exit code, the process-group backend it reported, and the loss of each step.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--path", default=os.environ.get("GPU_CHECK_DISK", "/var/tmp"), help="where the temp dir goes")
    p.add_argument("--timeout", type=float, default=50.0)
    args = p.parse_args()
    from infinity.train import default_config

    work = tempfile.mkdtemp(prefix="gpu_check_train_", dir=args.path)
    cfg = default_config()
    cfg["train"].update(log_every=1, output_dir=os.path.join(work, "out"))
    with open(os.path.join(work, "config.json"), "w") as f:
        json.dump(cfg, f)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
           "-m", "infinity.train", "--config", os.path.join(work, "config.json"), "--steps", str(args.steps),
           "--no-save", "--offload", "nvme", "--nvme-path", os.path.join(work, "nvme")]
    print(" ".join(cmd), flush=True)
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=args.timeout)
        rc, output = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as e:
        rc, output = "timeout", e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(output, flush=True)
    print(json.dumps({"rc": rc, **reported(output, rc != 0)}), flush=True)


def reported(output: str, failed: bool) -> dict:
    """The process-group backend the job logged (``gloo``, or ``cpu:gloo,cuda:nccl`` on a GPU),
    the loss of each step, and on failure the last line naming an error."""
    backend = re.findall(r"initialized torch.distributed \(([^)]+)\)", output)
    losses = [{"step": int(s), "loss": float(v)} for s, v in re.findall(r"step\s+(\d+)/\d+\s+loss\s+([-\d.naif]+)", output)]
    errors = [line for line in output.splitlines() if "error" in line.lower()][-1:]
    return {"backend": backend[0] if backend else None, "losses": losses,
            **({"error": errors[0][-200:]} if failed and errors else {})}


if __name__ == "__main__":
    sys.exit(main())
