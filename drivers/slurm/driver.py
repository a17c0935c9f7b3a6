"""``SlurmDriver``: jobs as sbatch submissions on a login node reached over SSH.

A cluster's address is the login node ``host[:port]``; its credentials are
``SshCredentials`` (user, private key, pinned host keys). Options: upper-case
names (``SLURM_CONF``, ``PATH`` ...) are exported before every remote
command; ``partition`` (the default partition), ``state_dir`` (where job
scripts write their logs; default ``.dlsched/slurm`` under the SSH user's
home; must be shared with the compute nodes) and ``max_nodes`` go to
``render``.

Launch (exactly once): the script from ``render.render_job`` goes to
``sbatch --parsable`` on stdin (the first launch of a cluster configuration
also makes the state dir: ``mkdir -p <state dir> && sbatch ...``; the
script makes its attempt dir itself, see render). Whether Slurm may
already hold the attempt (comment ``dlsched-<job_id>.<attempt>``) is known
without a call in the common case: the last poll round listed every job of
the user (``--states=all``), so an attempt it did not list, that this
process never sent an unanswered ``sbatch`` for, is submitted straight
away, and one it listed is adopted. Only before this process's first round
(a restart: an earlier process may have submitted it) and after a failed or
ambiguous ``sbatch`` (an error exit, a dead connection, a timeout) does the
driver look the attempt up (``squeue --states=all --name=dlsched-<job_id>``)
and adopt what it finds; only when Slurm holds no such job does it submit
(again); should a timed-out ``sbatch`` land after that look-up, the retry
finds two jobs, keeps the oldest and cancels the other before anything is
reported. So a launch costs what a bare ``sbatch`` on the open connection
costs: one channel, one process, one controller RPC. Less: a warm
``mkdir -p <state dir> && exec sbatch --parsable`` per cluster is started
ahead of the launch and waits for the script on stdin (``_WarmSubmitter``),
so the first try costs writing the script and sbatch's RPC; retries use a
fresh command. An ``sbatch`` that
fails with no job behind it is FAILED_PRECONDITION reason ``SBATCH_REJECTED``
with Slurm's message (an unknown partition), unless the message says the
controller was unreachable or slow (``TRANSIENT_RE``): that is retried, and
after the last try UNAVAILABLE reason ``BACKEND_UNAVAILABLE``.

State: one ``Poller`` per cluster (one ``squeue`` per interval for all
tracked jobs, one ``scontrol`` follow-up only for jobs missing from it; a
launch or stop never adds a round), see ``poller.py``; ``states.py`` maps
Slurm states. While a round fails (SSH or
slurmctld down) every job keeps its last known state, with reason
``BackendStale`` and the error in the message: nothing turns FAILED on an
outage. A tracked job that both squeue and scontrol no longer know, while
the controller answers, ends FAILED reason ``LeftSlurm`` (or keeps its
terminal state if one was seen). A job Slurm requeues (``scontrol requeue``,
a node failure; squeue's ``RestartCnt``) stays the same dlsched attempt: its
state goes back to QUEUED (REQUEUED / PENDING, never FAILED) and then
RUNNING, its start time and usage restart, ``JobObservation.backend_restarts``
carries the count (JobManager shows it as ``Job.backend_restarts``) and every
message says ``(Slurm restart N)``. ``JobObservation.attempt`` stays the
dlsched attempt on purpose: JobManager drops observations of any other
attempt, and a requeue is not a dlsched retry.

Jobs the driver does not know (after a driver restart) are adopted on the
first observation that names them: the next poll round answers for all of
them, with no call of its own.

Logs: ``<role>-<index>.stdout|.stderr`` in the attempt directory (render),
read by the scripts of ``logs.py``. A tail starts with one framed read of
every file on the control connection (``tail_lines``: each file from its
last N lines, found from its end, so a large log is never read whole;
``since_time``: from the log index's last entry before it). A follower then
streams: one long-lived remote loop on one channel of the cluster's second
SSH connection (``log_ssh``, opened on first use, at most
``--max-log-streams`` channels, default 8, below sshd's MaxSessions) sends
each file's new bytes as they come and, once the poller has seen the job
end and the driver closes the loop's input, drains every file and ends.
Followers beyond the bound (and a follower whose stream broke) read by polls
on the control connection (one command per ``min(1 s, poll interval)``, floor
0.2 s) and take a stream slot when one frees. Either way a cursor holds each
file's offset and applies whole rounds only, so nothing is lost or said
twice. Lines are dated by ``log.index``, which the job script appends every
second (``logs.LogCursor``): ``LogEntry.time`` is at most about a second
after the write, and ``since_time`` keeps the lines dated at or after it.

Stop: ``scancel`` (Slurm sends SIGTERM, then SIGKILL after KillWait);
stopping an ended or unknown job is fine. CANCELLED maps to STOPPED.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import shlex
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from dlsched import __version__
from dlsched.errors import DlschedError, FailedPrecondition, InvalidArgument, Unavailable
from drivers.common.base import (
    ClusterCapacity,
    ClusterConfig,
    ClusterInfo,
    ClusterState,
    Driver,
    GpuInventory,
    JobNotFound,
    JobObservation,
    JobRef,
    JobSpec,
    JobState,
    JobUsage,
    LaunchResult,
    LogEntry,
    LogQuery,
    NativeSpec,
    ReplicaStatus,
    ReplicaUsage,
    SshCredentials,
    WatchEvent,
)
from drivers.common.hub import ObservationHub
from drivers.common.launches import Known, LaunchRules
from drivers.common.planner import ALL_RUN_MODES
from drivers.common.registry import STOP_REQUESTED, BackendUnavailable, ClusterRegistry
from drivers.slurm import logs as slogs
from drivers.slurm import poller as poll
from drivers.slurm import render, states
from drivers.slurm.render import SlurmScript
from drivers.slurm.ssh import ENV_RE, HostKeyMismatch, SshClient, Started

log = logging.getLogger("dlsched.driver.slurm")

SUBMIT_TRIES = 3
#: squeue look-ups of one attempt before a launch says UNAVAILABLE.
LOOKUP_TRIES = 3
#: A warm sbatch older than this is replaced before use (seconds).
WARM_MAX_AGE = 300.0
#: Log tails read files on the login node, not the controller: their own, lower floor.
LOG_POLL_FLOOR = 0.2
#: A log stream's remote loop looks at its files this often (a stat on the login node, no SSH
#: round trip), whatever the poll interval.
STREAM_INTERVAL = 0.2
LOG_LINE_RE = slogs.FILE_RE
#: sbatch errors that say nothing about the job itself: retried (after a look-up), never a refusal.
TRANSIENT_RE = re.compile(r"Socket timed out|Unable to contact slurm controller|temporarily unavailable|"
                          r"Slurm temporarily unable|Connection refused|Zero Bytes were transmitted")


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


class SbatchRejected(FailedPrecondition):
    reason = "SBATCH_REJECTED"


class _WarmSubmitter:
    """One ``sbatch --parsable`` per cluster started ahead of the next launch, waiting for
    its script on stdin: a launch pays only writing the script and sbatch's own RPC, not
    opening a channel and exec'ing. At most one idle process per cluster; it holds one
    channel of the bound (so it is used only where the bound is at least 3); one that died
    (a lost connection) or is older than ``WARM_MAX_AGE`` is closed and replaced; ``close``
    (RemoveCluster, reconfigure, driver close) gives it up. Given up unused, sbatch reads an
    empty script and submits nothing. The command and environment are the cold path's."""

    def __init__(self, ssh: SshClient, command: str, enabled: bool) -> None:
        self._ssh = ssh
        self._command = command
        self._enabled = enabled
        self._idle: Started | None = None
        self._starting: asyncio.Task[None] | None = None
        self._closed = False

    def take(self) -> Started | None:
        """The idle process if it is usable (then the next one starts in the background)."""
        p, self._idle = self._idle, None
        if p is not None and (not p.alive() or time.monotonic() - p.started > WARM_MAX_AGE):
            p.close()
            p = None
        self.refill()
        return p

    def refill(self) -> None:
        if not self._enabled or self._closed or self._idle is not None:
            return
        if self._starting is not None and not self._starting.done():
            return
        self._starting = asyncio.create_task(self._start(), name="slurm-warm-sbatch")

    async def _start(self) -> None:
        try:
            p = await self._ssh.start(self._command, call="sbatch")
        except DlschedError as e:
            log.debug("no warm sbatch: %s", e.message)
            return
        if self._closed or self._idle is not None:
            p.close()
        else:
            self._idle = p

    async def close(self) -> None:
        self._closed = True
        if self._starting is not None:
            self._starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._starting
        if self._idle is not None:
            self._idle.close()
            self._idle = None


