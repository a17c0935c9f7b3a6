"""The Kubernetes driver as a real process over real gRPC, against kmock's API emulator over real HTTP.

The emulator runs in the test process (``Emulator``: kmock's stateful
``KubernetesEmulator`` plus a small front that normalises ``watch=True`` to
``watch=true``, kmock 0.8 recognising only the latter, serves the pod log
endpoint from ``Emulator.logs`` and, when ``Emulator.pod_metrics`` is set,
``metrics.k8s.io`` pod metrics, counts and timestamps requests, and can
answer every request with a 5xx (``fail_with``) or some paths with 403
(``forbidden``), as an API server under trouble or RBAC would). The test
plays the kubelet: it moves pods through phases by patching
``pods/<name>/status`` over HTTP, as a kubelet does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import grpc
import pytest

kmock = pytest.importorskip("kmock")
pytest.importorskip("kubernetes")

import aiohttp  # noqa: E402 - a kmock dependency
import aiohttp.web  # noqa: E402

from dlsched.v1 import cluster_pb2, driver_service_pb2_grpc, job_pb2  # noqa: E402
from dlsched.v1 import driver_service_pb2 as dpb  # noqa: E402
from drivers.kubernetes import render  # noqa: E402
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
        self.gone_at = 0
        self.logs: dict[tuple[str, str], list[str]] = {}
        self.log_event = asyncio.Event()
        self.stamps: list[tuple[float, str]] = []  # (monotonic arrival, "METHOD path")
        self.fail_with: int | None = None  # answer every request with this status (5xx)
        self.failed = 0
        self.forbidden: set[str] = set()  # paths answered 403 (RBAC)
        self.pod_metrics: dict[str, dict[str, Any]] | None = None  # pod -> PodMetrics' timestamp/window/containers
        for r in ("v1/pods", "v1/services", "v1/nodes", "v1/secrets", "v1/configmaps"):
            self.resources[r] = {}
        return self

    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        self.count += 1
        self.paths.append(f"{raw.method} {raw.rel_url}")
        self.auth.add(raw.headers.get("Authorization", ""))
        self.stamps.append((time.monotonic(), f"{raw.method} {raw.path}"))
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
            return aiohttp.web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                              "code": 410, "reason": "Expired",
                                              "message": "too old resource version"}, status=410)
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
        q = raw.rel_url.query
        key = (request.name, q.get("container", "main"))
        if self.phase(request.name) in ("", "Pending"):
            return aiohttp.web.json_response({"kind": "Status", "code": 400, "reason": "BadRequest",
                                              "message": "container is waiting to start"}, status=400)
        resp = aiohttp.web.StreamResponse()
        resp.content_type = "text/plain"
        await resp.prepare(raw)
        lines = self.logs.setdefault(key, [])
        pos = max(0, len(lines) - int(q["tailLines"])) if q.get("tailLines") else 0
        cutoff = time.time() - int(q["sinceSeconds"]) if q.get("sinceSeconds") else None
        while True:
            while pos < len(lines):
                if cutoff is None or stamp_time(lines[pos]) >= cutoff:
                    await resp.write(lines[pos].encode() + b"\n")
                pos += 1
            if q.get("follow") not in ("true", "True") or self.phase(request.name) in ("Succeeded", "Failed", ""):
                break
            self.log_event.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.log_event.wait(), 0.5)
        await resp.write_eof()
        return resp

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


@pytest.fixture(scope="module")
async def emu() -> AsyncIterator[tuple[Emulator, str]]:
    async with emulator() as e:
        yield e


@pytest.fixture(scope="module")
def driver(emu: tuple[Emulator, str]) -> Iterator[ServiceProcess]:  # stopped before the emulator
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


def new_id(prefix: str) -> str:
    return f"{prefix}-{next(_n)}"


async def configure(stub: Any, cluster: str, url: str) -> dpb.ConfigureClusterResponse:
    return await stub.ConfigureCluster(dpb.ConfigureClusterRequest(
        cluster=cluster, address=url, options={"namespace": NS, "default_image": "python:3.11-slim"},
        credentials=cluster_pb2.ClusterCredentials(kubernetes=cluster_pb2.KubernetesCredentials(token=TOKEN))),
        timeout=15)


@pytest.fixture
async def stub(driver: ServiceProcess, emu: tuple[Emulator, str]) -> AsyncIterator[Any]:
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
                 cluster: str = "clusters/k8s") -> dpb.LaunchJobResponse:
    return await stub.LaunchJob(dpb.LaunchJobRequest(cluster=cluster, job_id=job_id, spec=sp,
                                                     attempt=attempt), timeout=15)


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


async def eventually(pred: Any, within: float = 10) -> None:
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
                render.LABEL_JOB) == render.job_label(job_id):
            out[name] = obj.raw
    return out


def has_service(e: Emulator, name: str) -> bool:
    return has(e, SERVICES, name)


def has(e: Emulator, resource: Any, name: str) -> bool:
    key = (resource, NS, name)
    return key in e.objects and not e.objects[key].deleted


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("mode", sorted(MODES))
async def test_each_mode_runs_to_success(stub: Any, emu: tuple[Emulator, str], mode: str) -> None:
    e, url = emu
    job = new_id(mode.replace("_", "-"))
    res = await launch(stub, job, spec(mode))
    assert res.backend_job_id == f"{NS}/{job}-1"
    assert res.native_spec.media_type == "application/yaml"
    pods = pods_of(e, job)
    assert has_service(e, f"{job}-1")
    assert len(pods) == sum(g.replicas for g in MODES[mode][1])
    for p in pods.values():
        assert p["spec"]["subdomain"] == f"{job}-1" and p["spec"]["restartPolicy"] == "Never"
        assert p["metadata"]["ownerReferences"][0]["name"] == f"{job}-1"
    for name in pods:
        await kubelet(url, name, "Running")
    obs = await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING])
    obs = await all_replicas_running(stub, job, obs)
    assert all(r.state == job_pb2.REPLICA_STATE_RUNNING and r.host == "node-1" for r in obs.replicas)
    rest = STOPPED_AFTER.get(mode)
    role_of = {n: p["metadata"]["labels"][render.LABEL_ROLE] for n, p in pods.items()}
    deciding = [n for n in pods if role_of[n] != rest]
    for name in deciding:
        await kubelet(url, name, "Succeeded", **exited(0, "Completed"))
    obs = await wait_for(stub, job, TERMINAL)
    assert obs.state == job_pb2.JOB_STATE_SUCCEEDED, obs
    if rest:  # the parameter servers / MPI workers are stopped once the deciding roles are done
        await eventually(lambda: not any(role_of[n] == rest for n in pods_of(e, job)))
        obs = await observe(stub, job)
        assert obs.state == job_pb2.JOB_STATE_SUCCEEDED
        stopped = [r for r in obs.replicas if r.role == rest]
        assert stopped and all(r.state == job_pb2.REPLICA_STATE_STOPPED for r in stopped)


@pytest.mark.parametrize("mode", ["multi_process", "master_worker", "ps_worker"])
async def test_a_failed_worker_fails_the_job_with_its_replica_and_reason(stub: Any, emu: tuple[Emulator, str],
                                                                         mode: str) -> None:
    e, url = emu
    job = new_id(f"oom-{mode.replace('_', '-')}")
    groups = [group("worker", 2)] if mode == "multi_process" else MODES[mode][1]
    await launch(stub, job, job_pb2.JobSpec(run_mode=MODES[mode][0], replica_groups=groups))
    failing = f"{job}-1-worker-1"
    for name in pods_of(e, job):
        if name != failing:
            await kubelet(url, name, "Running")
    await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING])
    await kubelet(url, failing, "Failed", **exited(137, "OOMKilled"))
    obs = await wait_for(stub, job, TERMINAL)
    assert (obs.state, obs.reason, obs.exit_code) == (job_pb2.JOB_STATE_FAILED, "OOMKilled", 137)
    assert obs.message.startswith("worker-1: OOMKilled"), obs.message
    (bad,) = [r for r in obs.replicas if r.state == job_pb2.REPLICA_STATE_FAILED]
    assert (bad.role, bad.index, bad.exit_code) == ("worker", 1, 137)
    await eventually(lambda: list(pods_of(e, job)) == [failing])  # the rest (master, ps, chief) is stopped
    obs = await observe(stub, job)
    assert obs.state == job_pb2.JOB_STATE_FAILED and obs.reason == "OOMKilled"  # latched
    assert all(r.state == job_pb2.REPLICA_STATE_STOPPED for r in obs.replicas if (r.role, r.index) != ("worker", 1))


@pytest.mark.parametrize("job", ["odd--id", "trailing-"])
async def test_job_ids_that_are_not_labels_are_tracked_by_their_label(stub: Any, emu: tuple[Emulator, str],
                                                                      job: str) -> None:
    e, url = emu
    job = f"{job}{next(_n)}" if job.endswith("--id") else f"{job}{next(_n)}-"
    label = render.job_label(job)
    assert label != job and render.is_dns_label(label)  # validation accepts the id; the label differs
    res = await launch(stub, job, spec("master_worker"))
    pods = pods_of(e, job)
    assert len(pods) == 3 and res.backend_job_id == f"{NS}/{render.service_name(job, 1)}"
    for name in pods:
        await kubelet(url, name, "Running")
    obs = await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING])
    obs = await all_replicas_running(stub, job, obs)
    assert obs.job_id == job and all(r.state == job_pb2.REPLICA_STATE_RUNNING for r in obs.replicas)
    before = len(e.paths)
    with pytest.raises(grpc.aio.AioRpcError):  # no metrics.k8s.io here; the query still names the label
        await stub.MeasureJobUsage(dpb.MeasureJobUsageRequest(cluster="clusters/k8s",
                                                              job=dpb.JobRef(job_id=job)), timeout=10)
    assert any("metrics.k8s.io" in p and f"job-id%3D{label}" in p for p in e.paths[before:]), e.paths[before:]
    for name in pods:
        await kubelet(url, name, "Succeeded", **exited(0, "Completed"))
    obs = await wait_for(stub, job, TERMINAL)
    assert obs.state == job_pb2.JOB_STATE_SUCCEEDED, obs
    await stub.CleanupJob(dpb.CleanupJobRequest(cluster="clusters/k8s", job=dpb.JobRef(job_id=job)), timeout=10)
    assert pods_of(e, job) == {} and not has_service(e, render.service_name(job, 1))


async def test_mpi_runs_with_a_per_attempt_ssh_key(stub: Any, emu: tuple[Emulator, str],
                                                   driver: ServiceProcess) -> None:
    e, url = emu
    job = new_id("mpi-key")
    res = await launch(stub, job, spec("mpi"))
    secret, config_map = f"{job}-1-ssh", f"{job}-1-mpi"
    assert has(e, SECRETS, secret) and has(e, CONFIG_MAPS, config_map)
    keys = e.objects[SECRETS, NS, secret].raw["stringData"]
    private = keys["ssh-privatekey"]
    assert private.startswith("-----BEGIN OPENSSH PRIVATE KEY-----")
    assert keys["known_hosts"] == f"*.{job}-1.{NS}.svc {keys['ssh-publickey']}"
    assert "PRIVATE KEY-----\n" not in res.native_spec.content  # the reported spec is the rendered one
    assert private not in driver.log()
    hostfile = e.objects[CONFIG_MAPS, NS, config_map].raw["data"]["hostfile"]
    assert hostfile == f"worker-0.{job}-1.{NS}.svc slots=2\nworker-1.{job}-1.{NS}.svc slots=2\n"
    again = await launch(stub, new_id("mpi-key"), spec("mpi"))  # every attempt has its own key
    other = e.objects[SECRETS, NS, f"{again.backend_job_id.split('/')[1]}-ssh"].raw["stringData"]
    assert other["ssh-privatekey"] != private
    pods = pods_of(e, job)
    launcher = pods[f"{job}-1-launcher-0"]
    assert [c["name"] for c in launcher["spec"]["initContainers"]] == ["wait-for-workers"]
    for name in pods:
        await kubelet(url, name, "Running")
    await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING])
    await kubelet(url, f"{job}-1-launcher-0", "Succeeded", **exited(0, "Completed"))
    obs = await wait_for(stub, job, TERMINAL)
    assert obs.state == job_pb2.JOB_STATE_SUCCEEDED  # the launcher's state, the workers still up
    await eventually(lambda: list(pods_of(e, job)) == [f"{job}-1-launcher-0"])  # workers stopped
    ref = dpb.JobRef(job_id=job)
    await stub.CleanupJob(dpb.CleanupJobRequest(cluster="clusters/k8s", job=ref), timeout=10)
    assert not has(e, SECRETS, secret) and not has(e, CONFIG_MAPS, config_map)
    assert not has_service(e, f"{job}-1") and pods_of(e, job) == {}


async def test_an_adopted_mpi_job_is_cleaned_up_whole(driver: ServiceProcess) -> None:
    """A driver that finds an MPI job on the watch (after a restart) still deletes its Secret and ConfigMap."""
    async with security.channel(driver.address) as ch, emulator() as (e, url):
        stub = driver_service_pb2_grpc.DriverServiceStub(ch)
        await configure(stub, "clusters/first", url)
        job = new_id("mpi-adopt")
        await launch(stub, job, spec("mpi"), cluster="clusters/first")
        await configure(stub, "clusters/second", url)  # knows the job from its pods alone
        obs = await wait_for(stub, job, [job_pb2.JOB_STATE_PENDING], cluster="clusters/second")
        assert obs.backend_job_id == f"{NS}/{job}-1" and len(obs.replicas) == 3
        await stub.CleanupJob(dpb.CleanupJobRequest(cluster="clusters/second", job=dpb.JobRef(job_id=job)),
                              timeout=10)
        assert not has(e, SECRETS, f"{job}-1-ssh") and not has(e, CONFIG_MAPS, f"{job}-1-mpi")
        assert not has_service(e, f"{job}-1") and pods_of(e, job) == {}
        for cluster in ("clusters/first", "clusters/second"):
            await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster=cluster), timeout=10)


async def test_a_failed_mpi_launcher_fails_the_job(stub: Any, emu: tuple[Emulator, str]) -> None:
    e, url = emu
    job = new_id("mpi-fail")
    await launch(stub, job, spec("mpi"))
    for name in pods_of(e, job):
        await kubelet(url, name, "Running")
    await kubelet(url, f"{job}-1-launcher-0", "Failed", **exited(1, "Error"))
    obs = await wait_for(stub, job, TERMINAL)
    assert (obs.state, obs.reason, obs.exit_code) == (job_pb2.JOB_STATE_FAILED, "Error", 1)
    assert obs.message.startswith("launcher-0: ")
    await eventually(lambda: list(pods_of(e, job)) == [f"{job}-1-launcher-0"])  # workers stopped
    assert (await observe(stub, job)).state == job_pb2.JOB_STATE_FAILED


async def test_a_messy_job_name_still_gives_valid_objects(stub: Any, emu: tuple[Emulator, str]) -> None:
    """Capitals, dots, unicode, 200 characters in the job's name label: every object the API gets is valid."""
    from tests.test_kubernetes_render import MESSY, assert_valid_metadata

    e, url = emu
    job = f"m{next(_n)}-" + "a-" * 28 + "-"  # the longest, oddest id validation lets through
    assert len(job) <= 63
    sp = spec("mpi")  # the mode with the most kinds of objects
    sp.labels.update({"name": MESSY, "Team.Name": "Vision.ML", "bad key!": "x"})
    await launch(stub, job, sp)
    mine = [obj.raw for (_res, _ns, _name), obj in list(e.objects.items()) if not obj.deleted and
            (obj.raw.get("metadata", {}).get("labels") or {}).get(render.LABEL_JOB) == render.job_label(job)]
    assert sorted(m["kind"] for m in mine) == ["ConfigMap", "Pod", "Pod", "Pod", "Secret", "Service"]
    for m in mine:
        assert_valid_metadata(m)
        assert m["metadata"]["labels"]["Team.Name"] == "Vision.ML"
    pods = pods_of(e, job)
    for name in pods:
        await kubelet(url, name, "Running")
    await kubelet(url, render.pod_name(job, 1, "launcher", 0), "Succeeded", **exited(0, "Completed"))
    obs = await wait_for(stub, job, TERMINAL)
    assert obs.state == job_pb2.JOB_STATE_SUCCEEDED and obs.job_id == job


