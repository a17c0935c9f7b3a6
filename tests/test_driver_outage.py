"""A driver that goes away: its jobs say so, keep their state, and are the driver's again once it is back.

The whole local stack as real processes (etcd, ClusterManager, the local
driver on a pinned port, JobManager). The driver is SIGKILLed while a job
runs: JobManager's record keeps RUNNING with reason ``DriverUnreachable``
("driver unreachable since ..."); the driver started again on the same port
and state directory re-adopts the job (it outlived the driver), the reason
goes away, and the job ends SUCCEEDED, having run once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator

import aetcd
import grpc
import pytest

from dlsched.client import ClusterManagerClient, DlschedRpcError, JobManagerClient
from dlsched.v1 import (
    cluster_pb2,
    driver_service_pb2,
    driver_service_pb2_grpc,
    job_manager_service_pb2,
    job_manager_service_pb2_grpc,
    job_pb2,
)
from tests import security
from tests.harness import EtcdServer, ServiceProcess, Stack, free_port, pid_alive


@pytest.fixture
async def stack(etcd: EtcdServer) -> AsyncIterator[Stack]:
    s = Stack(etcd, f"/outage-{uuid.uuid4().hex[:8]}/", driver_args=["--listen", f"127.0.0.1:{free_port()}"])
    with s.running():
        await s.register_local()
        yield s
        await _stop_all(s)


async def _stop_all(s: Stack) -> None:
    """Stop the jobs a test left running (they outlive a driver by design, so the stack's
    teardown alone would leave their processes behind) and wait for them to end, bounded."""
    if s.jm is None or s.jm.proc is None or s.jm.proc.poll() is not None:
        return
    with contextlib.suppress(Exception):
        async with JobManagerClient(s.jm.address) as jm:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                live = [j for j in await jm.list_all_jobs() if j.state not in _TERMINAL]
                if not live:
                    return
                for j in live:
                    if j.state != job_pb2.JOB_STATE_STOPPING:
                        with contextlib.suppress(DlschedRpcError):
                            await jm.stop_job(j.name)
                await asyncio.sleep(0.5)


_TERMINAL = (job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_STOPPED)


async def _until(jm: JobManagerClient, name: str, ok, within: float = 90.0) -> job_pb2.Job:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within
    while True:
        job = await jm.get_job(name)
        if ok(job):
            return job
        assert time.monotonic() < deadline, f"{name}: {job_pb2.JobState.Name(job.state)} {job.reason} {job.message}"
        await asyncio.sleep(0.3)


async def _texts(entries: AsyncIterator[job_pb2.LogEntry]) -> list[str]:
    return [e.text async for e in entries]


async def _wait_for(ok, what: str, within: float = 90.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within
    while not ok():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def test_a_killed_driver_marks_its_jobs_then_readopts_them(stack: Stack, tmp_path: pathlib.Path) -> None:
    marker, release = tmp_path / "runs", tmp_path / "release"
    script = 'echo started; while [ ! -e "$1" ]; do sleep 0.2; done; echo ran >> "$0"'
    spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[job_pb2.ReplicaGroup(
        role="main", replicas=1, command=["/bin/sh", "-c", script], args=[str(marker), str(release)])])
    assert stack.jm is not None
    async with JobManagerClient(stack.jm.address) as jm:
        name = (await jm.submit_job(spec)).job.name
        await _until(jm, name, lambda j: j.state == job_pb2.JOB_STATE_RUNNING)
        stack.driver.kill()
        down = await _until(jm, name, lambda j: j.reason == "DriverUnreachable")
        assert down.state == job_pb2.JOB_STATE_RUNNING and "driver unreachable since" in down.message
        await asyncio.to_thread(stack.driver.start)
        back = await _until(jm, name, lambda j: j.reason != "DriverUnreachable")
        assert back.state == job_pb2.JOB_STATE_RUNNING, (back.reason, back.message)  # re-adopted, not failed
        release.touch()
        done = await _until(jm, name, lambda j: j.state in (job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED))
        assert done.state == job_pb2.JOB_STATE_SUCCEEDED, (done.reason, done.message)
    assert marker.read_text().splitlines() == ["ran"]


async def test_log_followers_get_every_line_once_across_a_driver_kill(stack: Stack) -> None:
    """Followers whose tails share the driver's MultiplexJobLogs stream: the driver is SIGKILLed
    mid-job and started again; each follower resumes and has every line exactly once."""
    n = 300
    code = f"import time\nfor i in range({n}):\n    print(f'line-{{i}}', flush=True)\n    time.sleep(0.05)\n"
    spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[job_pb2.ReplicaGroup(
        role="main", replicas=1, command=[sys.executable, "-c", code])])
    assert stack.jm is not None
    async with JobManagerClient(stack.jm.address) as jm:
        name = (await jm.submit_job(spec)).job.name
        got: list[list[str]] = [[], [], []]
        reconnects: list[str] = []

        async def follow(into: list[str]) -> None:
            async for e in jm.stream_job_logs(name, follow=True,
                                              on_reconnect=lambda err: reconnects.append(err.code)):
                into.append(e.text)

        tasks = [asyncio.ensure_future(follow(g)) for g in got]
        try:
            deadline = time.monotonic() + 90
            while not all(len(g) >= 10 for g in got):
                assert time.monotonic() < deadline and not any(t.done() for t in tasks), got
                await asyncio.sleep(0.05)
            assert len(got[0]) < n - 50, "the job ended before the kill; make it slower"
            stack.driver.kill()
            await asyncio.to_thread(stack.driver.start)
            await asyncio.wait_for(asyncio.gather(*tasks), 180)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    want = [f"line-{i}" for i in range(n)]
    assert got == [want, want, want]
    assert len(reconnects) >= 3 and set(reconnects) == {"UNAVAILABLE"}, reconnects  # each resumed


async def test_a_restarted_driver_not_yet_configured_is_unavailable_not_a_precondition(
        etcd: EtcdServer, tmp_path: pathlib.Path) -> None:
    """Between a driver's restart and ClusterManager configuring it again (here never: its monitor
    polls once an hour), the driver answers CLUSTER_NOT_CONFIGURED. That is JobManager's to wait
    out, not the caller's mistake: usage and logs answer UNAVAILABLE DRIVER_NOT_READY, which
    clients retry (FAILED_PRECONDITION, which they must not retry, failed log followers in CI)."""
    s = Stack(etcd, f"/unready-{uuid.uuid4().hex[:8]}/", cm_args=["--monitor-interval", "3600"],
              driver_args=["--listen", f"127.0.0.1:{free_port()}"])
    release = tmp_path / "release"
    spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[job_pb2.ReplicaGroup(
        role="main", replicas=1, command=["/bin/sh", "-c", 'echo up; while [ ! -e "$0" ]; do sleep 0.2; done',
                                          str(release)])])
    with s.running():
        await s.register_local()
        assert s.jm is not None
        async with JobManagerClient(s.jm.address) as jm:
            name = (await jm.submit_job(spec)).job.name
            await _until(jm, name, lambda j: j.state == job_pb2.JOB_STATE_RUNNING)
            assert (await jm.get_job_usage(name)) is not None  # configured: usage answers
            s.driver.kill()
            await asyncio.to_thread(s.driver.start)
            with pytest.raises(DlschedRpcError) as usage:
                await jm.get_job_usage(name)
            assert (usage.value.code, usage.value.reason) == ("UNAVAILABLE", "DRIVER_NOT_READY"), usage.value
            assert usage.value.metadata.get("cluster") == "clusters/local"
            # Logs: UNAVAILABLE DRIVER_NOT_READY too (after JobManager's and the channel's retries),
            # which the client library calls again on, even before a first message; it has the
            # lines once the driver is configured (here by hand, as ClusterManager would).
            reasons: list[str] = []
            reading = asyncio.ensure_future(_texts(jm.stream_job_logs(
                name, on_reconnect=lambda e: reasons.append(e.reason))))
            await _wait_for(lambda: bool(reasons) or reading.done(), "no reconnect")
            assert not reading.done() and set(reasons) == {"DRIVER_NOT_READY"}, reasons
            async with security.channel(s.driver.address) as ch:
                await driver_service_pb2_grpc.DriverServiceStub(ch).ConfigureCluster(
                    driver_service_pb2.ConfigureClusterRequest(cluster="clusters/local"), timeout=30)
            assert await asyncio.wait_for(reading, 120) == ["up"]
            s.driver.kill()  # no driver at all: the cluster named, not gRPC's words about an address
            with pytest.raises(DlschedRpcError) as gone:
                await jm.get_job_usage(name)
            assert (gone.value.code, gone.value.reason) == ("UNAVAILABLE", "DRIVER_UNAVAILABLE"), gone.value
            assert "clusters/local" in gone.value.message and "127.0.0.1" not in gone.value.message
            release.touch()


async def test_a_job_submitted_while_its_only_cluster_is_down_waits_and_runs_once(
        stack: Stack, tmp_path: pathlib.Path) -> None:
    """The only cluster's driver is dead (DRIVER_UNAVAILABLE) when the job is submitted: SubmitJob
    stores it (no FAILED_PRECONDITION NO_MATCHING_CLUSTER for a moment's outage), it waits PENDING
    ``DriverUnavailable``, and runs once when the driver is back."""
    marker = tmp_path / "runs"
    spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[job_pb2.ReplicaGroup(
        role="main", replicas=1, command=["/bin/sh", "-c", 'echo ran >> "$0"', str(marker)])])
    assert stack.jm is not None
    stack.driver.kill()
    async with ClusterManagerClient(stack.cm.address) as cm:
        await cm.wait_cluster_state("local", cluster_pb2.CLUSTER_STATE_DRIVER_UNAVAILABLE, timeout=90)
        [cand] = await cm.match_clusters(spec)
        assert cand.eligible and any("waits for it" in r for r in cand.reasons), cand
    async with JobManagerClient(stack.jm.address) as jm:
        dry = (await jm.submit_job(spec, dry_run=True)).dry_run  # the placement; no driver to render it
        assert dry.cluster == "clusters/local" and not dry.HasField("native_spec"), dry
        name = (await jm.submit_job(spec)).job.name
        waiting = await _until(jm, name, lambda j: j.reason == "DriverUnavailable")
        assert waiting.state == job_pb2.JOB_STATE_PENDING and not waiting.backend_job_id
        await asyncio.to_thread(stack.driver.start)
        done = await _until(jm, name, lambda j: j.state in (job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED),
                            within=120)
        assert done.state == job_pb2.JOB_STATE_SUCCEEDED, (done.reason, done.message)
    assert marker.read_text().splitlines() == ["ran"]


async def test_a_job_id_submitted_again_after_a_delete_its_driver_missed_runs_again(
        stack: Stack, tmp_path: pathlib.Path) -> None:
    """DeleteJob while the driver is down cannot clean the job up (JobManager deletes it
    anyway). Once the driver is back, a job of the same id is a new job: it runs, and it
    never takes the deleted job's end (the restarted driver still has the old attempt's
    record: same id, attempt 1, another uid)."""
    marker = tmp_path / "runs"
    spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[job_pb2.ReplicaGroup(
        role="main", replicas=1, command=["/bin/sh", "-c", 'echo ran >> "$0"'], args=[str(marker)])])
    job_id = f"again-{uuid.uuid4().hex[:8]}"
    assert stack.jm is not None
    async with JobManagerClient(stack.jm.address) as jm:
        first = (await jm.submit_job(spec, job_id=job_id)).job
        done = await _until(jm, first.name, lambda j: j.state == job_pb2.JOB_STATE_SUCCEEDED)
        stack.driver.kill()
        await jm.delete_job(first.name)  # its cleanup fails: the driver is down
        await asyncio.to_thread(stack.driver.start)
        second = (await jm.submit_job(spec, job_id=job_id)).job
        assert second.uid != first.uid
        again = await _until(jm, second.name, lambda j: j.state in (
            job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_STOPPED))
        assert again.state == job_pb2.JOB_STATE_SUCCEEDED, (again.reason, again.message)
        assert again.backend_job_id and done.backend_job_id
    assert marker.read_text().splitlines() == ["ran", "ran"]


async def _delete_an_ended_job_while_its_driver_is_down(stack: Stack) -> tuple[str, pathlib.Path]:
    """A job run to its end, its driver killed, then DeleteJob (whose clean-up fails): the
    job's name and its files on the driver's host, still there."""
    spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[job_pb2.ReplicaGroup(
        role="main", replicas=1, command=["/bin/echo", "done"])])
    job_id = f"leftover-{uuid.uuid4().hex[:8]}"
    state_dir = pathlib.Path(stack.driver.args[stack.driver.args.index("--state-dir") + 1])
    assert stack.jm is not None
    async with JobManagerClient(stack.jm.address) as jm:
        first = (await jm.submit_job(spec, job_id=job_id)).job
        await _until(jm, first.name, lambda j: j.state == job_pb2.JOB_STATE_SUCCEEDED)
        files = state_dir / "jobs" / job_id
        assert files.is_dir()
        stack.driver.kill()
        await jm.delete_job(first.name)  # its cleanup fails now: the driver is down
        assert files.is_dir()
    return first.name, files


async def test_an_ended_job_deleted_while_its_driver_is_down_is_cleaned_up_once_it_is_back(
        stack: Stack) -> None:
    """DeleteJob of an ended job while its driver is down: the delete goes through, and its
    clean-up (the attempt's files here; pods, an MPI job's SSH key elsewhere) is retried until
    the driver is back, not given up."""
    _, files = await _delete_an_ended_job_while_its_driver_is_down(stack)
    await asyncio.to_thread(stack.driver.start)
    await _wait_for(lambda: not files.exists(), "the deleted job's files are removed", within=120)


async def test_a_pending_clean_up_outlives_the_job_manager_that_deleted_the_job(stack: Stack) -> None:
    """As above, but the JobManager that took the delete is SIGKILLed before the driver is
    back: the clean-up was recorded in etcd with the delete, and the next JobManager runs it
    (it was retried in the killed process's memory only: the files stayed for good)."""
    name, files = await _delete_an_ended_job_while_its_driver_is_down(stack)
    await asyncio.to_thread(stack.restart_jm)  # SIGKILL, then a new JobManager
    assert stack.jm is not None
    await asyncio.to_thread(stack.driver.start)
    await _wait_for(lambda: not files.exists(), "the deleted job's files are removed", within=120)
    async with aetcd.Client(host="127.0.0.1", port=stack.etcd.client_port) as etcd:  # its record goes
        deadline = time.monotonic() + 60
        while await etcd.get_prefix(f"{stack.prefix}job-cleanups/".encode(), keys_only=True):
            assert time.monotonic() < deadline, "the clean-up's record stays in etcd"
            await asyncio.sleep(0.2)
    async with JobManagerClient(stack.jm.address) as jm:  # its id is free; nothing else came back
        with pytest.raises(DlschedRpcError) as gone:
            await jm.get_job(name)
        assert gone.value.code == "NOT_FOUND"


async def test_a_stop_answers_stopping_while_the_driver_is_frozen(stack: Stack, tmp_path: pathlib.Path) -> None:
    """StopJob while the job's driver is frozen (SIGSTOP): the stop is stored, the call answers
    STOPPING within its deadline (the terminate retried in the background) rather than wait
    for the driver and fail DEADLINE_EXCEEDED; once the driver runs again the job is STOPPED."""
    spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[job_pb2.ReplicaGroup(
        role="main", replicas=1, command=["/bin/sh", "-c", "while :; do sleep 0.2; done"])])
    assert stack.jm is not None and stack.driver.proc is not None
    async with JobManagerClient(stack.jm.address) as jm:
        name = (await jm.submit_job(spec)).job.name
        await _until(jm, name, lambda j: j.state == job_pb2.JOB_STATE_RUNNING)
        os.kill(stack.driver.proc.pid, signal.SIGSTOP)
        try:
            async with security.channel(stack.jm.address) as ch:
                stub = job_manager_service_pb2_grpc.JobManagerServiceStub(ch)
                resp = await stub.StopJob(job_manager_service_pb2.StopJobRequest(name=name), timeout=20)
            assert resp.job.state == job_pb2.JOB_STATE_STOPPING, resp.job
        finally:
            os.kill(stack.driver.proc.pid, signal.SIGCONT)
        await _until(jm, name, lambda j: j.state == job_pb2.JOB_STATE_STOPPED, within=120)


