"""The application layer: submission, launching, tracking, stopping, deleting.

It joins the domain (state machine, validation) with the adapters (store,
ClusterManager and driver clients). Background work is one task per pending
launch or stop retry, and one observation stream per cluster with unfinished
jobs, all of it done only by the replica that owns the cluster
(``job_manager/ownership.py``): ``take_over`` starts it when this replica
gains a cluster (it picks up the cluster's jobs waiting for a launch or a
termination), ``on_job`` for jobs stored since (SubmitJob on any replica),
``release`` stops it before the ownership is handed over. Every tracking
write is fenced on the ownership, so a replica that lost it writes nothing.

SubmitJob semantics worth knowing:

- SubmitJob answers once the job is durably stored: one etcd transaction
  writes the job (PENDING, attempt 1, reason ``LaunchQueued``) together with
  its request-id key. The launch runs in the background, on the cluster's
  owner: this replica when it owns (or may claim) the cluster, else the
  owner, which sees the stored job through its job watch (``on_job``). The
  job's state says where the launch is: PENDING ``LaunchQueued`` until the
  driver answers, then the backend id and the driver's state; PENDING
  ``DriverUnavailable``/``ClusterNotConfigured`` while a retry with backoff
  waits for the driver (once the cluster's ``DriverGate`` has closed, only the
  job whose retry probes the driver says so; the others wait behind it,
  ``LaunchQueued``, without a call or a write); FAILED ``LaunchRejected`` when the driver refuses the
  job (INVALID_ARGUMENT, FAILED_PRECONDITION other than
  CLUSTER_NOT_CONFIGURED, UNIMPLEMENTED, NOT_FOUND). Nothing is lost between
  the store and the launch: a replica killed there leaves a PENDING job
  without a backend id, which the cluster's next owner launches (``take_over``
  and ``reconcile`` pick up every such job). The time from the store to the
  recorded backend id is ``dlsched_job_launch_latency_seconds``.
- A retried SubmitJob (same request_id) returns the stored job and launches
  nothing, except a job still PENDING without a backend id, whose launch is
  queued again: safe, since LaunchJob is idempotent on (cluster, job, attempt).
  A job moved to the job history is found there, by its request key's job id
  while the key lasts, then by the request id the archiver recorded before
  sweeping the key: the same answer, nothing created.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from dlsched import errors, spec_rules
from dlsched.kit import logs
from dlsched.kit.locks import KeyedLocks
from job_manager.cache import JobCache
from job_manager.clients import ClusterManagerClient, DriverClient, DriverPool
from job_manager.domain import states
from job_manager.domain.errors import (
    EtagMismatch,
    JobAlreadyExists,
    JobNotFound,
    NoMatchingCluster,
    RequestIdInUse,
)
from job_manager.domain.model import Candidate, Job, JobSpec, JobState, NativeSpec, Observation
from job_manager.domain.validation import validate_submit
from job_manager.driver_gate import DriverGate, Turn
from job_manager.history.store import HistoryStore
from job_manager.job_metrics import LAUNCH_LATENCY
from job_manager.ownership import Ownership, SoleOwner
from job_manager.store import (
    JobStore,
    OwnershipLost,
    PendingCleanup,
    PendingDelete,
    RequestJobGone,
)

log = logging.getLogger("job_manager.scheduler")

# Driver errors after which retrying a launch cannot help.
_PERMANENT = (errors.InvalidArgument, errors.FailedPrecondition, errors.Unimplemented,
              errors.NotFound, errors.AlreadyExists)


#: how long ended jobs are gathered before one ForgetJobs call tells their driver
FORGET_BATCH_SECONDS = 0.2
#: how often a replica looks for deleted jobs' pending clean-ups it should run (etcd
#: ``job-cleanups/``: recorded by a replica that died before they were done)
CLEANUP_SWEEP_SECONDS = 30.0
#: at most this many of them started by the sweep run at once (each retries its driver with
#: backoff): a mass delete on a down cluster does not become thousands of retry loops
SWEEP_IN_FLIGHT = 200
#: how long SubmitJob looks for a retried request's job after an UNAVAILABLE match
SEEN_LOOKUP_SECONDS = 2.0


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _retrieved(task: asyncio.Task[Any]) -> None:
    """A background task's outcome taken (logged where it was awaited), so none is reported lost."""
    if not task.cancelled():
        task.exception()


def _retryable(e: errors.DlschedError) -> bool:
    if e.reason in ("CLUSTER_NOT_CONFIGURED", "PREVIOUS_ATTEMPT_ACTIVE"):  # (the last: until it has ended)
        return True
    return not isinstance(e, _PERMANENT)


@dataclass(frozen=True)
class SchedulerConfig:
    stop_grace_seconds: float = 10.0
    retry_initial_seconds: float = 0.5
    retry_max_seconds: float = 10.0
    call_timeout_seconds: float = 15.0
    #: how long a StopJob/DeleteJob waits for the driver's TerminateJob (CleanupJob: the stop's
    #: grace more, it waits for the processes to end) before it answers with the job as stored
    #: (STOPPING; the call retried in the background): a frozen driver, or one finishing a
    #: launch of the job first, does not hold the caller to its deadline
    inline_driver_seconds: float = 8.0
    #: a cluster's observation stream down this long marks its running jobs DriverUnreachable
    driver_unreachable_after_seconds: float = 10.0
    #: LaunchJob calls in flight at once per cluster (the rest wait, PENDING ``LaunchQueued``)
    max_concurrent_launches: int = 32


class _GateClosed(Exception):
    """A launch found its cluster's driver down while it waited for its slot (``DriverGate``)."""


@dataclass(frozen=True)
class DryRun:
    cluster: str
    candidates: list[Candidate]
    #: None when the chosen cluster's driver does not answer (the job would wait for it)
    native_spec: NativeSpec | None


