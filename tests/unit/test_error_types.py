"""Every error infinity raises on purpose is an ``infinity.InfinityError`` (and still the
builtin exception a caller would catch), checked over the source: no ``raise`` of a bare
builtin exception class remains in the package."""
import ast
import builtins
import inspect
import pathlib

import pytest

import infinity
import infinity.errors

PACKAGE = pathlib.Path(infinity.__file__).parent
BUILTIN_ERRORS = {name for name, obj in vars(builtins).items() if inspect.isclass(obj) and issubclass(obj, BaseException)
                  } - {"SystemExit", "KeyboardInterrupt", "StopIteration", "GeneratorExit"}


def _raises(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name):
            yield node.exc.func.id, node.lineno


def test_no_bare_builtin_exception_is_raised():
    bare = [f"{path.relative_to(PACKAGE)}:{line} raises {name}" for path in PACKAGE.rglob("*.py")
            for name, line in _raises(path) if name in BUILTIN_ERRORS]
    assert bare == []


def test_no_assert_statements_guard_state():
    """``python -O`` drops asserts: preconditions are checks that always run."""
    found = [f"{path.relative_to(PACKAGE)}:{node.lineno}" for path in PACKAGE.rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Assert)]
    assert found == []


# Modules that import the Hugging Face stack (the Trainer alone takes seconds to import): their classes are
# checked in tests/integration/test_error_types_hf.py, the rest here.
HF_LIBRARIES = {"transformers", "trl", "peft", "accelerate", "datasets"}


def imports_hf(path: pathlib.Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
        if any(n.split(".")[0] in HF_LIBRARIES for n in names):
            return True
    return False


def exception_classes(hf: bool):
    """(qualified name, class) of every exception class defined in the package's modules that import
    the Hugging Face stack (``hf``) or that do not."""
    import importlib
    import importlib.util
    import pkgutil

    for mod in pkgutil.walk_packages([str(PACKAGE)], "infinity."):
        if mod.name.endswith(("__main__", "_aio_cffi", "_cpu_adam")):
            continue
        spec = importlib.util.find_spec(mod.name)
        if spec.origin.endswith(".py") and imports_hf(pathlib.Path(spec.origin)) != hf:
            continue
        module = importlib.import_module(mod.name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module.__name__:
                yield f"{module.__name__}.{name}", obj


def check_is_an_infinity_error(name, cls):
    if name.startswith("infinity.testing."):
        assert issubclass(cls, AssertionError)  # test failures, raised by the test harness
    elif name == "infinity.config.validate._LeafError":
        assert not issubclass(cls, infinity.InfinityError)  # internal to validation, never escapes it
    else:
        assert issubclass(cls, infinity.InfinityError)


@pytest.mark.parametrize("name,cls", list(exception_classes(hf=False)), ids=lambda x: x if isinstance(x, str) else "")
def test_every_exception_class_is_an_infinity_error(name, cls):
    check_is_an_infinity_error(name, cls)


def test_public_errors_keep_their_builtin_base():
    assert issubclass(infinity.ConfigError, ValueError)
    assert issubclass(infinity.ParameterNotAvailableError, RuntimeError)
    assert issubclass(infinity.aio.AioError, OSError) if hasattr(infinity.aio, "AioError") else True
    assert issubclass(infinity.errors.UsageError, ValueError)


def test_every_error_the_troubleshooting_guide_names_is_in_infinity_errors():
    """A user catches what the guide documents without reaching into private modules: each class
    of its table is ``infinity.errors.<name>`` (or the ``infinity.aio.<name>`` it spells out), the
    very class the engine raises."""
    import re

    import infinity.aio
    from infinity._runtime import _accelerator, _comm
    from infinity._zero import _param_groups

    guide = (PACKAGE.parent / "docs" / "guides" / "troubleshooting.md").read_text()
    table = guide.split("| class | also a | raised when |", 1)[1].split("\n\n", 1)[0]
    names = [n for row in table.splitlines()[2:] for n in re.findall(r"`([\w.]+)`", row.split("|")[1])]
    assert len(names) >= 20, names
    for name in names:
        home, _, short = name.rpartition(".")
        module = infinity.aio if home == "infinity.aio" else infinity.errors
        assert isinstance(getattr(module, short, None), type), f"{name} is not importable from {module.__name__}"
    assert _comm.JobStopped is infinity.errors.JobStopped and _comm.CommTimeout is infinity.errors.CommTimeout
    assert _accelerator.DeviceOutOfMemory is infinity.errors.DeviceOutOfMemory
    assert _param_groups.ParamGroupError is infinity.errors.ParamGroupError
