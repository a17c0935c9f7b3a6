"""``RayDriver``: jobs on Ray clusters through the Ray Jobs REST API (aiohttp; no ``import ray``).

A cluster's address is its dashboard URL (``http://head:8265``); its
credentials, when the cluster has token auth, are a token sent as
``Authorization: Bearer`` (kept in memory, never logged or returned).

Submission (``launch``): ``render.render_submission`` POSTed to
``/api/jobs/``. The submission id ``dlsched-{job}-{attempt}`` makes it
idempotent at Ray itself: a retried POST is refused ("already exists",
HTTP 400 or 500 depending on the Ray version), and on *any* refused or
failed POST the driver asks ``GET /api/jobs/{submission_id}``: a job there
is the first submission, returned as the launch's result. The attempt rules
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
``TimeLimitExceeded``.

Stop: ``POST /api/jobs/{id}/stop`` (Ray sends SIGTERM, then SIGKILL after its
own ``RAY_JOB_STOP_WAIT_TIME_S``, set on the cluster; a request's grace
period is not honoured per job). Cleanup: ``DELETE /api/jobs/{id}`` for every
attempt, stopping a still-running one first. Unknown jobs succeed.

Logs: ``GET /api/jobs/{id}/logs`` (the entrypoint's combined stdout and
stderr, so every entry is STDOUT). A follow re-reads it every
``--log-poll-interval`` (0.1 s by default; longer for a log of many MB, since
Ray sends all of it each time) and sends what was appended. Not Ray's
``/api/jobs/{id}/logs/tail`` websocket (what ``ray job logs --follow`` uses):
its file tail sleeps 1 s at end of file and its job manager another 1 s, so a
line waits about 1 s (bench/bench_ray.py: p50 ~1 s there, ~65 ms here). A
follow ends once the poller saw the job end and a last read drained it.
Lines the launcher tagged ``[dlsched role-index stream]`` (MULTI_PROCESS,
MASTER_WORKER, PS_WORKER) are attributed to that replica and stream; other lines belong to the job's first role, replica 0.
Ray's lines carry no time: history entries have none, followed ones the
time they were read, and ``since_time`` only filters the followed ones.

Capacity: ``GET /api/cluster_status`` (the autoscaler's load report: total
and used CPU, GPU, memory, per node).

Usage is UNIMPLEMENTED: Ray measures no process of a job. Its reporter
(``/nodes/{node_id}`` ``workers``) samples only the processes the raylet
registered (workers, agents), each alone; a job's entrypoint is a subprocess
of its ``JobSupervisor`` actor and the launcher's replica processes are
subprocesses of its tasks, so neither appears there, nor in ``/api/v0/tasks``,
``/api/v0/actors`` or ``/api/v0/workers`` (checked on Ray 2.60: a busy 200 MB
entrypoint showed in none of them). What Ray does hold per job, the requested
entrypoint resources and placement-group bundles, is a request, not a
measurement, so it is not reported as usage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from dlsched import __version__
from dlsched.errors import FailedPrecondition, InvalidArgument, Unavailable
from dlsched.kit import metrics
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
    LogStream,
    NativeSpec,
    TokenCredentials,
    WatchEvent,
)
from drivers.common.hub import ObservationHub
from drivers.common.launches import Known, LaunchRules
from drivers.common.registry import STOP_REQUESTED, BackendUnavailable, ClusterRegistry
from drivers.ray import render, states

log = logging.getLogger("dlsched.driver.ray")

MESSAGE_LIMIT = 2000
REASON_SUBMITTED = "Submitted"
TAG_RE = re.compile(r"\[dlsched (?P<role>[a-z][a-z0-9_-]*)-(?P<index>\d+) (?P<stream>out|err)\] ?")


@dataclass(frozen=True)
class RayConfig:
    """The Ray driver's flags."""

    poll_interval: float = field(default=1.0, metadata={"help": "seconds between job list polls"})
    log_poll_interval: float = field(default=0.1, metadata={"help": "seconds between log reads of a follow"})
    request_timeout: float = field(default=10.0, metadata={"help": "HTTP timeout per request"})


