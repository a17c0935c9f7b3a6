"""Translate a job into the local driver's launch plan, and that into JSON.

The render contract, in three steps: ``check`` (the run mode's rules, MPI
availability, the process bound: ``InvalidArgument`` naming the field, or
FAILED_PRECONDITION ``MPI_NOT_AVAILABLE``) → ``place`` (every replica on this
host, with the ports and GPUs the driver picked) → ``emit`` (the planner's
processes as a ``LocalPlan``: the exact per-process argv, added environment,
working directory and log files the job's supervisor starts).
``render_job`` checks and returns the ``LocalRequest`` (the kit's
``Rendered``) whose ``plan`` places and emits: its ``native_spec()`` is the
dry-run, and at launch the driver plans it with the ports and GPUs it picked.
``plan_job`` is the pure composition the golden files test. ``LocalPlan.native_spec()`` is its ``application/json``
form (sorted keys, golden-file testable), and this module is also the
plan's metadata codec: ``plan_to_json`` / ``plan_from_json`` (the supervisor
reads the plan back from the attempt's record) and ``backend_job_id``.

Environment: each process runs with the driver's own environment, plus the
planner's variables (``drivers.common.env``), plus the user's ``env`` (last).
The JSON lists only the added variables (``"inherit_env": true``), so a
render never leaks the driver's environment.

Ports: ``RenderJob`` shows ``MASTER_PORT`` 29500 and PS-Worker task ports
2222; ``LaunchJob`` picks free ports on the host at launch (one master port
per job; one port per ps / worker / chief replica) and returns the plan it
actually started in ``LaunchJobResponse.native_spec``.

Run modes beyond "every process must exit 0" add a ``"success"`` object
(the roles that decide success, the roles stopped after it); MPI adds
``"files": {"hostfile": ...}``, written to ``attempt-{n}/hostfile`` before
the launcher starts, and marks its worker processes ``"placeholder": true``
(hosts for mpirun's ranks: the local driver starts nothing for them).

Files, under the state dir::

    jobs/{job_id}/attempt-{n}/record.json         the launch: cluster, plan (attempt.py)
    jobs/{job_id}/attempt-{n}/status.json         the supervisor's status (machine.py)
    jobs/{job_id}/attempt-{n}/stop.json           a stop the driver asked for
    jobs/{job_id}/attempt-{n}/supervisor.lock     held while the supervisor lives
    jobs/{job_id}/attempt-{n}/supervisor.log      the supervisor's own messages
    jobs/{job_id}/attempt-{n}/hostfile            MPI only
    jobs/{job_id}/attempt-{n}/{role}-{index}.stdout|.stderr

Log files hold one line per output line, ``<unix-nanos> <text>\\n``: the
job's supervisor reads each process's pipes itself and stamps every line as
it reads it, so ``since_time`` and ``LogEntry.time`` are exact to the read. For
MULTI_PROCESS each process is a slot whose index is its rank.

Working directory: empty means the attempt directory; a relative one is
taken relative to it and must stay inside it (``a/../..`` or ``../other``
is INVALID_ARGUMENT naming the group's ``working_dir``, checked before
anything is placed); an absolute one is used as it is.
"""

from __future__ import annotations

import json
import os
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dlsched.errors import InvalidArgument
from drivers.common import planner
from drivers.common.base import JobSpec, LogStream, NativeSpec, RunMode

MEDIA_TYPE = "application/json"
LOG_FORMAT = "<unix-nanos> <text>"
LOCAL_HOST = "127.0.0.1"
#: the most processes one job may start on this host
MAX_PROCESSES = 256


@dataclass(frozen=True, slots=True)
class ProcessPlan:
    role: str
    index: int
    rank: int
    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str
    stdout: str
    stderr: str
    placeholder: bool = False

    def log_path(self, stream: LogStream) -> str:
        return self.stdout if stream is LogStream.STDOUT else self.stderr


@dataclass(frozen=True, slots=True)
class LocalPlan:
    job_id: str
    attempt: int
    backend_job_id: str
    run_mode: str
    time_limit_seconds: float | None
    processes: tuple[ProcessPlan, ...]
    decisive_roles: frozenset[str] = frozenset()  # empty: every role
    stopped_after_success: frozenset[str] = frozenset()
    success_description: str = "every process exited 0"
    files: Mapping[str, str] = field(default_factory=dict)

    def decides(self, role: str) -> bool:
        return not self.decisive_roles or role in self.decisive_roles

    @property
    def hostfile(self) -> str:
        return os.path.join(os.path.dirname(self.processes[0].stdout), planner.HOSTFILE) if self.processes else ""

    def native_spec(self) -> NativeSpec:
        """The plan as ``application/json`` (what RenderJob and LaunchJob return)."""
        return to_native_spec(self)


