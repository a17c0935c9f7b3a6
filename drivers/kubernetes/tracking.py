"""What the driver tracks per cluster and per job, and a job's observation from its pods.

``KubeCluster`` is one configured cluster: its ``KubeApi``, namespace,
informer, staleness and the jobs, keyed by ``naming.job_label(job_id)``
(the pods' job label; a request's job id is looked up through the same
function, ``find``). ``TrackedJob`` is one job's newest attempt: its
replicas (one pod each), the pods the watch shows, what the driver deleted,
and the latched end. ``observation`` turns that into a ``JobObservation``
with ``states.job_state`` and the attempt's success rule, one replica status
per process (``process_views``: index = replica index * processes per
replica + k, a pod of several processes read per container; a process of a
pod dlsched deleted is STOPPED with its exit code, except the failure that
decided the job); while the API
server is unreachable a job keeps its last state with reason
``BackendStale`` (never FAILED). A tracked job is kept compact (slots, each
pod as its ``states.PodView``, no native spec: a duplicate launch renders it
again); a forgotten one waits in ``KubeCluster.forgetting`` only until its
record is written (``records``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from drivers.common.base import (
    ClusterConfig,
    JobObservation,
    JobRef,
    JobState,
    ReplicaState,
    ReplicaStatus,
)
from drivers.common.planner import SuccessRule
from drivers.kubernetes import naming, states

if TYPE_CHECKING:
    from drivers.kubernetes.api import KubeApi
    from drivers.kubernetes.informer import PodInformer
    from drivers.kubernetes.render import Rendered
    from drivers.kubernetes.usage import Sampled


#: the success rules seen, one object each (jobs of one shape share it); bounded
_RULES: dict[SuccessRule, SuccessRule] = {}
_MAX_RULES = 1024


@dataclass(slots=True)
class Replica:
    role: str
    index: int
    pod: str
    containers: tuple[str, ...]


class TrackedJob:
    """One job's newest attempt, as the watch shows its pods (compact: slots, pods as views)."""

    __slots__ = ("cluster", "others", "job_id", "attempt", "backend_job_id", "service", "replicas", "rule",
                 "pods", "seen", "deleted", "ended_at_delete", "stop_requested", "final", "last", "start_time", "end_time",
                 "_changed", "usage", "cleaned", "uid", "submitted", "failed")

    def __init__(self, cluster: str, job_id: str, attempt: int, backend_job_id: str, service: str,
                 replicas: list[Replica], rule: SuccessRule,
                 others: Sequence[tuple[str, str]] = (), uid: str = "") -> None:
        self.cluster = cluster
        self.uid = uid  # the job's uid (label ``LABEL_UID``), "" for none
        self.others = tuple(others)  # (kind, name) besides the Service and the Pods
        self.job_id = job_id
        self.attempt = attempt
        self.backend_job_id = backend_job_id
        self.service = service
        self.replicas = replicas
        self.rule = _RULES.setdefault(rule, rule) if len(_RULES) < _MAX_RULES else rule  # shared when alike
        # by pod name: the replica's view of the pod as the watch last showed it (not the pod's JSON)
        self.pods: dict[str, states.PodView] = {}
        self.seen: set[str] = set()
        self.deleted: set[str] = set()
        #: pods dlsched deleted (``note_deleted``): the processes that had ended by then ("" for
        #: a pod of one), so one that ends later, exit 0 on the SIGTERM too, reads STOPPED (made
        #: on the first delete: a job's memory, <= 2 KiB, holds no empty map)
        self.ended_at_delete: dict[str, frozenset[str]] | None = None
        self.stop_requested = False
        self.final: JobObservation | None = None
        self.last: JobObservation | None = None
        self.start_time: float | None = None
        self.end_time: float | None = None
        self._changed: asyncio.Event | None = None  # made when a log follower first waits
        self.usage: dict[str, Sampled] = {}  # by pod: what metrics.k8s.io said so far
        self.cleaned = False  # CleanupJob deleted its objects (a pending record is not written)
        #: every object of the launch was created (an adopted job: all its pods were seen); until
        #: then a launch of the same attempt creates what is missing
        self.submitted = False
        #: (role, process index) whose failure decided the job: it stays FAILED when its pod is deleted
        self.failed: tuple[str, int] | None = None

    @classmethod
    def launched(cls, cluster: str, rendered: Rendered) -> TrackedJob:
        """The job a launch of ``rendered`` creates (its native spec is ``rendered``'s, made again when asked)."""
        return cls(cluster, rendered.job_id, rendered.attempt, rendered.backend_job_id, rendered.service,
                   [Replica(p.role, p.index, p.name, p.containers) for p in rendered.pods],
                   rendered.success, rendered.others, rendered.uid)

    @classmethod
    def adopted(cls, cluster: str, meta: naming.JobMeta, namespace: str) -> TrackedJob:
        """A job found on the watch (after a driver restart), rebuilt from its pods' metadata."""
        return cls(cluster, meta.job_id, meta.attempt, naming.backend_job_id(namespace, meta.job_id, meta.attempt),
                   naming.service_name(meta.job_id, meta.attempt),
                   [Replica(role, i, pod, ()) for role, i, pod in meta.pods()], meta.success, meta.others, meta.uid)

    def incomplete(self) -> bool:
        """A launch of this attempt stopped part-way (an API error, a driver killed mid-launch):
        a pod never created nor seen, the job neither ended nor stopped."""
        if self.submitted or self.final is not None or self.stop_requested:
            return False
        if all(r.pod in self.seen for r in self.replicas):
            self.submitted = True
            return False
        return True

    def by_pod(self, name: str) -> Replica | None:
        for r in self.replicas:
            if r.pod == name:
                return r
        return None

    def learn_containers(self, r: Replica, pod: Mapping[str, Any]) -> None:
        """An adopted replica's container names, from its pod (a launched one knows them): the
        log API answers a pod of several processes only per container, so after a restart the
        driver read no log of such a job, and numbered its processes as one."""
        if not r.containers:
            names = tuple(str(c.get("name", "")) for c in ((pod.get("spec") or {}).get("containers") or ()))
            if len(names) > 1:
                r.containers = names

    def notify(self) -> None:
        """Wake whoever waits for a change of this job (log followers)."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    @property
    def changed(self) -> asyncio.Event:
        """Set at the job's next change (for whoever waits: log followers)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed


class KubeCluster:
    """One configured cluster: its API, informer and tracked jobs."""

    def __init__(self, config: ClusterConfig, api: KubeApi, namespace: str) -> None:
        self.config = config
        self.api = api
        self.namespace = namespace
        self.informer: PodInformer | None = None
        self.stale: str | None = "not synced yet"
        self.synced = asyncio.Event()
        self.jobs: dict[str, TrackedJob] = {}  # by naming.job_label(job_id), the pods' job label
        #: forgotten jobs (same keys) until their record is on the API server, then dropped
        self.forgetting: dict[str, TrackedJob] = {}
        self.pods_forbidden_until = 0.0  # monotonic: skip the cluster-wide pod list (403) until then

    def find(self, ref: JobRef) -> TrackedJob | None:
        """The job ``ref`` names, tracked or being forgotten; ``None`` when memory has no such job."""
        key = naming.job_label(ref.job_id)
        job = self.jobs.get(key)
        if job is None or not self._is(job, ref):
            job = self.forgetting.get(key)
        return job if job is not None and self._is(job, ref) else None

    @staticmethod
    def _is(job: TrackedJob, ref: JobRef) -> bool:
        return job.job_id == ref.job_id and (not ref.backend_job_id or ref.backend_job_id == job.backend_job_id)


# --------------------------------------------------------------------------- observations


def views(job: TrackedJob) -> list[tuple[Replica, states.PodView]]:
    """Each replica with its pod's view (a pod the driver deleted reads as stopping, then STOPPED)."""
    out = []
    for r, v in _pod_views(job):
        if r.pod in job.deleted and r.pod in job.pods and not v.state.is_terminal():
            v = _stopping(job, v)
        out.append((r, v))
    return out


def _pod_views(job: TrackedJob) -> list[tuple[Replica, states.PodView]]:
    out = []
    for r in job.replicas:
        pod = job.pods.get(r.pod)
        out.append((r, pod if pod is not None else
                    states.missing(deleted_by_us=r.pod in job.deleted, seen=r.pod in job.seen)))
    return out


def _stopping(job: TrackedJob, v: states.PodView) -> states.PodView:
    return states.PodView(ReplicaState.STOPPED if job.stop_requested or job.final else v.state,
                          states.REASON_STOPPING, "deleting the pod", node=v.node, start_time=v.start_time)


def _deleted(job: TrackedJob, r: Replica, v: states.PodView) -> bool:
    """Whether dlsched deleted the replica's pod: it asked to, or the pod is being deleted (no
    disruption) while the job is stopping or has ended (a driver restarted since asking)."""
    return r.pod in job.pods and (r.pod in job.deleted
                                  or v.terminating and (job.stop_requested or job.final is not None))


def note_deleted(job: TrackedJob, names: Iterable[str]) -> None:
    """``names``, pods dlsched is deleting: in ``job.deleted``, with the processes each had
    ended by then (a pod deleted before, or not seen yet, is left as it is)."""
    wanted = set(names) - job.deleted
    if job.ended_at_delete is None:
        job.ended_at_delete = {}
    for r, v in _pod_views(job):
        if r.pod not in wanted:
            continue
        if r.pod in job.pods:
            job.ended_at_delete[r.pod] = (
                frozenset(n for n, pv in v.procs if pv.state.is_terminal()) if v.procs
                else frozenset({""}) if v.state.is_terminal() and not v.alive else frozenset())
        else:
            job.ended_at_delete[r.pod] = frozenset()
    job.deleted.update(wanted)


