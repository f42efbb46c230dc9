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
    return report.benchmarks_page(report.load_runs())


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


# the run with the most peers cells ok: the head-to-head's (Note [merged cells] in report.py)
MAIN = "h200-2026-12-04-gpu-check.jsonl"


def test_head_to_head_figures_are_the_records(generated):
    text, _ = generated
    check = records(MAIN)
    xl = next(r for r in check if r.get("bench") == "peers" and r.get("kind") == "result"
              and r["contender"] == "infinity-cpu" and r["size"] == "1.5b")
    row = row_of(text, "infinity-cpu", "1.5b")
    for figure in (f"{xl['step_s']:.3g}", f"{xl['step_s_min']:.3g}-{xl['step_s_max']:.3g}", f"{xl['tflops']:.1f}",
                   f"{xl['gpu_peak_gib']:.2f}", f"{xl['host_peak_gib']:.2f}", f"{xl['last_loss']:.4f}"):
        assert f" {figure} " in row, (figure, row)
    assert "separate run" not in row


def test_cells_from_separate_runs_say_so(generated):
    text, _ = generated
    for name in ("h200-2026-11-28-fsdp2-124m.jsonl",):  # the main run measured DeepSpeed's NVMe cell itself
        (r,) = records(name)
        row = row_of(text, r["contender"], r["size"])
        assert f" {r['step_s']:.3g} " in row and "**separate run**" in row and Path(name).stem in row, row


def test_recorded_ratios_are_the_pages(generated):
    """The ratios the page computes agree with those the peers run recorded."""
    text, _ = generated
    ratios = [r for r in records(MAIN) if r.get("kind") == "ratio"]
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


def test_every_record_is_of_the_one_schema():
    """Every benchmark record kept (a GPU check's own lines aside) is of the harness's schema."""
    from benchmarks import _harness

    for path in sorted(RECORDS.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "bench" in record:
                assert _harness.check_record(record) == [], (path.name, record)


def test_the_measured_page_is_the_transcribed_records():
    page = (ROOT / "docs" / "measured.md").read_text()
    transcribed = [r for run in report.load_runs() for r in run.records if r.get("kind") == "transcribed"]
    assert transcribed and "scripts/bench_" not in page
    for r in transcribed:
        assert f"\n## {r['section']}\n" in page and r["machine"] in page and r["measured"] in page, r["section"]
        for block in r["body"]:
            if isinstance(block, dict):
                row = block["rows"][0]
                assert "| " + " | ".join(row) + " |" in page, (r["section"], row)


def test_a_stale_measured_page_fails_the_check(tmp_path, monkeypatch):
    stale_page = tmp_path / "measured.md"
    stale_page.write_text((ROOT / "docs" / "measured.md").read_text().replace("1.08x", "1.8x"))
    monkeypatch.setattr(report, "MEASURED", stale_page)
    assert report.main(["--check"]) == 1


def test_another_benchmarks_records_get_a_section(generated):
    """A benchmark without a section of its own is shown from its records, ratios included."""
    from benchmarks import _harness

    def result(contender, step):
        return {"bench": "cpu_adam", "kind": "result", "contender": contender, "size": "64M-t2", "status": "ok",
                "step_s": step, "step_s_min": step, "step_s_max": step, "steps": 5, "rounds": 1, "tflops": None,
                "gpu_peak_gib": None, "host_peak_gib": None, "first_loss": None, "last_loss": None, "params": 1 << 26,
                "tokens_per_step": 0, "device": None, "dtype": "fp32", "error": None, "extra": {"gelems_per_s": 1.5}}

    records = [result("ours-fp32", 0.04), result("torch-fused-fp32", 0.05)]
    records += _harness.ratios("cpu_adam", records, [("ours-fp32", "torch-fused-fp32")])
    assert all(_harness.check_record(r) == [] for r in records)
    run = report.Run(RECORDS / "made-up.jsonl", tuple(records), "a test's records")
    text, _ = report.benchmarks_page(report.load_runs() + [run])
    assert "### `cpu_adam`" in text and "| ours-fp32 | 64M-t2 | 0.04 |" in text
    assert "64M-t2: ours-fp32 / torch-fused-fp32: step x0.8" in text
    assert text.count("python -m benchmarks.cpu_adam") >= 2  # the list of benchmarks, and its section
