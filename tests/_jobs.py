"""Commands that the cases of one parametrized test each wait for, all started at once by a
module fixture: each is one process on one thread, so a machine's cores run them side by side
in the time of the longest instead of the sum. Output goes to files, not pipes, so a job whose
case is not being waited for yet never blocks on a full pipe."""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Dict, List, Optional


class Jobs:
    def __init__(self, root: Path):
        self.root = root
        self._procs: Dict[str, subprocess.Popen] = {}

    def start(self, key: str, cmd: List[str], env: Optional[dict] = None, cwd: Optional[str] = None) -> None:
        i = len(self._procs)
        with open(self.root / f"{i}.out", "w") as out, open(self.root / f"{i}.err", "w") as err:
            self._procs[key] = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=cwd)

    def result(self, key: str, timeout: float) -> subprocess.CompletedProcess:
        """Job ``key`` once it ended (killed, and TimeoutExpired raised, past ``timeout``)."""
        proc = self._procs[key]
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        i = list(self._procs).index(key)
        return subprocess.CompletedProcess(proc.args, proc.returncode, (self.root / f"{i}.out").read_text(),
                                           (self.root / f"{i}.err").read_text())

    def close(self) -> None:
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