async def test_a_running_job_deleted_while_its_driver_is_down_is_stopped_before_it_goes(
        stack: Stack, tmp_path: pathlib.Path) -> None:
    """DeleteJob of a running job whose driver cannot be reached: JobManager cannot stop it, so
    it keeps the record (STOPPING, UNAVAILABLE JOB_STOP_PENDING to the caller) rather than
    delete it and leave the process running with nothing left to ever stop it. Once the
    driver is back the stop goes through, the process ends, and the job is deleted as asked,
    with no second DeleteJob, though the JobManager that took the call was SIGKILLed
    meanwhile (the delete is recorded in etcd; the record stayed STOPPED for good)."""
    pid_file = tmp_path / "pid"
    script = 'echo $$ > "$0"; while :; do sleep 0.2; done'
    spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[job_pb2.ReplicaGroup(
        role="main", replicas=1, command=["/bin/sh", "-c", script], args=[str(pid_file)])])
    assert stack.jm is not None
    async with JobManagerClient(stack.jm.address) as jm:
        name = (await jm.submit_job(spec)).job.name
        await _until(jm, name, lambda j: j.state == job_pb2.JOB_STATE_RUNNING)
        await _wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), "the job's pid")
        pid = int(pid_file.read_text())
        stack.driver.kill()
        with pytest.raises(DlschedRpcError) as ei:
            await jm.delete_job(name)
        assert (ei.value.code, ei.value.reason) == ("UNAVAILABLE", "JOB_STOP_PENDING"), ei.value
        kept = await jm.get_job(name)
        assert kept.state == job_pb2.JOB_STATE_STOPPING
        assert pid_alive(pid)  # nothing has stopped it yet: the record must stay
    await asyncio.to_thread(stack.restart_jm)  # SIGKILL, then a new JobManager
    await asyncio.to_thread(stack.driver.start)
    await _wait_for(lambda: not pid_alive(pid), "the job's process ends", within=120)
    async with JobManagerClient(stack.jm.address) as jm:
        deadline = time.monotonic() + 120
        while True:
            try:
                job = await jm.get_job(name)
            except DlschedRpcError as e:
                assert e.code == "NOT_FOUND", e
                break
            assert time.monotonic() < deadline, f"still there: {job_pb2.JobState.Name(job.state)}"
            await asyncio.sleep(0.3)


