# ruff: noqa: ASYNC109, ASYNC110, ASYNC230, ASYNC240  -- tests poll real backends and read their files
"""ForgetJobs on the Slurm and Ray drivers (issue 18 item 4): a driver drops an ended job from
memory once JobManager recorded its end, keeps answering for it (observations, logs, usage,
cleanup) from what the backend keeps (the attempt's files on the login node, sacct; Ray's
Jobs API), never tracks it again, and a restarted driver does not load it back. Real Slurm
over real sshd (``slurm_peer``), a real Ray head (``ray_head``)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from dlsched.v1 import driver_service_pb2 as dpb
from dlsched.v1 import driver_service_pb2_grpc, job_pb2
from drivers.common.base import JobState, ReplicaUsage
from drivers.slurm import exits
from drivers.slurm.jobs import RECORDED, TrackedJob
from drivers.slurm.poller import SlurmJob
from tests import security
from tests.harness import ServiceProcess, snapshot_ids

SLURM = "clusters/slurm"
RAY = "clusters/ray"


async def observe_ref(stub: driver_service_pb2_grpc.DriverServiceStub, cluster: str,
                      ref: dpb.JobRef) -> dpb.JobObservation:
    resp = await stub.BatchGetJobObservations(dpb.BatchGetJobObservationsRequest(cluster=cluster, jobs=[ref]),
                                              timeout=60)
    return resp.observations[0]


async def tail_ref(stub: driver_service_pb2_grpc.DriverServiceStub, cluster: str, ref: dpb.JobRef,
                   ) -> list[str]:
    return [e.text async for r in stub.TailJobLogs(dpb.TailJobLogsRequest(cluster=cluster, job=ref), timeout=60)
            for e in r.entries if e.stream == job_pb2.LOG_STREAM_STDOUT]


async def forget(stub: driver_service_pb2_grpc.DriverServiceStub, cluster: str, *refs: dpb.JobRef) -> int:
    resp = await stub.ForgetJobs(dpb.ForgetJobsRequest(cluster=cluster, jobs=list(refs)), timeout=30)
    return resp.forgotten


# --------------------------------------------------------------------------- the Slurm record


def test_a_slurm_record_rebuilds_the_ended_job_it_was_written_from() -> None:
    job = TrackedJob("clusters/s", "j", 2, "42", "/s/j/attempt-2", None,
                     roles=(("master", 0), ("worker", 0)))
    job.apply(SlurmJob(job_id="42", state="FAILED", exit_status=3, start_time=10.0, end_time=20.0, nodes="n1",
                       restarts=1))
    assert job.needs_exits
    assert job.exits_read(exits.parse("labels master-0 worker-0\nend worker-0 3 exit\nend master-0 143 stop\n"))
    job.usage[("worker", 0)] = ReplicaUsage(role="worker", replica_index=0, cpu_seconds=1.5, peak_memory_bytes=7)
    doc = json.loads(json.dumps(job.record()))
    again = TrackedJob.from_record("clusters/s", "/s/j/attempt-2", doc)
    assert again.observation(None) == job.observation(None)
    assert again.usage == job.usage and again.roles == job.roles and again.attempt == 2
    running = TrackedJob("clusters/s", "k", 1, "43", "/s/k/attempt-1", None)
    with pytest.raises(ValueError):  # only an ended job is ever recorded
        TrackedJob.from_record("clusters/s", "/s/k/attempt-1", running.record())
    assert job.state is JobState.FAILED and not hasattr(job, "__dict__")  # slots: compact


# --------------------------------------------------------------------------- Slurm


@pytest.fixture(scope="module")
def slurm_cluster() -> Iterator[object]:
    from tests import slurm_cluster as sc
    c = sc.SlurmCluster().start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def slurm_driver(slurm_cluster: object) -> Iterator[ServiceProcess]:
    svc = ServiceProcess("drivers.slurm", ["--poll-interval", "0.3"], name="slurm-driver-forget").start()
    yield svc
    svc.stop()


@pytest.fixture
async def slurm_stub(slurm_driver: ServiceProcess, slurm_cluster: object
                     ) -> AsyncIterator[driver_service_pb2_grpc.DriverServiceStub]:
    from tests.slurm_peer import configure_request
    async with security.channel(slurm_driver.address) as ch:
        s = driver_service_pb2_grpc.DriverServiceStub(ch)
        await s.ConfigureCluster(configure_request(slurm_cluster, SLURM), timeout=30)  # type: ignore[arg-type]
        yield s


async def test_slurm_forgets_a_recorded_job_and_answers_for_it_from_its_files(slurm_stub, slurm_cluster):
    from tests.slurm_peer import configure_request, launch, new_id, single, wait_state
    stub = slurm_stub
    jid, running_id = new_id("forget"), new_id("forget-running")
    first = await launch(stub, jid, single("print('kept on disk')"))
    running = await launch(stub, running_id, single("import time; time.sleep(600)"))
    ref = dpb.JobRef(job_id=jid, backend_job_id=first.backend_job_id)
    running_ref = dpb.JobRef(job_id=running_id, backend_job_id=running.backend_job_id)
    ended = await wait_state(stub, jid)
    assert ended.state == job_pb2.JOB_STATE_SUCCEEDED, ended
    try:
        # Only an ended job is forgotten; the running one stays tracked.
        assert await forget(stub, SLURM, ref, running_ref) == 1
        assert await forget(stub, SLURM, ref) == 0  # already forgotten
        ids = await snapshot_ids(stub, SLURM)
        assert jid not in ids and running_id in ids
        record = os.path.join(slurm_cluster.options()["state_dir"], jid, "attempt-1", RECORDED)
        deadline = time.monotonic() + 30
        while not os.path.exists(record):
            assert time.monotonic() < deadline, "the record was never written"
            await asyncio.sleep(0.2)
        with open(record) as f:
            assert json.load(f)["state"] == "SUCCEEDED"
        # Answered from its files, and never tracked again (the poller does not adopt it).
        obs = await observe_ref(stub, SLURM, ref)
        assert obs.found and obs.state == job_pb2.JOB_STATE_SUCCEEDED
        assert obs.replicas == ended.replicas and obs.end_time == ended.end_time
        assert jid not in await snapshot_ids(stub, SLURM)
        assert await tail_ref(stub, SLURM, ref) == ["kept on disk"]
        assert await tail_ref(stub, SLURM, dpb.JobRef(job_id=jid)) == ["kept on disk"]
        usage = await stub.MeasureJobUsage(dpb.MeasureJobUsageRequest(cluster=SLURM, job=ref), timeout=30)
        assert [r.role for r in usage.usage.replicas] == ["main"]
        stopped = await stub.TerminateJob(dpb.TerminateJobRequest(cluster=SLURM, job=ref), timeout=30)
        assert stopped.observation.state == job_pb2.JOB_STATE_SUCCEEDED  # ended: nothing to stop
        assert jid not in await snapshot_ids(stub, SLURM)
        # A restarted driver does not load it back, and still answers for it.
        other = ServiceProcess("drivers.slurm", ["--poll-interval", "0.3"], name="slurm-driver-forget-2").start()
        try:
            async with security.channel(other.address) as ch:
                s2 = driver_service_pb2_grpc.DriverServiceStub(ch)
                await s2.ConfigureCluster(configure_request(slurm_cluster, SLURM), timeout=30)
                again = await observe_ref(s2, SLURM, ref)
                assert again.found and again.state == job_pb2.JOB_STATE_SUCCEEDED
                assert again.replicas == ended.replicas
                assert jid not in await snapshot_ids(s2, SLURM)
                assert await tail_ref(s2, SLURM, ref) == ["kept on disk"]
                # Cleanup removes its files.
                await s2.CleanupJob(dpb.CleanupJobRequest(cluster=SLURM, job=ref), timeout=60)
                assert not os.path.exists(os.path.dirname(os.path.dirname(record)))
        finally:
            other.stop()
    finally:
        await stub.CleanupJob(dpb.CleanupJobRequest(cluster=SLURM, job=running_ref), timeout=60)


# --------------------------------------------------------------------------- Ray


@pytest.fixture(scope="module")
def ray_head() -> Iterator[object]:
    if importlib.util.find_spec("aiohttp") is None and os.environ.get("DLSCHED_REQUIRE_RAY") != "1":
        pytest.skip("aiohttp is not installed (pip install -e '.[ray]')")
    from tests.ray_head import started_head
    yield from started_head(os.environ.get("DLSCHED_REQUIRE_RAY") == "1")


@pytest.fixture(scope="module")
def ray_driver(ray_head: object) -> Iterator[ServiceProcess]:
    from tests.ray_head import started_driver
    yield from started_driver("ray-driver-forget")


async def configure_ray(stub: driver_service_pb2_grpc.DriverServiceStub, head: object) -> None:
    await stub.ConfigureCluster(dpb.ConfigureClusterRequest(
        cluster=RAY, address=head.address, options={"python": sys.executable}), timeout=30)  # type: ignore[attr-defined]


async def wait_ray_end(stub: driver_service_pb2_grpc.DriverServiceStub, ref: dpb.JobRef) -> dpb.JobObservation:
    deadline = time.monotonic() + 120
    while True:
        obs = await observe_ref(stub, RAY, ref)
        if obs.state in (job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_STOPPED):
            return obs
        assert time.monotonic() < deadline, f"still {job_pb2.JobState.Name(obs.state)}"
        await asyncio.sleep(0.2)


async def test_ray_forgets_a_recorded_job_and_answers_for_it_from_ray(ray_driver, ray_head):
    async with security.channel(ray_driver.address) as ch:
        stub = driver_service_pb2_grpc.DriverServiceStub(ch)
        await configure_ray(stub, ray_head)
        jid = f"forget-{os.getpid()}-{int(time.time() * 1000) % 10**8}"
        spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[job_pb2.ReplicaGroup(
            role="main", replicas=1, command=[sys.executable, "-u", "-c"], args=["print('kept by ray')"])])
        first = await stub.LaunchJob(dpb.LaunchJobRequest(cluster=RAY, job_id=jid, spec=spec, attempt=1), timeout=60)
        ref = dpb.JobRef(job_id=jid, backend_job_id=first.backend_job_id)
        ended = await wait_ray_end(stub, ref)
        assert ended.state == job_pb2.JOB_STATE_SUCCEEDED, ended
        assert await forget(stub, RAY, dpb.JobRef(job_id=jid, backend_job_id="dlsched-other-1")) == 0
        assert await forget(stub, RAY, ref) == 1
        assert await forget(stub, RAY, ref) == 0  # already forgotten
        # The poller lists it every round, yet does not track it again.
        await asyncio.sleep(1.0)
        assert jid not in await snapshot_ids(stub, RAY)
        obs = await observe_ref(stub, RAY, ref)
        assert obs.found and obs.state == job_pb2.JOB_STATE_SUCCEEDED
        assert obs.replicas == ended.replicas and obs.attempt == 1
        assert not (await observe_ref(stub, RAY, dpb.JobRef(job_id=jid))).found  # no submission id: not asked
        assert await tail_ref(stub, RAY, ref) == ["kept by ray"]
        usage = await stub.MeasureJobUsage(dpb.MeasureJobUsageRequest(cluster=RAY, job=ref), timeout=30)
        assert [r.role for r in usage.usage.replicas] == ["main"]
        stopped = await stub.TerminateJob(dpb.TerminateJobRequest(cluster=RAY, job=ref), timeout=30)
        assert stopped.observation.state == job_pb2.JOB_STATE_SUCCEEDED  # ended: not stopped again
        assert jid not in await snapshot_ids(stub, RAY)
    # A restarted driver does not load it back, and still answers for it.
    other = ServiceProcess("drivers.ray", ["--poll-interval", "0.2"], name="ray-driver-forget-2").start()
    try:
        async with security.channel(other.address) as ch:
            s2 = driver_service_pb2_grpc.DriverServiceStub(ch)
            await configure_ray(s2, ray_head)
            assert jid not in await snapshot_ids(s2, RAY)
            again = await observe_ref(s2, RAY, ref)
            assert again.found and again.state == job_pb2.JOB_STATE_SUCCEEDED and again.replicas == ended.replicas
            # Cleanup deletes it at Ray.
            await s2.CleanupJob(dpb.CleanupJobRequest(cluster=RAY, job=ref), timeout=60)
            assert not (await observe_ref(s2, RAY, ref)).found
    finally:
        other.stop()
