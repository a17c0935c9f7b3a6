"""``KubernetesDriver``: jobs as a headless Service and plain Pods, through the REST API.

Clusters. ``address`` is the API server URL. Credentials (write-only, in
memory only, never logged): a bearer token with an optional CA bundle, or a
kubeconfig (its current context). Options: ``namespace``, ``default_image``,
``image_pull_secrets``, ``service_account`` (see ``render``), and
``insecure_skip_tls_verify`` (``true`` only for test clusters). Every API
call goes through the official ``kubernetes`` client in a worker thread
(``asyncio.to_thread``), after taking a token from the cluster's
``RequestBudget`` (``--qps`` / ``--burst``).

Rendering: ``render.render_job`` (pure; ``RenderJob`` returns it as YAML).
Launch creates the Service, then every other object (MPI: the Secret, with
a fresh Ed25519 key pair from ``ssh_keypair`` filled in, and the ConfigMap;
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
``render.job_label(job_id)`` (not the raw id, which may differ: ``a--b``),
and a request's job id is looked up through the same function. Each pod event updates that job's
replicas (``states.replica_of``) and its state (``states.job_state`` with
the run mode's success rule, read back from the pod annotations), and every
change is published to the watchers. Terminal states are latched. When the
deciding roles succeed, the remaining pods (PS-Worker's parameter servers)
are deleted and end STOPPED; when a replica fails, the job is FAILED at once
(reason and message name the replica) and its other pods are deleted. A
job's pods seen on the watch but unknown to this process (after a driver
restart) are adopted: the job is rebuilt from the labels and annotations.

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

Logs: the pod log API per replica container (``timestamps=true`` for line
times; ``tail_lines``; ``since_time`` as ``sinceSeconds`` rounded up, then
filtered exactly). Kubernetes merges a container's stdout and stderr, so
every line is reported as STDOUT. A pod that has not started yet gives one
line saying so (without follow), or is waited for (with follow); a follow
ends once every replica's stream has ended and the job is terminal.

Usage: ``metrics.k8s.io/v1beta1`` pod metrics when the cluster serves them
(404, or 503 while the API server itself answers: UNIMPLEMENTED
``metrics.k8s.io not available``). Memory is the sum of the containers'
working sets; peak memory the highest the driver has seen. The API serves
CPU as a rate (cores over a window), not a counter, so ``cpu_seconds`` is an
estimate: the rate integrated over the time each sample covers (since the
previous one; the first since the pod started), kept per replica so it never
goes back, and still reported once the replica has ended (``running`` false).

Capacity: nodes' allocatable CPU, memory and ``nvidia.com/gpu`` minus the
requests of the pods scheduled on them that have not ended, cluster-wide;
GPU types from the ``nvidia.com/gpu.product`` label. A namespace-scoped
credential (403 on the cluster-wide pod list) leaves the cluster READY: free
capacity then counts only the namespace's pods, and the message says so. 403
on nodes: READY with capacity unknown (zero). Only an API server that does
not answer, answers 5xx or rejects the credentials (401) is UNREACHABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import logging
import math
import os
import re
import socket
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from dlsched import __version__
from dlsched.errors import (
    DlschedError,
    FailedPrecondition,
    InvalidArgument,
    Unimplemented,
)
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
    KubernetesCredentials,
    LaunchResult,
    LogEntry,
    LogQuery,
    LogStream,
    NativeSpec,
    ReplicaState,
    ReplicaStatus,
    ReplicaUsage,
    RunMode,
    WatchEvent,
)
from drivers.common.hub import ObservationHub
from drivers.common.launches import Known, LaunchRules
from drivers.common.planner import MpiNotAvailable
from drivers.common.registry import BackendUnavailable, ClusterRegistry
from drivers.kubernetes import render, states
from drivers.kubernetes.informer import PodInformer, RequestBudget, is_unreachable
from drivers.kubernetes.render import Rendered

log = logging.getLogger("dlsched.driver.kubernetes")
#: The kinds an attempt may own besides its Service and Pods, and the CoreV1Api call deleting one.
_OTHER_KINDS = {"Secret": "delete_namespaced_secret", "ConfigMap": "delete_namespaced_config_map"}
BATCH_ENTRIES = 500
FOLLOW_READ_TIMEOUT = 24 * 3600.0  # a followed log may stay silent for long
FORBIDDEN_RETRY = 300.0  # seconds before a 403'd cluster-wide pod list is tried again


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
    grace_seconds: float = field(default=10.0, metadata={"help": "pod deletion grace when a stop names none"})


class NameCollision(FailedPrecondition):
    reason = "NAME_COLLISION"


def _api_error(exc: BaseException, what: str) -> DlschedError:
    status = getattr(exc, "status", None)
    if is_unreachable(exc):
        return BackendUnavailable(f"Kubernetes API server: {what} failed ({_status_text(exc)})")
    if status in (401, 403):
        return FailedPrecondition(f"Kubernetes API server refused {what} (HTTP {status}); check the "
                                  "cluster's credentials and RBAC", reason="BACKEND_PERMISSION_DENIED")
    if status == 422 or status == 400:
        return InvalidArgument(f"Kubernetes API server rejected {what} (HTTP {status}): "
                               f"{_message(exc)}")
    return FailedPrecondition(f"Kubernetes API server: {what} failed (HTTP {status}): {_message(exc)}",
                              reason="BACKEND_ERROR")


def _status_text(exc: BaseException) -> str:
    status = getattr(exc, "status", None)
    return f"HTTP {status}" if isinstance(status, int) and status else type(exc).__name__


def _message(exc: BaseException) -> str:
    body = getattr(exc, "body", None)
    if body:
        with contextlib.suppress(ValueError, TypeError):
            return str(json.loads(body).get("message", ""))[:500]
    return ""


def _status(exc: BaseException) -> int | None:
    s = getattr(exc, "status", None)
    return s if isinstance(s, int) else None


# --------------------------------------------------------------------------- state


@dataclass
class _Replica:
    role: str
    index: int
    pod: str
    containers: tuple[str, ...]


class _Job:
    def __init__(self, cluster: str, job_id: str, attempt: int, backend_job_id: str, service: str,
                 replicas: list[_Replica], rule: Any, native: NativeSpec | None,
                 others: Sequence[tuple[str, str]] = ()) -> None:
        self.cluster = cluster
        self.others = tuple(others)  # (kind, name) besides the Service and the Pods
        self.job_id = job_id
        self.attempt = attempt
        self.backend_job_id = backend_job_id
        self.service = service
        self.replicas = replicas
        self.rule = rule
        self.native = native
        self.pods: dict[str, dict[str, Any]] = {}
        self.seen: set[str] = set()
        self.deleted: set[str] = set()
        self.stop_requested = False
        self.final: JobObservation | None = None
        self.last: JobObservation | None = None
        self.start_time: float | None = None
        self.end_time: float | None = None
        self.changed = asyncio.Event()
        self.usage: dict[str, _Sampled] = {}  # by pod: what metrics.k8s.io said so far

    def by_pod(self, name: str) -> _Replica | None:
        for r in self.replicas:
            if r.pod == name:
                return r
        return None


@dataclass
class _Sampled:
    """One replica's usage as accumulated from its metrics.k8s.io samples."""

    time: float  # the last sample's timestamp
    cpu_seconds: float
    peak_memory_bytes: int