async def test_services_started_before_etcd_wait_for_it() -> None:
    """ClusterManager and JobManager started (or restarted by their supervisor) while etcd is
    down wait for it and then serve, instead of exiting with a traceback (which `dlsched up`
    took for the stack failing, and Kubernetes for a crash loop)."""
    etcd = EtcdServer()  # its ports chosen, not started yet
    prefix = f"/late-etcd-{uuid.uuid4().hex[:8]}/"
    cm = ServiceProcess("cluster_manager", [*etcd.service_args(), "--prefix", prefix], name="cluster-manager")
    jm: ServiceProcess | None = None
    try:
        cm_up = asyncio.create_task(asyncio.to_thread(cm.start, 120))
        await asyncio.sleep(3)
        assert not cm_up.done() and cm.proc is not None and cm.proc.poll() is None  # waiting, alive
        assert "waiting for it" in cm.log()
        etcd.start()
        await cm_up
        jm = ServiceProcess("job_manager", [*etcd.service_args(), "--prefix", prefix,
                                            "--cluster-manager", cm.address], name="job-manager")
        etcd.proc.kill()  # type: ignore[union-attr]  # down again: JobManager starts meanwhile
        etcd.proc.wait()  # type: ignore[union-attr]
        jm_up = asyncio.create_task(asyncio.to_thread(jm.start, 120))
        await asyncio.sleep(3)
        assert not jm_up.done() and jm.proc is not None and jm.proc.poll() is None
        restart_on_same_data(etcd)
        await jm_up
        async with JobManagerClient(jm.address) as c:
            assert list(await c.list_all_jobs()) == []
            with pytest.raises(DlschedRpcError) as ei:
                await c.get_job("jobs/nope")
            assert ei.value.code == "NOT_FOUND"
    finally:
        for p in (jm, cm):
            if p is not None:
                p.stop()
        etcd.stop()


