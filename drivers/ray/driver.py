"""``RayDriver``: jobs on Ray clusters through the Ray Jobs REST API (aiohttp; no ``import ray``).

A cluster's address is its dashboard URL (``http://head:8265``); its
credentials, when the cluster has token auth, are a token sent as
``Authorization: Bearer`` (kept in memory, never logged or returned).

Submission (``launch``): ``render.render_submission`` POSTed to
``/api/jobs/``. The submission id ``dlsched-{job}-{attempt}_{uid}`` makes it
idempotent at Ray itself: a retried POST is refused ("already exists",
HTTP 400 or 500 depending on the Ray version), and on *any* refused or
failed POST the driver asks ``GET /api/jobs/{submission_id}``: a job there
is the first submission, returned as the launch's result. A job id used
again is a new uid, so a new id: never one Ray's monitor of a deleted
submission still watches (``render.submission_id``). The attempt rules
(one launch of a job at a time; a lower attempt than the newest known is
FAILED_PRECONDITION ``STALE_ATTEMPT``, a new attempt while the previous one
runs ``PREVIOUS_ATTEMPT_ACTIVE``) are the kit's ``drivers.common.launches``.

State: one poller task per cluster does ``GET /api/jobs/`` every
``--poll-interval`` (one call for all jobs, never one per job), keeps the
submissions whose metadata carries ``dlsched_job_id`` (the newest attempt per
job), maps them with ``states.map_status`` (Ray's message, trimmed, as the
message) and publishes every change to the watchers. When the head does not
answer, every job keeps its last state with reason ``BackendStale`` and the
error in the message; nothing is reported FAILED for it. ``observe`` answers
from that cache (after the cluster's first poll; until one succeeded it is
UNAVAILABLE ``BACKEND_UNAVAILABLE`` rather than "not found").

Time limit: Ray has none; the poller stops a RUNNING job that ran past its
``dlsched_time_limit_seconds`` (metadata, so it survives a driver restart),
and a STOPPED job whose run reached its limit is reported FAILED, reason
``TimeLimitExceeded``. The run counts from when the poller saw the job start
(``RayCluster.started``, ``tracking``): Ray's ``start_time`` is the submission's, and a job
queued for its entrypoint's resources would otherwise be stopped as it
starts. A job first seen running (by a restarted driver) counts from Ray's
``start_time``; a PENDING job has no start time.

Stop: ``POST /api/jobs/{id}/stop`` (Ray sends SIGTERM, then SIGKILL after its
own ``RAY_JOB_STOP_WAIT_TIME_S``, set on the cluster; a request's grace
period is not honoured per job). Cleanup: ``DELETE /api/jobs/{id}`` for every
attempt, stopping a still-running one first. Unknown jobs succeed.

Every job runs under the in-cluster launcher (``launcher.py``, single
process included), which writes each process's stdout and stderr to files of
their own in its node's Ray log directory and samples the processes' usage
(``layout.py`` the files, ``sampler.py`` the sampling).

Logs (``logs.py``): those files through Ray's state API
(``/api/v0/logs/file`` once; a follow keeps one ``/api/v0/logs/stream`` per
file, which sends only what was appended, so it costs the bytes the job
writes; latency about the ``--log-poll-interval`` the agent checks at, 0.1 s
by default). stdout and stderr stay apart in every mode and Ray's own lines
(runtime env set-up, "Running entrypoint ...") are not the job's output;
they stay in Ray's job log, and Ray's message on a failure quotes its end.
Not Ray's ``/api/jobs/{id}/logs`` (the whole log on every read) nor its
``/api/jobs/{id}/logs/tail`` websocket (``ray job logs --follow``: its file
tail sleeps 1 s at end of file). A follow ends once the poller saw the job end
and every file reached its end (bench/bench_ray.py measures both).

Usage (``usage.py``): the last sample of each process (``lines=1`` of its
``.usage`` file): CPU seconds, RSS and peak, GPU utilisation and memory where
NVML is there; ``running`` false once the process, or the job, ended. Ray
itself measures no process of a job (``usage.py`` says why).

Replicas: when Ray reports a job ended, the driver reads the launcher's
manifest once (at most ``END_WAIT_SECONDS``, the job keeping its last state
meanwhile: JobManager takes the first terminal observation as final) and
reports every process's end; a failed entrypoint whose process exited
non-zero is reason ``NonZeroExit`` with that process's code and
``<role>-<index> exited with code N`` before Ray's message.

Bounded memory (``ForgetJobs``): once JobManager has recorded a job's end,
the driver drops everything it keeps of it (its observation, entrypoint
node, submission ids, manifests, stop marks). The poller keeps only jobs it
saw before they ended: a submission first listed ended (forgotten, or ended
while no driver watched) is not tracked, by this driver or a restarted one.
Such a job is answered when asked, from Ray by its submission id (the ref's
``backend_job_id``): an observation is one ``GET /api/jobs/{id}`` (and the
manifest for its replicas), logs and usage read the files on its node as
for a tracked job, and cleanup lists Ray's jobs for its every attempt. Nothing
of it stays in memory.

Capacity: ``GET /api/cluster_status`` (the autoscaler's load report: total
and used CPU, GPU, memory, per node).

Endpoints relied on, all public in Ray 2.x: ``/api/jobs/`` (submit, list,
get, stop, delete; the list's ``driver_node_id``), ``/api/cluster_status``,
``/api/v0/logs/file`` and ``/api/v0/logs/stream`` (``node_id``,
``filename`` relative to the node's log directory, ``lines``, ``interval``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dlsched import __version__
from dlsched.errors import FailedPrecondition, InvalidArgument, Unavailable
from dlsched.kit import metrics
from drivers.common.base import (
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
    NameCollision,
    RunMode,
    same_job,
)
from drivers.common.launches import Known
from drivers.common.registry import STOP_REQUESTED, BackendUnavailable
from drivers.common.skeleton import BackendDriver, render_off_loop
from drivers.ray import layout, logs, render, states, usage
from drivers.ray.api import RayHttpError, last_line
from drivers.ray.parse import (
    capacity,
    newest_submission,
    observation,
    of_job,
    over_time_limit,
    with_replicas,
)
from drivers.ray.tracking import RayCluster as _Cluster

log = logging.getLogger("dlsched.driver.ray")

REASON_SUBMITTED = "Submitted"
END_WAIT_SECONDS = 5.0
#: look-ups of untracked (forgotten) jobs one observation may have in flight at once
UNTRACKED_CONCURRENCY = 8
ADDRESS_RE = re.compile(r"https?://[^/\s]+(/\S*)?")
#: How long after a submission's end Ray's job monitor may still look at it (its loop period is
#: 1 s): a delete waits that long (see ``_settled``).
MONITOR_SETTLE_SECONDS = 2.5


@dataclass(frozen=True)
class RayConfig:
    """The Ray driver's flags."""

    poll_interval: float = field(default=1.0, metadata={"help": "seconds between job list polls"})
    log_poll_interval: float = field(default=0.1, metadata={"help": "seconds between Ray's checks of a followed log file"})
    request_timeout: float = field(default=10.0, metadata={"help": "HTTP timeout per request"})


