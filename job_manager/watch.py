"""The watch hub: ONE etcd prefix watch on ``jobs/`` per JobManager process.

Events feed a bounded ring buffer (``--watch-buffer``) and one bounded queue
per subscriber. Every event with a revision above ``horizon`` is in the
buffer, so a resume token T (an etcd revision) can be honoured exactly when
T >= horizon: the buffered events after T are replayed, then live ones, with
no duplicate and no gap. An older token raises ``WatchTokenExpired``.

At start the etcd watch begins ``history`` revisions back (or at the
compaction revision), so tokens a previous JobManager process issued still
resume after a restart.

A subscriber whose queue overflows (a client that reads too slowly) is ended
with UNAVAILABLE, reason ``WATCH_SUBSCRIBER_LAGGING``: it reconnects with its
last token and resumes from the buffer while the buffer still covers it.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
from dataclasses import dataclass

import aetcd
import aetcd.exceptions

from dlsched.errors import DlschedError, InvalidArgument, Unavailable, WatchTokenExpired
from dlsched.kit import tokens
from job_manager.convert import job_from_bytes
from job_manager.domain.model import Job

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


@dataclass(frozen=True)
class JobEvent:
    revision: int
    type: EventType
    job: Job


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
    def __init__(self, client: aetcd.Client, prefix: str, *, buffer_size: int = 10000,
                 history: int = 5000, subscriber_limit: int | None = None) -> None:
        if not prefix.endswith("/"):
            prefix += "/"
        self._client = client
        self._key = f"{prefix}jobs/".encode()
        self._buffer: collections.deque[JobEvent] = collections.deque()
        self._buffer_size = max(1, buffer_size)
        self._history = history
        self._sub_limit = subscriber_limit or max(1024, buffer_size)
        self._subs: set[Subscription] = set()
        self.horizon = 0
        self.last_revision = 0
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._start_error: BaseException | None = None

    async def start(self) -> None:
        try:
            res = await self._client.get_prefix(self._key, keys_only=True)
            current = int(res.header.revision)
        except (aetcd.exceptions.ClientError, OSError) as e:
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
        snapshot at revision R and calls ``skip_to(R)``).
        """
        if after is not None and after < self.horizon:
            raise WatchTokenExpired(
                f"resume token (revision {after}) is older than the watch buffer "
                f"(horizon {self.horizon}); re-list", metadata={"horizon": str(self.horizon)})
        sub = Subscription(self, after if after is not None else 0, self._sub_limit + self._buffer_size)
        if after is not None:
            for ev in self._buffer:
                sub._push(ev)
        self._subs.add(sub)
        return sub

    def _on_event(self, ev: aetcd.rtypes.Event) -> None:
        rev = int(ev.kv.mod_revision)
        if rev <= self.last_revision:
            return
        if ev.kind == "DELETE":
            value = ev.prev_kv.value if ev.prev_kv is not None else b""
            job = job_from_bytes(value, ev.prev_kv.mod_revision if ev.prev_kv else 0)
            if not job.id:
                job.id = ev.kv.key[len(self._key):].decode()
            etype = EventType.DELETED
        else:
            job = job_from_bytes(ev.kv.value, rev)
            etype = EventType.CREATED if ev.kv.version == 1 else EventType.UPDATED
        je = JobEvent(rev, etype, job)
        self._buffer.append(je)
        while len(self._buffer) > self._buffer_size:
            self.horizon = self._buffer.popleft().revision
        self.last_revision = rev
        for s in list(self._subs):
            s._push(je)

    async def _run(self, start: int) -> None:
        next_rev = start
        delay = 0.2
        while True:
            try:
                watch = await self._client.watch_prefix(self._key, start_revision=next_rev,
                                                        prev_kv=True)
                self._ready.set()
                delay = 0.2
                async for ev in watch:
                    self._on_event(ev)
                    next_rev = max(next_rev, int(ev.kv.mod_revision) + 1)
            except asyncio.CancelledError:
                raise
            except aetcd.exceptions.RevisionCompactedError as e:
                lost_to = int(e.compacted_revision) - 1
                if lost_to >= next_rev:
                    # Events in [next_rev, compacted) are gone: no token below
                    # can be honoured, and live subscribers have a gap.
                    log.warning("job watch: revisions %d..%d compacted away", next_rev, lost_to)
                    self._buffer.clear()
                    self.horizon = max(self.horizon, lost_to)
                    self.last_revision = max(self.last_revision, lost_to)
                    if self._ready.is_set():
                        for s in list(self._subs):
                            s._fail(WatchTokenExpired("events were compacted; re-list"))
                next_rev = int(e.compacted_revision)
                continue
            except Exception as e:  # noqa: BLE001 - reconnect on any etcd trouble
                log.warning("job watch interrupted (%s); reconnecting from revision %d", e, next_rev)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
