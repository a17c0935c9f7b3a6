"""Job logs from the pod log API: one reader per replica container, merged into batches.

The pod log API per replica container (``timestamps=true`` for line times;
``tail_lines``; ``since_time`` as ``sinceSeconds`` rounded up, then
filtered exactly). Kubernetes merges a container's stdout and stderr, so
every line is reported as STDOUT; a query that does not want STDOUT opens
nothing. A pod that has not started yet gives one line saying so (without
follow), or is waited for (with follow); a follow ends once every replica's
stream has ended and the job is terminal. Each reader runs in a worker
thread (the client blocks); closing the stream (``LogStream.close``) shuts
the socket down so a reader blocked on a silent follow ends at once and no
reader outlives its consumer. What the readers of one tail hold for their
consumer is bounded (``QUEUED_CHARS`` characters of text): past it a reader
waits, and the pod log stream waits in the connection's flow control, so a
slow client costs the driver a bounded amount of memory however fast the
pods write. Readers run in a pool of their own (``READER_THREADS``,
``--max-log-readers``): a follow holds its thread for as long as it lasts,
and the pool the API calls use must never wait for them. Follows may hold
all but an eighth of the pool; a follow past that is RESOURCE_EXHAUSTED
``LOG_READERS_EXHAUSTED`` at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import socket
import threading
import time
from collections.abc import AsyncGenerator
from datetime import datetime
from typing import Any

from dlsched.errors import DlschedError, ResourceExhausted
from dlsched.kit import metrics
from dlsched.kit.parse import decimal
from drivers.common.base import LogEntry, LogQuery, LogStream, ReplicaState
from drivers.common.convert import MAX_LINE_CHARS, pieces
from drivers.kubernetes.api import api_error, raise_for_status, status_of, status_text
from drivers.kubernetes.tracking import KubeCluster, Replica, TrackedJob

BATCH_ENTRIES = 500
FOLLOW_READ_TIMEOUT = 24 * 3600.0  # a followed log may stay silent for long

#: the characters of log text one tail's readers may have queued for its consumer
QUEUED_CHARS = 4 << 20
_ENTRY_COST = 64  #: what an entry costs beyond its text, in characters
#: log readers at once in this process (a follow holds one for its whole life)
READER_THREADS = 256


class _Readers:
    """The reader threads, and how many follows hold one: follows may hold all but an
    eighth of them, so a read that ends (no follow) always finds a thread soon. A tail
    whose follows would pass that is refused RESOURCE_EXHAUSTED, not left waiting
    silently for a thread that a follow may hold for days."""

    def __init__(self, threads: int) -> None:
        self.threads = max(2, threads)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=self.threads,
                                                          thread_name_prefix="k8s-log")
        self.follow_cap = self.threads - max(1, self.threads // 8)
        self.following = 0

    def reserve(self, n: int) -> None:
        if self.following + n > self.follow_cap:
            raise ResourceExhausted(
                f"this driver follows {self.following} pod logs (at most {self.follow_cap} at "
                f"once; this follow needs {n}): follow fewer replicas, or retry later",
                reason="LOG_READERS_EXHAUSTED")
        self.following += n


_READERS = _Readers(READER_THREADS)


def configure(threads: int) -> None:
    """Size the reader pool (``--max-log-readers``), before any log is read."""
    global _READERS  # noqa: PLW0603 - one pool per process, sized once at start
    if threads != _READERS.threads:
        _READERS = _Readers(threads)

_Queue = asyncio.Queue[list[LogEntry] | BaseException | None]


def _cost(entries: list[LogEntry]) -> int:
    return sum(len(e.text) + _ENTRY_COST for e in entries)


class _Budget:
    """What one tail's readers have queued: a reader (a thread) waits while it is past
    ``QUEUED_CHARS`` (one batch always goes), until the consumer takes some or it is stopped."""

    def __init__(self, limit: int = QUEUED_CHARS) -> None:
        self._cond = threading.Condition()
        self._used = 0
        self._limit = limit

    def take(self, n: int, stop: _LogStream) -> bool:
        with self._cond:
            while self._used and self._used + n > self._limit:
                if stop.is_set():
                    return False
                self._cond.wait(0.1)
            self._used += n
            return True

    def charge(self, entries: list[LogEntry]) -> list[LogEntry]:
        """Counts what the event loop queues itself (a note), without waiting."""
        with self._cond:
            self._used += _cost(entries)
        return entries

    def give(self, n: int) -> None:
        with self._cond:
            self._used -= n
            self._cond.notify_all()


class _LogStream:
    """One open pod log response, closable from the event loop while a thread reads it."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._resp: Any = None

    def is_set(self) -> bool:
        return self._stop.is_set()

    def attach(self, resp: Any) -> bool:
        with self._lock:
            if self._stop.is_set():
                return False
            self._resp = resp
            return True

    def close(self) -> None:
        """Stop the reader without blocking the caller (the event loop).

        Closing the response here would wait for the reading thread's buffer
        lock; shutting the socket down instead ends a read blocked on a silent
        follow at once, and the reader closes the response itself.
        """
        with self._lock:
            self._stop.set()
            resp, self._resp = self._resp, None
        sock = getattr(getattr(resp, "connection", None), "sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def line_time(line: str) -> tuple[int | None, str]:
    """``<RFC3339Nano> <text>`` (the log API with timestamps) -> (unix nanos, text)."""
    stamp, sep, text = line.partition(" ")
    if not sep:
        return None, line
    s = stamp.rstrip("Z")
    frac = ""
    if "." in s:
        s, frac = s.split(".", 1)
    try:
        secs = datetime.fromisoformat(s + "+00:00").timestamp()
    except ValueError:
        return None, line
    nanos = int((frac + "000000000")[:9]) if decimal(frac) else 0
    return int(secs) * 1_000_000_000 + nanos, text


class _Pieces:
    """The log API's bytes -> (time, text) per line; a line longer than MAX_LINE_CHARS bytes in
    pieces (``piece_end``: the same cuts however the bytes arrive), each carrying the time stamp
    of the line's first piece (only that one starts with it)."""

    def __init__(self) -> None:
        self._buf = b""
        self._stamp: int | None = None
        self._mid = False  # pieces of the line in ``_buf`` went out already

    def _piece(self, raw: bytes, out: list[tuple[int | None, str]]) -> None:
        if self._mid:
            out.append((self._stamp, raw.decode("utf-8", "replace")))
        else:
            self._stamp, text = line_time(raw.decode("utf-8", "replace"))
            out.append((self._stamp, text))
        self._mid = True

    def _most(self, buf: bytes) -> int:
        """The bytes the next piece may take: MAX_LINE_CHARS of text, and the first piece its
        line's time stamp too (so pieces are cut where the other backends cut the text)."""
        if self._mid:
            return MAX_LINE_CHARS
        sp = buf.find(b" ", 0, 64)
        return MAX_LINE_CHARS + sp + 1 if sp >= 0 else MAX_LINE_CHARS

    def feed(self, chunk: bytes) -> list[tuple[int | None, str]]:
        out: list[tuple[int | None, str]] = []
        *lines, self._buf = (self._buf + chunk).split(b"\n")
        for line in lines:
            cuts, line = pieces(line, self._most(line))
            for piece in cuts:
                self._piece(piece, out)
            self._piece(line.rstrip(b"\r"), out)
            self._mid = False
        cuts, self._buf = pieces(self._buf, self._most(self._buf))  # without newlines: the same pieces
        for piece in cuts:
            self._piece(piece, out)
        return out

    def end(self) -> list[tuple[int | None, str]]:
        out: list[tuple[int | None, str]] = []
        if self._buf:
            self._piece(self._buf, out)
            self._buf, self._mid = b"", False
        return out


def _entries(role: str, index: int, lines: list[tuple[int | None, str]], query: LogQuery) -> list[LogEntry]:
    out = []
    for ns, text in lines:
        if query.since_ns is not None and ns is not None and ns < query.since_ns:
            continue
        out.append(LogEntry(role=role, replica_index=index, stream=LogStream.STDOUT, text=text, time_ns=ns))
    return out


def _note(r: Replica, index: int, text: str) -> list[LogEntry]:
    return [LogEntry(role=r.role, replica_index=index, stream=LogStream.STDERR, text=f"dlsched: {text}")]


async def tail(c: KubeCluster, job: TrackedJob, query: LogQuery) -> AsyncGenerator[list[LogEntry], None]:
    """Batches of the job's log lines, every wanted replica container's reader merged.

    ``job``: a tracked one, or a forgotten one read back for this request
    (its pods as listed now, its end latched: nothing to wait for)."""
    if not query.wants_stream(LogStream.STDOUT):
        return  # the pod log API merges stderr into one stream, reported as STDOUT
    targets = [(r, r.index * max(1, len(r.containers)) + k, cname)
               for r in job.replicas for k, cname in enumerate(r.containers or ("",))]
    targets = [(r, index, cname) for r, index, cname in targets if query.wants_replica(r.role, index)]
    readers = _READERS
    need = len(targets) if query.follow else 0
    readers.reserve(need)  # given back in the finally below, whatever happens after this line
    queue: _Queue = asyncio.Queue()
    stops: list[_LogStream] = []
    tasks: list[asyncio.Future[None]] = []
    held: list[list[LogEntry] | BaseException | None] = []  # a reader's end met while coalescing
    try:
        budget = _Budget()
        tasks.extend(asyncio.ensure_future(_tail_one(c, job, r, index, cname, query, queue, stops,
                                                     budget, readers.pool))
                     for r, index, cname in targets)
        remaining = len(tasks)
        while remaining:
            item = held.pop() if held else await queue.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            # A reader puts one network chunk's lines at a time: what is queued
            # already goes out in one batch, not one (often one-line) batch each.
            batch = list(item)
            while len(batch) < BATCH_ENTRIES and not queue.empty():
                more = queue.get_nowait()
                if more is None or isinstance(more, BaseException):
                    held.append(more)
                    break
                batch.extend(more)
            budget.give(_cost(batch))
            for i in range(0, len(batch), BATCH_ENTRIES):
                yield batch[i:i + BATCH_ENTRIES]
    finally:
        for st in stops:
            st.close()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        readers.following -= need


async def _started(job: TrackedJob, r: Replica, index: int, query: LogQuery, queue: _Queue,
                   budget: _Budget) -> bool:
    """Whether the replica's pod has started; without follow (or once it is gone) a note says it has not."""
    while True:
        view = job.pods.get(r.pod)
        if view is not None and view.state is not ReplicaState.PENDING:
            return True
        gone = (view is None and (r.pod in job.seen or r.pod in job.deleted)) or job.final is not None
        if not query.follow or gone:
            why = view.reason if view is not None else "not created yet"
            await queue.put(budget.charge(_note(r, index, f"pod {r.pod} has not started yet ({why})")))
            return False
        changed = job.changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), timeout=5)


