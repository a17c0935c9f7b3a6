"""The local driver's log files: ``<unix-nanos> <text>\\n`` per line.

``LineWriter`` (the supervisor) turns pipe chunks into stamped lines (a line
longer than ``MAX_LINE`` is split; a last line without newline is written at
EOF). ``LogFileReader`` reads whole lines from an offset onwards. ``tail``
(the driver) answers a TailJobLogs from the files: the backlog (``since``,
``tail_lines``), then, when following, new lines as the supervisor writes
them (a read every ``FOLLOW_POLL_SECONDS``) until the job has ended and its
pipes are drained.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from drivers.common.base import LogEntry, LogQuery, LogStream

MAX_LINE = 64 * 1024
BATCH_ENTRIES = 500
BATCH_BYTES = 1 << 20
#: how often a follow reads the files for new lines (the supervisor writes them)
FOLLOW_POLL_SECONDS = 0.05


class LineWriter:
    """Appends stamped lines to one file. Not thread-safe; one per stream."""

    def __init__(self, path: str) -> None:
        self._f = open(path, "ab", buffering=0)  # noqa: SIM115 - closed in close()
        self._partial = b""

    def feed(self, chunk: bytes, now_ns: int) -> int:
        """Write the complete lines of ``chunk``; returns how many were written."""
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        while len(self._partial) > MAX_LINE:
            lines.append(self._partial[:MAX_LINE])
            self._partial = self._partial[MAX_LINE:]
        return self._write(lines, now_ns)

    def _write(self, lines: list[bytes], now_ns: int) -> int:
        if not lines:
            return 0
        stamp = str(now_ns).encode() + b" "
        out = b"".join(
            stamp + line.rstrip(b"\r").decode("utf-8", "replace").encode() + b"\n" for line in lines
        )
        self._f.write(out)
        return len(lines)

    def close(self, now_ns: int) -> int:
        n = 0
        if self._partial:
            n = self._write([self._partial], now_ns)
            self._partial = b""
        self._f.close()
        return n


class LogFileReader:
    """Reads the lines appended to a log file since the last call."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def read_new(self) -> list[tuple[int, str]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return []
        if not data:
            return []
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        out: list[tuple[int, str]] = []
        for raw in lines:
            stamp, _, text = raw.partition(b" ")
            try:
                ns = int(stamp)
            except ValueError:
                ns, text = 0, raw
            out.append((ns, text.decode("utf-8", "replace")))
        return out



@dataclass(frozen=True)
class LogFile:
    """One log file of a job: its process (role, index) and stream."""

    role: str
    index: int
    stream: LogStream
    path: str


async def tail(files: Sequence[LogFile], query: LogQuery, *,
               ended: Callable[[], bool], gone: Callable[[], bool]) -> AsyncIterator[list[LogEntry]]:
    """Batches of the query's lines; when following, until ``ended()`` (checked before
    each read, so the last lines are never missed) or ``gone()`` (the job was removed)."""
    wanted = [f for f in files if query.wants_replica(f.role, f.index) and query.wants_stream(f.stream)]
    readers = [LogFileReader(f.path) for f in wanted]

    def entries(per_file: list[list[tuple[int, str]]], last: int) -> list[LogEntry]:
        out: list[LogEntry] = []
        for f, lines in zip(wanted, per_file, strict=True):
            if query.since_ns is not None:
                lines = [ln for ln in lines if ln[0] >= query.since_ns]
            if last:
                lines = lines[-last:]
            out.extend(LogEntry(role=f.role, replica_index=f.index, stream=f.stream, text=t,
                                time_ns=ns or None) for ns, t in lines)
        out.sort(key=lambda e: e.time_ns or 0)
        return out

    done = ended()
    backlog = await asyncio.to_thread(lambda: [r.read_new() for r in readers])
    for batch in _batches(entries(backlog, query.tail_lines)):
        yield batch
    if not query.follow or done:
        return
    while True:
        done = ended()
        new = entries([r.read_new() for r in readers], 0)
        if new:
            for batch in _batches(new):
                yield batch
            continue
        if done or gone():
            return
        await asyncio.sleep(FOLLOW_POLL_SECONDS)


def _batches(entries: list[LogEntry]) -> list[list[LogEntry]]:
    out: list[list[LogEntry]] = []
    cur: list[LogEntry] = []
    size = 0
    for e in entries:
        n = len(e.text) + 64
        if cur and (len(cur) >= BATCH_ENTRIES or size + n > BATCH_BYTES):
            out.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += n
    if cur:
        out.append(cur)
    return out