class _Http(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text[-300:]}")
        self.status, self.text = status, text


def _unavailable(address: str, e: BaseException) -> Unavailable:
    what = type(e).__name__ if not str(e) else f"{type(e).__name__}: {e}"
    return BackendUnavailable(f"Ray head {address} unreachable: {what}"[:500])


def _trim(message: str) -> str:
    return message if len(message) <= MESSAGE_LIMIT else message[:MESSAGE_LIMIT] + " ..."


class _Cluster:
    def __init__(self, config: ClusterConfig, timeout: float) -> None:
        self.config = config
        self.base = config.address.rstrip("/")
        headers = {}
        if isinstance(config.credentials, TokenCredentials) and config.credentials.token:
            headers["Authorization"] = f"Bearer {config.credentials.token}"
        self.session = aiohttp.ClientSession(headers=headers,
                                             timeout=aiohttp.ClientTimeout(total=timeout))
        self.jobs: dict[str, JobObservation] = {}  # job id -> newest attempt
        self.submissions: dict[str, set[str]] = {}  # job id -> every submission id seen
        self.roles: dict[str, str] = {}  # job id -> first role (log attribution)
        self.polled = asyncio.Event()
        self.ok = False  # the last poll answered
        self.known = False  # some poll answered: the cache is the cluster's, if maybe stale
        self.error = ""
        self.task: asyncio.Task[None] | None = None
        self.wake = asyncio.Event()
        self.stopping: set[str] = set()  # time-limit stops in flight
        self.stop_requested: set[str] = set()  # submissions a TerminateJob stopped: STOPPING until they end

    async def request(self, method: str, path: str, body: Any = None) -> Any:
        ok = False
        try:
            async with self.session.request(method, self.base + path, json=body) as r:
                text = await r.text()
                if r.status >= 300:
                    raise _Http(r.status, text)
                ctype = r.headers.get("Content-Type", "")
                out = await r.json(content_type=None) if "json" in ctype or text[:1] in "[{" else text
                ok = True
                return out
        except _Http:
            raise
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise _unavailable(self.base, e) from e
        finally:
            metrics.backend_call("ray", _call_name(method, path), ok)


def _call_name(method: str, path: str) -> str:
    """A bounded metric label for a call: ``GET /api/jobs/{id}/logs``, never the id itself."""
    parts = path.split("?", 1)[0].strip("/").split("/")
    if len(parts) > 2 and parts[:2] == ["api", "jobs"]:
        parts[2] = "{id}"
    return f"{method} /{'/'.join(parts[:4])}"