class RayDriver(BackendDriver[_Cluster, render.RaySubmission]):
    name = "ray"
    backend_noun = "the Ray head"
    carry_over = ("jobs", "submissions", "nodes", "ends", "known", "stop_requested", "started")
    supports_logs = True
    supports_usage = True

    def __init__(self, config: RayConfig | None = None) -> None:
        super().__init__()
        self._cfg = config or RayConfig()

    # ------------------------------------------------------------------ clusters

    def _validate_config(self, config: ClusterConfig) -> None:
        if not ADDRESS_RE.fullmatch(config.address or ""):
            raise InvalidArgument.for_field("address", "the Ray dashboard URL, e.g. http://head:8265")
        render.RayOptions.from_mapping(config.options)

    async def _connect(self, config: ClusterConfig, old: _Cluster | None) -> _Cluster:
        return _Cluster(config, self._cfg.request_timeout)

    async def _disconnect(self, c: _Cluster) -> None:
        for t in list(c.background):
            t.cancel()
        if c.task is not None:
            c.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await c.task
        await c.api.close()

    async def _activate(self, name: str, c: _Cluster) -> None:
        c.task = asyncio.create_task(self._poll_loop(name, c), name=f"ray-poll-{name}")

    def _modes(self, c: _Cluster) -> tuple[RunMode, ...]:
        return render.SUPPORTED_RUN_MODES

    async def _info(self, c: _Cluster) -> ClusterInfo:
        version = f"{self.name}/{__version__}"
        try:
            # (bounded by the kit: a head that does not answer in time is the cluster slow)
            doc = await c.request("GET", "/api/cluster_status")
        except (RayHttpError, Unavailable) as e:
            return ClusterInfo(state=ClusterState.UNREACHABLE, message=str(e)[:500], driver_version=version)
        report = (((doc or {}).get("data") or {}).get("clusterStatus") or {}).get("loadMetricsReport")
        if not report or not (report.get("usage") or {}).get("CPU"):
            return ClusterInfo(state=ClusterState.PENDING, message="Ray has not reported its resources yet",
                               supported_run_modes=render.SUPPORTED_RUN_MODES, driver_version=version)
        return ClusterInfo(state=ClusterState.READY, capacity=capacity(report),
                           supported_run_modes=render.SUPPORTED_RUN_MODES, driver_version=version)

    async def _ready(self, c: _Cluster) -> None:
        await c.polled.wait()
        if not c.known:
            raise BackendUnavailable(c.error or "the Ray head has not answered yet")

    # ------------------------------------------------------------------ the poller
    async def _poll_loop(self, name: str, c: _Cluster) -> None:
        while True:
            started = time.perf_counter()
            try:
                items = await c.request("GET", "/api/jobs/")
                if not isinstance(items, list):
                    raise RayHttpError(200, "the job list is not a JSON list")
                self._apply(name, c, items)
                c.ok, c.known, c.error = True, True, ""
            except (RayHttpError, Unavailable) as e:
                c.ok, c.error = False, str(e)
                self._mark_stale(name, c)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # never let the poller die
                log.exception("poll of %s failed", name)
                c.ok, c.error = False, f"{type(e).__name__}: {e}"
                self._mark_stale(name, c)
            metrics.POLL_DURATION.labels("ray").observe(time.perf_counter() - started)
            c.polled.set()
            c.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(c.wake.wait(), self._cfg.poll_interval)

    def _set(self, name: str, c: _Cluster, obs: JobObservation) -> None:
        if c.jobs.get(obs.job_id) != obs:
            c.jobs[obs.job_id] = obs
            self.hub.publish(name, obs)

    def _apply(self, name: str, c: _Cluster, items: list[Any]) -> None:
        groups: dict[str, list[tuple[render.SubmissionMeta, dict[str, Any]]]] = {}
        c.legacy.clear()
        for it in items:
            meta = render.parse_submission(it) if isinstance(it, dict) else None
            if meta is not None:
                groups.setdefault(meta.job_id, []).append((meta, it))
        seen = {job_id: {m.submission_id for m, _ in subs} for job_id, subs in groups.items()}
        newest = {job_id: newest_submission(c.jobs.get(job_id), subs) for job_id, subs in groups.items()}
        for job_id, (meta, it) in newest.items():
            prev = c.jobs.get(job_id)
            if prev is not None and prev.attempt > meta.attempt:
                continue  # a launch the list does not show yet
            if prev is not None and not of_job(prev, meta):
                continue  # a list from before a cleanup (an earlier job's submission of the id), or not ours
            obs = observation(job_id, meta.attempt, it, c.note_start(prev, it))
            if prev is None and obs.state.is_terminal():
                if (uid := render.uid_of(it)) and not render.carries_uid(obs.backend_job_id):  # made before
                    c.legacy[job_id] = (meta.attempt, uid, obs.backend_job_id)  # ids named uids (uid-less: no telling)
                continue  # ended before it was tracked, or forgotten: answered when asked (``_untracked``)
            node = it.get("driver_node_id")
            if isinstance(node, str) and node:
                c.nodes[job_id] = node
            if obs.state.is_terminal():
                ended = self._ended(name, c, obs)
                if ended is None:
                    continue
                obs = ended
            if obs.state is JobState.RUNNING and over_time_limit(it, obs.start_time, time.time()):
                self._stop_later(c, obs.backend_job_id)
            if not obs.state.is_terminal() and obs.backend_job_id in c.stop_requested:
                obs = replace(obs, state=JobState.STOPPING, reason=STOP_REQUESTED,
                              message="stop sent to Ray")  # until Ray reports the end
            self._set(name, c, obs)
        for job_id in [j for j in c.jobs if j not in newest]:
            obs = c.jobs[job_id]
            if obs.reason != REASON_SUBMITTED:  # a fresh launch may race the list; others were deleted
                gone = JobObservation.not_found(JobRef(job_id, obs.backend_job_id), obs.uid)
                self._drop(c, job_id)
                self.hub.publish(name, gone)
        # every attempt of the tracked jobs only (cleanup lists Ray's jobs for an untracked one)
        c.submissions = {k: v for k, v in {**c.submissions, **seen}.items() if k in c.jobs}

    def _ended(self, name: str, c: _Cluster, obs: JobObservation) -> JobObservation | None:
        """An ended job with its replicas; ``None`` (the last state stays) while its manifest is read.

        JobManager takes the first terminal observation as final, so the end
        waits for the launcher's manifest (one read, ``END_WAIT_SECONDS`` at
        most; a job that never started, or a driver that first sees it ended,
        has nothing to wait for).
        """
        sid = obs.backend_job_id
        manifest = c.ends.get(sid)
        if manifest is not None:
            c.held.pop(sid, None)
            return with_replicas(obs, manifest)
        node, prev = c.nodes.get(obs.job_id), c.jobs.get(obs.job_id)
        if not node or prev is None or prev.state.is_terminal() or prev.backend_job_id != sid:
            return obs
        first, _ = c.held.get(sid, (time.monotonic(), obs))
        if time.monotonic() - first > END_WAIT_SECONDS:
            c.held.pop(sid, None)
            return obs
        c.held[sid] = (first, obs)
        if sid not in c.reading:
            c.reading.add(sid)

            async def read() -> None:
                try:
                    m = await logs.read_manifest(c.api, sid, node)
                except Unavailable:
                    return  # asked again at the next poll, until END_WAIT_SECONDS
                finally:
                    c.reading.discard(sid)
                c.ends[sid] = m if m is not None else layout.Manifest([], {})
                held = c.held.pop(sid, None)
                cur = c.jobs.get(obs.job_id)
                if held is not None and cur is not None and cur.backend_job_id == sid and not cur.state.is_terminal():
                    self._set(name, c, with_replicas(held[1], c.ends[sid]))

            task = asyncio.create_task(read())
            c.background.add(task)
            task.add_done_callback(c.background.discard)
        return None

    def _stop_later(self, c: _Cluster, sid: str) -> None:
        async def stop() -> None:
            with contextlib.suppress(RayHttpError, Unavailable):
                await c.request("POST", f"/api/jobs/{sid}/stop")
        if sid not in c.stopping:
            c.stopping.add(sid)
            task = asyncio.create_task(stop())
            task.add_done_callback(lambda _: c.stopping.discard(sid))

    def _mark_stale(self, name: str, c: _Cluster) -> None:
        for obs in list(c.jobs.values()):
            if obs.found and not obs.state.is_terminal() and obs.reason != states.REASON_STALE:
                self._set(name, c, replace(obs, reason=states.REASON_STALE,
                                           message=f"last state {obs.state.name} ({obs.reason}); {c.error}"))

    # ------------------------------------------------------------------ jobs

    async def _prepare(self, c: _Cluster, job_id: str, spec: JobSpec, attempt: int,
                       uid: str) -> render.RaySubmission:
        return await render_off_loop(spec, render.render, job_id, spec, attempt, c.config.options, uid)

    def _known(self, c: _Cluster, job_id: str, rendered: render.RaySubmission) -> Known | None:
        prev = c.jobs.get(job_id)
        if prev is None:
            return None
        return Known(c.config.name, prev.attempt, not prev.state.is_terminal(),
                     lambda: LaunchResult(prev.backend_job_id, rendered.native_spec(), prev), prev.uid)

    async def _submit(self, c: _Cluster, name: str, job_id: str, spec: JobSpec, attempt: int,
                      rendered: render.RaySubmission) -> LaunchResult:
        legacy, obs = c.legacy.get(job_id), None
        if legacy is not None and legacy[0] == attempt and same_job(legacy[1], rendered.uid):
            # this launch, submitted by an earlier driver under an id without the uid: adopted
            obs = await self._untracked(c, JobRef(job_id, legacy[2], legacy[1]))
        if obs is None:
            obs = await self._post(c, job_id, attempt, rendered)
        sid = obs.backend_job_id
        self._set(name, c, obs)
        c.submissions.setdefault(job_id, set()).add(sid)
        return LaunchResult(sid, rendered.native_spec(), obs)

    async def _post(self, c: _Cluster, job_id: str, attempt: int,
                    rendered: render.RaySubmission) -> JobObservation:
        """POST the submission: its observation, the first submission's when Ray has it already."""
        sid = rendered.submission_id
        try:
            await c.request("POST", "/api/jobs/", dict(rendered.body))
            return JobObservation(job_id=job_id, backend_job_id=sid, found=True, state=JobState.PENDING,
                                  reason=REASON_SUBMITTED, message="submitted to Ray", attempt=attempt,
                                  start_time=None, uid=rendered.uid)
        except (RayHttpError, Unavailable) as e:
            existing = await c.api.find(sid)
            if existing is None:
                if isinstance(e, Unavailable):
                    raise
                if e.status >= 500 and "try again later" in e.text:  # e.g. no job agent up yet: retried
                    raise e.unavailable(f"submit {sid}") from e
                raise FailedPrecondition(f"Ray refused the submission: {last_line(e.text)}",
                                         reason="BACKEND_REJECTED",
                                         metadata={"http_status": str(e.status)}) from e
            if render.parse_submission(existing) is None:  # our id, not of our job and uid: not ours
                raise NameCollision(f"Ray submission {sid} is another job's (uid {render.uid_of(existing)})",
                                    metadata={"job_uid": render.uid_of(existing)}) from e
            return observation(job_id, attempt, existing)  # the first submission

    async def _settled(self, c: _Cluster, sid: str) -> None:
        """Until Ray's job monitor (a look a second) has seen a submission's end, if a later one
        may use its id (no uid in it): deleted before, the monitor goes on and fails the next
        job of that id (JobSupervisorActorDied). At most ``MONITOR_SETTLE_SECONDS`` after it."""
        if render.carries_uid(sid):
            return
        info = await c.api.find(sid)
        end = info.get("end_time") if isinstance(info, dict) else None
        if isinstance(end, (int, float)) and end > 0:
            wait = min(MONITOR_SETTLE_SECONDS, end / 1000 + MONITOR_SETTLE_SECONDS - time.time())
            if wait > 0:
                await asyncio.sleep(wait)

    def _snapshot(self, c: _Cluster) -> Iterable[JobObservation]:
        return list(c.jobs.values())

    def _lookup(self, c: _Cluster, ref: JobRef) -> JobObservation | None:
        return c.jobs.get(ref.job_id)

    async def _observe(self, c: _Cluster, refs: Sequence[JobRef]) -> list[JobObservation | None]:
        untracked = {r.backend_job_id: r for r in refs if r.job_id not in c.jobs and r.backend_job_id}
        found: dict[str, JobObservation | None] = {}
        if untracked:
            gate = asyncio.Semaphore(UNTRACKED_CONCURRENCY)

            async def one(ref: JobRef) -> None:
                async with gate:
                    found[ref.backend_job_id] = await self._untracked(c, ref)
            await asyncio.gather(*(one(r) for r in untracked.values()))
        return [c.jobs.get(r.job_id) or found.get(r.backend_job_id) for r in refs]

    async def _submission(self, c: _Cluster, ref: JobRef) -> tuple[dict[str, Any], int, str | None] | None:
        """An untracked job's submission (the ref's), its attempt and entrypoint node; None when
        Ray has no such submission of this job."""
        if not ref.backend_job_id:
            return None
        doc = await c.api.find(ref.backend_job_id)
        meta = render.parse_submission(doc) if doc is not None else None
        if doc is None or meta is None or meta.job_id != ref.job_id or not ref.names_uid(meta.uid):
            return None
        node = doc.get("driver_node_id")
        return doc, meta.attempt, node if isinstance(node, str) and node else None

    async def _untracked(self, c: _Cluster, ref: JobRef) -> JobObservation | None:
        """An untracked job's observation, from Ray now (with its replicas once it ended)."""
        found = await self._submission(c, ref)
        if found is None:
            return None
        doc, attempt, node = found
        obs = observation(ref.job_id, attempt, doc)
        if obs.state.is_terminal() and node:
            manifest = await logs.read_manifest(c.api, ref.backend_job_id, node)
            if manifest is not None:
                obs = with_replicas(obs, manifest)
        return obs

    def _sid(self, c: _Cluster, ref: JobRef) -> str | None:
        """The ref's submission: its backend id, else the tracked job's."""
        return ref.backend_job_id or (obs.backend_job_id if (obs := c.jobs.get(ref.job_id)) else None)

    def _follows(self, c: _Cluster, ref: JobRef) -> bool:
        """Whether the ref's submission is the one tracked (else Ray says whose it is: ``_submission``)."""
        return ref.job_id in c.jobs and ref.backend_job_id in ("", c.jobs[ref.job_id].backend_job_id)

    async def _terminate(self, c: _Cluster, name: str, ref: JobRef,
                         grace_seconds: float | None) -> JobObservation | None:
        sid = self._sid(c, ref)
        if sid is None:
            return None
        obs = c.jobs.get(ref.job_id) if self._follows(c, ref) else None
        if obs is None:  # not the submission tracked: Ray says whose it is; an ended one is not stopped again
            gone = await self._untracked(c, ref)
            if gone is None or gone.state.is_terminal():
                return gone
        try:
            await c.request("POST", f"/api/jobs/{sid}/stop")
        except RayHttpError as e:
            if e.status != 404:
                raise e.unavailable(f"stop {sid}") from e
            return obs
        c.stop_requested.add(sid)
        c.wake.set()
        if obs is None:
            return JobObservation(job_id=ref.job_id, backend_job_id=sid, found=True,
                                  state=JobState.STOPPING, reason=STOP_REQUESTED)
        stopping = replace(obs, state=JobState.STOPPING, reason=STOP_REQUESTED, message="stop sent to Ray")
        self._set(name, c, stopping)
        return stopping

    async def _cleanup(self, c: _Cluster, name: str, ref: JobRef) -> None:
        sids = set(c.submissions.get(ref.job_id, ()))
        if ref.backend_job_id and (ref.job_id in c.jobs or not ref.uid):  # (else: Ray's list says whose)
            sids.add(ref.backend_job_id)
        if ref.job_id not in c.jobs:  # untracked (forgotten): its attempts, from Ray's list
            items = await c.request("GET", "/api/jobs/")
            for it in items if isinstance(items, list) else ():
                meta = render.parse_submission(it) if isinstance(it, dict) else None
                if meta is not None and meta.job_id == ref.job_id and ref.names_uid(meta.uid):
                    sids.add(meta.submission_id)
        for sid in sorted(sids):
            await self._delete(c, sid)
        if (tracked := c.jobs.get(ref.job_id)) is not None:  # its uid: JobManager tells the job it was
            self.hub.publish(name, JobObservation.not_found(JobRef(ref.job_id, tracked.backend_job_id),
                                                            tracked.uid))
        self._drop(c, ref.job_id, sids)

    def _forget(self, c: _Cluster, ref: JobRef) -> bool:
        obs = c.jobs.get(ref.job_id)
        if obs is None or not obs.state.is_terminal() or ref.backend_job_id not in ("", obs.backend_job_id):
            return False
        self._drop(c, ref.job_id, {obs.backend_job_id})
        return True

    def _drop(self, c: _Cluster, job_id: str, sids: Iterable[str] = ()) -> None:
        """Let go of everything kept of a job (and of these submissions of it)."""
        obs = c.jobs.pop(job_id, None)
        gone = set(sids) | c.submissions.pop(job_id, set())
        if obs is not None:
            gone.add(obs.backend_job_id)
        c.nodes.pop(job_id, None)
        for sid in gone:
            c.ends.pop(sid, None)
            c.held.pop(sid, None)
            c.stop_requested.discard(sid)
            c.started.pop(sid, None)

    async def _delete(self, c: _Cluster, sid: str) -> None:
        await self._settled(c, sid)
        for stopped in (False, True):
            try:
                await c.request("DELETE", f"/api/jobs/{sid}")
                return
            except RayHttpError as e:
                if e.status == 404:
                    return
                not_ended = e.status == 400 or "non-terminal" in e.text  # 500 on Ray 2.x
                if stopped or not not_ended:
                    raise e.unavailable(f"delete {sid}") from e
            # Not ended yet: stop it and wait for the end (Ray kills after its stop timeout).
            with contextlib.suppress(RayHttpError):
                await c.request("POST", f"/api/jobs/{sid}/stop")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                doc = await c.api.find(sid)
                if doc is None or states.map_status(doc.get("status"))[0].is_terminal():
                    break
                await asyncio.sleep(0.2)

    # ------------------------------------------------------------------ logs and usage

    def _ended_job(self, c: _Cluster, job_id: str, sid: str = "") -> bool:
        """Whether the job's tracked submission (``sid``'s, when given) has ended: one the job
        no longer tracks (a retry's submission took its place) has."""
        obs = c.jobs.get(job_id)
        return obs is None or obs.state.is_terminal() or bool(sid) and obs.backend_job_id != sid

    def _tail(self, c: _Cluster, ref: JobRef, query: LogQuery) -> AsyncIterator[list[LogEntry]]:
        if not self._follows(c, ref):
            return self._tail_untracked(c, ref, query)
        sid = self._sid(c, ref)
        if sid is None:
            raise JobNotFound(ref.job_id)
        # ended with its own submission: a follow goes on to a retry's (JobManager's next tail)
        return logs.tail(c.api, ref.job_id, sid, query, ended=lambda: self._ended_job(c, ref.job_id, sid),
                         node=lambda: c.nodes.get(ref.job_id), interval=self._cfg.log_poll_interval)

    async def _tail_untracked(self, c: _Cluster, ref: JobRef, query: LogQuery) -> AsyncIterator[list[LogEntry]]:
        """An untracked job's logs: its node from Ray, then the files as for a tracked job."""
        found = await self._submission(c, ref)
        if found is None:
            raise JobNotFound(ref.job_id)
        doc, _, node = found
        ended = observation(ref.job_id, 0, doc).state.is_terminal()
        tail = logs.tail(c.api, ref.job_id, ref.backend_job_id, query,
                         ended=lambda: ended or self._ended_job(c, ref.job_id),
                         node=lambda: node or c.nodes.get(ref.job_id), interval=self._cfg.log_poll_interval)
        async with contextlib.aclosing(tail) as batches:  # type: ignore[type-var]
            async for batch in batches:
                yield batch

    async def _usage(self, c: _Cluster, ref: JobRef) -> JobUsage:
        if not self._follows(c, ref):  # untracked: its node from Ray
            found = await self._submission(c, ref)
            if found is None:
                raise JobNotFound(ref.job_id)
            doc, attempt, node = found
            sid, ended = ref.backend_job_id, observation(ref.job_id, attempt, doc).state.is_terminal()
        else:
            sid = self._sid(c, ref) or ""
            ended = self._ended_job(c, ref.job_id)
            node = c.nodes.get(ref.job_id)
        manifest = await logs.read_manifest(c.api, sid, node) if node else None
        if manifest is None:  # not started yet
            return JobUsage(replicas=(), sample_time=time.time())
        return await usage.job_usage(c.api, sid, node or "", manifest, ended)