async def test_pending_reasons_and_idempotent_launch(stub: Any, emu: tuple[Emulator, str]) -> None:
    e, url = emu
    job = new_id("pend")
    before = sum(1 for p in e.paths if p.startswith("POST"))
    first = await launch(stub, job, spec("single_process"))
    again = await launch(stub, job, spec("single_process"))
    assert again.backend_job_id == first.backend_job_id
    assert sum(1 for p in e.paths if p.startswith("POST")) - before == 2  # one Service, one Pod
    pod = f"{job}-1-main-0"
    await kubelet(url, pod, "Pending", conditions=[{"type": "PodScheduled", "status": "False",
                                                    "reason": "Unschedulable", "message": "0/3 nodes"}])
    obs = await wait_for(stub, job, [job_pb2.JOB_STATE_PENDING], reason="Unschedulable")
    assert "0/3 nodes" in obs.message
    await kubelet(url, pod, "Pending", conditions=[], containerStatuses=[
        {"name": "main", "state": {"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}}}])
    await wait_for(stub, job, [job_pb2.JOB_STATE_PENDING], reason="ImagePullBackOff")
    # Not started yet: the log says so instead of failing.
    out = []
    async for r in stub.TailJobLogs(dpb.TailJobLogsRequest(cluster="clusters/k8s", job=dpb.JobRef(job_id=job)),
                                    timeout=10):
        out.extend(r.entries)
    assert len(out) == 1 and "has not started" in out[0].text


async def test_logs_follow_a_replica_until_the_job_ends(stub: Any, emu: tuple[Emulator, str]) -> None:
    e, url = emu
    job = new_id("logs")
    await launch(stub, job, spec("single_process"))
    pod = f"{job}-1-main-0"
    got: list[str] = []

    async def follow() -> None:
        req = dpb.TailJobLogsRequest(cluster="clusters/k8s", job=dpb.JobRef(job_id=job), follow=True)
        async for r in stub.TailJobLogs(req, timeout=30):
            got.extend(x.text for x in r.entries)

    task = asyncio.create_task(follow())
    await asyncio.sleep(0.3)
    await kubelet(url, pod, "Running")
    e.write_log(pod, "epoch 1")
    await eventually(lambda: "epoch 1" in got)
    assert got == ["epoch 1"]
    e.write_log(pod, "epoch 2")
    await kubelet(url, pod, "Succeeded", **exited(0, "Completed"))
    await asyncio.wait_for(task, 15)
    assert got == ["epoch 1", "epoch 2"]
    tail = []
    async for r in stub.TailJobLogs(dpb.TailJobLogsRequest(cluster="clusters/k8s", job=dpb.JobRef(job_id=job),
                                                           tail_lines=1), timeout=10):
        tail.extend(r.entries)
    assert [t.text for t in tail] == ["epoch 2"] and tail[0].time.seconds > 0
    # A client that cancels a follow of a silent replica leaves no reader behind (see the fixture).
    quiet = new_id("quiet")
    await launch(stub, quiet, spec("single_process"))
    await kubelet(url, f"{quiet}-1-main-0", "Running")
    await wait_for(stub, quiet, [job_pb2.JOB_STATE_RUNNING])
    call = stub.TailJobLogs(dpb.TailJobLogsRequest(cluster="clusters/k8s", job=dpb.JobRef(job_id=quiet),
                                                   follow=True), timeout=30)
    await asyncio.sleep(0.5)
    call.cancel()


async def test_stop_and_delete_remove_the_right_objects(stub: Any, emu: tuple[Emulator, str]) -> None:
    e, url = emu
    job, other = new_id("stop"), new_id("keep")
    await launch(stub, job, spec("master_worker"))
    await launch(stub, other, spec("single_process"))
    for name in pods_of(e, job):
        await kubelet(url, name, "Running")
    await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING])
    ref = dpb.JobRef(job_id=job)
    resp = await stub.TerminateJob(dpb.TerminateJobRequest(cluster="clusters/k8s", job=ref), timeout=10)
    assert resp.observation.state in (job_pb2.JOB_STATE_STOPPING, job_pb2.JOB_STATE_STOPPED)
    obs = await wait_for(stub, job, [job_pb2.JOB_STATE_STOPPED])
    assert all(r.state == job_pb2.REPLICA_STATE_STOPPED for r in obs.replicas)
    assert pods_of(e, job) == {} and has_service(e, f"{job}-1")  # the record is kept
    await stub.TerminateJob(dpb.TerminateJobRequest(cluster="clusters/k8s", job=ref), timeout=10)
    await stub.CleanupJob(dpb.CleanupJobRequest(cluster="clusters/k8s", job=ref), timeout=10)
    assert not has_service(e, f"{job}-1")
    await stub.CleanupJob(dpb.CleanupJobRequest(cluster="clusters/k8s", job=ref), timeout=10)
    assert not (await observe(stub, job)).found
    assert len(pods_of(e, other)) == 1 and has_service(e, f"{other}-1")  # untouched


async def test_status_of_many_jobs_comes_from_one_watch(driver: ServiceProcess) -> None:
    n = 1000
    ids = [f"bulk-{i}" for i in range(n)]
    async with security.channel(driver.address) as ch, emulator() as (e, url):
        stub = driver_service_pb2_grpc.DriverServiceStub(ch)
        for j in ids:  # pods the driver did not create: it adopts them from its list + watch
            pod = dict(render.render_job(j, render_spec(), 1, {"namespace": NS, "default_image": "x"}).manifests[1])
            pod["status"] = {"phase": "Running"}
            e.objects["v1/pods", NS, pod["metadata"]["name"]] = pod
        counted_before = backend_calls(driver)
        await configure(stub, "clusters/bulk", url)
        refs = [dpb.JobRef(job_id=j) for j in ids]

        async def batch() -> list[dpb.JobObservation]:
            resp = await stub.BatchGetJobObservations(dpb.BatchGetJobObservationsRequest(
                cluster="clusters/bulk", jobs=refs), timeout=10)
            return list(resp.observations)

        for _ in range(100):
            if all(o.state == job_pb2.JOB_STATE_RUNNING for o in await batch()):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the list did not deliver every pod")
        driver_requests = lambda: sum(1 for p in e.paths if not p.startswith("PATCH"))  # noqa: E731
        before = driver_requests()
        for i in range(5):  # five status intervals over 1,000 jobs, one job finishing in each
            await kubelet(url, f"bulk-{i}-1-main-0", "Succeeded", **exited(0, "Completed"))
            await wait_for(stub, f"bulk-{i}", [job_pb2.JOB_STATE_SUCCEEDED], cluster="clusters/bulk")
            obs = await batch()
            assert len(obs) == n and all(o.found for o in obs)
        assert driver_requests() - before <= 1  # at most a watch reconnect; never a request per job
        # /metrics counts exactly the API calls the emulator saw from the driver.
        assert backend_calls(driver) - counted_before == driver_requests()
        await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster="clusters/bulk"), timeout=10)


