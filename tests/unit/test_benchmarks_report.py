"""docs/benchmarks.md and its plots are what the benchmark records give (``python -m
benchmarks.report``): the check fails when they are stale, and the page's figures are the
records' own."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain ``pytest`` does not put the repository root on the path
    sys.path.insert(0, str(ROOT))

from benchmarks import report  # noqa: E402

RECORDS = ROOT / "benchmarks" / "records"


def records(name: str) -> list:
    return [json.loads(line) for line in (RECORDS / name).read_text().splitlines() if line.strip()]


def row_of(page: str, contender: str, size: str) -> str:
    rows = [line for line in page.splitlines() if line.startswith(f"| {contender} | {size} |")]
    assert len(rows) == 1, f"{contender} at {size}: {len(rows)} rows in docs/benchmarks.md"
    return rows[0]


@pytest.fixture(scope="module")
def generated():
    return report.render(report.load_runs())


def test_page_and_plots_are_current():
    """Regenerate with ``python -m benchmarks.report`` when this fails."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.report", "--check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_check_needs_no_matplotlib():
    code = "import sys; sys.modules['matplotlib'] = None; from benchmarks import report; sys.exit(report.main(['--check']))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_stale_page_and_plots_are_named(generated, tmp_path):
    text, figures = generated
    page, images = tmp_path / "benchmarks.md", tmp_path / "images"
    images.mkdir()
    page.write_text(text + "edited by hand\n")
    for figure in figures[1:]:
        (images / figure.name).write_bytes((report.IMAGES / figure.name).read_bytes())
    (images / figures[-1].name).write_bytes((report.IMAGES / figures[0].name).read_bytes())  # another figure's data
    (images / f"{report.PREFIX}gone.png").write_bytes(b"")
    problems = report.stale(text, figures, page, images)
    assert problems == [f"{page.name}: not what the records give", f"{figures[0].name}: missing",
                        f"{figures[-1].name}: drawn from other data or code",
                        f"{report.PREFIX}gone.png: no figure of the page"]


def test_head_to_head_figures_are_the_records(generated):
    text, _ = generated
    check = records("h200-2026-11-28-gpu-check.jsonl")
    xl = next(r for r in check if r.get("bench") == "peers" and r.get("kind") == "result"
              and r["contender"] == "infinity-cpu" and r["size"] == "1.5b")
    row = row_of(text, "infinity-cpu", "1.5b")
    for figure in (f"{xl['step_s']:.3g}", f"{xl['step_s_min']:.3g}-{xl['step_s_max']:.3g}", f"{xl['tflops']:.1f}",
                   f"{xl['gpu_peak_gib']:.2f}", f"{xl['host_peak_gib']:.2f}", f"{xl['last_loss']:.4f}"):
        assert f" {figure} " in row, (figure, row)
    assert "separate run" not in row


def test_cells_from_separate_runs_say_so(generated):
    text, _ = generated
    for name in ("h200-2026-11-28-deepspeed-nvme-124m.jsonl", "h200-2026-11-28-fsdp2-124m.jsonl"):
        (r,) = records(name)
        row = row_of(text, r["contender"], r["size"])
        assert f" {r['step_s']:.3g} " in row and "**separate run**" in row and Path(name).stem in row, row


def test_recorded_ratios_are_the_pages(generated):
    """The ratios the page computes agree with those the peers run recorded."""
    text, _ = generated
    ratios = [r for r in records("h200-2026-11-28-gpu-check.jsonl") if r.get("kind") == "ratio"]
    assert ratios
    for q in ratios:
        line = f"- {q['size']}: **{q['contender']}** vs {q['vs']}: step time x{q['step']:.3g}"
        assert line in text, line


def test_machine_comes_from_the_env_records(generated):
    text, _ = generated
    env = {r["topic"]: r for r in records("h200-2026-11-28-gpu-check.jsonl") if r.get("phase") == "env" and "topic" in r}
    for figure in (env["gpu"]["driver"], env["torch_info"]["torch"], env["host"]["python"],
                   f"{env['host']['cpus']} cores", f"{env['host']['ram_gib']} GiB RAM"):
        assert figure in text, figure


def test_plots_are_deterministic(generated):
    pytest.importorskip("matplotlib")
    _, figures = generated
    figure = figures[0]
    first, second = report.png_bytes(figure), report.png_bytes(figure)
    assert first == second
    assert b"Software" not in first and report.png_text(first)["Comment"] == figure.digest()
