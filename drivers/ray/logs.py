"""A Ray job's output: the launcher's per-process files, read through Ray's state API.

The launcher (``drivers.ray.launcher``) writes each process's stdout and
stderr to files of their own in its node's Ray log directory, one
``<unix-nanos> <text>`` line per line, and lists them in the manifest on
the entrypoint's node (``drivers.ray.layout``). So every run mode keeps
stdout and stderr apart, every line has the time it was written, and Ray's
own lines ("Runtime env is setting up", "Running entrypoint ...", which
Ray writes to the job's log, ``GET /api/jobs/{id}/logs``) are not part of
the job's output: they stay in Ray's job log, and the last of them are in
Ray's message when the job fails.

- Where: the entrypoint's node is the job's ``driver_node_id`` (Ray's job
  list); its manifest (``GET /api/v0/logs/file``) lists every process's
  node and files. Only the files the query wants (role, replica, stream)
  are read.
- History (no follow): each file once (``/api/v0/logs/file``, its last
  ``tail_lines`` lines when asked for), merged by time.
- Follow: one ``GET /api/v0/logs/stream`` per file (Ray's agent sends what
  was appended, checked every ``--log-poll-interval``), so a follow costs the
  bytes the job writes, never a re-read of the whole log. Without
  ``tail_lines`` the stream starts at the file's start (a follow sends the
  whole history); with it, the history is read first (the last lines of
  each file) and the stream starts at a window of the last lines that
  reaches back to them, skipping what was sent (by the nanos). A file's follow ends at its ``eof`` line (the
  launcher writes it when the pipe closes), or, for a launcher killed before
  it could (a node lost), once the job has ended and nothing arrived for
  ``QUIET_SECONDS``. A file not there yet (a replica task not started) is
  asked for again until the job ends. The manifest is re-read every
  ``MANIFEST_SECONDS`` while the job runs, for processes placed later.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from dlsched.errors import Unavailable
from drivers.common.base import LogEntry, LogQuery, LogStream
from drivers.common.convert import MAX_LINE_CHARS
from drivers.ray import layout
from drivers.ray.api import FileMissing, RayApi

QUIET_SECONDS = 1.0
MANIFEST_SECONDS = 1.0
WAIT_SECONDS = 0.2
RETRIES = 5
RESUME_LINES = 200
#: The most lines asked of Ray's log endpoint (an int32 there: tail_lines=2**31-1 + 1 overflowed it,
#: UNAVAILABLE for ever); its reads are bounded in bytes anyway (``api.MAX_FILE_READ``).
MOST_LINES = 1 << 24
STREAMS = {"out": LogStream.STDOUT, "err": LogStream.STDERR}


@dataclass(frozen=True)
class OutputFile:
    role: str
    index: int
    stream: LogStream
    node_id: str
    path: str

#: Bytes without a newline held at most: the writer ends every line within MAX_LINE_CHARS (and
#: its time stamp), so a longer run was written by something else (the job, into its own file).
_MAX_PENDING = 4 * MAX_LINE_CHARS


async def read_manifest(api: RayApi, sid: str, node_id: str) -> layout.Manifest | None:
    data = await api.read_file(node_id, layout.manifest(sid))
    return None if data is None else layout.parse_manifest(data.decode(errors="replace"))


def files(sid: str, node_id: str, manifest: layout.Manifest, query: LogQuery) -> list[OutputFile]:
    """The output files of the processes and streams ``query`` wants."""
    out = []
    for p in manifest.placed:
        if not query.wants_replica(p.role, p.index):
            continue
        for kind, stream in STREAMS.items():
            if query.wants_stream(stream):
                out.append(OutputFile(p.role, p.index, stream, p.node_id or node_id,
                                      layout.output(sid, p.role, p.index, kind)))
    return out


def parse(f: OutputFile, lines: Iterable[str]) -> tuple[list[LogEntry], bool]:
    """Entries of complete lines, and whether the ``eof`` line was among them."""
    out, eof = [], False
    for line in lines:
        parsed = layout.parse_line(line)
        if parsed is None:
            eof = eof or line == layout.EOF
            continue
        out.append(LogEntry(role=f.role, replica_index=f.index, stream=f.stream, text=parsed[1], time_ns=parsed[0]))
    return out, eof


def _since(entries: list[LogEntry], q: LogQuery) -> list[LogEntry]:
    return entries if q.since_ns is None else [e for e in entries if (e.time_ns or 0) >= q.since_ns]


async def history(api: RayApi, wanted: list[OutputFile], query: LogQuery) -> tuple[list[LogEntry], dict[OutputFile, int]]:
    """Every wanted file once, each cut to its last ``tail_lines`` (a replica stream's, as every
    backend cuts), merged by time; and each file's last nanos."""
    lines = min(query.tail_lines, MOST_LINES) + 1 if query.tail_lines > 0 else -1  # + the eof line
    datas = await asyncio.gather(*(api.read_file(f.node_id, f.path, lines, newest=True) for f in wanted))
    per_file, last = [], {}
    for f, data in zip(wanted, datas, strict=True):
        entries, _ = parse(f, (data or b"").decode(errors="replace").split("\n"))
        if entries:
            last[f] = entries[-1].time_ns or 0
        kept = _since(entries, query)
        per_file.append(kept[-query.tail_lines:] if query.tail_lines > 0 else kept)
    return list(heapq.merge(*per_file, key=lambda e: e.time_ns or 0)), last


