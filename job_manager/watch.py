"""The watch hub: ONE etcd prefix watch on ``jobs/`` per JobManager process.

Each event is applied to the watch cache (``cache.py``) first, then goes to
a ring buffer of encoded events bounded by bytes (``--watch-buffer-bytes``,
and optionally by count, ``--watch-buffer``) and to one bounded queue per
subscriber. Every event with a revision above ``horizon`` is in the buffer,
so a resume token T (an etcd revision) can be honoured exactly when T >=
horizon: the buffered events after T are replayed, then live ones, with no
duplicate and no gap. An older token raises ``WatchTokenExpired``.

At start the cache is loaded (paged, at one revision R) and the etcd watch
begins ``history`` revisions before R (or at the compaction revision), so
tokens a previous JobManager process issued still resume after a restart.
The watch asks etcd for fragmented responses, so a burst of large events
never makes a message past the client's receive limit. When etcd compacted
revisions the watch had not seen yet, the cache is loaded again and every
subscriber ends with ``WatchTokenExpired`` (they re-list).

A subscriber whose queue overflows (a client that reads too slowly) is ended
with UNAVAILABLE, reason ``WATCH_SUBSCRIBER_LAGGING``: it reconnects with its
last token and resumes from the buffer while the buffer still covers it.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
from typing import TYPE_CHECKING

import aetcd
import aetcd.exceptions
import grpc
from aetcd import rpc

from dlsched.errors import DlschedError, InvalidArgument, Unavailable, WatchTokenExpired
from dlsched.kit import tokens
from job_manager.convert import job_from_bytes
from job_manager.domain.model import Job

if TYPE_CHECKING:
    from job_manager.cache import JobCache
    from job_manager.store import JobStore

log = logging.getLogger("job_manager.watch")

_TOKEN_PREFIX = "j1:"


def encode_token(revision: int) -> str:
    return tokens.encode(f"{_TOKEN_PREFIX}{revision}")


def decode_token(token: str, field: str = "resume_token") -> int:
    try:
        raw = tokens.decode(token) or ""
        if not raw.startswith(_TOKEN_PREFIX):
            raise ValueError(raw)
        rev = int(raw[len(_TOKEN_PREFIX):])
        if rev < 0:
            raise ValueError(raw)
        return rev
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidArgument.for_field(field, "not a resume token this server issued") from e


class EventType(enum.Enum):
    CREATED = "CREATED"
    UPDATED = "UPDATED"
    DELETED = "DELETED"


#: what one buffered event costs beyond its bytes (the object, the deque slot)
EVENT_OVERHEAD = 160


class JobEvent:
    """One job event; the job is decoded from ``data`` once, when first asked for."""

    __slots__ = ("_job", "data", "job_id", "job_revision", "revision", "type")

    def __init__(self, revision: int, type: EventType, job_id: str, data: bytes,
                 job_revision: int) -> None:
        self.revision = revision
        self.type = type
        self.job_id = job_id
        self.data = data  # the job as stored (DELETED: as it was last)
        self.job_revision = job_revision  # its etag's revision
        self._job: Job | None = None

    @property
    def job(self) -> Job:
        if self._job is None:
            job = job_from_bytes(self.data, self.job_revision)
            if not job.id:
                job.id = self.job_id
            self._job = job
        return self._job

    @property
    def size(self) -> int:
        return len(self.data) + len(self.job_id) + EVENT_OVERHEAD

    def compact(self) -> JobEvent:
        """This event without its decoded job (what the buffer keeps)."""
        return JobEvent(self.revision, self.type, self.job_id, self.data, self.job_revision)


class Subscription:
    """One subscriber's bounded queue of events with revision > ``after``."""

    def __init__(self, hub: WatchHub, after: int, limit: int) -> None:
        self._hub = hub
        self.after = after
        self._limit = limit
        self._items: collections.deque[JobEvent] = collections.deque()
        self._wake = asyncio.Event()
        self._error: DlschedError | None = None

    def _push(self, ev: JobEvent) -> None:
        if self._error is not None or ev.revision <= self.after:
            return
        if len(self._items) >= self._limit:
            self._fail(Unavailable("watch subscriber fell behind; resume with the last token",
                                   reason="WATCH_SUBSCRIBER_LAGGING"))
            return
        self._items.append(ev)
        self._wake.set()

    def _fail(self, err: DlschedError) -> None:
        if self._error is None:
            self._error = err
            self._items.clear()
            self._wake.set()

    def skip_to(self, revision: int) -> None:
        """Drop queued events at or below ``revision`` and ignore later ones too."""
        self.after = max(self.after, revision)
        while self._items and self._items[0].revision <= self.after:
            self._items.popleft()

    async def next(self) -> JobEvent:
        while True:
            if self._items:
                ev = self._items.popleft()
                if ev.revision > self.after:
                    self.after = ev.revision
                    return ev
                continue
            if self._error is not None:
                raise self._error
            self._wake.clear()
            await self._wake.wait()

    def close(self) -> None:
        self._hub._subs.discard(self)