class RayDriver(Driver):
    name = "ray"

    def __init__(self, config: RayConfig | None = None) -> None:
        self._cfg = config or RayConfig()
        self._hub = ObservationHub()
        self._clusters: ClusterRegistry[_Cluster] = ClusterRegistry(self._hub)
        self._launches = LaunchRules()

    async def close(self) -> None:
        for c in self._clusters.values():
            await self._drop(c)
        self._clusters.clear()

    # ------------------------------------------------------------------ clusters

    def _get(self, cluster: str) -> _Cluster:
        return self._clusters.require(cluster)

    async def _drop(self, c: _Cluster) -> None:
        if c.task is not None:
            c.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await c.task
        await c.session.close()

    async def configure_cluster(self, config: ClusterConfig) -> ClusterInfo:
        if not re.match(r"^https?://[^/\s]+", config.address or ""):
            raise InvalidArgument.for_field("address", "the Ray dashboard URL, e.g. http://head:8265")
        render.RayOptions.from_mapping(config.options)
        # keep what was observed; swap address, credentials, session
        new = await self._clusters.configure(
            config.name, lambda _old: _Cluster(config, self._cfg.request_timeout),
            carry_over=("jobs", "submissions", "roles", "known", "stop_requested"), drop=self._drop)
        new.task = asyncio.create_task(self._poll_loop(config.name, new), name=f"ray-poll-{config.name}")
        return await self._info(new)

    async def remove_cluster(self, cluster: str) -> None:
        await self._clusters.remove(cluster, drop=self._drop)

    async def cluster_info(self, cluster: str) -> ClusterInfo:
        return await self._info(self._get(cluster))

    async def _info(self, c: _Cluster) -> ClusterInfo:
        version = f"{self.name}/{__version__}"
        try:
            doc = await c.request("GET", "/api/cluster_status")
        except (_Http, Unavailable) as e:
            return ClusterInfo(state=ClusterState.UNREACHABLE, message=str(e)[:500], driver_version=version)
        report = (((doc or {}).get("data") or {}).get("clusterStatus") or {}).get("loadMetricsReport")
        if not report or not (report.get("usage") or {}).get("CPU"):
            return ClusterInfo(state=ClusterState.PENDING, message="Ray has not reported its resources yet",
                               supported_run_modes=render.SUPPORTED_RUN_MODES, driver_version=version)
        return ClusterInfo(state=ClusterState.READY, capacity=capacity(report),
                           supported_run_modes=render.SUPPORTED_RUN_MODES, driver_version=version)

    # ------------------------------------------------------------------ the poller

    async def _poll_loop(self, name: str, c: _Cluster) -> None:
        while True:
            started = time.perf_counter()
            try:
                items = await c.request("GET", "/api/jobs/")
                if not isinstance(items, list):
                    raise _Http(200, "the job list is not a JSON list")
                self._apply(name, c, items)
                c.ok, c.known, c.error = True, True, ""
            except (_Http, Unavailable) as e:
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
            self._hub.publish(name, obs)

    def _apply(self, name: str, c: _Cluster, items: list[Any]) -> None:
        newest: dict[str, tuple[int, dict[str, Any]]] = {}
        seen: dict[str, set[str]] = {}
        for it in items:
            if not isinstance(it, dict) or it.get("type") != "SUBMISSION":
                continue
            meta = it.get("metadata") or {}
            job_id, sid = meta.get(render.META_JOB_ID), it.get("submission_id")
            try:
                attempt = int(meta.get(render.META_ATTEMPT, ""))
            except ValueError:
                continue
            if not job_id or not sid:
                continue
            seen.setdefault(job_id, set()).add(sid)
            if job_id not in newest or attempt > newest[job_id][0]:
                newest[job_id] = (attempt, it)
            if render.META_ROLE in meta:
                c.roles.setdefault(job_id, meta[render.META_ROLE])
        for job_id, (attempt, it) in newest.items():
            prev = c.jobs.get(job_id)
            if prev is not None and prev.attempt > attempt:
                continue  # a launch the list does not show yet
            obs = observation(job_id, attempt, it)
            if obs.state is JobState.RUNNING and over_time_limit(it, time.time()):
                self._stop_later(c, obs.backend_job_id)
            if not obs.state.is_terminal() and obs.backend_job_id in c.stop_requested:
                obs = replace(obs, state=JobState.STOPPING, reason=STOP_REQUESTED,
                              message="stop sent to Ray")  # until Ray reports the end
            self._set(name, c, obs)
        c.submissions = {**{k: v for k, v in c.submissions.items() if k in seen}, **seen}
        for job_id in [j for j in c.jobs if j not in newest]:
            obs = c.jobs[job_id]
            if obs.reason != REASON_SUBMITTED:  # a fresh launch may race the list; others were deleted
                del c.jobs[job_id]
                self._hub.publish(name, JobObservation.not_found(JobRef(job_id, obs.backend_job_id)))

    def _stop_later(self, c: _Cluster, sid: str) -> None:
        async def stop() -> None:
            with contextlib.suppress(_Http, Unavailable):
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

    async def _ready(self, c: _Cluster) -> None:
        await c.polled.wait()
        if not c.known:
            raise BackendUnavailable(c.error or "the Ray head has not answered yet")

    # ------------------------------------------------------------------ jobs

    async def render(self, cluster: str, job_id: str, spec: JobSpec) -> NativeSpec:
        c = self._get(cluster)
        return render.to_native_spec(render.render_submission(job_id, spec, 1, c.config.options))

    async def launch(self, cluster: str, job_id: str, spec: JobSpec, attempt: int) -> LaunchResult:
        c = self._get(cluster)
        body = render.render_submission(job_id, spec, attempt, c.config.options)
        native = render.to_native_spec(body)
        sid = body["submission_id"]
        await self._ready(c)

        def known() -> Known | None:
            prev = c.jobs.get(job_id)
            if prev is None:
                return None
            return Known(cluster, prev.attempt, not prev.state.is_terminal(), lambda: LaunchResult(sid, native, prev))

        async def submit() -> LaunchResult:
            c.roles[job_id] = body["metadata"][render.META_ROLE]
            try:
                await c.request("POST", "/api/jobs/", body)
                obs = JobObservation(job_id=job_id, backend_job_id=sid, found=True, state=JobState.PENDING,
                                     reason=REASON_SUBMITTED, message="submitted to Ray", attempt=attempt,
                                     start_time=None)
            except (_Http, Unavailable) as e:
                existing = await self._find(c, sid)
                if existing is None:
                    if isinstance(e, Unavailable):
                        raise
                    raise FailedPrecondition(f"Ray refused the submission: {_last_line(e.text)}",
                                             reason="BACKEND_REJECTED",
                                             metadata={"http_status": str(e.status)}) from e
                obs = observation(job_id, attempt, existing)  # the first submission
            self._set(cluster, c, obs)
            c.submissions.setdefault(job_id, set()).add(sid)
            return LaunchResult(sid, native, obs)

        return await self._launches.launch(cluster, job_id, attempt, known=known, submit=submit)

    async def _find(self, c: _Cluster, sid: str) -> dict[str, Any] | None:
        try:
            doc = await c.request("GET", f"/api/jobs/{sid}")
        except _Http as e:
            if e.status == 404:
                return None
            raise BackendUnavailable(f"Ray answered {e}") from e
        return doc if isinstance(doc, dict) else None

    async def observe(self, cluster: str, refs: Sequence[JobRef]) -> list[JobObservation]:
        c = self._get(cluster)
        await self._ready(c)
        return [c.jobs.get(r.job_id) or JobObservation.not_found(r) for r in refs]

    def watch(self, cluster: str) -> AsyncIterator[WatchEvent]:
        return self._clusters.watch(cluster, lambda c: list(c.jobs.values()), ready=lambda c: c.polled.wait())

    def _sid(self, c: _Cluster, ref: JobRef) -> str | None:
        obs = c.jobs.get(ref.job_id)
        if obs is not None:
            return obs.backend_job_id
        return ref.backend_job_id or None

    async def terminate(self, cluster: str, ref: JobRef, grace_seconds: float | None) -> JobObservation:
        c = self._get(cluster)
        await self._ready(c)
        sid = self._sid(c, ref)
        if sid is None:
            return JobObservation.not_found(ref)
        obs = c.jobs.get(ref.job_id)
        if obs is not None and obs.state.is_terminal():
            return obs
        try:
            await c.request("POST", f"/api/jobs/{sid}/stop")
        except _Http as e:
            if e.status != 404:
                raise BackendUnavailable(f"Ray could not stop {sid}: {_last_line(e.text)}") from e
            return obs or JobObservation.not_found(ref)
        c.stop_requested.add(sid)
        c.wake.set()
        if obs is None:
            return JobObservation(job_id=ref.job_id, backend_job_id=sid, found=True,
                                  state=JobState.STOPPING, reason=STOP_REQUESTED)
        stopping = replace(obs, state=JobState.STOPPING, reason=STOP_REQUESTED, message="stop sent to Ray")
        self._set(cluster, c, stopping)
        return stopping

    async def cleanup(self, cluster: str, ref: JobRef) -> None:
        c = self._get(cluster)
        await self._ready(c)
        sids = set(c.submissions.get(ref.job_id, ()))
        if ref.backend_job_id:
            sids.add(ref.backend_job_id)
        for sid in sorted(sids):
            await self._delete(c, sid)
        if c.jobs.pop(ref.job_id, None) is not None:
            self._hub.publish(cluster, JobObservation.not_found(ref))
        c.submissions.pop(ref.job_id, None)

    async def _delete(self, c: _Cluster, sid: str) -> None:
        for stopped in (False, True):
            try:
                await c.request("DELETE", f"/api/jobs/{sid}")
                return
            except _Http as e:
                if e.status == 404:
                    return
                not_ended = e.status == 400 or "non-terminal" in e.text  # 500 on Ray 2.x
                if stopped or not not_ended:
                    raise BackendUnavailable(f"Ray could not delete {sid}: {_last_line(e.text)}") from e
            # Not ended yet: stop it and wait for the end (Ray kills after its stop timeout).
            with contextlib.suppress(_Http):
                await c.request("POST", f"/api/jobs/{sid}/stop")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                doc = await self._find(c, sid)
                if doc is None or states.map_status(doc.get("status"))[0].is_terminal():
                    break
                await asyncio.sleep(0.2)

    # ------------------------------------------------------------------ logs

    def tail_logs(self, cluster: str, ref: JobRef, query: LogQuery) -> AsyncIterator[list[LogEntry]]:
        return self._tail(cluster, ref, query)

    async def _tail(self, cluster: str, ref: JobRef, query: LogQuery) -> AsyncIterator[list[LogEntry]]:
        c = self._get(cluster)
        await self._ready(c)
        sid = self._sid(c, ref)
        if sid is None:
            raise JobNotFound(ref.job_id)
        role = c.roles.get(ref.job_id, "main")
        offset, pending, first = 0, "", True
        while True:
            obs = c.jobs.get(ref.job_id)
            ended = obs is None or obs.state.is_terminal()
            try:
                doc = await c.request("GET", f"/api/jobs/{sid}/logs")
            except _Http as e:
                if e.status == 404:
                    raise JobNotFound(ref.job_id) from e
                raise BackendUnavailable(f"Ray could not read the logs of {sid}: {_last_line(e.text)}") from e
            text = doc.get("logs", "") if isinstance(doc, dict) else ""
            if len(text) < offset:  # rewritten (should not happen): start over
                offset, pending = 0, ""
            chunk, offset = pending + text[offset:], len(text)
            lines = chunk.split("\n")
            done = ended or not query.follow
            pending = "" if done else lines.pop()
            if done and lines and lines[-1] == "":
                lines.pop()
            now = None if first else time.time_ns()
            entries = [e for e in (_entry(ln, role, now) for ln in lines) if _wanted(e, query)]
            if first and query.tail_lines > 0:
                entries = entries[-query.tail_lines:]
            first = False
            if entries:
                yield entries
            if done:
                return
            # Ray sends the whole log each time: read a big one less often (about 20 MB/s at most).
            await asyncio.sleep(min(2.0, max(self._cfg.log_poll_interval, len(text) / 20e6)))

    # ------------------------------------------------------------------ usage

    async def usage(self, cluster: str, ref: JobRef) -> JobUsage:
        self._get(cluster)  # an unknown cluster is CLUSTER_NOT_CONFIGURED, as for every call
        return await super().usage(cluster, ref)  # UNIMPLEMENTED: see the module docstring