class _Cluster:
    def __init__(self, config: ClusterConfig, api: Any, core: Any, budget: RequestBudget,
                 namespace: str, ca_file: str | None) -> None:
        self.config = config
        self.api = api
        self.core = core
        self.budget = budget
        self.namespace = namespace
        self.ca_file = ca_file
        self.informer: PodInformer | None = None
        self.stale: str | None = "not synced yet"
        self.synced = asyncio.Event()
        self.jobs: dict[str, _Job] = {}  # by render.job_label(job_id), the pods' job label
        self.pods_forbidden_until = 0.0  # monotonic: skip the cluster-wide pod list (403) until then


def _api_client(config: ClusterConfig) -> tuple[Any, str | None]:
    from kubernetes import client
    from kubernetes import config as kconfig

    cfg = client.Configuration()
    cfg.debug = False
    ca_file: str | None = None
    creds = config.credentials
    if isinstance(creds, KubernetesCredentials) and creds.kubeconfig:
        import yaml

        try:
            doc = yaml.safe_load(creds.kubeconfig)
            kconfig.load_kube_config_from_dict(doc, client_configuration=cfg,  # type: ignore[no-untyped-call]
                                               persist_config=False)
        except Exception as e:  # noqa: BLE001 - never echo the kubeconfig
            raise InvalidArgument.for_field("credentials.kubernetes.kubeconfig",
                                            f"cannot be loaded ({type(e).__name__})") from None
        if config.address:
            cfg.host = config.address.rstrip("/")
    else:
        if not config.address:
            raise InvalidArgument.for_field("address", "the API server URL is required")
        cfg.host = config.address.rstrip("/")
        if isinstance(creds, KubernetesCredentials):
            if creds.token:
                cfg.api_key = {"authorization": creds.token}  # the key name every client version reads
                cfg.api_key_prefix = {"authorization": "Bearer"}
            if creds.ca_cert:
                fd, ca_file = tempfile.mkstemp(prefix="dlsched-k8s-ca-", suffix=".pem")
                with os.fdopen(fd, "w") as f:
                    f.write(creds.ca_cert)
                cfg.ssl_ca_cert = ca_file
        elif creds is not None:
            raise InvalidArgument.for_field("credentials", "the Kubernetes driver takes kubernetes credentials")
    if config.options.get("insecure_skip_tls_verify", "").lower() == "true":
        cfg.verify_ssl = False
    api = client.ApiClient(cfg)
    return api, ca_file


def ssh_keypair() -> tuple[str, str]:
    """A fresh Ed25519 key pair for one MPI attempt: (OpenSSH private key, ``ssh-ed25519 ...`` line)."""
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    except ImportError:
        raise MpiNotAvailable("the Kubernetes driver needs the 'cryptography' package to make "
                              "each MPI job's SSH key") from None
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption()).decode()
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                           serialization.PublicFormat.OpenSSH).decode()
    return private, f"{public} dlsched"


def _run_modes() -> tuple[RunMode, ...]:
    if importlib.util.find_spec("cryptography") is None:
        return tuple(m for m in render.SUPPORTED_RUN_MODES if m is not RunMode.MPI)
    return render.SUPPORTED_RUN_MODES


def _parse_quantity(value: Any) -> float:
    from kubernetes.utils import parse_quantity

    try:
        return float(parse_quantity(str(value)))  # type: ignore[no-untyped-call]
    except (ValueError, TypeError, ArithmeticError):
        return 0.0


def _line_time(line: str) -> tuple[int | None, str]:
    """``<RFC3339Nano> <text>`` (the log API with timestamps) -> (unix nanos, text)."""
    stamp, sep, text = line.partition(" ")
    if not sep:
        return None, line
    s = stamp.rstrip("Z")
    frac = ""
    if "." in s:
        s, frac = s.split(".", 1)
    try:
        secs = datetime.fromisoformat(s + "+00:00").timestamp()
    except ValueError:
        return None, line
    nanos = int((frac + "000000000")[:9]) if frac.isdigit() else 0
    return int(secs) * 1_000_000_000 + nanos, text


