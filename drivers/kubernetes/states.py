"""Pod status -> unified replica state, and replicas -> job state, in one total map.

``replica_of(pod)`` reads a pod as the API returns it (the JSON dict: phase,
container states, conditions, reason) and gives a ``PodView``: the
``ReplicaState``, a reason in UpperCamelCase, a message, the exit code and
the node. Pods restart nothing (``restartPolicy: Never``), so:

=====================================  ==========  ==============================
pod                                    replica     reason
=====================================  ==========  ==============================
Pending, PodScheduled False            PENDING     the condition's (Unschedulable)
Pending, a container waiting           PENDING     the waiting reason (ImagePullBackOff,
                                                   ErrImagePull, CreateContainerConfigError, ...)
Pending/Running, a container waiting   FAILED      it (InvalidImageName: the reference does not
for good                                           parse, never started); the pod is ``alive``
Pending otherwise                      PENDING     Scheduled / Pending
Running, a container terminated != 0   FAILED      NonZeroExit (the kubelet's ``Error``) or its
                                                   own reason (OOMKilled, StartError), exit code:
                                                   a replica of several processes (containers)
                                                   fails with its first failing one; the pod,
                                                   still running the rest, is ``alive``
Running, a container waiting           RUNNING     its reason (CrashLoopBackOff)
Running                                RUNNING     Running
Succeeded                              SUCCEEDED   Completed, exit 0
Failed, pod reason set                 FAILED      it (Evicted, ...); DeadlineExceeded (the
                                                   time limit, activeDeadlineSeconds) as
                                                   TimeLimitExceeded, as every backend says
Failed, a container terminated != 0    FAILED      NonZeroExit or its own reason, exit code
                                                   (init containers first: MPI's wait-for-workers)
Failed otherwise                       FAILED      Failed
Unknown or anything else               UNSPECIFIED Unknown (the UNKNOWN fallback)
=====================================  ==========  ==============================

A pod of several processes also gives each its container's own view
(``PodView.procs``): the driver reports one replica status per process,
index = replica index * processes_per_replica + k, as every backend does.

A pod the driver deleted (stop, or the success rule stopping the rest) is
STOPPED, with the exit code it ended with (a kubelet reports such a pod
Failed, 143), except the process whose failure decided the job; one that
vanished on its own (preemption, a ``kubectl delete``) is FAILED with reason
``PodDeleted``; one not seen yet is PENDING (``Submitted``).

``job_state`` applies the run mode's ``SuccessRule`` to the processes: a
failing one fails the job, named as every backend names it (reason
``NonZeroExit``, ``worker-3 exited with code 3``); every process of the
deciding roles SUCCEEDED succeeds it unless another failed before they were
done (seen together in one re-list: that failure wins, as on the local
backend); any running process makes it RUNNING, else it is PENDING with the
first waiting one's reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from drivers.common.base import JobState, ReplicaState
from drivers.common.planner import SuccessRule

REASON_SUBMITTED = "Submitted"
REASON_PENDING = "Pending"
REASON_SCHEDULED = "Scheduled"
REASON_RUNNING = "Running"
REASON_COMPLETED = "Completed"
REASON_FAILED = "Failed"
REASON_UNKNOWN = "Unknown"
REASON_POD_DELETED = "PodDeleted"
REASON_STOPPING = "StopRequested"
REASON_STOPPED = "Stopped"
REASON_STALE = "BackendStale"
REASON_TIME_LIMIT = "TimeLimitExceeded"
#: a process that exited with a non-zero code and nothing more to say, as every backend names it
REASON_NON_ZERO_EXIT = "NonZeroExit"
#: the kubelet's reasons for a container's end that say no more than its exit code
PLAIN_EXIT_REASONS = frozenset({"", "Error", "Completed"})


@dataclass(frozen=True, slots=True)
class PodView:
    state: ReplicaState
    reason: str
    message: str = ""
    exit_code: int | None = None
    node: str = ""
    start_time: float | None = None
    end_time: float | None = None
    alive: bool = False  # FAILED while the pod still runs other containers: it must be deleted
    terminating: bool = False  # being deleted (``metadata.deletionTimestamp``), in its grace period
    gone: bool = False  # the pod was deleted after it ended (its end kept): no object left
    #: a pod of several processes: (container name, that process's own view), in the pod's order
    procs: tuple[tuple[str, PodView], ...] = ()


def parse_time(value: Any) -> float | None:
    if not value:
        return None
    if isinstance(value, datetime):
        return value.timestamp()
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _containers(status: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [*(status.get("initContainerStatuses") or ()), *(status.get("containerStatuses") or ())]


#: Waiting reasons the kubelet never gets past: the image reference does not parse. Every other
#: reason may pass (a registry back, a Secret created, an image loaded onto the node for
#: ErrImageNeverPull), so it leaves the replica PENDING, as Kubernetes leaves the pod.
PERMANENT_WAITING = frozenset({"InvalidImageName"})


def _waiting(status: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for c in _containers(status):
        w = (c.get("state") or {}).get("waiting")
        if w and w.get("reason") and w.get("reason") != "ContainerCreating":
            return {**w, "container": c.get("name", "")}
    return None


def _terminated(status: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    out: list[Mapping[str, Any]] = []
    inits = len(status.get("initContainerStatuses") or ())
    for i, c in enumerate(_containers(status)):
        t = (c.get("state") or {}).get("terminated")
        if t is not None:
            out.append({**t, "container": c.get("name", ""), "init": i < inits})
    return out


def exit_reason(t: Mapping[str, Any]) -> str:
    """A container's non-zero end as a reason: ``NonZeroExit`` when the kubelet says no more than
    the code (``Error``), else the kubelet's own (``OOMKilled``, ``StartError``, ...)."""
    reason = str(t.get("reason") or "")
    return REASON_NON_ZERO_EXIT if reason in PLAIN_EXIT_REASONS else reason


