"""The benchmarks have one home and share one set of helpers (CONTRIBUTING.md, Benchmarks): every
benchmark is a module of ``benchmarks/`` on the harness, and nothing the benchmarks define at
module level is defined again in ``benchmarks/`` or ``scripts/``. Read from the source (AST), nothing
imported."""
import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENTRY_POINTS = {"main", "measure"}  # every benchmark's own: its command line and its child's work
NOT_BENCHMARKS = {"report"}  # the page generator


def top_level_names(path: Path) -> set:
    tree = ast.parse(path.read_text(), filename=str(path))
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def benchmark_modules() -> list:
    return [p for p in sorted((ROOT / "benchmarks").glob("[!_]*.py")) if p.stem not in NOT_BENCHMARKS]


def test_no_helper_is_defined_twice_across_benchmarks_and_scripts():
    where = defaultdict(list)
    for path in sorted((ROOT / "benchmarks").rglob("*.py")) + sorted((ROOT / "scripts").rglob("*.py")):
        for name in top_level_names(path) - ENTRY_POINTS:
            where[name].append(path.relative_to(ROOT).as_posix())
    twice = {name: paths for name, paths in where.items()
             if len(paths) > 1 and any(p.startswith("benchmarks/") for p in paths)}
    assert not twice, f"defined more than once (use the one in benchmarks/, or name it for what it does): {twice}"


def test_every_benchmark_is_a_module_on_the_harness():
    assert not sorted((ROOT / "scripts").glob("bench_*.py")), "a benchmark belongs in benchmarks/ (python -m benchmarks.<name>)"
    for path in benchmark_modules():
        text = path.read_text()
        assert {"main", "measure"} <= top_level_names(path), path.name
        for call in ("_flags.parser(", "_harness.parse(p, measure", "_harness.run_cells(", "_harness.finish("):
            assert call in text, f"{path.name} does not call {call}...: its flags, processes and records are the harness's"
