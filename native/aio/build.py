"""cffi build of native/aio: ``ffibuilder`` makes the module ``infinity._aio_cffi``.

setup.py lists this file in ``cffi_modules``. The C++ sources (every ``*.cpp`` here, split by
job: engine.h lists them) are compiled together with cffi's generated wrapper (API mode, out
of line). When liburing's header is missing, or
``INFINITY_AIO_NO_URING=1`` is set, the library is built without io_uring and its
thread-pool backend serves every handle. Nothing here links against torch.
"""
import os
import re
import shutil
import subprocess
import sysconfig
import tempfile

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))

def header_declarations() -> str:
    """The C ABI's declarations for cffi, read from the header itself so the two never
    drift: comments, preprocessor lines and the extern "C" wrapper are dropped."""
    with open(os.path.join(HERE, "infinity_aio.h")) as f:
        text = re.sub(r"/\*.*?\*/", "", f.read(), flags=re.S)
    keep = [line for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#") and line.strip() not in ('extern "C" {', "}")]
    return "\n".join(keep) + "\n"



_PROBE = "#include <liburing.h>\nint main(void) { struct io_uring r; return io_uring_queue_init(1, &r, 0); }\n"


def have_liburing() -> bool:
    """Compiles and links a one-line io_uring program: header and library both present."""
    if os.environ.get("INFINITY_AIO_NO_URING") == "1":
        return False
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    if shutil.which(cc[0]) is None:
        cc = ["cc"]
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write(_PROBE)
        cmd = cc + [src, "-o", os.path.join(tmp, "probe"), "-luring"]
        try:
            return subprocess.run(cmd, capture_output=True).returncode == 0
        except OSError:
            return False


def _relative(path: str) -> str:
    # setuptools wants sources relative to the directory setup.py runs in.
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def sanitize_flags() -> list:
    """``INFINITY_SANITIZE=1``: an ASan + UBSan build (scripts/test_sanitize.sh), never installed."""
    if os.environ.get("INFINITY_SANITIZE") != "1":
        return []
    return ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined", "-g"]


# Every C++ source of the library, split by job (engine.h lists them); the headers rebuild it when they change.
SOURCES = sorted(name for name in os.listdir(HERE) if name.endswith(".cpp"))
HEADERS = sorted(name for name in os.listdir(HERE) if name.endswith(".h"))
_URING = have_liburing()
_EXTRA = sanitize_flags()
ffibuilder = FFI()
ffibuilder.cdef(header_declarations())
ffibuilder.set_source(
    "infinity._aio_cffi",
    '#include "infinity_aio.h"\n',
    sources=[_relative(os.path.join(HERE, name)) for name in SOURCES],
    depends=[_relative(os.path.join(HERE, name)) for name in HEADERS],
    include_dirs=[HERE],
    source_extension=".cpp",
    extra_compile_args=["-O2", "-std=c++17", "-fvisibility=hidden", "-Wall", "-Wextra"] + _EXTRA,
    define_macros=[] if _URING else [("INFINITY_AIO_NO_URING", "1")],
    extra_link_args=_EXTRA,
    libraries=(["uring"] if _URING else []) + ["stdc++", "pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