def _entry(line: str, role: str, now: int | None) -> LogEntry:
    m = TAG_RE.search(line)
    if m is None:
        return LogEntry(role=role, replica_index=0, stream=LogStream.STDOUT, text=line, time_ns=now)
    stream = LogStream.STDERR if m.group("stream") == "err" else LogStream.STDOUT
    return LogEntry(role=m.group("role"), replica_index=int(m.group("index")), stream=stream,
                    text=line[m.end():], time_ns=now)


def _wanted(e: LogEntry, q: LogQuery) -> bool:
    if q.since_ns is not None and e.time_ns is not None and e.time_ns < q.since_ns:
        return False
    return q.wants_stream(e.stream) and q.wants_replica(e.role, e.replica_index)


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if any(ch.isalnum() for ch in ln)]
    return (lines[-1] if lines else text)[:500]


def _time_limit(it: Mapping[str, Any]) -> float | None:
    try:
        return float((it.get("metadata") or {})[render.META_TIME_LIMIT])
    except (KeyError, TypeError, ValueError):
        return None


def over_time_limit(it: Mapping[str, Any], now: float, end_ms: float | None = None) -> bool:
    """Whether the job ran (until ``end_ms``, or ``now``) past its ``dlsched_time_limit_seconds``."""
    limit, start = _time_limit(it), it.get("start_time")
    if limit is None or not start:
        return False
    end = end_ms / 1000 if end_ms else now
    return end - float(start) / 1000 >= limit


