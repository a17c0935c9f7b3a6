"""Usage and capacity: what ``sstat``, ``sacct`` and ``scontrol show nodes`` say, per replica and per cluster.

``measure`` samples a job's usage: a running job's steps by ``sstat`` (one
per process, named ``<role>-<index>``; the MPI launcher is the batch step;
PS-Worker's one ``--multi-prog`` step covers all its tasks: ``parse_sstat``),
in one remote command with ``squeue -s`` for the step names; GPU utilisation
and memory from the steps' TRES usage (``gres/gpuutil``, ``gres/gpumem``)
where the site gathers them. An ended job: with accounting storage
(GetClusterInfo found it), one ``sacct`` of its steps gives the final CPU
time and peak memory, even after a driver restart. Without it Slurm keeps no
usage of an ended job (``scontrol show job`` has only its RunTime and
allocated TRES; sstat says "No steps running"), so it reports the driver's
last sample, ``running`` false, memory and GPU figures 0 (lost when the
driver restarts).

``capacity`` reads ``scontrol --oneliner show nodes`` into the cluster's
capacity (CPUs, memory, GPUs by type, allocated vs total). The parsers are
pure and tested on recorded output.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import time
from collections.abc import Sequence

from dlsched.kit.parse import decimal
from drivers.common.base import ClusterCapacity, GpuInventory, JobUsage, ReplicaUsage
from drivers.slurm import render
from drivers.slurm.jobs import TrackedJob
from drivers.slurm.logs import FILE_RE
from drivers.slurm.poller import RunFn, key_values


async def measure(run: RunFn, job: TrackedJob, accounting: bool) -> JobUsage:
    """The job's usage now (see the module docstring); samples are kept on ``job``."""
    launcher = next(((r, i) for r, i in job.roles if r == "launcher"), None)
    tasks = [k for k in job.roles if k != launcher]  # PS-Worker's tasks share one step
    if not job.state.is_terminal():
        jid = shlex.quote(job.backend_job_id)
        _, out, _ = await run(
            f"sstat --noheader --parsable2 --allsteps -j {jid} -o {SSTAT_FIELDS}; "
            f"echo '--- steps'; squeue --noheader --steps --jobs={jid} -o '%i|%j'")
        stats, _, names = out.partition("--- steps\n")
        _mark_not_running(job)
        for key, sample in parse_sstat(stats, names, launcher, tasks).items():
            prev = job.usage.get(key)
            job.usage[key] = dataclasses.replace(
                sample, cpu_seconds=max(sample.cpu_seconds, prev.cpu_seconds if prev else 0.0),
                peak_memory_bytes=max(sample.peak_memory_bytes, prev.peak_memory_bytes if prev else 0))
        return _report(job)
    _mark_not_running(job)
    if accounting and not job.accounted:
        rc, out, _ = await run(f"sacct --noheader --parsable2 -j {shlex.quote(job.backend_job_id)} "
                               f"-o {SACCT_USAGE_FIELDS}")
        if rc == 0 and (final := parse_sacct_steps(out, launcher, tasks)):
            job.usage.update(final)
            job.accounted = True
    return _report(job)


def _mark_not_running(job: TrackedJob) -> None:
    for k, u in list(job.usage.items()):
        job.usage[k] = _not_running(u)


def _report(job: TrackedJob) -> JobUsage:
    replicas = [job.usage.get((r, i), ReplicaUsage(role=r, replica_index=i)) for r, i in job.roles]
    return JobUsage(replicas=tuple(replicas), sample_time=time.time())


# --------------------------------------------------------------------------- parsing usage

#: sstat's columns for ``parse_sstat``.
SSTAT_FIELDS = "JobID,AveCPU,MaxRSS,AveRSS,TRESUsageInAve"


