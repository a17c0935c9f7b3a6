# ruff: noqa: ASYNC109, ASYNC110, ASYNC230, ASYNC240  -- tests poll a real Ray head, files and /proc
"""Ray jobs through the services only: a real Ray head (tests/ray_head.py), the Ray
driver as a process, ClusterManager and JobManager over a real etcd, cluster
``ray`` registered with CreateCluster; every job is submitted, watched, tailed
and stopped through JobManagerService alone.

The Ray head runs on this machine, so the replicas' probes write what they saw
as JSON files into the test's tmp dir (the #3 contract, docs/ENVIRONMENT.md).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from dlsched.kit.rpc_errors import error_info, precondition_violations
from dlsched.v1 import cluster_manager_service_pb2 as cm_pb
from dlsched.v1 import cluster_manager_service_pb2_grpc as cm_grpc
from dlsched.v1 import cluster_pb2, job_pb2
from dlsched.v1 import job_manager_service_pb2 as jpb
from dlsched.v1 import job_manager_service_pb2_grpc as jm_grpc
from tests import security
from tests.harness import EtcdServer, ServiceProcess, Stack
from tests.ray_head import RayHead, started_driver, started_head
from tests.through_services import (
    TERMINAL,
    Run,
    assert_one_torch_world,
    cleanup,
    new_id,
    probe_group,
    probes,
    wait_dead,
)
from tests.through_services import run_to_end as run_spec_to_end

S = job_pb2
PY = sys.executable
CLUSTER = "clusters/ray"
JOB_TIMEOUT = 120.0  # the Ray head is slow on 2 cores; a placement group job with torch takes ~20 s
IN_CI = os.environ.get("CI") == "true"


def needs(module: str) -> pytest.MarkDecorator:
    """Skip when ``module`` is missing, except in CI, where a missing one fails."""
    missing = importlib.util.find_spec(module) is None
    return pytest.mark.skipif(missing and not IN_CI, reason=f"{module} is not installed")


pytestmark = needs("aiohttp")  # the Ray driver's HTTP client (pip install -e '.[ray]')


# --------------------------------------------------------------------------- fixtures: one head, one stack


@pytest.fixture(scope="module")
def head() -> Iterator[RayHead]:
    yield from started_head(IN_CI)


@pytest.fixture(scope="module")
def ray_driver(head: RayHead) -> Iterator[ServiceProcess]:
    yield from started_driver("ray-driver-services")


@pytest.fixture(scope="module")
def stack(etcd: EtcdServer, head: RayHead, ray_driver: ServiceProcess) -> Iterator[Stack]:
    """ClusterManager + JobManager (and the local driver Stack brings) with ``clusters/ray`` READY."""
    st = Stack(etcd, f"/dlsched-ray-services-{uuid.uuid4().hex[:8]}/", jm_args=["--stop-grace-seconds", "2"])
    try:
        st.start()
        with security.sync_channel(st.cm.address) as ch:
            cm = cm_grpc.ClusterManagerServiceStub(ch)
            cm.CreateCluster(cm_pb.CreateClusterRequest(
                cluster_id="ray", request_id=f"register-ray-{uuid.uuid4().hex[:8]}",
                cluster=cluster_pb2.Cluster(type=S.CLUSTER_TYPE_RAY, address=head.address,
                                            driver_address=ray_driver.address, options={"python": PY})),
                timeout=20)
            deadline = time.monotonic() + 60
            while (c := cm.GetCluster(cm_pb.GetClusterRequest(name=CLUSTER), timeout=10).cluster).state != \
                    cluster_pb2.CLUSTER_STATE_READY:
                assert time.monotonic() < deadline, f"{CLUSTER} never READY: {c}"
                time.sleep(0.3)
            assert c.type == S.CLUSTER_TYPE_RAY and S.RUN_MODE_MPI not in c.supported_run_modes, c
    except BaseException:
        st.stop()
        raise
    yield st
    st.stop()


@pytest.fixture
async def jm(stack: Stack) -> AsyncIterator[jm_grpc.JobManagerServiceStub]:
    assert stack.jm is not None
    async with security.channel(stack.jm.address) as ch:
        yield jm_grpc.JobManagerServiceStub(ch)


# --------------------------------------------------------------------------- helpers


def on_ray(mode: int, *groups: S.ReplicaGroup) -> S.JobSpec:
    """A spec whose selector names the Ray cluster (the local cluster could run it too)."""
    return S.JobSpec(run_mode=mode, replica_groups=list(groups),
                     cluster_selector=S.ClusterSelector(cluster="ray"))


def single(code: str, *args: str) -> S.JobSpec:
    return on_ray(S.RUN_MODE_SINGLE_PROCESS, S.ReplicaGroup(
        role="main", replicas=1, command=[PY, "-u", "-c", textwrap.dedent(code)], args=list(args)))


def run_of(jm: jm_grpc.JobManagerServiceStub, spec: S.JobSpec) -> Run:
    return Run(jm, spec, prefix="ray-svc", cluster=CLUSTER, job_timeout=JOB_TIMEOUT, submit_timeout=30)


@pytest.fixture
async def runs(jm: jm_grpc.JobManagerServiceStub) -> AsyncIterator[list[Run]]:
    """Runs made by a test; their watches are closed and unfinished jobs stopped after it."""
    made: list[Run] = []
    yield made
    await cleanup(jm, made)


async def run_to_end(jm: jm_grpc.JobManagerServiceStub, runs: list[Run], spec: S.JobSpec) -> tuple[Run, S.Job]:
    return await run_spec_to_end(run_of(jm, spec), runs)


# --------------------------------------------------------------------------- the run modes


async def test_single_process_succeeds_with_the_job_environment(jm, runs, tmp_path):
    r, job = await run_to_end(jm, runs, on_ray(S.RUN_MODE_SINGLE_PROCESS, probe_group("main", tmp_path)))
    assert job.state == S.JOB_STATE_SUCCEEDED and job.exit_code == 0, job
    assert job.cluster == CLUSTER and job.backend_job_id == f"dlsched-{r.id}-1_{job.uid.replace('-', '')}" and job.attempt == 1
    assert r.states[0] == S.JOB_STATE_PENDING and r.states[-1] == S.JOB_STATE_SUCCEEDED, r.states
    [env] = [p["env"] for p in probes(tmp_path)]
    assert (env["DLSCHED_JOB_ID"], env["DLSCHED_JOB_NAME"]) == (r.id, r.name)
    assert (env["DLSCHED_ROLE"], env["DLSCHED_REPLICA_INDEX"], env["DLSCHED_NUM_REPLICAS"]) == ("main", "0", "1")
    assert "probe main-0-" in [e.text for e in await r.logs()]


async def test_multi_process_every_rank_distinct_in_one_world(jm, runs, tmp_path):
    spec = on_ray(S.RUN_MODE_MULTI_PROCESS, probe_group("worker", tmp_path, replicas=2, ppr=2))
    r, job = await run_to_end(jm, runs, spec)
    assert job.state == S.JOB_STATE_SUCCEEDED, job
    envs = [p["env"] for p in probes(tmp_path)]
    assert len(envs) == 4
    assert_one_torch_world(envs, 4)
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}  # every process on the entrypoint's node
    entries = await r.logs(replica_index=3)
    assert [(e.role, e.replica_index, e.text) for e in entries] == [("worker", 3, "probe worker-1-3")]


# Each rank records what it saw and the all-reduced sum of (rank + 1) over the world.
ALL_REDUCE = """
import json, os, sys, torch, torch.distributed as dist
dist.init_process_group('gloo')
t = torch.tensor([float(os.environ['RANK']) + 1])
dist.all_reduce(t)
out = os.path.join(sys.argv[1], f"rank-{os.environ['RANK']}")
with open(out + '.tmp', 'w') as f:
    json.dump({'env': dict(os.environ), 'sum': t.item(), 'world': dist.get_world_size()}, f)
