"""``SlurmDriver``: jobs as sbatch submissions on a login node reached over SSH.

A cluster's address is the login node ``host[:port]``; its credentials are ``SshCredentials``
(user, private key, pinned host keys). Options: upper-case names (``SLURM_CONF``, ``PATH`` ...)
are exported before every remote command; ``partition`` (the default partition), ``state_dir``
(where job scripts write their logs; default ``.dlsched/slurm`` under the SSH user's home; must
be shared with the compute nodes), ``max_nodes`` and ``port_range`` (``LO-HI``, where the job
script picks rendezvous ports) go to ``render``.

The driver is the kit's ``BackendDriver`` (``drivers.common.skeleton``: the
public operations, the attempt rules, cluster look-up) over these hooks and
one module per concern: ``render`` the script (check → place → emit) and the
job's metadata codec (``dlsched-<job_id>.<attempt>.<uid>``), ``adapter`` the Slurm
commands over SSH with the one mapping of their exits to errors (and
exactly-once submission), ``poller`` the shared squeue rounds, ``cluster`` what is
kept per cluster, ``jobs`` what those rounds make of a tracked job, ``states`` the state table, ``logs`` the
log files and followers, ``usage`` sstat/sacct and the node capacity.

Launch: ``adapter.SlurmClient.submit``, exactly once (its docstring: every job submitted held, only
the one adopted for the attempt released, in the background, again each round while held); each
poll round cancels what no driver will ever release (``strays``); a job cancelled while held is
``voided``; a job id used again after a delete is a new job (its uid in the comment differs).

State: one ``Poller`` per cluster (one ``squeue`` per interval for all tracked jobs, one
``sacct``/``scontrol`` follow-up only for jobs missing from it; a launch or stop never adds a
round). While a round fails (SSH or slurmctld down) every job keeps its last known state, with
reason ``BackendStale`` and the error in the message: nothing turns FAILED on an outage. A tracked
job that both squeue and the follow-up no longer know, while the controller answers, ends FAILED
reason ``LeftSlurm`` (or keeps its terminal state if one was seen). A job Slurm requeues stays the
same dlsched attempt (``jobs``): QUEUED again, then RUNNING, ``backend_restarts`` counting. Jobs the
driver does not know (after a restart) are adopted on the first observation that names them,
answered by the next poll round.

Stop (``SlurmClient.stop``): the ``stopping`` mark first, always; then a job the last round saw
RUNNING has its steps' processes get SIGTERM (``scancel --signal=TERM``) and the stop's grace
(``--grace-seconds`` when it names none); a poll round then kills it (``scancel --signal=KILL``, not
a plain ``scancel``'s second SIGTERM and KillWait). Any other job (not seen running yet: the mark
tells its script the ends are the stop's), an MPI job (its ranks are mpirun's children in the batch
step, which the step signal misses), a stop with no grace and a cleanup are ``scancel``ed at once. A
job that ends after a stop reached it is STOPPED; stopping an ended job is fine.
A stop or cleanup by a ref the driver does not track (it restarted) adopts the job first. A cleanup by
job id alone (a new job of that id, refused NAME_COLLISION) cancels every job of the id Slurm still
runs; until they have ended, a launch of the id is UNAVAILABLE (they may still run in its directory),
for ``ENDING_WINDOW``. A cleanup removes no files while another job of the id may use them.

Bounded memory (``ForgetJobs``): a job whose end JobManager recorded leaves
memory once its record is written (``records``); untracked jobs are looked up there first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Container, Iterable, Sequence

from dlsched import __version__
from dlsched.errors import DlschedError, InvalidArgument
from dlsched.kit.parse import decimal
from drivers.common.base import (
    ClusterCapacity,
    ClusterConfig,
    ClusterInfo,
    ClusterState,
    JobNotFound,
    JobObservation,
    JobRef,
    JobSpec,
    JobState,
    JobUsage,
    LaunchResult,
    LogEntry,
    LogQuery,
    SshCredentials,
    same_job,
)
from drivers.common.launches import Known
from drivers.common.planner import ALL_RUN_MODES
from drivers.common.registry import BackendUnavailable
from drivers.common.skeleton import BackendDriver, render_off_loop
from drivers.slurm import exits, records, render, strays, usage
from drivers.slurm import logs as slogs
from drivers.slurm import poller as poll
from drivers.slurm.adapter import (
    SbatchRejected,
    SlurmClient,
    bounded,
    ended,
    held_by_dlsched,
    is_held,
    listing,
    voided,
)
from drivers.slurm.cluster import SlurmCluster
from drivers.slurm.config import SlurmConfig
from drivers.slurm.jobs import TrackedJob
from drivers.slurm.render import SlurmScript
from drivers.slurm.ssh import ENV_RE, Congested, HostKeyMismatch

log = logging.getLogger("dlsched.driver.slurm")

#: Seconds GetClusterInfo may spend on the login node (ClusterManager waits 5 s): past it, a
#: look-up in progress counts as slow (the command is given up and killed there).
INFO_BUDGET = 3.5
PING_BUDGET = 1.0  # of which the controller ping (one quick RPC) always gets at least this much

RECORD_RETRY_SECONDS = 5.0  # between tries to write forgotten jobs' records while they fail
#: how long after its cleanup a job Slurm still runs holds back a launch of its id (UNAVAILABLE; KillWait: 30 s)
ENDING_WINDOW = 300.0

__all__ = ["SbatchRejected", "SlurmConfig", "SlurmDriver"]


class SlurmDriver(BackendDriver[SlurmCluster, SlurmScript]):
    name = "slurm"
    backend_noun = "the login node"
    info_budget = INFO_BUDGET + 0.75  # its own bound answers first; the kit's cuts a wait behind a look-up
    #: kept across a reconfiguration: what was tracked; the connections, poller and warm sbatch are new
    carry_over = ("jobs", "recording", "unsure", "late", "to_release", "launching", "held_since", "claiming",
                  "retired")
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
        render.check_options(config.options)

    def _unchanged(self, old: SlurmCluster, config: ClusterConfig) -> bool:
        a = old.config
        return a.address == config.address and dict(a.options) == dict(config.options) \
            and a.credentials == config.credentials

    async def _connect(self, config: ClusterConfig, old: SlurmCluster | None) -> SlurmCluster:
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
        return SlurmCluster(config, client, self.config.poll_interval, self._on_round)

    async def _disconnect(self, c: SlurmCluster) -> None:
        # Each step bounded: a login node that stops answering (or a machine
        # under load) must not hold RemoveCluster/ConfigureCluster past the
        # caller's deadline; what did not close in time is abandoned.
        await bounded(c.poller.stop())
        if c.record_writer is not None:  # a new record of the cluster carries ``recording`` on
            c.record_writer.cancel()
        await c.client.close()

    async def _activate(self, name: str, c: SlurmCluster) -> None:
        c.poller.start()
        c.client.warm.refill()
        if c.recording:  # carried over from the record a reconfiguration replaced
            self._start_record_writer(c)

    async def _info(self, c: SlurmCluster) -> ClusterInfo:
        """Health and capacity at a bounded controller cost: while the poller polls, health
        is its last round (no call of its own) and capacity is looked up every
        ``capacity_interval``, taking one round's slot (``Poller.charge``); with nothing
        polled, one look-up (``scontrol show nodes``) every ``idle_check_interval`` says
        both. A cluster answering slowly over a live connection (``ssh.Congested``: a
        command timed out, no channel or session freed in time) is DEGRADED, unless
        ``scontrol ping`` says slurmctld is down (a dead controller makes squeue wait ~10 s,
        which may look slow); one that cannot be reached, or whose commands fail, is
        UNREACHABLE."""
        async with c.info_lock:  # concurrent callers share one look-up
            deadline = time.monotonic() + INFO_BUDGET
            busy = c.poller.busy()
            every = self.config.capacity_interval if busy else self.config.idle_check_interval
            if c.capacity is None:  # never answered yet: look again sooner
                every = min(every, poll.MIN_INTERVAL)
            if c.looked_up is None or time.monotonic() - c.looked_up >= every:
                await self._look_up(c, busy, INFO_BUDGET - PING_BUDGET)
            state, message = self._health(c)
            if state is ClusterState.DEGRADED:  # slow, or is nothing answering at all?
                try:
                    why = await asyncio.wait_for(c.client.controller_down(),
                                                 max(PING_BUDGET, deadline - time.monotonic()))
                    if why:
                        state, message = ClusterState.UNREACHABLE, f"BACKEND_UNAVAILABLE: {why}"
                except TimeoutError:
                    pass  # too slow to tell: DEGRADED
                except DlschedError as e:
                    state, message = ClusterState.UNREACHABLE, f"{e.reason}: {e.message}"
        return ClusterInfo(state=state, message=message,
                           capacity=c.capacity or ClusterCapacity(),
                           supported_run_modes=ALL_RUN_MODES, driver_version=f"slurm/{__version__}")

    async def _look_up(self, c: SlurmCluster, busy: bool, budget: float) -> None:
        error: DlschedError | None = None
        try:
            # Bounded well below ClusterManager's deadline for GetClusterInfo: a
            # controller or login node that does not answer in time is the cluster
            # slow or UNREACHABLE, never this driver unresponsive.
            nodes, accounting = await asyncio.wait_for(c.client.info(ask_accounting=c.accounting is None),
                                                       budget)
        except TimeoutError:
            error = Congested(f"the capacity look-up took over {budget:g}s")
        except DlschedError as e:
            error = e
        else:
            c.capacity = usage.capacity(nodes)
            if accounting is not None:
                c.accounting = accounting
        c.looked_up = time.monotonic()
        c.lookup_result = (c.looked_up, error)
        if busy:
            c.poller.charge()

    def _health(self, c: SlurmCluster) -> tuple[ClusterState, str]:
        """The state the latest of the poller's round and the look-up says, and why."""
        results = [r for r in (c.poller.last_round, c.lookup_result) if r is not None]
        error = max(results, key=lambda r: r[0])[1] if results else None
        if isinstance(error, Congested) and c.client.ssh.connected():
            return ClusterState.DEGRADED, f"the login node answers slowly: {error.reason}: {error.message}"
        if error is not None:
            return ClusterState.UNREACHABLE, f"{error.reason}: {error.message}"
        if c.capacity is None:
            return ClusterState.PENDING, "capacity not looked up yet"
        return ClusterState.READY, ""

    # ------------------------------------------------------------------ render / launch

    async def _prepare(self, c: SlurmCluster, job_id: str, spec: JobSpec, attempt: int, uid: str) -> SlurmScript:
        return await render_off_loop(spec, render.render_job, job_id, spec, attempt, c.options, uid=uid,
                                     stop_grace=self.config.grace_seconds)

    def _known(self, c: SlurmCluster, job_id: str, rendered: SlurmScript) -> Known | None:
        prev = c.jobs.get(job_id) or c.recording.get(job_id)
        if prev is None:
            return None
        return Known(prev.cluster, prev.attempt, not prev.state.is_terminal(), lambda: LaunchResult(
            prev.backend_job_id, prev.native or rendered.native_spec(), c.observation(prev)), prev.uid)

    async def _submit(self, c: SlurmCluster, name: str, job_id: str, spec: JobSpec, attempt: int,
                      rendered: SlurmScript) -> LaunchResult:
        marks = {rendered.comment}  # what it may adopt, see ``SlurmScript.marks``
        c.launching.update(marks)  # its job may sit held a while: not a stray
        try:
            ending = {k: time.monotonic() - t < ENDING_WINDOW for k, (t, j) in c.retired.items() if j == job_id}
            backend_id, held = await c.client.submit(rendered, c.listed, c.unsure, c.late, c.retired, ending,
                                                     attempt_rules=self._known(c, job_id, rendered) is None)
        finally:
            c.launching.difference_update(marks)
        # no native spec kept (a few KiB): a repeated launch renders it again (``_known``)
        job = TrackedJob(name, job_id, attempt, backend_id, rendered.dir, None,
                         roles=rendered.roles, hosts=rendered.hosts, uid=rendered.uid)
        c.jobs[job_id] = job
        if held:  # tracked first: the release is ours now, off the launch's path
            c.to_release.add(backend_id)
            self._later(c, "release", backend_id, job_id)
        self._publish(c, job)
        c.poller.wake()
        return LaunchResult(backend_id, rendered.native_spec(), c.observation(job))

    # ------------------------------------------------------------------ polling and observing

    def _on_round(self, c: SlurmCluster, jobs: dict[str, poll.SlurmJob], error: str | None,
                  complete: bool) -> None:
        if self.clusters.get(c.name) is not c:
            return
        c.last_error = error
        if error is None:
            attempts: dict[str, list[poll.SlurmJob]] = {}
            c.retired = {k: t for k, t in c.retired.items() if k in jobs or time.monotonic() - t[0] < 60}
            for listed in jobs.values():
                if render.is_ours(listed.comment) and not voided(listed) and listed.job_id not in c.retired:
                    attempts.setdefault(listed.comment, []).append(listed)
            c.listed = listing(attempts)
            self._cancel_strays(c, attempts)
        for job in list(c.jobs.values()):
            sj = job.listed(jobs.get(job.backend_job_id))  # (None: its id handed out again)
            if (sj is not None and error is None and held_by_dlsched(sj) and job.released and not job.stop_requested
                    and job.start_time is None and job.backend_job_id not in c.to_release):
                c.to_release.add(job.backend_job_id)  # held again: slurmctld lost the release we made
            if job.backend_job_id in c.to_release and error is None and sj is not None:
                if is_held(sj):
                    self._later(c, "release", job.backend_job_id, job.job_id)
                else:
                    c.to_release.discard(job.backend_job_id)
            if error is None and job.kill_due(time.monotonic()):
                self._later(c, "kill", job.backend_job_id, job.job_id)
            released = job.backend_job_id not in c.to_release and job.note_release(None)  # held no more
            if not job.state.is_terminal() and (job.round(sj, error, complete) or released):
                self._publish(c, job)
                if job.unschedulable:  # reported FAILED; take it out of Slurm's queue
                    self._later(c, "cancel", job.backend_job_id)
            if job.needs_exits and error is None:  # ended: its processes' ends are read before the end is reported
                self._read_exits(c, job)

    def _cancel_strays(self, c: SlurmCluster, attempts: dict[str, list[poll.SlurmJob]]) -> None:
        """Cancel the jobs no driver will ever release (``strays``)."""
        def tracked(job_id: str, attempt: int, uid: str) -> str | None:
            job = c.jobs.get(job_id)
            return job.backend_job_id if job is not None and job.attempt == attempt and \
                same_job(job.uid, uid) else None

        def wanted(comment: str, job_id: str, attempt: int, uid: str) -> bool:  # by any configuration of this process
            return any(comment in x.launching or ((j := x.jobs.get(job_id)) is not None and j.attempt == attempt
                                                 and same_job(j.uid, uid))
                       for x in self.clusters.values())

        now = time.monotonic()
        since = self.clusters.observed_since(c.name)
        observed_for = None if since is None else now - since
        for jid, why in strays.find(attempts, tracked=tracked, wanted=wanted, held_since=c.held_since,
                                    now=now, grace=self.config.held_grace,
                                    window=self.config.adopt_window, observed_for=observed_for):
            if any(jid in x.claiming for x in self.clusters.values()):
                continue  # JobManager claims it: adopted once this round is through
            log.warning("cancelling Slurm job %s: %s", jid, why)
            self._later(c, "cancel", jid)

    def _later(self, c: SlurmCluster, action: str, backend_job_id: str, job_id: str = "") -> None:
        """``scancel`` ("cancel"; "kill": ``job_id``'s stop grace is over) or ``scontrol release`` ("release") in
        the background; a failure is logged (the next round asks again), a release's also in ``job_id``'s job."""
        async def call() -> None:
            try:
                if action == "release":
                    await c.client.release(backend_job_id)
                    c.to_release.discard(backend_job_id)
                    self._release_failed(c, job_id, backend_job_id, None)
                else:
                    await (c.client.kill if action == "kill" else c.client.cancel)(backend_job_id)
                    if action == "kill" and (job := c.jobs.get(job_id)) is not None \
                            and job.backend_job_id == backend_job_id:
                        job.killed = True  # (a failed one is asked again the next round)
            except DlschedError as e:
                log.warning("%s of Slurm job %s: %s", action, backend_job_id, e.message)
                if action == "release" and backend_job_id in c.to_release:  # else: held no more
                    self._release_failed(c, job_id, backend_job_id, e.message)

        self._once(c, (action, backend_job_id), call)

    def _release_failed(self, c: SlurmCluster, job_id: str, backend_job_id: str, error: str | None) -> None:
        """Job ``job_id``, still Slurm job ``backend_job_id``, reports why its release failed, or no more."""
        job = c.jobs.get(job_id)
        if (self.clusters.get(c.name) is c and job is not None and job.backend_job_id == backend_job_id
                and job.note_release(error, released=error is None) and not job.state.is_terminal()):
            self._publish(c, job)

    def _read_exits(self, c: SlurmCluster, job: TrackedJob) -> None:
        """Read an ended job's exits file (``exits``) in the background, one read per job at a
        time; the job reports its end once it is read (or could not be, ``exits.MAX_READS`` times)."""
        async def call() -> None:
            found, absent = None, False  # absent: read, and no file (the command prints nothing)
            try:
                rc, out, _ = await c.client.run(exits.read_command(job.dir))
                found, absent = (exits.parse(out), not out) if rc == 0 else (None, False)
            except DlschedError as e:
                log.warning("reading the exits of Slurm job %s: %s", job.backend_job_id, e.message)
            if job.exits_read(found, absent) and c.jobs.get(job.job_id) is job:
                self._publish(c, job)

        self._once(c, ("exits", job.backend_job_id), call)

    def _once(self, c: SlurmCluster, key: tuple[str, str], work: Callable[[], Awaitable[None]]) -> None:
        """``work`` in the background, unless work of the same ``key`` (action, Slurm job id) runs."""
        if key in c.pending:
            return
        c.pending.add(key)

        async def call() -> None:
            try:
                await work()
            finally:
                c.pending.discard(key)

        task = asyncio.create_task(call(), name=f"slurm-{key[0]}-{key[1]}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _publish(self, c: SlurmCluster, job: TrackedJob) -> None:
        self.hub.publish(job.cluster, c.observation(job))

    def _snapshot(self, c: SlurmCluster) -> Iterable[JobObservation]:
        return [c.observation(j) for j in c.jobs.values()]

    def _lookup(self, c: SlurmCluster, ref: JobRef) -> JobObservation | None:
        job = c.find_known(ref)
        return c.observation(job) if job is not None else None

    async def _observe(self, c: SlurmCluster, refs: Sequence[JobRef]) -> list[JobObservation | None]:
        untracked = [r for r in refs if c.find_known(r) is None and decimal(r.backend_job_id)]
        recorded = await self._recorded(c, untracked) if untracked else {}
        unknown = [r for r in untracked if r.job_id not in c.jobs and (r.job_id, r.backend_job_id) not in recorded]
        if unknown and not await self._adopt(c, unknown):
            # No round answered (slurmctld or the login node down): unknown is not gone.
            raise BackendUnavailable(f"Slurm did not answer for {len(unknown)} job(s) this driver does not track yet")
        out: list[JobObservation | None] = []
        for ref in refs:
            gone = recorded.get((ref.job_id, ref.backend_job_id))
            out.append(gone.observation(None) if gone is not None else self._lookup(c, ref))
        return out

    async def _adopt(self, c: SlurmCluster, refs: Sequence[JobRef], release: bool = True) -> bool:
        """Track jobs submitted before this driver started, from the next poll round's answer
        (releasing a held one unless ``release`` is False); whether the round answered."""
        ids = [r.backend_job_id for r in refs]
        c.claiming.update(ids)  # the round that lists them must not cancel them as strays
        try:
            jobs = await c.poller.fresh(ids)
        finally:
            c.claiming.subtract(ids)
            for jid in ids:
                if c.claiming[jid] <= 0:
                    del c.claiming[jid]
        if jobs is None:
            return False
        for ref in refs:
            sj = jobs.get(ref.backend_job_id)
            parsed = render.parse_comment(sj.comment) if sj is not None else None
            if sj is None or parsed is None or parsed[0] != ref.job_id or ref.job_id in c.jobs:
                continue
            job = TrackedJob(c.name, ref.job_id, parsed[1], sj.job_id,
                             render.attempt_dir(c.options, ref.job_id, parsed[1]), None, uid=parsed[2])
            job.apply(sj)
            c.jobs[ref.job_id] = job
            if release and held_by_dlsched(sj):
                # submitted held by a driver that died before releasing it (an admin's hold stays)
                c.to_release.add(sj.job_id)
                self._later(c, "release", sj.job_id, ref.job_id)
        return True

    # ------------------------------------------------------------------ stop / cleanup

    async def _terminate(self, c: SlurmCluster, name: str, ref: JobRef,
                         grace_seconds: float | None) -> JobObservation | None:
        job = c.find(ref)
        if job is None and decimal(ref.backend_job_id):  # forgotten: it ended; else submitted before
            if (gone := await self._forgotten(c, ref)) is not None:  # this driver started: adopted
                return c.observation(gone)
            if not await self._adopt(c, [ref], release=False):  # (held: cancelled before it may start)
                raise BackendUnavailable("Slurm did not answer the look-up of the job to stop")
            job = c.find(ref)
        if job is None or not ref.names_uid(job.uid):  # unknown (or another uid's): nothing to stop
            return None
        if job.stop_requested or job.id_lost:  # a stop reached it (its grace runs, or it was cancelled); or lost
            return c.observation(job)
        grace = self.config.grace_seconds if grace_seconds is None else grace_seconds
        # SIGTERM to the steps of a job that may run (MPI's ranks are mpirun's, in the batch step: scancel)
        how = await c.client.stop(job.backend_job_id, job.dir, signal=grace > 0 and not job.hosts,
                                  running=job.state is JobState.RUNNING and job.reason == "Running")
        if how is not None:  # (else it ended already: a round reports it)
            job.stop_sent(grace if how == "signal" else None)
        self._publish(c, job)
        c.poller.wake()
        return c.observation(job)

    async def _cleanup(self, c: SlurmCluster, name: str, ref: JobRef) -> None:
        job = c.find(ref)  # its job id may come back as a new job: the Slurm id is retired
        if job is not None:
            c.retired[job.backend_job_id] = (time.monotonic(), ref.job_id)
        else:  # forgotten (its record written or being written), or not tracked here
            job = await self._forgotten(c, ref)
            if job is None:
                return await self._cleanup_untracked(c, ref)
            c.retired[job.backend_job_id] = (time.monotonic(), ref.job_id)
            if c.recording.get(job.job_id) is job:
                del c.recording[job.job_id]
                if (writer := c.record_writer) is not None and not writer.done():  # it may hold its record:
                    await asyncio.wait([writer], timeout=self.config.command_timeout)  # removed after it
            return await self._remove_files(c, job.job_id)
        if (not job.state.is_terminal() or job.unschedulable) and not job.id_lost:  # (unschedulable: maybe queued)
            await c.client.cancel(job.backend_job_id)  # at once, whatever grace a stop gave it
        await c.client.remove_files(job.job_id, job.dir.rsplit("/", 1)[0])
        c.jobs.pop(job.job_id, None)
        c.to_release.discard(job.backend_job_id)  # cancelled: nothing to release
        c.unsure.discard(render.job_comment(job.job_id, job.attempt, job.uid))

    async def _cleanup_untracked(self, c: SlurmCluster, ref: JobRef) -> None:
        """Jobs Slurm runs that this driver does not track (submitted before it started): the
        ref's, or by its job id alone (a new job's cleanup) each of that id's, cancelled (each
        id retired once Slurm took its cancel), then the id's files (``_remove_files``). Raises
        when Slurm cannot tell, or while a launch of such a job is in flight: a job left
        running is never answered cleaned up."""
        if ref.backend_job_id and not decimal(ref.backend_job_id):
            return
        running, cancelled, launching = await c.client.running(ref.job_id), set(), False
        for sj in running:
            parsed = render.parse_comment(sj.comment)
            tracked = c.jobs.get(ref.job_id) or c.recording.get(ref.job_id)  # (a launch may land meanwhile)
            if parsed is None or (tracked is not None and tracked.backend_job_id == sj.job_id) \
                    or not ref.names_uid(parsed[2]) or ref.backend_job_id not in ("", sj.job_id):
                continue
            if sj.comment in c.launching:
                launching = True
                continue
            await c.client.cancel(sj.job_id)
            c.retired[sj.job_id] = (time.monotonic(), ref.job_id)
            cancelled.add(sj.job_id)
        if launching:
            raise BackendUnavailable(f"a launch of job {ref.job_id!r} is in flight; clean it up after it")
        if ref.backend_job_id and all(sj.job_id != ref.backend_job_id for sj in running):
            c.retired.setdefault(ref.backend_job_id, (time.monotonic(), ref.job_id))  # ended: never adopted
        await self._remove_files(c, ref.job_id, running, cancelled)

    async def _remove_files(self, c: SlurmCluster, job_id: str, running: list[poll.SlurmJob] | None = None,
                            cancelled: Container[str] = ()) -> None:
        """A cleaned-up job id's files (every attempt's), unless a job of the id is tracked or
        launching here, or Slurm runs one not just cancelled (after a restart, maybe a new
        job's: attempt directories are per job id). ``running``: Slurm's jobs of the id that
        have not ended, if known (else the last round's listing says)."""
        if job_id in c.jobs or job_id in c.recording or any(m.startswith(f"{render.job_name(job_id)}.") for m in c.launching):
            return
        if running is None:
            running = await c.client.running(job_id) if c.listed is None else [
                j for key, entry in c.listed.items() if key.startswith(f"{render.job_name(job_id)}.")
                for j in entry.values() if not ended(j)]
        if all(sj.job_id in cancelled for sj in running):
            await c.client.remove_files(job_id, f"{render.state_dir_of(c.options)}/{job_id}")

    # ------------------------------------------------------------------ logs and usage

    def _tail(self, c: SlurmCluster, ref: JobRef, query: LogQuery) -> AsyncIterator[list[LogEntry]]:
        job = c.find_known(ref)
        if job is None:
            return self._tail_forgotten(c, ref, query)
        jobs = c.jobs  # the same dict after a reconfiguration (carried over)
        return slogs.tail(lambda: self.clusters.require(c.name).client, job.dir, query,
                          lambda: job.state.is_terminal() or jobs.get(job.job_id) is not job,
                          self._log_interval(), max(0.01, self.config.log_stream_interval), job.roles)

    def _log_interval(self) -> float:
        return max(slogs.LOG_POLL_FLOOR, min(1.0, self.config.poll_interval))

    async def _tail_forgotten(self, c: SlurmCluster, ref: JobRef, query: LogQuery) -> AsyncIterator[list[LogEntry]]:
        job = await self._forgotten(c, ref)
        if job is None:
            raise JobNotFound(ref.job_id)
        tail = slogs.tail(lambda: self.clusters.require(c.name).client, job.dir, query, lambda: True,
                          self._log_interval(), max(0.01, self.config.log_stream_interval), job.roles)
        async with contextlib.aclosing(tail) as batches:
            async for batch in batches:
                yield batch

    async def _usage(self, c: SlurmCluster, ref: JobRef) -> JobUsage:
        job = c.find_known(ref) or await self._forgotten(c, ref)
        if job is None:
            raise JobNotFound(ref.job_id)
        return await usage.measure(c.client.run, job, bool(c.accounting))

    # ------------------------------------------------------------------ forgotten jobs

    def _forget(self, c: SlurmCluster, ref: JobRef) -> bool:
        job = c.find(ref)
        if job is None or not job.state.is_terminal():
            return False
        del c.jobs[job.job_id]
        c.recording[job.job_id] = job  # answered from here until its record is written
        c.to_release.discard(job.backend_job_id)
        c.held_since.pop(job.backend_job_id, None)
        c.unsure.discard(render.job_comment(job.job_id, job.attempt, job.uid))
        self._start_record_writer(c)
        return True

    def _start_record_writer(self, c: SlurmCluster) -> None:
        if c.record_writer is None or c.record_writer.done():
            c.record_writer = asyncio.create_task(self._write_records(c.name), name=f"slurm-records-{c.name}")

    async def _write_records(self, name: str) -> None:
        """Write the records of the cluster's forgotten jobs (one remote command per batch),
        then let go of them; tried again every ``RECORD_RETRY_SECONDS`` while it fails."""
        await asyncio.sleep(0)  # the rest of the ForgetJobs batch joins this write
        while (c := self.clusters.get(name)) is not None and c.recording:
            batch = list(c.recording.values())
            if (why := await records.write(c.client.run, batch)) is not None:
                log.warning("cannot write the records of %d forgotten jobs on %s: %s", len(batch), name, why)
                await asyncio.sleep(RECORD_RETRY_SECONDS)
                continue
            for job in batch:
                if c.recording.get(job.job_id) is job:
                    del c.recording[job.job_id]

    async def _forgotten(self, c: SlurmCluster, ref: JobRef) -> TrackedJob | None:
        """A forgotten job (not tracked): being recorded, or read from its record."""
        if (job := c.find_known(ref)) is not None and c.jobs.get(ref.job_id) is not job:
            return job
        return (await self._recorded(c, [ref])).get((ref.job_id, ref.backend_job_id))

    async def _recorded(self, c: SlurmCluster, refs: Sequence[JobRef]) -> dict[tuple[str, str], TrackedJob]:
        return await records.read(c.client.run, c.name, render.state_dir_of(c.options), refs)
