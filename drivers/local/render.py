"""Translate a job into the local driver's launch plan, and that into JSON.

``plan_job`` is a pure function of (job id, spec, attempt, state dir, master
port): the exact per-process argv, added environment, working directory and
log files that ``LocalDriver.launch`` then starts, and ``to_native_spec`` its
``application/json`` form (sorted keys, so it is golden-file testable).

Environment: each process runs with the driver's own environment, plus the
planner's variables (``drivers.common.env``), plus the user's ``env`` (last).
The JSON lists only the added variables (``"inherit_env": true``), so a
render never leaks the driver's environment.

``MASTER_PORT``: ``RenderJob`` shows 29500; ``LaunchJob`` picks a free port
at launch and returns the plan it actually started in
``LaunchJobResponse.native_spec``.

Files, under the state dir::

    jobs/{job_id}/attempt-{n}/record.json         the job's record (driver.py)
    jobs/{job_id}/attempt-{n}/{role}-{index}.stdout|.stderr

Log files hold one line per output line, ``<unix-nanos> <text>\\n``: the
driver reads each process's pipes itself and stamps every line as it reads
it, so ``since_time`` and ``LogEntry.time`` are exact to the read. For
MULTI_PROCESS each process is a slot whose index is its rank.

Working directory: empty means the attempt directory; a relative one is
taken relative to it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

from drivers.common import env as planner
from drivers.common.base import JobSpec, LogStream, NativeSpec

MEDIA_TYPE = "application/json"
LOG_FORMAT = "<unix-nanos> <text>"
LOCAL_HOST = "127.0.0.1"


@dataclass(frozen=True)
class ProcessPlan:
    role: str
    index: int
    rank: int
    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str
    stdout: str
    stderr: str

    def log_path(self, stream: LogStream) -> str:
        return self.stdout if stream is LogStream.STDOUT else self.stderr


@dataclass(frozen=True)
class LocalPlan:
    job_id: str
    attempt: int
    backend_job_id: str
    run_mode: str
    time_limit_seconds: float | None
    processes: tuple[ProcessPlan, ...]


def backend_job_id(job_id: str, attempt: int) -> str:
    return f"local-{job_id}-{attempt}"


def job_dir(state_dir: str, job_id: str) -> str:
    return os.path.join(state_dir, "jobs", job_id)


def attempt_dir(state_dir: str, job_id: str, attempt: int) -> str:
    return os.path.join(job_dir(state_dir, job_id), f"attempt-{attempt}")


def log_path(state_dir: str, job_id: str, attempt: int, role: str, index: int,
             stream: LogStream) -> str:
    return os.path.join(attempt_dir(state_dir, job_id, attempt), f"{role}-{index}.{stream.suffix}")


def plan_job(job_id: str, spec: JobSpec, *, attempt: int, state_dir: str,
             master_port: int = planner.DEFAULT_MASTER_PORT) -> LocalPlan:
    """The launch plan; raises InvalidArgument / Unimplemented for bad run modes."""
    placements = [planner.Placement(role=g.role, replica_index=r, host=LOCAL_HOST, node_rank=0)
                  for g in spec.replica_groups for r in range(g.replicas)]
    launches = planner.plan_processes(job_id, spec, placements, master_port=master_port)
    adir = attempt_dir(state_dir, job_id, attempt)
    procs = []
    for p in launches:
        cwd = os.path.normpath(os.path.join(adir, p.working_dir)) if p.working_dir else adir
        procs.append(ProcessPlan(
            role=p.role, index=p.slot_index, rank=p.rank, argv=p.argv, env=dict(p.env), cwd=cwd,
            stdout=log_path(state_dir, job_id, attempt, p.role, p.slot_index, LogStream.STDOUT),
            stderr=log_path(state_dir, job_id, attempt, p.role, p.slot_index, LogStream.STDERR),
        ))
    return LocalPlan(job_id=job_id, attempt=attempt, backend_job_id=backend_job_id(job_id, attempt),
                     run_mode=f"RUN_MODE_{spec.run_mode.name}",
                     time_limit_seconds=spec.time_limit_seconds, processes=tuple(procs))


def plan_to_json(plan: LocalPlan) -> dict[str, object]:
    return {
        "backend_job_id": plan.backend_job_id,
        "job_id": plan.job_id,
        "attempt": plan.attempt,
        "run_mode": plan.run_mode,
        "time_limit_seconds": plan.time_limit_seconds,
        "inherit_env": True,
        "log_format": LOG_FORMAT,
        "processes": [
            {"role": p.role, "index": p.index, "rank": p.rank, "argv": list(p.argv),
             "env": dict(p.env), "cwd": p.cwd, "stdout": p.stdout, "stderr": p.stderr}
            for p in plan.processes
        ],
    }


def to_native_spec(plan: LocalPlan) -> NativeSpec:
    return NativeSpec(media_type=MEDIA_TYPE,
                      content=json.dumps(plan_to_json(plan), indent=2, sort_keys=True) + "\n")