def replica_of(pod: Mapping[str, Any]) -> PodView:
    """One pod's replica state (total: any input gives a view); a pod of several processes
    (containers) carries each one's own view too (``procs``)."""
    v = _replica_of(pod)
    if procs := _procs(pod, v):
        v = dataclasses.replace(v, procs=procs)
    if not (pod.get("metadata") or {}).get("deletionTimestamp"):
        return v
    # Being deleted: by a stop, or by a disruption (an eviction, a preemption, a taint), which
    # Kubernetes marks with the DisruptionTarget condition: only the first is ``terminating``
    # (a stop in its grace period; the second is the replica's failure, retried as one).
    disrupted = any(c.get("type") == "DisruptionTarget" and c.get("status") == "True"
                    for c in (pod.get("status") or {}).get("conditions") or ())
    return v if disrupted else dataclasses.replace(v, terminating=True)


def _replica_of(pod: Mapping[str, Any]) -> PodView:
    status = pod.get("status") or {}
    phase = status.get("phase") or "Pending"
    node = (pod.get("spec") or {}).get("nodeName") or ""
    start = parse_time(status.get("startTime"))
    terms = _terminated(status)
    end = max((t for t in (parse_time(x.get("finishedAt")) for x in terms) if t is not None), default=None)
    if phase == "Pending":
        for cond in status.get("conditions") or ():
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                return PodView(ReplicaState.PENDING, cond.get("reason") or "Unschedulable",
                               cond.get("message") or "", node=node)
        w = _waiting(status)
        if w is not None:
            return _stuck(w, node) or PodView(ReplicaState.PENDING, w["reason"],
                                              f"{w['container']}: {w.get('message') or w['reason']}", node=node)
        return PodView(ReplicaState.PENDING, REASON_SCHEDULED if node else REASON_PENDING, node=node)
    if phase == "Running":
        if failed := _failed(terms, status, node, start, end):
            return dataclasses.replace(failed, alive=True)
        w = _waiting(status)
        if w is not None and (stuck := _stuck(w, node, start)) is not None:
            return stuck
        if w is not None:
            return PodView(ReplicaState.RUNNING, w["reason"],
                           f"{w['container']}: {w.get('message') or w['reason']}", node=node,
                           start_time=start)
        return PodView(ReplicaState.RUNNING, REASON_RUNNING, node=node, start_time=start)
    if phase == "Succeeded":
        return PodView(ReplicaState.SUCCEEDED, REASON_COMPLETED, exit_code=0, node=node,
                       start_time=start, end_time=end)
    if phase == "Failed":
        if status.get("reason"):
            bad = [t for t in terms if _code(t) != 0]
            # activeDeadlineSeconds passed: the time limit, named as every backend names it
            reason = REASON_TIME_LIMIT if status["reason"] == "DeadlineExceeded" else str(status["reason"])
            return PodView(ReplicaState.FAILED, reason, status.get("message") or "",
                           exit_code=_code(bad[0]) if bad else None, node=node, start_time=start, end_time=end)
        return _failed(terms, status, node, start, end) or PodView(
            ReplicaState.FAILED, REASON_FAILED, status.get("message") or "", node=node, start_time=start,
            end_time=end)
    return PodView(ReplicaState.UNSPECIFIED, REASON_UNKNOWN,
                   status.get("message") or f"pod phase {phase!r}", node=node, start_time=start)