os.replace(out + '.tmp', out + '.json')
print('sum', int(t.item()), 'rank', os.environ['RANK'], flush=True)
dist.barrier()  # leave together, and skip gloo's teardown: it may abort a rank whose peers left (exit 134)
sys.stdout.flush()
os._exit(0)
"""


@needs("torch")
async def test_master_worker_gloo_all_reduce_across_replicas(jm, runs, tmp_path):
    def group(role: str, n: int) -> S.ReplicaGroup:
        return S.ReplicaGroup(role=role, replicas=n, command=[PY, "-c", textwrap.dedent(ALL_REDUCE), str(tmp_path)])

    r, job = await run_to_end(jm, runs, on_ray(S.RUN_MODE_MASTER_WORKER, group("worker", 2), group("master", 1)))
    if job.state != S.JOB_STATE_SUCCEEDED:
        pytest.fail(f"{job}\n" + "\n".join(e.text for e in await r.logs()))
    recs = probes(tmp_path)
    envs = [p["env"] for p in recs]
    assert len(envs) == 3
    assert_one_torch_world(envs, 3)
    assert [e["DLSCHED_ROLE"] for e in envs if e["RANK"] == "0"] == ["master"]  # the master holds rank 0
    assert {(p["sum"], p["world"]) for p in recs} == {(6.0, 3)}  # 1 + 2 + 3, reduced across the replicas
    sums = sorted((e.role, e.replica_index, e.text) for e in await r.logs() if e.text.startswith("sum "))
    assert sums == [("master", 0, "sum 6 rank 0"), ("worker", 0, "sum 6 rank 1"), ("worker", 1, "sum 6 rank 2")]


async def test_ps_worker_tf_config_and_parameter_servers_stopped_after_workers(jm, runs, tmp_path):
    spec = on_ray(S.RUN_MODE_PS_WORKER, probe_group("ps", tmp_path, replicas=2, PROBE_PS="forever"),
                  probe_group("worker", tmp_path, replicas=2, PROBE_AWAIT="4"))
    _, job = await run_to_end(jm, runs, spec)
    assert job.state == S.JOB_STATE_SUCCEEDED and job.exit_code == 0, job
    got = probes(tmp_path)
    configs = {(p["env"]["DLSCHED_ROLE"], int(p["env"]["DLSCHED_REPLICA_INDEX"])): json.loads(p["env"]["TF_CONFIG"])
               for p in got}
    assert sorted(configs) == [("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1)]
    cluster = configs[("ps", 0)]["cluster"]
    assert sorted(cluster) == ["ps", "worker"] and [len(cluster["ps"]), len(cluster["worker"])] == [2, 2]
    addrs = [a for tasks in cluster.values() for a in tasks]
    assert len(set(addrs)) == len(addrs)  # a port of its own per task
    for (role, index), c in configs.items():
        assert c == {"cluster": cluster, "task": {"type": role, "index": index}}  # same cluster, own task
    # The parameter servers never exit by themselves: the job succeeded on the workers and they were stopped.
    await wait_dead([p["pid"] for p in got])


async def test_mpi_is_refused_at_submit_and_nothing_is_stored(jm, tmp_path):
    spec = on_ray(S.RUN_MODE_MPI, probe_group("launcher", tmp_path), probe_group("worker", tmp_path))
    job_id = new_id("ray-mpi")
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await jm.SubmitJob(jpb.SubmitJobRequest(job_id=job_id, spec=spec), timeout=30)
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    info = error_info(ei.value)
    assert info is not None and info.reason == "NO_MATCHING_CLUSTER", info
    [(subject, why)] = precondition_violations(ei.value)  # the one cluster the selector names, and why not
    assert subject == CLUSTER and "MPI" in why, why
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await jm.GetJob(jpb.GetJobRequest(name=f"jobs/{job_id}"), timeout=10)
    assert error_info(ei.value).reason == "JOB_NOT_FOUND"


# --------------------------------------------------------------------------- logs, stop, failure


async def test_followed_logs_arrive_while_the_job_runs_and_end_after_it(jm, runs, tmp_path):
    go = tmp_path / "go"
    code = """
    import os, sys, time
    print('ready', flush=True)
    while not os.path.exists(sys.argv[1]):  # the test lets the job end only after it saw 'ready'
        time.sleep(0.05)
    print('done', flush=True)
    """
    r = run_of(jm, single(code, str(go)))
    runs.append(r)
    await r.submit()
    texts: list[str] = []
    req = jpb.StreamJobLogsRequest(name=r.name, follow=True)
    async for resp in jm.StreamJobLogs(req, timeout=JOB_TIMEOUT):
        for e in resp.entries:
            texts.append(e.text)
            if e.text == "ready":
                assert (await r.get()).state not in TERMINAL  # a line of a job that has not ended
                go.touch()
    # The stream ended OK, after the job's last line; Ray's own lines are not the job's output.
    assert texts == ["ready", "done"], texts
    job = await r.until()
    assert job.state == S.JOB_STATE_SUCCEEDED, job


async def test_stop_job_ends_a_running_job_stopped(jm, runs, tmp_path):
    r = run_of(jm, on_ray(S.RUN_MODE_SINGLE_PROCESS, probe_group("main", tmp_path, PROBE_MAIN="forever")))
    runs.append(r)
    await r.submit()
    await r.until((S.JOB_STATE_RUNNING,))
    deadline = time.monotonic() + 60
    while not (got := probes(tmp_path)):
        assert time.monotonic() < deadline, "the job's process never started"
        await asyncio.sleep(0.1)
    stopped = (await jm.StopJob(jpb.StopJobRequest(name=r.name), timeout=20)).job
    assert stopped.state in (S.JOB_STATE_STOPPING, S.JOB_STATE_STOPPED), stopped
    job = await r.until()
    assert job.state == S.JOB_STATE_STOPPED, job
    assert set(r.states) <= {S.JOB_STATE_PENDING, S.JOB_STATE_RUNNING, S.JOB_STATE_STOPPING,
                             S.JOB_STATE_STOPPED}, r.states
    await wait_dead([p["pid"] for p in got])
    again = (await jm.StopJob(jpb.StopJobRequest(name=r.name), timeout=20)).job  # ended: unchanged
    assert again.state == S.JOB_STATE_STOPPED


async def test_failing_entrypoint_is_failed_naming_the_replica(jm, runs):
    spec = single("import sys; print('boom', file=sys.stderr); sys.exit(3)")
    r, job = await run_to_end(jm, runs, spec)
    assert job.state == S.JOB_STATE_FAILED and job.exit_code == 3, job
    assert job.reason == "NonZeroExit", job  # the launcher's word for which replica failed
    assert [(x.role, x.index, x.state, x.exit_code) for x in job.replicas] == [("main", 0, S.REPLICA_STATE_FAILED, 3)]
    assert job.message == "main-0 exited with code 3", job.message  # as every backend says it
    assert S.JOB_STATE_SUCCEEDED not in r.states
    assert "boom" in [e.text for e in await r.logs()]


# --------------------------------------------------------------------------- usage, streams


BUSY = """
import os, sys, time
block = bytearray(64 << 20)
for i in range(0, len(block), 4096):  # resident
    block[i] = 1