class _Job:
    def __init__(self, cluster: str, job_id: str, attempt: int, backend_job_id: str, adir: str,
                 native: NativeSpec | None) -> None:
        self.cluster = cluster
        self.job_id = job_id
        self.attempt = attempt
        self.backend_job_id = backend_job_id
        self.dir = adir
        self.native = native
        self.state = JobState.QUEUED
        self.reason = states.REASON_SUBMITTED
        self.message = "submitted to Slurm"
        self.exit_code: int | None = None
        self.start_time: float | None = None
        self.end_time: float | None = None
        self.nodes = ""
        self.stale = False
        self.stop_requested = False
        self.seen = False  # Slurm has answered about it at least once
        self.restarts = 0  # Slurm requeues seen (RestartCnt)
        self.roles: tuple[tuple[str, int], ...] = ()
        self.usage: dict[tuple[str, int], ReplicaUsage] = {}  # last sample per replica
        self.accounted = False  # usage holds sacct's final figures


class _Cluster:
    def __init__(self, config: ClusterConfig, ssh: SshClient, log_ssh: SshClient, driver: SlurmDriver) -> None:
        self.config = config
        self.name = config.name
        self.ssh = ssh
        self.log_ssh = log_ssh  # log followers' streams: a connection of their own, opened on first use
        self.options = {k: v for k, v in config.options.items() if not ENV_RE.match(k)}
        self.jobs: dict[str, _Job] = {}
        self.last_error: str | None = None
        #: comment -> Slurm job id of every dlsched job the last good round listed; None before one.
        self.listed: dict[str, str] | None = None
        #: comments of attempts whose sbatch may have landed unseen (look them up before submitting).
        self.unsure: set[str] = set()
        self.state_dir_made = False
        #: Whether the cluster has accounting storage (sacct answers); None until GetClusterInfo says.
        self.accounting: bool | None = None
        self.warm = _WarmSubmitter(
            ssh, f"mkdir -p -- {shlex.quote(render.state_dir_of(self.options))} && exec sbatch --parsable",
            driver._cfg.max_channels >= 3)
        self.poller = poll.Poller(self.run, ssh.username, driver._cfg.poll_interval, self.tracked,
                                  lambda jobs, err, complete: driver._on_round(self, jobs, err, complete),
                                  accounting=lambda: bool(self.accounting))

    async def run(self, command: str, input: str | None = None) -> tuple[int, str, str]:
        r = await self.ssh.run(command, input=input, time_limit=self.driver_timeout)
        return r.exit_status, r.stdout, r.stderr

    driver_timeout = 30.0

    async def submit(self, script: str, cold: str) -> tuple[int, str, str]:
        """``script`` to the warm sbatch if one is ready, else ``cold`` (a fresh command)."""
        p = self.warm.take()
        if p is None:
            return await self.run(cold, input=script)
        r = await p.finish(script.encode(), self.driver_timeout)
        return r.exit_status, r.stdout.decode("utf-8", "replace"), r.stderr.decode("utf-8", "replace")

    def tracked(self) -> list[str]:
        return [j.backend_job_id for j in self.jobs.values() if not j.state.is_terminal()]


