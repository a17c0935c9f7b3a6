"""``SlurmDriver``: jobs as sbatch submissions on a login node reached over SSH.

A cluster's address is the login node ``host[:port]``; its credentials are
``SshCredentials`` (user, private key, pinned host keys). Options: upper-case
names (``SLURM_CONF``, ``PATH`` ...) are exported before every remote
command; ``partition`` (the default partition), ``state_dir`` (where job
scripts write their logs; default ``.dlsched/slurm`` under the SSH user's
home; must be shared with the compute nodes) and ``max_nodes`` go to
``render``.

The driver is the kit's ``BackendDriver`` (``drivers.common.skeleton``: the
public operations, the attempt rules, cluster look-up) over these hooks and
one module per concern: ``render`` the script (check → place → emit) and the
job's metadata codec (``dlsched-<job_id>.<attempt>``), ``adapter`` the Slurm
commands over SSH with the one mapping of their exits to errors (and
exactly-once submission), ``poller`` the shared squeue rounds, ``jobs`` what
those rounds make of a tracked job, ``states`` the state table, ``logs`` the
log files and followers, ``usage`` sstat/sacct and the node capacity.

Launch: ``adapter.SlurmClient.submit`` (an ``sbatch --parsable --hold``
started ahead of the launch takes the script on stdin; an ambiguous one is
resolved by looking the attempt up before any retry; only the one Slurm job
adopted for the attempt, the oldest with its comment, is released with
``scontrol release``). Exactly once: every poll round groups the user's
jobs by ``dlsched-`` comment, and any job of a tracked attempt other than
the adopted one that has not ended is cancelled on sight; it was submitted
held and never released, so it never ran (an ``sbatch`` that timed out and
landed afterwards; after such an ``sbatch`` the attempt is polled for
``adapter.LATE_WINDOW``, 10 minutes, even once its job has ended). Extra jobs of an attempt the cluster does not track are
left held (another cluster configuration sharing the SSH user may own the
attempt) until a launch adopts it. An adopted job
still held (its driver died between ``sbatch`` and the release) is released
on adoption, by a launch or by an observation. An ``sbatch`` that fails with no
job behind it is FAILED_PRECONDITION reason ``SBATCH_REJECTED`` with Slurm's
message (an unknown partition), unless the message says the controller was
unreachable or slow: that is retried, and after the last try UNAVAILABLE
reason ``BACKEND_UNAVAILABLE``.

State: one ``Poller`` per cluster (one ``squeue`` per interval for all
tracked jobs, one ``sacct``/``scontrol`` follow-up only for jobs missing
from it; a launch or stop never adds a round). While a round fails (SSH or
slurmctld down) every job keeps its last known state, with reason
``BackendStale`` and the error in the message: nothing turns FAILED on an
outage. A tracked job that both squeue and the follow-up no longer know,
while the controller answers, ends FAILED reason ``LeftSlurm`` (or keeps its
terminal state if one was seen). A job Slurm requeues stays the same dlsched
attempt (``jobs``): QUEUED again, then RUNNING, ``backend_restarts`` counting.

Jobs the driver does not know (after a driver restart) are adopted on the
first observation that names them: the next poll round answers for all of
them, with no call of its own.

Stop: ``scancel`` (Slurm sends SIGTERM, then SIGKILL after KillWait);
stopping an ended or unknown job is fine. CANCELLED maps to STOPPED.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field

from dlsched import __version__
from dlsched.errors import DlschedError, InvalidArgument
from drivers.common.base import (
    ClusterConfig,
    ClusterInfo,
    ClusterState,
    JobNotFound,
    JobObservation,
    JobRef,
    JobSpec,
    JobUsage,
    LaunchResult,
    LogEntry,
    LogQuery,
    SshCredentials,
)
from drivers.common.launches import Known
from drivers.common.planner import ALL_RUN_MODES
from drivers.common.skeleton import BackendDriver
from drivers.slurm import logs as slogs
from drivers.slurm import poller as poll
from drivers.slurm import render, states, usage
from drivers.slurm.adapter import (
    LATE_WINDOW,
    SbatchRejected,
    SlurmClient,
    bounded,
    is_held,
    oldest_first,
)
from drivers.slurm.jobs import TrackedJob
from drivers.slurm.render import SlurmScript
from drivers.slurm.ssh import ENV_RE, HostKeyMismatch

log = logging.getLogger("dlsched.driver.slurm")

__all__ = ["SbatchRejected", "SlurmConfig", "SlurmDriver"]


@dataclass(frozen=True)
class SlurmConfig:
    """The Slurm driver's flags."""

    poll_interval: float = field(default=2.0, metadata={
        "help": f"seconds between squeue rounds per cluster (at least {poll.MIN_INTERVAL:g})"})
    command_timeout: float = field(default=30.0, metadata={"help": "timeout of one remote command"})
    max_channels: int = field(default=8, metadata={
        "help": "concurrent SSH channels per cluster (keep below the server's MaxSessions, 10)"})
    max_log_streams: int = field(default=8, metadata={
        "help": "log followers streaming at once per cluster, each on one channel of a second SSH "
                "connection (at most 9; followers beyond it read by polls)"})


