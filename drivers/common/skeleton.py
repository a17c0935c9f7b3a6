"""``BackendDriver``: the public ``Driver`` operations as fixed wrappers over backend hooks.

Modelled on TorchX's scheduler API: the public methods own the rules every
backend shares, and call a few private hooks each backend implements. A
backend package subclasses ``BackendDriver[C]`` (``C``: its per-cluster
record: connection, poller, tracked jobs) and implements the hooks; it does
not override the public methods.

What the wrappers own, once for every backend:

- cluster look-up: every operation on a cluster the driver has not been
  configured with raises ``ClusterNotConfigured`` (``registry``), before any
  hook runs, optional capabilities included;
- configuration: validate (``_validate_config``), keep an unchanged cluster
  as is (``_unchanged``), else build the new record (``_connect``), carry
  the declared per-cluster state over (``carry_over``), drop the old one
  (``_disconnect``), start it (``_activate``) and answer its info;
- launch: the attempt rules and per-job lock of ``LaunchRules`` over the
  ``_known`` and ``_submit`` hooks, run as a DRIVER-OWNED task: a caller
  that goes away (deadline, cancelled RPC, JobManager killed) does not
  cancel a submission half-way; it completes, the backend records it, and
  the caller's retry of the same attempt gets its result (never a job
  killed mid-spawn and reported FAILED without having run);
- cluster info: ``_info`` bounded by ``INFO_BUDGET``, below ClusterManager's
  deadline: a backend that does not answer in time is the cluster slow
  (DEGRADED, with the record's last READY capacity; never answered yet:
  UNREACHABLE), never this driver unresponsive;
- readiness: ``_ready`` (e.g. the first poll of the backend) before launch,
  observe, terminate, cleanup, logs and watch;
- observe: one observation per ref, in order, ``found=False`` for unknown;
- terminate: an unknown job is ``found=False``, an ended one answers its last
  observation, without calling the backend;
- logs and usage: ``UNIMPLEMENTED``/``UNSUPPORTED`` when the backend has no
  hook (after the cluster look-up), the query's role/replica/stream filter
  applied to whatever the backend yields;
- forget: only a job the backend reports ended is handed to ``_forget``
  (JobManager recorded its final state; the driver drops it from memory and
  keeps on disk what logs and usage need); others are left as they are. A
  backend without the hook keeps its jobs until ``cleanup``;
- close: in-flight launches finish (bounded), then every cluster is dropped.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from dlsched import __version__
from dlsched.errors import FailedPrecondition, Unimplemented
from drivers.common.base import (
    ClusterConfig,
    ClusterInfo,
    ClusterState,
    Driver,
    JobObservation,
    JobRef,
    JobSpec,
    JobUsage,
    LaunchResult,
    LogEntry,
    LogQuery,
    NativeSpec,
    RunMode,
    WatchEvent,
)
from drivers.common.hub import ObservationHub
from drivers.common.launches import Known, LaunchRules
from drivers.common.registry import ClusterRegistry

log = logging.getLogger(__name__)

C = TypeVar("C")

#: how long ``close`` waits for launches still in flight
CLOSE_LAUNCH_WAIT_SECONDS = 10.0
#: Seconds GetClusterInfo (and ConfigureCluster's answer) waits for the backend in all
#: (ClusterManager waits 5 s); a backend with finer logic of its own keeps within it.
INFO_BUDGET = 3.5


#: A job of more processes renders in a worker thread (``render_off_loop``).
RENDER_INLINE_PROCESSES = 64
_R = TypeVar("_R")


async def render_off_loop(spec: JobSpec, render: Callable[..., _R], *args: Any, **kw: Any) -> _R:
    """``render(*args, **kw)``: in this thread for a small job, else in a worker thread, so a
    large job's native spec (megabytes for thousands of processes) does not hold the event
    loop, and with it every cluster's calls, while it is built."""
    if sum(max(1, g.replicas) * max(1, g.processes) for g in spec.replica_groups) <= RENDER_INLINE_PROCESSES:
        return render(*args, **kw)
    return await asyncio.to_thread(render, *args, **kw)