ACCOUNTING_MARK = "--- accounting"
#: Seconds GetClusterInfo waits for the controller (ClusterManager's default deadline is 5 s).
INFO_TIME_LIMIT = 3.0


def _same(a: ClusterConfig, b: ClusterConfig) -> bool:
    return a.address == b.address and dict(a.options) == dict(b.options) and a.credentials == b.credentials


DROP_STEP_SECONDS = 5.0


class SlurmDriver(Driver):
    name = "slurm"

    def __init__(self, config: SlurmConfig | None = None) -> None:
        self._cfg = config or SlurmConfig()
        self._launches = LaunchRules()
        self._hub = ObservationHub()
        self._clusters: ClusterRegistry[_Cluster] = ClusterRegistry(self._hub)

    async def close(self) -> None:
        for c in self._clusters.values():
            await self._drop_cluster(c)

    # ------------------------------------------------------------------ clusters

    def _require(self, cluster: str) -> _Cluster:
        return self._clusters.require(cluster)

    async def configure_cluster(self, config: ClusterConfig) -> ClusterInfo:
        old = self._clusters.get(config.name)
        if old is not None and _same(old.config, config):
            return await self._info(old)
        creds = config.credentials
        if not isinstance(creds, SshCredentials):
            raise InvalidArgument.for_field("credentials", "a Slurm cluster needs ssh credentials")
        if not config.address:
            raise InvalidArgument.for_field("address", "the login node, host[:port]")
        env = {k: v for k, v in config.options.items() if ENV_RE.match(k)}
        render.state_dir_of(config.options)

        async def build(_old: _Cluster | None) -> _Cluster:
            ssh = SshClient(config.address, creds.username, creds.private_key, creds.known_host_keys, env=env,
                            max_channels=max(1, min(9, self._cfg.max_channels)))
            log_ssh = SshClient(config.address, creds.username, creds.private_key, creds.known_host_keys,
                                env=env, max_channels=max(0, min(9, self._cfg.max_log_streams)))
            c = _Cluster(config, ssh, log_ssh, self)
            c.driver_timeout = self._cfg.command_timeout
            try:
                await ssh.run("true", time_limit=self._cfg.command_timeout)
            except HostKeyMismatch:
                await ssh.close()
                raise
            except DlschedError as e:
                log.info("cluster %s not reachable yet: %s", config.name, e.message)
            return c

        # keep what was tracked; swap the connections, poller and warm submitter
        c = await self._clusters.configure(config.name, build, carry_over=("jobs", "unsure"),
                                           drop=self._drop_cluster)
        c.poller.start()
        c.warm.refill()
        return await self._info(c)

    async def _drop_cluster(self, c: _Cluster) -> None:
        # Each step bounded: a login node that stops answering (or a machine
        # under load) must not hold RemoveCluster/ConfigureCluster past the
        # caller's deadline; what did not close in time is abandoned.
        for step in (c.warm.close, c.poller.stop, c.ssh.close, c.log_ssh.close):
            try:
                await asyncio.wait_for(step(), DROP_STEP_SECONDS)
            except TimeoutError:
                log.warning("dropping a cluster: %s took over %ss; abandoned",
                            getattr(step, "__qualname__", step), DROP_STEP_SECONDS)

    async def remove_cluster(self, cluster: str) -> None:
        await self._clusters.remove(cluster, drop=self._drop_cluster)

    async def cluster_info(self, cluster: str) -> ClusterInfo:
        return await self._info(self._require(cluster))

    async def _info(self, c: _Cluster) -> ClusterInfo:
        version = f"slurm/{__version__}"
        try:
            # Bounded well below ClusterManager's deadline for GetClusterInfo: a
            # controller that does not answer (scontrol waits ~10 s) is the
            # cluster UNREACHABLE, not this driver unresponsive.
            cmd = "scontrol --oneliner show nodes"
            if c.accounting is None:  # once per cluster: is there accounting storage (sacct)?
                cmd += f"; echo {ACCOUNTING_MARK}; scontrol show config | grep '^AccountingStorageType'"
            r = await c.ssh.run(cmd, time_limit=INFO_TIME_LIMIT)
            rc, out, err = r.exit_status, r.stdout, r.stderr
        except DlschedError as e:
            return ClusterInfo(state=ClusterState.UNREACHABLE, message=f"{e.reason}: {e.message}",
                               supported_run_modes=ALL_RUN_MODES, driver_version=version)
        if rc != 0:
            return ClusterInfo(state=ClusterState.UNREACHABLE, message=f"scontrol: {err.strip()[:300]}",
                               supported_run_modes=ALL_RUN_MODES, driver_version=version)
        out, mark, config = out.partition(f"{ACCOUNTING_MARK}\n")
        if mark and "AccountingStorageType" in config:
            c.accounting = "accounting_storage/none" not in config
        return ClusterInfo(state=ClusterState.READY, capacity=capacity(out),
                           supported_run_modes=ALL_RUN_MODES, driver_version=version)

    # ------------------------------------------------------------------ render / launch

    async def render(self, cluster: str, job_id: str, spec: JobSpec) -> NativeSpec:
        c = self._require(cluster)
        return render.render_job(job_id, spec, 1, c.options).native_spec()

    async def launch(self, cluster: str, job_id: str, spec: JobSpec, attempt: int) -> LaunchResult:
        c = self._require(cluster)
        script = render.render_job(job_id, spec, attempt, c.options)

        def known() -> Known | None:
            prev = c.jobs.get(job_id)
            if prev is None:
                return None
            return Known(prev.cluster, prev.attempt, not prev.state.is_terminal(), lambda: LaunchResult(
                prev.backend_job_id, prev.native or script.native_spec(), self._observe(prev)))

        async def submit() -> LaunchResult:
            backend_id = await self._submit_once(c, script)
            job = _Job(cluster, job_id, attempt, backend_id, script.dir, script.native_spec())
            job.roles = tuple((s.role, s.index) for s in script.steps)
            c.jobs[job_id] = job
            self._publish(job)
            c.poller.wake()
            return LaunchResult(backend_id, script.native_spec(), self._observe(job))

        return await self._launches.launch(cluster, job_id, attempt, known=known, submit=submit)

    async def _lookup_all(self, c: _Cluster, script: SlurmScript) -> list[str]:
        """Slurm job ids of this attempt, oldest first; raises when Slurm cannot tell.
        squeue only reads, so a failed look-up is tried again (a loaded controller or
        login node fails one now and then) before the caller hears of it."""
        for tries in range(LOOKUP_TRIES):
            if tries:
                await asyncio.sleep(0.3 * tries)
            try:
                rc, out, err = await c.run(poll.squeue_command(c.ssh.username, script.job_name))
            except Unavailable:  # transport: a changed host key etc. is not retried
                if tries + 1 == LOOKUP_TRIES:
                    raise
                continue
            if rc == 0:
                break
            log.warning("look-up of %s: squeue exited %s: %s", script.comment, rc, err.strip()[:300])
        else:
            raise BackendUnavailable(f"squeue exited {rc}: {err.strip()[:300]}")
        found = [j.job_id for j in poll.parse_squeue(out).values() if j.comment == script.comment]
        return sorted(found, key=lambda s: int(s) if s.isdigit() else 0)

    async def _lookup(self, c: _Cluster, script: SlurmScript) -> str | None:
        found = await self._lookup_all(c, script)
        return found[0] if found else None

    async def _converge(self, c: _Cluster, script: SlurmScript, submitted: str) -> str:
        """After a retried sbatch: if an earlier, ambiguous sbatch also made a job
        (it landed after our look-up), keep the oldest and cancel the others."""
        try:
            found = await self._lookup_all(c, script)
        except DlschedError:
            return submitted
        if len(found) <= 1:
            return found[0] if found else submitted
        extra = " ".join(shlex.quote(j) for j in found[1:])
        log.warning("duplicate Slurm jobs %s for %s; keeping %s", found[1:], script.comment, found[0])
        with contextlib.suppress(DlschedError):
            await c.run(f"scancel {extra}")
        return found[0]

    async def _submit_once(self, c: _Cluster, script: SlurmScript) -> str:
        if c.listed is None or script.comment in c.unsure:
            existing = await self._lookup(c, script)  # Slurm may hold it and no round has said so
        else:
            existing = c.listed.get(script.comment)
        if existing is not None:
            log.info("adopting Slurm job %s for %s", existing, script.comment)
            c.unsure.discard(script.comment)
            return existing
        cmd = "exec sbatch --parsable"  # exec: the shell never forks, sbatch replaces it
        if not c.state_dir_made:  # the batch output goes there; it must exist before the job starts
            cmd = f"mkdir -p -- {shlex.quote(render.state_dir_of(c.options))} && {cmd}"
        last = ""
        c.unsure.add(script.comment)  # until sbatch answers (a cancelled launch leaves it here)
        for attempt in range(SUBMIT_TRIES):
            if attempt:
                await asyncio.sleep(0.5 * attempt)
            rc, out, err = 255, "", ""
            try:
                if attempt:
                    rc, out, err = await c.run(cmd, input=script.script)
                else:  # the warm sbatch, if one is ready: the same command, started earlier
                    rc, out, err = await c.submit(script.script, cmd)
            except DlschedError as e:
                last = f"{e.reason}: {e.message}"
            if rc == 0 and (jid := out.strip().split(";")[0].strip()).isdigit():
                c.state_dir_made = True
                jid = jid if not attempt else await self._converge(c, script, jid)
                c.unsure.discard(script.comment)
                return jid
            # Failed or ambiguous: Slurm may hold the job anyway. Look before any retry.
            try:
                existing = await self._lookup(c, script)
            except DlschedError as e:
                last = f"{e.reason}: {e.message}"
                continue
            if existing is not None:
                log.warning("sbatch for %s reported failure but submitted job %s; adopting it",
                            script.comment, existing)
                c.unsure.discard(script.comment)
                return existing
            if rc not in (0, 255) and err.strip() and not TRANSIENT_RE.search(err):
                c.unsure.discard(script.comment)  # refused, and the look-up found nothing
                raise SbatchRejected(f"sbatch refused the job: {err.strip()[:500]}",
                                     metadata={"job_id": script.job_id})
            last = last or f"sbatch exited {rc}: {err.strip()[:300]}"
        raise BackendUnavailable(f"could not submit to Slurm: {last}")

    # ------------------------------------------------------------------ polling

    def _on_round(self, c: _Cluster, jobs: dict[str, poll.SlurmJob], error: str | None,
                  complete: bool) -> None:
        if self._clusters.get(c.name) is not c:
            return
        c.last_error = error
        if error is None:
            listed: dict[str, str] = {}
            for sj in sorted(jobs.values(), key=lambda j: -int(j.job_id) if j.job_id.isdigit() else 0):
                if sj.comment.startswith("dlsched-"):
                    listed[sj.comment] = sj.job_id  # the oldest job of an attempt wins
            c.listed = listed
        for job in list(c.jobs.values()):
            if job.state.is_terminal():
                continue
            before = (job.state, job.reason, job.message, job.exit_code, job.stale, job.start_time,
                      job.end_time, job.nodes)
            if error is not None:
                job.stale = True
            else:
                job.stale = False
                sj = jobs.get(job.backend_job_id)
                if sj is not None:
                    self._apply(job, sj)
                elif complete and job.seen:
                    job.state, job.reason = JobState.FAILED, states.REASON_LOST
                    job.message = "Slurm no longer knows the job and its end was never seen"
                    job.end_time = time.time()
            after = (job.state, job.reason, job.message, job.exit_code, job.stale, job.start_time,
                     job.end_time, job.nodes)
            if before != after:
                self._publish(job)

    def _apply(self, job: _Job, sj: poll.SlurmJob) -> None:
        job.seen = True
        m = states.job_state(sj.state, sj.reason)
        job.state, job.reason, job.message = m.state, m.reason, m.message
        if sj.restarts > job.restarts:  # requeued: a new run of the same attempt; forget the old one's end
            job.restarts = sj.restarts
            job.start_time = job.end_time = job.exit_code = None
            job.usage.clear()
        if job.restarts:
            job.message = f"{job.message} (Slurm restart {job.restarts})"
        if job.stop_requested and not m.state.is_terminal():
            job.state, job.reason = JobState.STOPPING, STOP_REQUESTED
        if m.state in (JobState.RUNNING, JobState.STOPPING) or m.state.is_terminal():
            job.start_time = sj.start_time or job.start_time
        job.nodes = sj.nodes if sj.nodes not in ("", "(null)") else job.nodes
        if m.state.is_terminal():
            job.exit_code = sj.exit_status
            job.end_time = sj.end_time or time.time()
            if m.state is JobState.FAILED and sj.exit_status:
                job.message = f"{m.message}; exit code {sj.exit_status}"

    def _observe(self, job: _Job) -> JobObservation:
        reason, message = job.reason, job.message
        if job.stale and not job.state.is_terminal():
            c = self._clusters.get(job.cluster)
            err = c.last_error if c is not None else ""
            reason, message = states.REASON_STALE, f"last known: {job.reason} ({job.message}); {err}"
        rstate = states.replica_state(job.state)
        replicas = tuple(ReplicaStatus(role=r, index=i, state=rstate, host=job.nodes,
                                       exit_code=job.exit_code if job.state.is_terminal() else None)
                         for r, i in job.roles)
        return JobObservation(job_id=job.job_id, backend_job_id=job.backend_job_id, found=True,
                              state=job.state, reason=reason, message=message, exit_code=job.exit_code,
                              replicas=replicas, start_time=job.start_time, end_time=job.end_time,
                              attempt=job.attempt, backend_restarts=job.restarts)

    def _publish(self, job: _Job) -> None:
        self._hub.publish(job.cluster, self._observe(job))

    def _find(self, c: _Cluster, ref: JobRef) -> _Job | None:
        job = c.jobs.get(ref.job_id)
        if job is None or (ref.backend_job_id and ref.backend_job_id != job.backend_job_id):
            return None
        return job

    async def observe(self, cluster: str, refs: Sequence[JobRef]) -> list[JobObservation]:
        c = self._require(cluster)
        unknown = [r for r in refs if r.job_id not in c.jobs and r.backend_job_id.isdigit()]
        if unknown:
            await self._adopt(c, unknown)
        out = []
        for ref in refs:
            job = self._find(c, ref)
            out.append(self._observe(job) if job is not None else JobObservation.not_found(ref))
        return out

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
            job = _Job(c.name, ref.job_id, parsed[1], sj.job_id,
                       render.attempt_dir(c.options, ref.job_id, parsed[1]), None)
            self._apply(job, sj)
            c.jobs[ref.job_id] = job

    def watch(self, cluster: str) -> AsyncIterator[WatchEvent]:
        return self._clusters.watch(cluster, lambda c: [self._observe(j) for j in c.jobs.values()])

    # ------------------------------------------------------------------ stop / cleanup

    async def terminate(self, cluster: str, ref: JobRef, grace_seconds: float | None) -> JobObservation:
        c = self._require(cluster)
        job = self._find(c, ref)
        if job is None:
            return JobObservation.not_found(ref)
        if job.state.is_terminal():
            return self._observe(job)
        rc, _, err = await c.run(f"scancel {shlex.quote(job.backend_job_id)}")
        if rc != 0 and "already" not in err and "Invalid job id" not in err:
            raise BackendUnavailable(f"scancel failed: {err.strip()[:300]}")
        job.stop_requested = True
        job.state, job.reason, job.message = JobState.STOPPING, STOP_REQUESTED, "scancel sent"
        self._publish(job)
        c.poller.wake()
        return self._observe(job)

    async def cleanup(self, cluster: str, ref: JobRef) -> None:
        c = self._require(cluster)
        job = self._find(c, ref)
        if job is None:
            return
        if not job.state.is_terminal():
            await self.terminate(cluster, ref, None)
        jdir = job.dir.rsplit("/", 1)[0]
        batch = shlex.quote(f"{render.state_dir_of(c.options)}/{job.job_id}.")  # ids hold no dot
        await c.run(f"rm -rf -- {shlex.quote(jdir)} {batch}*.batch.stdout {batch}*.batch.stderr")
        c.jobs.pop(job.job_id, None)

    # ------------------------------------------------------------------ usage

    async def usage(self, cluster: str, ref: JobRef) -> JobUsage:
        """``sstat`` of the running steps (one per process, named ``<role>-<index>``;
        the MPI launcher is the batch step; PS-Worker's one ``--multi-prog`` step
        covers all its tasks: ``parse_sstat``), in one remote command with ``squeue
        -s`` for the step names; GPU utilisation and memory from the steps' TRES
        usage (``gres/gpuutil``, ``gres/gpumem``) where the site gathers them.
        An ended job: with accounting storage (GetClusterInfo found it), one
        ``sacct`` of its steps gives the final CPU time and peak memory, even
        after a driver restart. Without it Slurm keeps no usage of an ended job
        (``scontrol show job`` has only its RunTime and allocated TRES; sstat
        says "No steps running"), so it reports the driver's last sample,
        ``running`` false, memory and GPU figures 0 (lost when the driver
        restarts)."""
        c = self._require(cluster)
        job = self._find(c, ref)
        if job is None:
            raise JobNotFound(ref.job_id)
        launcher = next(((r, i) for r, i in job.roles if r == "launcher"), None)
        tasks = [k for k in job.roles if k != launcher]  # PS-Worker's tasks share one step
        if not job.state.is_terminal():
            jid = shlex.quote(job.backend_job_id)
            rc, out, _ = await c.run(
                f"sstat --noheader --parsable2 --allsteps -j {jid} -o {SSTAT_FIELDS}; "
                f"echo '--- steps'; squeue --noheader --steps --jobs={jid} -o '%i|%j'")
            stats, _, names = out.partition("--- steps\n")
            for k, u in list(job.usage.items()):
                job.usage[k] = _not_running(u)
            for key, sample in parse_sstat(stats, names, launcher, tasks).items():
                prev = job.usage.get(key)
                job.usage[key] = dataclasses.replace(
                    sample, cpu_seconds=max(sample.cpu_seconds, prev.cpu_seconds if prev else 0.0),
                    peak_memory_bytes=max(sample.peak_memory_bytes, prev.peak_memory_bytes if prev else 0))
        else:
            for k, u in list(job.usage.items()):
                job.usage[k] = _not_running(u)
            if c.accounting and not job.accounted:
                rc, out, _ = await c.run(f"sacct --noheader --parsable2 -j {shlex.quote(job.backend_job_id)} "
                                         f"-o {SACCT_USAGE_FIELDS}")
                if rc == 0 and (final := parse_sacct_steps(out, launcher, tasks)):
                    job.usage.update(final)
                    job.accounted = True
        out_list = [job.usage.get((r, i), ReplicaUsage(role=r, replica_index=i)) for r, i in job.roles]
        return JobUsage(replicas=tuple(out_list), sample_time=time.time())

    # ------------------------------------------------------------------ logs

    @property
    def _log_poll_interval(self) -> float:
        """How often a polling follower reads, and a streaming one checks whether its job ended."""
        return max(LOG_POLL_FLOOR, min(1.0, self._cfg.poll_interval))

    def tail_logs(self, cluster: str, ref: JobRef, query: LogQuery) -> AsyncIterator[list[LogEntry]]:
        return self._tail(cluster, ref, query)

    async def _tail(self, cluster: str, ref: JobRef, query: LogQuery) -> AsyncIterator[list[LogEntry]]:
        job = self._find(self._require(cluster), ref)
        if job is None:
            raise JobNotFound(ref.job_id)
        cursor = slogs.LogCursor(query)
        while True:
            c = self._require(cluster)  # a reconfigured cluster has new connections
            gone = c.jobs.get(job.job_id) is not job
            ended = job.state.is_terminal() or gone
            out = await c.ssh.run_bytes(cursor.read_script(job.dir), time_limit=c.driver_timeout, call="tail")
            batch = cursor.feed(slogs.parse_frames(out.stdout), ended)
            if batch:
                yield batch
            if cursor.more():
                continue  # a capped chunk: read on at once
            if ended or not query.follow:
                return
            if c.log_ssh.channel_free():
                try:
                    async with contextlib.aclosing(self._stream(c, job, cursor)) as stream:
                        async for batch in stream:
                            yield batch
                    return
                except DlschedError as e:  # go on reading from where the stream's last round left off
                    log.info("log stream of %s ended early (%s); reading by polls", job.job_id, e.message)
            await asyncio.sleep(self._log_poll_interval)

    async def _stream(self, c: _Cluster, job: _Job, cursor: slogs.LogCursor) -> AsyncIterator[list[LogEntry]]:
        """Follow on one long-lived channel of the cluster's log connection (``logs.stream_script``)
        until the job has ended and every file is drained. Rounds are applied whole, so when the
        channel fails the cursor stands at the end of the last whole round and nothing is lost or
        said twice."""
        proc = await c.log_ssh.start(slogs.stream_script(job.dir, cursor.offsets(), STREAM_INTERVAL, cursor.query),
                                     call="tail", wait=False)
        rounds: asyncio.Queue[list[slogs.Frame] | None | DlschedError] = asyncio.Queue()

        async def read() -> None:
            frames: list[slogs.Frame] = []
            try:
                while True:
                    line = await proc.readline()
                    h = slogs.parse_header(line) if line else None
                    if h is None:
                        raise BackendUnavailable("the log stream ended without its end frame")
                    n, start, size, mtime, name = h
                    if name == slogs.STREAM_END:
                        await rounds.put(None)
                        return
                    if name == slogs.ROUND_END:
                        await rounds.put(frames)
                        frames = []
                        continue
                    frames.append(slogs.Frame(name, start, size, mtime, await proc.readexactly(n) if n else b""))
            except DlschedError as e:
                await rounds.put(e)

        reader = asyncio.create_task(read(), name=f"slurm-log-stream-{job.job_id}")
        check = self._log_poll_interval
        ending = False
        getter: asyncio.Task[list[slogs.Frame] | None | DlschedError] | None = None
        try:
            while True:
                # not wait_for(rounds.get()): its timeout can race the get and lose the item
                getter = getter or asyncio.create_task(rounds.get())
                done, _ = await asyncio.wait({getter}, timeout=check)
                if not done:
                    if not ending and (job.state.is_terminal() or c.jobs.get(job.job_id) is not job):
                        proc.end_input()  # drain every file, then the end frame
                        ending = True
                    continue
                got, getter = getter.result(), None
                if isinstance(got, DlschedError):
                    raise got
                if got is None:
                    if batch := cursor.feed([], ended=True):
                        yield batch
                    return
                if batch := cursor.feed(got, ended=False):
                    yield batch
        finally:
            proc.close()
            if getter is not None:
                getter.cancel()
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader


