"""The local driver's log files: ``<unix-nanos> <text>\\n`` per line.

``LineWriter`` (the supervisor) turns pipe chunks into stamped lines (a line
longer than ``MAX_LINE`` is split; a last line without newline is written at
EOF). ``LogFileReader`` reads whole lines in chunks of ``READ_CHUNK``:
forwards from an offset, or the last N backwards from the end. ``tail`` (the
driver) answers a TailJobLogs from the files: the backlog (``tail_lines``:
each file's last lines, read from the end, so ``tail_lines=1`` of a 100 MB
file reads one chunk; else every file from its start, merged by time a
chunk per file at a time; ``since``), then, when following, new lines as
the supervisor writes them (a read every ``FOLLOW_POLL_SECONDS``, a chunk
per file per read) until the job has ended and its pipes are drained.
Memory stays bounded whatever the files' size.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import os
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import BinaryIO

from drivers.common.base import LogEntry, LogQuery, LogStream
from drivers.common.convert import pieces

MAX_LINE = 64 * 1024
BATCH_ENTRIES = 500
BATCH_BYTES = 1 << 20
#: how often a follow reads the files for new lines (the supervisor writes them)
FOLLOW_POLL_SECONDS = 0.05
#: bytes one read takes from a log file (a tail reads backwards in these, a backlog or a follow forwards)
READ_CHUNK = 256 * 1024
#: a "line" without a newline longer than this is no line the supervisor wrote: it is passed on in pieces
#: (forwards) or ends the search (backwards), so no read holds more than this beside its chunk
MAX_SCAN = 4 * MAX_LINE


class LineWriter:
    """Appends stamped lines to one file. Not thread-safe; one per stream."""

    def __init__(self, path: str) -> None:
        self._f = open(path, "ab", buffering=0)  # noqa: SIM115 - closed in close()
        self._partial = b""

    def feed(self, chunk: bytes, now_ns: int) -> int:
        """Write the complete lines of ``chunk``; returns how many were written."""
        data = self._partial + chunk
        *whole, partial = data.split(b"\n")
        lines: list[bytes] = []
        for line in whole:  # a long line in pieces cut at UTF-8 characters (the same however it arrived)
            cuts, rest = pieces(line, MAX_LINE)
            lines.extend(cuts)
            lines.append(rest)
        cuts, self._partial = pieces(partial, MAX_LINE)
        lines.extend(cuts)
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


Line = tuple[int, str]  # (unix nanos, 0 when the stamp is unreadable; text)


def _parse(raw: bytes) -> Line:
    stamp, _, text = raw.partition(b" ")
    try:
        return int(stamp), text.decode("utf-8", "replace")
    except ValueError:
        return 0, raw.decode("utf-8", "replace")


class LogFileReader:
    """Reads one log file in bounded pieces: forwards from an offset (``read_new``), or its last lines,
    found backwards from the end (``seek_last``) and read forwards. Memory is a chunk, whatever the file's
    size and the lines asked for; ``bytes_read`` counts what it read."""

    def __init__(self, path: str, chunk: int = READ_CHUNK) -> None:
        self.path = path
        self.chunk = chunk
        self.offset = 0
        self.eof = False  # the last read_new reached the end of the file (or ``limit``)
        self.limit: int | None = None  # read_new stops there (seek_last's end of the lines asked for)
        self.bytes_read = 0
        self._partial = b""

    def read_new(self) -> list[Line]:
        """The complete lines among the next ``chunk`` bytes after the offset (up to ``limit``, when set)."""
        want = self.chunk if self.limit is None else min(self.chunk, self.limit - self.offset)
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(want) if want > 0 else b""
        except OSError:
            data = b""
        # A short read is the end, limit or not: a file cut or removed under a tail must not be
        # read again for ever (a bare limit kept its reader spinning).
        self.eof = len(data) < want or (self.limit is not None and self.offset + len(data) >= self.limit)
        if not data:
            return []
        self.offset += len(data)
        self.bytes_read += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > MAX_SCAN:  # no file the supervisor writes has such a line: pass it on in pieces
            lines.append(self._partial)
            self._partial = b""
        return [_parse(raw) for raw in lines]

    def seek_last(self, n: int, since_ns: int | None = None) -> None:
        """Place the reader on the last ``n`` complete lines (only those stamped at or after
        ``since_ns``): ``read_new`` reads them, forwards, up to ``limit`` (the end of the last
        complete line). Found reading backwards a chunk at a time, counting lines without keeping
        them: memory is a chunk, whatever ``n`` and the file's size. Clear ``limit`` to go on after."""
        try:
            with open(self.path, "rb") as f:
                start, stop = self._backwards(f, f.seek(0, os.SEEK_END), n, since_ns)
        except OSError:
            start = stop = self.offset
        self.offset, self.limit, self._partial, self.eof = start, stop, b"", start >= stop

    def read_last(self, n: int, since_ns: int | None = None) -> list[Line]:
        """The last ``n`` complete lines as a list, oldest first (``seek_last``, then read them);
        ``read_new`` goes on after them."""
        self.seek_last(n, since_ns)
        out: list[Line] = []
        while not self.eof:
            out.extend(self.read_new())
        self.limit = None
        return out

    def _backwards(self, f: BinaryIO, end: int, n: int, since_ns: int | None) -> tuple[int, int]:
        """(start, stop): the offsets of the first of the last ``n`` lines and just after the last."""
        taken = 0
        pos, buf = end, b""  # buf: the bytes from pos not yet taken apart, ending with a newline once stop is known
        stop: int | None = None  # just after the last complete line: where reading forwards goes on
        start = end
        while pos > 0 and taken < n:
            step = min(self.chunk, pos)
            pos -= step
            f.seek(pos)
            buf = f.read(step) + buf
            self.bytes_read += step
            if stop is None:
                cut = buf.rfind(b"\n")
                if cut < 0:
                    if len(buf) > MAX_SCAN:  # not a file of ours
                        return end, end
                    continue
                stop, buf = pos + cut + 1, buf[:cut + 1]
                start = stop
            parts = buf.split(b"\n")[:-1]
            head = parts.pop(0) if pos > 0 else None  # may begin before pos
            line_end = pos + len(buf)  # the offset just after the newline ending the part looked at
            for raw in reversed(parts):
                if since_ns is not None and _parse(raw)[0] < since_ns:
                    return start, stop
                start = line_end - len(raw) - 1
                line_end = start
                taken += 1
                if taken == n:
                    return start, stop
            if head is None:
                break
            buf = head + b"\n"
            if len(buf) > MAX_SCAN:  # a line too long to be ours: the tail ends after it
                break
        if stop is None:  # no newline at all: every byte is still to come
            return 0, 0
        return start, stop


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
    each read, so the last lines are never missed) or ``gone()`` (the job was removed).

    ``tail_lines``: the last lines of each file, read backwards from its end. Otherwise the files
    from their start, merged by time a chunk per file at a time. Either way memory stays bounded
    (chunks and the lines asked for), whatever the files' size."""
    wanted = [f for f in files if query.wants_replica(f.role, f.index) and query.wants_stream(f.stream)]
    readers = [LogFileReader(f.path) for f in wanted]
    done = ended()
    batcher = _Batcher()
    if query.tail_lines > 0:
        n = query.tail_lines

        def seek_all() -> None:
            for r in readers:
                r.seek_last(n, query.since_ns)

        await asyncio.to_thread(seek_all)
        async for e in _merged(wanted, readers, query.since_ns):  # a chunk per file at a time
            if full := batcher.add(e):
                yield full
        for r in readers:
            r.limit = None  # a follow goes on after the lines read
    else:
        async for e in _merged(wanted, readers, query.since_ns):
            if full := batcher.add(e):
                yield full
    if last := batcher.take():
        yield last
    if not query.follow or done:
        return
    while True:
        done = ended()
        new = sorted((_entry(f, ln) for f, r in zip(wanted, readers, strict=True) for ln in r.read_new()), key=_when)
        if new:
            for batch in _batches(new):
                yield batch
            continue
        if done or gone():
            return
        await asyncio.sleep(FOLLOW_POLL_SECONDS)


