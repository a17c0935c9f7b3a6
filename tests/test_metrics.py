"""``/metrics`` on every service of the stack counts what it should.

A real stack (etcd, ClusterManager, the local driver, JobManager as processes,
each with ``--metrics-listen 127.0.0.1:0``); the test drives real calls and
reads each service's Prometheus endpoint over HTTP.
"""

from __future__ import annotations

import asyncio
import pathlib
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dlsched.v1 import cluster_manager_service_pb2 as cm_pb
from dlsched.v1 import cluster_manager_service_pb2_grpc as cm_grpc
from dlsched.v1 import cluster_pb2, job_pb2
from dlsched.v1 import job_manager_service_pb2 as pb
from dlsched.v1 import job_manager_service_pb2_grpc as pb_grpc
from tests import security
from tests.harness import EtcdServer, ServiceProcess, Stack

M = ["--metrics-listen", "127.0.0.1:0"]
SECRET = f"s3cret-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def stack(etcd: EtcdServer) -> Iterator[Stack]:
    st = Stack(etcd, f"/dlsched-metrics-{uuid.uuid4().hex[:8]}/", jm_args=M, cm_args=M, driver_args=M)
    try:
        st.start()
        yield st
    finally:
        st.stop()


def metrics_address(proc: ServiceProcess) -> str:
    with open(proc.port_file + ".metrics") as f:
        return f.read().strip()


def scrape(proc: ServiceProcess) -> tuple[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    """The raw text and {(sample name, sorted labels): value} of one service."""
    with urllib.request.urlopen(f"http://{metrics_address(proc)}/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    return text, samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_every_service_counts_its_calls_jobs_clusters_and_streams(stack: Stack) -> None:
    assert stack.jm is not None
    await stack.register_local()
    async with security.channel(stack.cm.address) as ch:
        # A second cluster with a credential that must never show up anywhere.
        await cm_grpc.ClusterManagerServiceStub(ch).CreateCluster(cm_pb.CreateClusterRequest(
            cluster_id="secretive", cluster=cluster_pb2.Cluster(
                type=job_pb2.CLUSTER_TYPE_RAY, address="http://127.0.0.1:1", driver_address="127.0.0.1:1",
                credentials=cluster_pb2.ClusterCredentials(token=cluster_pb2.TokenCredentials(token=SECRET)))))

    async with security.channel(stack.jm.address) as ch:
        jm = pb_grpc.JobManagerServiceStub(ch)
        spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[
            job_pb2.ReplicaGroup(role="main", replicas=1, command=["true"])])
        spec.cluster_selector.cluster = "clusters/local"
        job = (await jm.SubmitJob(pb.SubmitJobRequest(job_id=f"m-{uuid.uuid4().hex[:6]}", spec=spec))).job
        with pytest.raises(grpc.aio.AioRpcError):
            await jm.GetJob(pb.GetJobRequest(name="not-a-name"))
        watch = jm.WatchJobs(pb.WatchJobsRequest())
        async for ev in watch:  # hold one WatchJobs stream open while scraping
            if ev.type == job_pb2.WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE:
                break
        deadline = time.monotonic() + 30
        while (await jm.GetJob(pb.GetJobRequest(name=job.name))).job.state != job_pb2.JOB_STATE_SUCCEEDED:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)

        svc = "dlsched.v1.JobManagerService"
        deadline = time.monotonic() + 60
        while True:  # the job gauge follows the watch: give it a moment
            text, s = scrape(stack.jm)
            if value(s, "dlsched_jobs", state="SUCCEEDED") >= 1 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        assert value(s, "dlsched_jobs", state="SUCCEEDED") == 1
        assert value(s, "dlsched_jobs", state="RUNNING") == 0
        assert value(s, "dlsched_rpc_requests_total", service=svc, method="SubmitJob", code="OK") == 1
        assert value(s, "dlsched_rpc_requests_total", service=svc, method="GetJob",
                     code="INVALID_ARGUMENT") == 1
        assert value(s, "dlsched_rpc_requests_total", service=svc, method="GetJob", code="OK") >= 1
        assert value(s, "dlsched_rpc_duration_seconds_count", service=svc, method="SubmitJob") == 1
        assert value(s, "dlsched_rpc_streams_active", service=svc, method="WatchJobs") == 1
        watch.cancel()

    deadline = time.monotonic() + 60
    while True:
        _, s = scrape(stack.jm)
        if value(s, "dlsched_rpc_streams_active", service=svc, method="WatchJobs") == 0 \
                or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert value(s, "dlsched_rpc_streams_active", service=svc, method="WatchJobs") == 0
    assert value(s, "dlsched_rpc_requests_total", service=svc, method="WatchJobs", code="CANCELLED") == 1

    cm_text, c = scrape(stack.cm)
    assert value(c, "dlsched_clusters", type="LOCAL", state="READY") == 1
    assert value(c, "dlsched_clusters", type="RAY", state="READY") == 0
    assert value(c, "dlsched_rpc_requests_total", service="dlsched.v1.ClusterManagerService",
                 method="CreateCluster", code="OK") == 2
    assert value(c, "dlsched_rpc_requests_total", service="dlsched.v1.ClusterManagerService",
                 method="MatchClusters", code="OK") >= 1

    drv_text, d = scrape(stack.driver)
    dsvc = "dlsched.v1.DriverService"
    assert value(d, "dlsched_rpc_requests_total", service=dsvc, method="LaunchJob", code="OK") == 1
    assert value(d, "dlsched_rpc_requests_total", service=dsvc, method="ConfigureCluster", code="OK") >= 1
    # JobManager follows the cluster with one observation stream, open now.
    assert value(d, "dlsched_rpc_streams_active", service=dsvc, method="WatchJobObservations") >= 1

    for scraped in (text, cm_text, drv_text):
        assert SECRET not in scraped


