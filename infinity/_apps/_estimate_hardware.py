"""The machine an estimate is for: GPUs per node and their memory, host memory and free NVMe,
given or read from this machine."""
from __future__ import annotations

import shutil
from dataclasses import dataclass

import psutil

from .._runtime import _accelerator
from .._runtime._log import logger

# --------------------------------------------------------------------------- hardware

@dataclass(frozen=True)
class Hardware:
    """Sizes per node. With no accelerator the device tier is host memory."""

    gpus_per_node: int
    nodes: int
    gpu_mem: int
    cpu_mem: int
    nvme: int
    device_is_host: bool = False
    detected: tuple = ()          # names of the sizes read from this machine

    @property
    def ranks(self) -> int:
        return self.gpus_per_node * self.nodes


def _accelerator_memory() -> tuple[int, int]:
    """(device count, bytes per device) from the accelerator module; (0, 0) without one."""
    count = _accelerator.device_count()
    return (count, _accelerator.device_memory_total() or 0) if count else (0, 0)


def _detect_hardware(gpus, nodes, gpu_mem, cpu_mem, nvme, nvme_dir) -> Hardware:
    detected = []
    if cpu_mem is None:
        cpu_mem = psutil.virtual_memory().total
        detected.append("cpu_mem")
    if nvme is None:
        nvme = shutil.disk_usage(nvme_dir).free
        detected.append("nvme")
    device_is_host = False
    if gpus is None or gpu_mem is None:
        count, memory = _accelerator_memory()
        if gpus is None:
            gpus = count or 1
            device_is_host = count == 0
            detected.append("gpus")
        if gpu_mem is None:
            if memory == 0:       # no accelerator: ranks run on the CPU, device tier = host RAM
                device_is_host = True
                memory = cpu_mem
            gpu_mem = memory
            detected.append("gpu_mem")
    hw = Hardware(gpus_per_node=gpus, nodes=nodes, gpu_mem=gpu_mem, cpu_mem=cpu_mem, nvme=nvme,
                  device_is_host=device_is_host, detected=tuple(detected))
    if detected:
        logger.info("estimate: read %s from this machine", ", ".join(detected))
    return hw
