"""The Kubernetes driver's tests' shared pieces: kmock's API emulator, the driver process, helpers.

The driver runs as a real process over real gRPC, against kmock's API
emulator over real HTTP. The emulator runs in the test process
(``Emulator``: kmock's stateful ``KubernetesEmulator`` plus a small front
that normalises ``watch=True`` to ``watch=true``, kmock 0.8 recognising only
the latter, serves the pod log endpoint from ``Emulator.logs`` and, when
``Emulator.pod_metrics`` is set, ``metrics.k8s.io`` pod metrics, counts and
timestamps requests, and can answer every request with a 5xx
(``fail_with``) or some paths with 403 (``forbidden``), as an API server
under trouble or RBAC would). The test plays the kubelet: it moves pods
through phases by patching ``pods/<name>/status`` over HTTP, as a kubelet
does (``kubelet``).

The fixtures ``emu``, ``driver`` (module-scoped: one emulator and one
driver process per test module) and ``stub`` (a DriverService stub with
``clusters/k8s`` configured) are imported by each ``test_kubernetes_*``
module as ``emu_fixture``, ``driver_fixture`` and ``stub_fixture``. ``tests/driver_contract.py`` uses ``NS``, ``TOKEN``, ``emulator``
and ``pods_of``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import pytest

kmock = pytest.importorskip("kmock")
pytest.importorskip("kubernetes")

import aiohttp  # noqa: E402 - a kmock dependency
import aiohttp.web  # noqa: E402

from dlsched.v1 import cluster_pb2, driver_service_pb2_grpc, job_pb2  # noqa: E402
from dlsched.v1 import driver_service_pb2 as dpb  # noqa: E402
from drivers.kubernetes import naming  # noqa: E402
from tests import security  # noqa: E402
from tests.harness import ServiceProcess  # noqa: E402

NS = "dl"
TOKEN = "sekrit-token-8f3a"
TERMINAL = (job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_STOPPED)
PODS = kmock.resource("v1/pods")
SERVICES = kmock.resource("v1/services")
SECRETS = kmock.resource("v1/secrets")
CONFIG_MAPS = kmock.resource("v1/configmaps")


class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator with the watch quirk normalised, a pod log endpoint and a request count."""

    def setup(self) -> Emulator:
        self.count = 0
        self.paths: list[str] = []
        self.auth: set[str] = set()
        self.watches: set[asyncio.Task[Any]] = set()
        self.gone = False
        self.gone_in_stream = False  # with gone: a 200 watch whose one event is the 410
        self.gone_at = 0
        self.logs: dict[tuple[str, str], list[str]] = {}
        self.log_event = asyncio.Event()
        self.log_sent: dict[tuple[str, str], int] = {}  # bytes of log lines written to clients
        #: pods whose log responses trickle: a line every half second until the client leaves
        #: (a slow API server, a log read slower than it grows), follow or not
        self.trickle: set[str] = set()
        self.follow_cuts = 0  # cut_follows() calls: each ends the open follows as if done
        self.log_auth: list[str] = []  # the Authorization header of each log request
        self.stamps: list[tuple[float, str]] = []  # (monotonic arrival, "METHOD path")
        self.fail_with: int | None = None  # answer every request with this status (5xx)
        self.failed = 0
        self.forbidden: set[str] = set()  # paths answered 403 (RBAC)
        self.pod_metrics: dict[str, dict[str, Any]] | None = None  # pod -> PodMetrics' timestamp/window/containers
        #: (method, path) -> seconds to hold that request before answering it (a slow API server);
        #: ``held`` counts the requests held so far
        self.hold: Callable[[str, str], float | None] | None = None
        self.held = 0
        #: (method, path) -> an HTTP status to answer that request with instead (5xx: a flaky server)
        self.refuse: Callable[[str, str], int | tuple[int, str, str] | None] | None = None
        for r in ("v1/pods", "v1/services", "v1/nodes", "v1/secrets", "v1/configmaps"):
            self.resources[r] = {}
        return self

    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        self.count += 1
        self.paths.append(f"{raw.method} {raw.rel_url}")
        self.auth.add(raw.headers.get("Authorization", ""))
        self.stamps.append((time.monotonic(), f"{raw.method} {raw.path}"))
        if self.hold is not None and (wait := self.hold(raw.method, raw.path)):
            self.held += 1
            await asyncio.sleep(wait)
        if self.refuse is not None and (answer := self.refuse(raw.method, raw.path)):  # (status, reason, message)
            self.failed += 1
            return status_response(*(answer if isinstance(answer, tuple) else
                                     (answer, "ServiceUnavailable", "etcdserver: request timed out")))
        if self.fail_with is not None:
            self.failed += 1
            return status_response(self.fail_with, "ServiceUnavailable", "etcdserver: request timed out")
        if raw.path in self.forbidden:
            return status_response(403, "Forbidden", f"cannot {raw.method} {raw.path} at the cluster scope")
        if raw.path.startswith("/apis/metrics.k8s.io/") and self.pod_metrics is not None:
            return self._serve_metrics(raw)
        if raw.rel_url.query.get("watch") in ("True", "1"):
            raw = raw.clone(rel_url=raw.rel_url.update_query(watch="true"))
        if raw.rel_url.query.get("watch") == "true" and self.gone:
            self.gone = False  # the resourceVersion was compacted away: the client must re-list
            self.gone_at = len(self.paths)
            gone = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410,
                    "reason": "Expired", "message": "too old resource version"}
            if self.gone_in_stream:  # as kube-apiserver answers a watch: 200, then an ERROR event
                self.gone_in_stream = False
                resp = aiohttp.web.StreamResponse()
                resp.content_type = "application/json"
                await resp.prepare(raw)
                await resp.write(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
                await resp.write_eof()
                return resp
            return aiohttp.web.json_response(gone, status=410)
        if raw.rel_url.query.get("watch") == "true" or raw.rel_url.query.get("follow") == "true":
            task = asyncio.current_task()
            assert task is not None
            self.watches.add(task)
            task.add_done_callback(self.watches.discard)
        return await super().__call__(raw)

    def _serve_metrics(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """``GET /apis/metrics.k8s.io/v1beta1/namespaces/{ns}/pods``: a PodMetricsList, as metrics-server
        serves it (pod labels copied, the selector applied), for the pods in ``pod_metrics``."""
        parts = raw.path.split("/")
        assert parts[3:5] == ["v1beta1", "namespaces"] and parts[6:] == ["pods"], raw.path
        ns = parts[5]
        want = dict(kv.split("=", 1) for kv in raw.rel_url.query.get("labelSelector", "").split(",") if kv)
        items = []
        for name, sample in (self.pod_metrics or {}).items():
            key = (PODS, ns, name)
            if key not in self.objects or self.objects[key].deleted:
                continue
            labels = self.objects[key].raw["metadata"].get("labels") or {}
            if all(labels.get(k) == v for k, v in want.items()):
                items.append({"kind": "PodMetrics", "apiVersion": "metrics.k8s.io/v1beta1",
                              "metadata": {"name": name, "namespace": ns, "labels": labels}, **sample})
        return aiohttp.web.json_response({"kind": "PodMetricsList", "apiVersion": "metrics.k8s.io/v1beta1",
                                          "metadata": {}, "items": items})

    def drop_streams(self) -> None:
        """End every open watch and log stream (the server then shuts down at once)."""
        for t in list(self.watches):
            t.cancel()

    async def _handle(self, request: Any) -> aiohttp.web.StreamResponse:
        if request.subresource == "log" and request.name:
            return await self._serve_log(request)
        return await super()._handle(request)

    def phase(self, name: str) -> str:
        key = (PODS, NS, name)
        if key not in self.objects or self.objects[key].deleted:
            return ""
        obj = self.objects[key]
        return str((obj.raw.get("status") or {}).get("phase", "Pending"))

    async def _serve_log(self, request: Any) -> aiohttp.web.StreamResponse:
        raw = request._raw_request
        self.log_auth.append(raw.headers.get("Authorization", ""))
        q = raw.rel_url.query
        key = (request.name, q.get("container", "main"))
        if self.phase(request.name) in ("", "Pending"):
            return aiohttp.web.json_response({"kind": "Status", "code": 400, "reason": "BadRequest",
                                              "message": "container is waiting to start"}, status=400)
        resp = aiohttp.web.StreamResponse()
        resp.content_type = "text/plain"
        await resp.prepare(raw)
        if request.name in self.trickle:
            while True:
                await resp.write(f"{rfc3339(time.time())} trickle\n".encode())
                await asyncio.sleep(0.5)
        cuts = self.follow_cuts
        lines = self.logs.setdefault(key, [])
        pos = max(0, len(lines) - int(q["tailLines"])) if q.get("tailLines") else 0
        cutoff = time.time() - int(q["sinceSeconds"]) if q.get("sinceSeconds") else None
        while True:
            while pos < len(lines):
                if cutoff is None or stamp_time(lines[pos]) >= cutoff:
                    data = lines[pos].encode() + b"\n"
                    await resp.write(data)
                    self.log_sent[key] = self.log_sent.get(key, 0) + len(data)
                pos += 1
            if q.get("follow") not in ("true", "True") or self.phase(request.name) in ("Succeeded", "Failed", ""):
                break
            if self.follow_cuts != cuts:  # as kube-apiserver ends a log it lost the kubelet of
                break
            self.log_event.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.log_event.wait(), 0.5)
        await resp.write_eof()
        return resp

    def cut_follows(self) -> None:
        """End every open follow cleanly, the pods running on (a kubelet restart)."""
        self.follow_cuts += 1
        self.log_event.set()

    def write_log(self, pod: str, text: str, container: str = "main", at: float | None = None) -> None:
        stamp = rfc3339(at) if at is not None else time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + ".123456789Z"
        self.logs.setdefault((pod, container), []).append(f"{stamp} {text}")
        self.log_event.set()


def status_response(code: int, reason: str, message: str) -> aiohttp.web.Response:
    return aiohttp.web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
                                      "reason": reason, "message": message}, status=code)