async def _follow_file(api: RayApi, f: OutputFile, after_ns: int, query: LogQuery, interval: float,
                       ended: Callable[[], bool], put: Callable[[list[LogEntry]], None]) -> None:
    """Send the file's lines after ``after_ns`` (0: all of them) until its end (see the module docstring).

    With lines already sent, the stream starts at a window of the file's last
    lines (``RESUME_LINES`` more than the tail asked for), which must reach
    back to the last line sent; when it does not (more was written meanwhile)
    the file is read from its start after all, skipping what was sent.
    """
    last, failures, from_start = after_ns, 0, after_ns == 0
    while True:
        lines = -1 if from_start else RESUME_LINES + min(max(0, query.tail_lines), MOST_LINES)
        try:
            async with api.stream_file(f.node_id, f.path, interval, lines) as stream:
                failures, pending, quiet, checked = 0, b"", 0.0, from_start
                while True:
                    done = ended()
                    try:
                        data = await asyncio.wait_for(stream.read(), WAIT_SECONDS)
                    except TimeoutError:
                        quiet = quiet + WAIT_SECONDS if done else 0.0
                        if quiet >= QUIET_SECONDS:
                            return
                        continue
                    if not data:  # Ray closed it: open it again, skipping what was sent
                        from_start = last == 0
                        break
                    quiet = 0.0
                    *raw, pending = (pending + data).split(b"\n")
                    if len(pending) > _MAX_PENDING:  # longer than any line the writer makes: no line
                        pending = b""
                    entries, eof = parse(f, (ln.decode(errors="replace") for ln in raw))
                    if not checked and entries:
                        checked = True
                        if (entries[0].time_ns or 0) > last:
                            from_start = True  # the window does not reach back to the last line sent
                            break
                    entries = [e for e in entries if (e.time_ns or 0) > last]
                    if entries:
                        last = entries[-1].time_ns or last
                        wanted = _since(entries, query)
                        if wanted:
                            put(wanted)
                    if eof:
                        return
        except FileMissing:
            if ended():
                return
        except Unavailable:
            failures += 1
            if failures > RETRIES:
                raise
        await asyncio.sleep(WAIT_SECONDS)


async def tail(api: RayApi, job_id: str, sid: str, query: LogQuery, *, ended: Callable[[], bool],
               node: Callable[[], str | None], interval: float) -> AsyncIterator[list[LogEntry]]:
    """Batches of the job's lines (history, or a follow until the job ended and its files are drained).

    Yields unfiltered by replica and stream beyond the files it reads (the kit filters).
    """
    manifest: layout.Manifest | None = None
    nid: str | None = None
    while True:  # the entrypoint's node and its manifest
        done = ended()
        nid = node()
        manifest = await read_manifest(api, sid, nid) if nid else None
        if manifest is not None and manifest.placed:
            break
        if done or not query.follow:
            return
        await asyncio.sleep(WAIT_SECONDS)
    assert nid is not None
    wanted = files(sid, nid, manifest, query)
    after: dict[OutputFile, int] = {}
    if not query.follow or query.tail_lines > 0:
        entries, after = await history(api, wanted, query)
        if entries:
            yield entries
        if not query.follow:
            return

    queue: asyncio.Queue[list[LogEntry] | BaseException | None] = asyncio.Queue()
    tasks: dict[OutputFile, asyncio.Task[None]] = {}

    def start(fs: list[OutputFile]) -> None:
        for f in fs:
            if f not in tasks:
                tasks[f] = asyncio.create_task(_run(f))

    async def _run(f: OutputFile) -> None:
        try:
            await _follow_file(api, f, after.get(f, 0), query, interval, ended, queue.put_nowait)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # handed to the consumer
            queue.put_nowait(e)
        finally:
            queue.put_nowait(None)

    async def watch_manifest() -> None:
        while not ended():
            await asyncio.sleep(MANIFEST_SECONDS)
            with contextlib.suppress(Unavailable):
                m = await read_manifest(api, sid, nid)
                if m is not None:
                    start(files(sid, nid, m, query))
        queue.put_nowait(None)

    start(wanted)
    watcher = asyncio.create_task(watch_manifest())
    try:
        while True:
            item = await queue.get()
            if item is None:  # a task ended (it is done by now): the follow ends with the last one
                if watcher.done() and all(t.done() for t in tasks.values()):
                    break
                continue
            if isinstance(item, BaseException):
                raise item
            yield item
        while not queue.empty():  # batches queued behind the last task's end
            item = queue.get_nowait()
            if isinstance(item, BaseException):
                raise item
            if item:
                yield item
    finally:
        for t in [*tasks.values(), watcher]:
            t.cancel()
        await asyncio.gather(*tasks.values(), watcher, return_exceptions=True)