async def test_log_followers_share_one_driver_stream_and_a_stalled_one_holds_up_no_other(
        stack: Stack, tmp_path: pathlib.Path) -> None:
    """JobManager tails every follower's logs on one MultiplexJobLogs stream to the driver (no
    call per follower), and a follower that stops reading holds up no other follower's lines."""
    assert stack.jm is not None
    await stack.register_local()
    go, n = tmp_path / "go", 20_000
    code = (f"import os, sys, time\nprint('ready', flush=True)\nwhile not os.path.exists({str(go)!r}): "
            f"time.sleep(0.05)\nfor i in range({n}): sys.stdout.write(f'line {{i:05d}} ' + 'x' * 90 + '\\n')\n")
    spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[
        job_pb2.ReplicaGroup(role="main", replicas=1, command=[sys.executable, "-c", code])])
    spec.cluster_selector.cluster = "clusters/local"
    dsvc = "dlsched.v1.DriverService"
    async with security.channel(stack.jm.address) as ch:
        jm = pb_grpc.JobManagerServiceStub(ch)
        job = (await jm.SubmitJob(pb.SubmitJobRequest(job_id=f"mux-{uuid.uuid4().hex[:6]}", spec=spec))).job
        req = pb.StreamJobLogsRequest(name=job.name, follow=True)
        calls = [jm.StreamJobLogs(req, timeout=300) for _ in range(5)]
        try:
            for call in calls:  # every follower has its first line
                while not any(e.text == "ready" for e in (await call.read()).entries):
                    pass
            _, d = scrape(stack.driver)
            assert value(d, "dlsched_rpc_streams_active", service=dsvc, method="MultiplexJobLogs") == 1
            assert value(d, "dlsched_rpc_streams_active", service=dsvc, method="TailJobLogs") == 0
            go.touch()
            # calls[0] reads no more: its lines pile up until flow control stops them.
            got: list[str] = []
            async for resp in calls[1]:
                got += [e.text for e in resp.entries]
            assert got == [f"line {i:05d} " + "x" * 90 for i in range(n)]
        finally:
            for call in calls:
                call.cancel()
