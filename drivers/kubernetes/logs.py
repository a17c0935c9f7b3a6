"""Job logs from the pod log API: one reader per replica container, merged into batches.

The pod log API per replica container (``timestamps=true`` for line times;
``tail_lines``; ``since_time`` as ``sinceSeconds`` rounded up, then
filtered exactly). Kubernetes merges a container's stdout and stderr, so
every line is reported as STDOUT; a query that does not want STDOUT opens
nothing. A pod that has not started yet gives one line saying so (without
follow), or is waited for (with follow); a follow ends once every replica's
stream has ended and the job is terminal (a followed stream that ends while
its pod runs, as when the API server loses its kubelet, is read again from
its last line's time). Each reader is a task on the
event loop reading its response with aiohttp (``podlog.PodLogClient``): a
silent follow costs a socket, not a thread, and closing the tail cancels
its readers, which close their responses, so no reader outlives its
consumer. What the readers of one tail hold for their consumer is bounded
(``QUEUED_CHARS`` characters of text): past it a reader waits, and the pod
log stream waits in the connection's flow control, so a slow client costs
the driver a bounded amount of memory however fast the pods write. At most
``READERS`` (``--max-log-readers``) responses are open at once (a
descriptor each): follows hold at most seven eighths of them (a follow past
that is RESOURCE_EXHAUSTED ``LOG_READERS_EXHAUSTED`` at once), reads without
follow the other eighth, each tail at most ``TAIL_READS`` of those at once.
So reads whose clients stopped taking lines never keep a follow waiting,
and one large job's read leaves room for the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import resource
import time
from collections.abc import AsyncGenerator
from datetime import datetime

import aiohttp

from dlsched.errors import ResourceExhausted
from dlsched.kit import metrics
from dlsched.kit.parse import decimal
from drivers.common.base import LogEntry, LogQuery, LogStream, ReplicaState
from drivers.common.convert import MAX_LINE_CHARS, pieces
from drivers.kubernetes.api import api_error, status_of, status_text
from drivers.kubernetes.podlog import HttpError
from drivers.kubernetes.tracking import KubeCluster, Replica, TrackedJob

BATCH_ENTRIES = 500
FOLLOW_READ_TIMEOUT = 24 * 3600.0  # a followed log may stay silent for long

#: the characters of log text one tail's readers may have queued for its consumer
QUEUED_CHARS = 4 << 20
_ENTRY_COST = 64  #: what an entry costs beyond its text, in characters
#: pod log responses open at once in this process (a follow holds one for its whole life)
READERS = 4096
#: the responses one read without follow has open at once (its replicas are read in waves)
TAIL_READS = 32
#: a followed stream that ends while its pod runs (the API server's link to the kubelet broke:
#: it ends the response as if done) is read again from its last line's time, after this long
#: (doubling up to ``RESUME_MAX_SECONDS``)
RESUME_SECONDS = 0.5
RESUME_MAX_SECONDS = 10.0


class _Readers:
    """The open pod log responses: follows may hold all but an eighth of them, counted as
    they start (a tail whose follows would pass that is refused RESOURCE_EXHAUSTED, not
    left waiting silently for a slot that a follow may hold for days); reads without
    follow wait for a slot of the other eighth (``reads``), which they give back as they
    end, and a follow never waits for."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.follow_cap = slots - max(1, slots // 8)
        self.reads = asyncio.Semaphore(slots - self.follow_cap)
        self.following = 0

    def reserve(self, n: int) -> None:
        if self.following + n > self.follow_cap:
            raise ResourceExhausted(
                f"this driver follows {self.following} pod logs (at most {self.follow_cap} at "
                f"once; this follow needs {n}): follow fewer replicas, or retry later",
                reason="LOG_READERS_EXHAUSTED")
        self.following += n


_READERS = _Readers(READERS)


def configure(slots: int) -> None:
    """Size the reader slots (``--max-log-readers``), before any log is read, and let the
    process open that many descriptors beside the 1,024 it has for everything else (the
    soft limit is raised towards the hard one; where that is lower, a read past it fails
    as unreachable, not the process)."""
    global _READERS  # noqa: PLW0603 - one pool per process, sized once at start
    if slots != _READERS.slots:
        _READERS = _Readers(slots)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = slots + 1024 if hard == resource.RLIM_INFINITY else min(hard, slots + 1024)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))

_Queue = asyncio.Queue[list[LogEntry] | BaseException | None]


def _cost(entries: list[LogEntry]) -> int:
    return sum(len(e.text) + _ENTRY_COST for e in entries)


