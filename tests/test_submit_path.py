# ruff: noqa: ASYNC109, ASYNC110, ASYNC240  -- polling services and files in tests
"""SubmitJob answers once the job is stored; the launch follows in the background
(issue 18 item 5), and a driver forgets an ended job once JobManager recorded it
(item 4). Real etcd, ClusterManager, JobManager and local driver processes."""

from __future__ import annotations

import asyncio
import glob
import os
import pathlib
import signal
import time
from collections.abc import Iterator

import grpc
import pytest

from dlsched.client import DlschedRpcError, JobManagerClient
from dlsched.v1 import driver_service_pb2 as dpb
from dlsched.v1 import driver_service_pb2_grpc, job_pb2
from tests import harness, security
from tests.harness import EtcdServer, Stack, metrics_samples, sample


def spec(code: str) -> job_pb2.JobSpec:
    return job_pb2.JobSpec(
        run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS,
        replica_groups=[job_pb2.ReplicaGroup(role="main", replicas=1, command=["python3", "-c", code])],
        cluster_selector=job_pb2.ClusterSelector(cluster="local"))


def marking(marker: pathlib.Path, text: str = "hello") -> str:
    """Appends one line to ``marker`` per run, prints ``text``."""
    return f"open({str(marker)!r}, 'a').write('ran\\n')\nprint({text!r}, flush=True)\n"


@pytest.fixture
def stack(etcd: EtcdServer, etcd_prefix: str) -> Iterator[Stack]:
    # a long driver timeout: ClusterManager keeps the cluster READY while the driver is frozen
    st = Stack(etcd, etcd_prefix, jm_args=["--metrics-listen", "127.0.0.1:0"],
               cm_args=["--driver-timeout", "120"])
    with st.running():
        yield st


async def until_job(jm: JobManagerClient, name: str, pred, within: float = 60) -> job_pb2.Job:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within
    while True:
        job = await jm.get_job(name)
        if pred(job):
            return job
        assert time.monotonic() < deadline, f"{name} still {job_pb2.JobState.Name(job.state)} {job.reason}"
        await asyncio.sleep(0.1)


async def test_submit_returns_before_the_launch_and_a_jm_killed_before_the_launch_loses_nothing(
        stack: Stack, tmp_path: pathlib.Path) -> None:
    await stack.register_local()
    assert stack.jm is not None and stack.driver.proc is not None
    marker = tmp_path / "runs"
    stack.driver.proc.send_signal(signal.SIGSTOP)  # LaunchJob cannot be answered now
    try:
        async with JobManagerClient(stack.jm.address) as jm:
            job = (await asyncio.wait_for(jm.submit_job(spec(marking(marker)), request_id="once"), 30)).job
        # Stored, answered, not launched: the state says where it is.
        assert job.state == job_pb2.JOB_STATE_PENDING and job.reason == "LaunchQueued"
        assert not job.backend_job_id and job.attempt == 1
        await asyncio.sleep(0.5)  # the background launch is waiting on the frozen driver
        stack.jm.kill()  # SIGKILL between the store and the recorded launch
    finally:
        stack.driver.proc.send_signal(signal.SIGCONT)
    stack.jm.start()
    async with JobManagerClient(stack.jm.address) as jm:
        done = await until_job(jm, job.name, lambda j: j.state == job_pb2.JOB_STATE_SUCCEEDED)
        assert done.backend_job_id == f"local-{job.name.rpartition('/')[2]}-1" and done.attempt == 1
        # A retry of the same request returns the same job and launches nothing.
        again = (await jm.submit_job(spec(marking(marker)), request_id="once")).job
        assert again.name == job.name and again.uid == job.uid
    await asyncio.sleep(1.0)
    assert marker.read_text() == "ran\n"  # run exactly once
    samples = metrics_samples(stack.jm)
    assert sample(samples, "dlsched_job_launch_latency_seconds_count") >= 1


