"""Ray's answers as the driver's types: a job list entry as an observation, the load report as capacity."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from drivers.common.base import (
    ClusterCapacity,
    GpuInventory,
    JobObservation,
    JobState,
    ReplicaState,
    ReplicaStatus,
    same_job,
)
from drivers.ray import layout, render, states

MESSAGE_LIMIT = 2000


_TRACEBACK = "Traceback (most recent call last):"
_EXCEPTION_RE = re.compile(r"[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure)\b:?")


def trim(message: str) -> str:
    """Ray's message, cut to ``MESSAGE_LIMIT``; a Python traceback in it (Ray's own, e.g. a
    runtime_env that failed: frames of the Ray host's files) becomes its last line, the error."""
    if _TRACEBACK in message:
        head, _, frames = message.partition(_TRACEBACK)
        lines = [ln.strip() for ln in frames.splitlines() if ln.strip()]
        # the exception's line (the last one; logs may follow it), else the last line
        error = next((ln for ln in reversed(lines) if _EXCEPTION_RE.match(ln)), lines[-1] if lines else "")
        message = f"{head.rstrip()} {error}".strip()
    return message if len(message) <= MESSAGE_LIMIT else message[:MESSAGE_LIMIT] + " ..."


def _time_limit(it: Mapping[str, Any]) -> float | None:
    try:
        return float((it.get("metadata") or {})[render.META_TIME_LIMIT])
    except (KeyError, TypeError, ValueError):
        return None


def over_time_limit(it: Mapping[str, Any], started: float | None, now: float) -> bool:
    """Whether the job, running since ``started`` (unix seconds), ran until ``now`` past its
    ``dlsched_time_limit_seconds``."""
    limit = _time_limit(it)
    if limit is None or started is None:
        return False
    return now - started >= limit


#: ``observation``'s ``started`` when the caller knows no better: Ray's ``start_time``, which is
#: the submission's, so it includes the time the entrypoint waited for its resources.
RAY_START = -1.0


def observation(job_id: str, attempt: int, it: Mapping[str, Any], started: float | None = RAY_START) -> JobObservation:
    """One Ray job (``GET /api/jobs/`` entry) as an observation.

    ``started``: when the job started running (unix seconds), as the driver saw it; None when
    it never ran; ``RAY_START`` when unknown (Ray's ``start_time`` stands in). A PENDING job has
    no start time. A job Ray reports STOPPED that had run past its time limit is FAILED, reason
    ``TimeLimitExceeded``: the driver stopped it for that.
    """
    obs = _observation(job_id, attempt, it)
    if started == RAY_START:
        started = obs.start_time
    obs = replace(obs, start_time=None if obs.state is JobState.PENDING else started)
    end = it.get("end_time")
    if obs.state is JobState.STOPPED and end and over_time_limit(it, started, end / 1000):
        return replace(obs, state=JobState.FAILED, reason="TimeLimitExceeded",
                       message=f"stopped after its time limit of {_time_limit(it)} s")
    return obs


def _observation(job_id: str, attempt: int, it: Mapping[str, Any]) -> JobObservation:
    state, reason = states.map_status(it.get("status"), it.get("error_type"))
    exit_code = it.get("driver_exit_code")
    start, end = it.get("start_time"), it.get("end_time")
    return JobObservation(
        job_id=job_id, backend_job_id=str(it.get("submission_id") or ""), found=True, state=state,
        reason=reason, message=trim(str(it.get("message") or "")),
        # (a process ended by signal N: Ray says -N, every other backend and the shell 128+N)
        exit_code=(128 - exit_code if exit_code < 0 else exit_code) if isinstance(exit_code, int) else None,
        start_time=start / 1000 if start else None, end_time=end / 1000 if end and state.is_terminal() else None,
        attempt=attempt, uid=render.uid_of(it))


REASON_NON_ZERO_EXIT = "NonZeroExit"