def backend_calls(driver: ServiceProcess) -> float:
    """The driver's ``dlsched_backend_calls_total`` for Kubernetes, from its /metrics."""
    import urllib.request

    with open(driver.port_file + ".metrics") as f:
        url = f"http://{f.read().strip()}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("dlsched_backend_calls_total{") and 'backend="kubernetes"' in line)


def render_spec() -> Any:
    from drivers.common.base import JobSpec, ReplicaGroup, RunMode

    return JobSpec(RunMode.SINGLE_PROCESS, (ReplicaGroup(role="main", replicas=1, command=("true",)),))


async def test_capacity_usage_and_mpi(stub: Any, emu: tuple[Emulator, str]) -> None:
    e, url = emu
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-1", "labels": {
        render.GPU_PRODUCT_LABEL: "H100"}}, "status": {"allocatable": {"cpu": "8", "memory": "32Gi",
                                                                        render.GPU_RESOURCE: "4"}}}
    async with aiohttp.ClientSession() as s, s.post(f"{url}/api/v1/nodes", json=node) as r:
        assert r.status == 200
    job = new_id("cap")
    await launch(stub, job, spec("single_process"))
    await kubelet(url, f"{job}-1-main-0", "Running", node="gpu-1")  # its requests count
    info = (await stub.GetClusterInfo(dpb.GetClusterInfoRequest(cluster="clusters/k8s"), timeout=10)).info
    assert info.state == cluster_pb2.CLUSTER_STATE_READY
    c = info.capacity
    assert (c.cpus_total, c.gpus_total, c.memory_bytes_total) == (8, 4, 32 << 30)
    assert c.cpus_free == 7 and c.memory_bytes_free == 31 << 30 and c.gpus[0].gpu_type == "H100"
    assert set(info.supported_run_modes) == {job_pb2.RUN_MODE_SINGLE_PROCESS, job_pb2.RUN_MODE_MULTI_PROCESS,
                                             job_pb2.RUN_MODE_MASTER_WORKER, job_pb2.RUN_MODE_PS_WORKER,
                                             job_pb2.RUN_MODE_MPI}
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.MeasureJobUsage(dpb.MeasureJobUsageRequest(cluster="clusters/k8s",
                                                              job=dpb.JobRef(job_id=job)), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_an_unreachable_api_server_never_fails_jobs(driver: ServiceProcess) -> None:
    async with security.channel(driver.address) as ch:
        stub = driver_service_pb2_grpc.DriverServiceStub(ch)
        cluster = "clusters/flaky"
        async with emulator() as (e, url):
            await configure(stub, cluster, url)
            job = new_id("flaky")
            await launch(stub, job, spec("single_process"), cluster=cluster)
            await kubelet(url, f"{job}-1-main-0", "Running")
            await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING], cluster=cluster)
            assert f"Bearer {TOKEN}" in e.auth  # the token reached the API server (and no log line)
        # The emulator is gone: connection refused.
        obs = await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING], reason="BackendStale", cluster=cluster)
        assert obs.state == job_pb2.JOB_STATE_RUNNING
        info = (await stub.GetClusterInfo(dpb.GetClusterInfoRequest(cluster=cluster), timeout=15)).info
        assert info.state == cluster_pb2.CLUSTER_STATE_UNREACHABLE
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await launch(stub, new_id("flaky"), spec("single_process"), cluster=cluster)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster=cluster), timeout=10)


