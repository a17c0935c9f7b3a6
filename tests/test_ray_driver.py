# ruff: noqa: ASYNC109, ASYNC110  -- tests poll a real Ray head
"""The Ray driver, as a real process over real gRPC, against a real Ray head (tests/ray_head.py)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence

import grpc
import pytest

from dlsched.kit.rpc_errors import error_info
from dlsched.v1 import driver_service_pb2 as dpb
from dlsched.v1 import driver_service_pb2_grpc, job_pb2
from tests.harness import ServiceProcess
from tests.ray_head import RayHead, ray_available

S = job_pb2
PY = sys.executable
CLUSTER = "clusters/ray"
TERMINAL = (S.JOB_STATE_SUCCEEDED, S.JOB_STATE_FAILED, S.JOB_STATE_STOPPED)
# Until the dev extra installs Ray, a missing Ray skips; DLSCHED_REQUIRE_RAY=1 makes it fail instead.
REQUIRE = os.environ.get("DLSCHED_REQUIRE_RAY") == "1"

pytestmark = pytest.mark.skipif(
    (not ray_available() or importlib.util.find_spec("aiohttp") is None) and not REQUIRE,
    reason="ray[default] and aiohttp are not installed (pip install -e '.[ray]' 'ray[default]')")


@pytest.fixture(scope="module")
def head() -> Iterator[RayHead]:
    h = RayHead().start()
    try:
        yield h
    finally:
        h.stop()


@pytest.fixture(scope="module")
def driver(head: RayHead) -> Iterator[ServiceProcess]:
    svc = ServiceProcess("drivers.ray", ["--poll-interval", "0.2", "--log-poll-interval", "0.05"],
                         name="ray-driver").start()
    try:
        yield svc
    finally:
        svc.stop()


@pytest.fixture
async def stub(driver: ServiceProcess, head: RayHead) -> AsyncIterator[driver_service_pb2_grpc.DriverServiceStub]:
    async with grpc.aio.insecure_channel(driver.address) as ch:
        s = driver_service_pb2_grpc.DriverServiceStub(ch)
        await s.ConfigureCluster(dpb.ConfigureClusterRequest(cluster=CLUSTER, address=head.address,
                                                             options={"python": PY}), timeout=20)
        yield s


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def single(code: str, **env: str) -> S.JobSpec:
    return S.JobSpec(run_mode=S.RUN_MODE_SINGLE_PROCESS, replica_groups=[S.ReplicaGroup(
        role="main", replicas=1, command=[PY, "-u", "-c"], args=[code], env=env)])


async def launch(stub: driver_service_pb2_grpc.DriverServiceStub, job_id: str, spec: S.JobSpec,
                 attempt: int = 1) -> dpb.LaunchJobResponse:
    return await stub.LaunchJob(dpb.LaunchJobRequest(cluster=CLUSTER, job_id=job_id, spec=spec,
                                                     attempt=attempt), timeout=30)


async def wait_state(stub: driver_service_pb2_grpc.DriverServiceStub, job_id: str,
                     states: Sequence[int] = TERMINAL, within: float = 90.0) -> dpb.JobObservation:
    deadline = time.monotonic() + within
    while True:
        resp = await stub.BatchGetJobObservations(dpb.BatchGetJobObservationsRequest(
            cluster=CLUSTER, jobs=[dpb.JobRef(job_id=job_id)]), timeout=10)
        obs = resp.observations[0]
        if obs.state in states:
            return obs
        if time.monotonic() > deadline:
            raise AssertionError(f"{job_id} still {S.JobState.Name(obs.state)}: {obs}")
        await asyncio.sleep(0.1)


async def logs(stub: driver_service_pb2_grpc.DriverServiceStub, job_id: str, **kw: object) -> list[S.LogEntry]:
    req = dpb.TailJobLogsRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job_id), **kw)  # type: ignore[arg-type]
    out: list[S.LogEntry] = []
    async for resp in stub.TailJobLogs(req, timeout=90):
        out.extend(resp.entries)
    return out


def ray_jobs(head: RayHead) -> list[dict]:
    import urllib.request
    with urllib.request.urlopen(f"{head.address}/api/jobs/", timeout=10) as r:
        return json.loads(r.read())


async def test_cluster_info_reports_ray_capacity(stub):
    deadline = time.monotonic() + 30
    while True:
        info = (await stub.GetClusterInfo(dpb.GetClusterInfoRequest(cluster=CLUSTER), timeout=10)).info
        if info.state == 2 or time.monotonic() > deadline:  # READY
            break
        await asyncio.sleep(0.5)
    assert info.state == 2, info
    assert info.capacity.cpus_total == 2 and info.capacity.nodes_total == 1
    assert info.capacity.memory_bytes_total > 0
    assert list(info.supported_run_modes) == [1, 2, 3, 4]  # no MPI
    assert info.driver_version.startswith("ray/")


async def test_single_process_succeeds_with_env_and_followed_logs(stub):
    job_id = new_id("single")
    code = ("import os, time\n"
            "print('start', os.environ['DLSCHED_JOB_ID'], os.environ['FOO'])\n"
            "time.sleep(1.5)\n"
            "print('end')\n")
    resp = await launch(stub, job_id, single(code, FOO="bar baz"))
    assert resp.backend_job_id == f"dlsched-{job_id}-1"
    assert json.loads(resp.native_spec.content)["submission_id"] == resp.backend_job_id
    await wait_state(stub, job_id, (S.JOB_STATE_RUNNING, *TERMINAL))
    got: list[tuple[float, str]] = []
    req = dpb.TailJobLogsRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job_id), follow=True)
    async for r in stub.TailJobLogs(req, timeout=90):
        got.extend((time.monotonic(), e.text) for e in r.entries)
    texts = [t for _, t in got]
    assert f"start {job_id} bar baz" in texts and "end" in texts
    obs = await wait_state(stub, job_id)
    assert obs.state == S.JOB_STATE_SUCCEEDED and obs.exit_code == 0 and obs.attempt == 1
    assert obs.start_time.seconds > 0 and obs.end_time.seconds > 0
    assert [e.text for e in await logs(stub, job_id, tail_lines=1)] == ["end"]


async def test_failing_entrypoint_is_failed_with_rays_message(stub):
    job_id = new_id("fail")
    await launch(stub, job_id, single("import sys; print('boom', file=sys.stderr); sys.exit(3)"))
    obs = await wait_state(stub, job_id)
    assert obs.state == S.JOB_STATE_FAILED and obs.exit_code == 3
    assert obs.reason == "JobEntrypointCommandError"
    assert "exit code 3" in obs.message


async def test_stop_ends_a_running_job_stopped_and_cleanup_is_idempotent(stub, head):
    job_id = new_id("stop")
    await launch(stub, job_id, single("import time; print('up', flush=True); time.sleep(300)"))
    await wait_state(stub, job_id, (S.JOB_STATE_RUNNING,))
    ref = dpb.JobRef(job_id=job_id)
    await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=ref), timeout=20)
    obs = await wait_state(stub, job_id, within=60)
    assert obs.state == S.JOB_STATE_STOPPED
    await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=ref), timeout=20)
    for _ in range(2):
        await stub.CleanupJob(dpb.CleanupJobRequest(cluster=CLUSTER, job=ref), timeout=60)
    assert not [j for j in ray_jobs(head) if (j.get("metadata") or {}).get("dlsched_job_id") == job_id]
    assert not (await wait_state(stub, job_id, (S.JOB_STATE_UNSPECIFIED,))).found


async def test_retried_launch_makes_one_ray_submission(stub, head):
    job_id = new_id("dedup")
    spec = single("print('once')")
    first, second = await asyncio.gather(launch(stub, job_id, spec), launch(stub, job_id, spec))
    assert first.backend_job_id == second.backend_job_id
    await wait_state(stub, job_id)
    third = await launch(stub, job_id, spec)
    assert third.backend_job_id == first.backend_job_id and third.observation.state == S.JOB_STATE_SUCCEEDED
    mine = [j for j in ray_jobs(head) if (j.get("metadata") or {}).get("dlsched_job_id") == job_id]
    assert len(mine) == 1


async def test_mpi_is_refused(stub):
    spec = S.JobSpec(run_mode=S.RUN_MODE_MPI, replica_groups=[
        S.ReplicaGroup(role="launcher", replicas=1, command=["true"]),
        S.ReplicaGroup(role="worker", replicas=1, command=["true"])])
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await launch(stub, new_id("mpi"), spec)
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(ei.value).reason == "MPI_NOT_SUPPORTED"
