"""One build for the Python package and both native libraries.

Each native library describes its own build in ``native/<name>/build.py``:
``native/aio/build.py`` exposes a cffi ``ffibuilder`` and ``native/cpu_adam/build.py``
exposes ``extension()`` returning a pybind11 extension; neither links against torch.
``native/host_alloc/build.py`` (torch's CPU allocator, so it does) returns None when torch
cannot be imported at build time.
"""
import importlib.util
import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _load(relpath):
    path = os.path.join(HERE, relpath)
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location(relpath.replace("/", "_")[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ext_modules = []
cffi_modules = []
_cpu_adam = _load("native/cpu_adam/build.py")
if _cpu_adam is not None:
    ext_modules.append(_cpu_adam.extension())
_host_alloc = _load("native/host_alloc/build.py")
_host_alloc_ext = _host_alloc.extension() if _host_alloc is not None else None
if _host_alloc_ext is not None:
    ext_modules.append(_host_alloc_ext)
if os.path.exists(os.path.join(HERE, "native/aio/build.py")):
    cffi_modules.append("native/aio/build.py:ffibuilder")

setup(
    name="infinity",
    version="0.1.0",
    description="ZeRO-Infinity: train models larger than device and host memory",
    packages=find_packages(include=["infinity", "infinity.*"]),
    python_requires=">=3.10",
    # A range the local CPU build (2.13.0) satisfies; never a bare "torch", which would
    # pull a multi-GB CUDA build on a machine without torch.
    install_requires=[
        "torch>=2.4,<2.15",
        "psutil>=5.9",
        "pyyaml>=6.0",
        "cffi>=1.15",
        "tqdm>=4.60",
        "safetensors>=0.4",
        "numpy>=1.22",  # the checkpoint format and the CRC helpers
    ],
    extras_require={"hf": ["transformers>=4.40"], "test": ["pytest>=7", "pytest-xdist>=3.2", "transformers>=4.40"]},
    setup_requires=["cffi>=1.15", "pybind11>=2.10"],
    ext_modules=ext_modules,
    cffi_modules=cffi_modules,
    zip_safe=False,
)
