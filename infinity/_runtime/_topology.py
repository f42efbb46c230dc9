"""The node a rank runs on: its NUMA nodes and physical cores read from sysfs, this rank's
share of them, and the placement of its threads and host memory there.

Note [rank placement]: a node runs several ranks (torchrun's LOCAL_WORLD_SIZE), and each rank's
CPU work (the native Adam, torch's intra-op pool, the copies) left to its defaults would use
every core: 8 ranks on a node oversubscribe its cores 8 times over. So each rank takes its
share, decided alike on every rank from what the ranks read and exchange in one all-gather:

- the cores: those this process may use (``os.sched_getaffinity``: a container or a launcher
  may restrict it; placement never widens it), grouped into physical cores (a core's
  hyperthreads go together: sysfs's ``thread_siblings_list``);
- the node: with ``zero.numa: auto`` the NUMA node of the rank's GPU (sysfs's
  ``/sys/bus/pci/devices/<pci address>/numa_node``, the address from the accelerator layer; each
  rank reads its own and the ranks exchange them, with their CPU masks, in one all-gather),
  or, without one, the local ranks spread over the nodes in blocks (ranks 0-3 on node 0 and
  4-7 on node 1 for 8 ranks on two; fewer ranks than nodes keep every node's cores, a lone
  rank on two sockets among them); a node number pins every rank there;
- the ranks it divides with: the local ranks launched with the same CPU mask: all of them
  under torchrun; none but itself where the launcher already gave each rank cores of its own
  (``srun --cpu-bind``), which it then keeps whole;
- the share: the ranks placed on one node divide its cores in contiguous blocks by their order,
  so no two overlap while there are at least as many cores as ranks (with fewer, a core is
  shared by the fewest ranks); its thread count is its number of physical cores, at least 1
  (``zero.cpu_threads`` overrides the count alone). The aio workers keep their count
  (``aio.threads``: they wait on the disk more than they compute) and run on the share too.

Placing a rank (``place``) moves every thread the process has to its share (the threads of
``/proc/self/task``: gloo's and torch's pools exist before ``initialize``; a thread started later
inherits its creator's mask), lowers torch's intra-op threads to the share (a smaller count set
by the user is kept), and sets the calling thread's memory policy to prefer the node
(``set_mempolicy(MPOL_PREFERRED)``). The memory policy, not an ``mbind`` of each mapping, because
one call covers every allocator: the engine's pinned buffers (``aio.aligned_empty``, faulted in
by ``cudaHostRegister`` in the calling thread), the block cache's mappings, glibc's heap and the
threads started afterwards (the aio workers, the Adam pool, the step's thread), which inherit it;
threads that existed before keep the kernel's default, local allocation, and run on the node's
cores, so they allocate there too. Preferred, not bound: a node out of memory spills to another
instead of failing. Pages touched before ``place`` stay where they are. On a machine with one
node there is nothing to choose and no call is made (the placement says so), and ``zero.numa:
off`` places nothing: the thread count is still the share, the cores and memory are left alone.

A process placed again (a second engine) divides what the launcher gave it, not its own
share: the mask it was given is remembered the first time and used while the affinity is still
the share placed.
"""
from __future__ import annotations

import ctypes
import dataclasses
import glob
import os
import platform
import socket
import threading
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from ..errors import EngineError, UsageError
from . import _accelerator as acc
from . import _comm as comm
from ._log import logger

SYSFS = "/sys"

MPOL_DEFAULT, MPOL_PREFERRED = 0, 1
# set_mempolicy and get_mempolicy by architecture (glibc wraps neither; libnuma is not needed for two calls)
_SYSCALLS = {"x86_64": (238, 239), "aarch64": (237, 236), "ppc64le": (261, 260)}