def parse_sstat(stats: str, step_names: str, launcher: tuple[str, int] | None,
                tasks: Sequence[tuple[str, int]] = ()) -> dict[tuple[str, int], ReplicaUsage]:
    """``sstat --parsable2 -o SSTAT_FIELDS`` lines and ``squeue --steps -o '%i|%j'``
    lines -> a running sample per replica (steps are named ``<role>-<index>``; the
    batch step is the MPI launcher). PS-Worker's tasks share one step, which Slurm
    measures as a whole: each task gets the step's per-task average (AveCPU, AveRSS;
    so the tasks' CPU times still add up to the step's) and its highest peak. GPU figures come from the TRES usage when the
    site's Slurm gathers them (``gres/gpuutil``, percent; ``gres/gpumem``), else 0."""
    label = {}
    for line in step_names.splitlines():
        sid, _, name = line.partition("|")
        label[sid.strip()] = name.strip()
    out: dict[tuple[str, int], ReplicaUsage] = {}
    for line in stats.splitlines():
        parts = line.split("|")
        if len(parts) < 4:
            continue
        sid = parts[0].strip()
        tres = _tres(parts[4]) if len(parts) > 4 else {}
        try:
            gpu_util = float(tres.get("gres/gpuutil", "0") or 0)
        except ValueError:
            gpu_util = 0.0
        for key in _replicas_of(sid, label.get(sid, ""), launcher, tasks):
            out[key] = ReplicaUsage(role=key[0], replica_index=key[1], cpu_seconds=_duration(parts[1]),
                                    memory_bytes=_size(parts[3]), peak_memory_bytes=_size(parts[2]),
                                    gpu_utilization_percent=gpu_util,
                                    gpu_memory_bytes=_size(tres.get("gres/gpumem", "0")), running=True)
    return out


def _replicas_of(step_id: str, step_name: str, launcher: tuple[str, int] | None,
                 tasks: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
    """The replicas a Slurm step ran: ``<job>.batch`` is the MPI launcher (if any), the
    PS-Worker ``--multi-prog`` step (``render.TASKS_STEP``) all of ``tasks``, other steps
    are named ``<role>-<index>`` (render); anything else (extern) none."""
    if step_id.endswith(".batch"):
        return [launcher] if launcher is not None else []
    if step_name == render.TASKS_STEP:
        return list(tasks)
    m = FILE_RE.match(step_name + ".stdout")
    return [(m.group(1), int(m.group(2)))] if m is not None else []


def _not_running(u: ReplicaUsage) -> ReplicaUsage:
    """A sample kept after its step ended: CPU time and peak stay, current figures go."""
    return dataclasses.replace(u, memory_bytes=0, gpu_utilization_percent=0.0, gpu_memory_bytes=0,
                               running=False)


#: sacct's columns for ``parse_sacct_steps``.
SACCT_USAGE_FIELDS = "JobID,JobName,TotalCPU,MaxRSS"


def parse_sacct_steps(text: str, launcher: tuple[str, int] | None,
                      tasks: Sequence[tuple[str, int]] = ()) -> dict[tuple[str, int], ReplicaUsage]:
    """``sacct --parsable2 -j <job> -o SACCT_USAGE_FIELDS`` -> the final figures per
    replica of an ended job: its step's total CPU time and peak memory (``<id>.batch``
    is the MPI launcher; steps are named ``<role>-<index>``)."""
    out: dict[tuple[str, int], ReplicaUsage] = {}
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) < 4 or "." not in parts[0]:
            continue  # the allocation line carries no usage of its own
        keys = _replicas_of(parts[0].strip(), parts[1].strip(), launcher, tasks)
        for key in keys:  # a step of several tasks: TotalCPU is their sum, MaxRSS their highest
            out[key] = ReplicaUsage(role=key[0], replica_index=key[1], cpu_seconds=_duration(parts[2]) / len(keys),
                                    peak_memory_bytes=_size(parts[3]), running=False)
    return out


