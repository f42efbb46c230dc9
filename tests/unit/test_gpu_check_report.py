"""scripts/gpu_check/train_one_rank.py reads the backend and the losses from the train job's
output, the backend in every spelling the job logs (a CUDA job: ``cpu:gloo,cuda:nccl``)."""
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check" / "train_one_rank.py"


def _script():
    spec = importlib.util.spec_from_file_location("train_one_rank", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("backend", ["cpu:gloo,cuda:nccl", "gloo", "nccl"])
def test_the_backend_is_read_in_every_spelling(backend):
    output = (f"[infinity rank 0] INFO initialized torch.distributed ({backend}), world size 1\n"
              "step     1/2  loss 5.7216  lr 3.00e-04  614 tokens/s\n"
              "step     2/2  loss 4.4781  lr 3.00e-04  9167 tokens/s\n")
    got = _script().reported(output, failed=False)
    assert got == {"backend": backend, "losses": [{"step": 1, "loss": 5.7216}, {"step": 2, "loss": 4.4781}]}


def test_a_failed_run_reports_its_last_error_line():
    got = _script().reported("infinity.train: error: nvme_path '/x' does not exist\n", failed=True)
    assert got["backend"] is None and got["error"].startswith("infinity.train: error")
