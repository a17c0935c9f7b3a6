"""Capacity of the local host and usage of a job's processes.

Capacity: one node; CPUs ``os.cpu_count()``, memory ``/proc/meminfo``, GPUs
from ``nvidia-smi`` when present (cached ``GPU_CACHE_SECONDS``). Free CPUs
are the total minus what running jobs ask for (each replica's
``resources.cpu``, or one per process when 0); free GPUs likewise; free
memory is MemAvailable. Nothing is enforced.

Usage: a replica's processes are its session (or process group) in /proc:
CPU time summed, RSS now, peak from ``VmHWM``; CPU time and peak never go
down between samples (``Peaks``), so an ended replica keeps its last figures.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dlsched import __version__
from drivers.common import procfs as proctable
from drivers.common.base import (
    ClusterCapacity,
    ClusterInfo,
    ClusterState,
    GpuInventory,
    JobSpec,
    JobUsage,
    ReplicaUsage,
    RunMode,
)
from drivers.local import procfs
from drivers.local.machine import Proc

GPU_CACHE_SECONDS = 60.0


def requested(spec: JobSpec) -> tuple[float, int]:
    """(CPUs, GPUs) a job asks for while it runs."""
    cpu, gpu = 0.0, 0
    for g in spec.replica_groups:
        cpu += g.replicas * (g.resources.cpu if g.resources.cpu > 0 else g.processes)
        gpu += g.replicas * g.resources.gpus
    return cpu, gpu


class Gpus:
    """This host's GPUs (type, memory) from nvidia-smi, asked at most every ``GPU_CACHE_SECONDS``."""

    def __init__(self) -> None:
        self._cache: tuple[float, list[tuple[str, int]]] | None = None
        self._asking: asyncio.Task[list[tuple[str, int]]] | None = None

    async def get(self) -> list[tuple[str, int]]:
        if self._cache is not None and time.monotonic() - self._cache[0] <= GPU_CACHE_SECONDS:
            return self._cache[1]
        if self._asking is None:
            self._asking = asyncio.create_task(self._ask(), name="nvidia-smi")
        # Shielded: a caller cut off (GetClusterInfo's bound, under a cold nvidia-smi's seconds)
        # leaves the question running and the next caller gets its answer; cancelled with the
        # caller, it was asked again and cut off again on every call, the host never READY.
        return await asyncio.shield(self._asking)

    async def _ask(self) -> list[tuple[str, int]]:
        try:
            gpus = await procfs.nvidia_gpus()
            self._cache = (time.monotonic(), gpus)
            return gpus
        finally:
            self._asking = None


def cluster_info(gpus: Sequence[tuple[str, int]], running: Iterable[tuple[float, int]],
                 run_modes: tuple[RunMode, ...]) -> ClusterInfo:
    """The host's capacity, less what ``running`` jobs ask for ((CPUs, GPUs) each)."""
    cpus = float(os.cpu_count() or 1)
    mem_total, mem_avail = procfs.meminfo()
    used_cpu = used_gpu = 0.0
    for c, g in running:
        used_cpu += c
        used_gpu += g
    cpus_free = max(0.0, cpus - used_cpu)
    by_type: dict[str, int] = {}
    for t, _ in gpus:
        by_type[t] = by_type.get(t, 0) + 1
    left = int(used_gpu)
    inventory = []
    for t, n in sorted(by_type.items()):
        take = min(n, left)
        left -= take
        inventory.append(GpuInventory(gpu_type=t, total=n, free=n - take))
    gpus_total = len(gpus)
    cap = ClusterCapacity(
        nodes_total=1, nodes_free=1 if cpus_free > 0 else 0,
        cpus_total=cpus, cpus_free=cpus_free,
        memory_bytes_total=mem_total, memory_bytes_free=mem_avail,
        gpus_total=gpus_total, gpus_free=max(0, gpus_total - int(used_gpu)),
        gpus=tuple(inventory),
        max_cpus_per_node=cpus, max_memory_bytes_per_node=mem_total,
        max_gpus_per_node=gpus_total,
    )
    return ClusterInfo(state=ClusterState.READY, capacity=cap, supported_run_modes=run_modes,
                       driver_version=f"local/{__version__}")


@dataclass(slots=True)
class Peak:
    """The highest CPU time and memory seen of one replica."""

    cpu_seconds: float = 0.0
    peak_bytes: int = 0


async def measure(procs: Sequence[Proc], peaks: list[Peak]) -> JobUsage:
    """The usage of a job's replicas now; ``peaks`` (one per process) is updated."""
    live = {p.pid for p in procs if p.running and p.pid is not None}
    stats = await asyncio.to_thread(proctable.all_stats) if live else []
    groups: dict[int, list[proctable.ProcStat]] = {pid: [] for pid in live}
    for st in stats:
        for key in {st.pgrp, st.session} & live:
            groups[key].append(st)
            break
    out = []
    for p, peak in zip(procs, peaks, strict=True):
        members = groups.get(p.pid, []) if p.pid is not None else []
        rss = sum(m.rss_bytes for m in members)
        if members:
            peak.cpu_seconds = max(peak.cpu_seconds, sum(m.cpu_seconds for m in members))
            hwm = sum(procfs.vm_hwm_bytes(m.pid) for m in members)
            peak.peak_bytes = max(peak.peak_bytes, hwm, rss)
        out.append(ReplicaUsage(role=p.role, replica_index=p.index, cpu_seconds=peak.cpu_seconds,
                                memory_bytes=rss, peak_memory_bytes=peak.peak_bytes, running=bool(members)))
    return JobUsage(replicas=tuple(out), sample_time=time.time())