async def test_a_410_gone_watch_relists(stub: Any, emu: tuple[Emulator, str]) -> None:
    e, url = emu
    job = new_id("gone")
    await launch(stub, job, spec("single_process"))
    def relisted() -> bool:
        return e.gone_at > 0 and any(p.startswith("GET /api/v1/namespaces/dl/pods?") and "watch" not in p
                                     for p in e.paths[e.gone_at:])

    e.gone, e.gone_at = True, 0
    e.drop_streams()  # the watch breaks; the next one is answered 410 Gone
    await eventually(relisted)
    await kubelet(url, f"{job}-1-main-0", "Running")
    await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING])  # watching again after the re-list


async def test_render_and_watch_observations(stub: Any, emu: tuple[Emulator, str]) -> None:
    e, url = emu
    job = new_id("watched")
    rendered = await stub.RenderJob(dpb.RenderJobRequest(cluster="clusters/k8s", job_id=job,
                                                         spec=spec("master_worker")), timeout=10)
    assert rendered.native_spec.media_type == "application/yaml"
    assert f"master-0.{job}-1.{NS}.svc" in rendered.native_spec.content
    assert pods_of(e, job) == {}  # a dry run creates nothing
    call = stub.WatchJobObservations(dpb.WatchJobObservationsRequest(cluster="clusters/k8s"), timeout=20)
    try:
        async for ev in call:
            if ev.snapshot_complete:
                break
        await launch(stub, job, spec("single_process"))
        await kubelet(url, f"{job}-1-main-0", "Running")
        async for ev in call:
            if ev.observation.job_id == job and ev.observation.state == job_pb2.JOB_STATE_RUNNING:
                break
    finally:
        call.cancel()