def observation(job_id: str, attempt: int, it: Mapping[str, Any]) -> JobObservation:
    """One Ray job (``GET /api/jobs/`` entry) as an observation.

    A job Ray reports STOPPED that had run past its time limit is FAILED,
    reason ``TimeLimitExceeded``: the driver stopped it for that.
    """
    state, reason = states.map_status(it.get("status"), it.get("error_type"))
    if state is JobState.STOPPED and it.get("end_time") and over_time_limit(it, 0, it["end_time"]):
        return replace(_observation(job_id, attempt, it), state=JobState.FAILED, reason="TimeLimitExceeded",
                       message=f"stopped after its time limit of {_time_limit(it)} s")
    return _observation(job_id, attempt, it)


def _observation(job_id: str, attempt: int, it: Mapping[str, Any]) -> JobObservation:
    state, reason = states.map_status(it.get("status"), it.get("error_type"))
    exit_code = it.get("driver_exit_code")
    start, end = it.get("start_time"), it.get("end_time")
    return JobObservation(
        job_id=job_id, backend_job_id=str(it.get("submission_id") or ""), found=True, state=state,
        reason=reason, message=_trim(str(it.get("message") or "")),
        exit_code=int(exit_code) if isinstance(exit_code, int) else None,
        start_time=start / 1000 if start else None, end_time=end / 1000 if end and state.is_terminal() else None,
        attempt=attempt)


