"""``torch.cuda`` is called only in the accelerator layer (infinity/_runtime/_accelerator/):
everything else asks that layer, so the rest of the package is device-agnostic and runs on the
emulated device in tests."""
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "infinity"
LAYER = PACKAGE / "_runtime" / "_accelerator"
CALL = re.compile(r"\btorch\.cuda\b")


def test_only_the_accelerator_layer_calls_torch_cuda():
    outside = [f"{path.relative_to(PACKAGE.parent)}:{n}"
               for path in sorted(PACKAGE.rglob("*.py")) if LAYER not in path.parents
               for n, line in enumerate(path.read_text().splitlines(), 1)
               if CALL.search(line.split("#", 1)[0])]
    assert outside == [], f"torch.cuda outside the accelerator layer: {outside}"
