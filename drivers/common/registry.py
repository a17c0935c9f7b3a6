"""``ClusterRegistry``: the clusters a driver serves, once for every backend.

Every driver keeps one record per configured cluster (a backend's
connection, poller, tracked jobs). The registry owns what is the same for
all of them:

- look-up: ``require(cluster)`` raises ``ClusterNotConfigured``;
- reconfiguration: ``configure(name, build, carry_over=..., drop=...)``
  builds the new record, copies the DECLARED per-cluster state (the
  attribute names in ``carry_over``: what was observed, never the
  connection) from the old record, drops the old one and installs the new;
- removal: ``remove(cluster, drop=...)`` drops the record and ends every
  watch of the cluster with ``ClusterNotConfigured``;
- watch: ``watch(cluster, snapshot)`` is the WatchJobObservations stream
  over the driver's ``ObservationHub`` (snapshot, marker, changes).

It also names the error and the reasons every backend shares:
``BackendUnavailable`` (UNAVAILABLE, reason ``BACKEND_UNAVAILABLE``) and the
observation reasons ``STOP_REQUESTED``, ``BACKEND_STALE``, ``UNKNOWN``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Generic, TypeVar

from dlsched.errors import Unavailable
from drivers.common.base import ClusterNotConfigured, JobObservation, WatchEvent
from drivers.common.hub import ObservationHub

#: a stop was asked for and the backend has not confirmed the end yet
STOP_REQUESTED = "StopRequested"
#: the backend has not answered; the job keeps its last known state
BACKEND_STALE = "BackendStale"
#: a backend state the driver's state map does not know
UNKNOWN = "Unknown"
#: FAILED: the backend lost the attempt before any of its processes started (it provably never
#: ran); JobManager launches the job again as a new attempt (driver_service.proto)
LOST_BEFORE_START = "LostBeforeStart"


class BackendUnavailable(Unavailable):
    """The backend (login node, API server, Ray head) cannot be reached or refused for now; retry later."""

    reason = "BACKEND_UNAVAILABLE"


C = TypeVar("C")

async def _call(drop: Callable[[C], object] | None, record: C) -> None:
    if drop is None:
        return
    out = drop(record)
    if inspect.isawaitable(out):
        await out


class ClusterRegistry(Generic[C]):
    """The configured clusters of one driver, by name."""

    def __init__(self, hub: ObservationHub) -> None:
        self._hub = hub
        self._records: dict[str, C] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        # cluster -> when each watch open now got past its snapshot
        self._observed: dict[str, list[float]] = {}

    def observed_since(self, cluster: str) -> float | None:
        """When (``time.monotonic``) the newest WatchJobObservations of ``cluster``
        open now got past its snapshot, None when none is open: a JobManager
        that owns the cluster keeps one open and, right after its snapshot, asks
        for every launched job it has that the snapshot lacked (which adopts
        it). A job no such watch asked for in a while is none of JobManager's.
        The newest: a new owner's watch may open while its predecessor's, dead,
        still counts (until keepalive finds it)."""
        starts = self._observed.get(cluster)
        return max(starts) if starts else None

    def require(self, cluster: str) -> C:
        """The cluster's record; ``ClusterNotConfigured`` when there is none."""
        c = self._records.get(cluster)
        if c is None:
            raise ClusterNotConfigured(cluster)
        return c

    def get(self, cluster: str) -> C | None:
        return self._records.get(cluster)

    def __contains__(self, cluster: object) -> bool:
        return cluster in self._records

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._records))

    def values(self) -> list[C]:
        return list(self._records.values())

    def clear(self) -> None:
        self._records.clear()

    def lock(self, name: str) -> asyncio.Lock:
        """The cluster's configuration lock: one ConfigureCluster or removal at a time (an old
        ClusterManager leader resumed from SIGSTOP may configure beside the new one)."""
        return self._locks.setdefault(name, asyncio.Lock())

    async def configure(self, name: str, build: Callable[[C | None], Awaitable[C] | C], *,
                        carry_over: Sequence[str] = (),
                        drop: Callable[[C], object] | None = None) -> C:
        """Install the record ``build(old)`` makes for ``name`` (the caller holds ``lock(name)``).

        The attributes named in ``carry_over`` go from the old record to the
        new one, the new one is installed, then the old one is dropped
        (``drop``), shielded: a cancelled call never leaves a dropped record
        installed. ``build`` may refuse (raise): nothing changes then.
        """
        old = self._records.get(name)
        new = build(old)
        if inspect.isawaitable(new):
            new = await new
        if old is not None:
            for attr in carry_over:
                setattr(new, attr, getattr(old, attr))
        self._records[name] = new
        if old is not None:
            await asyncio.shield(_call(drop, old))
        return new

    async def remove(self, cluster: str, *, drop: Callable[[C], object] | None = None) -> None:
        """Forget the cluster (idempotent): drop its record, end its watches."""
        async with self.lock(cluster):
            c = self._records.pop(cluster, None)
            if c is not None:
                self._hub.close_cluster(cluster, ClusterNotConfigured(cluster))
                await asyncio.shield(_call(drop, c))

    async def watch(self, cluster: str, snapshot: Callable[[C], Iterable[JobObservation]], *,
                    ready: Callable[[C], Awaitable[object]] | None = None) -> AsyncIterator[WatchEvent]:
        """WatchJobObservations for ``cluster``: the snapshot, its marker, then every change.

        ``ready`` (if given) is awaited before the snapshot is taken, e.g.
        the backend's first poll.
        """
        c = self.require(cluster)
        if ready is not None:
            await ready(c)
        counted: float | None = None  # when this watch got past its snapshot
        try:
            async with contextlib.aclosing(self._hub.subscribe(cluster, lambda: snapshot(c))) as events:  # type: ignore[type-var]
                async for ev in events:
                    yield ev
                    if ev.snapshot_complete and counted is None:
                        counted = time.monotonic()
                        self._observed.setdefault(cluster, []).append(counted)
        finally:
            if counted is not None:
                starts = self._observed[cluster]
                starts.remove(counted)
                if not starts:
                    del self._observed[cluster]
