"""A Ray job's usage: the launcher's samples, read through Ray's state API.

Ray measures no process a job starts: its reporter samples only the
processes the raylet registered (workers, agents), and a job's entrypoint
is a subprocess of its ``JobSupervisor`` actor, the replica processes
subprocesses of the entrypoint or of the launcher's tasks, so none of them
appears in ``/nodes/{id}``, ``/api/v0/tasks``, ``/api/v0/actors`` or
``/api/v0/workers`` (checked on Ray 2.60). The launcher, which starts every
replica process, measures them itself (``drivers.ray.sampler``) and appends
one sample a second to each process's ``.usage`` file
(``drivers.ray.layout``). ``job_usage`` reads the last line of each
(``/api/v0/logs/file`` with ``lines=1``: a few hundred bytes a replica,
whatever the job's age). A process that ended has a last sample with
``running: false``; once the job ended every replica is reported not
running, even when its launcher was killed before it could say so.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from drivers.common.base import JobUsage, ReplicaUsage
from drivers.ray import layout
from drivers.ray.api import RayApi


def replica_usage(p: layout.Placed, doc: dict[str, Any] | None, ended: bool) -> ReplicaUsage:
    if not doc:  # placed, not sampled yet
        return ReplicaUsage(role=p.role, replica_index=p.index, running=not ended)
    return ReplicaUsage(
        role=p.role, replica_index=p.index, cpu_seconds=float(doc.get("cpu", 0.0)),
        memory_bytes=0 if ended else int(doc.get("rss", 0)), peak_memory_bytes=int(doc.get("peak", 0)),
        gpu_utilization_percent=0.0 if ended else float(doc.get("gpu", 0.0)),
        gpu_memory_bytes=0 if ended else int(doc.get("gpu_mem", 0)),
        running=bool(doc.get("running")) and not ended)


def last_sample(data: bytes | None) -> dict[str, Any] | None:
    for line in reversed((data or b"").decode(errors="replace").splitlines()):
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict):
            return doc
    return None


async def job_usage(api: RayApi, sid: str, node_id: str, manifest: layout.Manifest, ended: bool) -> JobUsage:
    placed = manifest.placed
    datas = await asyncio.gather(*(api.read_file(p.node_id or node_id, layout.output(sid, p.role, p.index, "usage"),
                                                 lines=2) for p in placed))
    docs = [last_sample(d) for d in datas]
    times = [float(d["t"]) for d in docs if d and isinstance(d.get("t"), (int, float))]
    return JobUsage(replicas=tuple(replica_usage(p, d, ended) for p, d in zip(placed, docs, strict=True)),
                    sample_time=max(times, default=time.time()))
