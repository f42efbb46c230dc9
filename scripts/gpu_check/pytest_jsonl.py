"""A pytest plugin that prints one JSON line per test as soon as the test is done:

    {"test": nodeid, "outcome": "passed|failed|skipped|error", "duration_s": ...,
     "where": "infinity/x.py:123", "error": "last line of the message"}   (the last two for failures)

``where`` is the innermost frame inside the ``infinity`` package, a failed rank's own first
(the test's frame when the failure never reached the package). Load it with ``-p pytest_jsonl``
with this folder on ``PYTHONPATH``; ``scripts/gpu_check/phase.py`` collects the lines.
"""
import json
import os
import re

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PACKAGE = os.path.join(_ROOT, "infinity") + os.sep
_tests: dict = {}
_config: list = []


def pytest_configure(config):
    _config.append(config)


def _where(excinfo) -> str:
    """A failed rank's traceback comes as text in the message (infinity.testing.RankFailure):
    its frames come first, then those of this process."""
    text = [(path, int(line)) for path, line in re.findall(r'File "([^"]+)", line (\d+)', str(excinfo.value))]
    frames = [(str(e.path), e.lineno + 1) for e in excinfo.traceback]
    inside = ([f for f in text if f[0].startswith(_PACKAGE)] or [f for f in frames if f[0].startswith(_PACKAGE)]
              or frames[-1:])
    if not inside:
        return ""
    path, line = inside[-1]
    return f"{os.path.relpath(path, _ROOT)}:{line}"


def _last_line(excinfo) -> str:
    lines = str(excinfo.value).strip().splitlines()
    return f"{excinfo.typename}: {lines[-1] if lines else ''}".rstrip(": ")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    entry = _tests.setdefault(item.nodeid, {"test": item.nodeid, "outcome": "passed", "duration_s": 0.0})
    entry["duration_s"] = round(entry["duration_s"] + report.duration, 3)
    if report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        entry["error"] = reason.removeprefix("Skipped: ")
    elif report.failed and entry["outcome"] in ("passed", "skipped"):
        entry["outcome"] = "failed" if report.when == "call" else "error"
        if call.excinfo is not None:
            entry.update(where=_where(call.excinfo), error=_last_line(call.excinfo))


def pytest_runtest_logfinish(nodeid, location):
    entry = _tests.pop(nodeid, None)
    if entry is not None:
        # after the progress letter of -q, on a line of its own
        _config[0].pluginmanager.get_plugin("terminalreporter").write("\n" + json.dumps(entry) + "\n", flush=True)