async def test_many_submits_each_launch_once(stack: Stack, tmp_path: pathlib.Path) -> None:
    await stack.register_local()
    assert stack.jm is not None
    async with JobManagerClient(stack.jm.address) as jm:
        markers = [tmp_path / f"m{i}" for i in range(12)]
        jobs = await asyncio.gather(*(jm.submit_job(spec(marking(m))) for m in markers))
        assert all(r.job.state == job_pb2.JOB_STATE_PENDING for r in jobs)
        for r in jobs:
            await until_job(jm, r.job.name, lambda j: j.state == job_pb2.JOB_STATE_SUCCEEDED)
    assert [m.read_text() for m in markers] == ["ran\n"] * len(markers)


async def snapshot_ids(address: str) -> set[str]:
    """The job ids in the local driver's WatchJobObservations snapshot of clusters/local."""
    async with security.channel(address) as ch:
        return await harness.snapshot_ids(driver_service_pb2_grpc.DriverServiceStub(ch), "clusters/local")


async def test_driver_forgets_a_recorded_job_and_keeps_its_logs_and_usage(stack: Stack) -> None:
    await stack.register_local()
    assert stack.jm is not None
    state_dir = stack.driver.args[1]
    async with JobManagerClient(stack.jm.address) as jm:
        job = (await jm.submit_job(spec(marking(pathlib.Path(os.devnull), "kept on disk")))).job
        job_id = job.name.rpartition("/")[2]
        await until_job(jm, job.name, lambda j: j.state == job_pb2.JOB_STATE_SUCCEEDED)
        # JobManager recorded the end, then told the driver: the job leaves its memory.
        deadline = time.monotonic() + 30
        while job_id in await snapshot_ids(stack.driver.address):
            assert time.monotonic() < deadline, "the driver still tracks a recorded job"
            await asyncio.sleep(0.2)
        assert glob.glob(os.path.join(state_dir, "jobs", job_id, "attempt-1", "recorded.json"))
        # What logs and usage need stayed on disk.
        lines = [e.text async for e in jm.stream_job_logs(job.name)]
        assert lines == ["kept on disk"]
        usage = await jm.get_job_usage(job.name)
        assert [r.role for r in usage.replicas] == ["main"]
        # A restarted driver (a new address: talked to directly) does not load it back into
        # memory, and still answers for it from its files.
        stack.driver.kill()
        stack.driver.start()
        async with security.channel(stack.driver.address) as ch:
            stub = driver_service_pb2_grpc.DriverServiceStub(ch)
            await stub.ConfigureCluster(dpb.ConfigureClusterRequest(cluster="clusters/local"), timeout=30)
            assert job_id not in await snapshot_ids(stack.driver.address)
            ref = dpb.JobRef(job_id=job_id, backend_job_id=f"local-{job_id}-1")
            got = await stub.BatchGetJobObservations(
                dpb.BatchGetJobObservationsRequest(cluster="clusters/local", jobs=[ref]), timeout=30)
            assert got.observations[0].found and got.observations[0].state == job_pb2.JOB_STATE_SUCCEEDED
            tail = [e.text async for r in stub.TailJobLogs(
                dpb.TailJobLogsRequest(cluster="clusters/local", job=ref), timeout=30) for e in r.entries]
            assert tail == ["kept on disk"]
            # A repeated launch of the attempt answers its first result; nothing runs again.
            again = await stub.LaunchJob(dpb.LaunchJobRequest(
                cluster="clusters/local", job_id=job_id, spec=job.spec, attempt=1), timeout=30)
            assert again.backend_job_id == ref.backend_job_id
            assert again.observation.state == job_pb2.JOB_STATE_SUCCEEDED
            # Cleanup removes its files.
            await stub.CleanupJob(dpb.CleanupJobRequest(cluster="clusters/local", job=ref), timeout=30)
            assert not os.path.exists(os.path.join(state_dir, "jobs", job_id))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie not reaped yet has ended too
        return f.read().rpartition(")")[2].split()[0] != "Z"