# --------------------------------------------------------------------------- usage, capacity, trouble, budget


async def measure(stub: Any, job_id: str, cluster: str = "clusters/k8s") -> dict[tuple[str, int], Any]:
    resp = await stub.MeasureJobUsage(dpb.MeasureJobUsageRequest(cluster=cluster, job=dpb.JobRef(job_id=job_id)),
                                      timeout=10)
    return {(r.role, r.replica_index): r for r in resp.usage.replicas}


async def test_usage_comes_from_metrics_k8s_io(stub: Any, emu: tuple[Emulator, str]) -> None:
    """Memory as served; CPU seconds integrated from the served rate (cores) over the time each sample covers."""
    e, url = emu
    job = new_id("usage")
    await launch(stub, job, job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_MULTI_PROCESS,
                                            replica_groups=[group("worker", 2, 2)]))  # two containers a pod
    w0, w1 = f"{job}-1-worker-0", f"{job}-1-worker-1"
    for pod in (w0, w1):
        await kubelet(url, pod, "Running")  # startTime 2026-01-01T00:00:00Z
    await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING])

    def sample(at: str, *usage: tuple[str, str]) -> dict[str, Any]:
        return {"timestamp": at, "window": "15s", "containers": [
            {"name": f"main-{i}", "usage": {"cpu": cpu, "memory": mem}} for i, (cpu, mem) in enumerate(usage)]}

    e.pod_metrics = {w0: sample("2026-01-01T00:01:40Z", ("250m", "64Mi"), ("1500000n", "123456Ki")),
                     w1: sample("2026-01-01T00:01:40Z", ("2", "1Gi"), ("0", "0"))}
    try:
        u = await measure(stub, job)
        assert set(u) == {("worker", 0), ("worker", 1)} and all(r.running for r in u.values())
        assert u["worker", 0].memory_bytes == (64 << 20) + 123456 * 1024 == u["worker", 0].peak_memory_bytes
        assert u["worker", 1].memory_bytes == 1 << 30
        # 0.2515 and 2 cores for the 100 s since the pods started
        assert u["worker", 0].cpu_seconds == pytest.approx(25.15)
        assert u["worker", 1].cpu_seconds == pytest.approx(200)
        assert (await measure(stub, job)) == u  # the same sample again adds nothing
        # 15 s later worker-0 runs at 0.5 cores with less memory; worker-1 has ended (no metrics).
        e.pod_metrics = {w0: sample("2026-01-01T00:01:55Z", ("500m", "32Mi"))}
        await kubelet(url, w1, "Succeeded", **exited(0, "Completed"))
        u2 = await measure(stub, job)
        assert u2["worker", 0].cpu_seconds == pytest.approx(25.15 + 7.5)
        assert u2["worker", 0].memory_bytes == 32 << 20
        assert u2["worker", 0].peak_memory_bytes == (64 << 20) + 123456 * 1024
        ended = u2["worker", 1]
        assert not ended.running and ended.memory_bytes == 0
        assert ended.cpu_seconds == pytest.approx(200) and ended.peak_memory_bytes == 1 << 30
    finally:
        e.pod_metrics = None


