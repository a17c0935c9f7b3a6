"""Usage from ``metrics.k8s.io`` and capacity from the nodes: the API's answers parsed.

Usage: ``metrics.k8s.io/v1beta1`` pod metrics when the cluster serves them
(404, or 503 while the API server itself answers: UNIMPLEMENTED
``metrics.k8s.io not available``), one usage per process as its replica
status is (a pod of several processes: its containers' own; an MPI worker,
one sshd container, one). Memory is the working set (a pod of one
process: its containers' summed); peak memory the highest the driver has seen. The API serves
CPU as a rate (cores over a window), not a counter, so ``cpu_seconds`` is an
estimate: the rate integrated over the time each sample covers (since the
previous one; the first since the pod started), kept per replica so it never
goes back, and still reported once the replica has ended (``running`` false).

Capacity: nodes' allocatable CPU, memory and ``nvidia.com/gpu`` minus the
requests of the pods scheduled on them that have not ended, cluster-wide;
GPU types from the ``nvidia.com/gpu.product`` label. A namespace-scoped
credential (403 on the cluster-wide pod list) leaves the cluster READY: free
capacity then counts only the namespace's pods, and the message says so. 403
on nodes: READY with capacity unknown (zero). Only an API server that does
not answer, answers 5xx or rejects the credentials (401) is UNREACHABLE.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dlsched.errors import Unimplemented
from drivers.common.base import (
    ClusterCapacity,
    ClusterInfo,
    ClusterState,
    GpuInventory,
    JobUsage,
    ReplicaUsage,
    RunMode,
)
from drivers.kubernetes import naming, states
from drivers.kubernetes.api import api_error, status_of, status_text
from drivers.kubernetes.tracking import KubeCluster, TrackedJob

FORBIDDEN_RETRY = 300.0  # seconds before a 403'd cluster-wide pod list is tried again


@dataclass
class Sampled:
    """One replica's usage as accumulated from its metrics.k8s.io samples."""

    time: float  # the last sample's timestamp
    cpu_seconds: float
    peak_memory_bytes: int


def parse_quantity(value: Any) -> float:
    """A Kubernetes quantity ("250m", "64Mi", "1500000n") as a number; 0 when unreadable."""
    from kubernetes.utils import parse_quantity as parse

    try:
        return float(parse(str(value)))  # type: ignore[no-untyped-call]
    except (ValueError, TypeError, ArithmeticError):
        return 0.0


_GO_DURATION = re.compile(r"(\d+(?:\.\d*)?)(ns|us|µs|ms|s|m|h)")
_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def go_duration(value: Any) -> float:
    """A Go duration as metrics.k8s.io writes ``window`` ("15s", "1m0.5s") -> seconds; 0 if unreadable."""
    return sum(float(n) * _GO_UNITS[u] for n, u in _GO_DURATION.findall(str(value or "")))


def integrate(prev: Sampled | None, metrics_item: Mapping[str, Any], cores: float, memory: int,
              start: float | None) -> Sampled:
    """Fold one PodMetrics sample into a replica's running CPU-seconds estimate.

    metrics.k8s.io serves a rate (cores, averaged over ``window`` up to
    ``timestamp``), not a counter, so CPU seconds are estimated: each sample
    stands for the time since the one before (exact when samples come at the
    metrics resolution), the first for the time since the pod started (or
    its window, when the start is unknown). A sample seen before adds nothing.
    """
    ts = states.parse_time(metrics_item.get("timestamp")) or time.time()
    if prev is not None:
        if ts <= prev.time:
            return Sampled(prev.time, prev.cpu_seconds, max(prev.peak_memory_bytes, memory))
        return Sampled(ts, prev.cpu_seconds + cores * (ts - prev.time), max(prev.peak_memory_bytes, memory))
    span = ts - start if start is not None and start <= ts else go_duration(metrics_item.get("window"))
    return Sampled(ts, cores * span, memory)


