"""ClusterManager end to end: the service as a real process over real etcd,
real gRPC, and (for monitoring and matching) the real local driver."""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator

import aetcd
import grpc
import pytest
from google.protobuf import field_mask_pb2
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from dlsched.kit.envelope import Keyring
from dlsched.kit.rpc_errors import error_info, field_violations
from dlsched.v1 import cluster_manager_service_pb2 as pb
from dlsched.v1 import cluster_manager_service_pb2_grpc as pb_grpc
from dlsched.v1 import cluster_pb2, driver_service_pb2, driver_service_pb2_grpc, job_pb2
from tests import security
from tests.harness import ROOT, EtcdServer, ServiceProcess, free_port

SSH_KEY = (
    "-----BEGIN OPENSSH PRIVATE KEY-----\n"
    "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\n"
    "QyNTUxOQAAACBzZWNyZXRzZWNyZXRzZWNyZXRzZWNyZXRzZWNyZXQAAAAAAAAAAAAAAAA\n"
    "-----END OPENSSH PRIVATE KEY-----\n"
)
SSH_KEY_MARKER = "QyNTUxOQAAACBzZWNyZXRzZWNyZXRzZWNyZXRzZWNyZXRzZWNyZXQ"
RAY_TOKEN = "raytok-7f3a9c1e5b2d4f60a8e1c3b5d7f9a2c4"
WAIT = 10.0

HAVE_LOCAL_DRIVER = (ROOT / "drivers" / "local" / "driver.py").exists()
needs_driver = pytest.mark.skipif(not HAVE_LOCAL_DRIVER, reason="drivers.local is not built yet")


# --- fixtures ---------------------------------------------------------------


def start_cm(etcd: EtcdServer, prefix: str, *extra: str) -> ServiceProcess:
    return ServiceProcess(
        "cluster_manager",
        ["--etcd", etcd.endpoint, "--prefix", prefix, "--monitor-interval", "0.3",
         "--log-level", "DEBUG", *extra],
        name="cluster-manager",
    ).start()


@pytest.fixture
def cm(etcd: EtcdServer, etcd_prefix: str) -> Iterator[ServiceProcess]:
    proc = start_cm(etcd, etcd_prefix)
    yield proc
    proc.stop()


@pytest.fixture
async def stub(cm: ServiceProcess) -> AsyncIterator[pb_grpc.ClusterManagerServiceStub]:
    async with security.channel(cm.address) as ch:
        yield pb_grpc.ClusterManagerServiceStub(ch)


@pytest.fixture(scope="module")
def local_driver() -> Iterator[ServiceProcess]:
    if not HAVE_LOCAL_DRIVER:
        pytest.skip("drivers.local is not built yet")
    # PATH without mpirun: the driver then leaves RUN_MODE_MPI out, the unsupported mode matched below.
    proc = ServiceProcess("drivers.local", ["--state-dir", tempfile.mkdtemp(prefix="cm-drv-")],
                          env={"PATH": os.path.dirname(sys.executable)}, name="local-driver").start()
    yield proc
    proc.stop()


def dead_address() -> str:
    return f"127.0.0.1:{free_port()}"


def local_cluster(driver_address: str, **labels: str) -> cluster_pb2.Cluster:
    return cluster_pb2.Cluster(type=job_pb2.CLUSTER_TYPE_LOCAL, driver_address=driver_address,
                               labels=labels)


def slurm_cluster(driver_address: str, **labels: str) -> cluster_pb2.Cluster:
    return cluster_pb2.Cluster(
        type=job_pb2.CLUSTER_TYPE_SLURM, address="login.example.org:22",
        driver_address=driver_address, labels=labels,
        credentials=cluster_pb2.ClusterCredentials(
            ssh=cluster_pb2.SshCredentials(username="svc", private_key=SSH_KEY)),
    )


async def create(stub: pb_grpc.ClusterManagerServiceStub, cid: str, c: cluster_pb2.Cluster,
                 request_id: str = "") -> cluster_pb2.Cluster:
    resp = await stub.CreateCluster(
        pb.CreateClusterRequest(cluster_id=cid, cluster=c, request_id=request_id))
    return resp.cluster