def with_replicas(obs: JobObservation, manifest: layout.Manifest) -> JobObservation:
    """An ended job with each process's end from the launcher's manifest.

    A process that exited 0 SUCCEEDED, one the launcher stopped (the job was
    decided or stopped) STOPPED, one with another code FAILED, one with no
    exit recorded (its launcher was killed) STOPPED. When Ray failed the
    entrypoint and a process failed, the job's reason is ``NonZeroExit``,
    its exit code that process's and its message names it, as on every
    backend (Ray's message repeats the entrypoint's last 20,000 characters of
    output, which the job's logs have).
    """
    replicas, failed = [], None
    for p in manifest.placed:
        end = manifest.exits.get((p.role, p.index))
        if end is None or end[1]:
            state, code = ReplicaState.STOPPED, end[0] if end else None
        elif end[0] == 0:
            state, code = ReplicaState.SUCCEEDED, 0
        else:
            state, code = ReplicaState.FAILED, end[0]
            failed = failed or (p, code)
        msg = f"exited with code {code}" if code is not None else "no exit recorded"
        replicas.append(ReplicaStatus(role=p.role, index=p.index, state=state, exit_code=code,
                                      host=p.host, message=msg))
    out = replace(obs, replicas=tuple(replicas))
    if failed is not None and obs.state is JobState.FAILED and obs.reason == states.camel("JOB_ENTRYPOINT_COMMAND_ERROR"):
        p, code = failed
        out = replace(out, reason=REASON_NON_ZERO_EXIT, exit_code=code,
                      message=f"{p.role}-{p.index} exited with code {code}")
    return out


def capacity(report: Mapping[str, Any]) -> ClusterCapacity:
    """The autoscaler's load report (``usage``: resource -> [used, total]) as capacity."""
    usage = report.get("usage") or {}
    by_node = (report.get("usageByNode") or {}).values()

    def pair(d: Mapping[str, Any], key: str) -> tuple[float, float]:
        v = d.get(key) or [0.0, 0.0]
        return float(v[0]), float(v[1])

    cpu_used, cpu_total = pair(usage, "CPU")
    mem_used, mem_total = pair(usage, "memory")
    gpu_used, gpu_total = pair(usage, "GPU")
    gpus = []
    for key in usage:
        if key.startswith("accelerator_type:"):
            # Ray counts accelerator types per node (1 per node of that type), not per GPU.
            gpus.append(GpuInventory(gpu_type=key.split(":", 1)[1], total=int(gpu_total), free=int(gpu_total - gpu_used)))
    nodes = list(by_node)
    return ClusterCapacity(
        nodes_total=len(nodes),
        nodes_free=sum(1 for n in nodes if pair(n, "CPU")[0] == 0 and pair(n, "GPU")[0] == 0),
        cpus_total=cpu_total, cpus_free=max(0.0, cpu_total - cpu_used),
        memory_bytes_total=int(mem_total), memory_bytes_free=int(max(0.0, mem_total - mem_used)),
        gpus_total=int(gpu_total), gpus_free=int(max(0.0, gpu_total - gpu_used)), gpus=tuple(gpus[:1]),
        max_cpus_per_node=max((pair(n, "CPU")[1] for n in nodes), default=0.0),
        max_memory_bytes_per_node=int(max((pair(n, "memory")[1] for n in nodes), default=0.0)),
        max_gpus_per_node=int(max((pair(n, "GPU")[1] for n in nodes), default=0.0)),
    )


def of_job(prev: JobObservation, meta: render.SubmissionMeta) -> bool:
    """Whether a listed submission (``render.parse_submission``) may be the tracked job ``prev``'s.

    A job with a uid owns only submissions of that uid under the id the driver gives them
    (``render.submission_id``), or the one it follows already (adopted from a driver that
    made ids without uids): a uid-less submission, or one under an id of its own, is
    anyone's (anything in the cluster may POST to the dashboard), never the job's. A job
    without a uid has no more to tell by than ``same_job``.
    """
    if not prev.uid:
        return True
    return bool(meta.uid) and same_job(prev.uid, meta.uid) and meta.submission_id in (
        render.submission_id(prev.job_id, meta.attempt, prev.uid), prev.backend_job_id)


def newest_submission(prev: JobObservation | None, subs: list[tuple[render.SubmissionMeta, dict[str, Any]]]
                      ) -> tuple[render.SubmissionMeta, dict[str, Any]]:
    """A job id's listed submission to follow: of the tracked job (``of_job``; else of the uid
    submitted last: jobs of one id deleted without their cleanup may be listed beside it),
    the newest attempt."""
    def started(it: dict[str, Any]) -> float:
        t = it.get("start_time")
        return float(t) if isinstance(t, (int, float)) else 0.0
    mine = [x for x in subs if prev is not None and of_job(prev, x[0])]
    if not mine:
        last = max(subs, key=lambda x: started(x[1]))[0].uid
        mine = [x for x in subs if x[0].uid == last]
    return max(mine, key=lambda x: (x[0].attempt, started(x[1])))