class WatchHub:
    def __init__(self, client: aetcd.Client, prefix: str, *, buffer_size: int = 0,
                 buffer_bytes: int = 64 << 20, history: int = 5000,
                 subscriber_limit: int | None = None, cache: JobCache | None = None,
                 store: JobStore | None = None) -> None:
        if not prefix.endswith("/"):
            prefix += "/"
        if (cache is None) != (store is None):
            raise ValueError("a cache needs the store it loads from")
        self._client = client
        self._key = f"{prefix}jobs/".encode()
        self._buffer: collections.deque[JobEvent] = collections.deque()
        self._buffer_size = buffer_size  # events; 0: bounded by bytes only
        self._buffer_bytes = max(1, buffer_bytes)
        self.buffered_bytes = 0
        self._history = history
        self._sub_limit = subscriber_limit or max(10000, buffer_size)
        self.cache, self._store = cache, store
        self._subs: set[Subscription] = set()
        self.horizon = 0
        self.last_revision = 0
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._start_error: BaseException | None = None

    async def _revision(self) -> int:
        """etcd's current revision (one single-key read)."""
        await self._client.connect()
        res = await self._client.kvstub.Range(rpc.RangeRequest(key=self._key, keys_only=True),
                                              metadata=self._client.metadata)
        return int(res.header.revision)

    async def start(self) -> None:
        try:
            if self.cache is not None and self._store is not None:
                current = await self.cache.load(self._store)
            else:
                current = await self._revision()
        except (aetcd.exceptions.ClientError, grpc.RpcError, OSError) as e:
            raise Unavailable(f"etcd: {e}", reason="STORE_UNAVAILABLE") from e
        start = max(1, current - self._history)
        self.horizon = start - 1
        self.last_revision = start - 1
        self._task = asyncio.create_task(self._run(start), name="job-watch-hub")
        await asyncio.wait({self._task, asyncio.ensure_future(self._ready.wait())},
                           timeout=15, return_when=asyncio.FIRST_COMPLETED)
        if not self._ready.is_set():
            raise Unavailable("etcd watch did not start", reason="STORE_UNAVAILABLE")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        for s in list(self._subs):
            s._fail(Unavailable("server shutting down", reason="SHUTTING_DOWN"))

    def subscribe(self, after: int | None = None) -> Subscription:
        """A subscription to events with revision > ``after``.

        With ``after`` (a resume token's revision) the buffered events after it
        come first; raises WatchTokenExpired when the buffer no longer covers it.
        Without, every event from now on is queued (the caller then reads a
        snapshot at revision R, from the cache with no await in between, and
        calls ``skip_to(R)``).
        """
        if after is not None and after < self.horizon:
            raise WatchTokenExpired(
                f"resume token (revision {after}) is older than the watch buffer "
                f"(horizon {self.horizon}); re-list", metadata={"horizon": str(self.horizon)})
        replay = [ev for ev in self._buffer if ev.revision > after] if after is not None else []
        sub = Subscription(self, after if after is not None else 0, self._sub_limit + len(replay))
        for ev in replay:
            sub._push(ev)
        self._subs.add(sub)
        return sub

    def _on_event(self, ev: aetcd.rtypes.Event) -> None:
        rev = int(ev.kv.mod_revision)
        job_id = ev.kv.key[len(self._key):].decode()
        deleted = ev.kind == "DELETE"
        if self.cache is not None:
            self.cache.apply(rev, job_id, None if deleted else ev.kv.value)
        if rev <= self.last_revision:
            return
        if deleted:
            prev = ev.prev_kv
            je = JobEvent(rev, EventType.DELETED, job_id, prev.value if prev is not None else b"",
                          int(prev.mod_revision) if prev is not None else 0)
        else:
            etype = EventType.CREATED if ev.kv.version == 1 else EventType.UPDATED
            je = JobEvent(rev, etype, job_id, ev.kv.value, rev)
        kept = je.compact()
        self._buffer.append(kept)
        self.buffered_bytes += kept.size
        while len(self._buffer) > 1 and (
                self.buffered_bytes > self._buffer_bytes
                or (self._buffer_size and len(self._buffer) > self._buffer_size)):
            old = self._buffer.popleft()
            self.buffered_bytes -= old.size
            self.horizon = old.revision
        self.last_revision = rev
        for s in list(self._subs):
            s._push(je)

    def _expire_all(self, upto: int, why: str) -> None:
        """Events up to ``upto`` are lost to the buffer: no older token resumes,
        and live subscribers have a gap (they re-list)."""
        self._buffer.clear()
        self.buffered_bytes = 0
        self.horizon = max(self.horizon, upto)
        self.last_revision = max(self.last_revision, upto)
        if self._ready.is_set():
            for s in list(self._subs):
                s._fail(WatchTokenExpired(why))

    async def _past_oversized(self, next_rev: int) -> int:
        """A watch message was over the receive limit (an etcd that does not
        fragment): skip what the cache already holds, or load it again."""
        assert self.cache is not None and self._store is not None
        if next_rev <= self.cache.revision:  # the history replay: give up the history
            log.warning("job watch: history %d..%d too large; older tokens expire",
                        next_rev, self.cache.revision)
            self._buffer.clear()
            self.buffered_bytes = 0
            self.horizon = self.last_revision = max(self.last_revision, self.cache.revision)
            for s in list(self._subs):
                if s.after < self.horizon:
                    s._fail(WatchTokenExpired("the watch history was dropped; re-list"))
            return self.cache.revision + 1
        try:
            rev = await self.cache.load(self._store)
        except DlschedError as le:
            log.warning("job watch: reloading the cache: %s", le)
            return next_rev
        self._expire_all(rev, "the job cache was reloaded; re-list")
        return rev + 1

    async def _run(self, start: int) -> None:
        next_rev = start
        delay = 0.2
        while True:
            try:
                watch = await self._client.watch_prefix(self._key, start_revision=next_rev,
                                                        prev_kv=True, fragment=True)
                self._ready.set()
                delay = 0.2
                async for ev in watch:
                    self._on_event(ev)
                    next_rev = max(next_rev, int(ev.kv.mod_revision) + 1)
            except asyncio.CancelledError:
                raise
            except aetcd.exceptions.RevisionCompactedError as e:
                compacted = int(e.compacted_revision)
                lost_to = compacted - 1
                if lost_to >= next_rev:
                    # Events in [next_rev, compacted) are gone: no token below
                    # can be honoured, and live subscribers have a gap.
                    log.warning("job watch: revisions %d..%d compacted away", next_rev, lost_to)
                    self._expire_all(lost_to, "events were compacted; re-list")
                next_rev = compacted
                if self.cache is not None and self._store is not None and compacted > self.cache.revision + 1:
                    # The cache missed events: read every job again, then go on from there.
                    try:
                        rev = await self.cache.load(self._store)
                    except DlschedError as le:
                        log.warning("job watch: reloading the cache: %s", le)
                    else:
                        log.warning("job watch: cache reloaded at revision %d", rev)
                        self._expire_all(rev, "the job cache was reloaded; re-list")
                        next_rev = rev + 1
                        continue
                else:
                    continue
            except Exception as e:  # noqa: BLE001 - reconnect on any etcd trouble
                log.warning("job watch interrupted (%s); reconnecting from revision %d", e, next_rev)
                if _too_large(e) and self.cache is not None and self._store is not None:
                    next_rev = await self._past_oversized(next_rev)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


def _too_large(e: BaseException) -> bool:
    """Whether ``e`` (or its cause) is gRPC's receive limit."""
    while e is not None:
        if isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return True
        e = e.__cause__  # type: ignore[assignment]
    return False