class _Cluster:
    """One configured cluster: its commands (``client``), poller and tracked jobs."""

    def __init__(self, config: ClusterConfig, client: SlurmClient, driver: SlurmDriver) -> None:
        self.config = config
        self.name = config.name
        self.client = client
        self.options = {k: v for k, v in config.options.items() if not ENV_RE.match(k)}
        self.jobs: dict[str, TrackedJob] = {}
        self.last_error: str | None = None
        #: comment -> the oldest Slurm job of every dlsched attempt the last good round listed; None before one.
        self.listed: dict[str, poll.SlurmJob] | None = None
        #: comments of attempts whose sbatch may have landed unseen (look them up before submitting).
        self.unsure: set[str] = set()
        #: comment -> when (monotonic) an sbatch of it last failed or timed out: polled for
        #: ``LATE_WINDOW`` afterwards, ended or not, so a late-landing job is cancelled on sight.
        self.late: dict[str, float] = {}
        #: adopted Slurm jobs found held: released in the background, retried each round until done.
        self.to_release: set[str] = set()
        #: (action, Slurm job id) of scancel / scontrol release calls in flight.
        self.pending: set[tuple[str, str]] = set()
        #: Whether the cluster has accounting storage (sacct answers); None until GetClusterInfo says.
        self.accounting: bool | None = None
        self.poller = poll.Poller(client.run, client.username, driver.config.poll_interval, self.tracked,
                                  lambda jobs, err, complete: driver._on_round(self, jobs, err, complete),
                                  accounting=lambda: bool(self.accounting))

    def tracked(self) -> list[str]:
        now = time.monotonic()
        for comment, since in list(self.late.items()):
            if now - since > LATE_WINDOW:
                del self.late[comment]
        return [j.backend_job_id for j in self.jobs.values()
                if not j.state.is_terminal() or render.job_comment(j.job_id, j.attempt) in self.late]

    def find(self, ref: JobRef) -> TrackedJob | None:
        job = self.jobs.get(ref.job_id)
        if job is None or (ref.backend_job_id and ref.backend_job_id != job.backend_job_id):
            return None
        return job

    def observation(self, job: TrackedJob) -> JobObservation:
        return job.observation(self.last_error)