def rfc3339(t: float) -> str:
    """Unix seconds -> the log API's ``2026-01-01T00:00:00.123456789Z``."""
    ns = round(t * 1e9)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ns // 10**9)) + f".{ns % 10**9:09d}Z"


def stamp_time(line: str) -> float:
    """A log line's ``<RFC3339Nano> `` prefix -> unix seconds."""
    from datetime import datetime

    stamp = line.split(" ", 1)[0].rstrip("Z")
    whole, _, frac = stamp.partition(".")
    return datetime.fromisoformat(whole + "+00:00").timestamp() + float(f"0.{frac or 0}")


@contextlib.asynccontextmanager
async def emulator() -> AsyncIterator[tuple[Emulator, str]]:
    emu = Emulator().setup()
    async with emu, kmock.Server(emu) as srv:
        try:
            yield emu, str(srv.url).rstrip("/")
        finally:
            emu.drop_streams()


@pytest.fixture(scope="module", name="emu")
async def emu_fixture() -> AsyncIterator[tuple[Emulator, str]]:
    async with emulator() as e:
        yield e


@pytest.fixture(scope="module", name="driver")
def driver_fixture(emu: tuple[Emulator, str]) -> Iterator[ServiceProcess]:  # stopped before the emulator
    svc = ServiceProcess("drivers.kubernetes", ["--request-timeout", "3", "--watch-read-timeout", "60",
                                                "--qps", "500", "--burst", "1000", "--grace-seconds", "1",
                                                "--metrics-listen", "127.0.0.1:0"],
                         name="kubernetes-driver").start()
    yield svc
    t0 = time.monotonic()
    svc.stop()
    assert time.monotonic() - t0 < 10, "the driver hung on SIGTERM (a log follow left a reader behind?)"
    assert TOKEN not in svc.log()