# --------------------------------------------------------------------------- parsing

#: sstat's columns for ``parse_sstat``.
SSTAT_FIELDS = "JobID,AveCPU,MaxRSS,AveRSS,TRESUsageInAve"


def parse_sstat(stats: str, step_names: str, launcher: tuple[str, int] | None,
                tasks: Sequence[tuple[str, int]] = ()) -> dict[tuple[str, int], ReplicaUsage]:
    """``sstat --parsable2 -o SSTAT_FIELDS`` lines and ``squeue --steps -o '%i|%j'``
    lines -> a running sample per replica (steps are named ``<role>-<index>``; the
    batch step is the MPI launcher). PS-Worker's tasks share one step, which Slurm
    measures as a whole: each task gets the step's per-task average (AveCPU, AveRSS;
    so the tasks' CPU times still add up to the step's) and its highest peak. GPU figures come from the TRES usage when the
    site's Slurm gathers them (``gres/gpuutil``, percent; ``gres/gpumem``), else 0."""
    label = {}
    for line in step_names.splitlines():
        sid, _, name = line.partition("|")
        label[sid.strip()] = name.strip()
    out: dict[tuple[str, int], ReplicaUsage] = {}
    for line in stats.splitlines():
        parts = line.split("|")
        if len(parts) < 4:
            continue
        sid = parts[0].strip()
        tres = _tres(parts[4]) if len(parts) > 4 else {}
        try:
            gpu_util = float(tres.get("gres/gpuutil", "0") or 0)
        except ValueError:
            gpu_util = 0.0
        for key in _replicas_of(sid, label.get(sid, ""), launcher, tasks):
            out[key] = ReplicaUsage(role=key[0], replica_index=key[1], cpu_seconds=_duration(parts[1]),
                                    memory_bytes=_size(parts[3]), peak_memory_bytes=_size(parts[2]),
                                    gpu_utilization_percent=gpu_util,
                                    gpu_memory_bytes=_size(tres.get("gres/gpumem", "0")), running=True)
    return out


