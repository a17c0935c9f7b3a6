"""One local job attempt's bookkeeping, as an explicit state machine.

Pure: no processes, no files, no clock (times are passed in). The
supervisor (``supervisor.py``) feeds it what happens to the processes it
runs and acts on what the transitions return; the driver rebuilds it from
the supervisor's status file (``from_json``) to answer observations, and
applies ``request_stop`` to its copy to answer a TerminateJob at once.

Per process (``Proc``)::

    PENDING ──started──▶ RUNNING ──exit 0, job not signalled──▶ SUCCEEDED
       │                    ├──exit ≠ 0, job not signalled──▶ FAILED
       │                    └──any exit after the job was signalled──▶ STOPPED
       ├──cannot start──▶ FAILED (exit code 127 or 126)
       └──the job is stopping──▶ STOPPED (never started)

A placeholder (an MPI worker: mpirun starts its ranks) is RUNNING from the
launch and ends with the job: SUCCEEDED when the job succeeds, else STOPPED.

Per job: PENDING → RUNNING (the first process started) → STOPPING (a
TerminateJob) → SUCCEEDED / FAILED / STOPPED once every process has ended
(``states.job_outcome``). What decides it, in order: a stop that was asked
for (TerminateJob: STOPPED; the time limit: FAILED ``TimeLimitExceeded``),
else the first process that failed (``NonZeroExit``; one that could not start
as one that exited 127 or 126), else success. Once the deciding roles all exited 0 the job is
``succeeding``: the others still running are stopped, and that is no
failure. A transition that returns True asks the caller to stop the
processes still running (SIGTERM, SIGKILL after the grace); from then on the
job is ``signalled`` and a non-zero exit is a stop, not a failure.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from drivers.common.base import JobObservation, JobState, ReplicaState, ReplicaStatus
from drivers.local import states
from drivers.local.render import LocalPlan

T = TypeVar("T")

#: the format of ``to_json`` (the status file)
STATUS_VERSION = 1


@dataclass(slots=True)
class Proc:
    """One process of the job (one slot of the plan)."""

    role: str
    index: int
    placeholder: bool = False
    state: ReplicaState = ReplicaState.PENDING
    pid: int | None = None
    start_ticks: int = 0  # /proc start time: a reused pid is never taken for this process
    exit_code: int | None = None
    message: str = ""

    @property
    def running(self) -> bool:
        """A started process that has not ended (placeholders have none)."""
        return self.state is ReplicaState.RUNNING and not self.placeholder

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


class JobMachine:
    """The state of one job attempt and its processes."""

    __slots__ = ("plan", "procs", "state", "reason", "message", "exit_code", "start_time", "end_time",
                 "spawned", "stop", "signalled", "succeeding", "failure", "logs_done")

    def __init__(self, plan: LocalPlan) -> None:
        self.plan = plan
        self.procs = [Proc(p.role, p.index, p.placeholder) for p in plan.processes]
        self.state = JobState.PENDING
        self.reason = ""
        self.message = ""
        self.exit_code: int | None = None
        self.start_time: float | None = None
        self.end_time: float | None = None
        self.spawned = False  # every process was started (or refused, or skipped)
        self.stop: tuple[JobState, str] | None = None  # what a requested stop ends in
        self.signalled = False  # the job's processes were told to stop
        self.succeeding = False  # the deciding roles succeeded; the rest are being stopped
        self.failure: tuple[str, int, int, str] | None = None  # role, index, exit code, reason
        self.logs_done = False  # every output pipe drained (set by the supervisor)

    # ------------------------------------------------------------------ queries

    @property
    def ended(self) -> bool:
        """Terminal, and every line of output is in the log files."""
        return self.state.is_terminal() and self.logs_done

    def running_pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.running and p.pid is not None]

    def observation(self, job_id: str, backend_job_id: str, attempt: int, host: str, uid: str = "") -> JobObservation:
        return JobObservation(
            job_id=job_id, backend_job_id=backend_job_id, found=True, state=self.state, uid=uid,
            reason=self.reason, message=self.message, exit_code=self.exit_code,
            replicas=tuple(ReplicaStatus(role=p.role, index=p.index, state=p.state, exit_code=p.exit_code,
                                         host=host, message=p.message) for p in self.procs),
            start_time=self.start_time, end_time=self.end_time, attempt=attempt,
        )

    # ------------------------------------------------------------------ starting

    def skip(self, i: int) -> None:
        """Process ``i`` is not started: the job is already stopping."""
        p = self.procs[i]
        p.state, p.message = ReplicaState.STOPPED, "not started: the job is stopping"

    def placeholder_started(self, i: int) -> None:
        p = self.procs[i]
        p.state, p.message = ReplicaState.RUNNING, "placeholder: mpirun starts this host's ranks"

    def started(self, i: int, pid: int, start_ticks: int, now: float) -> bool:
        """Process ``i`` runs as ``pid``; True when it must be stopped at once (the job is stopping)."""
        p = self.procs[i]
        p.pid, p.start_ticks = pid, start_ticks
        if p.state is ReplicaState.PENDING:  # it may have exited already
            p.state = ReplicaState.RUNNING
        if self.state is JobState.PENDING:
            self.state, self.reason, self.start_time = JobState.RUNNING, states.REASON_STARTED, now
        return self.signalled

    def start_failed(self, i: int, code: int, message: str) -> bool:
        """Process ``i`` could not be started (``message`` says why): it fails as a process that
        exited with ``code`` (127 or 126, as a shell says), as on every backend; True: stop the others."""
        p = self.procs[i]
        p.state, p.exit_code, p.message = ReplicaState.FAILED, code, message
        if self.failure is None:
            self.failure = (p.role, p.index, code, states.REASON_NON_ZERO_EXIT)
            self.reason, self.message = states.REASON_REPLICA_FAILED, f"{p.name} exited with code {code}; stopping the rest"
        self.signalled = True
        return True

    def all_spawned(self) -> None:
        self.spawned = True

    # ------------------------------------------------------------------ events

    def exited(self, i: int, returncode: int | None) -> bool:
        """Process ``i`` exited with ``returncode`` (``Popen`` style); True: stop the others."""
        p = self.procs[i]
        code = states.exit_code_of(returncode)
        p.exit_code = code
        p.state = states.replica_state(code, stop_signalled=self.signalled)
        if p.state is ReplicaState.FAILED:
            p.message = f"exited with code {code}"
            if self.failure is None and self.stop is None:
                self.failure = (p.role, p.index, code if code is not None else 1, states.REASON_NON_ZERO_EXIT)
                if self.running_pids():
                    self.reason = states.REASON_REPLICA_FAILED
                    self.message = f"{p.name} exited with code {code}; stopping the rest"
                    self.signalled = True
                    return True
        elif p.state is ReplicaState.STOPPED:
            p.message = "stopped: the job succeeded" if self.succeeding else "stopped by dlsched"
        elif self._deciders_succeeded(p):
            self.succeeding = True
            if self.running_pids():
                self.message = f"{self.plan.success_description}: stopping the rest"
                self.signalled = True
                return True
        return False

    def _deciders_succeeded(self, p: Proc) -> bool:
        return (p.state is ReplicaState.SUCCEEDED and not self.succeeding and self.failure is None
                and self.stop is None and self.plan.decides(p.role)
                and all(q.state is ReplicaState.SUCCEEDED for q in self.procs if self.plan.decides(q.role)))

    def request_stop(self, grace: float) -> bool:
        """A TerminateJob; True: stop the processes (False: already ended or succeeding)."""
        if self.state.is_terminal() or self.succeeding:
            return False
        if self.stop is None and self.failure is None:
            self.stop = (JobState.STOPPED, states.REASON_STOPPED)
            self.state, self.reason = JobState.STOPPING, states.REASON_STOPPING
            self.message = f"stopping: SIGTERM, SIGKILL after {grace:g}s"
        self.signalled = True
        return True

    def time_limit(self) -> bool:
        """The time limit passed; True: stop the processes."""
        if self.state.is_terminal() or self.stop is not None or self.failure is not None or self.succeeding:
            return False
        self.stop = (JobState.FAILED, states.REASON_TIME_LIMIT)
        self.reason, self.message = states.REASON_TIME_LIMIT, "the job ran past its time limit; stopping"
        self.signalled = True
        return True

    def abandon(self, reason: str, message: str) -> bool:
        """The supervisor must stop the job on its own (signalled, its files removed)."""
        if self.state.is_terminal():
            return False
        if self.stop is None:
            self.stop = (JobState.FAILED, reason)
            self.reason, self.message = reason, message
        self.signalled = True
        return True

    def finish(self, now: float) -> bool:
        """End the job if every process has ended; True when it ended now."""
        if self.state.is_terminal():
            return False
        if not self.spawned or any(not p.state.is_terminal() for p in self.procs if not p.placeholder):
            return False
        out = states.job_outcome(stop_requested=self.stop is not None, stop_final=self.stop,
                                 failure=self.failure, success_message=self.plan.success_description)
        for p in self.procs:
            if p.placeholder and not p.state.is_terminal():
                p.state = ReplicaState.SUCCEEDED if out.state is JobState.SUCCEEDED else ReplicaState.STOPPED
                p.message = "placeholder: ended with the launcher"
        self.state, self.reason, self.message, self.exit_code = out.state, out.reason, out.message, out.exit_code
        self.end_time = now
        return True

    def lost(self, reason: str, message: str, now: float) -> None:
        """The supervisor is gone before the end: FAILED with ``reason``, whatever still ran; a
        job asked to stop (by a TerminateJob) is STOPPED, as it would have been."""
        stopped = self.stop is not None and self.stop[0] is JobState.STOPPED
        for p in self.procs:
            if not p.state.is_terminal():
                p.state = ReplicaState.STOPPED if stopped else ReplicaState.FAILED
                p.message = "stopped by the driver" if stopped else "lost with its supervisor"
        if stopped:
            reason, message = states.REASON_STOPPED, f"stopped ({message})"
        self.state = JobState.STOPPED if stopped else JobState.FAILED
        self.reason, self.message, self.exit_code = reason, message, None
        self.end_time = now
        self.logs_done = True

    # ------------------------------------------------------------------ the status file

    def to_json(self) -> dict[str, Any]:
        return {
            "version": STATUS_VERSION, "state": self.state.name, "reason": self.reason,
            "message": self.message, "exit_code": self.exit_code, "start_time": self.start_time,
            "end_time": self.end_time, "spawned": self.spawned, "signalled": self.signalled,
            "succeeding": self.succeeding, "logs_done": self.logs_done,
            "stop": [self.stop[0].name, self.stop[1]] if self.stop else None,
            "failure": list(self.failure) if self.failure else None,
            "processes": [{"state": p.state.name, "pid": p.pid, "start_ticks": p.start_ticks,
                           "exit_code": p.exit_code, "message": p.message} for p in self.procs],
        }

    @classmethod
    def from_json(cls, plan: LocalPlan, doc: Mapping[str, Any]) -> JobMachine:
        """Raises KeyError, TypeError or ValueError for a document not of ``to_json``'s shape (a
        job can write over the file: every field is checked for its type)."""
        m = cls(plan)
        m.state = JobState[_str(doc["state"])]
        m.reason, m.message = _str(doc["reason"]), _str(doc["message"])
        m.exit_code = _opt(_int, doc["exit_code"])
        m.start_time = _opt(_time, doc["start_time"])
        m.end_time = _opt(_time, doc["end_time"])
        m.spawned, m.signalled = bool(doc["spawned"]), bool(doc["signalled"])
        m.succeeding, m.logs_done = bool(doc["succeeding"]), bool(doc["logs_done"])
        if doc.get("stop"):
            state, reason = _list(doc["stop"])
            m.stop = (JobState[_str(state)], _str(reason))
        if doc.get("failure"):
            role, index, code, reason = _list(doc["failure"])
            m.failure = (_str(role), _int(index), _int(code), _str(reason))
        for p, d in zip(m.procs, _list(doc["processes"]), strict=True):
            p.state = ReplicaState[_str(d["state"])]
            p.pid, p.start_ticks = _opt(_int, d["pid"]), _int(d["start_ticks"] or 0)
            p.exit_code, p.message = _opt(_int, d["exit_code"]), _str(d["message"])
        return m


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"a string expected, got {type(value).__name__}")
    return value


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"an integer expected, got {type(value).__name__}")
    if not -(1 << 63) <= value < (1 << 63):
        raise ValueError("integer out of range")
    return value


def _time(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"a number expected, got {type(value).__name__}")
    if not 0 <= value < 1e11:
        raise ValueError("not a time")
    return float(value)


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"a list expected, got {type(value).__name__}")
    return value


def _opt(check: Callable[[Any], T], value: Any) -> T | None:
    return None if value is None else check(value)