def _tres(value: str) -> dict[str, str]:
    """``cpu=00:00:01,gres/gpumem=512M,gres/gpuutil=37,mem=10M`` -> {name: value}."""
    out = {}
    for item in value.split(","):
        k, sep, v = item.partition("=")
        if sep:
            out[k.strip()] = v.strip()
    return out


def _duration(value: str) -> float:
    """sstat times: ``[D-][HH:]MM:SS[.mmm]`` -> seconds."""
    v = value.strip()
    days = 0
    if "-" in v:
        d, _, v = v.partition("-")
        days = int(d) if decimal(d) else 0
    secs = 0.0
    try:
        for part in v.split(":"):
            secs = secs * 60 + float(part)
    except ValueError:
        return 0.0
    return days * 86400 + secs


def _size(value: str) -> int:
    """``64608K`` / ``1.5M`` / ``2G`` / ``123`` -> bytes."""
    v = value.strip()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(v[-1:].upper(), 1)
    num = v[:-1] if mult != 1 else v
    try:
        return int(float(num) * mult)
    except ValueError:
        return 0


# --------------------------------------------------------------------------- capacity


def _mib(value: str) -> int:
    return int(value) << 20 if decimal(value) else 0


def _gres_gpus(gres: str) -> list[tuple[str, int]]:
    """``gpu:a100:4(S:0-1),gpu:2`` -> [("a100", 4), ("", 2)]."""
    out = []
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] != "gpu" or len(parts) < 2:
            continue
        count = parts[-1]
        if decimal(count):
            out.append((parts[1] if len(parts) > 2 else "", int(count)))
    return out


def capacity(scontrol_nodes: str) -> ClusterCapacity:
    """``scontrol --oneliner show nodes`` -> capacity (CPUs, memory, GPUs, allocated vs total)."""
    nodes = [key_values(line) for line in scontrol_nodes.splitlines() if line.startswith("NodeName=")]
    cpus_t = cpus_f = 0.0
    mem_t = mem_f = 0
    gpus_t = gpus_f = 0
    nodes_free = 0
    max_cpu, max_mem, max_gpu = 0.0, 0, 0
    inventory: dict[str, list[int]] = {}
    for n in nodes:
        state = n.get("State", "").upper()
        usable = not any(s in state for s in ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "FUTURE"))
        total = float(n.get("CPUTot", "0") or 0)
        alloc = float(n.get("CPUAlloc", "0") or 0)
        mem = _mib(n.get("RealMemory", "0"))
        amem = _mib(n.get("AllocMem", "0"))
        g = _gres_gpus(n.get("Gres", ""))
        gtot = sum(c for _, c in g)
        galloc = 0
        m = re.search(r"gres/gpu=(\d+)", n.get("AllocTRES", ""))
        if m:
            galloc = int(m.group(1))
        cpus_t += total
        mem_t += mem
        gpus_t += gtot
        if usable:
            cpus_f += max(0.0, total - alloc)
            mem_f += max(0, mem - amem)
            gpus_f += max(0, gtot - galloc)
            if alloc < total:
                nodes_free += 1
        max_cpu, max_mem, max_gpu = max(max_cpu, total), max(max_mem, mem), max(max_gpu, gtot)
        for t, cnt in g:
            inv = inventory.setdefault(t, [0, 0])
            inv[0] += cnt
            inv[1] += cnt if usable and not galloc else 0
    return ClusterCapacity(
        nodes_total=len(nodes), nodes_free=nodes_free, cpus_total=cpus_t, cpus_free=cpus_f,
        memory_bytes_total=mem_t, memory_bytes_free=mem_f, gpus_total=gpus_t, gpus_free=gpus_f,
        gpus=tuple(GpuInventory(gpu_type=t, total=v[0], free=v[1]) for t, v in sorted(inventory.items())),
        max_cpus_per_node=max_cpu, max_memory_bytes_per_node=max_mem, max_gpus_per_node=max_gpu,
    )