_n = iter(range(10**6))


def unique() -> int:
    """A number no other call in this test session got."""
    return next(_n)


def new_id(prefix: str) -> str:
    return f"{prefix}-{unique()}"


async def configure(stub: Any, cluster: str, url: str) -> dpb.ConfigureClusterResponse:
    return await stub.ConfigureCluster(dpb.ConfigureClusterRequest(
        cluster=cluster, address=url, options={"namespace": NS, "default_image": "python:3.11-slim"},
        credentials=cluster_pb2.ClusterCredentials(kubernetes=cluster_pb2.KubernetesCredentials(token=TOKEN))),
        timeout=15)


@pytest.fixture(name="stub")
async def stub_fixture(driver: ServiceProcess, emu: tuple[Emulator, str]) -> AsyncIterator[Any]:
    async with security.channel(driver.address) as ch:
        s = driver_service_pb2_grpc.DriverServiceStub(ch)
        await configure(s, "clusters/k8s", emu[1])
        yield s


def group(role: str, replicas: int = 1, ppr: int = 0) -> job_pb2.ReplicaGroup:
    return job_pb2.ReplicaGroup(role=role, replicas=replicas, processes_per_replica=ppr,
                                command=["python", "-c"], args=["print('hi')"],
                                resources=job_pb2.Resources(cpu=1, memory_bytes=1 << 30))


