"""The package's layering, checked from the source: each module imports only from its own
layer or the layers below it, and no two modules import each other (directly or around a
cycle), type-only imports aside. See docs/architecture.md, "Layers"."""
import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "infinity")

# Lowest first. A new module goes into the layer of what it is, and may import only downwards.
LAYERS = {
    "runtime": ["errors", "_log", "_accelerator", "_comm", "_telemetry_counters", "_telemetry", "_tiers", "_recycle",
                "config", "_schedule", "aio", "optim", "_aio_cffi", "_cpu_adam"],
    "offload": ["_memory", "_layout", "_moments", "_swap", "_param_store", "_optimizer_store", "_optimizer_swapper",
                "_preflight", "_placement"],
    "zero": ["_ledger", "_param", "_pretrained", "_init", "_unit", "_phase", "_step_gate", "_prefetch", "_reduce",
             "_loss_scale", "_param_groups", "_optimizer", "tiling", "_activation_offload", "_engine", "_gathered",
             "_swap_labels", "_save_fence", "_initialize"],
    "apps": ["__init__", "train", "_train_data", "estimate", "_estimate", "export", "_safetensors_export", "_checkpoint",
             "testing", "integrations", "_runmodel", "_endurance"],
}
# Deferred (function-level) imports that close a cycle on purpose, each with its reason.
DEFERRED_OK: dict = {}
LEVEL = {name: i for i, layer in enumerate(LAYERS.values()) for name in layer}


def _modules():
    """(top-level name, file) of every Python file of the package."""
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, ROOT).split(os.sep)
                yield (rel[0][:-3] if len(rel) == 1 else rel[0]), path


def _imports(path):
    """(top-level module imported, type-only?) for every import of the package in a file."""
    tree = ast.parse(open(path).read())
    type_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only |= {id(n) for n in ast.walk(node)}
    root_level = 2 if os.path.dirname(path) != ROOT else 1  # the relative level that reaches infinity/
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.level < root_level:
                continue  # within a subpackage
            names = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
            for name in names:
                yield name, id(node) in type_only
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("infinity"):
            parts = node.module.split(".")
            names = [parts[1]] if len(parts) > 1 else [a.name for a in node.names]
            for name in names:
                yield name, id(node) in type_only


def _graph():
    graph = {}
    for name, path in _modules():
        for target, type_only in _imports(path):
            if target != name:
                graph.setdefault(name, set()).add((target, type_only))
    return graph


def test_every_module_has_a_layer():
    missing = sorted({name for name, _ in _modules()} - set(LEVEL))
    assert not missing, f"add these modules to a layer in tests/test_layering.py: {missing}"


def test_imports_point_down():
    wrong = []
    for name, targets in _graph().items():
        for target, type_only in targets:
            if target in LEVEL and not type_only and LEVEL[target] > LEVEL[name]:
                wrong.append(f"{name} ({list(LAYERS)[LEVEL[name]]}) imports {target} ({list(LAYERS)[LEVEL[target]]})")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


def test_no_import_cycles():
    edges = {name: {t for t, type_only in targets if not type_only and t in LEVEL and t != name
                    and (name, t) not in DEFERRED_OK}
             for name, targets in _graph().items()}
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("name", ["_unit", "_prefetch", "_reduce", "_phase", "_step_gate"])
def test_units_and_their_services_never_import_the_engine_or_the_optimizer(name):
    targets = {t for t, type_only in _graph().get(name, ()) if not type_only}
    assert not targets & {"_engine", "_optimizer", "_initialize"}, f"{name} imports {sorted(targets)}"


# infinity/config/: the validation knows no schema, the DeepSpeed mapping reads the schema only through the class
# it is given, and the schema builds on both (see the package's docstring).
CONFIG_ORDER = ["validate", "deepspeed", "schema", "__init__"]


def test_config_package_imports_point_down():
    wrong = []
    for i, name in enumerate(CONFIG_ORDER):
        tree = ast.parse(open(os.path.join(ROOT, "config", f"{name}.py")).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                target = node.module.split(".")[0]
                if target not in CONFIG_ORDER[:i]:
                    wrong.append(f"config/{name}.py imports .{target}")
    assert not wrong, "imports against the order of infinity/config/ " + str(CONFIG_ORDER) + ":\n" + "\n".join(wrong)
