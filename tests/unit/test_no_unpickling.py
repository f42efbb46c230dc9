"""Nothing in infinity unpickles what it reads, but in one place that asks for it (Note [data,
never code] in infinity/_checkpoint/_files.py).

Every call in the package that could unpickle (``torch.load``, ``pickle.load`` / ``loads`` /
``Unpickler``, ``numpy.load`` with ``allow_pickle``) is found in the source, and each must be
safe by its arguments (``torch.load(..., weights_only=True)``) or sit where it is allowed:
``_checkpoint/_legacy.py``'s ``load_pickle``, the one opt-in (``trust_pickle=True``), and the
result queue of ``infinity.testing.run_ranks``, which reads back only what the ranks it started
sent it, never a file."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "infinity"
ALLOWED = {("_checkpoint/_legacy.py", "load_pickle"): 1,  # the opt-in: trust_pickle=True
           ("testing.py", "_loads"): 1}  # run_ranks' results from its own rank processes
MODULES = {"torch": {"load"}, "pickle": {"load", "loads", "Unpickler"}, "np": {"load"}, "numpy": {"load"},
           "dill": {"load", "loads"}, "cloudpickle": {"load", "loads"}, "joblib": {"load"}}


def _unsafe_calls(tree: ast.AST):
    """(enclosing function, line) of every call that may unpickle."""
    out = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call) and _may_unpickle(child):
                out.append((function, child.lineno))
            visit(child, name)

    visit(tree, None)
    return out


def _may_unpickle(call: ast.Call) -> bool:
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and \
            func.attr in MODULES.get(func.value.id, ()):
        kwargs = {k.arg: k.value for k in call.keywords}
        if func.value.id == "torch":
            safe = kwargs.get("weights_only")
            return not (isinstance(safe, ast.Constant) and safe.value is True)
        if func.value.id in ("np", "numpy"):
            allow = kwargs.get("allow_pickle")
            return not (allow is None or (isinstance(allow, ast.Constant) and allow.value is False))
        return True
    if isinstance(func, ast.Name) and func.id in ("load", "loads", "Unpickler"):
        return True  # from pickle import load: flagged (a bare load of another module is rare here)
    return False


def test_nothing_unpickles_outside_the_opt_in():
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for function, line in _unsafe_calls(ast.parse(path.read_text(), rel)):
            found.setdefault((rel, function), []).append(line)
    stray = {k: v for k, v in found.items() if k not in ALLOWED}
    assert not stray, (f"calls that may unpickle (torch.load without weights_only=True, pickle.load...): {stray}; "
                       f"a checkpoint is data, never code: read JSON or safetensors instead")
    assert {k: len(v) for k, v in found.items()} == ALLOWED  # the allowed places are still what they are


def test_the_scan_finds_what_it_looks_for():
    src = ("import torch, pickle\nfrom pickle import loads\n"
           "def f(p):\n    torch.load(p)\n    torch.load(p, weights_only=False)\n    torch.load(p, weights_only=True)\n"
           "    pickle.loads(b'')\n    loads(b'')\n    np.load(p, allow_pickle=True)\n    np.load(p)\n")
    assert [line for _, line in _unsafe_calls(ast.parse(src))] == [4, 5, 7, 8, 9]
