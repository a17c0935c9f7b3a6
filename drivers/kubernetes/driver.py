"""``KubernetesDriver``: jobs as a headless Service and plain Pods, through the REST API.

The public operations are the kit's (``drivers.common.skeleton``); this
class fills in its hooks. The package, by concern: ``render`` (check →
place → emit; pure), ``naming`` (names, labels and the annotation codec),
``api`` (the client, calls as plain JSON off the loop, the one error map),
``informer`` (one pod list + watch per cluster; the request budget),
``tracking`` (the tracked jobs and their observations), ``states`` (pod →
replica → job state), ``logs`` and ``usage`` (metrics.k8s.io, capacity).

Clusters. ``address`` is the API server URL. Credentials (write-only, in
memory only, never logged): a bearer token with an optional CA bundle, or a
kubeconfig (its current context). Options: ``namespace``, ``default_image``,
``image_pull_secrets``, ``service_account`` (see ``render``), and
``insecure_skip_tls_verify`` (``true`` only for test clusters). Every API
call goes through the official ``kubernetes`` client in a worker thread
(``asyncio.to_thread``), after taking a token from the cluster's
``RequestBudget`` (``--qps`` / ``--burst``).

Launch creates the Service, then every other object (MPI: the Secret, with
a fresh Ed25519 key pair from ``mpi.ssh_keypair`` filled in, and the ConfigMap;
then the Pods) with an owner reference to the Service's uid. The key pair
needs the ``cryptography`` package; without it MPI is left out of
``supported_run_modes`` and an MPI launch is FAILED_PRECONDITION
``MPI_NOT_AVAILABLE``. The native spec a launch returns is the rendered
one: it never carries the private key. Idempotent: ``409 AlreadyExists`` means already submitted (the
existing Service must carry the same job id and attempt labels, else
FAILED_PRECONDITION ``NAME_COLLISION``), so a retried launch creates nothing
twice. The attempt rules are the kit's (``drivers.common.launches``): a new
attempt is ``PREVIOUS_ATTEMPT_ACTIVE`` until the previous one's end is
latched. ``backend_job_id`` is ``<namespace>/<service>``.

Status: one ``PodInformer`` per cluster (list + watch of the pods labelled
``dlsched.io/job-id``); no per-job GETs. Jobs are keyed by that label's value,
``naming.job_label(job_id)`` (not the raw id, which may differ: ``a--b``),
and a request's job id is looked up through the same function. Each pod event updates that job's
replicas (``states.replica_of``) and its state (``states.job_state`` with
the run mode's success rule, read back from the pod annotations), and every
change is published to the watchers. Terminal states are latched. When the
deciding roles succeed, the remaining pods (PS-Worker's parameter servers)
are deleted and end STOPPED; when a replica fails, the job is FAILED at once
(reason and message name the replica) and its other pods are deleted. A
job's pods seen on the watch but unknown to this process (after a driver
restart) are adopted: the job is rebuilt from the labels and annotations
(``naming.decode``).

API server unreachable or answering 5xx: the informer reports it stale, every
job keeps its last state with reason ``BackendStale`` (never FAILED) and
``cluster_info`` says UNREACHABLE; a later successful list recomputes every
job. Launch, stop and delete then fail with UNAVAILABLE
``BACKEND_UNAVAILABLE`` (JobManager retries them).

Stop deletes the job's pods (grace period from the request); the job is
STOPPING until the watch shows them gone, then STOPPED; the Service stays,
so the record is kept. Cleanup deletes every pod, the other objects (MPI's
Secret and ConfigMap) and the Service (and with it, on a real cluster,
anything the garbage collector finds owned by it).
Both are idempotent (404 is success).

Forget (ForgetJobs, once JobManager has stored the job's end): the job
leaves ``c.jobs`` at once; its record goes on its Service and the label
``dlsched.io/recorded`` on its pods (``records``; retried while the API
server fails, the job answering from ``c.forgetting`` meanwhile). The watch
selects recorded pods out (``naming.WATCH_SELECTOR``; a pod that arrives with
the label anyway is ignored), so neither this driver nor a restarted one
tracks the attempt again. Observations, stop, logs, usage and cleanup of a
job not in memory read its Service's record (and, for logs and usage, its
pods) on demand: one GET (the ref's ``backend_job_id``) or one labelled list.

Logs: ``logs``. Usage and capacity: ``usage``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dlsched import __version__
from drivers.common.base import (
    ClusterConfig,
    ClusterInfo,
    JobNotFound,
    JobObservation,
    JobRef,
    JobSpec,
    JobUsage,
    LaunchResult,
    LogEntry,
    LogQuery,
    NameCollision,
    RunMode,
    same_job,
)
from drivers.common.launches import Known
from drivers.common.skeleton import BackendDriver, render_off_loop
from drivers.kubernetes import attempts, launched, logs, mpi, naming, records, render, states, usage
from drivers.kubernetes.api import KubeApi, api_error, status_of, status_text
from drivers.kubernetes.informer import PodInformer
from drivers.kubernetes.render import Rendered
from drivers.kubernetes.tracking import (
    KubeCluster,
    TrackedJob,
    live_pods,
    note_deleted,
    observation,
)

log = logging.getLogger("dlsched.driver.kubernetes")
_DELETE_OTHER = attempts.DELETE_OTHER


@dataclass(frozen=True)
class KubernetesConfig:
    """The Kubernetes driver's flags."""

    qps: float = field(default=20.0, metadata={"help": "API requests per second per cluster"})
    burst: int = field(default=40, metadata={"help": "API requests allowed in a burst per cluster"})
    request_timeout: float = field(default=10.0, metadata={"help": "seconds per API request"})
    watch_timeout: int = field(default=300, metadata={
        "help": "timeoutSeconds of each pod watch (it then resumes from the last resourceVersion)"})
    watch_read_timeout: float = field(default=330.0, metadata={
        "help": "seconds without a byte after which a watch is re-opened"})
    grace_seconds: float = field(default=10.0, metadata={"min": 0, "help": "pod deletion grace when a stop names none"})
    allow_kubeconfig_exec: bool = field(default=False, metadata={
        "help": "let a cluster's kubeconfig run exec / auth-provider plugins on this host (EKS, GKE)"})
    max_log_readers: int = field(default=logs.READERS, metadata={"min": 2,
        "help": "pod log responses open at once (a connection each, no thread); follows may hold "
                "7/8 of them (one past that is RESOURCE_EXHAUSTED), reads without follow the rest"})


