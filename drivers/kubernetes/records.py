"""The record of a forgotten job, kept on its Service: what the driver answers it from.

ForgetJobs (JobManager has stored the job's end) drops an ended job from
the driver's memory. What observations, logs, usage and cleanup need of it
stays on the API server, with the job's objects, until CleanupJob deletes
them: the Service gets the annotation ``naming.ANN_FINAL`` (``record``: the
final observation as reported, the replicas' pods and containers, the
attempt's other objects and the usage sampled so far) and, like every pod
still there, the label ``naming.LABEL_RECORDED``, which the pod watch
selects out (``naming.WATCH_SELECTOR``), so neither this driver nor a
restarted one tracks the attempt again. ``from_record`` reads it back into
a ``TrackedJob`` built for one request and not kept.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import zlib
from collections.abc import Mapping
from typing import Any

from drivers.common.base import JobObservation, JobState, ReplicaState, ReplicaStatus
from drivers.common.planner import SuccessRule
from drivers.kubernetes import naming
from drivers.kubernetes.tracking import Replica, TrackedJob
from drivers.kubernetes.usage import Sampled

RECORD_VERSION = 1


def record(job: TrackedJob, final: JobObservation) -> dict[str, Any]:
    """What the Service keeps of an ended job (``final``: its observation as last reported)."""
    return {
        "version": RECORD_VERSION, "job_id": job.job_id, "attempt": job.attempt,
        "backend_job_id": job.backend_job_id, "service": job.service,
        "state": final.state.name, "reason": final.reason, "message": final.message,
        "exit_code": final.exit_code, "start_time": final.start_time, "end_time": final.end_time,
        "replicas": [[r.role, r.index, r.pod, list(r.containers)] for r in job.replicas],
        "statuses": [[s.role, s.index, s.state.name, s.exit_code, s.host, s.message] for s in final.replicas],
        "others": [list(o) for o in job.others],
        "usage": {pod: [s.time, s.cpu_seconds, s.peak_memory_bytes] for pod, s in job.usage.items()},
    }


#: The most a record may take of the Service's annotations (the API server refuses more than
#: 256 KiB in all, 422, and the record was retried for ever): past it the JSON is compressed
#: (``COMPRESSED``: zlib, base64), then the replicas' messages are cut, then usage is dropped.
MAX_RECORD_BYTES = 200 * 1024
COMPRESSED = "z:"
_CUT_MESSAGE = 200


def annotation(job: TrackedJob, final: JobObservation) -> str:
    doc = record(job, final)
    for step in range(3):
        text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
        if len(text.encode()) <= MAX_RECORD_BYTES:
            return text
        packed = COMPRESSED + base64.b64encode(zlib.compress(text.encode(), 9)).decode()
        if len(packed) <= MAX_RECORD_BYTES:
            return packed
        if step == 0:  # a thousand replicas' termination messages: their heads say enough
            doc["message"] = str(doc["message"])[:4096]
            doc["statuses"] = [[*st[:5], str(st[5])[:_CUT_MESSAGE]] for st in doc["statuses"]]
        else:
            doc["usage"], doc["statuses"] = {}, [[*st[:5], ""] for st in doc["statuses"]]
    return packed  # (the last resort; a refusal is logged and retried)


#: The most a compressed record may expand to (anyone who may edit the Service may write it).
MAX_DECODED_BYTES = 16 << 20


def _decoded(raw: str) -> Any:
    if raw.startswith(COMPRESSED):
        z = zlib.decompressobj()
        text = z.decompress(base64.b64decode(raw[len(COMPRESSED):], validate=True), MAX_DECODED_BYTES)
        if z.unconsumed_tail or not z.eof:
            raise ValueError("a compressed record past its bound, or cut")
        return json.loads(text)
    return json.loads(raw)


def from_service(cluster: str, service: Mapping[str, Any]) -> TrackedJob | None:
    """The forgotten job a Service's record describes; ``None`` when it carries none (or a bad one)."""
    ann = (service.get("metadata") or {}).get("annotations") or {}
    raw = ann.get(naming.ANN_FINAL)
    if not raw:
        return None
    try:
        job = from_record(cluster, _decoded(raw))
    except (KeyError, TypeError, ValueError, zlib.error):
        return None
    job.uid = naming.uid_of(service)  # the job's uid: the Service's label
    if job.final is not None:
        job.final = job.last = dataclasses.replace(job.final, uid=job.uid)
    return job


def from_record(cluster: str, doc: Mapping[str, Any]) -> TrackedJob:
    """The ended job ``record`` wrote (raises KeyError/TypeError/ValueError when malformed)."""
    state = JobState[doc["state"]]
    if not state.is_terminal():
        raise ValueError(f"a recorded job must have ended, not {state.name}")
    replicas = [Replica(str(role), int(i), str(pod), tuple(str(c) for c in conts))
                for role, i, pod, conts in doc["replicas"]]
    job = TrackedJob(cluster, str(doc["job_id"]), int(doc["attempt"]), str(doc["backend_job_id"]),
                     str(doc["service"]), replicas, SuccessRule(frozenset(), frozenset()),
                     tuple((str(k), str(n)) for k, n in doc.get("others") or ()))
    job.final = job.last = JobObservation(
        job_id=job.job_id, backend_job_id=job.backend_job_id, found=True, state=state,
        reason=str(doc["reason"]), message=str(doc["message"]),
        exit_code=None if doc.get("exit_code") is None else int(doc["exit_code"]),
        replicas=tuple(ReplicaStatus(role=str(r), index=int(i), state=ReplicaState[st],
                                     exit_code=None if code is None else int(code), host=str(host),
                                     message=str(msg))
                       for r, i, st, code, host, msg in doc.get("statuses") or ()),
        start_time=doc.get("start_time"), end_time=doc.get("end_time"), attempt=job.attempt)
    job.start_time, job.end_time = job.final.start_time, job.final.end_time
    job.stop_requested = job.final.state is JobState.STOPPED
    for pod, (t, cpu, peak) in (doc.get("usage") or {}).items():
        job.usage[str(pod)] = Sampled(float(t), float(cpu), int(peak))
    return job
