"""Commands that the cases of one parametrized test each wait for, all started at once by a
module fixture: each is one process on one thread, so a machine's cores run them side by side
in the time of the longest instead of the sum. Output goes to files, not pipes, so a job whose
case is not being waited for yet never blocks on a full pipe."""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Dict, List, Optional, Tuple


class Jobs:
    """Use as a context manager: every job still running when the block ends (the module's
    tests are done, or a later start failed) is killed."""

    def __init__(self, root: Path):
        self.root = root
        self._jobs: Dict[str, Tuple[subprocess.Popen, Path, Path]] = {}

    def __enter__(self) -> "Jobs":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self, key: str, cmd: List[str], env: Optional[dict] = None, cwd: Optional[str] = None) -> None:
        if key in self._jobs:
            raise ValueError(f"job {key!r} was already started")
        i = len(self._jobs)
        out_path, err_path = self.root / f"{i}.out", self.root / f"{i}.err"
        with open(out_path, "w") as out, open(err_path, "w") as err:
            self._jobs[key] = (subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=cwd), out_path, err_path)

    def result(self, key: str, timeout: float) -> subprocess.CompletedProcess:
        """Job ``key`` once it ended (killed, and TimeoutExpired raised, past ``timeout``)."""
        proc, out_path, err_path = self._jobs[key]
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out_path.read_text(), err_path.read_text())

    def close(self) -> None:
        for proc, _, _ in self._jobs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