async def measure(c: KubeCluster, job: TrackedJob) -> JobUsage:
    """The job's usage now, from one PodMetricsList of its attempt's pods (``job``: tracked, or a
    forgotten one read back from its record, whose samples it starts from)."""
    selector = f"{naming.LABEL_JOB}={naming.job_label(job.job_id)},{naming.LABEL_ATTEMPT}={job.attempt}"
    try:
        doc = await c.api.pod_metrics(c.namespace, selector)
    except Exception as e:  # noqa: BLE001
        # 404: no metrics API; 503: its APIService is down (the API server itself answers).
        if status_of(e) == 404 or status_of(e) == 503 and c.stale is None:
            raise Unimplemented("metrics.k8s.io not available") from None
        raise api_error(e, "reading pod metrics") from None
    by_pod = {(m.get("metadata") or {}).get("name"): m for m in doc.get("items") or ()}
    out = []
    for r in job.replicas:
        m = by_pod.get(r.pod)
        view = job.pods.get(r.pod)
        # one usage per process, indexed as its replica status (replica * processes + k): a pod of
        # several processes has one per container (its samples kept as "<pod>/<container>")
        n = len(r.containers) if len(r.containers) > 1 else 1
        for k in range(n):
            key = f"{r.pod}/{r.containers[k]}" if n > 1 else r.pod
            conts = [c for c in (m.get("containers") or ()) if n == 1 or c.get("name") == r.containers[k]] \
                if m is not None else []
            prev = job.usage.get(key)
            if m is None or not conts:  # ended (or not started): what was seen while it ran
                out.append(ReplicaUsage(role=r.role, replica_index=r.index * n + k,
                                        cpu_seconds=prev.cpu_seconds if prev else 0.0,
                                        peak_memory_bytes=prev.peak_memory_bytes if prev else 0))
                continue
            mem = cores = 0.0
            for cont in conts:
                u = cont.get("usage") or {}
                mem += parse_quantity(u.get("memory", 0))
                cores += parse_quantity(u.get("cpu", 0))
            sampled = integrate(prev, m, cores, int(mem), view.start_time if view is not None else None)
            job.usage[key] = sampled
            out.append(ReplicaUsage(role=r.role, replica_index=r.index * n + k, cpu_seconds=sampled.cpu_seconds,
                                    memory_bytes=int(mem), peak_memory_bytes=sampled.peak_memory_bytes,
                                    running=True))
    return JobUsage(replicas=tuple(out), sample_time=time.time())


# --------------------------------------------------------------------------- capacity