def _stuck(w: Mapping[str, Any], node: str, start: float | None = None) -> PodView | None:
    """A container waiting for good (``PERMANENT_WAITING``) fails its replica; the pod, which
    would wait on for ever, is ``alive`` (deleted); None for a wait that may pass."""
    if w["reason"] not in PERMANENT_WAITING:
        return None
    return PodView(ReplicaState.FAILED, w["reason"], f"{w['container']}: {w.get('message') or w['reason']}",
                   node=node, start_time=start, alive=True)


def _code(t: Mapping[str, Any]) -> int:
    try:
        return int(t.get("exitCode", 0))
    except (TypeError, ValueError):
        return 1  # not a number: no success either


def _failed(terms: list[Mapping[str, Any]], status: Mapping[str, Any], node: str, start: float | None,
            end: float | None) -> PodView | None:
    """The pod's first container that ended with a non-zero code, as a FAILED view; None if none did."""
    bad = [t for t in terms if _code(t) != 0]
    if not bad:
        return None
    t, code = bad[0], _code(bad[0])
    # the message: the container's termination message; an init container's (MPI's
    # wait-for-workers) name with it, as the process itself never ran
    msg = str(t.get("message") or "")
    if t.get("init"):
        msg = f"init container {t['container']}" + (f": {msg}" if msg else "")
    return PodView(ReplicaState.FAILED, exit_reason(t), msg, exit_code=code, node=node,
                   start_time=start, end_time=end)


def _procs(pod: Mapping[str, Any], v: PodView) -> tuple[tuple[str, PodView], ...]:
    """Each process's view of a pod of several (one container each, in the spec's order); ()
    for a pod of one, whose view is its process's."""
    status = pod.get("status") or {}
    by_name = {str(c.get("name", "")): c for c in status.get("containerStatuses") or ()}
    names = [str(c.get("name", "")) for c in (pod.get("spec") or {}).get("containers") or ()] or list(by_name)
    if len(names) < 2:
        return ()
    pod_reason = status.get("phase") == "Failed" and bool(status.get("reason"))
    return tuple((n, _proc(by_name.get(n) or {}, v, pod_reason)) for n in names)


def _proc(c: Mapping[str, Any], v: PodView, pod_reason: bool) -> PodView:
    """One container's process, within its pod's view ``v`` (``pod_reason``: the pod failed as a
    whole, evicted or past its deadline: every process that did not exit 0 fails with it)."""
    st = c.get("state") or {}
    node, start = v.node, v.start_time
    if (t := st.get("terminated")) is not None:
        code, end = _code(t), parse_time(t.get("finishedAt"))
        if code == 0:
            return PodView(ReplicaState.SUCCEEDED, REASON_COMPLETED, exit_code=0, node=node, start_time=start,
                           end_time=end)
        if pod_reason:
            return PodView(ReplicaState.FAILED, v.reason, v.message, exit_code=code, node=node, start_time=start,
                           end_time=end)
        return PodView(ReplicaState.FAILED, exit_reason(t), str(t.get("message") or ""), exit_code=code, node=node,
                       start_time=start, end_time=end)
    if pod_reason or v.state in (ReplicaState.PENDING, ReplicaState.UNSPECIFIED):
        return dataclasses.replace(v, exit_code=None, alive=False, terminating=False)
    w = st.get("waiting")
    if w and w.get("reason") and w.get("reason") != "ContainerCreating":
        w = {**w, "container": c.get("name", "")}
        if (stuck := _stuck(w, node, start)) is not None:
            return dataclasses.replace(stuck, alive=False)
        return PodView(ReplicaState.RUNNING, w["reason"], str(w.get("message") or w["reason"]), node=node,
                       start_time=start)
    if v.state is ReplicaState.FAILED and not v.alive:  # the pod ended; this container with no end of its own
        return PodView(ReplicaState.FAILED, v.reason, v.message, node=node, start_time=start, end_time=v.end_time)
    if v.state is ReplicaState.SUCCEEDED:
        return dataclasses.replace(v, procs=())
    return PodView(ReplicaState.RUNNING, REASON_RUNNING, node=node, start_time=start)