async def rpc_error(coro: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await coro  # type: ignore[misc]
    return ei.value


def reason(e: grpc.aio.AioRpcError) -> str:
    info = error_info(e)
    assert info is not None, e
    assert info.domain == "dlsched.io"
    return info.reason


def fields(e: grpc.aio.AioRpcError) -> list[str]:
    return [v.field for v in field_violations(e)]


class Watch:
    """A WatchClusters stream read by a background task into a queue."""

    def __init__(self, stub: pb_grpc.ClusterManagerServiceStub, token: str = "",
                 filter: str = "") -> None:
        self.call = stub.WatchClusters(pb.WatchClustersRequest(resume_token=token, filter=filter))
        self.q: asyncio.Queue[pb.WatchClustersResponse | BaseException] = asyncio.Queue()
        self.task = asyncio.ensure_future(self._pump())

    async def _pump(self) -> None:
        try:
            async for ev in self.call:
                await self.q.put(ev)
            await self.q.put(EOFError("stream ended"))
        except BaseException as e:  # noqa: BLE001 - handed to the reader
            await self.q.put(e)

    async def next(self, within: float = WAIT) -> pb.WatchClustersResponse:
        item = await asyncio.wait_for(self.q.get(), within)
        if isinstance(item, BaseException):
            raise item
        return item

    async def until(self, pred: object, within: float = WAIT) -> list[pb.WatchClustersResponse]:
        """Events up to and including the first one for which pred(ev) holds."""
        seen = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while True:
            ev = await self.next(max(0.01, deadline - loop.time()))
            seen.append(ev)
            if pred(ev):  # type: ignore[operator]
                return seen

    async def snapshot(self) -> list[pb.WatchClustersResponse]:
        return await self.until(lambda e: e.type == job_pb2.WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE)

    def drain(self) -> list[pb.WatchClustersResponse]:
        out = []
        while not self.q.empty():
            item = self.q.get_nowait()
            if isinstance(item, BaseException):
                raise item
            out.append(item)
        return out

    async def close(self) -> None:
        self.call.cancel()
        self.task.cancel()
        try:
            await self.task
        except asyncio.CancelledError:
            pass


async def wait_state(stub: pb_grpc.ClusterManagerServiceStub, name: str, state: int,
                     within: float = WAIT) -> cluster_pb2.Cluster:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        c = (await stub.GetCluster(pb.GetClusterRequest(name=name))).cluster
        if c.state == state:
            return c
        if loop.time() > deadline:
            raise AssertionError(f"{name} stayed {cluster_pb2.ClusterState.Name(c.state)}: "
                                 f"{c.state_message}")
        await asyncio.sleep(0.1)


# --- service basics ---------------------------------------------------------


async def test_health_serving_and_reflection_lists_service(cm: ServiceProcess) -> None:
    async with security.channel(cm.address) as ch:
        h = health_pb2_grpc.HealthStub(ch)
        for svc in ("", "dlsched.v1.ClusterManagerService"):
            resp = await h.Check(health_pb2.HealthCheckRequest(service=svc))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        r = reflection_pb2_grpc.ServerReflectionStub(ch)
        call = r.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        async for resp in call:
            names = {s.name for s in resp.list_services_response.service}
            break
        assert "dlsched.v1.ClusterManagerService" in names


async def test_reflection_v1_beside_v1alpha(cm: ServiceProcess) -> None:
    """grpcurl and other current tools ask grpc.reflection.v1 first; v1 lists, and describes
    the services and itself, without a token (like health)."""
    from google.protobuf import descriptor_pb2

    async with security.user_channel(cm.address, token=None) as ch:
        v1 = ch.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                              request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                              response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        R = reflection_pb2.ServerReflectionRequest
        call = v1(iter([R(list_services=""), R(file_containing_symbol="dlsched.v1.ClusterManagerService"),
                        R(file_containing_symbol="grpc.reflection.v1.ServerReflection")]))
        got = [resp async for resp in call]
    names = {s.name for s in got[0].list_services_response.service}
    assert {"dlsched.v1.ClusterManagerService", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection", "grpc.health.v1.Health"} <= names
    files = []
    for resp in got[1:]:
        assert not resp.HasField("error_response"), resp.error_response
        files.append([descriptor_pb2.FileDescriptorProto.FromString(b).name
                      for b in resp.file_descriptor_response.file_descriptor_proto])
    assert "dlsched/v1/cluster_manager_service.proto" in files[0]
    assert files[1][0] == "grpc/reflection/v1/reflection.proto"


# --- registry ---------------------------------------------------------------


async def test_create_get_list_delete(stub: pb_grpc.ClusterManagerServiceStub) -> None:
    made = await create(stub, "alpha", local_cluster(dead_address(), team="ml"))
    assert made.name == "clusters/alpha"
    assert made.uid and made.etag
    assert made.type == job_pb2.CLUSTER_TYPE_LOCAL
    assert made.state in (cluster_pb2.CLUSTER_STATE_PENDING,
                          cluster_pb2.CLUSTER_STATE_DRIVER_UNAVAILABLE)
    assert made.create_time.seconds > 0
    assert not made.has_credentials

    got = (await stub.GetCluster(pb.GetClusterRequest(name="clusters/alpha"))).cluster
    assert got.uid == made.uid and dict(got.labels) == {"team": "ml"}

    e = await rpc_error(stub.GetCluster(pb.GetClusterRequest(name="clusters/nope")))
    assert e.code() == grpc.StatusCode.NOT_FOUND and reason(e) == "CLUSTER_NOT_FOUND"
    # The resource's name under "name", as JOB_NOT_FOUND has it ("cluster" kept for older clients).
    assert dict(error_info(e).metadata) == {"name": "clusters/nope", "cluster": "clusters/nope"}
    e = await rpc_error(stub.GetCluster(pb.GetClusterRequest(name="alpha")))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and fields(e) == ["name"]

    e = await rpc_error(create(stub, "alpha", local_cluster(dead_address())))
    assert e.code() == grpc.StatusCode.ALREADY_EXISTS and reason(e) == "CLUSTER_ALREADY_EXISTS"

    listed = (await stub.ListClusters(pb.ListClustersRequest())).clusters
    assert [c.name for c in listed] == ["clusters/alpha"]

    # An etag on delete (AIP-154): a stale one deletes nothing, a garbage one names its field.
    upd = (await stub.UpdateCluster(pb.UpdateClusterRequest(
        cluster=cluster_pb2.Cluster(name="clusters/alpha", labels={"team": "ml2"}),
        update_mask=field_mask_pb2.FieldMask(paths=["labels"])))).cluster
    e = await rpc_error(stub.DeleteCluster(pb.DeleteClusterRequest(name="clusters/alpha", etag=made.etag)))
    assert e.code() == grpc.StatusCode.ABORTED and error_info(e).reason == "ETAG_MISMATCH"
    meta = dict(error_info(e).metadata)  # which cluster, and its etag now (as a job's mismatch says)
    assert meta["name"] == "clusters/alpha" and int(meta["etag"]) > int(made.etag), meta
    e = await rpc_error(stub.DeleteCluster(pb.DeleteClusterRequest(name="clusters/alpha", etag="x1")))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and fields(e) == ["etag"]
    # One past the cluster's every write was never returned: INVALID_ARGUMENT, not a retry.
    e = await rpc_error(stub.DeleteCluster(pb.DeleteClusterRequest(name="clusters/alpha", etag="999999999999")))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and fields(e) == ["etag"]
    e = await rpc_error(stub.UpdateCluster(pb.UpdateClusterRequest(
        cluster=cluster_pb2.Cluster(name="clusters/alpha", labels={"team": "ml3"}, etag="999999999999"),
        update_mask=field_mask_pb2.FieldMask(paths=["labels"]))))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and fields(e) == ["cluster.etag"]
    assert (await stub.GetCluster(pb.GetClusterRequest(name="clusters/alpha"))).cluster.uid == upd.uid
    for _ in range(20):  # the health checker writes the cluster's state too: re-read and retry
        current = (await stub.GetCluster(pb.GetClusterRequest(name="clusters/alpha"))).cluster
        try:
            deleted = (await stub.DeleteCluster(pb.DeleteClusterRequest(
                name="clusters/alpha", etag=current.etag))).cluster
            break
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.ABORTED, err
    else:
        raise AssertionError("DeleteCluster with the current etag kept being ABORTED")
    assert deleted.uid == made.uid
    e = await rpc_error(stub.GetCluster(pb.GetClusterRequest(name="clusters/alpha")))
    assert reason(e) == "CLUSTER_NOT_FOUND"
    e = await rpc_error(stub.DeleteCluster(pb.DeleteClusterRequest(name="clusters/alpha")))
    assert e.code() == grpc.StatusCode.NOT_FOUND and reason(e) == "CLUSTER_NOT_FOUND"
    resp = await stub.DeleteCluster(pb.DeleteClusterRequest(name="clusters/alpha",
                                                            allow_missing=True))
    assert not resp.HasField("cluster")
    assert not (await stub.ListClusters(pb.ListClustersRequest())).clusters


async def test_list_pages_by_name_and_filters(stub: pb_grpc.ClusterManagerServiceStub) -> None:
    drv = dead_address()
    ids = [f"c{i:02d}" for i in range(7)]
    for i, cid in enumerate(reversed(ids)):
        c = slurm_cluster(drv, team="ml") if i % 2 else local_cluster(drv, team="web")
        await create(stub, cid, c)

    names: list[str] = []
    token = ""
    pages = 0
    while True:
        resp = await stub.ListClusters(pb.ListClustersRequest(page_size=3, page_token=token))
        names += [c.name for c in resp.clusters]
        pages += 1
        token = resp.next_page_token
        if not token:
            break
    assert names == [f"clusters/{cid}" for cid in ids]
    assert pages == 3

    all_resp = await stub.ListClusters(pb.ListClustersRequest())
    slurm = {c.name for c in all_resp.clusters if c.type == job_pb2.CLUSTER_TYPE_SLURM}
    assert slurm and len(slurm) < len(ids)
    for f in ("type=SLURM", "type=CLUSTER_TYPE_SLURM", "type = slurm AND labels.team=ml",
              'labels.team="ml"'):
        got = {c.name for c in (await stub.ListClusters(pb.ListClustersRequest(filter=f))).clusters}
        assert got == slurm, f
    got = {c.name for c in (await stub.ListClusters(
        pb.ListClustersRequest(filter="type!=SLURM"))).clusters}
    assert got == {f"clusters/{cid}" for cid in ids} - slurm
    got = (await stub.ListClusters(pb.ListClustersRequest(filter="state=READY"))).clusters
    assert not got
    got = (await stub.ListClusters(pb.ListClustersRequest(
        filter="type=SLURM AND labels.team=web"))).clusters
    assert not got

    for bad in ("type=BOGUS", "colour=red", "type", "type=SLURM OR state=READY",
                "labels.=x"):
        e = await rpc_error(stub.ListClusters(pb.ListClustersRequest(filter=bad)))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
        assert fields(e) == ["filter"], bad
    e = await rpc_error(stub.ListClusters(pb.ListClustersRequest(page_token="garbage!")))
    assert fields(e) == ["page_token"]
    e = await rpc_error(stub.ListClusters(pb.ListClustersRequest(page_size=-1)))
    assert fields(e) == ["page_size"]


async def test_an_error_echoing_a_long_input_still_reaches_the_client_as_itself(
        stub: pb_grpc.ClusterManagerServiceStub) -> None:
    """Errors quote what the client sent; a status travels in trailers that gRPC clients cap
    at 16 KiB, so a long quoted filter (or a thousand violations) came back as the client's
    own RESOURCE_EXHAUSTED ("metadata size exceeds hard limit"), naming no field."""
    for flt in ("colour=" + "x" * 7000, "type=" + "\x01" * 3000, "x" * 7000,
                "labels.a=b AND " * 400 + "nope"):
        e = await rpc_error(stub.ListClusters(pb.ListClustersRequest(filter=flt)))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and fields(e) == ["filter"], e.details()
        assert len((e.details() or "").encode()) <= 512
    huge = cluster_pb2.Cluster(type=job_pb2.CLUSTER_TYPE_LOCAL, driver_address="127.0.0.1:1",
                               labels={f"bad key {i}!" + "k" * 60: "v" for i in range(1000)})
    e = await rpc_error(create(stub, "many-bad", huge))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    vs = field_violations(e)
    assert 1 < len(vs) <= 11 and vs[-1].description.endswith("more"), vs[-1]


async def test_update_applies_masked_fields_and_checks_etag(
        stub: pb_grpc.ClusterManagerServiceStub) -> None:
    drv = dead_address()
    made = await create(stub, "upd", local_cluster(drv, team="ml"))
    made = (await stub.GetCluster(pb.GetClusterRequest(name="clusters/upd"))).cluster

    # Only masked fields change: labels changes, driver_address in the body is ignored.
    body = cluster_pb2.Cluster(name="clusters/upd", labels={"team": "web"},
                               driver_address="10.0.0.1:1")
    resp = await stub.UpdateCluster(pb.UpdateClusterRequest(
        cluster=body, update_mask=field_mask_pb2.FieldMask(paths=["labels"])))
    upd = resp.cluster
    assert dict(upd.labels) == {"team": "web"}
    assert upd.driver_address == drv
    assert upd.etag != made.etag
    assert upd.uid == made.uid

    # A stale etag is refused; the current one works.
    e = await rpc_error(stub.UpdateCluster(pb.UpdateClusterRequest(
        cluster=body, update_mask=field_mask_pb2.FieldMask(paths=["labels"]), etag=made.etag)))
    assert e.code() == grpc.StatusCode.ABORTED
    body2 = cluster_pb2.Cluster(name="clusters/upd", options={"partition": "gpu"})
    for _ in range(20):  # the health checker writes the cluster's state too: re-read and retry
        current = (await stub.GetCluster(pb.GetClusterRequest(name="clusters/upd"))).cluster
        try:
            resp = await stub.UpdateCluster(pb.UpdateClusterRequest(
                cluster=body2, update_mask=field_mask_pb2.FieldMask(paths=["options"]),
                etag=current.etag))
            break
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.ABORTED, err
    else:
        raise AssertionError("UpdateCluster with the current etag kept being ABORTED")
    assert dict(resp.cluster.options) == {"partition": "gpu"}
    assert dict(resp.cluster.labels) == {"team": "web"}

    # The resource's own etag (AIP-154) is a precondition too; a garbage one is the
    # caller's error, naming its field; both set must agree.
    e = await rpc_error(stub.UpdateCluster(pb.UpdateClusterRequest(
        cluster=cluster_pb2.Cluster(name="clusters/upd", labels={"x": "y"}, etag=made.etag),
        update_mask=field_mask_pb2.FieldMask(paths=["labels"]))))
    assert e.code() == grpc.StatusCode.ABORTED
    for req, field in ((pb.UpdateClusterRequest(etag="nope"), "etag"),
                       (pb.UpdateClusterRequest(cluster=cluster_pb2.Cluster(etag="00")), "cluster.etag"),
                       (pb.UpdateClusterRequest(etag="5", cluster=cluster_pb2.Cluster(etag="6")), "etag")):
        req.cluster.name = "clusters/upd"
        req.cluster.labels["x"] = "y"
        req.update_mask.paths.append("labels")
        e = await rpc_error(stub.UpdateCluster(req))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and fields(e) == [field], req
    assert dict((await stub.GetCluster(pb.GetClusterRequest(name="clusters/upd"))).cluster.labels) \
        == {"team": "web"}

    # update_mask is required and limited ('*' alone); type is immutable.
    for paths in ([], ["type"], ["state"], ["name"], ["*", "labels"]):
        e = await rpc_error(stub.UpdateCluster(pb.UpdateClusterRequest(
            cluster=body, update_mask=field_mask_pb2.FieldMask(paths=paths))))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and fields(e) == ["update_mask"], paths
    e = await rpc_error(stub.UpdateCluster(pb.UpdateClusterRequest(
        cluster=cluster_pb2.Cluster(name="clusters/upd", type=job_pb2.CLUSTER_TYPE_SLURM,
                                    labels={"a": "b"}),
        update_mask=field_mask_pb2.FieldMask(paths=["labels"]))))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and fields(e) == ["cluster.type"]
    # '*' replaces every updatable field: labels and options not sent are cleared.
    for _ in range(20):
        current = (await stub.GetCluster(pb.GetClusterRequest(name="clusters/upd"))).cluster
        try:
            full = cluster_pb2.Cluster(name="clusters/upd", address=current.address,
                                       driver_address=current.driver_address, labels={"whole": "1"})
            resp = await stub.UpdateCluster(pb.UpdateClusterRequest(
                cluster=full, update_mask=field_mask_pb2.FieldMask(paths=["*"]), etag=current.etag))
            break
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.ABORTED, err
    else:
        raise AssertionError("UpdateCluster with the current etag kept being ABORTED")
    assert dict(resp.cluster.labels) == {"whole": "1"} and not resp.cluster.options
    assert resp.cluster.driver_address == current.driver_address
    # Masked fields are validated.
    e = await rpc_error(stub.UpdateCluster(pb.UpdateClusterRequest(
        cluster=cluster_pb2.Cluster(name="clusters/upd", driver_address="nope"),
        update_mask=field_mask_pb2.FieldMask(paths=["driver_address"]))))
    assert fields(e) == ["cluster.driver_address"]
    e = await rpc_error(stub.UpdateCluster(pb.UpdateClusterRequest(
        cluster=cluster_pb2.Cluster(name="clusters/ghost", labels={"a": "b"}),
        update_mask=field_mask_pb2.FieldMask(paths=["labels"]))))
    assert e.code() == grpc.StatusCode.NOT_FOUND and reason(e) == "CLUSTER_NOT_FOUND"


async def test_a_quiet_cluster_watch_gets_heartbeats_with_its_resume_token(
        etcd: EtcdServer, etcd_prefix: str) -> None:
    """WatchClusters sends a HEARTBEAT (no cluster, the current resume token) when it has sent
    nothing for --stream-heartbeat-seconds, as WatchJobs does (it sent nothing at all: a
    proxy closing idle streams cut a quiet watch). Resuming with that token repeats nothing."""
    proc = start_cm(etcd, etcd_prefix, "--stream-heartbeat-seconds", "0.3")
    try:
        async with security.channel(proc.address) as ch:
            stub = pb_grpc.ClusterManagerServiceStub(ch)
            await create(stub, "beat", local_cluster(dead_address()))
            w = Watch(stub)
            await w.snapshot()
            beat = await w.until(lambda e: e.type == job_pb2.WATCH_EVENT_TYPE_HEARTBEAT)
            assert not beat[-1].HasField("cluster") and beat[-1].resume_token
            await w.close()
            again = Watch(stub, token=beat[-1].resume_token)
            first = await again.next()
            assert first.type in (job_pb2.WATCH_EVENT_TYPE_HEARTBEAT, job_pb2.WATCH_EVENT_TYPE_UPDATED), first
            await again.close()
    finally:
        proc.stop()


async def test_a_filtered_cluster_watch_gets_heartbeats_while_clusters_it_drops_change(
        etcd: EtcdServer, etcd_prefix: str) -> None:
    """A change the stream's filter drops sends nothing, so it must not put the heartbeat off:
    with another cluster changing more often than every heartbeat period, a watcher of
    type=SLURM heard nothing at all (a proxy closing idle streams cut it)."""
    proc = start_cm(etcd, etcd_prefix, "--stream-heartbeat-seconds", "1")
    try:
        async with security.channel(proc.address) as ch:
            stub = pb_grpc.ClusterManagerServiceStub(ch)
            await create(stub, "noisy", local_cluster(dead_address()))
            w = Watch(stub, filter="type=SLURM")
            await w.snapshot()
            stop = asyncio.Event()

            async def churn() -> int:  # a change every ~0.1 s, none the watcher sees
                n = 0
                while not stop.is_set():
                    await stub.UpdateCluster(pb.UpdateClusterRequest(
                        cluster=cluster_pb2.Cluster(name="clusters/noisy", labels={"n": str(n)}),
                        update_mask=field_mask_pb2.FieldMask(paths=["labels"])))
                    n += 1
                    await asyncio.sleep(0.1)
                return n

            churning = asyncio.create_task(churn())
            try:
                beat = await w.until(lambda e: e.type == job_pb2.WATCH_EVENT_TYPE_HEARTBEAT)
            finally:
                stop.set()
                changed = await churning
                await w.close()
            assert [e.type for e in beat] == [job_pb2.WATCH_EVENT_TYPE_HEARTBEAT]  # nothing of noisy's
            assert changed >= 2
    finally:
        proc.stop()


async def test_create_with_request_id_is_idempotent(
        stub: pb_grpc.ClusterManagerServiceStub) -> None:
    drv = dead_address()
    first = await create(stub, "idem", local_cluster(drv), request_id="req-1")
    again = await create(stub, "idem", local_cluster(drv), request_id="req-1")
    assert again.uid == first.uid

    # Without the request id, or with another one, it is a conflict.
    e = await rpc_error(create(stub, "idem", local_cluster(drv)))
    assert reason(e) == "CLUSTER_ALREADY_EXISTS"
    e = await rpc_error(create(stub, "idem", local_cluster(drv), request_id="req-2"))
    assert reason(e) == "CLUSTER_ALREADY_EXISTS"
    # The same request id for another cluster is a client bug.
    e = await rpc_error(create(stub, "other", local_cluster(drv), request_id="req-1"))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and fields(e) == ["request_id"]

    # Once its cluster is deleted the request id is free (as SubmitJob's after a DeleteJob): it
    # was NOT_FOUND for ever ("made by this request, was deleted").
    await stub.DeleteCluster(pb.DeleteClusterRequest(name="clusters/idem"))
    remade = await create(stub, "idem", local_cluster(drv), request_id="req-1")
    assert remade.uid != first.uid
    await stub.DeleteCluster(pb.DeleteClusterRequest(name="clusters/idem"))
    # retries racing to release it: one makes the cluster, every one answers it (a release
    # compared on the key's value deleted the key a twin had just written: ALREADY_EXISTS)
    twins = await asyncio.gather(*(create(stub, "idem", local_cluster(drv), request_id="req-1") for _ in range(8)))
    assert len({t.uid for t in twins}) == 1 and twins[0].uid != remade.uid
    await stub.DeleteCluster(pb.DeleteClusterRequest(name="clusters/idem"))
    other = await create(stub, "other", local_cluster(drv), request_id="req-1")
    assert other.name == "clusters/other"
    await stub.DeleteCluster(pb.DeleteClusterRequest(name="clusters/other"))

    # Concurrent twins: all succeed with the one cluster.
    results = await asyncio.gather(*(
        create(stub, "twin", local_cluster(drv), request_id="req-twin") for _ in range(8)))
    assert len({r.uid for r in results}) == 1
    listed = (await stub.ListClusters(pb.ListClustersRequest())).clusters
    assert sorted(c.name for c in listed) == ["clusters/twin"]

    # Concurrent creates of one id without request ids: exactly one wins.
    outcomes = await asyncio.gather(
        *(create(stub, "race", local_cluster(drv)) for _ in range(6)), return_exceptions=True)
    wins = [o for o in outcomes if isinstance(o, cluster_pb2.Cluster)]
    losses = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    assert len(wins) == 1 and len(losses) == 5
    assert all(reason(e) == "CLUSTER_ALREADY_EXISTS" for e in losses)


BAD_CREATES = [
    ("Bad_Id", local_cluster("127.0.0.1:1"), "cluster_id"),
    ("", local_cluster("127.0.0.1:1"), "cluster_id"),
    ("x" * 64, local_cluster("127.0.0.1:1"), "cluster_id"),
    ("1abc", local_cluster("127.0.0.1:1"), "cluster_id"),
    ("ok", cluster_pb2.Cluster(driver_address="127.0.0.1:1"), "cluster.type"),
    ("ok", cluster_pb2.Cluster(type=job_pb2.CLUSTER_TYPE_LOCAL), "cluster.driver_address"),
    # whole values: whitespace around them was stripped, and the cluster made
    ("ok", local_cluster("127.0.0.1:1\n"), "cluster.driver_address"),
    ("ok", cluster_pb2.Cluster(type=job_pb2.CLUSTER_TYPE_SLURM, driver_address="127.0.0.1:1",
                               address=" login:22 "), "cluster.address"),
    ("ok", local_cluster("no-port"), "cluster.driver_address"),
    ("ok", local_cluster("host:99999"), "cluster.driver_address"),
    ("ok", cluster_pb2.Cluster(type=job_pb2.CLUSTER_TYPE_SLURM, driver_address="127.0.0.1:1"),
     "cluster.address"),
    ("ok", cluster_pb2.Cluster(type=job_pb2.CLUSTER_TYPE_SLURM, driver_address="127.0.0.1:1",
                               address="login; rm -rf /"), "cluster.address"),
    ("ok", cluster_pb2.Cluster(type=job_pb2.CLUSTER_TYPE_SLURM, driver_address="127.0.0.1:1",
                               address="login host"), "cluster.address"),
    ("ok", cluster_pb2.Cluster(type=job_pb2.CLUSTER_TYPE_SLURM, driver_address="127.0.0.1:1",
                               address="$(whoami):22"), "cluster.address"),
    ("ok", cluster_pb2.Cluster(type=job_pb2.CLUSTER_TYPE_KUBERNETES,
                               driver_address="127.0.0.1:1", address="k8s.local:6443"),
     "cluster.address"),
    ("ok", cluster_pb2.Cluster(type=job_pb2.CLUSTER_TYPE_RAY, driver_address="127.0.0.1:1",
                               address="ftp://ray:8265"), "cluster.address"),
    # A password in the address would reach every reader of the cluster (credentials
    # are write-only); a user alone too.
    ("ok", cluster_pb2.Cluster(type=job_pb2.CLUSTER_TYPE_RAY, driver_address="127.0.0.1:1",
                               address="https://dlsched:s3cret@ray:8265"), "cluster.address"),
    ("ok", cluster_pb2.Cluster(type=job_pb2.CLUSTER_TYPE_KUBERNETES, driver_address="127.0.0.1:1",
                               address="https://admin@k8s.local:6443"), "cluster.address"),
    # map entries named by their key, as JobManager names spec.labels['k'] and env['K']
    ("ok", local_cluster("127.0.0.1:1", **{"bad key!": "v"}), "cluster.labels['bad key!']"),
    ("ok", local_cluster("127.0.0.1:1", team="v" * 64), "cluster.labels['team']"),
    ("ok", cluster_pb2.Cluster(type=job_pb2.CLUSTER_TYPE_LOCAL, driver_address="127.0.0.1:1",
                               options={"bad key": "v"}), "cluster.options['bad key']"),
    ("ok", cluster_pb2.Cluster(
        type=job_pb2.CLUSTER_TYPE_LOCAL, driver_address="127.0.0.1:1",
        credentials=cluster_pb2.ClusterCredentials(token=cluster_pb2.TokenCredentials(token="t"))),
     "cluster.credentials"),
    ("ok", cluster_pb2.Cluster(
        type=job_pb2.CLUSTER_TYPE_RAY, driver_address="127.0.0.1:1", address="http://ray:8265",
        credentials=cluster_pb2.ClusterCredentials(
            ssh=cluster_pb2.SshCredentials(username="u", private_key=SSH_KEY))),
     "cluster.credentials"),
    ("ok", cluster_pb2.Cluster(
        type=job_pb2.CLUSTER_TYPE_SLURM, driver_address="127.0.0.1:1", address="login",
        credentials=cluster_pb2.ClusterCredentials(
            kubernetes=cluster_pb2.KubernetesCredentials(token="t"))),
     "cluster.credentials"),
]


async def test_invalid_creates_name_the_field(stub: pb_grpc.ClusterManagerServiceStub) -> None:
    for cid, c, field in BAD_CREATES:
        e = await rpc_error(create(stub, cid, c))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (cid, field)
        assert field in fields(e), (cid, field, fields(e))
        assert SSH_KEY_MARKER not in (e.details() or "")
    e = await rpc_error(create(stub, "ok", local_cluster("127.0.0.1:1"), request_id="has space"))
    assert fields(e) == ["request_id"]
    # Nothing was stored.
    assert not (await stub.ListClusters(pb.ListClustersRequest())).clusters
    # Good addresses of each type pass.
    for cid, c in [
        ("s1", cluster_pb2.Cluster(type=job_pb2.CLUSTER_TYPE_SLURM, driver_address="127.0.0.1:1",
                                   address="login-1.example.org")),
        ("k1", cluster_pb2.Cluster(type=job_pb2.CLUSTER_TYPE_KUBERNETES,
                                   driver_address="localhost:1", address="https://k8s:6443")),
        ("r1", cluster_pb2.Cluster(type=job_pb2.CLUSTER_TYPE_RAY, driver_address="127.0.0.1:1",
                                   address="http://ray-head:8265")),
    ]:
        await create(stub, cid, c)


# --- credentials ------------------------------------------------------------


async def test_credentials_are_stored_but_never_returned_or_logged(
        etcd: EtcdServer, etcd_prefix: str, cm: ServiceProcess,
        stub: pb_grpc.ClusterManagerServiceStub) -> None:
    w = Watch(stub)
    await w.snapshot()
    drv = dead_address()
    made = await create(stub, "slurm-a", slurm_cluster(drv, team="ml"), request_id="cred-1")
    await create(stub, "slurm-a", slurm_cluster(drv, team="ml"), request_id="cred-1")
    ray = cluster_pb2.Cluster(
        type=job_pb2.CLUSTER_TYPE_RAY, address="http://ray:8265", driver_address=drv,
        credentials=cluster_pb2.ClusterCredentials(token=cluster_pb2.TokenCredentials(
            token=RAY_TOKEN)))
    await create(stub, "ray-a", ray)
    assert made.has_credentials and not made.HasField("credentials")

    # Rotate the token through UpdateCluster.
    new_tok = RAY_TOKEN[::-1]
    upd = await stub.UpdateCluster(pb.UpdateClusterRequest(
        cluster=cluster_pb2.Cluster(name="clusters/ray-a", credentials=cluster_pb2.ClusterCredentials(
            token=cluster_pb2.TokenCredentials(token=new_tok))),
        update_mask=field_mask_pb2.FieldMask(paths=["credentials"])))
    assert upd.cluster.has_credentials

    # A failed request carrying credentials must not echo them either.
    e = await rpc_error(create(stub, "Bad", slurm_cluster(drv)))
    assert SSH_KEY_MARKER not in (e.details() or "")

    await wait_state(stub, "clusters/slurm-a", cluster_pb2.CLUSTER_STATE_DRIVER_UNAVAILABLE)
    responses: list[bytes] = []
    for name in ("clusters/slurm-a", "clusters/ray-a"):
        got = (await stub.GetCluster(pb.GetClusterRequest(name=name))).cluster
        assert got.has_credentials and not got.HasField("credentials")
        responses.append(got.SerializeToString())
    responses.append((await stub.ListClusters(pb.ListClustersRequest())).SerializeToString())
    responses.append(upd.SerializeToString())
    await asyncio.sleep(0.5)
    for ev in w.drain():
        assert not ev.cluster.HasField("credentials")
        responses.append(ev.SerializeToString())
    await w.close()
    w2 = Watch(stub)
    responses += [ev.SerializeToString() for ev in await w2.snapshot()]
    await w2.close()
    deleted = await stub.DeleteCluster(pb.DeleteClusterRequest(name="clusters/slurm-a"))
    responses.append(deleted.SerializeToString())
    for blob in responses:
        for secret in (SSH_KEY_MARKER, RAY_TOKEN, new_tok):
            assert secret.encode() not in blob

    # They are in etcd, under the credentials key only.
    client = aetcd.Client(host="127.0.0.1", port=etcd.client_port)
    try:
        kv = await client.get(f"{etcd_prefix}cluster-credentials/ray-a".encode())
        assert kv is not None
        assert new_tok.encode() not in kv.value  # encrypted at rest (test_credentials_at_rest.py)
        keyring = Keyring.load(os.environ["DLSCHED_ENCRYPTION_KEY_FILE"])
        creds = cluster_pb2.ClusterCredentials.FromString(keyring.decrypt(kv.value, "ray-a"))
        assert creds.token.token == new_tok
        records = list(await client.get_prefix(f"{etcd_prefix}clusters/".encode()))
        assert [r.key for r in records] == [f"{etcd_prefix}clusters/ray-a".encode()]
        for rec in records:
            for secret in (SSH_KEY_MARKER, RAY_TOKEN, new_tok):
                assert secret.encode() not in rec.value
        # Deleting the cluster deleted its credentials.
        assert await client.get(f"{etcd_prefix}cluster-credentials/slurm-a".encode()) is None
    finally:
        await client.close()

    log = cm.log()
    assert "DEBUG" in log or "INFO" in log
    for secret in (SSH_KEY_MARKER, RAY_TOKEN, new_tok, "PRIVATE KEY"):
        assert secret not in log, f"{secret[:12]}... leaked into the log"


# --- watch ------------------------------------------------------------------


async def test_watch_snapshot_then_changes_and_dead_driver_state(
        stub: pb_grpc.ClusterManagerServiceStub) -> None:
    await create(stub, "pre", local_cluster(dead_address()))
    await wait_state(stub, "clusters/pre", cluster_pb2.CLUSTER_STATE_DRIVER_UNAVAILABLE)
    w = Watch(stub)
    snap = await w.snapshot()
    assert [e.type for e in snap] == [job_pb2.WATCH_EVENT_TYPE_EXISTING,
                                      job_pb2.WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE]
    assert snap[0].cluster.name == "clusters/pre" and all(e.resume_token for e in snap)

    await create(stub, "dead", local_cluster(dead_address()))
    ev = await w.next()
    assert ev.type == job_pb2.WATCH_EVENT_TYPE_CREATED and ev.cluster.name == "clusters/dead"
    assert ev.cluster.state == cluster_pb2.CLUSTER_STATE_PENDING
    evs = await w.until(lambda e: e.cluster.state == cluster_pb2.CLUSTER_STATE_DRIVER_UNAVAILABLE)
    assert evs[-1].type == job_pb2.WATCH_EVENT_TYPE_UPDATED
    assert evs[-1].cluster.name == "clusters/dead"
    assert evs[-1].cluster.state_message
    # The driver never answered, so there is no heartbeat.
    assert not evs[-1].cluster.HasField("last_heartbeat_time")

    # A steady dead driver does not make an event per poll (interval 0.3 s).
    await asyncio.sleep(1.5)
    assert not [e for e in w.drain() if e.cluster.name == "clusters/dead"]

    await stub.DeleteCluster(pb.DeleteClusterRequest(name="clusters/dead"))
    ev = await w.until(lambda e: e.type == job_pb2.WATCH_EVENT_TYPE_DELETED)
    assert ev[-1].cluster.name == "clusters/dead"
    assert ev[-1].cluster.state == cluster_pb2.CLUSTER_STATE_DRIVER_UNAVAILABLE
    await w.close()

    # A filtered watch sees only its clusters.
    wf = Watch(stub, filter="labels.team=ml")
    snap = await wf.snapshot()
    assert len(snap) == 1
    await create(stub, "other", local_cluster(dead_address(), team="web"))
    await create(stub, "mine", local_cluster(dead_address(), team="ml"))
    ev = await wf.next()
    assert ev.type == job_pb2.WATCH_EVENT_TYPE_CREATED and ev.cluster.name == "clusters/mine"
    await wf.close()

    e = await rpc_error(Watch(stub, filter="type=NOPE").next())
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and fields(e) == ["filter"]


async def test_watch_resume_has_no_gaps_and_no_duplicates(
        stub: pb_grpc.ClusterManagerServiceStub) -> None:
    drv = dead_address()
    # Slow heartbeats are irrelevant here: label changes are the events.
    w = Watch(stub)
    await w.snapshot()
    await create(stub, "res", local_cluster(drv, n="0"))
    await w.until(lambda e: e.type == job_pb2.WATCH_EVENT_TYPE_CREATED)

    async def relabel(i: int) -> None:
        await stub.UpdateCluster(pb.UpdateClusterRequest(
            cluster=cluster_pb2.Cluster(name="clusters/res", labels={"n": str(i)}),
            update_mask=field_mask_pb2.FieldMask(paths=["labels"])))

    for i in range(1, 4):
        await relabel(i)
    got = await w.until(lambda e: e.cluster.labels.get("n") == "3")
    token = got[-1].resume_token
    await w.close()

    # Changes while disconnected.
    for i in range(4, 8):
        await relabel(i)
    w2 = Watch(stub, token=token)
    evs = await w2.until(lambda e: e.cluster.labels.get("n") == "7")
    label_seq = [e.cluster.labels["n"] for e in evs
                 if e.type == job_pb2.WATCH_EVENT_TYPE_UPDATED and "n" in e.cluster.labels]
    # Every label value 4..7 exactly once, in order. State updates may interleave,
    # even before relabel(4): the health checker's, late on a busy host (label 3).
    deduped = [v for i, v in enumerate(label_seq) if i == 0 or label_seq[i - 1] != v]
    assert deduped in (["4", "5", "6", "7"], ["3", "4", "5", "6", "7"]), label_seq
    assert all(e.type != job_pb2.WATCH_EVENT_TYPE_EXISTING for e in evs)
    tokens = [e.resume_token for e in evs]
    assert len(set(tokens)) == len(tokens)
    await w2.close()

    # Resuming from the last token sees only what comes next.
    w3 = Watch(stub, token=evs[-1].resume_token)
    await relabel(8)
    ev = await w3.until(lambda e: e.cluster.labels.get("n") == "8")
    assert all(e.cluster.labels.get("n") in ("7", "8") for e in ev)
    assert ev[0].cluster.labels.get("n") != "7" or ev[0].cluster.state != evs[-1].cluster.state
    await w3.close()

    # A garbage token is a bad argument.
    e = await rpc_error(Watch(stub, token="!!notatoken").next())
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and fields(e) == ["resume_token"]


async def test_watch_token_older_than_buffer_is_expired(
        etcd: EtcdServer, etcd_prefix: str) -> None:
    proc = start_cm(etcd, etcd_prefix, "--watch-buffer", "4")
    try:
        async with security.channel(proc.address) as ch:
            stub = pb_grpc.ClusterManagerServiceStub(ch)
            w = Watch(stub)
            snap = await w.snapshot()
            first = snap[-1].resume_token
            drv = dead_address()
            await create(stub, "exp", local_cluster(drv))
            for i in range(10):
                await stub.UpdateCluster(pb.UpdateClusterRequest(
                    cluster=cluster_pb2.Cluster(name="clusters/exp", labels={"n": str(i)}),
                    update_mask=field_mask_pb2.FieldMask(paths=["labels"])))
            evs = await w.until(lambda e: e.cluster.labels.get("n") == "9")
            await w.close()
            e = await rpc_error(Watch(stub, token=first).next())
            assert e.code() == grpc.StatusCode.OUT_OF_RANGE
            assert reason(e) == "WATCH_TOKEN_EXPIRED"
            e = await rpc_error(Watch(stub, token=evs[0].resume_token).next())
            assert reason(e) == "WATCH_TOKEN_EXPIRED"
            # A recent token still resumes.
            w2 = Watch(stub, token=evs[-2].resume_token)
            ev = await w2.next()
            assert ev.resume_token == evs[-1].resume_token
            await w2.close()
    finally:
        proc.stop()


# --- monitoring and matching with the real local driver ----------------------


def precondition_violations(e: grpc.aio.AioRpcError) -> list[tuple[str, str]]:
    st = rpc_status.from_call(e)
    assert st is not None
    out = []
    for d in st.details:
        if d.Is(error_details_pb2.PreconditionFailure.DESCRIPTOR):
            pf = error_details_pb2.PreconditionFailure()
            d.Unpack(pf)
            out += [(v.subject, v.description) for v in pf.violations]
    return out


def spec(cpu: float = 1, gpus: int = 0, replicas: int = 1,
         mode: int = job_pb2.RUN_MODE_SINGLE_PROCESS, **sel: object) -> job_pb2.JobSpec:
    return job_pb2.JobSpec(
        run_mode=mode,  # type: ignore[arg-type]
        replica_groups=[job_pb2.ReplicaGroup(
            role="main" if mode == job_pb2.RUN_MODE_SINGLE_PROCESS else "worker",
            replicas=replicas, command=["true"],
            resources=job_pb2.Resources(cpu=cpu, memory_bytes=64 * 2**20, gpus=gpus))],
        cluster_selector=job_pb2.ClusterSelector(**sel),  # type: ignore[arg-type]
    )


async def driver_info(driver: ServiceProcess, name: str) -> driver_service_pb2.ClusterInfo:
    async with security.channel(driver.address) as ch:
        s = driver_service_pb2_grpc.DriverServiceStub(ch)
        return (await s.GetClusterInfo(driver_service_pb2.GetClusterInfoRequest(cluster=name))).info


@needs_driver
async def test_local_cluster_becomes_ready_and_is_matched(
        stub: pb_grpc.ClusterManagerServiceStub, local_driver: ServiceProcess) -> None:
    w = Watch(stub)
    await w.snapshot()
    await create(stub, "m-local", local_cluster(local_driver.address, team="ml"))
    await create(stub, "m-dead", local_cluster(dead_address(), team="ml"))
    evs = await w.until(lambda e: e.cluster.name == "clusters/m-local"
                        and e.cluster.state == cluster_pb2.CLUSTER_STATE_READY)
    assert evs[0].type == job_pb2.WATCH_EVENT_TYPE_CREATED
    ready = evs[-1].cluster
    assert evs[-1].type == job_pb2.WATCH_EVENT_TYPE_UPDATED
    assert ready.capacity.cpus_total >= 1 and ready.capacity.max_cpus_per_node >= 1
    assert ready.capacity.memory_bytes_total > 0
    assert ready.HasField("last_heartbeat_time")
    assert set(ready.supported_run_modes) >= {job_pb2.RUN_MODE_SINGLE_PROCESS,
                                              job_pb2.RUN_MODE_MULTI_PROCESS}
    await wait_state(stub, "clusters/m-dead", cluster_pb2.CLUSTER_STATE_DRIVER_UNAVAILABLE)

    # Steady: no event per poll (interval 0.3 s, heartbeat 30 s).
    w.drain()
    await asyncio.sleep(1.5)
    assert not [e for e in w.drain() if e.cluster.name == "clusters/m-local"]
    await w.close()

    resp = await stub.MatchClusters(pb.MatchClustersRequest(spec=spec(cpu=1)))
    cands = resp.candidates
    assert [(c.cluster, c.eligible) for c in cands] == [
        ("clusters/m-local", True), ("clusters/m-dead", False)]
    best = cands[0]
    assert best.score > 0 and best.driver_address == local_driver.address
    assert best.cluster_type == job_pb2.CLUSTER_TYPE_LOCAL
    assert best.reasons and any("READY" in r for r in best.reasons)
    assert any("DRIVER_UNAVAILABLE" in r for r in cands[1].reasons)

    # Selector by name and labels.
    resp = await stub.MatchClusters(pb.MatchClustersRequest(
        spec=spec(cluster="m-local", labels={"team": "ml"})))
    assert [c.cluster for c in resp.candidates] == ["clusters/m-local"]

    # More GPUs than any node has: no cluster can ever run it.
    e = await rpc_error(stub.MatchClusters(pb.MatchClustersRequest(spec=spec(gpus=64))))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert reason(e) == "NO_MATCHING_CLUSTER"
    violations = dict(precondition_violations(e))
    assert set(violations) == {"clusters/m-local", "clusters/m-dead"}
    assert "GPU" in violations["clusters/m-local"]
    # An unsupported run mode is refused too.
    e = await rpc_error(stub.MatchClusters(pb.MatchClustersRequest(
        spec=spec(mode=job_pb2.RUN_MODE_MPI, cluster="clusters/m-local"))))
    assert reason(e) == "NO_MATCHING_CLUSTER"
    # Naming a cluster that does not exist is a bad argument.
    e = await rpc_error(stub.MatchClusters(pb.MatchClustersRequest(spec=spec(cluster="nope"))))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and reason(e) == "UNKNOWN_CLUSTER"
    assert fields(e) == ["spec.cluster_selector.cluster"]
    # A cluster's name or id, whole: whitespace around it was stripped, and the job matched.
    for sel in ("m-local\n", " clusters/m-local", "clusters/m-local\t"):
        e = await rpc_error(stub.MatchClusters(pb.MatchClustersRequest(spec=spec(cluster=sel))))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, sel
        assert fields(e) == ["spec.cluster_selector.cluster"], sel
    e = await rpc_error(stub.MatchClusters(pb.MatchClustersRequest()))
    assert fields(e) == ["spec"]
    e = await rpc_error(stub.MatchClusters(pb.MatchClustersRequest(spec=spec(replicas=0))))
    assert fields(e) == ["spec.replica_groups[0].replicas"]
    # Resources as SubmitJob takes them: a NaN or infinite cpu was eligible, scored NaN.
    for cpu in (float("nan"), float("inf"), -1.0):
        e = await rpc_error(stub.MatchClusters(pb.MatchClustersRequest(spec=spec(cpu=cpu))))
        assert fields(e) == ["spec.replica_groups[0].resources.cpu"], cpu
    # Selector labels as SubmitJob takes them: a hostile one was answered NO_MATCHING_CLUSTER,
    # quoted back in the message.
    for labels in ({"--wrap": "x"}, {"a": "b\nc"}, {"k": "v\x00"}, {"k" * 300: "v"}):
        e = await rpc_error(stub.MatchClusters(pb.MatchClustersRequest(spec=spec(labels=labels))))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, labels
        assert all(f.startswith("spec.cluster_selector.labels") for f in fields(e)), (labels, fields(e))


@needs_driver
async def test_monitor_reconfigures_and_delete_removes_from_driver(
        stub: pb_grpc.ClusterManagerServiceStub, local_driver: ServiceProcess) -> None:
    # A cluster whose driver is not there, then moved to a live driver.
    await create(stub, "moving", local_cluster(dead_address()))
    await wait_state(stub, "clusters/moving", cluster_pb2.CLUSTER_STATE_DRIVER_UNAVAILABLE)
    await stub.UpdateCluster(pb.UpdateClusterRequest(
        cluster=cluster_pb2.Cluster(name="clusters/moving", driver_address=local_driver.address),
        update_mask=field_mask_pb2.FieldMask(paths=["driver_address"])))
    await wait_state(stub, "clusters/moving", cluster_pb2.CLUSTER_STATE_READY)
    assert (await driver_info(local_driver, "clusters/moving")).state == \
        cluster_pb2.CLUSTER_STATE_READY

    # The driver forgets the cluster (as after a restart): it is configured
    # again at once, without the cluster ever leaving READY.
    w = Watch(stub)
    await w.snapshot()
    async with security.channel(local_driver.address) as ch:
        d = driver_service_pb2_grpc.DriverServiceStub(ch)
        await d.RemoveCluster(driver_service_pb2.RemoveClusterRequest(cluster="clusters/moving"))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT
        while True:
            try:
                await d.GetClusterInfo(driver_service_pb2.GetClusterInfoRequest(
                    cluster="clusters/moving"))
                break
            except grpc.aio.AioRpcError as e:
                assert reason(e) == "CLUSTER_NOT_CONFIGURED"
                assert loop.time() < deadline, "not configured again"
                await asyncio.sleep(0.1)
    await wait_state(stub, "clusters/moving", cluster_pb2.CLUSTER_STATE_READY)
    await asyncio.sleep(0.7)
    flaps = [e for e in w.drain() if e.cluster.state != cluster_pb2.CLUSTER_STATE_READY]
    assert not flaps, flaps
    await w.close()

    # Deleting the cluster removes it from its driver.
    await stub.DeleteCluster(pb.DeleteClusterRequest(name="clusters/moving"))
    await asyncio.sleep(1.0)  # several monitor intervals: nothing configures it again
    e = await rpc_error(driver_info(local_driver, "clusters/moving"))
    assert reason(e) == "CLUSTER_NOT_CONFIGURED"


@needs_driver
async def test_a_cluster_registered_with_a_driver_of_another_type_is_not_used(
        stub: pb_grpc.ClusterManagerServiceStub, local_driver: ServiceProcess) -> None:
    """A Slurm cluster whose driver_address is a local driver's: the driver refuses it
    (CLUSTER_TYPE_MISMATCH), so the cluster is UNREACHABLE saying why and no job is matched to
    it. It was READY and Slurm-selected jobs ran as local processes on the driver's host."""
    await create(stub, "typo", slurm_cluster(local_driver.address))
    c = await wait_state(stub, "clusters/typo", cluster_pb2.CLUSTER_STATE_UNREACHABLE)
    assert "CLUSTER_TYPE_MISMATCH" in c.state_message and "local" in c.state_message, c.state_message
    e = await rpc_error(stub.MatchClusters(pb.MatchClustersRequest(spec=spec(cluster="typo"))))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and reason(e) == "NO_MATCHING_CLUSTER"
    # The same driver takes a local cluster.
    await create(stub, "typo-local", local_cluster(local_driver.address))
    await wait_state(stub, "clusters/typo-local", cluster_pb2.CLUSTER_STATE_READY)