def backend_job_id(job_id: str, attempt: int) -> str:
    return f"local-{job_id}-{attempt}"


def job_dir(state_dir: str, job_id: str) -> str:
    return os.path.join(state_dir, "jobs", job_id)


def attempt_dir(state_dir: str, job_id: str, attempt: int) -> str:
    return os.path.join(job_dir(state_dir, job_id), f"attempt-{attempt}")


def log_path(state_dir: str, job_id: str, attempt: int, role: str, index: int,
             stream: LogStream) -> str:
    return os.path.join(attempt_dir(state_dir, job_id, attempt), f"{role}-{index}.{stream.suffix}")


def check(spec: JobSpec, *, mpi_available: bool = True) -> None:
    """The spec's violations for this backend: raises before anything is placed."""
    if spec.run_mode is RunMode.MPI and not mpi_available:
        raise planner.MpiNotAvailable("no Open MPI mpirun on the local driver's PATH")
    planner.check_run_mode(spec)
    if sum(g.replicas * g.processes for g in spec.replica_groups) > MAX_PROCESSES:
        raise InvalidArgument.for_field(
            "spec.replica_groups", f"the local driver runs at most {MAX_PROCESSES} processes per job")
    for i, g in enumerate(spec.replica_groups):
        if g.working_dir and not os.path.isabs(g.working_dir) and _escapes(g.working_dir):
            raise InvalidArgument.for_field(f"spec.replica_groups[{i}].working_dir",
                                            "a relative working directory must stay inside the attempt directory")


def _escapes(relative: str) -> bool:
    """Whether a relative path leads out of the directory it is taken in (``..`` first, once normalised)."""
    first = os.path.normpath(relative).split(os.sep, 1)[0]
    return first == os.pardir


def place(spec: JobSpec, *, ports: Mapping[tuple[str, int], int] | None = None,
          gpus: Mapping[tuple[str, int], tuple[str, ...]] | None = None) -> list[planner.Placement]:
    """Every replica on this host (node rank 0); ``ports`` and ``gpus`` per (role, replica index)."""
    ports, gpus = ports or {}, gpus or {}
    return [planner.Placement(role=g.role, replica_index=r, host=LOCAL_HOST, node_rank=0,
                              port=ports.get((g.role, r), 0), gpus=gpus.get((g.role, r), ()))
            for g in spec.replica_groups for r in range(g.replicas)]


def emit(job_id: str, spec: JobSpec, placements: Sequence[planner.Placement], *, attempt: int,
         state_dir: str, master_port: int = planner.DEFAULT_MASTER_PORT,
         mpirun: str = planner.MPIRUN, mpirun_args: Sequence[str] = ()) -> LocalPlan:
    """The planner's processes, with this backend's files and working directories."""
    adir = attempt_dir(state_dir, job_id, attempt)
    jp = planner.plan_job(job_id, spec, placements, master_port=master_port,
                          hostfile_path=os.path.join(adir, planner.HOSTFILE),
                          mpirun=mpirun, mpirun_args=mpirun_args)
    procs = []
    for p in jp.processes:
        cwd = os.path.normpath(os.path.join(adir, p.working_dir)) if p.working_dir else adir
        procs.append(ProcessPlan(
            role=p.role, index=p.slot_index, rank=p.rank, argv=p.argv, env=dict(p.env), cwd=cwd,
            stdout=log_path(state_dir, job_id, attempt, p.role, p.slot_index, LogStream.STDOUT),
            stderr=log_path(state_dir, job_id, attempt, p.role, p.slot_index, LogStream.STDERR),
            placeholder=p.placeholder,
        ))
    all_roles = frozenset(g.role for g in spec.replica_groups)
    decisive = jp.success.decisive_roles
    return LocalPlan(job_id=job_id, attempt=attempt, backend_job_id=backend_job_id(job_id, attempt),
                     run_mode=f"RUN_MODE_{spec.run_mode.name}",
                     time_limit_seconds=spec.time_limit_seconds, processes=tuple(procs),
                     decisive_roles=_NO_ROLES if decisive == all_roles else _shared(decisive),
                     stopped_after_success=_shared(jp.success.stopped_after_success),
                     success_description=jp.success.description,
                     files=dict(jp.files) if jp.files else _NO_FILES)


#: shared empties: a tracked job's plan holds no set or dict of its own for nothing
_NO_ROLES: frozenset[str] = frozenset()
_NO_FILES: Mapping[str, str] = types.MappingProxyType({})


def _shared(roles: frozenset[str]) -> frozenset[str]:
    return roles or _NO_ROLES