async def put_node(url: str, name: str, cpu: str, gpus: str = "", product: str = "") -> None:
    alloc = {"cpu": cpu, "memory": "64Gi", **({render.GPU_RESOURCE: gpus} if gpus else {})}
    labels = {render.GPU_PRODUCT_LABEL: product} if product else {}
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels},
            "status": {"allocatable": alloc}}
    async with aiohttp.ClientSession() as s, s.post(f"{url}/api/v1/nodes", json=node) as r:
        assert r.status == 200, await r.text()


def foreign_pod(e: Emulator, ns: str, name: str, node: str, phase: str, gpus: int) -> None:
    """A pod dlsched did not make (another namespace, another user), GPUs in its limits only."""
    e.objects[PODS, ns, name] = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x", "resources": {
            "limits": {render.GPU_RESOURCE: str(gpus)}}}]},
        "status": {"phase": phase}}


async def test_gpu_capacity_and_a_namespace_scoped_credential(driver: ServiceProcess) -> None:
    """Free GPUs = allocatable - requests of scheduled pods that have not ended, cluster-wide; a credential
    that may not list pods cluster-wide (403) still leaves the cluster READY with the nodes' capacity."""
    cluster = "clusters/gpus"
    async with security.channel(driver.address) as ch, emulator() as (e, url):
        stub = driver_service_pb2_grpc.DriverServiceStub(ch)
        await put_node(url, "a100-1", "32", "8", "A100")
        await put_node(url, "h100-1", "32", "4", "H100")
        await put_node(url, "cpu-1", "16")
        await configure(stub, cluster, url)
        job = new_id("gpu")
        gpu_group = job_pb2.ReplicaGroup(role="worker", replicas=2, processes_per_replica=2, command=["python"],
                                         resources=job_pb2.Resources(cpu=2, memory_bytes=1 << 30, gpus=2))
        await launch(stub, job, job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_MULTI_PROCESS,
                                                replica_groups=[gpu_group]), cluster=cluster)
        for pod in pods_of(e, job):
            await kubelet(url, pod, "Running", node="a100-1")  # 2 x 2 GPUs on the A100 node
        foreign_pod(e, "other", "training", "h100-1", "Running", 1)  # counts: another namespace
        foreign_pod(e, "other", "done", "h100-1", "Succeeded", 4)  # ended: holds nothing
        foreign_pod(e, "other", "queued", "", "Pending", 4)  # not scheduled: holds nothing

        async def info() -> Any:
            return (await stub.GetClusterInfo(dpb.GetClusterInfoRequest(cluster=cluster), timeout=10)).info

        i = await info()
        assert i.state == cluster_pb2.CLUSTER_STATE_READY
        c = i.capacity
        assert (c.gpus_total, c.gpus_free, c.max_gpus_per_node) == (12, 12 - 4 - 1, 8)
        assert {(g.gpu_type, g.total, g.free) for g in c.gpus} == {("A100", 8, 4), ("H100", 4, 3)}
        assert (c.cpus_total, c.cpus_free, c.nodes_total, c.nodes_free) == (80, 76, 3, 1)

        e.forbidden.add("/api/v1/pods")  # namespace-scoped RBAC: no cluster-wide pod list
        i = await info()
        assert i.state == cluster_pb2.CLUSTER_STATE_READY, i
        c = i.capacity
        assert (c.gpus_total, c.cpus_total, c.max_gpus_per_node) == (12, 80, 8)  # the nodes, all there
        assert c.gpus_free == 12 - 4  # only namespace dl's pods are seen
        assert "forbidden" in i.message  # says why free capacity is partial
        tried = sum(1 for _, p in e.stamps if p == "GET /api/v1/pods")
        await info()
        assert sum(1 for _, p in e.stamps if p == "GET /api/v1/pods") == tried  # not asked again each interval
        assert (await observe(stub, job, cluster)).state == job_pb2.JOB_STATE_RUNNING
        await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster=cluster), timeout=10)