def _stopped(job: TrackedJob, role: str, index: int, v: states.PodView, ended_before: bool = True,
             ) -> states.PodView:
    """Process ``role-index`` of a pod dlsched deleted: stopping while it runs, then STOPPED with
    its exit code (143: a deleted pod's SIGTERM, which the kubelet reports as phase Failed); the
    failure that decided the job stays FAILED, and a process that exited 0 before the delete
    (``ended_before``) SUCCEEDED; one that exited 0 after it (on the SIGTERM) is STOPPED, as on
    every backend."""
    if not v.state.is_terminal():
        return _stopping(job, v)
    if v.state is ReplicaState.SUCCEEDED and not ended_before:
        return states.PodView(ReplicaState.STOPPED, states.REASON_STOPPED, "stopped by dlsched",
                              exit_code=v.exit_code, node=v.node, start_time=v.start_time, end_time=v.end_time)
    if v.state is ReplicaState.FAILED and job.failed != (role, index):
        return states.PodView(ReplicaState.STOPPED, states.REASON_STOPPED, "stopped by dlsched",
                              exit_code=v.exit_code, node=v.node, start_time=v.start_time, end_time=v.end_time)
    return v


def process_views(job: TrackedJob) -> list[tuple[Replica, int, states.PodView]]:
    """Each process ``(replica, index within its role, view)``, index = replica index *
    processes per replica + k, as on every backend (and in the logs): a pod of several
    processes gives each its own container's view."""
    counts = {r.role: len(r.containers) for r in job.replicas if r.containers}  # an adopted one: its role's
    out = []
    for r, v in _pod_views(job):
        n = max(1, len(r.containers) or counts.get(r.role, 1))
        procs = dict(v.procs)
        deleted = _deleted(job, r, v)
        # None: not known (a driver restarted since)
        ended_then = job.ended_at_delete.get(r.pod) if job.ended_at_delete is not None else None
        for k in range(n):
            pv, name = v, ""
            if n > 1:
                name = r.containers[k] if k < len(r.containers) else f"proc-{k}"
                pv = procs.get(name) or (dataclasses.replace(v, exit_code=None, procs=()) if procs else v)
            index = r.index * n + k
            out.append((r, index, _stopped(job, r.role, index, pv, ended_then is None or name in ended_then)
                        if deleted else pv))
    return out


def live_pods(job: TrackedJob) -> list[str]:
    """The job's pods still there that have not ended (or that run on after a container failed)."""
    return [r.pod for r, v in views(job) if r.pod in job.pods and (not v.state.is_terminal() or v.alive)]


def _message(v: states.PodView) -> str:
    if v.state is ReplicaState.FAILED and v.exit_code is not None:  # as every backend says it
        said = f"exited with code {v.exit_code}" + (f": {v.message}" if v.message else "")
        return said if v.reason == states.REASON_NON_ZERO_EXIT else f"{v.reason}: {said}"
    return f"{v.reason}: {v.message}" if v.message else v.reason


def _replica_statuses(vs: list[tuple[Replica, int, states.PodView]]) -> tuple[ReplicaStatus, ...]:
    return tuple(ReplicaStatus(role=r.role, index=index, state=v.state, exit_code=v.exit_code,
                               host=v.node, message=_message(v))
                 for r, index, v in vs)


def observation(job: TrackedJob, stale: str | None) -> JobObservation:
    """The job's observation now (``stale``: why the API server is not answering, else ``None``)."""
    vs = process_views(job)
    if job.final is not None:  # the job's state is latched; its replicas still move (the rest stopping)
        return dataclasses.replace(job.final, replicas=_replica_statuses(vs))
    jv = states.job_state([(r.role, index, v) for r, index, v in vs], job.rule, stop_requested=job.stop_requested)
    if jv.state is JobState.FAILED:
        job.failed = jv.failed
    if job.stop_requested and jv.state is JobState.STOPPED:
        # STOPPED only once the watch shows every deleted pod gone.
        if any(r.pod in job.pods and not job.pods[r.pod].gone for r in job.replicas):
            jv = states.JobView(JobState.STOPPING, states.REASON_STOPPING, "deleting the pods")
    starts = [v.start_time for *_, v in vs if v.start_time is not None]
    if starts and job.start_time is None:
        job.start_time = min(starts)
    if jv.state.is_terminal() and job.end_time is None:
        ends = [v.end_time for *_, v in vs if v.end_time is not None]
        job.end_time = max(ends) if ends else time.time()
    reason, message = jv.reason, jv.message
    if stale is not None and not jv.state.is_terminal():
        if job.last is not None:
            return dataclasses.replace(job.last, reason=states.REASON_STALE,
                                       message=f"Kubernetes API server unreachable ({stale}); last known state")
        reason, message = states.REASON_STALE, f"Kubernetes API server unreachable ({stale})"
    return JobObservation(
        job_id=job.job_id, backend_job_id=job.backend_job_id, found=True, state=jv.state, uid=job.uid,
        reason=reason, message=message, exit_code=jv.exit_code, replicas=_replica_statuses(vs),
        start_time=job.start_time, end_time=job.end_time if jv.state.is_terminal() else None,
        attempt=job.attempt)