def _run_modes() -> tuple[RunMode, ...]:
    if importlib.util.find_spec("cryptography") is None:
        return tuple(m for m in render.SUPPORTED_RUN_MODES if m is not RunMode.MPI)
    return render.SUPPORTED_RUN_MODES


def ours(job: TrackedJob, pod: dict[str, Any]) -> bool:
    """Whether ``pod`` is of ``job`` and not of an earlier job of the same id (another uid)."""
    return same_job(job.uid, naming.uid_of(pod))


class KubernetesDriver(BackendDriver[KubeCluster, Rendered]):
    name = "kubernetes"
    backend_noun = "the Kubernetes API server"
    carry_over = ("jobs", "forgetting")  # keep the tracked jobs; swap the API client, budget and informer
    supports_logs = True
    supports_usage = True

    def __init__(self, config: KubernetesConfig | None = None) -> None:
        super().__init__()
        self._cfg = config or KubernetesConfig()
        self._tasks: set[asyncio.Task[Any]] = set()
        logs.configure(self._cfg.max_log_readers)

    # ------------------------------------------------------------------ hooks: clusters

    def _validate_config(self, config: ClusterConfig) -> None:
        naming.namespace_of(config.options)

    async def _connect(self, config: ClusterConfig, old: KubeCluster | None) -> KubeCluster:
        api = KubeApi(config, qps=self._cfg.qps, burst=self._cfg.burst, request_timeout=self._cfg.request_timeout,
                      allow_exec=self._cfg.allow_kubeconfig_exec)
        return KubeCluster(config, api, naming.namespace_of(config.options))

    async def _disconnect(self, c: KubeCluster) -> None:
        if c.informer is not None:
            c.informer.stop()
        await c.api.close()

    async def _activate(self, name: str, c: KubeCluster) -> None:
        loop = asyncio.get_running_loop()

        def hop(fn: Callable[..., None]) -> Callable[..., None]:
            def cb(*args: Any) -> None:
                if not loop.is_closed():
                    loop.call_soon_threadsafe(fn, *args)
            return cb

        c.informer = PodInformer(
            c.api.core, c.namespace, naming.WATCH_SELECTOR, c.api.budget,
            on_sync=hop(lambda items: self._on_sync(c, items)),
            on_event=hop(lambda kind, obj: self._on_event(c, kind, obj)),
            on_stale=hop(lambda msg: self._on_stale(c, msg)),
            watch_timeout=self._cfg.watch_timeout, read_timeout=self._cfg.watch_read_timeout,
            request_timeout=self._cfg.request_timeout)
        c.informer.start()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(c.synced.wait(), timeout=self._cfg.request_timeout)

    def _modes(self, c: KubeCluster) -> tuple[RunMode, ...]:
        return _run_modes()

    async def _info(self, c: KubeCluster) -> ClusterInfo:
        return await usage.cluster_info(c, f"{self.name}/{__version__}", tuple(_run_modes()))

    # ------------------------------------------------------------------ informer callbacks

    def _current(self, c: KubeCluster) -> bool:
        """Whether ``c`` is still the cluster's record (a replaced one's informer may still call back)."""
        return self.clusters.get(c.config.name) is c

    def _on_sync(self, c: KubeCluster, items: list[dict[str, Any]]) -> None:
        if not self._current(c):
            return
        c.stale = None
        by_job: dict[str, dict[str, dict[str, Any]]] = {}
        for pod in items:
            labels = (pod.get("metadata") or {}).get("labels") or {}
            if naming.LABEL_JOB in labels and not naming.is_recorded(pod):
                self._adopt(c, pod)
                by_job.setdefault(labels[naming.LABEL_JOB], {})[pod["metadata"].get("name", "")] = pod
        for key, job in list(c.jobs.items()):
            fresh = {n: replace(v, alive=False, terminating=False, gone=True)  # ended: kept when gone
                     for n, v in job.pods.items() if v.state.is_terminal()}
            for n, p in by_job.get(key, {}).items():
                if (r := job.by_pod(n)) is not None and naming.attempt_of(p) == job.attempt and ours(job, p):
                    job.learn_containers(r, p)
                    fresh[n] = states.replica_of(p)
            job.pods = fresh
            job.seen.update(fresh)
            if job.incomplete():  # adopted with a pod missing: a launch cut short, or a pod lost since?
                self._spawn(self._lost_pods(c, job))
            if job.final is None and not job.stop_requested and fresh and all(v.terminating for v in fresh.values()):
                # every pod left is being deleted: a stop in its grace period (a driver restarted
                # since, or the watch lost): STOPPED once they are gone, not FAILED PodDeleted
                job.stop_requested = True
                job.deleted.update(r.pod for r in job.replicas)
            self._update(c, job)
        c.synced.set()

    async def _lost_pods(self, c: KubeCluster, job: TrackedJob) -> None:
        """An adopted job with a pod missing whose launch completed (``launched``): the pod was
        made, then deleted while no driver watched; its replica fails ``PodDeleted``."""
        if await launched.was_launched(c, job) and job.incomplete() and self._current(c):
            job.submitted = True
            job.seen.update(r.pod for r in job.replicas)
            self._update(c, job)

    def _on_event(self, c: KubeCluster, kind: str, pod: dict[str, Any]) -> None:
        if not self._current(c) or c.stale is not None:
            return  # stale: a re-list follows and replaces the cache
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if naming.LABEL_JOB not in labels or naming.is_recorded(pod):
            return  # a forgotten attempt's pod (a watch not applying the selector): never tracked again
        if kind != "DELETED":
            self._adopt(c, pod)
        job = c.jobs.get(labels[naming.LABEL_JOB])
        if job is None or naming.attempt_of(pod) != job.attempt or (r := job.by_pod(meta.get("name", ""))) is None \
                or not ours(job, pod):
            return
        job.learn_containers(r, pod)
        if kind == "DELETED":
            ended = job.pods.pop(meta["name"], None)
            if ended is not None and ended.state.is_terminal():
                # A pod deleted after it ended (terminated-pod GC, a script, the driver deleting a
                # failed replica's pod) keeps its end: it was no PodDeleted failure.
                # (gone: a stopped job is STOPPED once its pods are)
                job.pods[meta["name"]] = replace(ended, alive=False, terminating=False, gone=True)
        else:
            job.pods[meta["name"]] = states.replica_of(pod)
            job.seen.add(meta["name"])
        self._update(c, job)

    def _on_stale(self, c: KubeCluster, msg: str) -> None:
        if not self._current(c):
            return
        first = c.stale is None
        c.stale = msg
        c.synced.set()
        if first:
            for job in c.jobs.values():
                self._update(c, job)

    def _adopt(self, c: KubeCluster, pod: dict[str, Any]) -> None:
        """A pod of a job (or attempt) this process does not know: track the job its metadata describes."""
        meta = naming.decode(pod)
        if meta is None:
            return
        key = naming.job_label(meta.job_id)
        known = c.jobs.get(key)
        if known is not None and known.attempt >= meta.attempt:
            return
        forgotten = c.forgetting.get(key)
        if forgotten is not None and forgotten.attempt >= meta.attempt:
            return  # forgotten, its record not written yet
        ns = (pod.get("metadata") or {}).get("namespace") or c.namespace
        c.jobs[key] = TrackedJob.adopted(c.config.name, meta, ns)

    # ------------------------------------------------------------------ observations

    def _publish(self, c: KubeCluster, job: TrackedJob, obs: JobObservation) -> None:
        if obs != job.last:
            job.last = obs
            self.hub.publish(c.config.name, obs)

    def _update(self, c: KubeCluster, job: TrackedJob) -> None:
        obs = observation(job, c.stale)
        if obs.reason != states.REASON_STALE and obs.state.is_terminal() and job.final is None:
            job.final = obs
            self._after_end(c, job)
        self._publish(c, job, obs)
        job.notify()

    def _after_end(self, c: KubeCluster, job: TrackedJob) -> None:
        """The job ended: delete pods still running (PS after success, the rest after a failure)."""
        if job.stop_requested:
            return
        live = live_pods(job)
        if live:
            note_deleted(job, live)
            self._spawn(attempts.delete_until_gone(c, job, live, self._cfg.grace_seconds,
                                                 lambda: self.clusters.get(c.config.name) is c))

    def _spawn(self, coro: Any) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._task_done)

    def _task_done(self, t: asyncio.Task[Any]) -> None:
        self._tasks.discard(t)
        if not t.cancelled() and (exc := t.exception()) is not None:
            log.warning("background pod deletion failed: %s", exc)

    def _snapshot(self, c: KubeCluster) -> Iterable[JobObservation]:
        return [observation(j, c.stale) for j in c.jobs.values()]

    async def _observe(self, c: KubeCluster, refs: Sequence[JobRef]) -> list[JobObservation | None]:
        out = []
        for ref in refs:
            obs = self._lookup(c, ref)
            if obs is None and (job := await self._recall(c, ref)) is not None:
                obs = job.final
            out.append(obs)
        return out

    def _lookup(self, c: KubeCluster, ref: JobRef) -> JobObservation | None:
        job = c.find(ref)
        return observation(job, c.stale) if job is not None else None

    # ------------------------------------------------------------------ launch

    async def _prepare(self, c: KubeCluster, job_id: str, spec: JobSpec, attempt: int, uid: str) -> Rendered:
        return render.with_job_uid(
            await render_off_loop(spec, render.render_job, job_id, spec, attempt, c.config.options), uid)

    def _known(self, c: KubeCluster, job_id: str, rendered: Rendered) -> Known | None:
        key = naming.job_label(job_id)
        job = c.jobs.get(key) or c.forgetting.get(key)
        if job is None:
            return None
        if job.job_id != job_id:
            raise NameCollision(f"job {job_id!r} and job {job.job_id!r} have the same Kubernetes label {key!r}")
        if job.attempt == rendered.attempt and same_job(job.uid, rendered.uid) and job.incomplete():
            return None  # its launch stopped part-way: this one creates the rest (409: made already)
        return Known(job.cluster, job.attempt, job.final is None, lambda: LaunchResult(
            job.backend_job_id, rendered.native_spec(), observation(job, c.stale)), job.uid)

    async def _submit(self, c: KubeCluster, name: str, job_id: str, spec: JobSpec, attempt: int,
                      rendered: Rendered) -> LaunchResult:
        native = rendered.native_spec()
        service, *rest = rendered.manifests
        key_pair = mpi.ssh_keypair() if any(m["kind"] == "Secret" for m in rest) else None
        created = await c.api.create(c.api.core.create_namespaced_service, c.namespace, service,
                                     f"service {rendered.service}")
        if created is None:  # 409: an earlier try of this launch, or another job's
            created = await self._existing_service(c, rendered)
            done = records.from_service(name, created)
            if not same_job(theirs := naming.uid_of(created), rendered.uid):  # an earlier job of the same id
                if done is None or done.final is None:
                    raise NameCollision(f"service {c.namespace}/{rendered.service} is an earlier job's (uid {theirs}), "
                                        "which still runs", metadata={"job_uid": theirs})
                await self._cleanup(c, name, JobRef(job_id, rendered.backend_job_id))  # ended, forgotten: deleted
                created = await c.api.create(c.api.core.create_namespaced_service, c.namespace, service,
                                             f"service {rendered.service}")
                if created is None:
                    raise NameCollision(f"service {c.namespace}/{rendered.service} exists again")
            elif done is not None and done.final is not None:
                return LaunchResult(rendered.backend_job_id, native, done.final)  # a forgotten attempt
        uid = str((created.get("metadata") or {}).get("uid") or "")
        job = c.jobs.get(naming.job_label(job_id))  # a launch that stopped part-way: its pods as seen
        if job is None or job.attempt != rendered.attempt or not same_job(job.uid, rendered.uid):
            job = TrackedJob.launched(name, rendered)
            c.jobs[naming.job_label(job_id)] = job
        create = {"Pod": c.api.core.create_namespaced_pod, "Secret": c.api.core.create_namespaced_secret,
                  "ConfigMap": c.api.core.create_namespaced_config_map}
        read = {"Pod": c.api.core.read_namespaced_pod, "Secret": c.api.core.read_namespaced_secret,
                "ConfigMap": c.api.core.read_namespaced_config_map}
        for m in rest:
            kind, obj = m["kind"], m["metadata"]["name"]
            body = render.with_owner_uid(m, uid)
            if kind == "Secret" and key_pair is not None:
                body = mpi.with_ssh_key(body, *key_pair)
            if await c.api.create(create[kind], c.namespace, body, f"{kind.lower()} {obj}") is None:
                # 409: an earlier try of this launch made it (owned by this Service), or someone
                # else did - a pod, or an MPI Secret (its key) or ConfigMap (sshd's config) the
                # job would then trust: refused, not taken for ours, and nothing of this launch
                # is left to name it (a clean-up deletes by name).
                try:
                    await self._owned(c, read[kind], kind, obj, uid)
                except NameCollision:
                    if c.jobs.get(naming.job_label(job_id)) is job:
                        del c.jobs[naming.job_label(job_id)]
                    await c.api.delete(c.api.core.delete_namespaced_service, rendered.service, c.namespace,
                                       f"service {rendered.service}", propagation_policy="Background")
                    raise
        job.submitted = True
        self._spawn(launched.mark(c, job))
        obs = observation(job, c.stale)
        self._publish(c, job, obs)
        return LaunchResult(rendered.backend_job_id, native, obs)

    async def _owned(self, c: KubeCluster, read: Any, kind: str, obj: str, uid: str) -> None:
        try:
            found = await c.api.call(read, obj, c.namespace)
        except Exception as e:  # noqa: BLE001
            raise api_error(e, f"reading {kind.lower()} {obj}") from None
        owners = {str(r.get("uid", "")) for r in (found.get("metadata") or {}).get("ownerReferences") or ()}
        if uid not in owners:
            raise NameCollision(f"{kind.lower()} {c.namespace}/{obj} exists and is not this job's")

    async def _existing_service(self, c: KubeCluster, rendered: Rendered) -> dict[str, Any]:
        try:
            svc: dict[str, Any] = await c.api.call(c.api.core.read_namespaced_service, rendered.service,
                                                   c.namespace)
        except Exception as e:  # noqa: BLE001
            raise api_error(e, f"reading service {rendered.service}") from None
        labels = (svc.get("metadata") or {}).get("labels") or {}
        if labels.get(naming.LABEL_JOB) != naming.job_label(rendered.job_id) or \
                labels.get(naming.LABEL_ATTEMPT) != str(rendered.attempt):
            raise NameCollision(f"service {c.namespace}/{rendered.service} exists and belongs to another job")
        return svc

    # ------------------------------------------------------------------ stop / cleanup

    async def _terminate(self, c: KubeCluster, name: str, ref: JobRef,
                         grace_seconds: float | None) -> JobObservation | None:
        job = c.find(ref)
        if job is None:
            forgotten = await self._recall(c, ref)
            return forgotten.final if forgotten is not None else None  # forgotten: it has ended
        grace = self._cfg.grace_seconds if grace_seconds is None else grace_seconds
        job.stop_requested = True
        names = [r.pod for r in job.replicas]
        note_deleted(job, names)
        self._update(c, job)
        await attempts.delete_pods(c, names, grace)
        return observation(job, c.stale)

    async def _cleanup(self, c: KubeCluster, name: str, ref: JobRef) -> None:
        job = c.find(ref) or await self._recall(c, ref)
        if job is None:  # (ended, no pod left to adopt it from, no record: its objects by label and uid)
            return await attempts.delete_attempts(c, ref.job_id, ref.uid)
        job.cleaned = True
        if job.final is None:
            job.stop_requested = True
        note_deleted(job, [r.pod for r in job.replicas])
        await attempts.delete_pods(c, [r.pod for r in job.replicas], 0)
        for kind, obj in job.others:
            await c.api.delete(getattr(c.api.core, _DELETE_OTHER[kind]), obj, c.namespace, f"{kind.lower()} {obj}")
        await c.api.delete(c.api.core.delete_namespaced_service, job.service, c.namespace,
                           f"service {job.service}", propagation_policy="Background")
        if job.attempt > 1:
            await attempts.delete_earlier(c, job)
        key = naming.job_label(job.job_id)
        if c.jobs.get(key) is job:
            del c.jobs[key]
        if c.forgetting.get(key) is job:
            del c.forgetting[key]

    # ------------------------------------------------------------------ logs, usage

    async def _tail(self, c: KubeCluster, ref: JobRef, query: LogQuery) -> AsyncIterator[list[LogEntry]]:
        job = c.find(ref) or await self._recall(c, ref, pods=True)
        if job is None:
            raise JobNotFound(ref.job_id)
        batches = logs.tail(c, job, query)
        try:
            async for batch in batches:
                yield batch
        finally:
            await batches.aclose()

    async def _usage(self, c: KubeCluster, ref: JobRef) -> JobUsage:
        job = c.find(ref) or await self._recall(c, ref, pods=True)
        if job is None:
            raise JobNotFound(ref.job_id)
        return await usage.measure(c, job)

    # ------------------------------------------------------------------ forget

    def _forget(self, c: KubeCluster, ref: JobRef) -> bool:
        """Drop an ended job from memory: its record goes on its Service, its pods get the label the
        watch selects out (``records``); until that is written it answers from ``c.forgetting``."""
        key = naming.job_label(ref.job_id)
        job = c.jobs.get(key)
        if job is None or job.job_id != ref.job_id or job.final is None or (
                ref.backend_job_id and ref.backend_job_id != job.backend_job_id):
            return False
        final = observation(job, None)
        del c.jobs[key]
        c.forgetting[key] = job
        t = asyncio.ensure_future(self._write_record(c.config.name, key, job, final))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return True

    async def _write_record(self, name: str, key: str, job: TrackedJob, final: JobObservation) -> None:
        """Write the forgotten job's record, retried (backoff) while the API server fails; then drop it."""
        backoff = 0.5
        while not job.cleaned:
            c = self.clusters.get(name)
            if c is None:
                return  # the cluster was removed
            try:
                await self._mark(c, job, final)
            except Exception as e:  # noqa: BLE001 - retried: the job answers from memory meanwhile
                log.warning("recording forgotten job %s failed (retrying in %.1fs): %s", job.job_id, backoff,
                            status_text(e))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)
                continue
            if c.forgetting.get(key) is job:
                del c.forgetting[key]
            return

    async def _mark(self, c: KubeCluster, job: TrackedJob, final: JobObservation) -> None:
        """The record on the Service, then the label on every pod still there (404: gone, fine)."""
        record = {"metadata": {"labels": {naming.LABEL_RECORDED: "true"},
                               "annotations": {naming.ANN_FINAL: records.annotation(job, final)}}}
        try:
            await c.api.call(c.api.core.patch_namespaced_service, job.service, c.namespace, record)
        except Exception as e:
            if status_of(e) == 404:
                return  # cleaned up: nothing left to answer from
            raise
        label = {"metadata": {"labels": {naming.LABEL_RECORDED: "true"}}}
        for r in job.replicas:
            if r.pod in job.pods or r.pod not in job.seen:
                try:
                    await c.api.call(c.api.core.patch_namespaced_pod, r.pod, c.namespace, label)
                except Exception as e:
                    if status_of(e) != 404:
                        raise

    async def _recall(self, c: KubeCluster, ref: JobRef, *, pods: bool = False) -> TrackedJob | None:
        """A forgotten job, read back from its Service's record (``None``: no record of it).

        The Service ``ref.backend_job_id`` names, else the newest recorded attempt of the job's
        label; with ``pods``, the attempt's pods as listed now (what logs and usage read)."""
        key = naming.job_label(ref.job_id)
        ns, _, svc = ref.backend_job_id.partition("/")
        try:
            if svc and ns == c.namespace:
                try:
                    found = [await c.api.call(c.api.core.read_namespaced_service, svc, c.namespace)]
                except Exception as e:
                    if status_of(e) == 404:
                        return None
                    raise
            else:
                doc = await c.api.call(c.api.core.list_namespaced_service, c.namespace,
                                       label_selector=f"{naming.LABEL_JOB}={key},{naming.LABEL_RECORDED}")
                found = list(doc.get("items") or ())
        except Exception as e:  # noqa: BLE001
            raise api_error(e, f"reading the service of job {ref.job_id}") from None
        best: TrackedJob | None = None
        for obj in found:
            job = records.from_service(c.config.name, obj)
            if job is None or job.job_id != ref.job_id or (
                    ref.backend_job_id and ref.backend_job_id != job.backend_job_id) or not ref.names_uid(job.uid):
                continue
            if best is None or job.attempt > best.attempt:
                best = job
        if best is not None and pods:
            selector = f"{naming.LABEL_JOB}={key},{naming.LABEL_ATTEMPT}={best.attempt}"
            try:
                doc = await c.api.call(c.api.core.list_namespaced_pod, c.namespace, label_selector=selector)
            except Exception as e:  # noqa: BLE001
                raise api_error(e, f"listing the pods of job {ref.job_id}") from None
            for pod in doc.get("items") or ():
                podname = (pod.get("metadata") or {}).get("name", "")
                if naming.attempt_of(pod) == best.attempt and (r := best.by_pod(podname)) is not None:
                    best.learn_containers(r, pod)
                    best.pods[podname] = states.replica_of(pod)
            best.seen = set(best.pods)
        return best