def _requested(pods: Mapping[str, Any]) -> dict[str, list[float]]:
    """Per node: the CPU, memory and GPUs the scheduled pods that have not ended request."""
    used: dict[str, list[float]] = {}
    for p in pods.get("items") or ():
        spec = p.get("spec") or {}
        node = spec.get("nodeName")
        if not node or (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        u = used.setdefault(node, [0.0, 0.0, 0.0])
        for cont in spec.get("containers") or ():
            req = (cont.get("resources") or {}).get("requests") or {}
            lim = (cont.get("resources") or {}).get("limits") or {}
            u[0] += parse_quantity(req.get("cpu", 0))
            u[1] += parse_quantity(req.get("memory", 0))
            u[2] += parse_quantity(req.get(naming.GPU_RESOURCE, lim.get(naming.GPU_RESOURCE, 0)))
    return used


def capacity(nodes: Mapping[str, Any], pods: Mapping[str, Any]) -> ClusterCapacity:
    """The schedulable nodes' allocatable resources, and what the pods on them leave free."""
    used = _requested(pods)
    cap = dict(nodes_total=0, nodes_free=0, cpus_total=0.0, cpus_free=0.0, memory_bytes_total=0,
               memory_bytes_free=0, gpus_total=0, gpus_free=0, max_cpus_per_node=0.0,
               max_memory_bytes_per_node=0, max_gpus_per_node=0)
    gpu_types: dict[str, list[int]] = {}
    for n in nodes.get("items") or ():
        if (n.get("spec") or {}).get("unschedulable"):
            continue
        alloc = (n.get("status") or {}).get("allocatable") or {}
        cpu = parse_quantity(alloc.get("cpu", 0))
        mem = int(parse_quantity(alloc.get("memory", 0)))
        gpu = int(parse_quantity(alloc.get(naming.GPU_RESOURCE, 0)))
        u = used.get((n.get("metadata") or {}).get("name", ""), [0.0, 0.0, 0.0])
        free_cpu, free_mem, free_gpu = max(0.0, cpu - u[0]), max(0, mem - int(u[1])), max(0, gpu - int(u[2]))
        cap["nodes_total"] += 1
        if u == [0.0, 0.0, 0.0]:
            cap["nodes_free"] += 1
        cap["cpus_total"] += cpu
        cap["cpus_free"] += free_cpu
        cap["memory_bytes_total"] += mem
        cap["memory_bytes_free"] += free_mem
        cap["gpus_total"] += gpu
        cap["gpus_free"] += free_gpu
        cap["max_cpus_per_node"] = max(cap["max_cpus_per_node"], cpu)
        cap["max_memory_bytes_per_node"] = max(cap["max_memory_bytes_per_node"], mem)
        cap["max_gpus_per_node"] = max(cap["max_gpus_per_node"], gpu)
        if gpu:
            t = ((n.get("metadata") or {}).get("labels") or {}).get(naming.GPU_PRODUCT_LABEL, "")
            acc = gpu_types.setdefault(t, [0, 0])
            acc[0] += gpu
            acc[1] += free_gpu
    return ClusterCapacity(**cap, gpus=tuple(GpuInventory(t, a, f) for t, (a, f) in sorted(gpu_types.items())))  # type: ignore[arg-type]


async def _scheduled_pods(c: KubeCluster, notes: list[str]) -> Any:
    """Every pod that may hold resources, cluster-wide; the namespace's only when RBAC forbids that.

    A namespace-scoped credential gets 403 on the cluster-wide list: free
    capacity then counts only this namespace's pods (an overestimate the
    message states), and the cluster-wide list is retried only every
    ``FORBIDDEN_RETRY`` seconds, not every interval.
    """
    selector = "status.phase!=Succeeded,status.phase!=Failed"
    if time.monotonic() >= c.pods_forbidden_until:
        try:
            return await c.api.call(c.api.core.list_pod_for_all_namespaces, field_selector=selector)
        except Exception as e:  # noqa: BLE001
            if status_of(e) != 403:
                raise
            c.pods_forbidden_until = time.monotonic() + FORBIDDEN_RETRY
    notes.append(f"free capacity counts only namespace {c.namespace}'s pods: listing pods in all "
                 "namespaces is forbidden (HTTP 403)")
    return await c.api.call(c.api.core.list_namespaced_pod, c.namespace, field_selector=selector)


async def cluster_info(c: KubeCluster, version: str, modes: tuple[RunMode, ...]) -> ClusterInfo:
    """Health and capacity, asked of the API server now (never raises; the kit bounds it)."""
    notes = [f"stale: {c.stale}"] if c.stale and c.synced.is_set() else []
    try:
        nodes = await c.api.call(c.api.core.list_node)
    except Exception as e:  # noqa: BLE001
        if status_of(e) != 403:  # down, 5xx, or credentials rejected (401): unreachable
            return ClusterInfo(state=ClusterState.UNREACHABLE, driver_version=version,
                               message=f"Kubernetes API server: {status_text(e)}", supported_run_modes=modes)
        # Reachable, but RBAC hides the nodes: capacity unknown (zero), not an outage.
        notes.append("capacity unknown: listing nodes is forbidden (HTTP 403); grant nodes list")
        return ClusterInfo(state=ClusterState.READY, driver_version=version, message="; ".join(notes),
                           supported_run_modes=modes)
    try:
        pods = await _scheduled_pods(c, notes)
    except Exception as e:  # noqa: BLE001
        return ClusterInfo(state=ClusterState.UNREACHABLE, driver_version=version,
                           message=f"Kubernetes API server: {status_text(e)}", supported_run_modes=modes)
    return ClusterInfo(state=ClusterState.READY, capacity=capacity(nodes, pods), supported_run_modes=modes,
                       driver_version=version, message="; ".join(notes))