async def test_an_api_server_answering_5xx_never_fails_jobs(driver: ServiceProcess) -> None:
    cluster = "clusters/five-xx"
    async with security.channel(driver.address) as ch, emulator() as (e, url):
        stub = driver_service_pb2_grpc.DriverServiceStub(ch)
        await configure(stub, cluster, url)
        job = new_id("five-xx")
        await launch(stub, job, spec("single_process"), cluster=cluster)
        pod = f"{job}-1-main-0"
        await kubelet(url, pod, "Running")
        await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING], cluster=cluster)

        e.fail_with = 503
        e.drop_streams()  # the watch breaks; every request after it is answered 503
        await eventually(lambda: e.failed >= 2)  # the informer's re-list was refused, and retried
        await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING], reason="BackendStale", cluster=cluster)
        info = (await stub.GetClusterInfo(dpb.GetClusterInfoRequest(cluster=cluster), timeout=10)).info
        assert info.state == cluster_pb2.CLUSTER_STATE_UNREACHABLE
        for call in (launch(stub, new_id("five-xx"), spec("single_process"), cluster=cluster), measure(stub, job, cluster)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        for _ in range(5):  # the last state is kept, never FAILED
            obs = await observe(stub, job, cluster)
            assert (obs.state, obs.reason) == (job_pb2.JOB_STATE_RUNNING, "BackendStale")
            await asyncio.sleep(0.1)

        e.fail_with = None  # the API server is well again: the informer re-lists and the job is current
        await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING], reason="Running", within=20, cluster=cluster)
        info = (await stub.GetClusterInfo(dpb.GetClusterInfoRequest(cluster=cluster), timeout=10)).info
        assert info.state == cluster_pb2.CLUSTER_STATE_READY
        await kubelet(url, pod, "Succeeded", **exited(0, "Completed"))
        await wait_for(stub, job, [job_pb2.JOB_STATE_SUCCEEDED], cluster=cluster)
        await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster=cluster), timeout=10)


