"""The job state machine: the transition table and how observations apply.

Drivers report observations; JobManager applies them only along legal
transitions. Terminal states are final: a late RUNNING never overwrites
SUCCEEDED. While STOPPING, a driver's STOPPED, SUCCEEDED or FAILED ends the
job in that state; anything else only refreshes the details.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime

from dlsched import spec_rules
from job_manager.domain.model import Job, JobState, Observation, ReplicaStatus

S = JobState

#: the reason of a stored job whose launch is queued (SubmitJob answered before it)
LAUNCH_QUEUED = "LaunchQueued"
#: the reason every driver gives a job its time limit ended
TIME_LIMIT_EXCEEDED = "TimeLimitExceeded"

#: Legal transitions. A retry (FAILED attempt n → PENDING attempt n+1) is not
#: an observation; it goes through ``plan_retry``.
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    S.PENDING: frozenset({S.QUEUED, S.RUNNING, S.SUCCEEDED, S.FAILED, S.STOPPING, S.STOPPED}),
    S.QUEUED: frozenset({S.RUNNING, S.SUCCEEDED, S.FAILED, S.STOPPING, S.STOPPED}),
    S.RUNNING: frozenset({S.QUEUED, S.SUCCEEDED, S.FAILED, S.STOPPING, S.STOPPED}),
    S.STOPPING: frozenset({S.STOPPED, S.SUCCEEDED, S.FAILED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.STOPPED: frozenset(),
    S.UNSPECIFIED: frozenset(),
}


#: What an observation may put into a stored job. A driver reads replicas and messages from
#: files and objects the job itself can write (a Ray job's manifest, a Slurm attempt's exits
#: file, a container's termination message): 30,000 replicas or 420 pods with 4 KiB messages
#: made a record etcd refused (at most 1.5 MiB a request), and with it every later update of
#: that cluster's jobs. The spec is at most 256 KiB; what is observed is bounded here.
MAX_REASON = 128
MAX_MESSAGE = 4096
MAX_REPLICA_TEXT = 512  # a replica's host and message each
MAX_REPLICAS_BYTES = 512 * 1024  # the replicas in all, about as stored
_REPLICA_OVERHEAD = 32


def planned_replicas(job: Job, replicas: list[ReplicaStatus]) -> list[ReplicaStatus]:
    """The observed replicas a job can have: one per (role, index) of its spec's processes (the
    last reported wins), host and message cut to ``MAX_REPLICA_TEXT``, and within
    ``MAX_REPLICAS_BYTES`` in all: failed ones first, then in the order reported; past the
    budget a replica keeps its state and exit code without host or message, or is left out."""
    # (drivers report one status per process, indexed replica * processes_per_replica + k)
    sizes = {g.role: g.replicas * max(1, g.processes_per_replica) for g in job.spec.replica_groups}
    by_key: dict[tuple[str, int], ReplicaStatus] = {}
    for r in replicas:
        n = sizes.get(r.role)
        if n is None or not 0 <= r.index < n:
            continue
        if len(r.host) > MAX_REPLICA_TEXT or len(r.message) > MAX_REPLICA_TEXT:
            r = dataclasses.replace(r, host=r.host[:MAX_REPLICA_TEXT], message=r.message[:MAX_REPLICA_TEXT])
        by_key.pop((r.role, r.index), None)
        by_key[(r.role, r.index)] = r
    failed_first = sorted(by_key.items(), key=lambda kv: kv[1].exit_code in (None, 0))  # (stable)
    # Every replica's state first (as many as fit), then hosts and messages while they fit.
    budget = MAX_REPLICAS_BYTES
    kept: dict[tuple[str, int], ReplicaStatus] = {}
    for key, r in failed_first:
        cost = len(r.role) + _REPLICA_OVERHEAD
        if cost <= budget:
            budget -= cost
            kept[key] = r
    for key, r in failed_first:
        if key in kept and (r.host or r.message):
            cost = len(r.host) + len(r.message)
            if cost <= budget:
                budget -= cost
            else:
                kept[key] = dataclasses.replace(r, host="", message="")
    return [kept[k] for k in by_key if k in kept]


def can_transition(src: JobState, dst: JobState) -> bool:
    return dst in TRANSITIONS.get(src, frozenset())


def _with_state(job: Job, state: JobState, now: datetime, **changes: object) -> Job:
    new = dataclasses.replace(job, state=state, **changes)  # type: ignore[arg-type]
    if state.is_terminal() and new.end_time is None:
        new.end_time = now
    return new


def of_another_job(job: Job, obs: Observation) -> bool:
    """Whether ``obs`` is of an earlier job of the same id (deleted while its driver could not
    clean it up): both uids known and different. Such an observation never changes the job."""
    return not spec_rules.same_job(obs.job_uid, job.uid)


def apply_observation(job: Job, obs: Observation, now: datetime) -> Job | None:
    """The job after ``obs``, or None when nothing changes.

    An observation of another attempt than the job's is stale and ignored. A
    backend's own restart of the attempt (``backend_restarts``, a Slurm
    requeue) is the same attempt: the job shows the count, never a retry.
    ``found=False`` observations are handled by ``mark_lost``.
    """
    if job.state.is_terminal() or not obs.found:
        return None
    if obs.attempt and job.attempt and obs.attempt != job.attempt:
        return None
    if obs.state == S.UNSPECIFIED:
        return None
    target = job.state
    if obs.state != job.state and can_transition(job.state, obs.state):
        target = obs.state
    elif job.state == S.STOPPING and obs.state in (S.PENDING, S.QUEUED, S.RUNNING):
        target = S.STOPPING  # stop in progress; only details refresh
    elif obs.state != job.state:
        return None
    new = dataclasses.replace(job)
    new.state = target
    if target == obs.state or target == S.STOPPING:
        if target != S.STOPPING:
            new.reason = obs.reason[:MAX_REASON]
            new.message = obs.message[:MAX_MESSAGE]
        if obs.replicas:
            new.replicas = planned_replicas(job, obs.replicas)
        if target == S.STOPPED or (target == S.FAILED and new.reason == TIME_LIMIT_EXCEEDED):
            # stopped (by a stop, or by its time limit), not exited: every backend alike
            # (Slurm said 143 for both, local and Ray nothing)
            new.exit_code = None
        elif obs.exit_code is not None:
            new.exit_code = obs.exit_code
    if obs.backend_restarts > new.backend_restarts:  # the backend reran this attempt (a Slurm requeue)
        new.backend_restarts = obs.backend_restarts
    if obs.backend_job_id and not new.backend_job_id:
        new.backend_job_id = obs.backend_job_id
    if obs.start_time is not None and new.start_time is None:
        new.start_time = obs.start_time
    if new.start_time is None and target in (S.RUNNING,):
        new.start_time = now
    if target.is_terminal():
        new.end_time = obs.end_time or new.end_time or now
    if _same(new, job):
        return None
    return new


def _same(a: Job, b: Job) -> bool:
    fields = ("state", "reason", "message", "exit_code", "replicas", "backend_job_id",
              "start_time", "end_time", "attempt", "cluster", "backend_restarts")
    return all(getattr(a, f) == getattr(b, f) for f in fields)


#: A driver's reason for an attempt the backend lost before any of its processes started (it
#: provably never ran: Slurm forgot a job slurmctld never saved): launched again as a new attempt
#: whatever max_retries says, at most LOST_BEFORE_START_RELAUNCHES attempts beyond them (the
#: attempts it takes count against a real failure's retries).
LOST_BEFORE_START = "LostBeforeStart"
LOST_BEFORE_START_RELAUNCHES = 3


def should_retry(job: Job, obs: Observation) -> bool:
    """Whether a FAILED observation of the current attempt leads to a retry."""
    most = job.spec.max_retries + (LOST_BEFORE_START_RELAUNCHES if obs.reason == LOST_BEFORE_START else 0)
    return (
        obs.found
        and obs.state == S.FAILED
        and not job.state.is_terminal()
        and job.state != S.STOPPING
        and (not obs.attempt or obs.attempt == job.attempt)
        and job.attempt <= most
    )


def plan_retry(job: Job, obs: Observation, now: datetime) -> Job:
    """The job back in PENDING for attempt+1, not launched yet."""
    return dataclasses.replace(
        job,
        state=S.PENDING,
        attempt=job.attempt + 1,
        backend_job_id="",
        reason="Retrying",
        message=f"attempt {job.attempt} failed ({obs.reason[:MAX_REASON] or 'Failed'}); retrying",
        # the failed attempt's code, as its end would have had it (none for its time limit)
        exit_code=None if obs.reason == TIME_LIMIT_EXCEEDED else obs.exit_code,
        replicas=[],
        end_time=None,
        backend_restarts=0,
    )


def mark_lost(job: Job, now: datetime) -> Job | None:
    """The driver no longer knows a job it launched: FAILED LostByBackend (STOPPED when a stop
    was under way: what was asked for happened, whatever ended it)."""
    if job.state.is_terminal() or not job.launched:
        return None
    if job.state == S.STOPPING:
        return _with_state(job, S.STOPPED, now, reason="LostByBackend",
                           message="stopped: the backend no longer knows the job")
    return _with_state(job, S.FAILED, now, reason="LostByBackend",
                       message="the backend no longer knows the job")


DRIVER_UNREACHABLE = "DriverUnreachable"


def mark_driver_unreachable(job: Job, since: datetime, detail: str) -> Job | None:
    """The cluster's driver has not answered since ``since``: say so, keep the state.

    Only launched jobs that run or wait on the backend; the driver's next
    observation (its snapshot after it is back) replaces the reason."""
    if job.state.is_terminal() or job.state == S.STOPPING or not job.launched:
        return None
    if job.reason == DRIVER_UNREACHABLE:
        return None
    message = f"driver unreachable since {since.isoformat(timespec='seconds')}; last state {job.state.name}"
    if detail:
        message += f": {detail}"
    return dataclasses.replace(job, reason=DRIVER_UNREACHABLE, message=message[:1000])


def mark_launched(job: Job, backend_job_id: str, obs: Observation | None,
                  now: datetime) -> Job | None:
    """Record a successful LaunchJob; None when the job moved on meanwhile. An attempt that
    failed before its launch answered (the observation says FAILED) is retried like one
    whose failure came later: the job back in PENDING for the next attempt."""
    if job.state.is_terminal() or job.launched:
        return None
    new = dataclasses.replace(job, backend_job_id=backend_job_id)
    if new.reason in (LAUNCH_QUEUED, "DriverUnavailable", "ClusterNotConfigured", "Retrying"):
        new.reason, new.message = "", ""
    if obs is not None and should_retry(new, obs):
        return plan_retry(new, obs, now)
    if obs is not None:
        applied = apply_observation(new, obs, now)
        if applied is not None:
            new = applied
    return new


def mark_launch_waiting(job: Job, reason: str, message: str) -> Job | None:
    """A retryable launch failure: the job stays PENDING with a reason."""
    if job.state != S.PENDING or job.launched:
        return None
    if job.reason == reason and job.message == message:
        return None
    return dataclasses.replace(job, reason=reason, message=message)


def mark_launch_failed(job: Job, reason: str, message: str, now: datetime) -> Job | None:
    """A non-retryable launch failure: the job is FAILED."""
    if job.state.is_terminal() or job.launched:
        return None
    return _with_state(job, S.FAILED, now, reason=reason, message=message)


def request_stop(job: Job, now: datetime) -> Job | None:
    """StopJob: None when the job is terminal or already stopping.

    A job not handed to a backend yet stops at once; otherwise it goes to
    STOPPING and the driver's STOPPED observation ends it.
    """
    if job.state.is_terminal() or job.state == S.STOPPING:
        return None
    if not job.launched:
        return _with_state(job, S.STOPPED, now, reason="Stopped",
                           message="stopped before it was launched")
    return dataclasses.replace(job, state=S.STOPPING, reason="StopRequested",
                               message="stop requested")
