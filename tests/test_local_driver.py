"""The local driver, as a real process over real gRPC, running real jobs."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence

import grpc
import pytest

from dlsched.kit.rpc_errors import error_info, field_violations
from dlsched.v1 import driver_service_pb2 as dpb
from dlsched.v1 import driver_service_pb2_grpc, job_pb2
from drivers.common import base
from drivers.local import render
from tests import security
from tests.harness import ServiceProcess, pid_alive

PY = sys.executable
CLUSTER = "clusters/local"
GOLDEN = pathlib.Path(__file__).parent / "golden" / "local"
TERMINAL = (job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_STOPPED)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def state_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="dlsched-local-test-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def driver(state_dir: str) -> Iterator[ServiceProcess]:
    svc = ServiceProcess("drivers.local", ["--state-dir", state_dir, "--grace-seconds", "3"],
                         name="local-driver").start()
    yield svc
    svc.stop()


@pytest.fixture
async def stub(driver: ServiceProcess) -> AsyncIterator[driver_service_pb2_grpc.DriverServiceStub]:
    async with security.channel(driver.address) as ch:
        s = driver_service_pb2_grpc.DriverServiceStub(ch)
        await s.ConfigureCluster(dpb.ConfigureClusterRequest(cluster=CLUSTER), timeout=10)
        yield s


_ids = iter(range(10**6))


def new_id(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{next(_ids)}"


def group(code: str, *, role: str = "main", replicas: int = 1, ppr: int = 0,
          env: dict[str, str] | None = None, working_dir: str = "",
          cpu: float = 0.0) -> job_pb2.ReplicaGroup:
    return job_pb2.ReplicaGroup(role=role, replicas=replicas, processes_per_replica=ppr,
                                command=[PY, "-u", "-c"], args=[code], env=env or {},
                                working_dir=working_dir, resources=job_pb2.Resources(cpu=cpu))


def single(code: str, **kw: object) -> job_pb2.JobSpec:
    return job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[group(code, **kw)])  # type: ignore[arg-type]


def multi(code: str, *, replicas: int = 1, ppr: int = 0, **kw: object) -> job_pb2.JobSpec:
    return job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_MULTI_PROCESS,
                           replica_groups=[group(code, role="worker", replicas=replicas, ppr=ppr, **kw)])  # type: ignore[arg-type]


async def launch(stub: driver_service_pb2_grpc.DriverServiceStub, job_id: str, spec: job_pb2.JobSpec,
                 attempt: int = 1, cluster: str = CLUSTER) -> dpb.LaunchJobResponse:
    return await stub.LaunchJob(dpb.LaunchJobRequest(cluster=cluster, job_id=job_id, spec=spec,
                                                     attempt=attempt), timeout=10)


async def observe(stub: driver_service_pb2_grpc.DriverServiceStub, job_id: str,
                  cluster: str = CLUSTER) -> dpb.JobObservation:
    resp = await stub.BatchGetJobObservations(
        dpb.BatchGetJobObservationsRequest(cluster=cluster, jobs=[dpb.JobRef(job_id=job_id)]), timeout=10)
    return resp.observations[0]


async def wait_state(stub: driver_service_pb2_grpc.DriverServiceStub, job_id: str,
                     states: Sequence[int] = TERMINAL, within: float = 15.0,
                     cluster: str = CLUSTER) -> dpb.JobObservation:
    deadline = time.monotonic() + within
    while True:
        obs = await observe(stub, job_id, cluster)
        if obs.state in states:
            return obs
        if time.monotonic() > deadline:
            raise AssertionError(f"{job_id} still {job_pb2.JobState.Name(obs.state)}: {obs}")
        await asyncio.sleep(0.03)


async def logs(stub: driver_service_pb2_grpc.DriverServiceStub, job_id: str,
               cluster: str = CLUSTER, **kw: object) -> list[job_pb2.LogEntry]:
    req = dpb.TailJobLogsRequest(cluster=cluster, job=dpb.JobRef(job_id=job_id), **kw)  # type: ignore[arg-type]
    out: list[job_pb2.LogEntry] = []
    async for resp in stub.TailJobLogs(req, timeout=20):
        out.extend(resp.entries)
    return out


def texts(entries: Sequence[job_pb2.LogEntry], stream: int = job_pb2.LOG_STREAM_STDOUT) -> list[str]:
    return [e.text for e in entries if e.stream == stream]


# --------------------------------------------------------------------------- clusters


async def test_configure_cluster_reports_ready_with_host_capacity(stub):
    resp = await stub.GetClusterInfo(dpb.GetClusterInfoRequest(cluster="local"), timeout=10)
    info = resp.info
    assert info.state == 2  # CLUSTER_STATE_READY
    assert info.capacity.nodes_total == 1
    assert info.capacity.cpus_total == os.cpu_count()
    assert info.capacity.max_cpus_per_node == os.cpu_count()
    assert info.capacity.memory_bytes_total > 0
    assert 0 < info.capacity.memory_bytes_free <= info.capacity.memory_bytes_total
    assert list(info.supported_run_modes)[:4] == [1, 2, 3, 4]  # MPI (5) too when mpirun is installed
    assert info.driver_version.startswith("local/")
    if shutil.which("nvidia-smi") is None:
        assert info.capacity.gpus_total == 0


async def test_unknown_cluster_is_failed_precondition_cluster_not_configured(stub):
    calls = [
        stub.GetClusterInfo(dpb.GetClusterInfoRequest(cluster="clusters/nope"), timeout=10),
        stub.LaunchJob(dpb.LaunchJobRequest(cluster="clusters/nope", job_id="x", attempt=1,
                                            spec=single("pass")), timeout=10),
        stub.BatchGetJobObservations(dpb.BatchGetJobObservationsRequest(cluster="clusters/nope"), timeout=10),
    ]
    for call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await call
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        info = error_info(ei.value)
        assert info is not None and info.reason == "CLUSTER_NOT_CONFIGURED"
        assert info.domain == "dlsched.io"
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        async for _ in stub.WatchJobObservations(dpb.WatchJobObservationsRequest(cluster="nope"), timeout=10):
            pass
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(ei.value).reason == "CLUSTER_NOT_CONFIGURED"


# --------------------------------------------------------------------------- running jobs


async def test_single_process_job_succeeds_with_planner_and_user_env(stub, tmp_path):
    job_id = new_id("single")
    code = ("import os\n"
            "for k in ('DLSCHED_JOB_ID','DLSCHED_JOB_NAME','DLSCHED_ROLE','DLSCHED_REPLICA_INDEX',"
            "'DLSCHED_NUM_REPLICAS','FOO','RANK'):\n"
            "    print(f'{k}={os.environ.get(k)}')\n"
            "print('CWD=' + os.getcwd())\n")
    resp = await launch(stub, job_id, single(code, env={"FOO": "bar baz"}, working_dir=str(tmp_path)))
    assert resp.backend_job_id == f"local-{job_id}-1"
    assert resp.native_spec.media_type == "application/json"
    obs = await wait_state(stub, job_id)
    assert obs.state == job_pb2.JOB_STATE_SUCCEEDED
    assert obs.HasField("exit_code") and obs.exit_code == 0
    assert obs.attempt == 1 and obs.found
    assert obs.start_time.seconds > 0 and obs.end_time.seconds > 0
    [rep] = obs.replicas
    assert (rep.role, rep.index, rep.state, rep.exit_code) == ("main", 0, job_pb2.REPLICA_STATE_SUCCEEDED, 0)
    assert rep.host == socket.gethostname()
    out = texts(await logs(stub, job_id))
    assert f"DLSCHED_JOB_ID={job_id}" in out
    assert f"DLSCHED_JOB_NAME=jobs/{job_id}" in out
    assert "DLSCHED_ROLE=main" in out
    assert "DLSCHED_REPLICA_INDEX=0" in out
    assert "DLSCHED_NUM_REPLICAS=1" in out
    assert "FOO=bar baz" in out
    assert "RANK=None" in out  # no torch.distributed variables for a single process
    assert f"CWD={tmp_path}" in out


async def test_failing_job_reports_failed_with_exit_code(stub):
    job_id = new_id("fail")
    await launch(stub, job_id, single("import sys; print('boom', file=sys.stderr); sys.exit(3)"))
    obs = await wait_state(stub, job_id)
    assert obs.state == job_pb2.JOB_STATE_FAILED
    assert obs.exit_code == 3 and obs.reason == "NonZeroExit"
    assert obs.replicas[0].state == job_pb2.REPLICA_STATE_FAILED and obs.replicas[0].exit_code == 3
    assert texts(await logs(stub, job_id), job_pb2.LOG_STREAM_STDERR) == ["boom"]


async def test_missing_program_fails_to_start(stub):
    job_id = new_id("nostart")
    spec = single("pass")
    spec.replica_groups[0].command[:] = ["/nonexistent/program"]
    await launch(stub, job_id, spec)
    obs = await wait_state(stub, job_id)
    assert obs.state == job_pb2.JOB_STATE_FAILED
    assert obs.reason == "StartFailed" and obs.exit_code == 127


async def test_multi_process_job_gets_ranks_and_world_size(stub):
    job_id = new_id("multi")
    code = ("import os\n"
            "print(' '.join(f'{k}={os.environ[k]}' for k in ('RANK','WORLD_SIZE','LOCAL_RANK',"
            "'LOCAL_WORLD_SIZE','NODE_RANK','DLSCHED_REPLICA_INDEX','DLSCHED_NUM_REPLICAS',"
            "'MASTER_ADDR','MASTER_PORT')))\n")
    resp = await launch(stub, job_id, multi(code, replicas=3))
    port = json.loads(resp.native_spec.content)["processes"][0]["env"]["MASTER_PORT"]
    obs = await wait_state(stub, job_id)
    assert obs.state == job_pb2.JOB_STATE_SUCCEEDED
    assert sorted((r.role, r.index) for r in obs.replicas) == [("worker", 0), ("worker", 1), ("worker", 2)]
    entries = await logs(stub, job_id)
    by_index = {e.replica_index: e.text for e in entries}
    for rank in range(3):
        assert by_index[rank] == (f"RANK={rank} WORLD_SIZE=3 LOCAL_RANK={rank} LOCAL_WORLD_SIZE=3 "
                                  f"NODE_RANK=0 DLSCHED_REPLICA_INDEX={rank} DLSCHED_NUM_REPLICAS=3 "
                                  f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port}")
    assert int(port) > 0
    one = await logs(stub, job_id, replica_index=1)
    assert [e.replica_index for e in one] == [1]


async def test_multi_process_failure_stops_the_others_and_fails_the_job(stub):
    job_id = new_id("mfail")
    code = ("import os, sys, time\n"
            "if os.environ['RANK'] == '1':\n"
            "    sys.exit(4)\n"
            "time.sleep(30)\n")
    t0 = time.monotonic()
    await launch(stub, job_id, multi(code, ppr=3))
    obs = await wait_state(stub, job_id, within=10)
    assert time.monotonic() - t0 < 5
    assert obs.state == job_pb2.JOB_STATE_FAILED and obs.exit_code == 4 and obs.reason == "NonZeroExit"
    states = {r.index: (r.state, r.exit_code) for r in obs.replicas}
    assert states[1] == (job_pb2.REPLICA_STATE_FAILED, 4)
    assert states[0] == states[2] == (job_pb2.REPLICA_STATE_STOPPED, 128 + 15)


async def test_launch_is_idempotent_on_cluster_job_and_attempt(stub, tmp_path):
    job_id = new_id("dedup")
    marker = tmp_path / "runs.txt"
    spec = single(f"open({str(marker)!r}, 'a').write('ran\\n')")
    first, second = await asyncio.gather(launch(stub, job_id, spec), launch(stub, job_id, spec))
    third = await launch(stub, job_id, spec)
    assert first.backend_job_id == second.backend_job_id == third.backend_job_id
    await wait_state(stub, job_id)
    assert (await launch(stub, job_id, spec)).observation.state == job_pb2.JOB_STATE_SUCCEEDED
    await asyncio.sleep(0.2)
    assert marker.read_text() == "ran\n"
    # A lower attempt is refused; the next attempt runs again.
    again = await launch(stub, job_id, spec, attempt=2)
    assert again.backend_job_id == f"local-{job_id}-2"
    assert (await wait_state(stub, job_id)).attempt == 2
    assert marker.read_text() == "ran\nran\n"
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await launch(stub, job_id, spec, attempt=1)
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(ei.value).reason == "STALE_ATTEMPT"


async def test_watch_sends_snapshot_marker_then_changes(stub):
    cluster = f"clusters/{new_id('w')}"
    await stub.ConfigureCluster(dpb.ConfigureClusterRequest(cluster=cluster), timeout=10)
    done_id = new_id("wdone")
    await launch(stub, done_id, single("pass"), cluster=cluster)
    await wait_state(stub, done_id, cluster=cluster)
    events: list[tuple[float, dpb.WatchJobObservationsResponse]] = []
    call = stub.WatchJobObservations(dpb.WatchJobObservationsRequest(cluster=cluster))
    it = call.__aiter__()

    async def next_event() -> dpb.WatchJobObservationsResponse:
        ev = await asyncio.wait_for(it.__anext__(), timeout=10)
        events.append((time.time(), ev))
        return ev

    first = await next_event()
    assert first.observation.job_id == done_id and first.observation.state == job_pb2.JOB_STATE_SUCCEEDED
    marker = await next_event()
    assert marker.snapshot_complete and not marker.HasField("observation")
    job_id = new_id("wnew")
    await launch(stub, job_id, single("import time; time.sleep(0.3); print(time.time())"), cluster=cluster)
    seen = []
    while True:
        ev = await next_event()
        assert ev.observation.job_id == job_id
        seen.append(ev.observation.state)
        if ev.observation.state in TERMINAL:
            break
    call.cancel()
    assert job_pb2.JOB_STATE_RUNNING in seen
    assert seen[-1] == job_pb2.JOB_STATE_SUCCEEDED
    # Freshness: the SUCCEEDED event arrived soon after the program printed its last line.
    exited_at = float(texts(await logs(stub, job_id, cluster))[0])
    assert events[-1][0] - exited_at < 0.5


async def test_logs_follow_arrive_line_by_line_and_end_with_the_job(stub):
    job_id = new_id("follow")
    code = "import time\nfor i in range(5):\n    print(f'{i} {time.time()}', flush=True)\n    time.sleep(0.3)\n"
    await launch(stub, job_id, single(code))
    arrivals: list[tuple[float, str]] = []
    req = dpb.TailJobLogsRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job_id), follow=True)

    async def follow() -> None:
        async for resp in stub.TailJobLogs(req):
            for e in resp.entries:
                arrivals.append((time.time(), e.text))

    await asyncio.wait_for(follow(), timeout=10)  # the stream ends by itself when the job ends
    obs = await observe(stub, job_id)
    assert obs.state == job_pb2.JOB_STATE_SUCCEEDED
    assert [t.split()[0] for _, t in arrivals] == ["0", "1", "2", "3", "4"]
    end = obs.end_time.seconds + obs.end_time.nanos / 1e9
    assert arrivals[0][0] < end - 1.0  # the first line came while the job still ran
    latencies = sorted(at - float(t.split()[1]) for at, t in arrivals)
    assert latencies[len(latencies) // 2] < 0.1, latencies
    assert latencies[-1] < 0.25, latencies


async def test_tail_lines_since_time_and_stream_filters(stub):
    job_id = new_id("tail")
    code = ("import sys, time\n"
            "for i in range(1, 6): print(f'line-{i}')\n"
            "sys.stdout.flush(); time.sleep(0.2)\n"
            "for i in range(6, 11): print(f'line-{i}')\n"
            "print('err-1', file=sys.stderr); print('err-2', file=sys.stderr)\n")
    await launch(stub, job_id, single(code))
    await wait_state(stub, job_id)
    everything = await logs(stub, job_id)
    assert texts(everything) == [f"line-{i}" for i in range(1, 11)]
    last = await logs(stub, job_id, tail_lines=3)
    assert texts(last) == ["line-8", "line-9", "line-10"]
    assert texts(last, job_pb2.LOG_STREAM_STDERR) == ["err-1", "err-2"]
    only_err = await logs(stub, job_id, streams=[job_pb2.LOG_STREAM_STDERR])
    assert {e.stream for e in only_err} == {job_pb2.LOG_STREAM_STDERR} and len(only_err) == 2
    line6 = next(e for e in everything if e.text == "line-6")
    since = await logs(stub, job_id, since_time=line6.time, streams=[job_pb2.LOG_STREAM_STDOUT])
    assert texts(since) == [f"line-{i}" for i in range(6, 11)]
    assert await logs(stub, job_id, role="other") == []


async def test_terminate_kills_process_groups_that_ignore_sigterm(stub):
    job_id = new_id("term")
    code = ("import os, signal, subprocess, sys, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
            "print(os.getpid(), child.pid, flush=True)\n"
            "time.sleep(60)\n")
    await launch(stub, job_id, multi(code, ppr=3))
    pids: list[int] = []
    req = dpb.TailJobLogsRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job_id), follow=True)
    call = stub.TailJobLogs(req)
    async for resp in call:
        for e in resp.entries:
            pids.extend(int(p) for p in e.text.split())
        if len(pids) == 6:
            break
    call.cancel()
    assert all(pid_alive(p) for p in pids)
    t0 = time.monotonic()
    resp = await stub.TerminateJob(dpb.TerminateJobRequest(
        cluster=CLUSTER, job=dpb.JobRef(job_id=job_id), grace_period={"seconds": 1}), timeout=10)
    assert resp.observation.state == job_pb2.JOB_STATE_STOPPING
    while True:
        if not any(pid_alive(p) for p in pids) or time.monotonic() - t0 > 3:
            break
        await asyncio.sleep(0.02)
    gone_after = time.monotonic() - t0
    assert not any(pid_alive(p) for p in pids)
    assert 0.9 < gone_after < 2.0, gone_after
    obs = await wait_state(stub, job_id, within=3)
    assert obs.state == job_pb2.JOB_STATE_STOPPED
    assert {(r.state, r.exit_code) for r in obs.replicas} == {(job_pb2.REPLICA_STATE_STOPPED, 128 + 9)}
    # Idempotent: stopping an ended job, or an unknown one, succeeds.
    again = await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job_id)), timeout=10)
    assert again.observation.state == job_pb2.JOB_STATE_STOPPED
    unknown = await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=dpb.JobRef(job_id="nosuchjob")), timeout=10)
    assert not unknown.observation.found


async def test_usage_reports_cpu_and_memory_of_a_busy_process(stub):
    job_id = new_id("usage")
    code = "import time\nt = time.time()\nwhile time.time() - t < 1.0: pass\ntime.sleep(30)\n"
    await launch(stub, job_id, single(code))
    deadline = time.monotonic() + 5
    while True:
        resp = await stub.MeasureJobUsage(dpb.MeasureJobUsageRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job_id)), timeout=10)
        [u] = resp.usage.replicas
        if u.cpu_seconds > 0.3 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert u.running and u.cpu_seconds > 0.3
    assert u.memory_bytes > 1 << 20 and u.peak_memory_bytes >= u.memory_bytes
    assert (u.role, u.replica_index) == ("main", 0)
    await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job_id),
                                                    grace_period={}), timeout=10)
    await wait_state(stub, job_id)
    resp = await stub.MeasureJobUsage(dpb.MeasureJobUsageRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job_id)), timeout=10)
    assert not resp.usage.replicas[0].running


async def test_cleanup_removes_files_and_is_idempotent(stub, state_dir):
    job_id = new_id("clean")
    await launch(stub, job_id, single("print('x')"))
    await wait_state(stub, job_id)
    jdir = pathlib.Path(state_dir) / "jobs" / job_id
    assert (jdir / "attempt-1" / "main-0.stdout").exists()
    for _ in range(2):
        await stub.CleanupJob(dpb.CleanupJobRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job_id)), timeout=10)
    assert not jdir.exists()
    assert not (await observe(stub, job_id)).found


# --------------------------------------------------------------------------- validation


async def test_bad_ids_are_invalid_argument_naming_the_field(stub):
    cases = [
        ("job_id", dpb.LaunchJobRequest(cluster=CLUSTER, job_id="../etc", attempt=1, spec=single("pass"))),
        ("job_id", dpb.LaunchJobRequest(cluster=CLUSTER, job_id="Upper", attempt=1, spec=single("pass"))),
        ("attempt", dpb.LaunchJobRequest(cluster=CLUSTER, job_id="ok", attempt=0, spec=single("pass"))),
        ("spec.replica_groups[0].role",
         dpb.LaunchJobRequest(cluster=CLUSTER, job_id="ok", attempt=1, spec=single("pass", role="Main/x"))),
        ("spec.replica_groups[0].env['DLSCHED_X']",
         dpb.LaunchJobRequest(cluster=CLUSTER, job_id="ok", attempt=1, spec=single("pass", env={"DLSCHED_X": "1"}))),
        ("spec.replica_groups[0].replicas",
         dpb.LaunchJobRequest(cluster=CLUSTER, job_id="ok", attempt=1, spec=single("pass", replicas=2))),
    ]
    for field, req in cases:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.LaunchJob(req, timeout=10)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert error_info(ei.value).metadata["field"] == field
        assert field in [v.field for v in field_violations(ei.value)]
    assert not (await observe(stub, "ok")).found


async def test_run_mode_structure_is_invalid_argument(stub):
    spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_PS_WORKER, replica_groups=[group("pass", role="worker")])
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await launch(stub, new_id("ps"), spec)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(ei.value).metadata["field"] == "spec.replica_groups"


# --------------------------------------------------------------------------- render


def _golden_spec(mode: str) -> base.JobSpec:
    if mode == "single":
        g = base.ReplicaGroup(role="main", replicas=1, command=("python", "train.py"), args=("--lr", "0.1"),
                              env={"FOO": "bar"}, working_dir="/work/project")
        return base.JobSpec(run_mode=base.RunMode.SINGLE_PROCESS, replica_groups=(g,))
    g = base.ReplicaGroup(role="worker", replicas=2, processes_per_replica=2, command=("python", "-m", "ddp"),
                          env={"NCCL_DEBUG": "INFO"}, resources=base.Resources(cpu=2, gpus=1))
    return base.JobSpec(run_mode=base.RunMode.MULTI_PROCESS, replica_groups=(g,), time_limit_seconds=3600)


@pytest.mark.parametrize("mode", ["single", "multi"])
def test_render_matches_golden_file(mode):
    plan = render.plan_job("train-1", _golden_spec(mode), attempt=1, state_dir="/var/lib/dlsched/local")
    got = render.to_native_spec(plan)
    assert got.media_type == "application/json"
    path = GOLDEN / f"{mode}_process.json"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(got.content)
    assert got.content == path.read_text()


async def test_render_job_over_grpc_is_the_launch_plan(stub, state_dir):
    spec = multi("pass", replicas=2)
    resp = await stub.RenderJob(dpb.RenderJobRequest(cluster=CLUSTER, job_id="render-me", spec=spec), timeout=10)
    assert resp.native_spec.media_type == "application/json"
    doc = json.loads(resp.native_spec.content)
    assert [p["env"]["RANK"] for p in doc["processes"]] == ["0", "1"]
    assert doc["processes"][1]["stdout"] == os.path.join(state_dir, "jobs", "render-me", "attempt-1", "worker-1.stdout")
    assert "PATH" not in doc["processes"][0]["env"]  # the driver's own environment is not shown
    assert not (await observe(stub, "render-me")).found  # rendering runs nothing


# --------------------------------------------------------------------------- restart


async def test_restarted_driver_keeps_ended_jobs_and_fails_lost_ones(tmp_path):
    state = str(tmp_path / "state")
    marker = tmp_path / "runs.txt"
    svc = ServiceProcess("drivers.local", ["--state-dir", state], name="local-driver-restart").start()
    try:
        async with security.channel(svc.address) as ch:
            s = driver_service_pb2_grpc.DriverServiceStub(ch)
            await s.ConfigureCluster(dpb.ConfigureClusterRequest(cluster=CLUSTER), timeout=10)
            spec = single(f"open({str(marker)!r}, 'a').write('ran\\n')")
            await launch(s, "done-job", spec)
            await wait_state(s, "done-job")
            await launch(s, "lost-job", single("import os, time; print(os.getpid(), flush=True); time.sleep(60)"))
            await wait_state(s, "lost-job", [job_pb2.JOB_STATE_RUNNING])
            await asyncio.sleep(0.2)
            pid = int(texts(await logs(s, "lost-job"))[0])
        svc.kill()
        svc.start()
        async with security.channel(svc.address) as ch:
            s = driver_service_pb2_grpc.DriverServiceStub(ch)
            await s.ConfigureCluster(dpb.ConfigureClusterRequest(cluster=CLUSTER), timeout=10)
            done = await observe(s, "done-job")
            assert done.state == job_pb2.JOB_STATE_SUCCEEDED and done.exit_code == 0
            again = await launch(s, "done-job", spec)
            assert again.backend_job_id == "local-done-job-1"
            lost = await observe(s, "lost-job")
            assert lost.state == job_pb2.JOB_STATE_FAILED and lost.reason == "DriverRestarted"
            assert not pid_alive(pid)
        assert marker.read_text() == "ran\n"
    finally:
        svc.stop()


async def test_health_serving_and_reflection_lists_the_driver_service(driver: ServiceProcess):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async with security.channel(driver.address) as ch:
        h = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="dlsched.v1.DriverService"), timeout=10)
        assert h.status == health_pb2.HealthCheckResponse.SERVING
        call = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = [s.name async for r in call for s in r.list_services_response.service]
        assert "dlsched.v1.DriverService" in names
