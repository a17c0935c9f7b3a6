"""``dlsched_jobs{state}``: jobs in etcd by state, kept from the one job watch;
and the families that show which replica tracks which cluster.

A snapshot at revision R (from the watch cache), then every WatchHub event after R: the gauge follows
etcd without a read per scrape. If the subscription ends (a lagging reader,
an etcd hiccup) it starts again from a fresh snapshot.
"""

from __future__ import annotations

import asyncio
import collections
import logging

from prometheus_client import Counter, Gauge, Histogram

from dlsched.errors import DlschedError
from dlsched.kit.metrics import JOBS
from job_manager.cache import JobCache
from job_manager.domain.model import JobState
from job_manager.watch import EventType, WatchHub

log = logging.getLogger("job_manager.metrics")

#: 1 for each cluster whose tracking this replica owns now, 0 once it no longer does
#: (``job_manager/ownership.py``); the replica is the process serving /metrics.
CLUSTER_OWNED = Gauge(
    "dlsched_job_manager_cluster_owned",
    "1 while this JobManager replica owns the cluster's tracking, else 0", ["cluster"])
OWNERSHIP_CHANGES = Counter(
    "dlsched_job_manager_ownership_changes",
    "this replica's ownership changes: gained, released (rebalance, shutdown), lost (lease)",
    ["cluster", "change"])
TRACKING_WRITES = Counter(
    "dlsched_job_manager_tracking_writes",
    "fenced job writes of the cluster owner: applied, conflict (retried CAS), fenced (refused: "
    "ownership lost)", ["cluster", "result"])

#: SubmitJob's store to the recorded backend id (the launch runs after SubmitJob answered)
LAUNCH_LATENCY = Histogram(
    "dlsched_job_launch_latency_seconds",
    "from a job's creation (SubmitJob stored it) to its first attempt's backend id recorded",
    ["cluster"], buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))


class JobStateGauge:
    def __init__(self, cache: JobCache, hub: WatchHub, *, retry_seconds: float = 1.0) -> None:
        self._cache, self._hub, self._retry = cache, hub, retry_seconds
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="job-state-gauge")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    @staticmethod
    def _publish_all(counts: collections.Counter[JobState]) -> None:
        for s in JobState:
            if s is not JobState.UNSPECIFIED:
                JOBS.labels(s.name).set(counts.get(s, 0))

    async def _run(self) -> None:
        while True:
            sub = self._hub.subscribe()
            try:
                states, rev = self._cache.states()  # no await since subscribe()
                sub.skip_to(rev)
                counts = collections.Counter(states.values())
                self._publish_all(counts)
                while True:  # per event: move one job between two states, O(1)
                    ev = await sub.next()
                    before = states.pop(ev.job.id, None)
                    after = None if ev.type is EventType.DELETED else ev.job.state
                    if after is not None:
                        states[ev.job.id] = after
                    if before == after:
                        continue
                    for state, delta in ((before, -1), (after, 1)):
                        if state is not None:
                            counts[state] += delta
                            if state is not JobState.UNSPECIFIED:
                                JOBS.labels(state.name).set(counts[state])
            except DlschedError as e:
                log.info("job gauge restarts: %s", e)
            finally:
                sub.close()
            await asyncio.sleep(self._retry)