class _Budget:
    """What one tail's readers have queued: a reader waits while it is past ``QUEUED_CHARS``
    (one batch always goes), until the consumer takes some (or the tail ends: cancelled)."""

    def __init__(self, limit: int = QUEUED_CHARS) -> None:
        self._freed = asyncio.Event()
        self._used = 0
        self._limit = limit

    async def take(self, n: int) -> None:
        while self._used and self._used + n > self._limit:
            self._freed.clear()
            await self._freed.wait()
        self._used += n

    def charge(self, entries: list[LogEntry]) -> list[LogEntry]:
        """Counts what is queued without waiting (a note)."""
        self._used += _cost(entries)
        return entries

    def give(self, n: int) -> None:
        self._used -= n
        self._freed.set()


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
    tasks: list[asyncio.Future[None]] = []
    held: list[list[LogEntry] | BaseException | None] = []  # a reader's end met while coalescing
    try:
        budget = _Budget()
        # A follow's readers were counted by reserve(); a read's wait for a slot of their own
        # (a wave of this tail's, then the process's).
        gates = () if query.follow else (asyncio.Semaphore(TAIL_READS), readers.reads)
        tasks.extend(asyncio.ensure_future(_tail_one(c, job, r, index, cname, query, queue,
                                                     budget, gates))
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


def _params(container: str, query: LogQuery, after_ns: int | None = None) -> dict[str, str]:
    """The log request's parameters; ``after_ns``: resuming a follow after the line of that time
    (every line since, whatever ``tail_lines`` said)."""
    params = {"timestamps": "true", "follow": "true" if query.follow else "false"}
    if container:
        params["container"] = container
    if query.tail_lines and after_ns is None:
        params["tailLines"] = str(query.tail_lines)
    since = after_ns if after_ns is not None else query.since_ns
    if since is not None:
        params["sinceSeconds"] = str(max(1, math.ceil(time.time() - since / 1e9) + 1))
    return params


def _may_write(job: TrackedJob, r: Replica) -> bool:
    """Whether the replica's pod may still write: it runs, and its job has not ended."""
    view = job.pods.get(r.pod)
    return job.final is None and view is not None and not view.state.is_terminal()


async def _tail_one(c: KubeCluster, job: TrackedJob, r: Replica, index: int, container: str,
                    query: LogQuery, queue: _Queue, budget: _Budget,
                    gates: tuple[asyncio.Semaphore, ...]) -> None:
    try:
        if not await _started(job, r, index, query, queue, budget):
            return

        resumed: int | None = None  # reading again after a follow's stream ended early: its last line's time
        skip = 0  # resuming: the lines of that very time sent already
        last: int | None = None  # the newest line's time sent, and how many lines of it
        at_last = 0

        async def put(lines: list[tuple[int | None, str]]) -> None:
            nonlocal last, at_last, skip
            if resumed is not None:  # the lines read before come again (sinceSeconds is whole seconds)
                kept: list[tuple[int | None, str]] = []
                for ns, text in lines:
                    if ns is None or ns < resumed:
                        continue
                    if ns == resumed and skip:
                        skip -= 1
                        continue
                    kept.append((ns, text))
                lines = kept
            if entries := _entries(r.role, index, lines, query):
                await budget.take(_cost(entries))
                queue.put_nowait(entries)
            for ns, _ in lines:
                if ns is not None and (last is None or ns > last):
                    last, at_last = ns, 1
                elif ns is not None and ns == last:
                    at_last += 1

        async with contextlib.AsyncExitStack() as slots:
            for gate in gates:
                await slots.enter_async_context(gate)
            wait = RESUME_SECONDS
            while True:
                before = last
                try:
                    await c.api.budget.acquire_async()
                    metrics.backend_call("kubernetes", "read_namespaced_pod_log")
                    resp = await c.api.logs.open(
                        c.namespace, r.pod, _params(container, query, resumed),
                        read_timeout=FOLLOW_READ_TIMEOUT if query.follow else c.api.timeout)
                except (HttpError, aiohttp.ClientError, TimeoutError) as e:
                    if status_of(e) not in (400, 404):
                        raise api_error(e, f"reading the log of {r.pod}") from None
                    if resumed is None:  # resuming, the pod went away meanwhile: its log has ended
                        await queue.put(budget.charge(_note(r, index,
                                                            f"no log for pod {r.pod} ({status_text(e)})")))
                    return
                try:
                    pieces = _Pieces()
                    async for chunk in resp.content.iter_any():
                        await put(pieces.feed(chunk))
                    if not (query.follow and _may_write(job, r)):
                        await put(pieces.end())
                    # (else the stream ended while the pod writes on: a line it cut is read again,
                    # whole, by the resumed request; sent now, the rest of it was skipped as sent)
                except (aiohttp.ClientError, TimeoutError) as e:
                    raise api_error(e, f"reading the log of {r.pod}") from None
                finally:  # read to its end: the connection may serve another; else (a cancel) closed
                    resp.release() if resp.content.at_eof() else resp.close()
                if not query.follow or not _may_write(job, r):
                    return
                # The stream ended while the pod runs (the API server lost its kubelet): read on
                # from the last line, not end the follow as if the job had.
                wait = RESUME_SECONDS if last != before else wait  # it read on a while: cut afresh
                await asyncio.sleep(wait)
                wait = min(wait * 2, RESUME_MAX_SECONDS)
                resumed, skip = last, at_last  # None: nothing read yet, so the first request's again
    except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
        queue.put_nowait(e)
    finally:
        queue.put_nowait(None)