def capacity(report: Mapping[str, Any]) -> ClusterCapacity:
    """The autoscaler's load report (``usage``: resource -> [used, total]) as capacity."""
    usage = report.get("usage") or {}
    by_node = (report.get("usageByNode") or {}).values()

    def pair(d: Mapping[str, Any], key: str) -> tuple[float, float]:
        v = d.get(key) or [0.0, 0.0]
        return float(v[0]), float(v[1])

    cpu_used, cpu_total = pair(usage, "CPU")
    mem_used, mem_total = pair(usage, "memory")
    gpu_used, gpu_total = pair(usage, "GPU")
    gpus = []
    for key in usage:
        if key.startswith("accelerator_type:"):
            # Ray counts accelerator types per node (1 per node of that type), not per GPU.
            gpus.append(GpuInventory(gpu_type=key.split(":", 1)[1], total=int(gpu_total), free=int(gpu_total - gpu_used)))
    nodes = list(by_node)
    return ClusterCapacity(
        nodes_total=len(nodes),
        nodes_free=sum(1 for n in nodes if pair(n, "CPU")[0] == 0 and pair(n, "GPU")[0] == 0),
        cpus_total=cpu_total, cpus_free=max(0.0, cpu_total - cpu_used),
        memory_bytes_total=int(mem_total), memory_bytes_free=int(max(0.0, mem_total - mem_used)),
        gpus_total=int(gpu_total), gpus_free=int(max(0.0, gpu_total - gpu_used)), gpus=tuple(gpus[:1]),
        max_cpus_per_node=max((pair(n, "CPU")[1] for n in nodes), default=0.0),
        max_memory_bytes_per_node=int(max((pair(n, "memory")[1] for n in nodes), default=0.0)),
        max_gpus_per_node=int(max((pair(n, "GPU")[1] for n in nodes), default=0.0)),
    )
