"""``ObservationHub``: in-process fan-out of job observation changes.

A driver publishes each change once (``publish``); every watcher of that
cluster gets it. ``subscribe`` takes the snapshot and registers the
subscriber with no ``await`` in between, so no change falls between the
snapshot and the stream. A subscriber that falls ``max_pending`` events
behind is ended with ``Unavailable`` (reason ``WATCH_OVERFLOW``); it
reconnects and gets a fresh snapshot.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable, Iterable

from dlsched.errors import DlschedError, Unavailable
from drivers.common.base import JobObservation, WatchEvent


class _Subscriber:
    def __init__(self, max_pending: int) -> None:
        self.items: collections.deque[JobObservation] = collections.deque()
        self.max_pending = max_pending
        self.error: DlschedError | None = None
        self.wakeup = asyncio.Event()

    def push(self, obs: JobObservation) -> None:
        if self.error is not None:
            return
        if len(self.items) >= self.max_pending:
            self.items.clear()
            self.error = Unavailable("watcher fell too far behind; reconnect",
                                     reason="WATCH_OVERFLOW")
        else:
            self.items.append(obs)
        self.wakeup.set()

    def fail(self, err: DlschedError) -> None:
        self.error = err
        self.wakeup.set()


class ObservationHub:
    """Fans observation changes out to the watchers of each cluster."""

    def __init__(self, max_pending: int = 10_000) -> None:
        self._subs: dict[str, set[_Subscriber]] = collections.defaultdict(set)
        self._max_pending = max_pending

    def publish(self, cluster: str, obs: JobObservation) -> None:
        for sub in list(self._subs.get(cluster, ())):
            sub.push(obs)

    def close_cluster(self, cluster: str, err: DlschedError) -> None:
        """End every watch of ``cluster`` with ``err`` (e.g. the cluster was removed)."""
        for sub in list(self._subs.get(cluster, ())):
            sub.fail(err)

    def subscriber_count(self, cluster: str) -> int:
        return len(self._subs.get(cluster, ()))

    async def subscribe(self, cluster: str,
                        snapshot: Callable[[], Iterable[JobObservation]]) -> AsyncIterator[WatchEvent]:
        sub = _Subscriber(self._max_pending)
        self._subs[cluster].add(sub)
        try:
            current = list(snapshot())  # same step as the registration: no gap
            for obs in current:
                yield WatchEvent(observation=obs)
            yield WatchEvent(snapshot_complete=True)
            while True:
                while sub.items:
                    yield WatchEvent(observation=sub.items.popleft())
                if sub.error is not None:
                    raise sub.error
                sub.wakeup.clear()
                if not sub.items and sub.error is None:
                    await sub.wakeup.wait()
        finally:
            subs = self._subs.get(cluster)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    self._subs.pop(cluster, None)