def missing(*, deleted_by_us: bool, seen: bool) -> PodView:
    """A pod the watch does not (or no longer) have."""
    if deleted_by_us:
        return PodView(ReplicaState.STOPPED, REASON_STOPPED, "pod deleted by dlsched")
    if seen:
        return PodView(ReplicaState.FAILED, REASON_POD_DELETED, "the pod was deleted outside dlsched")
    return PodView(ReplicaState.PENDING, REASON_SUBMITTED, "created; not observed yet")


@dataclass(frozen=True)
class JobView:
    state: JobState
    reason: str
    message: str
    exit_code: int | None = None
    failed: tuple[str, int] | None = None  #: (role, index) of the process whose failure decided the job


def failure_message(role: str, index: int, v: PodView) -> str:
    """The job's message for process ``role-index``'s failure, as every backend words it:
    ``worker-3 exited with code 3`` (then what else is known: ``; OOMKilled``, a termination message)."""
    if v.exit_code is None:
        return f"{role}-{index}: {v.reason}" + (f": {v.message}" if v.message else "")
    named = f"{role}-{index} exited with code {v.exit_code}"
    detail = "; ".join(x for x in ("" if _reason(v) == REASON_NON_ZERO_EXIT else v.reason, v.message) if x)
    return f"{named}; {detail}" if detail else named


def _reason(v: PodView) -> str:
    """A failure's reason: ``NonZeroExit`` for an exit code with nothing more said."""
    return REASON_NON_ZERO_EXIT if v.exit_code is not None and v.reason in PLAIN_EXIT_REASONS else v.reason


def _ended_the_job(v: PodView, success_at: float | None) -> bool:
    """Whether a failure counts though the deciding roles all succeeded (seen together, as a
    re-list shows them): it does unless it came after their success (the stop that follows it,
    or an end the driver would have pre-empted) or is a deletion that is no disruption."""
    if v.terminating:
        return False
    return success_at is None or v.end_time is None or v.end_time <= success_at


def job_state(replicas: Sequence[tuple[str, int, PodView]], rule: SuccessRule, *,
              stop_requested: bool = False) -> JobView:
    """The job's state from its processes ``(role, index, view)`` per the success rule."""
    if stop_requested:
        if all(v.state.is_terminal() or v.state is ReplicaState.PENDING and v.reason == REASON_SUBMITTED
               for *_, v in replicas):
            return JobView(JobState.STOPPED, REASON_STOPPED, "stopped on request")
        return JobView(JobState.STOPPING, REASON_STOPPING, "deleting the pods")
    decisive = [(r, i, v) for r, i, v in replicas if r in rule.decisive_roles]
    failures = [(r, i, v) for r, i, v in replicas if v.state is ReplicaState.FAILED]
    if decisive and all(v.state is ReplicaState.SUCCEEDED for *_, v in decisive):
        ends = [v.end_time for *_, v in decisive]
        success_at = None if None in ends else max(e for e in ends if e is not None)
        failures = [(r, i, v) for r, i, v in failures if _ended_the_job(v, success_at)]
        if not failures:
            return JobView(JobState.SUCCEEDED, REASON_COMPLETED, rule.description, 0)
    # a pod being deleted (a stop's, or the success rule's, seen after a driver restart) last
    for role, index, v in sorted(failures, key=lambda f: f[2].terminating):
        return JobView(JobState.FAILED, _reason(v), failure_message(role, index, v), v.exit_code, (role, index))
    if any(v.state is ReplicaState.RUNNING for *_, v in replicas):
        return JobView(JobState.RUNNING, REASON_RUNNING, "")
    for role, index, v in replicas:
        if v.state is ReplicaState.PENDING and v.reason not in (REASON_PENDING, REASON_SCHEDULED,
                                                                 REASON_SUBMITTED):
            return JobView(JobState.PENDING, v.reason, f"{role}-{index}: {v.message or v.reason}")
    if any(v.state is ReplicaState.UNSPECIFIED for *_, v in replicas):
        return JobView(JobState.RUNNING, REASON_UNKNOWN, "a pod's state is unknown")
    return JobView(JobState.PENDING, REASON_PENDING, "")