def _replicas_of(step_id: str, step_name: str, launcher: tuple[str, int] | None,
                 tasks: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
    """The replicas a Slurm step ran: ``<job>.batch`` is the MPI launcher (if any), the
    PS-Worker ``--multi-prog`` step (``render.TASKS_STEP``) all of ``tasks``, other steps
    are named ``<role>-<index>`` (render); anything else (extern) none."""
    if step_id.endswith(".batch"):
        return [launcher] if launcher is not None else []
    if step_name == render.TASKS_STEP:
        return list(tasks)
    m = LOG_LINE_RE.match(step_name + ".stdout")
    return [(m.group(1), int(m.group(2)))] if m is not None else []


def _not_running(u: ReplicaUsage) -> ReplicaUsage:
    """A sample kept after its step ended: CPU time and peak stay, current figures go."""
    return dataclasses.replace(u, memory_bytes=0, gpu_utilization_percent=0.0, gpu_memory_bytes=0,
                               running=False)


#: sacct's columns for ``parse_sacct_steps``.
SACCT_USAGE_FIELDS = "JobID,JobName,TotalCPU,MaxRSS"


def parse_sacct_steps(text: str, launcher: tuple[str, int] | None,
                      tasks: Sequence[tuple[str, int]] = ()) -> dict[tuple[str, int], ReplicaUsage]:
    """``sacct --parsable2 -j <job> -o SACCT_USAGE_FIELDS`` -> the final figures per
    replica of an ended job: its step's total CPU time and peak memory (``<id>.batch``
    is the MPI launcher; steps are named ``<role>-<index>``)."""
    out: dict[tuple[str, int], ReplicaUsage] = {}
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) < 4 or "." not in parts[0]:
            continue  # the allocation line carries no usage of its own
        keys = _replicas_of(parts[0].strip(), parts[1].strip(), launcher, tasks)
        for key in keys:  # a step of several tasks: TotalCPU is their sum, MaxRSS their highest
            out[key] = ReplicaUsage(role=key[0], replica_index=key[1], cpu_seconds=_duration(parts[2]) / len(keys),
                                    peak_memory_bytes=_size(parts[3]), running=False)
    return out