class SlurmDriver(BackendDriver[_Cluster, SlurmScript]):
    name = "slurm"
    #: kept across a reconfiguration: what was tracked; the connections, poller and warm sbatch are new
    carry_over = ("jobs", "unsure", "late", "to_release")
    supports_logs = True
    supports_usage = True

    def __init__(self, config: SlurmConfig | None = None) -> None:
        super().__init__()
        self._background: set[asyncio.Task[None]] = set()
        self.config = config or SlurmConfig()

    # ------------------------------------------------------------------ clusters

    def _validate_config(self, config: ClusterConfig) -> None:
        if not isinstance(config.credentials, SshCredentials):
            raise InvalidArgument.for_field("credentials", "a Slurm cluster needs ssh credentials")
        if not config.address:
            raise InvalidArgument.for_field("address", "the login node, host[:port]")
        render.state_dir_of(config.options)

    def _unchanged(self, old: _Cluster, config: ClusterConfig) -> bool:
        a = old.config
        return a.address == config.address and dict(a.options) == dict(config.options) \
            and a.credentials == config.credentials

    async def _connect(self, config: ClusterConfig, old: _Cluster | None) -> _Cluster:
        assert isinstance(config.credentials, SshCredentials)  # _validate_config
        client = SlurmClient(config.address, config.credentials,
                             {k: v for k, v in config.options.items() if ENV_RE.match(k)}, config.options,
                             command_timeout=self.config.command_timeout, max_channels=self.config.max_channels,
                             max_log_streams=self.config.max_log_streams)
        try:
            await client.ssh.run("true", time_limit=self.config.command_timeout)
        except HostKeyMismatch:
            await client.ssh.close()
            raise
        except DlschedError as e:
            log.info("cluster %s not reachable yet: %s", config.name, e.message)
        return _Cluster(config, client, self)

    async def _disconnect(self, c: _Cluster) -> None:
        # Each step bounded: a login node that stops answering (or a machine
        # under load) must not hold RemoveCluster/ConfigureCluster past the
        # caller's deadline; what did not close in time is abandoned.
        await bounded(c.poller.stop())
        await c.client.close()

    async def _activate(self, name: str, c: _Cluster) -> None:
        c.poller.start()
        c.client.warm.refill()

    async def _info(self, c: _Cluster) -> ClusterInfo:
        version = f"slurm/{__version__}"
        try:
            # Bounded well below ClusterManager's deadline for GetClusterInfo: a
            # controller that does not answer (scontrol waits ~10 s) is the
            # cluster UNREACHABLE, not this driver unresponsive.
            nodes, accounting = await c.client.info(ask_accounting=c.accounting is None)
        except DlschedError as e:
            return ClusterInfo(state=ClusterState.UNREACHABLE, message=f"{e.reason}: {e.message}",
                               supported_run_modes=ALL_RUN_MODES, driver_version=version)
        if accounting is not None:
            c.accounting = accounting
        return ClusterInfo(state=ClusterState.READY, capacity=usage.capacity(nodes),
                           supported_run_modes=ALL_RUN_MODES, driver_version=version)

    # ------------------------------------------------------------------ render / launch

    async def _prepare(self, c: _Cluster, job_id: str, spec: JobSpec, attempt: int) -> SlurmScript:
        return render.render_job(job_id, spec, attempt, c.options)

    def _known(self, c: _Cluster, job_id: str, rendered: SlurmScript) -> Known | None:
        prev = c.jobs.get(job_id)
        if prev is None:
            return None
        return Known(prev.cluster, prev.attempt, not prev.state.is_terminal(), lambda: LaunchResult(
            prev.backend_job_id, prev.native or rendered.native_spec(), c.observation(prev)))

    async def _submit(self, c: _Cluster, name: str, job_id: str, spec: JobSpec, attempt: int,
                      rendered: SlurmScript) -> LaunchResult:
        backend_id = await c.client.submit(rendered, c.listed, c.unsure, c.late)
        job = TrackedJob(name, job_id, attempt, backend_id, rendered.dir, rendered.native_spec(),
                         roles=tuple((s.role, s.index) for s in rendered.steps))
        c.jobs[job_id] = job
        self._publish(c, job)
        c.poller.wake()
        return LaunchResult(backend_id, rendered.native_spec(), c.observation(job))

    # ------------------------------------------------------------------ polling and observing

    def _on_round(self, c: _Cluster, jobs: dict[str, poll.SlurmJob], error: str | None,
                  complete: bool) -> None:
        if self.clusters.get(c.name) is not c:
            return
        c.last_error = error
        if error is None:
            attempts: dict[str, list[poll.SlurmJob]] = {}
            for listed in jobs.values():
                if render.is_ours(listed.comment):
                    attempts.setdefault(listed.comment, []).append(listed)
            c.listed = {comment: oldest_first(sjs)[0] for comment, sjs in attempts.items()}
            self._cancel_strays(c, attempts)
        for job in list(c.jobs.values()):
            sj = jobs.get(job.backend_job_id)
            if job.backend_job_id in c.to_release and error is None and sj is not None:
                if is_held(sj):
                    self._later(c, "release", job.backend_job_id)
                else:
                    c.to_release.discard(job.backend_job_id)
            if not job.state.is_terminal() and job.round(sj, error, complete):
                self._publish(c, job)
                if job.unschedulable:  # reported FAILED; take it out of Slurm's queue
                    self._later(c, "cancel", job.backend_job_id)

    def _cancel_strays(self, c: _Cluster, attempts: dict[str, list[poll.SlurmJob]]) -> None:
        """Cancel every job of a tracked attempt but the tracked one: a late-landing
        sbatch's, held since it landed, so it never ran. An attempt this cluster does not
        track is left alone (another cluster configuration or driver sharing the SSH user
        may own it); its extra jobs are held, and cancelled here once a launch adopts it."""
        for comment, sjs in attempts.items():
            if len(sjs) < 2 or (parsed := render.parse_comment(comment)) is None:
                continue
            tracked = c.jobs.get(parsed[0])
            if tracked is None or tracked.attempt != parsed[1]:
                continue
            for sj in sjs:
                if sj.job_id != tracked.backend_job_id \
                        and not states.job_state(sj.state, sj.reason).state.is_terminal():
                    log.warning("cancelling Slurm job %s: a duplicate of %s's job %s", sj.job_id, comment,
                                tracked.backend_job_id)
                    self._later(c, "cancel", sj.job_id)

    def _later(self, c: _Cluster, action: str, backend_job_id: str) -> None:
        """``scancel`` (``action`` "cancel") or ``scontrol release`` ("release") of one job in
        the background, one call per job and action at a time; a failure is logged (the next
        round that sees the job asks again)."""
        key = (action, backend_job_id)
        if key in c.pending:
            return
        c.pending.add(key)

        async def call() -> None:
            try:
                if action == "release":
                    await c.client.release(backend_job_id)
                    c.to_release.discard(backend_job_id)
                else:
                    await c.client.cancel(backend_job_id)
            except DlschedError as e:
                log.warning("%s of Slurm job %s: %s", action, backend_job_id, e.message)
            finally:
                c.pending.discard(key)

        task = asyncio.create_task(call(), name=f"slurm-{action}-{backend_job_id}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _publish(self, c: _Cluster, job: TrackedJob) -> None:
        self.hub.publish(job.cluster, c.observation(job))

    def _snapshot(self, c: _Cluster) -> Iterable[JobObservation]:
        return [c.observation(j) for j in c.jobs.values()]

    def _lookup(self, c: _Cluster, ref: JobRef) -> JobObservation | None:
        job = c.find(ref)
        return c.observation(job) if job is not None else None

    async def _observe(self, c: _Cluster, refs: Sequence[JobRef]) -> list[JobObservation | None]:
        unknown = [r for r in refs if r.job_id not in c.jobs and r.backend_job_id.isdigit()]
        if unknown:
            await self._adopt(c, unknown)
        return [self._lookup(c, ref) for ref in refs]

    async def _adopt(self, c: _Cluster, refs: Sequence[JobRef]) -> None:
        """Track jobs submitted before this driver started, from the next poll round's answer."""
        jobs = await c.poller.fresh(r.backend_job_id for r in refs)
        if jobs is None:
            return
        for ref in refs:
            sj = jobs.get(ref.backend_job_id)
            parsed = render.parse_comment(sj.comment) if sj is not None else None
            if sj is None or parsed is None or parsed[0] != ref.job_id or ref.job_id in c.jobs:
                continue
            job = TrackedJob(c.name, ref.job_id, parsed[1], sj.job_id,
                             render.attempt_dir(c.options, ref.job_id, parsed[1]), None)
            job.apply(sj)
            c.jobs[ref.job_id] = job
            if is_held(sj):  # submitted held by a driver that died before releasing it
                c.to_release.add(sj.job_id)
                self._later(c, "release", sj.job_id)

    # ------------------------------------------------------------------ stop / cleanup

    async def _terminate(self, c: _Cluster, name: str, ref: JobRef,
                         grace_seconds: float | None) -> JobObservation | None:
        job = c.find(ref)
        if job is None:
            return None
        await c.client.cancel(job.backend_job_id)
        job.stop_sent()
        self._publish(c, job)
        c.poller.wake()
        return c.observation(job)

    async def _cleanup(self, c: _Cluster, name: str, ref: JobRef) -> None:
        job = c.find(ref)
        if job is None:
            return
        if not job.state.is_terminal():
            await self._terminate(c, name, ref, None)
        await c.client.remove_files(job.job_id, job.dir.rsplit("/", 1)[0])
        c.jobs.pop(job.job_id, None)

    # ------------------------------------------------------------------ logs and usage

    def _tail(self, c: _Cluster, ref: JobRef, query: LogQuery) -> AsyncIterator[list[LogEntry]]:
        job = c.find(ref)
        if job is None:
            raise JobNotFound(ref.job_id)
        jobs = c.jobs  # the same dict after a reconfiguration (carried over)
        interval = max(slogs.LOG_POLL_FLOOR, min(1.0, self.config.poll_interval))
        return slogs.tail(lambda: self.clusters.require(c.name).client, job.dir, query,
                          lambda: job.state.is_terminal() or jobs.get(job.job_id) is not job, interval)

    async def _usage(self, c: _Cluster, ref: JobRef) -> JobUsage:
        job = c.find(ref)
        if job is None:
            raise JobNotFound(ref.job_id)
        return await usage.measure(c.client.run, job, bool(c.accounting))