def restart_on_same_data(etcd: EtcdServer) -> None:
    """Start ``etcd`` again (same ports and data dir) after its process was killed."""
    data = etcd.dir
    etcd.start()
    assert etcd.dir == data


async def test_reads_of_a_job_whose_driver_is_frozen_are_unavailable_naming_the_cluster(stack: Stack) -> None:
    """GetJobUsage while the job's driver is frozen (SIGSTOP), by clients on the shipped service
    config (a 30 s deadline of the client's own that no server sees, UNAVAILABLE retried): the
    answer is UNAVAILABLE DRIVER_UNAVAILABLE naming the cluster, within that deadline. JobManager
    waited 30 s for the driver, so the client's own bare DEADLINE_EXCEEDED came first. A log
    read without follow ends the same way (it waited for the driver for ever)."""
    spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[job_pb2.ReplicaGroup(
        role="main", replicas=1, command=["/bin/sh", "-c", "echo hi; while :; do sleep 0.2; done"])])
    assert stack.jm is not None and stack.driver.proc is not None
    driver = stack.driver.proc.pid
    async with JobManagerClient(stack.jm.address) as jm, security.channel(stack.jm.address) as ch:
        stub = job_manager_service_pb2_grpc.JobManagerServiceStub(ch)  # a bare stub: the config alone
        name = (await jm.submit_job(spec)).job.name
        await _until(jm, name, lambda j: j.state == job_pb2.JOB_STATE_RUNNING)
        await _wait_for_usage(jm, name)
        os.kill(driver, signal.SIGSTOP)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as logs:  # what is there, no follow
                async for _ in stub.StreamJobLogs(job_manager_service_pb2.StreamJobLogsRequest(name=name),
                                                  timeout=60):
                    pass
        finally:
            os.kill(driver, signal.SIGCONT)
        await _wait_for_usage(jm, name)  # the driver answers again: the silence is forgotten
        os.kill(driver, signal.SIGSTOP)
        try:
            with pytest.raises(DlschedRpcError) as sdk:  # the SDK: the config's deadline and its own
                await jm.get_job_usage(name)
            with pytest.raises(grpc.aio.AioRpcError) as bare:
                await stub.GetJobUsage(job_manager_service_pb2.GetJobUsageRequest(name=name))
        finally:
            os.kill(driver, signal.SIGCONT)
        assert (sdk.value.code, sdk.value.reason) == ("UNAVAILABLE", "DRIVER_UNAVAILABLE"), sdk.value
        assert sdk.value.metadata.get("cluster") == "clusters/local", sdk.value.metadata
        for e in (logs.value, bare.value):
            err = DlschedRpcError.from_rpc_error(e)
            assert (err.code, err.reason, err.metadata.get("cluster")) == (
                "UNAVAILABLE", "DRIVER_UNAVAILABLE", "clusters/local"), err
        await _wait_for_usage(jm, name)
        texts = [e.text async for e in jm.stream_job_logs(name)]
        assert texts == ["hi"], texts


async def _wait_for_usage(jm: JobManagerClient, name: str, within: float = 90.0) -> None:
    deadline = time.monotonic() + within
    while True:
        try:
            assert (await jm.get_job_usage(name)).HasField("sample_time")
            return
        except DlschedRpcError as e:
            assert e.code == "UNAVAILABLE" and time.monotonic() < deadline, e
        await asyncio.sleep(0.5)
