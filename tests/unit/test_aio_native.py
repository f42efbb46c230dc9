"""native/aio at its C ABI: the fault-injection hook is inert until armed and refuses bad rules
(a failure of the system, no threads, coming back as -errno instead of a C++ exception reaching
std::terminate: tests/integration/test_aio_errors.py, in a process of its own)."""
import errno

import pytest
import torch

from infinity.aio import AioError, AsyncIO
from infinity.aio._inject import clear, inject
from infinity.errors import UsageError


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
