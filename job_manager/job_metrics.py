"""``dlsched_jobs{state}``: jobs in etcd by state, kept from the one job watch.

A snapshot at revision R, then every WatchHub event after R: the gauge follows
etcd without a read per scrape. If the subscription ends (a lagging reader,
an etcd hiccup) it starts again from a fresh snapshot.
"""

from __future__ import annotations

import asyncio
import collections
import logging

from dlsched.errors import DlschedError
from dlsched.kit.metrics import JOBS
from job_manager.domain.model import JobState
from job_manager.store import JobStore
from job_manager.watch import EventType, WatchHub

log = logging.getLogger("job_manager.metrics")


class JobStateGauge:
    def __init__(self, store: JobStore, hub: WatchHub, *, retry_seconds: float = 1.0) -> None:
        self._store, self._hub, self._retry = store, hub, retry_seconds
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="job-state-gauge")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    @staticmethod
    def _publish(states: dict[str, JobState]) -> None:
        counts = collections.Counter(states.values())
        for s in JobState:
            if s is not JobState.UNSPECIFIED:
                JOBS.labels(s.name).set(counts.get(s, 0))

    async def _run(self) -> None:
        while True:
            sub = self._hub.subscribe()
            try:
                jobs, rev = await self._store.list_all()
                sub.skip_to(rev)
                states = {j.id: j.state for j in jobs}
                self._publish(states)
                while True:
                    ev = await sub.next()
                    if ev.type is EventType.DELETED:
                        states.pop(ev.job.id, None)
                    else:
                        states[ev.job.id] = ev.job.state
                    self._publish(states)
            except DlschedError as e:
                log.info("job gauge restarts: %s", e)
            finally:
                sub.close()
            await asyncio.sleep(self._retry)