def parse_cpulist(text: str) -> Tuple[int, ...]:
    """The CPUs of a sysfs list such as ``0-3,8,10-11``."""
    out: List[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(out)


def format_cpulist(cpus: Iterable[int]) -> str:
    """The inverse of ``parse_cpulist``: ``0-3,8``."""
    ranges: List[List[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


@dataclass(frozen=True)
class Topology:
    """A machine's NUMA nodes (each its logical CPUs) and physical cores (each its hyperthreads)."""

    nodes: Dict[int, Tuple[int, ...]]
    cores: Tuple[Tuple[int, ...], ...]  # sorted by their first CPU
    root: str = SYSFS

    @classmethod
    def read(cls, root: str = SYSFS) -> "Topology":
        """From a sysfs tree (``root`` a recorded copy in tests): ``devices/system/node/node*/cpulist``
        and ``devices/system/cpu/cpu*/topology/thread_siblings_list``; without the node directory
        (a kernel without NUMA) one node 0 holding the online CPUs."""
        nodes: Dict[int, Tuple[int, ...]] = {}
        for path in glob.glob(os.path.join(root, "devices/system/node/node[0-9]*")):
            cpus = parse_cpulist(_read(os.path.join(path, "cpulist")) or "")
            if cpus:  # a node of memory alone (CXL, HBM) has no cores to place on
                nodes[int(os.path.basename(path)[4:])] = cpus
        if not nodes:
            online = _read(os.path.join(root, "devices/system/cpu/online"))
            nodes = {0: parse_cpulist(online) if online else tuple(sorted(os.sched_getaffinity(0)))}
        cores: Dict[Tuple[int, ...], None] = {}
        for cpu in sorted(c for cpus in nodes.values() for c in cpus):
            siblings = _read(os.path.join(root, f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"))
            cores[parse_cpulist(siblings) if siblings else (cpu,)] = None
        return cls(nodes, tuple(sorted(cores, key=lambda c: c[0])), root)

    def device_node(self, pci_address: Optional[str]) -> Optional[int]:
        """The NUMA node of a PCI device (``0000:3b:00.0``); None when unknown (no address, no
        such device, or the firmware says -1)."""
        if not pci_address:
            return None
        text = _read(os.path.join(self.root, "bus/pci/devices", pci_address.lower(), "numa_node"))
        if text is None or int(text) < 0 or int(text) not in self.nodes:
            return None
        return int(text)


@dataclass(frozen=True)
class CoreShare:
    """Where one rank runs (Note [rank placement]): its CPUs, the node they are on, its thread count."""

    cpus: Tuple[int, ...]          # the logical CPUs of its share
    cores: int                     # physical cores among them
    threads: int                   # its CPU threads (native Adam, torch's intra-op pool)
    node: Optional[int]            # None: not placed on a node (zero.numa off)
    why: str                       # how the node was chosen
    local_rank: int
    local_world: int
    pinned: bool                   # its threads are to be moved to ``cpus``
    memory_node: Optional[int]     # where its host memory is preferred; None: where the kernel puts it

    def describe(self) -> str:
        where = f"NUMA node {self.node} ({self.why})" if self.node is not None else self.why
        verb = "pinned to" if self.pinned else "sized for"
        memory = f", host memory preferred on node {self.memory_node}" if self.memory_node is not None else ""
        return (f"local rank {self.local_rank}/{self.local_world}: {self.threads} thread(s), {verb} CPUs "
                f"{format_cpulist(self.cpus)} ({self.cores} core(s)), {where}{memory}")

    def record(self) -> dict:
        """For telemetry: numbers, and the CPU list as text."""
        return {"local_rank": self.local_rank, "threads": self.threads, "cores": self.cores,
                "cpus": format_cpulist(self.cpus), "node": -1 if self.node is None else self.node,
                "pinned": self.pinned, "memory_node": -1 if self.memory_node is None else self.memory_node}


Numa = Union[str, int]


def share_of(topo: Topology, allowed: Iterable[int], local_rank: int, local_world: int, numa: Numa = "auto",
             cpu_threads: Optional[int] = None, device_nodes: Sequence[Optional[int]] = (),
             sharing: Optional[Sequence[int]] = None) -> CoreShare:
    """This rank's share (Note [rank placement]). ``device_nodes[r]``: the NUMA node of local rank
    r's GPU, where known; ``sharing``: the local ranks launched with this rank's CPU mask (None:
    all of them), the only ones it divides its cores with."""
    if not 0 <= local_rank < local_world:
        raise UsageError(f"LOCAL_RANK {local_rank} is outside LOCAL_WORLD_SIZE {local_world}; launch with torchrun "
                         "or set both as it does")
    allowed = set(allowed)
    usable = {n: tuple(c for c in cpus if c in allowed) for n, cpus in topo.nodes.items()}
    usable = {n: cpus for n, cpus in usable.items() if cpus}
    if not usable:
        raise UsageError(f"none of the CPUs this process may use ({format_cpulist(allowed)}) is on a NUMA node "
                         f"of {topo.root}")
    node_of: Dict[int, Optional[int]]
    if numa == "off":
        node_of = {r: None for r in range(local_world)}
        why = "zero.numa off"
    elif isinstance(numa, int):
        if numa not in topo.nodes:
            raise UsageError(f"zero.numa: node {numa} does not exist here (nodes with cores: "
                             f"{', '.join(map(str, sorted(topo.nodes)))}); choose one of those, auto or off")
        if numa not in usable:
            raise UsageError(f"zero.numa: node {numa} has none of the CPUs this process may use here (nodes with "
                             f"them: {', '.join(map(str, sorted(usable)))}); choose one of those, auto or off")
        node_of = {r: numa for r in range(local_world)}
        why = "zero.numa"
    else:
        node_of, why = _auto_nodes(sorted(usable), local_world, device_nodes)
    mine = node_of[local_rank]
    sharing = range(local_world) if sharing is None else sorted(sharing)
    peers = [r for r in sharing if node_of[r] == mine]
    pool = usable[mine] if mine is not None else tuple(sorted(allowed))
    groups = [g for g in (tuple(c for c in core if c in pool) for core in topo.cores) if g]
    groups += [(c,) for c in pool if not any(c in g for g in groups)]  # CPUs sysfs gave no core for
    groups.sort(key=lambda g: g[0])
    taken = _block(groups, peers.index(local_rank), len(peers))
    cpus = tuple(sorted(c for g in taken for c in g))
    pinned = numa != "off"
    memory_node = mine if pinned and len(usable) > 1 else None  # one node: nothing to choose
    return CoreShare(cpus=cpus, cores=len(taken), threads=cpu_threads or len(taken), node=mine, why=why,
                     local_rank=local_rank, local_world=local_world, pinned=pinned, memory_node=memory_node)


def _auto_nodes(nodes: List[int], local_world: int,
                device_nodes: Sequence[Optional[int]]) -> Tuple[Dict[int, Optional[int]], str]:
    """``zero.numa: auto``: each local rank's GPU's node when every one is known, else blocks of
    ranks over the nodes."""
    known = [device_nodes[r] if r < len(device_nodes) else None for r in range(local_world)]
    if all(n is not None and n in nodes for n in known):
        return dict(enumerate(known)), "its GPU's"
    if len(nodes) == 1:
        return {r: nodes[0] for r in range(local_world)}, "the only node"
    if local_world < len(nodes):  # one rank on two sockets keeps both: more cores beat nearer memory
        return {r: None for r in range(local_world)}, "across the NUMA nodes (fewer local ranks than nodes)"
    return {r: nodes[r * len(nodes) // local_world] for r in range(local_world)}, "local ranks spread over nodes"


def _block(groups: list, index: int, count: int) -> list:
    """The ``index``-th of ``count`` contiguous blocks of ``groups``; one group each (shared) when
    there are fewer groups than blocks."""
    n = len(groups)
    if count <= n:
        return groups[index * n // count:(index + 1) * n // count]
    return [groups[index * n // count]]


# ---------------------------------------------------------------------------------------------
# This process


class _Placed:
    """The CPUs the launcher gave this process, and the share last placed (Note [rank placement])."""

    lock = threading.Lock()
    launch: Optional[frozenset] = None
    share: Optional[CoreShare] = None


def local_ranks() -> Tuple[int, int]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) as torchrun sets them; (0, 1) without them. A launcher that
    sets LOCAL_RANK alone has at least LOCAL_RANK + 1 ranks on the node (``place`` counts them
    from the ranks' all-gather)."""
    try:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", str(max(1, local_rank + 1))))
    except ValueError as err:
        raise UsageError(f"LOCAL_RANK / LOCAL_WORLD_SIZE must be integers as torchrun sets them: {err}") from None


def allowed_cpus() -> frozenset:
    """The CPUs this process may divide: what it was launched with, even after its own placement."""
    now = frozenset(os.sched_getaffinity(0))
    with _Placed.lock:
        placed = _Placed.share
        if _Placed.launch is None or placed is None or not placed.pinned or now != frozenset(placed.cpus):
            _Placed.launch = now  # the user's (or the launcher's) own mask
        return _Placed.launch


def current() -> Optional[CoreShare]:
    """The share this process was last placed on; None before any engine placed it."""
    return _Placed.share


def default_threads() -> int:
    """Threads of CPU work where nothing says otherwise (the native Adam's): torch's intra-op
    count once ``place`` set it, else that count capped at this rank's share of the CPUs it may
    use (the native Adam used without an engine, under torchrun)."""
    if _Placed.share is not None:
        return torch.get_num_threads()
    _, local_world = local_ranks()
    return max(1, min(torch.get_num_threads(), len(os.sched_getaffinity(0)) // max(1, local_world)))


def place(numa: Numa = "auto", cpu_threads: Optional[int] = None, root: str = SYSFS) -> CoreShare:
    """Note [rank placement]: this rank's share, its threads and memory placed there."""
    local_rank, local_world = local_ranks()
    topo, allowed = Topology.read(root), allowed_cpus()
    device_nodes, sharing, local_world = _local_peers(local_rank, local_world, allowed,
                                                      topo.device_node(acc.pci_address()))
    share = share_of(topo, allowed, local_rank, local_world, numa, cpu_threads, device_nodes, sharing)
    if share.pinned:
        _pin_threads(share.cpus)
    if cpu_threads is not None and cpu_threads > len(share.cpus):
        logger.warning("zero.cpu_threads %d is more than the %d CPU(s) of this rank's share (%s): the threads take "
                       "turns on them, and the rank's CPU work (Adam, copies) runs slower, not faster; leave it null "
                       "for the share, or give the rank more CPUs", cpu_threads, len(share.cpus),
                       format_cpulist(share.cpus))
    if cpu_threads is not None or torch.get_num_threads() > share.threads:
        torch.set_num_threads(share.threads)
    if share.memory_node is not None and not prefer_node(share.memory_node):
        share = dataclasses.replace(share, memory_node=None)  # prefer_node said why
    with _Placed.lock:
        _Placed.share = share
    logger.info("placement: %s", share.describe())
    return share


def _local_peers(local_rank: int, local_world: int, allowed: frozenset,
                 gpu_node: Optional[int]) -> Tuple[List[Optional[int]], List[int], int]:
    """One all-gather among the ranks: the NUMA node of each local rank's GPU (each rank reads its
    own: a launcher may show each rank its GPU alone), the local ranks of this host launched
    with this rank's CPU mask: every one under plain torchrun; only itself where the launcher gave
    each rank cores of its own (``srun --cpu-bind``, ``taskset`` per rank), which it keeps whole;
    and the ranks on this host where the launcher did not set LOCAL_WORLD_SIZE."""
    host, mask = socket.gethostname(), sorted(allowed)
    if not comm.is_distributed():  # no peers to ask: the environment's local ranks share the mask
        return [gpu_node if r == local_rank else None for r in range(local_world)], list(range(local_world)), local_world
    gathered = comm.all_gather_object((host, local_rank, mask, gpu_node), what="all-gather of the ranks' placement")
    if "LOCAL_WORLD_SIZE" not in os.environ:
        local_world = max([local_world] + [r + 1 for h, r, _, _ in gathered if h == host])
    here = [(r, m, node) for h, r, m, node in gathered if h == host and 0 <= r < local_world]
    device_nodes: List[Optional[int]] = [None] * local_world
    for r, _, node in here:
        device_nodes[r] = node
    return device_nodes, [r for r, m, _ in here if m == mask], local_world


def _pin_threads(cpus: Tuple[int, ...]) -> None:
    """Every thread of this process onto ``cpus`` (a thread that ended meanwhile is skipped)."""
    mask = set(cpus)
    os.sched_setaffinity(0, mask)  # this thread first: a refusal here is the launcher's and is raised
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), mask)
        except ProcessLookupError:
            pass


def _syscalls() -> Optional[Tuple[int, int]]:
    return _SYSCALLS.get(platform.machine())


def prefer_node(node: int) -> bool:
    """``set_mempolicy(MPOL_PREFERRED, {node})`` for the calling thread and those it starts;
    False (said in the log) where this architecture's call is unknown."""
    calls = _syscalls()
    if calls is None:
        logger.warning("placement: set_mempolicy's number on %s is unknown; host memory is left where the kernel "
                       "puts it", platform.machine())
        return False
    mask = (ctypes.c_ulong * (node // 64 + 1))()
    mask[node // 64] = 1 << (node % 64)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(calls[0], MPOL_PREFERRED, mask, ctypes.c_ulong(64 * len(mask) + 1)) != 0:
        err = ctypes.get_errno()
        raise EngineError(f"set_mempolicy(MPOL_PREFERRED, node {node}) failed: {os.strerror(err)} (errno {err}); "
                          f"set zero.numa: off to leave host memory where the kernel puts it")
    return True


def memory_policy() -> Tuple[int, Tuple[int, ...]]:
    """The calling thread's (mode, nodes) from ``get_mempolicy``, for tests and diagnosis."""
    calls = _syscalls()
    if calls is None:
        raise UsageError(f"get_mempolicy's number on {platform.machine()} is unknown")
    mode = ctypes.c_int()
    mask = (ctypes.c_ulong * 16)()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(calls[1], ctypes.byref(mode), mask, ctypes.c_ulong(64 * 16), None, 0) != 0:
        err = ctypes.get_errno()
        raise EngineError(f"get_mempolicy failed: {os.strerror(err)} (errno {err})")
    nodes = tuple(i * 64 + b for i, word in enumerate(mask) for b in range(64) if word >> b & 1)
    return mode.value, nodes