MODES = {
    "single_process": (job_pb2.RUN_MODE_SINGLE_PROCESS, [group("main")]),
    "multi_process": (job_pb2.RUN_MODE_MULTI_PROCESS, [group("worker", 2, 2)]),
    "master_worker": (job_pb2.RUN_MODE_MASTER_WORKER, [group("master"), group("worker", 2)]),
    "ps_worker": (job_pb2.RUN_MODE_PS_WORKER, [group("ps", 1), group("worker", 2)]),
    "mpi": (job_pb2.RUN_MODE_MPI, [group("launcher"), group("worker", 2, 2)]),
}
#: Roles that keep running until the deciding ones are done; the driver stops them.
STOPPED_AFTER = {"ps_worker": "ps", "mpi": "worker"}


def spec(mode: str) -> job_pb2.JobSpec:
    m, groups = MODES[mode]
    return job_pb2.JobSpec(run_mode=m, replica_groups=groups)


async def launch(stub: Any, job_id: str, sp: job_pb2.JobSpec, attempt: int = 1,
                 cluster: str = "clusters/k8s", uid: str = "") -> dpb.LaunchJobResponse:
    return await stub.LaunchJob(dpb.LaunchJobRequest(cluster=cluster, job_id=job_id, spec=sp,
                                                     attempt=attempt, job_uid=uid), timeout=15)


async def observe(stub: Any, job_id: str, cluster: str = "clusters/k8s") -> dpb.JobObservation:
    resp = await stub.BatchGetJobObservations(
        dpb.BatchGetJobObservationsRequest(cluster=cluster, jobs=[dpb.JobRef(job_id=job_id)]), timeout=10)
    return resp.observations[0]


async def wait_for(stub: Any, job_id: str, states: Sequence[int], reason: str = "", within: float = 15,
                   cluster: str = "clusters/k8s") -> dpb.JobObservation:
    deadline = time.monotonic() + within
    while True:
        obs = await observe(stub, job_id, cluster)
        if obs.state in states and (not reason or obs.reason == reason):
            return obs
        if time.monotonic() > deadline:
            raise AssertionError(f"{job_id}: {obs}")
        await asyncio.sleep(0.05)


async def all_replicas_running(stub: Any, job_id: str, obs: dpb.JobObservation,
                               within: float = 30) -> dpb.JobObservation:
    """The job turns RUNNING with its first running pod; the watch delivers the
    other pods' Running after: the observation once every replica is RUNNING
    (or the last one seen at the deadline)."""
    deadline = time.monotonic() + within
    while not all(r.state == job_pb2.REPLICA_STATE_RUNNING for r in obs.replicas) \
            and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        obs = await observe(stub, job_id)
    return obs


async def eventually(pred: Any, within: float = 60) -> None:
    for _ in range(int(within / 0.05)):
        if pred():
            return
        await asyncio.sleep(0.05)
    assert pred()


