"""cffi build of native/aio: ``ffibuilder`` makes the module ``infinity._aio_cffi``.

setup.py lists this file in ``cffi_modules``. The C++ sources are compiled together with
cffi's generated wrapper (API mode, out of line). When liburing's header is missing, or
``INFINITY_AIO_NO_URING=1`` is set, the library is built without io_uring and its
thread-pool backend serves every handle. Nothing here links against torch.
"""
import os
import shutil
import subprocess
import sysconfig
import tempfile

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))

CDEF = """
typedef struct infinity_aio infinity_aio;
typedef struct infinity_aio_error {
    int64_t id;
    int64_t offset;
    int64_t length;
    int64_t transferred;
    int32_t err;
    int32_t op;
} infinity_aio_error;

int infinity_aio_has_uring(void);
int infinity_aio_create(int32_t backend, int64_t block_size, int32_t queue_depth, int32_t threads,
                        infinity_aio **out, char *why, size_t why_len);
int infinity_aio_backend(const infinity_aio *h);
void infinity_aio_destroy(infinity_aio *h);
int64_t infinity_aio_submit(infinity_aio *h, int32_t op, int32_t fd_direct, int32_t fd_buffered,
                            void *buf, int64_t length, int64_t offset);
int infinity_aio_rw(infinity_aio *h, int32_t op, int32_t fd_direct, int32_t fd_buffered, void *buf,
                    int64_t length, int64_t offset, infinity_aio_error *err);
int64_t infinity_aio_wait(infinity_aio *h, infinity_aio_error *errs, int32_t max_errs,
                          int32_t *n_errs, int64_t *horizon);
int64_t infinity_aio_in_flight(infinity_aio *h);
int64_t infinity_aio_direct_fallbacks(infinity_aio *h);
void *infinity_aio_alloc(int64_t bytes, int32_t hugepage, int32_t *huge);
void infinity_aio_free(void *p, int64_t bytes, int32_t hugepage);
"""

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


_URING = have_liburing()
ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "infinity._aio_cffi",
    '#include "infinity_aio.h"\n',
    sources=[_relative(os.path.join(HERE, "aio.cpp"))],
    include_dirs=[HERE],
    source_extension=".cpp",
    extra_compile_args=["-O2", "-std=c++17", "-fvisibility=hidden"],
    define_macros=[] if _URING else [("INFINITY_AIO_NO_URING", "1")],
    libraries=(["uring"] if _URING else []) + ["stdc++", "pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
