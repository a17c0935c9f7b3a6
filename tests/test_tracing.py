"""OpenTelemetry tracing across JobManager -> ClusterManager -> driver, and JSON logs.

The stack's three services run with ``--trace-export file:PATH`` and
``--log-format json``; one SubmitJob must be one trace: the JobManager's
server span, its client calls, and the server spans they cause in
ClusterManager (MatchClusters) and in the driver (LaunchJob), each the child
of the call that made it. The logs are JSON lines naming the job they are
about, and never hold a credential.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import time
import uuid
from collections.abc import Iterator

import pytest

from dlsched.v1 import cluster_manager_service_pb2 as cm_pb
from dlsched.v1 import cluster_manager_service_pb2_grpc as cm_grpc
from dlsched.v1 import cluster_pb2, job_pb2
from dlsched.v1 import job_manager_service_pb2 as pb
from dlsched.v1 import job_manager_service_pb2_grpc as pb_grpc
from tests import security
from tests.harness import EtcdServer, Stack

SECRET = f"tok-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def traced(etcd: EtcdServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, pathlib.Path]]:
    out = tmp_path_factory.mktemp("traces")

    def flag(name: str) -> list[str]:
        return ["--trace-export", f"file:{out / name}.jsonl", "--log-format", "json"]

    st = Stack(etcd, f"/dlsched-trace-{uuid.uuid4().hex[:8]}/", jm_args=flag("jm"), cm_args=flag("cm"),
               driver_args=flag("driver"))
    try:
        st.start()
        yield st, out
    finally:
        st.stop()


def spans(out: pathlib.Path) -> list[dict]:
    got = []
    for f in out.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            if line.strip():
                s = json.loads(line)
                s["_service"] = s["resource"]["attributes"]["service.name"]
                got.append(s)
    return got


async def test_one_submit_is_one_trace_across_the_three_services(traced) -> None:
    stack, out = traced
    assert stack.jm is not None
    await stack.register_local()
    async with security.channel(stack.cm.address) as ch:
        # A second cluster with a credential that must never show up anywhere.
        await cm_grpc.ClusterManagerServiceStub(ch).CreateCluster(cm_pb.CreateClusterRequest(cluster_id="secretive", cluster=cluster_pb2.Cluster(
            type=job_pb2.CLUSTER_TYPE_RAY, address="http://127.0.0.1:1", driver_address=stack.driver.address,
            credentials=cluster_pb2.ClusterCredentials(token=cluster_pb2.TokenCredentials(token=SECRET)))))
    async with security.channel(stack.jm.address) as ch:
        spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[
            job_pb2.ReplicaGroup(role="main", replicas=1, command=["true"])])
        submitted = (await pb_grpc.JobManagerServiceStub(ch).SubmitJob(pb.SubmitJobRequest(spec=spec))).job

    def submit_trace() -> list[dict]:
        all_spans = spans(out)
        roots = [s for s in all_spans if s["name"] == "/dlsched.v1.JobManagerService/SubmitJob"
                 and s["kind"] == "SpanKind.SERVER"]
        if not roots:
            return []
        trace_id = roots[0]["context"]["trace_id"]
        return [s for s in all_spans if s["context"]["trace_id"] == trace_id]

    deadline = time.monotonic() + 60
    while True:
        trace = submit_trace()
        names = {(s["_service"], s["kind"], s["name"]) for s in trace}
        if ("driver-local", "SpanKind.SERVER", "/dlsched.v1.DriverService/LaunchJob") in names \
                or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)

    assert ("job-manager", "SpanKind.SERVER", "/dlsched.v1.JobManagerService/SubmitJob") in names
    assert ("cluster-manager", "SpanKind.SERVER", "/dlsched.v1.ClusterManagerService/MatchClusters") in names
    assert ("driver-local", "SpanKind.SERVER", "/dlsched.v1.DriverService/LaunchJob") in names

    by_id = {s["context"]["span_id"]: s for s in trace}
    for service, method in (("cluster-manager", "MatchClusters"), ("driver-local", "LaunchJob")):
        server = next(s for s in trace if s["_service"] == service and s["name"].endswith("/" + method))
        caller = by_id[server["parent_id"]]  # the JobManager's client span of that very call
        assert caller["_service"] == "job-manager" and caller["kind"] == "SpanKind.CLIENT"
        assert caller["name"].endswith("/" + method)
    assert not [s for s in spans(out) if "grpc.health" in s["name"]]  # health checks stay untraced

    # JSON logs: every line an object; the job's records carry its id, in the
    # JobManager and in the driver; no credential anywhere.
    job_id = submitted.name.removeprefix("jobs/")
    for proc, service in ((stack.jm, "job-manager"), (stack.driver, "driver-local"), (stack.cm, "cluster-manager")):
        text = proc.log()
        assert SECRET not in text
        if service == "cluster-manager":
            continue
        records = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        assert records and all(r["service"] == service for r in records)
        about = [r for r in records if r.get("job_id") == job_id]
        assert any(job_id in r["message"] for r in about), (service, records[-5:])