while not os.path.exists(sys.argv[1]):
    sum(range(100000))
    time.sleep(0.001)
"""


async def test_usage_of_a_running_master_worker_job_then_its_last_sample_not_running(jm, runs, tmp_path):
    stop = tmp_path / "stop"
    group = lambda role: S.ReplicaGroup(role=role, replicas=1, command=[PY, "-c", BUSY, str(stop)])  # noqa: E731
    r = run_of(jm, on_ray(S.RUN_MODE_MASTER_WORKER, group("master"), group("worker")))
    runs.append(r)
    await r.submit()
    await r.until((S.JOB_STATE_RUNNING,))
    deadline = time.monotonic() + JOB_TIMEOUT
    while True:
        u = (await jm.GetJobUsage(jpb.GetJobUsageRequest(name=r.name), timeout=30)).usage
        busy = {(x.role, x.replica_index) for x in u.replicas
                if x.running and x.cpu_seconds > 0 and x.memory_bytes > 64 << 20}
        if busy == {("master", 0), ("worker", 0)}:
            break
        assert time.monotonic() < deadline, f"usage never covered every replica: {u}"
        await asyncio.sleep(0.5)
    stop.touch()
    job = await r.until()
    assert job.state == S.JOB_STATE_SUCCEEDED, job
    assert sorted((x.role, x.index, x.state) for x in job.replicas) == [
        ("master", 0, S.REPLICA_STATE_SUCCEEDED), ("worker", 0, S.REPLICA_STATE_SUCCEEDED)]
    last = (await jm.GetJobUsage(jpb.GetJobUsageRequest(name=r.name), timeout=30)).usage
    assert sorted((x.role, x.replica_index, x.running) for x in last.replicas) == [
        ("master", 0, False), ("worker", 0, False)], last
    assert all(x.cpu_seconds > 0 and x.peak_memory_bytes > 64 << 20 for x in last.replicas), last


async def test_stderr_only_and_no_ray_line_in_either_stream(jm, runs):
    code = """
    import sys
    for i in range(3):
        print('to out', i, flush=True)
        print('to err', i, file=sys.stderr, flush=True)
    """
    r, job = await run_to_end(jm, runs, single(code))
    assert job.state == S.JOB_STATE_SUCCEEDED, job
    err = await r.logs(streams=[S.LOG_STREAM_STDERR])
    assert [(e.stream, e.text) for e in err] == [(S.LOG_STREAM_STDERR, f"to err {i}") for i in range(3)]
    out = await r.logs(streams=[S.LOG_STREAM_STDOUT])
    assert [(e.stream, e.text) for e in out] == [(S.LOG_STREAM_STDOUT, f"to out {i}") for i in range(3)]
    for e in err + out:  # Ray's own lines ("Runtime env is setting up", "Running entrypoint ...") are not output
        assert "Runtime env" not in e.text and "entrypoint" not in e.text, e.text
