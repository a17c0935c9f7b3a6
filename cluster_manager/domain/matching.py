"""The matcher: a pure function from a job's requirements and the registered
clusters to ranked candidates, each with the reasons for its rank.

Rules, in order: the selector (name, type, labels) filters; the cluster must
be READY or DEGRADED (reachable but slow: a job matched to it is stored and
launched as it recovers), or DRIVER_UNAVAILABLE with its driver heard from
within ``DOWN_WAIT_SECONDS`` (a driver restarting or upgraded; run modes and
capacity as last observed); the run mode must be supported; every replica must fit on one node
(CPUs, memory, GPUs, GPU model); the whole job must fit the cluster's total
capacity. Eligible clusters score 1 when the job fits the *free* capacity now
(0 when it would queue) plus the share of free capacity left after placing it
(0..1), so an idle cluster beats a busy one. A cluster whose driver is down
ranks after every one that is up, whatever its score: a job matched to it is
stored and waits (PENDING ``DriverUnavailable``) until it is back, as Slurm
keeps a job for a DOWN partition, rather than being refused for a moment's
outage. UNREACHABLE (the driver answers, the backend does not: often a
configuration or credentials fault that lasts) is refused, as is a cluster
never observed (nothing says what it can run) or one whose driver has been
silent longer than ``DOWN_WAIT_SECONDS``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from dlsched import resources
from dlsched.resources import CpuRule

from .errors import NoMatchingCluster, UnknownCluster
from .models import (
    BACKENDS,
    Candidate,
    Capacity,
    Cluster,
    ClusterState,
    ClusterType,
    JobRequirements,
    cluster_name,
)

GIB = 1024**3
#: Cluster states a job may be matched to (DEGRADED: reachable, slow; its launches are retried).
ELIGIBLE_STATES = frozenset({ClusterState.READY, ClusterState.DEGRADED})
#: A state of a cluster that may be down only for now: matched after every one that is up.
DOWN_STATES = frozenset({ClusterState.DRIVER_UNAVAILABLE})
#: How long after its driver last answered a cluster that is down still takes jobs to wait for it.
DOWN_WAIT_SECONDS = 900.0


@dataclass(frozen=True)
class _Totals:
    cpus: float
    memory: int
    gpus: int
    gpus_by_type: dict[str, int]


def _cpu_rule(c: Cluster) -> CpuRule:
    backend = BACKENDS.get(c.type)
    return backend.cpus if backend is not None else CpuRule.AS_GIVEN


def _totals(job: JobRequirements, rule: CpuRule) -> _Totals:
    cpus, mem, gpus = resources.job_cpus(job.replica_groups, rule), 0, 0
    by_type: dict[str, int] = {}
    for g in job.replica_groups:
        n = max(g.replicas, 1)
        r = g.resources
        mem += n * r.memory_bytes
        gpus += n * r.gpus
        if r.gpus and r.gpu_type:
            by_type[r.gpu_type.lower()] = by_type.get(r.gpu_type.lower(), 0) + n * r.gpus
    return _Totals(cpus, mem, gpus, by_type)


def selector_cluster_id(sel: str) -> str:
    return sel[len("clusters/"):] if sel.startswith("clusters/") else sel


def _fmt_bytes(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def _evaluate(job: JobRequirements, c: Cluster, now: datetime) -> Candidate:
    rule = _cpu_rule(c)
    need = _totals(job, rule)
    refusals: list[str] = []
    sel = job.selector
    if sel.cluster_type is not ClusterType.UNSPECIFIED and c.type is not sel.cluster_type:
        refusals.append(f"type {c.type.value} is not the selected {sel.cluster_type.value}")
    backend = BACKENDS.get(c.type)
    if job.image and not (backend is not None and backend.takes_images):
        # run on the hosts as they are, the job would not get what it named (its image's software)
        refusals.append(f"a replica group names a container image; {c.type.value} clusters run none")
    for k, v in sorted(sel.labels.items()):
        if c.labels.get(k) != v:
            have = c.labels.get(k)
            refusals.append(f"label {k}={v} wanted, cluster has "
                            + (f"{k}={have}" if have is not None else f"no label {k}"))
    if c.allowed_projects and job.project not in c.allowed_projects:
        # a request naming no project (MatchClusters without one) is not in any: a cluster kept for
        # some projects was shown eligible to it
        refusals.append(f"project {job.project} may not use this cluster" if job.project
                        else "this cluster runs only its allowed projects' jobs; name a project")
    if refusals:
        return _refused(c, refusals)
    msg = f"state is {c.state.value}"
    if c.state not in ELIGIBLE_STATES:
        msg = f"{msg}: {c.state_message}" if c.state_message else msg
        heard = c.last_heartbeat_time
        silent = (now - heard).total_seconds() if heard is not None else None
        if (c.state not in DOWN_STATES or not c.supported_run_modes or c.capacity is None
                or silent is None or silent > DOWN_WAIT_SECONDS):
            return _refused(c, [msg])
        msg += (f"; its driver last answered {silent:.0f} s ago: the job waits for it "
                "(as last observed, it can run the job)")
    reasons = [msg]
    if job.run_mode not in c.supported_run_modes:
        modes = ", ".join(m.value for m in c.supported_run_modes) or "none"
        refusals.append(f"run mode {job.run_mode.value} is not supported (supports {modes})")
    else:
        reasons.append(f"run mode {job.run_mode.value} is supported")
    cap = c.capacity or Capacity()
    inventory = {g.gpu_type.lower(): g for g in cap.gpus}
    for g, cpus in zip(job.replica_groups, resources.replica_cpus(job.replica_groups, rule), strict=True):
        r = g.resources
        who = f"a {g.role or 'replica'} replica"
        if cpus > cap.max_cpus_per_node:
            asked = "" if cpus == r.cpu else f" ({g.processes_per_replica or 1} processes, as {c.type.value} asks)"
            refusals.append(f"{who} needs {cpus:g} CPUs{asked}; the largest node has "
                            f"{cap.max_cpus_per_node:g}")
        if r.memory_bytes > cap.max_memory_bytes_per_node:
            refusals.append(f"{who} needs {_fmt_bytes(r.memory_bytes)} of memory; the largest "
                            f"node has {_fmt_bytes(cap.max_memory_bytes_per_node)}")
        if r.gpus > cap.max_gpus_per_node:
            refusals.append(f"{who} needs {r.gpus} GPUs; the largest node has "
                            f"{cap.max_gpus_per_node}")
        if r.gpus and r.gpu_type and r.gpu_type.lower() not in inventory:
            have = ", ".join(sorted(inventory)) or "none"
            refusals.append(f"{who} needs GPU type {r.gpu_type}; the cluster has {have}")
    if need.cpus > cap.cpus_total:
        refusals.append(f"the job needs {need.cpus:g} CPUs in all; the cluster has "
                        f"{cap.cpus_total:g}")
    if need.memory > cap.memory_bytes_total:
        refusals.append(f"the job needs {_fmt_bytes(need.memory)} of memory in all; the "
                        f"cluster has {_fmt_bytes(cap.memory_bytes_total)}")
    if need.gpus > cap.gpus_total:
        refusals.append(f"the job needs {need.gpus} GPUs in all; the cluster has "
                        f"{cap.gpus_total}")
    for t, n in sorted(need.gpus_by_type.items()):
        inv = inventory.get(t)
        if inv is not None and n > inv.total:
            refusals.append(f"the job needs {n} {t} GPUs in all; the cluster has {inv.total}")
    if refusals:
        return _refused(c, refusals)
    reasons.append("every replica fits on one node")

    fits_free = (
        need.cpus <= cap.cpus_free
        and need.memory <= cap.memory_bytes_free
        and need.gpus <= cap.gpus_free
        and all(n <= inventory[t].free for t, n in need.gpus_by_type.items() if t in inventory)
    )
    shares = []
    for free, total, used in (
        (cap.cpus_free, cap.cpus_total, need.cpus),
        (float(cap.memory_bytes_free), float(cap.memory_bytes_total), float(need.memory)),
        (float(cap.gpus_free), float(cap.gpus_total), float(need.gpus)),
    ):
        if total > 0:
            shares.append(max(free - used, 0.0) / total)
    headroom = sum(shares) / len(shares) if shares else 0.0
    if fits_free:
        reasons.append(
            f"fits in free capacity now ({cap.cpus_free:g} CPUs, "
            f"{_fmt_bytes(cap.memory_bytes_free)}, {cap.gpus_free} GPUs free)")
    else:
        reasons.append("fits the cluster's total capacity but not its free capacity now; "
                       "the job would queue")
    reasons.append(f"{headroom:.0%} of the capacity stays free after placing the job")
    score = (1.0 if fits_free else 0.0) + headroom
    return Candidate(c.name, c.type, True, round(score, 6), tuple(reasons), c.driver_address)


def _refused(c: Cluster, reasons: Sequence[str]) -> Candidate:
    return Candidate(c.name, c.type, False, 0.0, tuple(reasons), c.driver_address)


def rank(job: JobRequirements, clusters: Iterable[Cluster],
         now: datetime | None = None) -> list[Candidate]:
    """Candidates for ``job``: eligible ones best first (those up before those
    down, then by score, ties by name), then the refused ones by name. Raises UnknownCluster when the selector names a
    cluster that is not registered, NoMatchingCluster when none is eligible.
    ``now`` (default: the clock) dates how long a down cluster's driver has been silent.
    """
    cs = sorted(clusters, key=lambda c: c.cluster_id)
    if job.selector.cluster:
        want = selector_cluster_id(job.selector.cluster)
        cs = [c for c in cs if c.cluster_id == want]
        if not cs:
            raise UnknownCluster(cluster_name(want))
    at = now or datetime.now(UTC)
    cands = [_evaluate(job, c, at) for c in cs]
    down = {c.name for c in cs if c.state in DOWN_STATES}
    eligible = sorted((x for x in cands if x.eligible),
                      key=lambda x: (x.cluster in down, -x.score, x.cluster))
    refused = [x for x in cands if not x.eligible]
    if not eligible:
        if not cands:
            raise NoMatchingCluster("no cluster is registered")
        raise NoMatchingCluster(
            "no cluster can run the job: "
            + "; ".join(f"{x.cluster}: {', '.join(x.reasons)}" for x in refused),
            [(x.cluster, "; ".join(x.reasons)) for x in refused],
        )
    return eligible + refused