def _entry(f: LogFile, line: Line) -> LogEntry:
    return LogEntry(role=f.role, replica_index=f.index, stream=f.stream, text=line[1], time_ns=line[0] or None)


def _when(e: LogEntry) -> int:
    return e.time_ns or 0


async def _merged(files: Sequence[LogFile], readers: Sequence[LogFileReader],
                  since_ns: int | None) -> AsyncIterator[LogEntry]:
    """Every line of the files from their start to their current end, by time (a k-way merge that
    holds at most one chunk's lines per file)."""
    bufs: list[collections.deque[Line]] = [collections.deque() for _ in readers]

    def fill(i: int) -> None:  # until the file has a line to offer, or has none left
        r = readers[i]
        while not bufs[i]:
            bufs[i].extend(ln for ln in r.read_new() if since_ns is None or ln[0] >= since_ns)
            if r.eof:
                return

    def fill_all() -> None:
        for i in range(len(readers)):
            fill(i)

    await asyncio.to_thread(fill_all)
    heap = [(bufs[i][0][0], i) for i in range(len(readers)) if bufs[i]]
    heapq.heapify(heap)
    while heap:
        _, i = heapq.heappop(heap)
        yield _entry(files[i], bufs[i].popleft())
        if not bufs[i] and not readers[i].eof:
            await asyncio.to_thread(fill, i)
        if bufs[i]:
            heapq.heappush(heap, (bufs[i][0][0], i))


class _Batcher:
    """Entries into batches of at most ``BATCH_ENTRIES`` entries and about ``BATCH_BYTES``."""

    def __init__(self) -> None:
        self._cur: list[LogEntry] = []
        self._size = 0

    def add(self, e: LogEntry) -> list[LogEntry] | None:
        """Adds ``e``; returns the batch it closed, if any."""
        n = len(e.text) + 64
        full = None
        if self._cur and (len(self._cur) >= BATCH_ENTRIES or self._size + n > BATCH_BYTES):
            full = self.take()
        self._cur.append(e)
        self._size += n
        return full

    def take(self) -> list[LogEntry]:
        out, self._cur, self._size = self._cur, [], 0
        return out


def _batches(entries: list[LogEntry]) -> list[list[LogEntry]]:
    b = _Batcher()
    out = [full for e in entries if (full := b.add(e))]
    if last := b.take():
        out.append(last)
    return out
