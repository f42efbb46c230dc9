"""native/aio at its C ABI: failures of the system (no memory, no threads) come back as
-errno instead of a C++ exception reaching std::terminate; the fault-injection hook is inert
until armed and refuses bad rules."""
import errno
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from infinity.aio import AioError, AsyncIO
from infinity.aio._inject import clear, inject
from infinity.errors import UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_NO_THREADS = textwrap.dedent("""
    import resource
    from infinity.aio import AsyncIO
    from infinity.errors import EngineError
    # Address space for what is mapped now and a little more: a 64-thread pool's stacks do not fit.
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (96 << 20), resource.RLIM_INFINITY))
    try:
        AsyncIO(backend="threads", threads=8, queue_depth=8)
    except EngineError as e:
        print("refused:", e)
    else:
        print("created")
""")


def test_thread_creation_failure_is_an_error_not_an_abort():
    r = subprocess.run([sys.executable, "-c", _NO_THREADS], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, f"the process died ({r.returncode}): {r.stderr[-2000:]}"
    out = r.stdout.strip()
    if out == "created":
        pytest.skip("the address-space limit did not stop thread creation here")
    assert out.startswith("refused:") and ("Resource temporarily unavailable" in out or "memory" in out), out


def test_injection_is_inert_until_armed_and_refuses_bad_rules(tmp_path):
    path = str(tmp_path / "f.bin")
    data = torch.arange(4096, dtype=torch.int32)
    with AsyncIO() as h:
        h.sync_pwrite(data, path, 0)
        with pytest.raises(UsageError):
            inject(path, "read", "errno", arg=0)  # an errno fault needs the errno
        with pytest.raises(UsageError):
            inject(path, "read", "flip", nth=0)
        rule = inject(path, "read", "errno", nth=2, arg=errno.EIO)
        try:
            out = torch.empty_like(data)
            h.sync_pread(out, path, 0)  # the first read: untouched
            assert torch.equal(out, data) and rule.hits == 0
            with pytest.raises(AioError, match=r"\(EIO\)"):
                h.sync_pread(out, path, 0)
            assert rule.hits == 1
            h.sync_pread(out, path, 0)  # count=1: the third read is clean again
        finally:
            clear()
        assert torch.equal(out, data)
