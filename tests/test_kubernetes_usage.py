"""The Kubernetes driver's usage (metrics.k8s.io) and capacity (nodes minus scheduled pods)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

pytest.importorskip("kmock")
pytest.importorskip("kubernetes")

import aiohttp  # noqa: E402 - a kmock dependency

from dlsched.v1 import cluster_pb2, driver_service_pb2_grpc, job_pb2  # noqa: E402
from dlsched.v1 import driver_service_pb2 as dpb  # noqa: E402
from drivers.kubernetes import naming  # noqa: E402
from tests import security  # noqa: E402
from tests.harness import ServiceProcess  # noqa: E402
from tests.kube_emulator import (  # noqa: E402, F401 - the fixtures driver, emu, stub, by their names
    Emulator,
    configure,
    driver_fixture,
    emu_fixture,
    emulator,
    exited,
    foreign_pod,
    group,
    has,
    kubelet,
    launch,
    measure,
    new_id,
    observe,
    pods_of,
    put_node,
    spec,
    stub_fixture,
    wait_for,
)


async def test_capacity_usage_and_mpi(stub: Any, emu: tuple[Emulator, str]) -> None:
    e, url = emu
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-1", "labels": {
        naming.GPU_PRODUCT_LABEL: "H100"}}, "status": {"allocatable": {"cpu": "8", "memory": "32Gi",
                                                                        naming.GPU_RESOURCE: "4"}}}
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

async def test_usage_comes_from_metrics_k8s_io(stub: Any, emu: tuple[Emulator, str]) -> None:
    """Memory as served; CPU seconds integrated from the served rate (cores) over the time each
    sample covers; one usage per process (a container each), indexed as its replica status:
    replica * processes_per_replica + k."""
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
            {"name": f"proc-{i}", "usage": {"cpu": cpu, "memory": mem}} for i, (cpu, mem) in enumerate(usage)]}

    e.pod_metrics = {w0: sample("2026-01-01T00:01:40Z", ("250m", "64Mi"), ("1500000n", "123456Ki")),
                     w1: sample("2026-01-01T00:01:40Z", ("2", "1Gi"), ("0", "0"))}
    try:
        u = await measure(stub, job)
        assert set(u) == {("worker", i) for i in range(4)} and all(r.running for r in u.values())
        assert u["worker", 0].memory_bytes == 64 << 20 == u["worker", 0].peak_memory_bytes
        assert u["worker", 1].memory_bytes == 123456 * 1024
        assert u["worker", 2].memory_bytes == 1 << 30 and u["worker", 3].memory_bytes == 0
        # 0.25, 0.0015, 2 and 0 cores for the 100 s since the pods started
        assert u["worker", 0].cpu_seconds == pytest.approx(25)
        assert u["worker", 1].cpu_seconds == pytest.approx(0.15)
        assert u["worker", 2].cpu_seconds == pytest.approx(200)
        assert (await measure(stub, job)) == u  # the same sample again adds nothing
        # 15 s later worker-0's first process runs at 0.5 cores with less memory, its second has
        # ended; worker-1's pod has ended (no metrics).
        e.pod_metrics = {w0: sample("2026-01-01T00:01:55Z", ("500m", "32Mi"))}
        await kubelet(url, w1, "Succeeded", **exited(0, "Completed"))
        u2 = await measure(stub, job)
        assert u2["worker", 0].cpu_seconds == pytest.approx(25 + 7.5)
        assert u2["worker", 0].memory_bytes == 32 << 20
        assert u2["worker", 0].peak_memory_bytes == 64 << 20
        for i, cpu, peak in ((1, 0.15, 123456 * 1024), (2, 200, 1 << 30)):
            ended = u2["worker", i]
            assert not ended.running and ended.memory_bytes == 0
            assert ended.cpu_seconds == pytest.approx(cpu) and ended.peak_memory_bytes == peak
    finally:
        e.pod_metrics = None

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


async def test_an_api_server_that_does_not_answer_is_degraded_within_cluster_managers_deadline(
        driver: ServiceProcess) -> None:
    """GetClusterInfo while the API server holds every node list: answered within ClusterManager's
    5 s, DEGRADED with the capacity last seen (jobs matched to it wait), not the call's deadline
    (its HTTP timeout is 10 s), which ClusterManager reads as the driver not answering."""
    cluster = "clusters/slow-api"
    async with security.channel(driver.address) as ch, emulator() as (e, url):
        stub = driver_service_pb2_grpc.DriverServiceStub(ch)
        await put_node(url, "cpu-1", "16")
        await configure(stub, cluster, url)
        ok = (await stub.GetClusterInfo(dpb.GetClusterInfoRequest(cluster=cluster), timeout=10)).info
        assert ok.state == cluster_pb2.CLUSTER_STATE_READY and ok.capacity.cpus_total == 16
        e.hold = lambda method, path: 30.0 if path == "/api/v1/nodes" else None
        try:
            slow = (await stub.GetClusterInfo(dpb.GetClusterInfoRequest(cluster=cluster), timeout=5)).info
        finally:
            e.hold = None
        assert slow.state == cluster_pb2.CLUSTER_STATE_DEGRADED, slow
        assert "did not answer" in slow.message and slow.capacity.cpus_total == 16
        await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster=cluster), timeout=10)