def _tres(value: str) -> dict[str, str]:
    """``cpu=00:00:01,gres/gpumem=512M,gres/gpuutil=37,mem=10M`` -> {name: value}."""
    out = {}
    for item in value.split(","):
        k, sep, v = item.partition("=")
        if sep:
            out[k.strip()] = v.strip()
    return out



def _duration(value: str) -> float:
    """sstat times: ``[D-][HH:]MM:SS[.mmm]`` -> seconds."""
    v = value.strip()
    days = 0
    if "-" in v:
        d, _, v = v.partition("-")
        days = int(d) if d.isdigit() else 0
    secs = 0.0
    try:
        for part in v.split(":"):
            secs = secs * 60 + float(part)
    except ValueError:
        return 0.0
    return days * 86400 + secs


def _size(value: str) -> int:
    """``64608K`` / ``1.5M`` / ``2G`` / ``123`` -> bytes."""
    v = value.strip()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(v[-1:].upper(), 1)
    num = v[:-1] if mult != 1 else v
    try:
        return int(float(num) * mult)
    except ValueError:
        return 0


# --------------------------------------------------------------------------- capacity


def _mib(value: str) -> int:
    return int(value) << 20 if value.isdigit() else 0


def _gres_gpus(gres: str) -> list[tuple[str, int]]:
    """``gpu:a100:4(S:0-1),gpu:2`` -> [("a100", 4), ("", 2)]."""
    out = []
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] != "gpu" or len(parts) < 2:
            continue
        count = parts[-1]
        if count.isdigit():
            out.append((parts[1] if len(parts) > 2 else "", int(count)))
    return out