async def test_a_backend_job_whose_job_is_gone_is_stopped_and_removed(stack: Stack, tmp_path: pathlib.Path) -> None:
    """A backend job running for a job the store does not have (deleted while its launch was in
    flight, or while its driver was down): JobManager sees it in the driver's observations,
    stops it and removes its files; the job it does have runs on."""
    await stack.register_local()
    assert stack.jm is not None
    state_dir = stack.driver.args[1]
    pid_file = tmp_path / "orphan.pid"
    async with JobManagerClient(stack.jm.address) as jm:
        kept = (await jm.submit_job(spec("import time; time.sleep(600)"))).job  # the cluster is tracked
        await until_job(jm, kept.name, lambda j: j.state == job_pb2.JOB_STATE_RUNNING)
        async with security.channel(stack.driver.address) as ch:  # a launch JobManager never recorded
            stub = driver_service_pb2_grpc.DriverServiceStub(ch)
            await stub.LaunchJob(dpb.LaunchJobRequest(
                cluster="clusters/local", job_id="orphan", attempt=1,
                spec=spec(f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
                          "time.sleep(600)")), timeout=30)
        deadline = time.monotonic() + 90
        while "orphan" in await snapshot_ids(stack.driver.address) or \
                os.path.exists(os.path.join(state_dir, "jobs", "orphan")):
            assert time.monotonic() < deadline, "the driver still runs the orphan, or its files are still there"
            await asyncio.sleep(0.2)
        if pid_file.exists() and pid_file.read_text():  # it may be stopped before it starts
            assert not alive(int(pid_file.read_text()))
        assert (await jm.get_job(kept.name)).state == job_pb2.JOB_STATE_RUNNING
        await jm.stop_job(kept.name)


async def test_a_retried_submit_gets_its_job_while_cluster_manager_is_down(stack: Stack) -> None:
    """The request id answers a retry with the stored job whatever the clusters now, even with
    ClusterManager unreachable; a new request cannot be placed then and says so."""
    await stack.register_local()
    assert stack.jm is not None
    async with JobManagerClient(stack.jm.address) as jm:
        first = (await jm.submit_job(spec("print('once')"), request_id="retried")).job
        stack.cm.kill()
        again = (await asyncio.wait_for(jm.submit_job(spec("print('once')"), request_id="retried"), 60)).job
        assert (again.name, again.uid) == (first.name, first.uid)
        with pytest.raises(DlschedRpcError) as e:
            await asyncio.wait_for(jm.submit_job(spec("print('new')"), request_id="new"), 60)
        assert e.value.status_code == grpc.StatusCode.UNAVAILABLE


def test_the_match_request_keeps_everything_matching_reads() -> None:
    """JobManager sends ClusterManager only ``match_spec`` of a job (so jobs alike in their
    needs share a match): ClusterManager must derive the same requirements from it."""
    from google.protobuf import duration_pb2

    from cluster_manager.convert import job_requirements_from_proto
    from job_manager.clients import match_spec
    from job_manager.convert import spec_from_proto

    full = job_pb2.JobSpec(
        run_mode=job_pb2.RUN_MODE_PS_WORKER, queue="q", time_limit=duration_pb2.Duration(seconds=60),
        max_retries=2, labels={"a": "b"}, project="p",
        cluster_selector=job_pb2.ClusterSelector(cluster="c", cluster_type=job_pb2.CLUSTER_TYPE_SLURM,
                                                 labels={"zone": "z"}),
        replica_groups=[job_pb2.ReplicaGroup(
            role=role, replicas=n, processes_per_replica=2, command=["x"], args=["y"], image="i",
            env={"K": "V"}, working_dir="w",
            resources=job_pb2.Resources(cpu=1.5, memory_bytes=1 << 30, gpus=1, gpu_type="h100"))
            for role, n in (("ps", 1), ("worker", 3))])
    unset = [f.name for f in job_pb2.JobSpec.DESCRIPTOR.fields if not getattr(full, f.name)]
    assert not unset, f"set every field here (a new one must be judged): {unset}"
    sent = match_spec(spec_from_proto(full))
    assert job_requirements_from_proto(sent) == job_requirements_from_proto(full)
    assert sent.project == full.project
    assert not any(g.command or g.args or g.env or g.working_dir for g in sent.replica_groups)