class Rendered(Protocol):
    """What a backend's renderer returns: one typed request that submit sends as is."""

    def native_spec(self) -> NativeSpec:
        """The native form shown by a dry-run (sbatch script, manifests, JSON)."""


def filter_entries(entries: Iterable[LogEntry], query: LogQuery) -> list[LogEntry]:
    """The entries a query wants (role, replica index, streams)."""
    return [e for e in entries if query.wants_replica(e.role, e.replica_index) and query.wants_stream(e.stream)]


R = TypeVar("R", bound=Rendered)


class BackendDriver(Driver, Generic[C, R]):
    """A ``Driver`` whose public operations are the kit's; backends implement the hooks.

    ``C`` is the backend's per-cluster record, ``R`` its ``Rendered`` request.
    """

    #: per-cluster attributes a reconfiguration keeps (what was observed, never the connection)
    carry_over: ClassVar[tuple[str, ...]] = ()
    #: whether ``_tail`` / ``_usage`` are implemented
    supports_logs: ClassVar[bool] = False
    supports_usage: ClassVar[bool] = False
    #: what the backend is called in a cluster's message ("the Ray head")
    backend_noun: ClassVar[str] = "the backend"
    #: the bound on ``_info`` (a backend whose own finer bound answers first may widen it)
    info_budget: ClassVar[float] = INFO_BUDGET

    def __init__(self) -> None:
        self.hub = ObservationHub()
        self.clusters: ClusterRegistry[C] = ClusterRegistry(self.hub)
        self.launches = LaunchRules()
        self._last_ready: dict[str, tuple[C, ClusterInfo]] = {}  # per cluster: its record's last READY info

    # ------------------------------------------------------------------ hooks: clusters

    def _validate_config(self, config: ClusterConfig) -> None:  # noqa: B027 - optional hook
        """Refuse a configuration (``InvalidArgument.for_field``) before anything changes."""

    def _unchanged(self, old: C, config: ClusterConfig) -> bool:
        """True when ``config`` would build the same record as ``old`` (it is kept as is)."""
        return False

    @abc.abstractmethod
    async def _connect(self, config: ClusterConfig, old: C | None) -> C:
        """Build the record for ``config`` (may refuse by raising: nothing changes then)."""

    async def _disconnect(self, c: C) -> None:  # noqa: B027 - optional hook
        """Release a record's connections and tasks (bounded: must not hang)."""

    async def _activate(self, name: str, c: C) -> None:  # noqa: B027 - optional hook
        """Start the installed record's poller or informer."""

    @abc.abstractmethod
    async def _info(self, c: C) -> ClusterInfo:
        """Health, capacity and run modes, asked of the backend now."""

    def _modes(self, c: C) -> tuple[RunMode, ...]:
        """The run modes the cluster supports, known without asking the backend (the kit's
        answer for a backend that did not answer in time: ClusterManager keeps what it says)."""
        return ()

    async def _ready(self, c: C) -> None:  # noqa: B027 - optional hook
        """Wait until the record can answer (e.g. its first poll); raise when it cannot."""

    # ------------------------------------------------------------------ hooks: jobs

    @abc.abstractmethod
    async def _prepare(self, c: C, job_id: str, spec: JobSpec, attempt: int, uid: str) -> R:
        """The request for this attempt (render: check → place → emit); refusals raise here,
        before any launch rule. The dry-run is ``_prepare(..., attempt=1, uid="").native_spec()``.
        ``uid`` (the job's, "" when unknown) goes into what marks the submission as this job's
        where the backend may still list a deleted job's submission of the same id and attempt."""

    @abc.abstractmethod
    def _known(self, c: C, job_id: str, rendered: R) -> Known | None:
        """What the backend knows of the job's newest attempt (under the job's launch lock)."""

    @abc.abstractmethod
    async def _submit(self, c: C, name: str, job_id: str, spec: JobSpec, attempt: int, rendered: R) -> LaunchResult:
        """Submit ``rendered`` as is (the rules allowed it; under the job's launch lock, never cancelled half-way)."""

    @abc.abstractmethod
    def _snapshot(self, c: C) -> Iterable[JobObservation]:
        """Every job the record tracks, for a watch's snapshot."""

    @abc.abstractmethod
    async def _observe(self, c: C, refs: Sequence[JobRef]) -> list[JobObservation | None]:
        """What is known of each ref, in order (``None``: not found)."""

    @abc.abstractmethod
    def _lookup(self, c: C, ref: JobRef) -> JobObservation | None:
        """The job's last observation, without asking the backend (``None``: not tracked)."""

    @abc.abstractmethod
    async def _terminate(self, c: C, name: str, ref: JobRef, grace_seconds: float | None) -> JobObservation | None:
        """Start stopping a tracked job that has not ended (``None``: the backend does not know it)."""

    @abc.abstractmethod
    async def _cleanup(self, c: C, name: str, ref: JobRef) -> None:
        """Remove the job's backend objects and files (unknown jobs: nothing to do)."""

    def _forget(self, c: C, ref: JobRef) -> bool:
        """Drop an ended job from memory (its final state is recorded upstream); True when
        dropped. What logs, usage and observations of it need must stay readable (disk,
        backend); a restarted driver must not load it back into memory."""
        return False

    def _tail(self, c: C, ref: JobRef, query: LogQuery) -> AsyncIterator[list[LogEntry]]:
        """Batches of log lines (``supports_logs``); the wrapper filters them by the query."""
        raise NotImplementedError

    async def _usage(self, c: C, ref: JobRef) -> JobUsage:
        """The job's usage now (``supports_usage``)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the fixed wrappers

    async def close(self) -> None:
        await self.launches.drain(CLOSE_LAUNCH_WAIT_SECONDS)
        for c in self.clusters.values():
            await self._disconnect(c)
        self.clusters.clear()

    async def configure_cluster(self, config: ClusterConfig) -> ClusterInfo:
        self._validate_config(config)
        async with self.clusters.lock(config.name):  # one configuration of a cluster at a time
            old = self.clusters.get(config.name)
            if old is not None and self._unchanged(old, config):
                c = old
            else:
                c = await self.clusters.configure(config.name, lambda prev: self._connect(config, prev),
                                                  carry_over=self.carry_over, drop=self._disconnect)
                await self._activate(config.name, c)
        return await self._bounded_info(config.name, c)

    async def remove_cluster(self, cluster: str, *, if_idle: bool = False) -> None:
        """Forget the cluster; with ``if_idle``, FAILED_PRECONDITION ``CLUSTER_HAS_JOBS`` while a
        job of it this driver tracks is unfinished (ClusterManager's DeleteCluster asks so: a
        cluster deleted under running jobs left them running, out of every API's reach)."""
        c = self.clusters.get(cluster) if if_idle else None
        if c is not None and (live := [o.job_id for o in self._snapshot(c) if not o.state.is_terminal()]):
            raise FailedPrecondition(
                f"{cluster} has {len(live)} unfinished job(s) (e.g. jobs/{live[0]}): stop them, or let "
                "them end, then delete it", reason="CLUSTER_HAS_JOBS",
                metadata={"cluster": cluster, "unfinished_jobs": str(len(live))})
        await self.clusters.remove(cluster, drop=self._disconnect)
        self._last_ready.pop(cluster, None)

    async def cluster_info(self, cluster: str) -> ClusterInfo:
        return await self._bounded_info(cluster, self.clusters.require(cluster))

    async def _bounded_info(self, cluster: str, c: C) -> ClusterInfo:
        """``_info`` within ``info_budget``: past it, DEGRADED with what the record last
        answered READY (jobs matched to the cluster wait for it), or UNREACHABLE when it
        never did."""
        try:
            info = await asyncio.wait_for(self._info(c), self.info_budget)
        except TimeoutError:
            why = f"{self.backend_noun} did not answer in {self.info_budget:g}s"
            last = self._last_ready.get(cluster)
            if last is None or last[0] is not c:
                return ClusterInfo(state=ClusterState.UNREACHABLE, message=why, supported_run_modes=self._modes(c),
                                   driver_version=f"{self.name}/{__version__}")
            return dataclasses.replace(last[1], state=ClusterState.DEGRADED, message=why)
        if info.state is ClusterState.READY:
            self._last_ready[cluster] = (c, info)
        return info

    async def render(self, cluster: str, job_id: str, spec: JobSpec) -> NativeSpec:
        rendered = await self._prepare(self.clusters.require(cluster), job_id, spec, 1, "")
        return rendered.native_spec()

    async def launch(self, cluster: str, job_id: str, spec: JobSpec, attempt: int, uid: str = "") -> LaunchResult:
        c = self.clusters.require(cluster)
        rendered = await self._prepare(c, job_id, spec, attempt, uid)
        await self._ready(c)
        return await self.launches.launch(
            cluster, job_id, attempt, known=lambda: self._known(c, job_id, rendered),
            submit=lambda: self._submit(c, cluster, job_id, spec, attempt, rendered), uid=uid,
            discard=lambda prev: self._cleanup(self._record_for(prev.cluster, c), prev.cluster, JobRef(job_id, "")))

    def _record_for(self, cluster: str, launching: C) -> C:
        """The record of ``cluster``, where a launch's discard cleans up; a cluster name no
        longer configured (a backend whose jobs span its names: the local driver, one host)
        lends the launching cluster's, or that job would hold the new one back for good."""
        return self.clusters.get(cluster) or launching

    async def observe(self, cluster: str, refs: Sequence[JobRef]) -> list[JobObservation]:
        c = self.clusters.require(cluster)
        await self._ready(c)
        found = await self._observe(c, refs)
        return [obs if obs is not None and ref.names(obs) else JobObservation.not_found(ref)
                for ref, obs in zip(refs, found, strict=True)]

    def watch(self, cluster: str) -> AsyncIterator[WatchEvent]:
        return self.clusters.watch(cluster, self._snapshot, ready=self._ready)

    async def terminate(self, cluster: str, ref: JobRef, grace_seconds: float | None) -> JobObservation:
        c = self.clusters.require(cluster)
        await self._ready(c)
        async with self.launches.settled(ref.job_id):  # a launch in flight first makes all it makes
            known = self._lookup(c, ref)
            if not ref.names(known):  # another uid's job under the same backend id: not this one
                return JobObservation.not_found(ref, ref.uid)
            if known is not None and known.found and known.state.is_terminal():
                return known
            obs = await self._terminate(c, cluster, ref, grace_seconds)
        return obs if obs is not None else JobObservation.not_found(ref)

    async def cleanup(self, cluster: str, ref: JobRef) -> None:
        c = self.clusters.require(cluster)
        await self._ready(c)
        async with self.launches.settled(ref.job_id):
            if ref.names(self._lookup(c, ref)):  # (another uid's job under the same backend id is left alone)
                await self._cleanup(c, cluster, ref)

    async def forget(self, cluster: str, refs: Sequence[JobRef]) -> int:
        c = self.clusters.require(cluster)
        await self._ready(c)
        n = 0
        for ref in refs:
            known = self._lookup(c, ref)
            if known is not None and known.found and known.state.is_terminal() and self._forget(c, ref):
                n += 1
        return n

    def tail_logs(self, cluster: str, ref: JobRef, query: LogQuery) -> AsyncIterator[list[LogEntry]]:
        return self._tail_filtered(cluster, ref, query)

    async def _tail_filtered(self, cluster: str, ref: JobRef, query: LogQuery) -> AsyncIterator[list[LogEntry]]:
        c = self.clusters.require(cluster)
        if not self.supports_logs:
            raise Unimplemented(f"{self.name} driver cannot tail logs")
        await self._ready(c)
        batches = self._tail(c, ref, query)
        try:
            async for batch in batches:
                wanted = filter_entries(batch, query)
                if wanted:
                    yield wanted
        finally:
            close = getattr(batches, "aclose", None)  # a generator: close it now, not at GC
            if close is not None:
                await close()

    async def usage(self, cluster: str, ref: JobRef) -> JobUsage:
        c = self.clusters.require(cluster)
        if not self.supports_usage:
            raise Unimplemented(f"{self.name} driver cannot measure usage")
        await self._ready(c)
        return await self._usage(c, ref)