def capacity(scontrol_nodes: str) -> ClusterCapacity:
    """``scontrol --oneliner show nodes`` -> capacity (CPUs, memory, GPUs, allocated vs total)."""
    nodes = [poll._key_values(line) for line in scontrol_nodes.splitlines() if line.startswith("NodeName=")]
    cpus_t = cpus_f = 0.0
    mem_t = mem_f = 0
    gpus_t = gpus_f = 0
    nodes_free = 0
    max_cpu, max_mem, max_gpu = 0.0, 0, 0
    inventory: dict[str, list[int]] = {}
    for n in nodes:
        state = n.get("State", "").upper()
        usable = not any(s in state for s in ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "FUTURE"))
        total = float(n.get("CPUTot", "0") or 0)
        alloc = float(n.get("CPUAlloc", "0") or 0)
        mem = _mib(n.get("RealMemory", "0"))
        amem = _mib(n.get("AllocMem", "0"))
        g = _gres_gpus(n.get("Gres", ""))
        gtot = sum(c for _, c in g)
        galloc = 0
        m = re.search(r"gres/gpu=(\d+)", n.get("AllocTRES", ""))
        if m:
            galloc = int(m.group(1))
        cpus_t += total
        mem_t += mem
        gpus_t += gtot
        if usable:
            cpus_f += max(0.0, total - alloc)
            mem_f += max(0, mem - amem)
            gpus_f += max(0, gtot - galloc)
            if alloc < total:
                nodes_free += 1
        max_cpu, max_mem, max_gpu = max(max_cpu, total), max(max_mem, mem), max(max_gpu, gtot)
        for t, cnt in g:
            inv = inventory.setdefault(t, [0, 0])
            inv[0] += cnt
            inv[1] += cnt if usable and not galloc else 0
    return ClusterCapacity(
        nodes_total=len(nodes), nodes_free=nodes_free, cpus_total=cpus_t, cpus_free=cpus_f,
        memory_bytes_total=mem_t, memory_bytes_free=mem_f, gpus_total=gpus_t, gpus_free=gpus_f,
        gpus=tuple(GpuInventory(gpu_type=t, total=v[0], free=v[1]) for t, v in sorted(inventory.items())),
        max_cpus_per_node=max_cpu, max_memory_bytes_per_node=max_mem, max_gpus_per_node=max_gpu,
    )