@dataclass(frozen=True)
class LocalRequest:
    """A checked job for this host (``Rendered``): its dry-run plan now, its launch plan
    once the driver has picked ports and GPUs (``plan``)."""

    job_id: str
    spec: JobSpec
    attempt: int
    state_dir: str
    mpirun: str = planner.MPIRUN
    mpirun_args: tuple[str, ...] = ()
    uid: str = ""  #: the job's uid, kept in the launch record ("" for none)

    def plan(self, *, master_port: int = planner.DEFAULT_MASTER_PORT,
             ports: Mapping[tuple[str, int], int] | None = None,
             gpus: Mapping[tuple[str, int], tuple[str, ...]] | None = None) -> LocalPlan:
        return emit(self.job_id, self.spec, place(self.spec, ports=ports, gpus=gpus), attempt=self.attempt,
                    state_dir=self.state_dir, master_port=master_port, mpirun=self.mpirun,
                    mpirun_args=self.mpirun_args)

    def native_spec(self) -> NativeSpec:
        """The dry-run: ``MASTER_PORT`` 29500, PS-Worker task ports 2222, no GPU indices."""
        return self.plan().native_spec()


def render_job(job_id: str, spec: JobSpec, *, attempt: int, state_dir: str, mpirun: str | None = planner.MPIRUN,
               mpirun_args: Sequence[str] = (), uid: str = "") -> LocalRequest:
    """``check``, then the request whose ``plan`` places and emits; ``mpirun=None``: this host has none."""
    check(spec, mpi_available=mpirun is not None)
    return LocalRequest(job_id, spec, attempt, state_dir, mpirun or planner.MPIRUN, tuple(mpirun_args), uid)


def plan_job(job_id: str, spec: JobSpec, *, attempt: int, state_dir: str,
             master_port: int = planner.DEFAULT_MASTER_PORT,
             ports: Mapping[tuple[str, int], int] | None = None,
             gpus: Mapping[tuple[str, int], tuple[str, ...]] | None = None,
             mpirun: str = planner.MPIRUN, mpirun_args: Sequence[str] = ()) -> LocalPlan:
    """check → place → emit in one call; InvalidArgument for specs the run mode rejects."""
    return render_job(job_id, spec, attempt=attempt, state_dir=state_dir, mpirun=mpirun,
                      mpirun_args=mpirun_args).plan(master_port=master_port, ports=ports, gpus=gpus)


def _process_json(p: ProcessPlan) -> dict[str, object]:
    d: dict[str, object] = {"role": p.role, "index": p.index, "rank": p.rank, "argv": list(p.argv),
                            "env": dict(p.env), "cwd": p.cwd, "stdout": p.stdout, "stderr": p.stderr}
    if p.placeholder:
        d["placeholder"] = True
    return d


def plan_to_json(plan: LocalPlan) -> dict[str, object]:
    out: dict[str, object] = {
        "backend_job_id": plan.backend_job_id,
        "job_id": plan.job_id,
        "attempt": plan.attempt,
        "run_mode": plan.run_mode,
        "time_limit_seconds": plan.time_limit_seconds,
        "inherit_env": True,
        "log_format": LOG_FORMAT,
        "processes": [_process_json(p) for p in plan.processes],
    }
    if plan.decisive_roles:
        out["success"] = {"decisive_roles": sorted(plan.decisive_roles),
                          "stopped_after_success": sorted(plan.stopped_after_success),
                          "description": plan.success_description}
    if plan.files:
        out["files"] = dict(plan.files)
    return out


def plan_from_json(doc: Mapping[str, Any]) -> LocalPlan:
    """The inverse of ``plan_to_json`` (reloading a record after a restart)."""
    procs = tuple(ProcessPlan(
        role=p["role"], index=p["index"], rank=p["rank"], argv=tuple(p["argv"]), env=p["env"],
        cwd=p["cwd"], stdout=p["stdout"], stderr=p["stderr"], placeholder=bool(p.get("placeholder")))
        for p in doc["processes"])
    success: Mapping[str, Any] = doc.get("success") or {}
    return LocalPlan(
        job_id=doc["job_id"], attempt=doc["attempt"], backend_job_id=doc["backend_job_id"],
        run_mode=doc["run_mode"], time_limit_seconds=doc.get("time_limit_seconds"), processes=procs,
        decisive_roles=frozenset(success.get("decisive_roles", ())),
        stopped_after_success=frozenset(success.get("stopped_after_success", ())),
        success_description=success.get("description", "every process exited 0"),
        files=dict(doc.get("files") or {}),
    )


def to_native_spec(plan: LocalPlan) -> NativeSpec:
    return NativeSpec(media_type=MEDIA_TYPE,
                      content=json.dumps(plan_to_json(plan), indent=2, sort_keys=True) + "\n")
