"""``TrackedJob``: what the local driver holds in memory per job it tracks.

One job's newest attempt: its plan, its supervisor's last status as a
``JobMachine``, and what following the supervisor needs. Kept compact (slots,
shared empties, nothing derived kept): issue 18 bounds a tracked job at 2 KiB.
A job whose end JobManager has recorded is not held at all (``ForgetJobs``):
it is read from its files when asked.
"""

from __future__ import annotations

import asyncio
import subprocess
from typing import Any

from drivers.common.base import NativeSpec
from drivers.local import render, usage
from drivers.local.machine import JobMachine

RECORD_VERSION = 2


class TrackedJob:
    """One job's newest attempt: its launch record and its supervisor's last status.

    Compact (slots; the native spec, the finished event made when asked; of the status
    file only the supervisor's identity; of the last observation published only its
    hash): the driver holds one per job it tracks.
    """

    __slots__ = ("cluster", "job_id", "attempt", "plan", "request", "dir", "machine", "supervisor",
                 "signature", "proc", "next_liveness", "pending_stop", "stop_by", "final", "_finished", "published",
                 "peaks", "forget_when_final", "uid")

    def __init__(self, state_dir: str, cluster: str, job_id: str, attempt_no: int, plan: render.LocalPlan,
                 request: tuple[float, int], uid: str = "") -> None:
        self.cluster = cluster
        self.uid = uid  # the job's uid ("" when its launch gave none)
        self.job_id = job_id
        self.attempt = attempt_no
        self.plan = plan
        self.request = request
        self.dir = render.attempt_dir(state_dir, job_id, attempt_no)
        self.machine = JobMachine(plan)
        self.supervisor: tuple[int, int] | None = None  # pid and start ticks, from the status file
        self.signature: tuple[int, int, int] | None = None
        self.proc: subprocess.Popen[bytes] | None = None  # the supervisor, while it is our child
        self.next_liveness = 0.0
        self.pending_stop: float | None = None  # a stop the supervisor has not shown yet
        #: monotonic time by which a stopped job's supervisor must have ended it (its grace and a
        #: margin); past it, the driver kills its processes and the supervisor itself
        self.stop_by: float | None = None
        self.final = False  # ended and the supervisor gone: nothing more to read
        self._finished: asyncio.Event | None = None  # set with ``final``
        self.published: int | None = None  # hash of the last observation published
        self.peaks = [usage.Peak() for _ in plan.processes]
        self.forget_when_final = False  # JobManager recorded its end: drop it once final

    @property
    def native(self) -> NativeSpec:
        return self.plan.native_spec()

    @property
    def finished(self) -> asyncio.Event:
        if self._finished is None:
            self._finished = asyncio.Event()
            if self.final:
                self._finished.set()
        return self._finished

    def end(self) -> None:
        """Nothing more to read of it: ``final``, and the finished event set."""
        self.final = True
        if self._finished is not None:
            self._finished.set()

    @property
    def backend_job_id(self) -> str:
        return self.plan.backend_job_id

    @property
    def logs_ended(self) -> bool:
        return self.final or self.machine.ended

    def record(self) -> dict[str, Any]:
        return {"version": RECORD_VERSION, "cluster": self.cluster, "job_id": self.job_id,
                "attempt": self.attempt, "native_spec": self.native.content, "request": list(self.request),
                "uid": self.uid}

    def gpus_held(self) -> set[str]:
        out: set[str] = set()
        for p in self.plan.processes:
            if v := p.env.get("CUDA_VISIBLE_DEVICES"):
                out.update(v.split(","))
        return out
