"""Benchmarks that run each contender in a process of its own (its peak RSS, threads and memory
its own): ``spawn_child`` starts a script with ``--child SPEC`` (the spec as JSON) and returns what
the child printed last, read as JSON."""
from __future__ import annotations

import json
import subprocess
import sys
from typing import Optional


class ChildFailed(RuntimeError):
    def __init__(self, what: str, returncode: int, stderr: Optional[str]):
        tail = "\n".join((stderr or "").strip().splitlines()[-12:])
        super().__init__(f"{what} failed with exit code {returncode}" + (f":\n{tail}" if tail else " (its stderr is above)"))


def spawn_child(script: str, spec: dict, timeout: float, *, what: str = "the child", python: str = sys.executable,
              env: Optional[dict] = None, capture_stderr: bool = False) -> dict:
    proc = subprocess.run([python, script, "--child", json.dumps(spec)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE if capture_stderr else None, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise ChildFailed(what, proc.returncode, proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])
