"""A Ray job's log: ``GET /api/jobs/{id}/logs`` read as entries, once or followed.

Ray's log is the entrypoint's combined stdout and stderr. Lines the launcher
tagged ``[dlsched role-index stream]`` (MULTI_PROCESS, MASTER_WORKER,
PS_WORKER) are attributed to that replica and stream; other lines belong to
the job's first role, replica 0, STDOUT. Ray's lines carry no time: history
entries have none, followed ones the time they were read, and ``since_time``
only filters the followed ones.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable

from drivers.common.base import JobNotFound, LogEntry, LogQuery, LogStream
from drivers.ray.api import RayApi, RayHttpError

TAG_RE = re.compile(r"\[dlsched (?P<role>[a-z][a-z0-9_-]*)-(?P<index>\d+) (?P<stream>out|err)\] ?")
#: a big log is re-read less often: about this many bytes per second at most
READ_RATE_BYTES = 20e6


def entry(line: str, role: str, now: int | None) -> LogEntry:
    m = TAG_RE.search(line)
    if m is None:
        return LogEntry(role=role, replica_index=0, stream=LogStream.STDOUT, text=line, time_ns=now)
    stream = LogStream.STDERR if m.group("stream") == "err" else LogStream.STDOUT
    return LogEntry(role=m.group("role"), replica_index=int(m.group("index")), stream=stream,
                    text=line[m.end():], time_ns=now)


def _since(e: LogEntry, q: LogQuery) -> bool:
    return q.since_ns is None or e.time_ns is None or e.time_ns >= q.since_ns


async def tail(api: RayApi, job_id: str, sid: str, role: str, query: LogQuery, *,
               ended: Callable[[], bool], interval: float) -> AsyncIterator[list[LogEntry]]:
    """Batches of the log's lines (all of them, or a follow until ``ended()`` and drained).

    Yields unfiltered by replica and stream (the kit filters); ``tail_lines``
    counts the lines the query wants.
    """
    offset, pending, first = 0, "", True
    while True:
        done_before_read = ended()
        try:
            doc = await api.request("GET", f"/api/jobs/{sid}/logs")
        except RayHttpError as e:
            if e.status == 404:
                raise JobNotFound(job_id) from e
            raise e.unavailable(f"read the logs of {sid}") from e
        text = doc.get("logs", "") if isinstance(doc, dict) else ""
        if len(text) < offset:  # rewritten (should not happen): start over
            offset, pending = 0, ""
        chunk, offset = pending + text[offset:], len(text)
        lines = chunk.split("\n")
        done = done_before_read or not query.follow
        pending = "" if done else lines.pop()
        if done and lines and lines[-1] == "":
            lines.pop()
        now = None if first else time.time_ns()
        entries = [e for e in (entry(ln, role, now) for ln in lines) if _since(e, query)]
        if first and query.tail_lines > 0:
            entries = [e for e in entries if query.wants_stream(e.stream)
                       and query.wants_replica(e.role, e.replica_index)][-query.tail_lines:]
        first = False
        if entries:
            yield entries
        if done:
            return
        # Ray sends the whole log each time: read a big one less often.
        await asyncio.sleep(min(2.0, max(interval, len(text) / READ_RATE_BYTES)))
