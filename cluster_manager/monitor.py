"""Driver monitoring: one task per registered cluster.

Each task configures its cluster on its driver (address, credentials from
``cluster-credentials/{id}``, options), then asks GetClusterInfo every
interval. A driver that answers CLUSTER_NOT_CONFIGURED (it restarted) is
configured again; one that does not answer makes the cluster
DRIVER_UNAVAILABLE, and it is configured again once it answers. A change of
address, driver address, options or credentials (the credentials key's mod
revision) makes the task configure again.

State, message, capacity and run modes are written to etcd only when they
change (capacity: see ``Capacity.materially_differs``); last_heartbeat_time
alone is refreshed at most every ``heartbeat_interval``, so a steady cluster
makes one watch event per heartbeat interval, not one per poll.

``MonitorManager`` starts and stops the tasks from the watch hub (snapshot,
then CREATED/UPDATED/DELETED), re-listing when its subscription fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from dlsched.errors import DlschedError, StoreUnavailable
from dlsched.kit.metrics import CLUSTERS

from .domain.errors import ClusterNotFound
from .domain.models import Cluster, ClusterState, ClusterType, Observation, observation_changed
from .drivers import DriverClients, is_not_configured, is_unreachable
from .hub import WatchHub
from .store import ClusterStore, EventKind

log = logging.getLogger("cluster_manager.monitor")


def utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class MonitorConfig:
    interval: float = 2.0
    heartbeat_interval: float = 30.0
    store_retry: float = 1.0


class ClusterMonitor:
    def __init__(self, cluster_id: str, store: ClusterStore, drivers: DriverClients,
                 cfg: MonitorConfig, clock: Callable[[], datetime] = utcnow) -> None:
        self.cluster_id = cluster_id
        self._store = store
        self._drivers = drivers
        self._cfg = cfg
        self._clock = clock
        self._wake = asyncio.Event()
        self._configured: tuple[object, ...] | None = None
        self.task = asyncio.create_task(self._run(), name=f"monitor-{cluster_id}")

    def poke(self) -> None:
        self._wake.set()

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)
        self._wake.clear()

    async def _run(self) -> None:
        while True:
            try:
                if not await self._once():
                    return
            except StoreUnavailable:
                await self._sleep(self._cfg.store_retry)
                continue
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a monitor must outlive one bad poll
                log.exception("monitor of clusters/%s failed; retrying", self.cluster_id)
            await self._sleep(self._cfg.interval)

    async def _once(self) -> bool:
        """One poll. False when the cluster is gone."""
        try:
            cluster = await self._store.get(self.cluster_id)
        except ClusterNotFound:
            return False
        creds, creds_rev = await self._store.get_credentials(self.cluster_id)
        fingerprint = (cluster.driver_address, cluster.address,
                       tuple(sorted(cluster.options.items())), creds_rev)
        obs: Observation | None = None
        for _ in range(2):
            try:
                if self._configured != fingerprint:
                    failing = cluster.state in (ClusterState.DRIVER_UNAVAILABLE,
                                                ClusterState.UNREACHABLE)
                    log.log(logging.DEBUG if failing else logging.INFO,
                            "configuring clusters/%s on driver %s", self.cluster_id,
                            cluster.driver_address)
                    obs = await self._drivers.configure(
                        cluster.driver_address, cluster.name, cluster.address, creds,
                        cluster.options, cluster.type)
                    self._configured = fingerprint
                else:
                    obs = await self._drivers.get_info(cluster.driver_address, cluster.name)
                break
            except DlschedError as e:
                self._configured = None
                if is_not_configured(e):
                    log.info("driver %s forgot clusters/%s; configuring again",
                             cluster.driver_address, self.cluster_id)
                    continue
                obs = self._failure(cluster, e)
                break
        del creds
        if obs is not None:
            return await self._publish(cluster, obs)
        return True

    def _failure(self, cluster: Cluster, e: DlschedError) -> Observation:
        """The cluster down. A driver that does not answer keeps what it was last
        seen to run (its capacity too, by ``with_observation``): matching sends
        jobs that fit it there to wait for it when no cluster that is up can
        take them (a driver restarting)."""
        modes = cluster.supported_run_modes
        if is_unreachable(e):
            if cluster.state is not ClusterState.DRIVER_UNAVAILABLE:
                log.warning("driver %s of clusters/%s does not answer: %s %s",
                            cluster.driver_address, self.cluster_id, e.code, e.reason)
            return Observation(ClusterState.DRIVER_UNAVAILABLE,
                               f"driver {cluster.driver_address} does not answer ({e.code})",
                               supported_run_modes=modes)
        if cluster.state is not ClusterState.UNREACHABLE:
            log.warning("driver %s refused clusters/%s: %s %s", cluster.driver_address,
                        self.cluster_id, e.code, e.reason)
        return Observation(ClusterState.UNREACHABLE,
                           f"driver {cluster.driver_address} failed: {e.code} {e.reason}: "
                           f"{e.message}"[:1024])

    async def _publish(self, cluster: Cluster, obs: Observation) -> bool:
        now = self._clock()
        changed = observation_changed(cluster.observation(), obs)
        last = cluster.last_heartbeat_time
        due = obs.driver_answered and (
            last is None or (now - last).total_seconds() >= self._cfg.heartbeat_interval)
        if not changed and not due:
            return True

        def mutate(c: Cluster) -> Cluster:
            out = c.with_observation(obs, now)
            return replace(out, update_time=now) if changed else out

        try:
            await self._store.update(self.cluster_id, mutate)
        except ClusterNotFound:
            return False
        if changed:
            log.info("clusters/%s is %s", self.cluster_id, obs.state.value)
        return True


class MonitorManager:
    """Keeps one ClusterMonitor per registered cluster, following the hub."""

    def __init__(self, hub: WatchHub, store: ClusterStore, drivers: DriverClients,
                 cfg: MonitorConfig, clock: Callable[[], datetime] = utcnow) -> None:
        self._hub = hub
        self._store = store
        self._drivers = drivers
        self._cfg = cfg
        self._clock = clock
        self._monitors: dict[str, ClusterMonitor] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="monitor-manager")

    def _ensure(self, cluster_id: str) -> ClusterMonitor:
        m = self._monitors.get(cluster_id)
        if m is None or m.task.done():
            m = self._monitors[cluster_id] = ClusterMonitor(
                cluster_id, self._store, self._drivers, self._cfg, self._clock)
        return m

    async def stop_monitor(self, cluster_id: str) -> None:
        m = self._monitors.pop(cluster_id, None)
        if m is not None:
            await m.stop()

    async def release(self, cluster: Cluster) -> None:
        """Before a delete: RemoveCluster on its driver, which refuses (FAILED_PRECONDITION
        ``CLUSTER_HAS_JOBS``, raised) while jobs it runs there are unfinished: deleted, they would
        run on, out of every API's reach. A driver that does not answer cannot say: the delete
        goes on (its jobs were out of reach already)."""
        try:
            await self._drivers.remove(cluster.driver_address, cluster.name, if_idle=True)
        except DlschedError as e:
            if e.reason == "CLUSTER_HAS_JOBS":
                raise
            log.info("RemoveCluster of %s on %s failed (%s); deleted all the same", cluster.name,
                     cluster.driver_address, e.reason)

    async def forget(self, cluster: Cluster) -> None:
        """A deleted cluster: stop its monitor, then RemoveCluster on its driver
        (best effort)."""
        await self.stop_monitor(cluster.cluster_id)
        try:
            await self._drivers.remove(cluster.driver_address, cluster.name)
        except DlschedError as e:
            log.info("RemoveCluster of %s on %s failed (%s); ignored", cluster.name,
                     cluster.driver_address, e.reason)

    async def _run(self) -> None:
        while True:
            try:
                sub = await self._hub.subscribe()
                try:
                    clusters, rev = await self._store.list_all()
                    sub.skip_through = rev
                    known = {c.cluster_id: c for c in clusters}
                    _count(known)
                    present = set(known)
                    for cid in list(self._monitors):
                        if cid not in present:
                            await self.stop_monitor(cid)
                    for cid in sorted(present):
                        self._ensure(cid)
                    while True:
                        ev = await sub.next()
                        cid = ev.cluster.cluster_id
                        if ev.kind is EventKind.DELETED:
                            known.pop(cid, None)
                        else:
                            known[cid] = ev.cluster
                        _count(known)
                        if ev.kind is EventKind.DELETED:
                            await self.stop_monitor(cid)
                        elif ev.kind is EventKind.CREATED or cid not in self._monitors:
                            self._ensure(cid)
                        elif ev.prev is None or _config_of(ev.prev) != _config_of(ev.cluster):
                            self._ensure(cid).poke()
                finally:
                    sub.close()
            except DlschedError as e:
                log.info("monitor manager re-lists clusters (%s)", e.reason)
                await asyncio.sleep(self._cfg.store_retry)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for cid in list(self._monitors):
            await self.stop_monitor(cid)
        CLUSTERS.clear()  # a replica that no longer leads reports no cluster counts


def _count(clusters: dict[str, Cluster]) -> None:
    """Set ``dlsched_clusters{type,state}`` from the registry as this process sees it."""
    counts: dict[tuple[ClusterType, ClusterState], int] = {}
    for c in clusters.values():
        counts[(c.type, c.state)] = counts.get((c.type, c.state), 0) + 1
    for t in ClusterType:
        for st in ClusterState:
            if t.name != "UNSPECIFIED" and st.name != "UNSPECIFIED":
                CLUSTERS.labels(t.name, st.name).set(counts.get((t, st), 0))


def _config_of(c: Cluster) -> tuple[object, ...]:
    return (c.address, c.driver_address, tuple(sorted(c.options.items())), c.has_credentials)