class KubernetesDriver(Driver):
    name = "kubernetes"

    def __init__(self, config: KubernetesConfig | None = None) -> None:
        self._cfg = config or KubernetesConfig()
        self._launches = LaunchRules()
        self._hub = ObservationHub()
        self._clusters: ClusterRegistry[_Cluster] = ClusterRegistry(self._hub)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    async def close(self) -> None:
        for c in self._clusters.values():
            self._drop(c)

    def _drop(self, c: _Cluster) -> None:
        if c.informer is not None:
            c.informer.stop()
        with contextlib.suppress(Exception):
            c.api.close()
        if c.ca_file:
            with contextlib.suppress(OSError):
                os.unlink(c.ca_file)

    # ------------------------------------------------------------------ calls

    async def _json(self, c: _Cluster, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One API call in a worker thread; the response as plain JSON.

        Never through the client's model classes: a response they cannot
        deserialize (a pod status missing a field they require) must not
        turn a delete that worked into an error.
        """

        def run() -> Any:
            c.budget.acquire()
            kwargs.setdefault("_request_timeout", self._cfg.request_timeout)
            ok = False
            try:
                resp = fn(*args, _preload_content=False, **kwargs)
                try:
                    if not 200 <= resp.status <= 299:
                        from kubernetes.client.exceptions import ApiException

                        raise ApiException(http_resp=resp)
                    out = json.loads(resp.data)
                    ok = True
                    return out
                finally:
                    resp.release_conn()
            finally:
                metrics.backend_call("kubernetes", getattr(fn, "__name__", "call"), ok)

        return await asyncio.to_thread(run)

    # ------------------------------------------------------------------ clusters

    def _get(self, cluster: str) -> _Cluster:
        return self._clusters.require(cluster)

    async def configure_cluster(self, config: ClusterConfig) -> ClusterInfo:
        from kubernetes import client

        ns = render.namespace_of(config.options)
        api, ca_file = _api_client(config)
        # keep the tracked jobs; swap the API client, budget and informer
        c = await self._clusters.configure(
            config.name,
            lambda _old: _Cluster(config, api, client.CoreV1Api(api),
                                  RequestBudget(self._cfg.qps, self._cfg.burst), ns, ca_file),
            carry_over=("jobs",), drop=self._drop)
        self._start_informer(c)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(c.synced.wait(), timeout=self._cfg.request_timeout)
        return await self._info(c)

    def _start_informer(self, c: _Cluster) -> None:
        loop = asyncio.get_running_loop()

        def hop(fn: Callable[..., None]) -> Callable[..., None]:
            def cb(*args: Any) -> None:
                if not loop.is_closed():
                    loop.call_soon_threadsafe(fn, *args)
            return cb

        c.informer = PodInformer(
            c.core, c.namespace, render.LABEL_JOB, c.budget,
            on_sync=hop(lambda items, c=c: self._on_sync(c, items)),
            on_event=hop(lambda kind, obj, c=c: self._on_event(c, kind, obj)),
            on_stale=hop(lambda msg, c=c: self._on_stale(c, msg)),
            watch_timeout=self._cfg.watch_timeout, read_timeout=self._cfg.watch_read_timeout,
            request_timeout=self._cfg.request_timeout)
        c.informer.start()

    async def remove_cluster(self, cluster: str) -> None:
        await self._clusters.remove(cluster, drop=self._drop)

    async def cluster_info(self, cluster: str) -> ClusterInfo:
        return await self._info(self._get(cluster))

    async def _info(self, c: _Cluster) -> ClusterInfo:
        version = f"{self.name}/{__version__}"
        modes = _run_modes()
        notes = [f"stale: {c.stale}"] if c.stale and c.synced.is_set() else []
        try:
            nodes = await self._json(c, c.core.list_node)
        except Exception as e:  # noqa: BLE001
            if _status(e) != 403:  # down, 5xx, or credentials rejected (401): unreachable
                return ClusterInfo(state=ClusterState.UNREACHABLE, driver_version=version,
                                   message=f"Kubernetes API server: {_status_text(e)}", supported_run_modes=modes)
            # Reachable, but RBAC hides the nodes: capacity unknown (zero), not an outage.
            notes.append("capacity unknown: listing nodes is forbidden (HTTP 403); grant nodes list")
            return ClusterInfo(state=ClusterState.READY, driver_version=version, message="; ".join(notes),
                               supported_run_modes=modes)
        try:
            pods = await self._scheduled_pods(c, notes)
        except Exception as e:  # noqa: BLE001
            return ClusterInfo(state=ClusterState.UNREACHABLE, driver_version=version,
                               message=f"Kubernetes API server: {_status_text(e)}", supported_run_modes=modes)
        return ClusterInfo(state=ClusterState.READY, capacity=_capacity(nodes, pods), supported_run_modes=modes,
                           driver_version=version, message="; ".join(notes))

    async def _scheduled_pods(self, c: _Cluster, notes: list[str]) -> Any:
        """Every pod that may hold resources, cluster-wide; the namespace's only when RBAC forbids that.

        A namespace-scoped credential gets 403 on the cluster-wide list: free
        capacity then counts only this namespace's pods (an overestimate the
        message states), and the cluster-wide list is retried only every
        ``FORBIDDEN_RETRY`` seconds, not every interval.
        """
        selector = "status.phase!=Succeeded,status.phase!=Failed"
        if time.monotonic() >= c.pods_forbidden_until:
            try:
                return await self._json(c, c.core.list_pod_for_all_namespaces, field_selector=selector)
            except Exception as e:  # noqa: BLE001
                if _status(e) != 403:
                    raise
                c.pods_forbidden_until = time.monotonic() + FORBIDDEN_RETRY
        notes.append(f"free capacity counts only namespace {c.namespace}'s pods: listing pods in all "
                     "namespaces is forbidden (HTTP 403)")
        return await self._json(c, c.core.list_namespaced_pod, c.namespace, field_selector=selector)

    # ------------------------------------------------------------------ informer callbacks

    def _on_sync(self, c: _Cluster, items: list[dict[str, Any]]) -> None:
        if self._clusters.get(c.config.name) is not c:
            return
        c.stale = None
        by_job: dict[str, dict[str, dict[str, Any]]] = {}
        for pod in items:
            labels = (pod.get("metadata") or {}).get("labels") or {}
            if render.LABEL_JOB in labels:
                self._adopt(c, pod)
                name = pod["metadata"].get("name", "")
                by_job.setdefault(labels[render.LABEL_JOB], {})[name] = pod
        for key, job in list(c.jobs.items()):
            fresh = {n: p for n, p in by_job.get(key, {}).items() if job.by_pod(n) is not None
                     and _attempt_of(p) == job.attempt}
            job.pods = fresh
            job.seen.update(fresh)
            self._update(c, job)
        c.synced.set()

    def _on_event(self, c: _Cluster, kind: str, pod: dict[str, Any]) -> None:
        if self._clusters.get(c.config.name) is not c:
            return
        if c.stale is not None:
            return  # a re-list follows and replaces the cache
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if render.LABEL_JOB not in labels:
            return
        if kind != "DELETED":
            self._adopt(c, pod)
        job = c.jobs.get(labels[render.LABEL_JOB])
        if job is None or _attempt_of(pod) != job.attempt or job.by_pod(meta.get("name", "")) is None:
            return
        name = meta["name"]
        if kind == "DELETED":
            job.pods.pop(name, None)
        else:
            job.pods[name] = pod
            job.seen.add(name)
        self._update(c, job)

    def _on_stale(self, c: _Cluster, msg: str) -> None:
        if self._clusters.get(c.config.name) is not c:
            return
        first = c.stale is None
        c.stale = msg
        c.synced.set()
        if first:
            for job in c.jobs.values():
                self._update(c, job)

    def _adopt(self, c: _Cluster, pod: dict[str, Any]) -> None:
        """A pod of a job this process does not know: rebuild the job from its pods' metadata."""
        meta = pod.get("metadata") or {}
        key = (meta.get("labels") or {}).get(render.LABEL_JOB, "")
        ann = meta.get("annotations") or {}
        job_id = ann.get(render.ANN_JOB) or key  # pods made before the annotation: label == id
        attempt = _attempt_of(pod)
        known = c.jobs.get(key)
        if known is not None and known.attempt >= attempt or attempt < 1 or render.job_label(job_id) != key:
            return
        counts = [part.partition("=") for part in ann.get(render.ANN_REPLICAS, "").split(",") if part]
        replicas = [_Replica(role, i, render.pod_name(job_id, attempt, role, i), ())
                    for role, _, n in counts if n.isdigit() for i in range(int(n))]
        if not replicas:
            return
        from drivers.common.planner import SuccessRule

        decisive = frozenset(r for r in ann.get(render.ANN_DECISIVE, "").split(",") if r)
        after = frozenset(r for r in ann.get(render.ANN_STOPPED_AFTER, "").split(",") if r)
        rule = SuccessRule(decisive or frozenset(r.role for r in replicas), after)
        others = [(kind, name) for kind, _, name in (part.partition("/") for part in
                                                     ann.get(render.ANN_OBJECTS, "").split(",") if part)
                  if kind in _OTHER_KINDS and name]
        ns = meta.get("namespace") or c.namespace
        c.jobs[key] = _Job(c.config.name, job_id, attempt, render.backend_job_id(ns, job_id, attempt),
                           render.service_name(job_id, attempt), replicas, rule, None, others)

    # ------------------------------------------------------------------ observations

    def _views(self, job: _Job) -> list[tuple[_Replica, states.PodView]]:
        out = []
        for r in job.replicas:
            pod = job.pods.get(r.pod)
            if pod is None:
                v = states.missing(deleted_by_us=r.pod in job.deleted, seen=r.pod in job.seen)
            else:
                v = states.replica_of(pod)
                if r.pod in job.deleted and not v.state.is_terminal():
                    v = states.PodView(ReplicaState.STOPPED if job.stop_requested or job.final else v.state,
                                       states.REASON_STOPPING, "deleting the pod", node=v.node,
                                       start_time=v.start_time)
            out.append((r, v))
        return out

    def _replica_statuses(self, views: list[tuple[_Replica, states.PodView]]) -> tuple[ReplicaStatus, ...]:
        return tuple(ReplicaStatus(role=r.role, index=r.index, state=v.state, exit_code=v.exit_code,
                                   host=v.node, message=f"{v.reason}: {v.message}" if v.message else v.reason)
                     for r, v in views)

    def _observe(self, c: _Cluster, job: _Job) -> JobObservation:
        views = self._views(job)
        if job.final is not None:  # the job's state is latched; its replicas still move (the rest stopping)
            return dataclasses.replace(job.final, replicas=self._replica_statuses(views))
        jv = states.job_state([(r.role, r.index, v) for r, v in views], job.rule,
                              stop_requested=job.stop_requested)
        if job.stop_requested and jv.state is JobState.STOPPED:
            # STOPPED only once the watch shows every deleted pod gone.
            if any(r.pod in job.pods for r in job.replicas):
                jv = states.JobView(JobState.STOPPING, states.REASON_STOPPING, "deleting the pods")
        starts = [v.start_time for _, v in views if v.start_time is not None]
        if starts and job.start_time is None:
            job.start_time = min(starts)
        if jv.state.is_terminal() and job.end_time is None:
            ends = [v.end_time for _, v in views if v.end_time is not None]
            job.end_time = max(ends) if ends else time.time()
        reason, message = jv.reason, jv.message
        if c.stale is not None and not jv.state.is_terminal():
            if job.last is not None:
                return JobObservation(**{**_fields(job.last), "reason": states.REASON_STALE,
                                         "message": f"Kubernetes API server unreachable ({c.stale}); "
                                                    "last known state"})
            reason, message = states.REASON_STALE, f"Kubernetes API server unreachable ({c.stale})"
        return JobObservation(
            job_id=job.job_id, backend_job_id=job.backend_job_id, found=True, state=jv.state,
            reason=reason, message=message, exit_code=jv.exit_code,
            replicas=self._replica_statuses(views),
            start_time=job.start_time, end_time=job.end_time if jv.state.is_terminal() else None,
            attempt=job.attempt)

    def _update(self, c: _Cluster, job: _Job) -> None:
        obs = self._observe(c, job)
        if obs.reason != states.REASON_STALE:
            if obs.state.is_terminal() and job.final is None:
                job.final = obs
                self._after_end(c, job, obs)
        if obs != job.last:
            job.last = obs
            self._hub.publish(c.config.name, obs)
        job.changed.set()
        job.changed = asyncio.Event()

    def _after_end(self, c: _Cluster, job: _Job, obs: JobObservation) -> None:
        """The job ended: delete pods still running (PS after success, the rest after a failure)."""
        if job.stop_requested:
            return
        live = [r.pod for r, v in self._views(job) if r.pod in job.pods and not v.state.is_terminal()]
        if live:
            job.deleted.update(live)
            self._spawn(self._delete_pods(c, job, live, self._cfg.grace_seconds))

    def _spawn(self, coro: Any) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._task_done)

    def _task_done(self, t: asyncio.Task[Any]) -> None:
        self._tasks.discard(t)
        if not t.cancelled() and (exc := t.exception()) is not None:
            log.warning("background pod deletion failed: %s", exc)

    async def _delete_pods(self, c: _Cluster, job: _Job, names: Sequence[str], grace: float) -> None:
        for name in names:
            try:
                await self._json(c, c.core.delete_namespaced_pod, name, c.namespace,
                                 grace_period_seconds=max(0, math.ceil(grace)))
            except Exception as e:  # noqa: BLE001
                if _status(e) != 404:
                    log.warning("deleting pod %s/%s failed: %s", c.namespace, name, _status_text(e))
                    raise _api_error(e, f"deleting pod {name}") from None

    def _find(self, c: _Cluster, ref: JobRef) -> _Job | None:
        job = c.jobs.get(render.job_label(ref.job_id))
        if job is None or job.job_id != ref.job_id or (
                ref.backend_job_id and ref.backend_job_id != job.backend_job_id):
            return None
        return job

    async def observe(self, cluster: str, refs: Sequence[JobRef]) -> list[JobObservation]:
        c = self._get(cluster)
        out = []
        for ref in refs:
            job = self._find(c, ref)
            out.append(self._observe(c, job) if job is not None else JobObservation.not_found(ref))
        return out

    def watch(self, cluster: str) -> AsyncIterator[WatchEvent]:
        return self._clusters.watch(cluster, lambda c: [self._observe(c, j) for j in c.jobs.values()])

    # ------------------------------------------------------------------ render / launch

    async def render(self, cluster: str, job_id: str, spec: JobSpec) -> NativeSpec:
        c = self._get(cluster)
        return render.render_job(job_id, spec, 1, c.config.options).native_spec()

    async def launch(self, cluster: str, job_id: str, spec: JobSpec, attempt: int) -> LaunchResult:
        c = self._get(cluster)
        rendered = render.render_job(job_id, spec, attempt, c.config.options)
        native = rendered.native_spec()
        key = render.job_label(job_id)

        def known() -> Known | None:
            job = c.jobs.get(key)
            if job is None:
                return None
            if job.job_id != job_id:
                raise NameCollision(f"job {job_id!r} and job {job.job_id!r} have the same Kubernetes label {key!r}")
            return Known(job.cluster, job.attempt, job.final is None, lambda: LaunchResult(
                job.backend_job_id, job.native or native, self._observe(c, job)))

        return await self._launches.launch(cluster, job_id, attempt, known=known,
                                           submit=lambda: self._create(c, rendered, native))

    async def _create(self, c: _Cluster, rendered: Rendered, native: NativeSpec) -> LaunchResult:
        cluster, job_id, attempt = c.config.name, rendered.job_id, rendered.attempt
        key = render.job_label(job_id)
        service, *rest = rendered.manifests
        key_pair = ssh_keypair() if any(m["kind"] == "Secret" for m in rest) else None
        try:
            created = await self._json(c, c.core.create_namespaced_service, c.namespace, service)
        except Exception as e:  # noqa: BLE001
            if _status(e) != 409:
                raise _api_error(e, f"creating service {rendered.service}") from None
            created = await self._existing_service(c, rendered)
        uid = str((created.get("metadata") or {}).get("uid") or "")
        job = _Job(cluster, job_id, attempt, rendered.backend_job_id, rendered.service,
                   [_Replica(p.role, p.index, p.name, p.containers) for p in rendered.pods],
                   rendered.success, native, rendered.others)
        c.jobs[key] = job
        for m in rest:
            kind, name = m["kind"], m["metadata"]["name"]
            body = render.with_owner_uid(m, uid)
            if kind == "Secret" and key_pair is not None:
                body = render.with_ssh_key(body, *key_pair)
            create = {"Pod": c.core.create_namespaced_pod, "Secret": c.core.create_namespaced_secret,
                      "ConfigMap": c.core.create_namespaced_config_map}[kind]
            try:
                await self._json(c, create, c.namespace, body)
            except Exception as e:  # noqa: BLE001 - 409: created by an earlier try of this launch
                if _status(e) != 409:
                    raise _api_error(e, f"creating {kind.lower()} {name}") from None
        obs = self._observe(c, job)
        if obs != job.last:
            job.last = obs
            self._hub.publish(cluster, obs)
        return LaunchResult(rendered.backend_job_id, native, obs)

    async def _existing_service(self, c: _Cluster, rendered: Rendered) -> dict[str, Any]:
        try:
            svc: dict[str, Any] = await self._json(c, c.core.read_namespaced_service, rendered.service,
                                                   c.namespace)
        except Exception as e:  # noqa: BLE001
            raise _api_error(e, f"reading service {rendered.service}") from None
        labels = (svc.get("metadata") or {}).get("labels") or {}
        if labels.get(render.LABEL_JOB) != render.job_label(rendered.job_id) or \
                labels.get(render.LABEL_ATTEMPT) != str(rendered.attempt):
            raise NameCollision(f"service {c.namespace}/{rendered.service} exists and belongs to another job")
        return svc

    # ------------------------------------------------------------------ stop / cleanup

    async def terminate(self, cluster: str, ref: JobRef, grace_seconds: float | None) -> JobObservation:
        c = self._get(cluster)
        job = self._find(c, ref)
        if job is None:
            return JobObservation.not_found(ref)
        if job.final is not None:
            return self._observe(c, job)
        grace = self._cfg.grace_seconds if grace_seconds is None else grace_seconds
        job.stop_requested = True
        names = [r.pod for r in job.replicas]
        job.deleted.update(names)
        self._update(c, job)
        await self._delete_pods(c, job, names, grace)
        return self._observe(c, job)

    async def cleanup(self, cluster: str, ref: JobRef) -> None:
        c = self._get(cluster)
        job = self._find(c, ref)
        if job is None:
            return
        if job.final is None:
            job.stop_requested = True
        job.deleted.update(r.pod for r in job.replicas)
        await self._delete_pods(c, job, [r.pod for r in job.replicas], 0)
        for kind, name in job.others:
            try:
                await self._json(c, getattr(c.core, _OTHER_KINDS[kind]), name, c.namespace)
            except Exception as e:  # noqa: BLE001
                if _status(e) != 404:
                    raise _api_error(e, f"deleting {kind.lower()} {name}") from None
        try:
            await self._json(c, c.core.delete_namespaced_service, job.service, c.namespace,
                             propagation_policy="Background")
        except Exception as e:  # noqa: BLE001
            if _status(e) != 404:
                raise _api_error(e, f"deleting service {job.service}") from None
        key = render.job_label(job.job_id)
        if c.jobs.get(key) is job:
            del c.jobs[key]

    # ------------------------------------------------------------------ logs

    def tail_logs(self, cluster: str, ref: JobRef, query: LogQuery) -> AsyncIterator[list[LogEntry]]:
        return self._tail(cluster, ref, query)

    async def _tail(self, cluster: str, ref: JobRef, query: LogQuery) -> AsyncIterator[list[LogEntry]]:
        c = self._get(cluster)
        job = self._find(c, ref)
        if job is None:
            raise JobNotFound(ref.job_id)
        if not query.wants_stream(LogStream.STDOUT):
            return  # the pod log API merges stderr into one stream, reported as STDOUT
        targets = [(r, k, cname) for r in job.replicas for k, cname in enumerate(r.containers or ("",))
                   if query.wants_replica(r.role, r.index * max(1, len(r.containers)) + k)]
        queue: asyncio.Queue[list[LogEntry] | BaseException | None] = asyncio.Queue()
        stops: list[_LogStream] = []
        tasks = [asyncio.ensure_future(self._tail_one(c, job, r, k, cname, query, queue, stops))
                 for r, k, cname in targets]
        remaining = len(tasks)
        try:
            while remaining:
                batch = await queue.get()
                if batch is None:
                    remaining -= 1
                    continue
                if isinstance(batch, BaseException):
                    raise batch
                for i in range(0, len(batch), BATCH_ENTRIES):
                    yield batch[i:i + BATCH_ENTRIES]
        finally:
            for st in stops:
                st.close()
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(BaseException):
                    await t

    async def _tail_one(self, c: _Cluster, job: _Job, r: _Replica, k: int, container: str,
                        query: LogQuery, queue: asyncio.Queue[list[LogEntry] | BaseException | None],
                        stops: list[_LogStream]) -> None:
        index = r.index * max(1, len(r.containers)) + k
        try:
            while True:
                pod = job.pods.get(r.pod)
                view = states.replica_of(pod) if pod is not None else None
                started = view is not None and (view.state is not ReplicaState.PENDING)
                if started:
                    break
                gone = (pod is None and (r.pod in job.seen or r.pod in job.deleted)) or job.final is not None
                if not query.follow or gone:
                    why = view.reason if view is not None else "not created yet"
                    await queue.put([LogEntry(role=r.role, replica_index=index, stream=LogStream.STDERR,
                                              text=f"dlsched: pod {r.pod} has not started yet ({why})")])
                    return
                changed = job.changed
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), timeout=5)
            stop = _LogStream()
            stops.append(stop)
            loop = asyncio.get_running_loop()
            kwargs: dict[str, Any] = {"timestamps": True, "follow": query.follow}
            if container:
                kwargs["container"] = container
            if query.tail_lines:
                kwargs["tail_lines"] = query.tail_lines
            if query.since_ns is not None:
                kwargs["since_seconds"] = max(1, math.ceil(time.time() - query.since_ns / 1e9) + 1)

            def read() -> None:
                c.budget.acquire()
                metrics.backend_call("kubernetes", "read_namespaced_pod_log")
                resp = c.core.read_namespaced_pod_log(r.pod, c.namespace, _preload_content=False,
                                                      _request_timeout=(self._cfg.request_timeout,
                                                                        FOLLOW_READ_TIMEOUT)
                                                      if query.follow else self._cfg.request_timeout,
                                                      **kwargs)
                if not stop.attach(resp):
                    with contextlib.suppress(Exception):
                        resp.close()
                    return
                try:
                    if not 200 <= resp.status <= 299:
                        from kubernetes.client.exceptions import ApiException

                        raise ApiException(http_resp=resp)
                    buf = b""
                    for chunk in resp.stream(amt=None, decode_content=True):
                        if stop.is_set():
                            return
                        buf += chunk
                        *lines, buf = buf.split(b"\n")
                        entries = _entries(r.role, index, lines, query)
                        if entries:
                            loop.call_soon_threadsafe(queue.put_nowait, entries)
                    if buf:
                        entries = _entries(r.role, index, [buf], query)
                        if entries:
                            loop.call_soon_threadsafe(queue.put_nowait, entries)
                finally:
                    if stop.is_set():  # the socket was shut down: never back into the pool
                        with contextlib.suppress(Exception):
                            resp.close()
                    else:
                        resp.release_conn()

            try:
                await asyncio.to_thread(read)
            except DlschedError:
                raise
            except Exception as e:  # noqa: BLE001
                if stop.is_set():
                    return  # closed by the consumer
                if _status(e) in (400, 404):
                    await queue.put([LogEntry(role=r.role, replica_index=index, stream=LogStream.STDERR,
                                              text=f"dlsched: no log for pod {r.pod} ({_status_text(e)})")])
                else:
                    raise _api_error(e, f"reading the log of {r.pod}") from None
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait(e)
        finally:
            queue.put_nowait(None)

    # ------------------------------------------------------------------ usage

    async def usage(self, cluster: str, ref: JobRef) -> JobUsage:
        from kubernetes import client

        c = self._get(cluster)
        job = self._find(c, ref)
        if job is None:
            raise JobNotFound(ref.job_id)
        custom = client.CustomObjectsApi(c.api)
        try:
            doc = await self._json(c, custom.list_namespaced_custom_object, "metrics.k8s.io", "v1beta1",
                                   c.namespace, "pods", label_selector=f"{render.LABEL_JOB}={render.job_label(job.job_id)},"
                                                  f"{render.LABEL_ATTEMPT}={job.attempt}")
        except Exception as e:  # noqa: BLE001
            # 404: no metrics API; 503: its APIService is down (the API server itself answers).
            if _status(e) == 404 or _status(e) == 503 and c.stale is None:
                raise Unimplemented("metrics.k8s.io not available") from None
            raise _api_error(e, "reading pod metrics") from None
        by_pod = {(m.get("metadata") or {}).get("name"): m for m in doc.get("items") or ()}
        out = []
        for r in job.replicas:
            m = by_pod.get(r.pod)
            prev = job.usage.get(r.pod)
            if m is None:  # ended (or not started): what was seen while it ran
                out.append(ReplicaUsage(role=r.role, replica_index=r.index,
                                        cpu_seconds=prev.cpu_seconds if prev else 0.0,
                                        peak_memory_bytes=prev.peak_memory_bytes if prev else 0))
                continue
            mem = cores = 0.0
            for cont in m.get("containers") or ():
                u = cont.get("usage") or {}
                mem += _parse_quantity(u.get("memory", 0))
                cores += _parse_quantity(u.get("cpu", 0))
            sampled = _integrate(prev, m, cores, int(mem), job.pods.get(r.pod))
            job.usage[r.pod] = sampled
            out.append(ReplicaUsage(role=r.role, replica_index=r.index, cpu_seconds=sampled.cpu_seconds,
                                    memory_bytes=int(mem), peak_memory_bytes=sampled.peak_memory_bytes,
                                    running=True))
        return JobUsage(replicas=tuple(out), sample_time=time.time())


