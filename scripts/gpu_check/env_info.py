"""Phase (a) of scripts/gpu_check.sh: what the machine is, as one JSON line per topic.

Each topic is measured on its own, so one that fails (no nvidia-smi, infinity not built)
is recorded as ``{"topic": ..., "error": ...}`` and the others still are.
"""
import json
import os
import platform
import shutil
import subprocess
import sys


def gpu() -> dict:
    if shutil.which("nvidia-smi") is None:
        return {"nvidia_smi": "not found"}
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
    name, memory, driver = [x.strip() for x in out[0].split(",")]
    return {"gpus": len(out), "name": name, "memory": memory, "driver": driver}


def torch_info() -> dict:
    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(device=props.name, device_memory_gib=round(props.total_memory / 2**30, 1),
                   capability=f"{props.major}.{props.minor}", bf16=torch.cuda.is_bf16_supported(),
                   nccl=".".join(map(str, torch.cuda.nccl.version())))
    return out


def host() -> dict:
    import psutil

    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    disks = {d: round(shutil.disk_usage(d).free / 2**30, 1) for d in (os.getcwd(), "/tmp", "/var/tmp")
             if os.path.isdir(d)}
    return {"python": platform.python_version(), "kernel": platform.release(), "cpu": model,
            "cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
            "ram_gib": round(psutil.virtual_memory().total / 2**30, 1), "disk_free_gib": disks,
            "compiler": (subprocess.run(["c++", "--version"], capture_output=True, text=True).stdout
                         .splitlines() or ["none"])[0] if shutil.which("c++") else "none"}


def libraries() -> dict:
    import transformers

    out = {"transformers": transformers.__version__}
    for name in ("cffi", "pycparser", "tqdm"):
        module = __import__(name)
        carried = "gpu_check_site" in module.__file__  # installed from .whl/ by scripts/gpu_check.sh
        out[name] = getattr(module, "__version__", "?") + (" (carried wheel)" if carried else "")
    return out


def aio() -> dict:
    """The backend a default handle gets, and when it is the thread pool, why io_uring was refused."""
    import infinity  # noqa: F401 - the package, with all its native modules
    from infinity.aio import AsyncIO
    from infinity.errors import InfinityError

    with AsyncIO() as h:
        out = {"aio_backend": h.backend}
    if h.backend != "io_uring":
        try:
            AsyncIO(backend="io_uring").close()
        except InfinityError as e:
            out["io_uring_refused"] = str(e)
    for name in ("_cpu_adam", "_host_alloc"):
        try:
            __import__(f"infinity.{name}")
            out[name] = "built"
        except ImportError as e:
            out[name] = f"missing: {e}"
    return out


def main() -> None:
    for topic in (gpu, torch_info, host, libraries, aio):
        try:
            record = topic()
        except Exception as e:  # noqa: BLE001 - one topic's failure is recorded, the others go on
            record = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps({"topic": topic.__name__, **record}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