def _request(c: KubeCluster, r: Replica, container: str, query: LogQuery) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"timestamps": True, "follow": query.follow,
                              "_request_timeout": (c.api.timeout, FOLLOW_READ_TIMEOUT) if query.follow
                              else c.api.timeout}
    if container:
        kwargs["container"] = container
    if query.tail_lines:
        kwargs["tail_lines"] = query.tail_lines
    if query.since_ns is not None:
        kwargs["since_seconds"] = max(1, math.ceil(time.time() - query.since_ns / 1e9) + 1)
    return kwargs


async def _tail_one(c: KubeCluster, job: TrackedJob, r: Replica, index: int, container: str,
                    query: LogQuery, queue: _Queue, stops: list[_LogStream], budget: _Budget,
                    pool: concurrent.futures.ThreadPoolExecutor) -> None:
    try:
        if not await _started(job, r, index, query, queue, budget):
            return
        stop = _LogStream()
        stops.append(stop)
        loop = asyncio.get_running_loop()
        kwargs = _request(c, r, container, query)

        def put(lines: list[tuple[int | None, str]]) -> None:
            entries = _entries(r.role, index, lines, query)
            if entries and budget.take(_cost(entries), stop):  # else stopped: nobody reads them
                loop.call_soon_threadsafe(queue.put_nowait, entries)

        def read() -> None:
            c.api.budget.acquire()
            metrics.backend_call("kubernetes", "read_namespaced_pod_log")
            resp = c.api.core.read_namespaced_pod_log(r.pod, c.namespace, _preload_content=False, **kwargs)
            if not stop.attach(resp):
                with contextlib.suppress(Exception):
                    resp.close()
                return
            try:
                raise_for_status(resp)
                pieces = _Pieces()
                for chunk in resp.stream(amt=None, decode_content=True):
                    if stop.is_set():
                        return
                    put(pieces.feed(chunk))
                put(pieces.end())
            finally:
                if stop.is_set():  # the socket was shut down: never back into the pool
                    with contextlib.suppress(Exception):
                        resp.close()
                else:
                    resp.release_conn()

        try:
            await loop.run_in_executor(pool, read)
        except DlschedError:
            raise
        except Exception as e:  # noqa: BLE001
            if stop.is_set():
                return  # closed by the consumer
            if status_of(e) not in (400, 404):
                raise api_error(e, f"reading the log of {r.pod}") from None
            await queue.put(budget.charge(_note(r, index, f"no log for pod {r.pod} ({status_text(e)})")))
    except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
        queue.put_nowait(e)
    finally:
        queue.put_nowait(None)
