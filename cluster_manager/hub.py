"""The watch hub: one etcd prefix watch on ``clusters/`` per process, a bounded
buffer of recent events, and subscriber queues fed from it.

Resume tokens are opaque: base64url of ``c1:<rev>`` (after the change at etcd
revision ``rev``) or ``s1:<rev>`` (inside a snapshot read at ``rev``; resuming
from one starts a fresh snapshot, since a half-sent snapshot cannot be
continued). The buffer holds the last ``buffer_size`` events; every event after
``horizon`` is in it, so a token at or after the horizon resumes with no gap
and no duplicate, and an older one raises WatchTokenExpired. A token that does
not decode is InvalidArgument on ``resume_token``.

A watchdog checks the watch every ``stall_seconds`` (30 s): a cluster record
changed at a revision the watch has not delivered by the next check (a watch
that stopped delivering without an error) makes the hub watch again from the
last revision it published. Monitors write the heartbeat of each cluster whose
driver answers every 30 s, so a silent watch is caught within about a minute
while one does; a missed delete alone (no newer record) waits for the next
change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass

from dlsched.errors import DlschedError, InvalidArgument, Unavailable, WatchTokenExpired
from dlsched.kit import tokens
from dlsched.kit.parse import decimal

from .store import ClusterStore, StoreEvent

log = logging.getLogger("cluster_manager.hub")


@dataclass(frozen=True)
class ResumeToken:
    revision: int
    in_snapshot: bool = False

    def encode(self) -> str:
        raw = f"{'s1' if self.in_snapshot else 'c1'}:{self.revision}"
        return tokens.encode(raw)

    @staticmethod
    def decode(token: str) -> ResumeToken:
        kind, _, rev = (tokens.decode(token) or "").partition(":")
        if kind in ("c1", "s1") and decimal(rev):
            return ResumeToken(int(rev), kind == "s1")
        raise InvalidArgument.for_field("resume_token", "not a resume_token of WatchClusters")


class Subscription:
    """One subscriber's queue. Events at or before ``skip_through`` are dropped
    (the subscriber already has them from its snapshot)."""

    def __init__(self, hub: WatchHub, maxsize: int) -> None:
        self._hub = hub
        self._q: asyncio.Queue[StoreEvent | DlschedError] = asyncio.Queue()
        self._max = maxsize
        self.skip_through = 0
        self._failed = False

    def _offer(self, item: StoreEvent | DlschedError) -> None:
        if self._failed:
            return
        if isinstance(item, DlschedError):
            self._failed = True
        elif self._q.qsize() >= self._max:
            self._failed = True
            item = Unavailable("the watch fell behind; reconnect with the last resume_token")
        self._q.put_nowait(item)

    async def next(self) -> StoreEvent:
        while True:
            item = await self._q.get()
            if isinstance(item, DlschedError):
                raise item
            if item.revision > self.skip_through:
                return item

    def close(self) -> None:
        self._hub._subs.discard(self)


class WatchHub:
    def __init__(self, store: ClusterStore, buffer_size: int = 1024,
                 subscriber_queue: int = 10_000, retry_seconds: float = 0.5,
                 stall_seconds: float = 30.0) -> None:
        self._store = store
        self._buf: deque[StoreEvent] = deque()
        self._size = max(1, buffer_size)
        self._subq = subscriber_queue
        self._retry = retry_seconds
        self._subs: set[Subscription] = set()
        self.revision = 0  # last etcd revision the hub has seen through
        self.horizon = 0  # every event after this revision is in the buffer
        self._task: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._stall = stall_seconds
        self._started = asyncio.Event()
        #: times the watchdog opened the watch again
        self.reopens = 0

    async def start(self) -> None:
        rev = await self._store.current_revision()
        self.revision = self.horizon = rev
        self._task = asyncio.create_task(self._run(), name="watch-hub")
        self._watchdog = asyncio.create_task(self._watch_stalls(), name="watch-hub-watchdog")

    async def close(self) -> None:
        # The watchdog first: it may be replacing the watch task.
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for s in list(self._subs):
            s._offer(Unavailable("the server is shutting down; reconnect"))

    async def subscribe(self, after: ResumeToken | None = None) -> Subscription:
        """A new subscription. With ``after``, it starts with the buffered events
        after that token (WatchTokenExpired when they are no longer buffered)."""
        if after is not None and after.revision > self.revision:
            # The client may have read a snapshot at a revision the hub has not
            # reached yet; a revision etcd never had is a foreign token.
            if after.revision > await self._store.current_revision():
                raise WatchTokenExpired("resume_token is from another etcd; re-list")
        sub = Subscription(self, self._subq)
        if after is not None:
            if after.revision < self.horizon:
                raise WatchTokenExpired(
                    f"resume_token is older than the watch buffer (revision {after.revision} < "
                    f"{self.horizon}); re-list")
            sub.skip_through = after.revision
            for ev in self._buf:
                if ev.revision > after.revision:
                    sub._offer(ev)
        self._subs.add(sub)
        return sub

    def _publish(self, ev: StoreEvent) -> None:
        self._buf.append(ev)
        while len(self._buf) > self._size:
            self.horizon = self._buf.popleft().revision
        self.revision = ev.revision
        for s in list(self._subs):
            s._offer(ev)

    def _reset(self, rev: int, err: DlschedError) -> None:
        self._buf.clear()
        self.revision = self.horizon = rev
        for s in list(self._subs):
            s._offer(err)

    async def _watch_stalls(self) -> None:
        """Every ``stall_seconds``: a change the watch had not delivered at the
        previous check and still has not opens the watch again."""
        owed = 0  # a change seen at the previous check that the watch had not delivered
        while True:
            await asyncio.sleep(self._stall)
            if owed > self.revision and self._task is not None:
                log.warning("cluster watch: revision %d not delivered in %.0f s; watching again "
                            "from revision %d", owed, self._stall, self.revision + 1)
                self.reopens += 1
                old = self._task
                old.cancel()
                await asyncio.wait({old})  # its end, not ours: a cancel of this task still lands
                self._task = asyncio.create_task(self._run(), name="watch-hub")
                owed = 0
                continue
            try:
                owed = await self._store.last_change()
            except DlschedError as e:
                log.debug("cluster watch check: %s", e.reason)
                owed = 0

    async def _run(self) -> None:
        while True:
            try:
                async for ev in self._store.watch(self.revision + 1):
                    if ev.revision > self.revision:
                        self._publish(ev)
            except WatchTokenExpired as e:
                log.warning("cluster watch history compacted; subscribers must re-list")
                try:
                    self._reset(await self._store.current_revision(), e)
                except DlschedError:
                    await asyncio.sleep(self._retry)
            except DlschedError as e:
                log.warning("cluster watch interrupted (%s); resuming at revision %d",
                            e.reason, self.revision + 1)
                await asyncio.sleep(self._retry)