async def kubelet(url: str, pod: str, phase: str, node: str = "node-1", **status: Any) -> None:
    """Patch a pod's status as a kubelet does (the scheduler's nodeName with it)."""
    body = {"status": {"phase": phase, **status}}
    if phase in ("Running", "Succeeded", "Failed"):
        body["spec"] = {"nodeName": node}
        body["status"].setdefault("startTime", "2026-01-01T00:00:00Z")
    async with aiohttp.ClientSession() as s, s.patch(
            f"{url}/api/v1/namespaces/{NS}/pods/{pod}/status", json=body,
            headers={"Content-Type": "application/merge-patch+json"}) as r:
        assert r.status == 200, await r.text()


def exited(code: int, reason: str) -> dict[str, Any]:
    return {"containerStatuses": [{"name": "main", "state": {"terminated": {
        "exitCode": code, "reason": reason, "finishedAt": "2026-01-01T00:01:00Z"}}}]}


def pods_of(e: Emulator, job_id: str) -> dict[str, dict[str, Any]]:
    out = {}
    for (res, _ns, name), obj in list(e.objects.items()):
        if res == PODS and not obj.deleted and (obj.raw["metadata"].get("labels") or {}).get(
                naming.LABEL_JOB) == naming.job_label(job_id):
            out[name] = obj.raw
    return out


def pods_created(e: Emulator, job_id: str) -> int:
    """How many times a pod of ``job_id`` was created, deleted ones included (a name used
    again after a delete counts again): every version that follows none (a delete) or
    opens an object's history."""
    label, n = naming.job_label(job_id), 0
    for (res, _ns, _name), obj in list(e.objects.items()):
        if res != PODS:
            continue
        before = None
        for version in obj.history:
            if version is not None and before is None and \
                    (version.raw["metadata"].get("labels") or {}).get(naming.LABEL_JOB) == label:
                n += 1
            before = version
    return n


def has_service(e: Emulator, name: str) -> bool:
    return has(e, SERVICES, name)


def has(e: Emulator, resource: Any, name: str) -> bool:
    key = (resource, NS, name)
    return key in e.objects and not e.objects[key].deleted


def backend_calls(driver: ServiceProcess) -> float:
    """The driver's ``dlsched_backend_calls_total`` for Kubernetes, from its /metrics."""
    from tests.harness import metrics_samples, sample

    return sample(metrics_samples(driver), "dlsched_backend_calls_total", backend="kubernetes")


def render_spec() -> Any:
    from drivers.common.base import JobSpec, ReplicaGroup, RunMode

    return JobSpec(RunMode.SINGLE_PROCESS, (ReplicaGroup(role="main", replicas=1, command=("true",)),))



async def measure(stub: Any, job_id: str, cluster: str = "clusters/k8s") -> dict[tuple[str, int], Any]:
    resp = await stub.MeasureJobUsage(dpb.MeasureJobUsageRequest(cluster=cluster, job=dpb.JobRef(job_id=job_id)),
                                      timeout=10)
    return {(r.role, r.replica_index): r for r in resp.usage.replicas}



async def put_node(url: str, name: str, cpu: str, gpus: str = "", product: str = "") -> None:
    alloc = {"cpu": cpu, "memory": "64Gi", **({naming.GPU_RESOURCE: gpus} if gpus else {})}
    labels = {naming.GPU_PRODUCT_LABEL: product} if product else {}
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels},
            "status": {"allocatable": alloc}}
    async with aiohttp.ClientSession() as s, s.post(f"{url}/api/v1/nodes", json=node) as r:
        assert r.status == 200, await r.text()


def foreign_pod(e: Emulator, ns: str, name: str, node: str, phase: str, gpus: int) -> None:
    """A pod dlsched did not make (another namespace, another user), GPUs in its limits only."""
    e.objects[PODS, ns, name] = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x", "resources": {
            "limits": {naming.GPU_RESOURCE: str(gpus)}}}]},
        "status": {"phase": phase}}