# --------------------------------------------------------------------------- helpers


class _LogStream:
    """One open pod log response, closable from the event loop while a thread reads it."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._resp: Any = None

    def is_set(self) -> bool:
        return self._stop.is_set()

    def attach(self, resp: Any) -> bool:
        with self._lock:
            if self._stop.is_set():
                return False
            self._resp = resp
            return True

    def close(self) -> None:
        """Stop the reader without blocking the caller (the event loop).

        Closing the response here would wait for the reading thread's buffer
        lock; shutting the socket down instead ends a read blocked on a silent
        follow at once, and the reader closes the response itself.
        """
        with self._lock:
            self._stop.set()
            resp, self._resp = self._resp, None
        sock = getattr(getattr(resp, "connection", None), "sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def _attempt_of(pod: Mapping[str, Any]) -> int:
    v = ((pod.get("metadata") or {}).get("labels") or {}).get(render.LABEL_ATTEMPT, "")
    return int(v) if str(v).isdigit() else 0


def _fields(obs: JobObservation) -> dict[str, Any]:
    return {f: getattr(obs, f) for f in obs.__dataclass_fields__}


def _entries(role: str, index: int, lines: list[bytes], query: LogQuery) -> list[LogEntry]:
    out = []
    for raw in lines:
        ns, text = _line_time(raw.decode("utf-8", "replace").rstrip("\r"))
        if query.since_ns is not None and ns is not None and ns < query.since_ns:
            continue
        out.append(LogEntry(role=role, replica_index=index, stream=LogStream.STDOUT, text=text, time_ns=ns))
    return out


_GO_DURATION = re.compile(r"(\d+(?:\.\d*)?)(ns|us|µs|ms|s|m|h)")
_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def _go_duration(value: Any) -> float:
    """A Go duration as metrics.k8s.io writes ``window`` ("15s", "1m0.5s") -> seconds; 0 if unreadable."""
    return sum(float(n) * _GO_UNITS[u] for n, u in _GO_DURATION.findall(str(value or "")))


def _integrate(prev: _Sampled | None, metrics_item: Mapping[str, Any], cores: float, memory: int,
               pod: Mapping[str, Any] | None) -> _Sampled:
    """Fold one PodMetrics sample into a replica's running CPU-seconds estimate.

    metrics.k8s.io serves a rate (cores, averaged over ``window`` up to
    ``timestamp``), not a counter, so CPU seconds are estimated: each sample
    stands for the time since the one before (exact when samples come at the
    metrics resolution), the first for the time since the pod started (or
    its window, when the start is unknown). A sample seen before adds nothing.
    """
    ts = states.parse_time(metrics_item.get("timestamp")) or time.time()
    if prev is not None:
        if ts <= prev.time:
            return _Sampled(prev.time, prev.cpu_seconds, max(prev.peak_memory_bytes, memory))
        return _Sampled(ts, prev.cpu_seconds + cores * (ts - prev.time), max(prev.peak_memory_bytes, memory))
    start = states.replica_of(pod).start_time if pod is not None else None
    span = ts - start if start is not None and start <= ts else _go_duration(metrics_item.get("window"))
    return _Sampled(ts, cores * span, memory)


def _capacity(nodes: Mapping[str, Any], pods: Mapping[str, Any]) -> ClusterCapacity:
    used: dict[str, list[float]] = {}
    for p in pods.get("items") or ():
        spec = p.get("spec") or {}
        node = spec.get("nodeName")
        if not node or (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        u = used.setdefault(node, [0.0, 0.0, 0.0])
        for cont in spec.get("containers") or ():
            req = (cont.get("resources") or {}).get("requests") or {}
            lim = (cont.get("resources") or {}).get("limits") or {}
            u[0] += _parse_quantity(req.get("cpu", 0))
            u[1] += _parse_quantity(req.get("memory", 0))
            u[2] += _parse_quantity(req.get(render.GPU_RESOURCE, lim.get(render.GPU_RESOURCE, 0)))
    cap = dict(nodes_total=0, nodes_free=0, cpus_total=0.0, cpus_free=0.0, memory_bytes_total=0,
               memory_bytes_free=0, gpus_total=0, gpus_free=0, max_cpus_per_node=0.0,
               max_memory_bytes_per_node=0, max_gpus_per_node=0)
    gpu_types: dict[str, list[int]] = {}
    for n in nodes.get("items") or ():
        if (n.get("spec") or {}).get("unschedulable"):
            continue
        alloc = (n.get("status") or {}).get("allocatable") or {}
        cpu = _parse_quantity(alloc.get("cpu", 0))
        mem = int(_parse_quantity(alloc.get("memory", 0)))
        gpu = int(_parse_quantity(alloc.get(render.GPU_RESOURCE, 0)))
        u = used.get((n.get("metadata") or {}).get("name", ""), [0.0, 0.0, 0.0])
        free_cpu, free_mem, free_gpu = max(0.0, cpu - u[0]), max(0, mem - int(u[1])), max(0, gpu - int(u[2]))
        cap["nodes_total"] += 1
        if u == [0.0, 0.0, 0.0]:
            cap["nodes_free"] += 1
        cap["cpus_total"] += cpu
        cap["cpus_free"] += free_cpu
        cap["memory_bytes_total"] += mem
        cap["memory_bytes_free"] += free_mem
        cap["gpus_total"] += gpu
        cap["gpus_free"] += free_gpu
        cap["max_cpus_per_node"] = max(cap["max_cpus_per_node"], cpu)
        cap["max_memory_bytes_per_node"] = max(cap["max_memory_bytes_per_node"], mem)
        cap["max_gpus_per_node"] = max(cap["max_gpus_per_node"], gpu)
        if gpu:
            t = ((n.get("metadata") or {}).get("labels") or {}).get(render.GPU_PRODUCT_LABEL, "")
            acc = gpu_types.setdefault(t, [0, 0])
            acc[0] += gpu
            acc[1] += free_gpu
    return ClusterCapacity(**cap, gpus=tuple(GpuInventory(t, a, f) for t, (a, f) in sorted(gpu_types.items())))  # type: ignore[arg-type]

