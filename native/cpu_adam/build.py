"""Build description of the native CPU Adam, loaded by setup.py.

Note: no -march/-mavx flags. The SIMD kernels carry per-function target attributes and
are chosen at run time by CPUID, so one binary runs on any x86-64 (a build machine's ISA
baked in with -march=native dies with an illegal instruction elsewhere).
"""
import os

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ["bindings.cpp", "dispatch.cpp", "thread_pool.cpp", "adam_scalar.cpp", "adam_avx2.cpp", "adam_avx512.cpp",
           "moments.cpp"]
HEADERS = ["cpu_adam.h", "kernel_table.h", "dispatch.h", "thread_pool.h", "adam_avx512_body.h", "moments.h"]


def _sanitize() -> list:
    """``INFINITY_SANITIZE=1``: an ASan + UBSan build (scripts/test_sanitize.sh), never installed."""
    if os.environ.get("INFINITY_SANITIZE") != "1":
        return []
    return ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined", "-g"]


def extension():
    from pybind11.setup_helpers import Pybind11Extension

    root = os.path.dirname(os.path.dirname(HERE))
    return Pybind11Extension(
        "infinity._cpu_adam",
        # setuptools wants paths relative to setup.py
        sources=[os.path.relpath(os.path.join(HERE, s), root) for s in SOURCES],
        include_dirs=[os.path.relpath(HERE, root)],
        depends=[os.path.relpath(os.path.join(HERE, h), root) for h in HEADERS],
        cxx_std=17,
        # GCC 12 warns about the _mm512_undefined_* idiom inside its own intrinsic headers.
        extra_compile_args=["-O3", "-fno-math-errno", "-Wall", "-Wextra", "-Wno-maybe-uninitialized"] + _sanitize(),
        extra_link_args=["-pthread"] + _sanitize(),
    )
