"""``SlurmCluster``: what the Slurm driver keeps of one configured cluster.

Its commands (``adapter.SlurmClient``), its poller (``poller.Poller``: one squeue round per
interval, answered to the driver's ``on_round``) and the jobs it tracks, with the bookkeeping of
exactly-once submission (``listed``, ``unsure``, ``late``, ``retired``, ``launching``,
``held_since``: see ``drivers.slurm.driver``). No I/O of its own.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable

from dlsched.errors import DlschedError
from drivers.common.base import ClusterCapacity, ClusterConfig, JobObservation, JobRef
from drivers.slurm import poller as poll
from drivers.slurm import render
from drivers.slurm.adapter import LATE_WINDOW, SlurmClient
from drivers.slurm.jobs import TrackedJob
from drivers.slurm.ssh import ENV_RE


class SlurmCluster:
    """One configured cluster: its commands (``client``), poller and tracked jobs."""

    def __init__(self, config: ClusterConfig, client: SlurmClient, poll_interval: float,
                 on_round: Callable[[SlurmCluster, dict[str, poll.SlurmJob], str | None, bool], None]) -> None:
        self.config = config
        self.name = config.name
        self.client = client
        self.options = {k: v for k, v in config.options.items() if not ENV_RE.match(k)}
        self.jobs: dict[str, TrackedJob] = {}
        #: forgotten jobs whose ``recorded.json`` is being written (answered from here until it is)
        self.recording: dict[str, TrackedJob] = {}
        self.record_writer: asyncio.Task[None] | None = None
        self.last_error: str | None = None
        #: the oldest Slurm job of every dlsched attempt the last good round listed (``listing``); None before one.
        self.listed: dict[str, dict[str, poll.SlurmJob]] | None = None
        #: comments of attempts whose sbatch may have landed unseen (look them up before submitting).
        self.unsure: set[str] = set()
        #: Slurm id of a deleted job -> (when, its job id); while squeue lists it
        self.retired: dict[str, tuple[float, str]] = {}
        #: comment -> when (monotonic) an sbatch of it last failed or timed out: polled for
        #: ``LATE_WINDOW`` afterwards, ended or not, so a late-landing job is cancelled on sight.
        self.late: dict[str, float] = {}
        #: adopted Slurm jobs found held: released in the background, retried each round until done.
        self.to_release: set[str] = set()
        #: Slurm ids an observation is adopting (waiting for the poll round that lists them)
        self.claiming: collections.Counter[str] = collections.Counter()
        #: (action, Slurm job id) of scancel / scontrol release calls in flight.
        self.pending: set[tuple[str, str]] = set()
        #: comments of attempts this driver is submitting or adopting right now (their jobs may be held).
        self.launching: set[str] = set()
        #: Slurm job id -> when (monotonic) a round first saw it held, for jobs of attempts not tracked here.
        self.held_since: dict[str, float] = {}
        #: Whether the cluster has accounting storage (sacct answers); None until GetClusterInfo says.
        self.accounting: bool | None = None
        #: the capacity the last good look-up (``scontrol show nodes``) found, and when (monotonic) one ended
        self.capacity: ClusterCapacity | None = None
        self.looked_up: float | None = None
        #: (monotonic end, error or None) of the last look-up; the poller's rounds beside it say health
        self.lookup_result: tuple[float, DlschedError | None] | None = None
        self.info_lock = asyncio.Lock()
        self.poller = poll.Poller(client.run, client.username, poll_interval, self.tracked,
                                  lambda jobs, err, complete: on_round(self, jobs, err, complete),
                                  accounting=lambda: bool(self.accounting),
                                  watching=lambda: bool(self.held_since) or bool(self.late))

    def tracked(self) -> list[str]:
        now = time.monotonic()
        for comment, since in list(self.late.items()):
            if now - since > LATE_WINDOW:
                del self.late[comment]
        return [j.backend_job_id for j in self.jobs.values()
                if not j.state.is_terminal() or render.job_comment(j.job_id, j.attempt, j.uid) in self.late]

    def find(self, ref: JobRef) -> TrackedJob | None:
        job = self.jobs.get(ref.job_id)
        if job is None or (ref.backend_job_id and ref.backend_job_id != job.backend_job_id):
            return None
        return job

    def find_known(self, ref: JobRef) -> TrackedJob | None:
        """A tracked job, or a forgotten one whose record is still being written."""
        job = self.find(ref)
        if job is None and (gone := self.recording.get(ref.job_id)) is not None \
                and ref.backend_job_id in ("", gone.backend_job_id):
            job = gone
        return job

    def observation(self, job: TrackedJob) -> JobObservation:
        return job.observation(self.last_error)