class Scheduler:
    def __init__(self, store: JobStore, cm: ClusterManagerClient, drivers: DriverPool,
                 config: SchedulerConfig = SchedulerConfig(), *,
                 clock: Callable[[], datetime] = _utcnow,
                 ownership: Ownership | None = None, cache: JobCache | None = None,
                 history: HistoryStore | None = None) -> None:
        self.store = store
        self.history = history  # archived jobs: a retried SubmitJob's first job may be there
        self.cache = cache  # the watch cache; without one (tests), reads page through etcd
        self.ownership: Ownership = ownership or SoleOwner()
        self.cm = cm
        self.drivers = drivers
        self.config = config
        self._clock = clock
        self._locks = KeyedLocks()
        self._launch_slots: dict[str, asyncio.Semaphore] = {}  # per cluster: one down never starves another
        self._early_stops = asyncio.Semaphore(8)  # stops sent to a driver before a launch answered
        self._gates: dict[str, DriverGate] = {}  # per cluster: its driver down, one retry probes it
        self._retries: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._retry_cluster: dict[tuple[str, str], str] = {}
        self._cluster_tasks: dict[str, set[asyncio.Task[Any]]] = collections.defaultdict(set)
        self._trackers: dict[str, asyncio.Task[None]] = {}
        # ended jobs whose final state is stored, to tell their driver (ForgetJobs), per cluster
        self._to_forget: dict[str, dict[str, str]] = {}
        self._forgetters: dict[str, asyncio.Task[Any]] = {}
        self._reaping: set[tuple[str, str, str]] = set()  # (job, backend id, uid) of orphans being stopped
        # DeleteJob calls that wait for their job's stop (recorded in etcd), by job id
        self._deletes: dict[str, PendingDelete] = {}
        self._finishing: set[str] = set()  # job ids whose pending delete runs now
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    # ------------------------------------------------------------ helpers

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str = "",
               cluster: str = "") -> asyncio.Task[Any]:
        """A background task; with ``cluster``, cluster work that a release cancels."""
        t = asyncio.create_task(coro, name=name or None)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        if cluster:
            tasks = self._cluster_tasks[cluster]
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        return t

    def _gate(self, cluster: str) -> DriverGate:
        gate = self._gates.get(cluster)
        if gate is None:
            gate = self._gates[cluster] = DriverGate(self.config.retry_initial_seconds,
                                                     self.config.retry_max_seconds)
        return gate

    async def driver_for(self, cluster: str) -> DriverClient:
        return self.drivers.get(await self.cm.driver_address(cluster))

    async def close(self) -> None:
        self._closed = True
        tasks = [*self._tasks, *self._retries.values(), *self._trackers.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------ submit

    async def submit(self, job_id: str, spec: JobSpec, request_id: str, *, dry_run: bool,
                     spec_bytes: int, owner: str = "") -> tuple[Job, DryRun | None]:
        """Store a job and queue its launch; the job as stored (PENDING
        ``LaunchQueued``). ``spec.project`` is already resolved and allowed for
        ``owner`` (the servicer asks ``Principal.resolve_project``)."""
        validate_submit(job_id, spec, request_id, spec_bytes)
        # Its job archived and its request key swept: the history has the pair. Looked up
        # beside the match (one round trip, not two), answered before anything is stored.
        early = (asyncio.ensure_future(self._archived(request_id, owner))
                 if request_id and not dry_run and self.history is not None else None)
        try:
            return await self._submit(job_id, spec, request_id, dry_run, owner, early)
        finally:
            if early is not None and not early.done():
                early.cancel()  # the match failed otherwise than DlschedError, or the call left

    async def _submit(self, job_id: str, spec: JobSpec, request_id: str, dry_run: bool, owner: str,
                      early: asyncio.Future[Job | None] | None) -> tuple[Job, DryRun | None]:
        try:
            candidates = await self.cm.match(spec)
        except errors.DlschedError as e:
            if early is not None and (archived := await early) is not None:
                return archived, None
            # A retried request whose job exists answers that job, whatever the clusters
            # now (none matching, ClusterManager unreachable).
            # (a dry run too: it answers what the call would, AIP-163)
            seen = await self._seen_request(request_id, owner, e) if request_id else None
            if seen is None:
                raise
            return await self._after_duplicate(seen, owner), None
        if early is not None and (archived := await early) is not None:
            return archived, None
        chosen = next((c for c in candidates if c.eligible), None)
        if chosen is None:
            raise NoMatchingCluster(
                "no cluster can run this job",
                [(c.cluster, "; ".join(c.reasons) or "not eligible") for c in candidates])
        if violations := spec_rules.check_for_cluster_type(spec, chosen.cluster_type):
            raise errors.InvalidArgument(
                f"invalid job for {chosen.cluster}: {violations[0].field}: {violations[0].description}", violations)
        now = self._clock()
        job = Job(id=job_id or f"job-{uuid.uuid4().hex[:12]}", spec=spec,
                  uid=str(uuid.uuid4()), state=JobState.PENDING, cluster=chosen.cluster,
                  attempt=1, create_time=now, update_time=now, labels=dict(spec.labels),
                  owner=owner, project=spec.project, reason=states.LAUNCH_QUEUED)
        logs.JOB_ID.set(job.id)  # this handler's task: its records name the job
        if dry_run:
            first = await self._dry_run_conflicts(job_id, request_id, owner)
            # A driver down for now (the job would be stored and wait for it): the
            # placement without the native spec, as the submit would go on.
            native: NativeSpec | None = None
            try:
                native = await self.drivers.get(chosen.driver_address).render(
                    chosen.cluster, (first or job).id, spec)
            except errors.Unavailable as e:
                if e.reason not in ("DRIVER_UNAVAILABLE", "DRIVER_NOT_READY"):
                    raise
            job.uid = ""
            # A retry's dry run answers the retry's answer, its first job (AIP-163), beside the
            # placement the spec would get now.
            return first or job, DryRun(chosen.cluster, candidates, native)
        try:
            stored, created = await self.store.create(job, request_id)
        except RequestJobGone as e:  # its request key names a job gone from etcd: archived?
            archived = await self._archived(request_id, owner, e.job_id)
            if archived is not None:
                return archived, None
            # Deleted from etcd and the history (an archived job's DeleteJob leaves its request
            # key to the sweep; a crash between a delete's two writes leaves it for good): the
            # request id is free, as after any DeleteJob. Once: a racing submit may win it.
            await self.store.release_request(request_id, e.job_id, e.revision)
            stored, created = await self.store.create(job, request_id)
        if not created:  # a retried request, or a concurrent one with its request id, came first
            return await self._after_duplicate(stored, owner), None
        log.debug("job %s stored for %s (request %s)", stored.id, stored.cluster,
                 request_id or "-")
        await self._queue_launch(stored)
        return stored, None

    async def _dry_run_conflicts(self, job_id: str, request_id: str, owner: str) -> Job | None:
        """The errors the call would answer were it not a dry run (AIP-163): its job id taken
        (ALREADY_EXISTS), its request id another caller's or another job id's; the first job
        of a retried request (the call would answer it), else None."""
        if request_id:
            seen = await self._lookup_request(request_id, owner)  # an archived one of another: raises
            if seen is not None:
                if seen.owner != owner:
                    raise RequestIdInUse()
                if job_id and seen.id != job_id:
                    raise errors.InvalidArgument.for_field("request_id", f"already used to submit jobs/{seen.id}")
                return seen  # a retry: the call would answer its first job
        if job_id:
            with contextlib.suppress(JobNotFound):
                await self.store.get(job_id)
                raise JobAlreadyExists(f"job jobs/{job_id} already exists", metadata={"name": f"jobs/{job_id}"})
        return None

    async def _seen_request(self, request_id: str, owner: str, match_error: errors.DlschedError) -> Job | None:
        """The job of ``request_id`` if one was made (live or archived), looked up
        after the match failed. After an UNAVAILABLE match (ClusterManager, or the
        etcd behind it, not answering) the look-up gets ``SEEN_LOOKUP_SECONDS``: etcd
        is likely down too, and the caller then gets the match's error at once
        rather than after a timeout of the store's own."""
        if not isinstance(match_error, errors.Unavailable):
            # Refused (e.g. NO_MATCHING_CLUSTER, not retried): only a look-up that
            # answered may let that refusal stand; its errors are the caller's.
            return await self._lookup_request(request_id, owner)
        try:
            async with asyncio.timeout(SEEN_LOOKUP_SECONDS):
                return await self._lookup_request(request_id, owner)
        except (TimeoutError, errors.Unavailable):
            return None  # the match's UNAVAILABLE: the client retries

    async def _lookup_request(self, request_id: str, owner: str) -> Job | None:
        seen = await self.store.job_for_request(request_id)
        if seen is None:
            seen = await self._archived(request_id, owner, await self.store.request_job_id(request_id))
        return seen

    async def _after_duplicate(self, job: Job, owner: str) -> Job:
        """The first job of a retried request, only for the caller that made it:
        another principal's request id never hands its job over (nor launches it)."""
        if job.owner != owner:
            raise RequestIdInUse()
        if job.state == JobState.PENDING and not job.launched:
            await self._queue_launch(job)
        return job

    async def archived_request(self, request_id: str, owner: str) -> Job | None:
        """The archived first job of a retried SubmitJob (``owner``'s only), if any."""
        if not request_id or self.history is None:
            return None
        return await self._archived(request_id, owner, await self.store.request_job_id(request_id))

    async def _archived(self, request_id: str, owner: str, job_id: str | None = None) -> Job | None:
        """The job history's job ``job_id`` (a request key's), else the one recorded
        for ``request_id``, answered as a duplicate's (same owner rule); None when none."""
        if self.history is None:
            return None
        a = await self.history.get(job_id) if job_id else None
        if a is None:
            a = await self.history.job_for_request(request_id)
        return None if a is None else await self._after_duplicate(a.job(), owner)

    async def _queue_launch(self, job: Job) -> None:
        """Launch ``job`` in the background as its cluster's owner (claimed now if
        this replica is the owner-to-be); else its owner does, from the job watch."""
        if await self.ownership.claim(job.cluster):
            self.ensure_tracking(job.cluster)
            self._retry_in_background(job.id, "launch", job.cluster, first_delay=0, known=job)

    # ------------------------------------------------------------ launch

    async def launch(self, job_id: str, cluster: str, known: Job | None = None) -> Job:
        """Launch now; on a retryable failure keep retrying in the background."""
        try:
            job, done = await self._try_launch(job_id, cluster, known)
        except OwnershipLost:
            return await self.store.get(job_id)  # the cluster's new owner launches it
        except _GateClosed:
            self._retry_in_background(job_id, "launch", cluster)
            return known or await self.store.get(job_id)
        if not done:
            self._retry_in_background(job_id, "launch", job.cluster)
        return job

    async def _try_launch(self, job_id: str, cluster: str, known: Job | None = None, *,
                          probe: bool = False) -> tuple[Job, bool]:
        """One launch attempt of a job of ``cluster``: (the job, whether no further
        attempt is needed). ``known``: the job as just written (by SubmitJob, a
        retry, the watch), read instead of etcd unless the cache holds a newer one.
        ``_GateClosed`` when the cluster's driver was found down while it waited for its
        slot (unless it is the gate's ``probe``): no call, the retry waits at the gate."""
        slots = self._launch_slots.get(cluster)
        if slots is None:
            slots = self._launch_slots[cluster] = asyncio.Semaphore(max(1, self.config.max_concurrent_launches))
        with logs.job_context(job_id):
            async with slots:
                if not probe and self._gate(cluster).must_wait():
                    raise _GateClosed()
                return await self._try_launch_locked(job_id, known)

    def _newest(self, job_id: str, known: Job | None) -> Job | None:
        """``known`` or, when newer, the cache's copy (e.g. a stop while the launch waited);
        None (read etcd) when the cache, past ``known``'s write, no longer holds the job:
        deleted since, maybe through another replica, it must not be launched."""
        if known is None or not known.etag:
            return None
        if self.cache is None:
            return known
        cached = self.cache.get(job_id)
        if cached is not None:
            return cached.job() if cached.revision > int(known.etag) else known
        return None if self.cache.current >= int(known.etag) else known

    async def _try_launch_locked(self, job_id: str, known: Job | None) -> tuple[Job, bool]:
        async with self._locks.hold(job_id):
            job = self._newest(job_id, known) or await self.store.get(job_id)
            if job.state != JobState.PENDING or job.launched:
                return job, True
            if not self.ownership.owns(job.cluster):
                return job, True  # its owner launches it
            fence = self.ownership.fence(job.cluster)
            attempt = job.attempt
            try:
                drv = await self.driver_for(job.cluster)
                backend_id, obs = await drv.launch(job.cluster, job.id, job.spec, attempt, job.uid)
            except errors.DlschedError as e:
                if _retryable(e):
                    gate = self._gate(job.cluster)
                    quiet = gate.closed  # (said once per outage, not once per queued job)
                    msg = e.message[:500]
                    gate.failed(e.reason, msg)
                    (log.debug if quiet else log.warning)(
                        "launch of %s on %s deferred: %s", job_id, job.cluster, e.reason)
                    why = "ClusterNotConfigured" if e.reason == "CLUSTER_NOT_CONFIGURED" else "DriverUnavailable"
                    job = await self.store.update(
                        job_id, lambda j: states.mark_launch_waiting(j, why, msg), fence=fence, current=job)
                    return job, False
                self._gate(job.cluster).answered()
                log.warning("launch of %s refused by %s: %s", job_id, job.cluster, e.reason)
                msg = f"{e.reason}: {e.message}"[:1000]
                job = await self.store.update(job_id, lambda j: states.mark_launch_failed(
                    j, "LaunchRejected", msg, self._clock()), fence=fence, current=job)
                return job, True
            self._gate(job.cluster).answered()
            now = self._clock()

            def record(j: Job) -> Job | None:
                if j.attempt != attempt:
                    return None
                return states.mark_launched(j, backend_id, obs, now)

            try:
                job = await self.store.update(job_id, record, fence=fence, current=job)
            except JobNotFound:
                # Deleted (through any replica) while the driver launched it: nothing
                # records the backend job, so it is stopped and its files removed here.
                self._reap(job.cluster, job_id, backend_id, job.uid)
                raise
            if job.attempt > attempt and job.state == JobState.PENDING and not job.launched:
                log.info("job %s failed at once (attempt %d); retrying as attempt %d", job_id, attempt, job.attempt)
                self._spawn(self.launch(job.id, job.cluster, job), name=f"relaunch-{job.id}", cluster=job.cluster)
                return job, True
            if job.backend_job_id == backend_id and attempt == 1 and job.create_time is not None:
                LAUNCH_LATENCY.labels(job.cluster).observe(
                    max(0.0, (self._clock() - job.create_time).total_seconds()))
            log.info("job %s launched on %s as %s (attempt %d)", job_id, job.cluster,
                     backend_id, attempt)
            if job.backend_job_id != backend_id and job.attempt == attempt:
                # Stopped (or otherwise ended) while the launch was in flight.
                log.info("job %s ended during launch; terminating %s", job_id, backend_id)
                self._spawn(self._terminate_backend(job.cluster, job_id, backend_id, job.uid),
                            cluster=job.cluster)
            return job, True

    async def _terminate_backend(self, cluster: str, job_id: str, backend_id: str, uid: str, *,
                                 cleanup: bool = False, record: PendingCleanup | None = None) -> None:
        """Stop a backend job no stored job records (and, with ``cleanup``, remove its files);
        ``uid``: its job's (the driver leaves a job of the same id and another uid alone).
        ``record``: the clean-up's etcd record, deleted once it is done (or refused)."""
        delay = self.config.retry_initial_seconds
        done = False
        while True:
            try:
                if not done:
                    drv = await self.driver_for(cluster)
                    await drv.terminate(cluster, job_id, backend_id, self.config.stop_grace_seconds, uid)
                    if cleanup:
                        await drv.cleanup(cluster, job_id, backend_id, uid)
                    done = True
                if record is not None:
                    await self.store.delete_cleanup(record)
                return
            except errors.DlschedError as e:
                if not _retryable(e) and not done:
                    log.warning("clean-up of %s on %s refused: %s", job_id, cluster, e.reason)
                    done = True
                    continue
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.config.retry_max_seconds)

    def _retry_in_background(self, job_id: str, op: str, cluster: str, *,
                             first_delay: float | None = None, known: Job | None = None) -> None:
        """Retry ``op`` (launch, terminate) until done, as the owner of ``cluster``
        (a launch's first attempt starts from ``known``, the job as just written)."""
        key = (job_id, op)
        if self._closed or key in self._retries or not self.ownership.owns(cluster):
            return

        async def loop() -> None:
            delay = self.config.retry_initial_seconds if first_delay is None else first_delay
            start = known
            gate = self._gate(cluster)
            try:
                while True:
                    await asyncio.sleep(delay)
                    delay = max(delay, self.config.retry_initial_seconds / 2)
                    # Its driver down: wait while another job's call probes it (no work meanwhile;
                    # the job stays PENDING with its reason, LaunchQueued, the prober's says why)
                    if gate.must_wait():
                        start = None  # (as written before the wait: maybe stopped since)
                    turn = await gate.turn()
                    try:
                        if op == "launch":
                            _, done = await self._try_launch(job_id, cluster, start, probe=turn is Turn.PROBE)
                            start = None
                        else:
                            done = await self._try_terminate(job_id)
                    except (JobNotFound, OwnershipLost):
                        return
                    except _GateClosed:
                        start = None
                        continue  # (not a try: no backoff of its own)
                    except errors.DlschedError as e:
                        log.warning("%s of %s: %s", op, job_id, e)
                        done = False
                    finally:
                        if turn is Turn.PROBE:
                            gate.probed()
                    if done:
                        return
                    delay = min(delay * 2, self.config.retry_max_seconds)
            finally:
                self._retries.pop(key, None)
                self._retry_cluster.pop(key, None)

        self._retries[key] = asyncio.create_task(loop(), name=f"{op}-{job_id}")
        self._retry_cluster[key] = cluster

    # ------------------------------------------------------------ stop / delete

    async def stop(self, job_id: str, *, expect: str = "") -> Job:
        """Ask the job to stop; ``expect``: an etag the job must be at (``JobStore.update``)."""
        return (await self._stop(job_id, expect))[0]

    async def _stop(self, job_id: str, expect: str = "") -> tuple[Job, bool]:
        """``stop``, and whether its backend took the stop (else it is retried in the background)."""
        unlaunched: list[Job] = []  # the job as this call found it, stopped before its launch answered

        def stop(j: Job) -> Job | None:
            new = states.request_stop(j, self._clock())
            if new is not None and not j.launched:
                unlaunched.append(j)
            return new

        job = await self.store.update(job_id, stop, expect=expect)
        done = True
        if unlaunched and job.state == JobState.STOPPED and not job.launched and (
                self._locks.busy(job_id) or not self.ownership.owns(job.cluster)):
            # Its launch may be at the driver now (this replica's call in flight, or another
            # replica's, the owner's, which may be frozen with the answer): the driver is told at
            # once, by id and uid, and stops what the launch makes once it has made it (the
            # owner, on the answer, would too, later). At most a few such calls at a time.
            self._spawn(self._stop_unanswered_launch(job), name=f"terminate-{job_id}").add_done_callback(_retrieved)
        if job.state == JobState.STOPPING:
            log.info("stopping job %s", job_id)
            # The driver's stop runs as a task of its own: past the wait it goes on (a stop left
            # half-way, pods half deleted, would wait for the retry), only this call answers.
            # (not cluster work: a replica that does not track the cluster stops the job too)
            call = self._spawn(self._try_terminate(job_id), name=f"terminate-{job_id}")
            call.add_done_callback(_retrieved)
            await asyncio.wait([call], timeout=self.config.inline_driver_seconds)
            if not call.done():
                log.warning("terminate of %s: its driver did not answer within %.0fs; retried in the background",
                            job_id, self.config.inline_driver_seconds)
                done = False
            elif call.cancelled():  # (this replica closing)
                done = False
            elif (e := call.exception()) is not None:
                log.warning("terminate of %s: %s", job_id, e)
                done = False
            else:
                done = call.result()
            if not done:
                self._retry_in_background(job_id, "terminate", job.cluster)
            job = await self.store.get(job_id)
        return job, done

    async def _stop_unanswered_launch(self, job: Job) -> None:
        """Best effort: a driver that does not answer is left to the launch's owner."""
        async with self._early_stops:
            if self._gate(job.cluster).must_wait():
                return  # its driver down: no launch of it answers either
            try:
                drv = await self.driver_for(job.cluster)
                await drv.terminate(job.cluster, job.id, "", self.config.stop_grace_seconds, job.uid)
            except errors.DlschedError as e:
                log.info("stop of %s before its launch answered, at its driver: %s", job.id, e.reason)

    async def _try_terminate(self, job_id: str) -> bool:
        job = await self.store.get(job_id)
        if job.state != JobState.STOPPING or not job.launched:
            return True
        gate = self._gate(job.cluster)
        try:
            drv = await self.driver_for(job.cluster)
            obs = await drv.terminate(job.cluster, job.id, job.backend_job_id,
                                      self.config.stop_grace_seconds, job.uid)
        except errors.DlschedError as e:
            if _retryable(e):
                gate.failed(e.reason, e.message[:500])
                return False
            gate.answered()
            log.warning("terminate of %s refused: %s", job_id, e.reason)
            return True
        gate.answered()
        self.ensure_tracking(job.cluster)
        if obs is not None:
            with contextlib.suppress(OwnershipLost):  # the new owner's stream tells it
                await self.apply(job.cluster, obs)
        return True

    async def delete(self, job_id: str, allow_missing: bool, *, etag: str = "") -> Job | None:
        """Stop (if it runs), clean up and delete a job. With ``etag`` the job must be
        at that revision at the first write this makes (the stop, or the delete of an
        ended job): else ``Aborted`` and nothing changed (AIP-154)."""
        # A launch in its driver call finishes first (its backend job is recorded, then
        # stopped below): its task is cancelled only while it waits, holding no lock.
        # One that starts later finds the job gone, or terminates what it launched.
        async with self._locks.hold(job_id):
            t = self._retries.pop((job_id, "launch"), None)
            self._retry_cluster.pop((job_id, "launch"), None)
            if t is not None:
                t.cancel()
        try:
            job = await self.store.get(job_id)
        except JobNotFound:
            if allow_missing:
                return None
            raise
        if etag and job.etag != etag:  # (an etcd read: the job's current revision)
            raise EtagMismatch(job_id, etag, job.etag)
        expect = etag
        if not job.state.is_terminal():
            job, stopped = await self._stop(job_id, expect=etag)
            expect = ""  # the precondition held at the stop, this call's own first write
            if not stopped:
                # Its driver could not be asked to stop it (unreachable, or ClusterManager to
                # find it): without the record nothing would stop it, ever. It stays STOPPING,
                # its terminate retried in the background; the delete is recorded and done
                # once the job has stopped (by the cluster's owner, whatever restarts).
                pending = PendingDelete(job.cluster, job_id, job.uid)
                await self.store.put_pending_delete(pending)
                if self.ownership.would_own(job.cluster):  # (else the owner's sweep finds it)
                    self._deletes[job_id] = pending
                raise errors.Unavailable(
                    f"jobs/{job_id} is stopping, but its cluster's driver could not be reached to "
                    "stop it; it is deleted once it has stopped (no need to ask again)",
                    reason="JOB_STOP_PENDING", metadata={"name": f"jobs/{job_id}"})
        cleanup: PendingCleanup | None = None
        if job.cluster:
            # A job never launched has nothing to stop gracefully (a launch whose answer was
            # lost may have left something, found by its id and uid): no grace in the wait, and
            # no wait at all while its driver is known not to answer (a frozen driver held such
            # deletes 18 s each; the record below has the clean-up done when it answers).
            never = not job.backend_job_id
            try:
                if never and (gate := self._gate(job.cluster)).must_wait():
                    raise errors.Unavailable(gate.message, reason="DRIVER_UNAVAILABLE")
                drv = await self.driver_for(job.cluster)
                await asyncio.wait_for(drv.cleanup(job.cluster, job.id, job.backend_job_id, job.uid),
                                       self.config.inline_driver_seconds +
                                       (0 if never else self.config.stop_grace_seconds))
            except (errors.DlschedError, TimeoutError) as e:
                if isinstance(e, TimeoutError) or _retryable(e):
                    # Its driver is unreachable now: the delete goes on (the job has ended or
                    # stopped) and the clean-up is retried in the background, so its backend
                    # objects (files, pods, an MPI job's SSH key) do not stay behind for ever;
                    # its record, written with the delete, outlives this process.
                    log.warning("cleanup of %s on %s failed (retried): %s", job_id, job.cluster, e)
                    cleanup = PendingCleanup(job.cluster, job_id, job.backend_job_id, job.uid)
                else:
                    log.warning("cleanup of %s on %s failed (ignored): %s", job_id, job.cluster, e)
        self._retry_cluster.pop((job_id, "terminate"), None)
        t = self._retries.pop((job_id, "terminate"), None)
        if t is not None:
            t.cancel()
        # (its request key goes with it, found through ``request_of_key``; that of a job stored
        # before that key was written is left to the archiver's sweep)
        last = await self.store.delete(job_id, expect=expect, cleanup=cleanup)
        self._deletes.pop(job_id, None)  # (its record went with it)
        if cleanup is not None:
            self._clean_up(cleanup)
        log.info("job %s deleted", job_id)
        if last is None and not allow_missing:
            raise JobNotFound(f"job jobs/{job_id} not found", metadata={"name": f"jobs/{job_id}"})
        return last

    # ------------------------------------------------------------ tracking

    async def apply(self, cluster: str, obs: Observation) -> Job | None:
        """Apply one observation of a job on ``cluster`` (CAS, domain transitions),
        as its owner: on another replica nothing; raises ``OwnershipLost`` when
        the ownership ended under the write."""
        if not self.ownership.owns(cluster):
            return None
        fence = self.ownership.fence(cluster)
        retry = False
        lost = not obs.found

        def change(j: Job) -> Job | None:
            nonlocal retry
            retry = False
            if j.cluster != cluster or states.of_another_job(j, obs):
                return None
            if lost:
                if obs.backend_job_id and j.backend_job_id and obs.backend_job_id != j.backend_job_id:
                    return None
                return states.mark_lost(j, self._clock())
            if states.should_retry(j, obs):
                retry = True
                return states.plan_retry(j, obs, self._clock())
            return states.apply_observation(j, obs, self._clock())

        # The job's lock: a launch being recorded and an observation of it never race
        # (no CAS retry within this replica).
        with logs.job_context(obs.job_id):
            try:
                async with self._locks.hold(obs.job_id):
                    job = await self.store.update(obs.job_id, change, fence=fence)
            except JobNotFound:
                if obs.found and obs.state.is_terminal():
                    self._forget_later(cluster, obs.job_id, obs.backend_job_id)  # deleted or archived
                elif obs.found and obs.backend_job_id:
                    self._reap_gone(cluster, obs)
                return None
            except OwnershipLost:
                self.ownership.lost(cluster)
                raise
            if job.state.is_terminal() and (d := self._deletes.get(job.id)) is not None and d.uid == job.uid:
                self._finish_delete(d)  # asked while it could not be stopped: it has stopped now
            if (obs.found and obs.state.is_terminal() and job.state.is_terminal()
                    and obs.backend_job_id == job.backend_job_id):
                self._forget_later(cluster, job.id, job.backend_job_id)
            elif (obs.found and not obs.state.is_terminal() and job.state.is_terminal()
                  and obs.backend_job_id and obs.backend_job_id != job.backend_job_id
                  and job.cluster == cluster and not states.of_another_job(job, obs)):
                # A backend job the ended job never recorded: a launch whose answer was lost
                # (the driver frozen past the deadline, the owner killed before the record),
                # then the job was stopped before any launch was recorded. Nothing else would
                # ever stop it.
                self._reap(cluster, job.id, obs.backend_job_id, job.uid, cleanup=False,
                           why=f"ended ({job.state.name}) without it")
            if retry and job.state == JobState.PENDING:
                log.info("job %s failed (attempt %d); retrying as attempt %d", job.id,
                         job.attempt - 1, job.attempt)
                self._spawn(self.launch(job.id, cluster, job), name=f"relaunch-{job.id}", cluster=cluster)
            return job

    def _reap(self, cluster: str, job_id: str, backend_job_id: str, uid: str, *,
              cleanup: bool = True, why: str = "is deleted", record: PendingCleanup | None = None) -> None:
        """A backend job still running for a job the store no longer has (deleted while its
        launch or stop was in flight, or while the driver was down): stop it and, with
        ``cleanup``, remove its files, once (later observations of it while that runs change
        nothing). Also for an ended job that never recorded it (``cleanup=False``: its logs stay)."""
        key = (job_id, backend_job_id, uid)  # (both jobs of one id may have one backend id)
        if key in self._reaping or self._closed:
            return
        log.warning("job %s %s but %s still runs on %s: terminating it", job_id, why,
                    backend_job_id, cluster)
        self._reaping.add(key)
        t = self._spawn(self._terminate_backend(cluster, job_id, backend_job_id, uid, cleanup=cleanup,
                                                record=record),
                        name=f"reap-{job_id}", cluster=cluster)
        t.add_done_callback(lambda _: self._reaping.discard(key))

    def _reap_gone(self, cluster: str, obs: Observation) -> None:
        """A backend job still running (or said so late) for a job etcd no longer has: deleted,
        or moved to the job history. An archived job's files stay (its logs and usage are read
        through the history); only a job the history does not hold either is cleaned up."""
        key = (obs.job_id, obs.backend_job_id, obs.job_uid)
        if self.history is None or key in self._reaping or self._closed:
            self._reap(cluster, obs.job_id, obs.backend_job_id, obs.job_uid)
            return
        self._reaping.add(key)  # one look-up however many observations come meanwhile (``_reap`` takes it on)
        self._spawn(self._reap_unless_archived(cluster, obs, self.history), name=f"reap-{obs.job_id}",
                    cluster=cluster)

    async def _reap_unless_archived(self, cluster: str, obs: Observation, history: HistoryStore) -> None:
        try:
            found = await history.get(obs.job_id)
            # (another job of that id archived, this one deleted: its files go)
            archived = found is not None and (not obs.job_uid or found.job().uid in ("", obs.job_uid))
        except errors.DlschedError:
            archived = True  # cannot tell: stopped, its files kept (never an archived job's logs lost)
        finally:
            self._reaping.discard((obs.job_id, obs.backend_job_id, obs.job_uid))
        if archived:
            self._reap(cluster, obs.job_id, obs.backend_job_id, obs.job_uid, cleanup=False,
                       why="is archived (or the history cannot say)")
        else:
            self._reap(cluster, obs.job_id, obs.backend_job_id, obs.job_uid)

    def _clean_up(self, c: PendingCleanup) -> None:
        self._reap(c.cluster, c.job_id, c.backend_job_id, c.uid, why="is deleted, its clean-up pending,",
                   record=c)

    async def delete_from_history(self, job_id: str, upto: int) -> None:
        """A deleted job's copy the archiver may have written (or may write: ``upto``) goes from
        the history; while the history does not answer, retried in the background (the delete
        in etcd is done: the client is told so, not UNAVAILABLE, whose retry found NOT_FOUND)."""
        assert self.history is not None
        try:
            await self.history.delete(job_id, upto=upto)
            return
        except errors.StoreUnavailable as e:
            log.warning("deleting %s from the history failed (%s); retried", job_id, e.reason)

        async def retry() -> None:
            assert self.history is not None
            delay = self.config.retry_initial_seconds
            for _ in range(60):
                await asyncio.sleep(delay)
                try:
                    await self.history.delete(job_id, upto=upto)
                    return
                except errors.StoreUnavailable:
                    delay = min(delay * 2, max(self.config.retry_max_seconds, 10.0))
            log.error("job %s could not be deleted from the history: an archived copy may remain", job_id)
        self._spawn(retry(), name=f"history-delete-{job_id}").add_done_callback(_retrieved)

    async def purge_archived(self, job_id: str, revision: int, data: bytes) -> None:
        """Delete the archived copy of ``job_id`` (at ``revision``, ``data`` its stored bytes).
        Watches learn of it first (its key left etcd with no event when it was archived): a
        delete that fails after is retried, and a watch sees a second DELETED, never none."""
        assert self.history is not None
        if await self.store.mark_purged(job_id, revision, data):
            await self.history.delete(job_id, upto=revision)
        else:  # its id is a live job's again: this archived copy was deleted meanwhile
            await self.history.delete(job_id, revision, upto=revision)

    async def clean_up_later(self, cluster: str, job_id: str, backend_job_id: str, uid: str) -> None:
        """A deleted job's clean-up that failed (its driver unreachable): recorded in etcd (raises
        ``StoreUnavailable`` when it cannot be), retried in the background until done."""
        c = PendingCleanup(cluster, job_id, backend_job_id, uid)
        await self.store.put_cleanup(c)
        self._clean_up(c)

    def _finish_delete(self, d: PendingDelete) -> None:
        if d.job_id in self._finishing or self._closed:
            return
        self._finishing.add(d.job_id)
        t = self._spawn(self._delete_stopped(d), name=f"delete-{d.job_id}")
        t.add_done_callback(lambda _: self._finishing.discard(d.job_id))

    async def _delete_stopped(self, d: PendingDelete) -> None:
        """Finish a DeleteJob that waited for its job's stop, once the job has ended."""
        try:
            try:
                job = await self.store.get(d.job_id)
            except JobNotFound:
                job = None
            if job is None and self.history is not None:
                # Archived once it stopped, before this record was acted on (its owner died and the
                # successor's sweep came after the archiver): deleted from the history, as promised
                # (it lived on there)
                archived = await self.history.get(d.job_id)
                if archived is not None and (gone := archived.job()).uid == d.uid:
                    if gone.cluster:
                        await self.clean_up_later(gone.cluster, gone.id, gone.backend_job_id, gone.uid)
                    await self.purge_archived(d.job_id, archived.revision, archived.data)
                    log.info("job %s deleted from the history: it stopped and was archived before its "
                             "pending delete", d.job_id)
            if job is None or job.uid != d.uid:  # deleted since, maybe its id reused
                self._deletes.pop(d.job_id, None)
                await self.store.drop_pending_delete(d)
                return
            if not job.state.is_terminal():
                return  # its stop is still retried; an observation of its end brings it back
            if self.history is not None and job.etag:  # a copy archived already (retried with the record)
                await self.history.delete(d.job_id, upto=int(job.etag))
            # At the revision read: a job of that id made since (another uid) is never deleted.
            last = await self.delete(d.job_id, True, etag=job.etag)
            if self.history is not None and last is not None and last.etag:
                await self.history.delete(d.job_id, upto=int(last.etag))
            log.info("job %s deleted: it has stopped, as a DeleteJob asked while its driver was "
                     "unreachable", d.job_id)
        except errors.DlschedError as e:
            log.info("pending delete of %s not done yet (%s); retried", d.job_id, e.reason)

    async def sweep_cleanups(self) -> int:
        """Start the pending clean-ups of the clusters this replica owns or would own that
        nothing here runs yet (recorded by a replica that died, or released): how many. And
        finish the pending deletes of their jobs that have stopped."""
        n = 0
        async for page in self.store.cleanups():
            if len(self._reaping) >= SWEEP_IN_FLIGHT:
                break  # the rest at a later sweep
            for c in page:
                if self._closed or len(self._reaping) >= SWEEP_IN_FLIGHT:
                    break
                if self.ownership.would_own(c.cluster) and \
                        (c.job_id, c.backend_job_id, c.uid) not in self._reaping:
                    self._clean_up(c)
                    n += 1
        async for deletes in self.store.pending_deletes():
            if len(self._finishing) >= SWEEP_IN_FLIGHT:
                break
            for d in deletes:
                if len(self._finishing) >= SWEEP_IN_FLIGHT:
                    break
                if not self._closed and self.ownership.would_own(d.cluster):
                    self._deletes[d.job_id] = d
                    self._finish_delete(d)
        return n

    async def run_cleanup_sweeps(self, every: float = CLEANUP_SWEEP_SECONDS) -> None:
        """``sweep_cleanups`` now and every ``every`` seconds, for good."""
        while not self._closed:
            try:
                if n := await self.sweep_cleanups():
                    log.info("%d pending clean-ups of deleted jobs resumed", n)
            except errors.DlschedError as e:
                log.info("pending clean-ups not read (%s); again in %g s", e.reason, every)
            await asyncio.sleep(every)

    def start(self) -> None:
        """The scheduler's own background work (pending clean-ups)."""
        self._spawn(self.run_cleanup_sweeps(), name="cleanup-sweeps")

    def _forget_later(self, cluster: str, job_id: str, backend_job_id: str) -> None:
        """Tell the driver, in a batch, that this ended job's final state is stored:
        it drops the job from memory (``ForgetJobs``). A call that fails is not
        retried: the driver names the job again in its next snapshot."""
        self._to_forget.setdefault(cluster, {})[job_id] = backend_job_id
        if cluster not in self._forgetters and not self._closed:
            self._forgetters[cluster] = self._spawn(self._forget_batches(cluster),
                                                    name=f"forget-{cluster}", cluster=cluster)

    async def _forget_batches(self, cluster: str) -> None:
        try:
            await asyncio.sleep(FORGET_BATCH_SECONDS)  # gather the jobs ending together
            while refs := self._to_forget.pop(cluster, None):
                try:
                    drv = await self.driver_for(cluster)
                    await drv.forget(cluster, list(refs.items()))
                except errors.DlschedError as e:
                    log.info("ForgetJobs on %s (%d jobs): %s", cluster, len(refs), e.reason)
        finally:
            self._forgetters.pop(cluster, None)
            self._to_forget.pop(cluster, None)  # left only by a cancel: the next snapshot names them

    def ensure_tracking(self, cluster: str) -> None:
        if self._closed or not cluster or not self.ownership.owns(cluster):
            return
        t = self._trackers.get(cluster)
        if t is None or t.done():
            self._trackers[cluster] = asyncio.create_task(self._track(cluster),
                                                          name=f"track-{cluster}")

    async def _unfinished(self, cluster: str | None = None) -> list[Job]:
        """Jobs not in a terminal state (of ``cluster``, when given)."""
        if self.cache is not None:
            return self.cache.unfinished(cluster)[0]
        jobs, _ = await self.store.list_all()
        return [j for j in jobs if not j.state.is_terminal()
                and (cluster is None or j.cluster == cluster)]

    async def _unfinished_launched(self, cluster: str) -> list[Job]:
        return [j for j in await self._unfinished(cluster) if j.launched]

    async def _track(self, cluster: str) -> None:
        """One long-lived WatchJobObservations stream for ``cluster``, reconnecting."""
        delay = self.config.retry_initial_seconds
        down_since: datetime | None = None  # the stream has failed since (None: it works)
        marked = False
        while True:
            seen: set[str] = set()
            snapshot_done = False
            detail = ""
            try:
                drv = await self.driver_for(cluster)
                async for obs in drv.watch(cluster):
                    delay = self.config.retry_initial_seconds
                    down_since, marked = None, False
                    if obs is None:
                        snapshot_done = True
                        await self._check_lost(cluster, drv, seen)
                        continue
                    if not snapshot_done:
                        if not obs.found:
                            continue  # decided after the snapshot, via _check_lost
                        seen.add(obs.job_id)
                        self._stop_again(cluster, obs, await self.apply(cluster, obs))
                        continue
                    await self.apply(cluster, obs)
                log.info("observation stream of %s ended; reconnecting", cluster)
            except asyncio.CancelledError:
                raise
            except OwnershipLost:
                log.info("tracking of %s ends: ownership lost", cluster)
                return
            except errors.DlschedError as e:
                if e.reason == "CLUSTER_NOT_CONFIGURED":
                    log.info("%s not configured on its driver yet; waiting", cluster)
                else:
                    log.warning("observation stream of %s: %s %s", cluster, e.reason, e.message)
                    detail = f"{e.reason}: {e.message}"[:300]
                self.cm.forget(cluster)
            except Exception as e:  # noqa: BLE001 - the tracker must survive anything
                log.exception("observation stream of %s failed", cluster)
                detail = type(e).__name__
            if detail:
                now = datetime.now(UTC)
                down_since = down_since or now
                if not marked and (now - down_since).total_seconds() >= self.config.driver_unreachable_after_seconds:
                    marked = await self._mark_unreachable(cluster, down_since, detail)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.config.retry_max_seconds)

    async def _mark_unreachable(self, cluster: str, since: datetime, detail: str) -> bool:
        """Every running job of ``cluster`` says its driver is unreachable (state unchanged)."""
        fence = self.ownership.fence(cluster)
        try:
            for job in await self._unfinished_launched(cluster):
                with contextlib.suppress(JobNotFound):
                    await self.store.update(job.id, lambda j: states.mark_driver_unreachable(j, since, detail),
                                            fence=fence)
        except OwnershipLost:
            return True  # no longer ours to mark; the release stops this tracker
        except errors.DlschedError as e:  # the store is down too: try again on the next round
            log.warning("marking the jobs of %s: %s", cluster, e)
            return False
        return True

    async def _check_lost(self, cluster: str, drv: DriverClient, seen: set[str]) -> None:
        """After a snapshot: jobs JM launched there that the driver did not list."""
        missing = [j for j in await self._unfinished_launched(cluster) if j.id not in seen]
        if not missing:
            return
        for obs in await drv.batch_get(cluster, [(j.id, j.backend_job_id) for j in missing]):
            if not obs.found:
                log.warning("job %s lost by %s", obs.job_id, cluster)
            self._stop_again(cluster, obs, await self.apply(cluster, obs))

    def _stop_again(self, cluster: str, obs: Observation, job: Job | None) -> None:
        """A stopping job its driver reports as running, in a snapshot or a look-up: the driver
        does not know of the stop (it restarted, e.g. in a stop's grace, before it killed the
        processes that ignored SIGTERM), so it is asked again (TerminateJob is idempotent)."""
        if (job is not None and job.state == JobState.STOPPING and job.launched and obs.found
                and obs.state in (JobState.PENDING, JobState.QUEUED, JobState.RUNNING)):
            log.info("job %s: %s reports it %s although it is stopping; stopping it again",
                     job.id, cluster, obs.state.name)
            self._retry_in_background(job.id, "terminate", cluster, first_delay=0)

    # ------------------------------------------------------------ ownership

    async def take_over(self, cluster: str) -> None:
        """This replica now owns ``cluster``: launch its jobs that wait for a
        launch, terminate those stopping, open its observation stream (whose
        snapshot brings the launched jobs up to date)."""
        jobs = await self._unfinished(cluster)
        counts = {"pending": 0, "stopping": 0, "tracked": 0}
        for j in jobs:
            if j.cluster != cluster or j.state.is_terminal():
                continue
            if j.state == JobState.PENDING and not j.launched:
                counts["pending"] += 1
            elif j.state == JobState.STOPPING:
                counts["stopping"] += 1
            counts["tracked"] += int(j.launched)
            self.on_job(j)
        self.ensure_tracking(cluster)
        log.info("took over %s: %s", cluster, counts)

    def on_job(self, job: Job) -> None:
        """A stored job of an owned cluster: start what it waits for, if nothing does yet."""
        if self._closed or not self.ownership.owns(job.cluster):
            return
        if job.state == JobState.PENDING and not job.launched:
            self._retry_in_background(job.id, "launch", job.cluster, first_delay=0, known=job)
        elif job.state == JobState.STOPPING and job.launched:
            self._retry_in_background(job.id, "terminate", job.cluster, first_delay=0)

    async def release(self, cluster: str) -> None:
        """Stop every piece of ``cluster``'s work (its ownership is ending)."""
        for job_id in [j for j, d in self._deletes.items() if d.cluster == cluster]:
            del self._deletes[job_id]  # (the next owner's sweep finds them)
        tasks = [t for key, t in self._retries.items() if self._retry_cluster.get(key) == cluster]
        tasks += self._cluster_tasks.pop(cluster, set())
        tracker = self._trackers.pop(cluster, None)
        if tracker is not None:
            tasks.append(tracker)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        log.info("released %s (%d tasks stopped)", cluster, len(tasks))

    async def reconcile(self) -> dict[str, int]:
        """Take over every owned cluster with unfinished jobs (``SoleOwner``: all)."""
        jobs = await self._unfinished()
        counts = {"pending": 0, "stopping": 0, "tracked": 0}
        clusters: set[str] = set()
        for j in jobs:
            if j.state.is_terminal() or not self.ownership.owns(j.cluster):
                continue
            counts["pending"] += int(j.state == JobState.PENDING and not j.launched)
            counts["stopping"] += int(j.state == JobState.STOPPING)
            counts["tracked"] += int(j.launched)
            clusters.add(j.cluster)
        for cluster in clusters:
            await self.take_over(cluster)
        log.info("reconciled: %s", counts)
        return counts

    async def wait_launched(self, job_id: str, *, poll: float = 0.25) -> Job:
        """The job once it has a backend id or has ended (reads etcd only)."""
        while True:
            job = await self.store.get(job_id)
            if job.launched or job.state.is_terminal():
                return job
            await asyncio.sleep(poll)

