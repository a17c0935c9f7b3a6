"""What the Ray driver keeps per cluster between polls (``RayCluster``)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from drivers.common.base import ClusterConfig, JobObservation, JobState
from drivers.ray import layout
from drivers.ray.api import RayApi


class RayCluster:
    """One configured Ray cluster: its API, the jobs the poller follows, and what the driver
    noted of them between polls (ends read, stops asked, starts seen)."""

    def __init__(self, config: ClusterConfig, timeout: float) -> None:
        self.config = config
        self.api = RayApi(config, timeout)
        self.jobs: dict[str, JobObservation] = {}  # job id -> newest attempt
        self.submissions: dict[str, set[str]] = {}  # job id -> every submission id seen
        #: job id -> (attempt, uid, submission id) of an ended, untracked submission whose id
        #: does not name its uid (made by an earlier driver): a launch of that attempt adopts it
        self.legacy: dict[str, tuple[int, str, str]] = {}
        self.nodes: dict[str, str] = {}  # job id -> the newest attempt's entrypoint node (Ray's driver_node_id)
        self.ends: dict[str, layout.Manifest] = {}  # submission id -> its manifest, read once it ended
        self.reading: set[str] = set()  # manifests being read
        self.held: dict[str, tuple[float, JobObservation]] = {}  # ended, waiting for its manifest
        self.background: set[asyncio.Task[None]] = set()
        self.polled = asyncio.Event()
        self.ok = False  # the last poll answered
        self.known = False  # some poll answered: the cache is the cluster's, if maybe stale
        self.error = ""
        self.task: asyncio.Task[None] | None = None
        self.wake = asyncio.Event()
        self.stopping: set[str] = set()  # time-limit stops in flight
        self.stop_requested: set[str] = set()  # submissions a TerminateJob stopped: STOPPING until they end
        #: submission id -> when it started running (unix seconds): seen to start by this driver
        #: (Ray's start_time is the submission's, queue included), else Ray's start_time; None:
        #: this driver saw it waiting and has not seen it run
        self.started: dict[str, float | None] = {}

    async def request(self, method: str, path: str, body: Any = None) -> Any:
        return await self.api.request(method, path, body)

    def note_start(self, prev: JobObservation | None, it: dict[str, Any]) -> float | None:
        """When submission ``it`` started running (``started``), noted when first seen
        running or ended; ``prev``: the job's last observation (None: untracked, nothing noted)."""
        sid, status, start = str(it.get("submission_id") or ""), it.get("status"), it.get("start_time")
        ray_start = start / 1000 if isinstance(start, (int, float)) and start > 0 else None
        if prev is None and status not in ("PENDING", "RUNNING"):
            return ray_start  # ended before it was tracked: not kept
        if self.started.get(sid) is not None:
            return self.started[sid]
        seen_waiting = sid in self.started or (prev is not None and prev.backend_job_id == sid
                                               and prev.state is JobState.PENDING)
        if status == "PENDING":
            self.started[sid] = None
        elif not seen_waiting:  # first seen running or ended: Ray's start (its queue included)
            self.started[sid] = ray_start
        elif status == "RUNNING":  # seen waiting: it started since the last look
            self.started[sid] = time.time()
        else:  # ended since it was seen waiting: stopped before it ran, or ran between two looks
            self.started[sid] = None if status == "STOPPED" else ray_start
        return self.started[sid]
