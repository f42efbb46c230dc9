"""Build description of the block cache (Note [block cache] in host_alloc.cpp), loaded by setup.py.

The one native library that links against torch: it is torch's CPU allocator, so it needs
c10's headers and the C++ ABI torch was built with. ``extension()`` returns None when torch
cannot be imported at build time (pip's isolated build); infinity then runs with glibc's
allocator and says so at ``initialize``. ``scripts/setup_env.sh`` builds without isolation.
"""
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def extension():
    try:
        import torch
        from torch.utils.cpp_extension import include_paths, library_paths
    except ImportError:
        return None
    from setuptools import Extension

    root = os.path.dirname(os.path.dirname(HERE))
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return Extension(
        "infinity._host_alloc",
        sources=[os.path.relpath(os.path.join(HERE, "host_alloc.cpp"), root)],
        include_dirs=include_paths(),
        library_dirs=library_paths(),
        libraries=["c10"],
        language="c++",
        # torch's headers and ABI; the library is loaded after torch, whose libc10 it then shares
        extra_compile_args=["-O2", "-std=c++17", "-Wall", "-Wextra", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                            "-DTORCH_EXTENSION_NAME=_host_alloc"],
    )