async def test_the_request_budget_paces_api_requests() -> None:
    """--qps 5 --burst 5: 20 concurrent launches (40 creates) reach the API server paced, not all at once."""
    qps, burst = 5, 5
    svc = ServiceProcess("drivers.kubernetes", ["--qps", str(qps), "--burst", str(burst), "--request-timeout", "5"],
                         name="kubernetes-paced").start()
    try:
        async with security.channel(svc.address) as ch, emulator() as (e, url):
            stub = driver_service_pb2_grpc.DriverServiceStub(ch)
            await configure(stub, "clusters/paced", url)
            before = len(e.stamps)
            ids = [new_id("paced") for _ in range(20)]
            await asyncio.gather(*(stub.LaunchJob(dpb.LaunchJobRequest(
                cluster="clusters/paced", job_id=j, spec=spec("single_process"), attempt=1), timeout=60)
                for j in ids))
            posts = [t for t, p in e.stamps[before:] if p.startswith("POST ")]
            assert len(posts) == 40  # a Service and a Pod each
            # A bucket of 5 lets 5 through at once, then one every 0.2 s: 35 more take 7 s (allow 5).
            assert posts[-1] - posts[0] >= (len(posts) - burst) / qps * 0.7, posts[-1] - posts[0]
            # No second ever sees more than burst + qps of them (plus slack for arrival jitter).
            assert max(sum(1 for u in posts if t <= u < t + 1) for t in posts) <= burst + qps + 2
            await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster="clusters/paced"), timeout=10)
    finally:
        svc.stop()


async def test_logs_since_a_time_ask_the_pod_log_api_for_since_seconds(stub: Any, emu: tuple[Emulator, str]) -> None:
    e, url = emu
    job = new_id("since")
    await launch(stub, job, spec("single_process"))
    pod = f"{job}-1-main-0"
    await kubelet(url, pod, "Running")
    since = time.time() - 60
    e.write_log(pod, "long before", at=since - 3600)
    e.write_log(pod, "just before", at=since - 0.5)  # inside the API's whole-second rounding: the driver drops it
    e.write_log(pod, "at the time", at=since + 0.001)
    e.write_log(pod, "now")
    before = len(e.paths)
    req = dpb.TailJobLogsRequest(cluster="clusters/k8s", job=dpb.JobRef(job_id=job))
    req.since_time.FromNanoseconds(int(since * 1e9))
    got = [x.text async for r in stub.TailJobLogs(req, timeout=10) for x in r.entries]
    assert got == ["at the time", "now"]
    (asked,) = [p for p in e.paths[before:] if f"/pods/{pod}/log?" in p]
    from urllib.parse import parse_qs, urlsplit

    q = parse_qs(urlsplit(asked.split(" ", 1)[1]).query)
    assert 60 <= int(q["sinceSeconds"][0]) <= 63, asked  # rounded up, never short
    assert q["timestamps"] == ["true"]
