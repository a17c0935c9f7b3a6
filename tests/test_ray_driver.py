# ruff: noqa: ASYNC109, ASYNC110, ASYNC240  -- tests poll a real Ray head and /proc
"""The Ray driver, as a real process over real gRPC, against a real Ray head (tests/ray_head.py)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence

import grpc
import pytest

from dlsched.kit.rpc_errors import error_info
from dlsched.v1 import cluster_pb2, driver_service_pb2_grpc, job_pb2
from dlsched.v1 import driver_service_pb2 as dpb
from tests import security
from tests.harness import AWAIT_RECORDS, ServiceProcess
from tests.ray_head import RayHead, started_driver, started_head

S = job_pb2
PY = sys.executable
CLUSTER = "clusters/ray"
TERMINAL = (S.JOB_STATE_SUCCEEDED, S.JOB_STATE_FAILED, S.JOB_STATE_STOPPED)
# Until the dev extra installs Ray, a missing Ray skips; DLSCHED_REQUIRE_RAY=1 makes it fail instead.
REQUIRE = os.environ.get("DLSCHED_REQUIRE_RAY") == "1"

if importlib.util.find_spec("aiohttp") is None and not REQUIRE:
    pytest.skip("aiohttp is not installed (pip install -e '.[ray]')", allow_module_level=True)


@pytest.fixture(scope="module")
def head() -> Iterator[RayHead]:
    yield from started_head(REQUIRE)


@pytest.fixture(scope="module")
def driver(head: RayHead) -> Iterator[ServiceProcess]:
    yield from started_driver("ray-driver", "--metrics-listen", "127.0.0.1:0")


@pytest.fixture
async def stub(driver: ServiceProcess, head: RayHead) -> AsyncIterator[driver_service_pb2_grpc.DriverServiceStub]:
    async with security.channel(driver.address) as ch:
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


def _dashboard_pid(head: RayHead) -> int:
    """The head's dashboard process (it answers the Jobs and cluster-status REST API)."""
    for d in os.listdir("/proc"):
        try:
            argv = open(f"/proc/{d}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"dashboard/dashboard.py") for a in argv) and f"--port={head.dashboard_port}".encode() in argv:
            return int(d)
    raise AssertionError("no dashboard process of the head")


async def test_a_frozen_head_is_degraded_within_cluster_managers_deadline(stub, head):
    """GetClusterInfo while the head's dashboard is frozen answers within ClusterManager's 5 s:
    DEGRADED with the capacity last seen (jobs matched to it wait for it); it ran into the
    deadline (the head's HTTP timeout is 10 s), and ClusterManager made the cluster UNREACHABLE."""
    deadline = time.monotonic() + 60
    while (await stub.GetClusterInfo(dpb.GetClusterInfoRequest(cluster=CLUSTER), timeout=10)).info.state != 2:
        assert time.monotonic() < deadline, "never READY"
        await asyncio.sleep(0.5)
    pid = _dashboard_pid(head)
    os.kill(pid, signal.SIGSTOP)
    try:
        info = (await stub.GetClusterInfo(dpb.GetClusterInfoRequest(cluster=CLUSTER), timeout=5)).info
    finally:
        os.kill(pid, signal.SIGCONT)
    assert info.state == cluster_pb2.CLUSTER_STATE_DEGRADED, info
    assert "did not answer" in info.message and info.capacity.cpus_total == 2


async def test_single_process_succeeds_with_env_and_followed_logs(stub):
    job_id = new_id("single")
    code = ("import os, time\n"
            "print('start', os.environ['DLSCHED_JOB_ID'], os.environ['FOO'])\n"
            "time.sleep(2)\n"
            "print('end')\n")
    # Ray expands $VAR in env_vars values (where the job travels): none reaches this one
    foo = "bar baz $HOME ${HOME} ${NOPE_XYZ} \\${HOME}"
    resp = await launch(stub, job_id, single(code, FOO=foo))
    assert resp.backend_job_id == f"dlsched-{job_id}-1"
    assert json.loads(resp.native_spec.content)["submission_id"] == resp.backend_job_id
    await wait_state(stub, job_id, (S.JOB_STATE_RUNNING, *TERMINAL))
    got: list[tuple[float, str]] = []
    req = dpb.TailJobLogsRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job_id), follow=True)
    async for r in stub.TailJobLogs(req, timeout=90):
        got.extend((time.monotonic(), e.text) for e in r.entries)
    texts = [t for _, t in got]
    assert f"start {job_id} {foo}" in texts and "end" in texts
    arrived = dict((t, at) for at, t in got)
    assert arrived["end"] - arrived[f"start {job_id} {foo}"] > 0.5  # streamed while it ran
    obs = await wait_state(stub, job_id)
    assert obs.state == S.JOB_STATE_SUCCEEDED and obs.exit_code == 0 and obs.attempt == 1
    assert obs.start_time.seconds > 0 and obs.end_time.seconds > 0
    assert [e.text for e in await logs(stub, job_id, tail_lines=1)] == ["end"]


async def test_a_job_near_the_command_line_limit_runs_and_one_past_it_is_refused_at_once(stub):
    """Ray hands the runtime_env (where the job travels) to each worker on its command line: a
    job of 180 KB waited ~6 minutes for workers that could not start, then failed. One just
    under the bound runs; one over it is INVALID_ARGUMENT at launch, naming the field."""
    job_id = new_id("big")
    code = "import sys; print([(len(a), a[:1]) for a in sys.argv[1:]])"
    spec = single(code)
    spec.replica_groups[0].args.extend(["a" * 50_000, "$" * 8_000, "\u00e9" * 1_000])
    await launch(stub, job_id, spec)
    obs = await wait_state(stub, job_id, within=180)
    assert obs.state == S.JOB_STATE_SUCCEEDED, obs
    assert [e.text for e in await logs(stub, job_id)] == ["[(50000, 'a'), (8000, '$'), (1000, '\u00e9')]"]
    spec.replica_groups[0].args.append("$" * 4_000)
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await launch(stub, new_id("big"), spec)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "spec.replica_groups" in ei.value.details()


async def test_watch_sends_snapshot_marker_then_changes(stub):
    job_id = new_id("watch")
    call = stub.WatchJobObservations(dpb.WatchJobObservationsRequest(cluster=CLUSTER))
    it = call.__aiter__()
    while not (await asyncio.wait_for(it.__anext__(), 20)).snapshot_complete:
        pass
    await launch(stub, job_id, single("print('hi')"))
    seen = []
    try:
        while not seen or seen[-1] not in TERMINAL:
            ev = await asyncio.wait_for(it.__anext__(), 60)
            if ev.observation.job_id == job_id:
                seen.append(ev.observation.state)
    finally:
        call.cancel()
    assert seen[0] in (S.JOB_STATE_PENDING, S.JOB_STATE_RUNNING) and seen[-1] == S.JOB_STATE_SUCCEEDED


async def wait_replicas(stub: driver_service_pb2_grpc.DriverServiceStub, job_id: str,
                        within: float = 30.0) -> dpb.JobObservation:
    """The ended job once its replicas (the launcher's manifest, read after the end) are in."""
    deadline = time.monotonic() + within
    while not (obs := await wait_state(stub, job_id)).replicas:
        assert time.monotonic() < deadline, f"{job_id} ended without replicas: {obs}"
        await asyncio.sleep(0.1)
    return obs


async def test_failing_entrypoint_is_failed_naming_the_replica_as_every_backend_does(stub):
    job_id = new_id("fail")
    await launch(stub, job_id, single("import sys; print('boom', file=sys.stderr); sys.exit(3)"))
    obs = await wait_replicas(stub, job_id)
    assert obs.state == S.JOB_STATE_FAILED and obs.exit_code == 3
    assert obs.reason == "NonZeroExit", obs
    assert obs.message == "main-0 exited with code 3"  # not Ray's, with the output's last 20,000 characters
    assert [(r.role, r.index, r.state, r.exit_code) for r in obs.replicas] == [("main", 0, S.REPLICA_STATE_FAILED, 3)]


async def test_a_replica_whose_program_does_not_exist_fails_with_127(stub):
    """A command not found is the replica's failure (exit 127, as a shell says), not a replica
    STOPPED with exit 0."""
    job_id = new_id("nocmd")
    await launch(stub, job_id, S.JobSpec(run_mode=S.RUN_MODE_SINGLE_PROCESS, replica_groups=[S.ReplicaGroup(
        role="main", replicas=1, command=["/nonexistent/program"])]))
    obs = await wait_replicas(stub, job_id)
    assert obs.state == S.JOB_STATE_FAILED and obs.exit_code == 127, obs
    assert [(r.role, r.index, r.state, r.exit_code) for r in obs.replicas] == [("main", 0, S.REPLICA_STATE_FAILED, 127)]


async def test_stop_ends_a_running_job_stopped_and_cleanup_is_idempotent(stub, head):
    job_id = new_id("stop")
    await launch(stub, job_id, single("import time; print('up', flush=True); time.sleep(300)"))
    await wait_state(stub, job_id, (S.JOB_STATE_RUNNING,))
    ref = dpb.JobRef(job_id=job_id)
    resp = await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=ref), timeout=20)
    assert resp.observation.state == S.JOB_STATE_STOPPING
    seen = []
    while not seen or seen[-1] not in TERMINAL:
        seen.append((await wait_state(stub, job_id, tuple(S.JobState.values()))).state)  # whatever it is now
        await asyncio.sleep(0.05)
    assert seen[-1] == S.JOB_STATE_STOPPED and set(seen) <= {S.JOB_STATE_STOPPING, S.JOB_STATE_STOPPED}
    await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=ref), timeout=20)
    for _ in range(2):
        await stub.CleanupJob(dpb.CleanupJobRequest(cluster=CLUSTER, job=ref), timeout=60)
    assert not [j for j in ray_jobs(head) if (j.get("metadata") or {}).get("dlsched_job_id") == job_id]
    assert not (await wait_state(stub, job_id, (S.JOB_STATE_UNSPECIFIED,))).found


async def test_time_limit_stops_the_job_and_fails_it(stub):
    job_id = new_id("limit")
    spec = single("import time; time.sleep(300)")
    spec.time_limit.FromSeconds(2)
    await launch(stub, job_id, spec)
    obs = await wait_state(stub, job_id, within=60)
    assert obs.state == S.JOB_STATE_FAILED and obs.reason == "TimeLimitExceeded", obs
    assert 2 <= obs.end_time.seconds - obs.start_time.seconds < 30


async def test_a_time_limit_counts_from_the_start_not_from_the_queue(stub):
    """A job waiting for its entrypoint's CPUs (Ray's start_time is its submission) runs its
    time limit from when it started: it SUCCEEDS once it got the CPUs, and reports that start."""
    first, queued = new_id("hog"), new_id("queued")
    hog = single("import time; time.sleep(10)")
    hog.replica_groups[0].resources.cpu = 2  # the head's every CPU
    await launch(stub, first, hog)
    await wait_state(stub, first, (S.JOB_STATE_RUNNING,))
    spec = single("import time; time.sleep(1); print('done')")
    spec.replica_groups[0].resources.cpu = 2
    spec.time_limit.FromSeconds(6)
    await launch(stub, queued, spec)
    waiting = await wait_state(stub, queued, (S.JOB_STATE_PENDING,), within=10)
    assert not waiting.HasField("start_time"), waiting  # not started yet
    ended = await wait_state(stub, first, within=60)
    assert ended.state == S.JOB_STATE_SUCCEEDED, ended
    obs = await wait_state(stub, queued, within=90)
    assert obs.state == S.JOB_STATE_SUCCEEDED, obs  # not FAILED TimeLimitExceeded on starting
    assert obs.start_time.ToNanoseconds() >= ended.end_time.ToNanoseconds() - 2_000_000_000, (obs, ended)


async def test_cleanup_of_a_running_job_stops_and_removes_it(stub, head):
    job_id = new_id("clean")
    await launch(stub, job_id, single("import time; time.sleep(300)"))
    await wait_state(stub, job_id, (S.JOB_STATE_RUNNING,))
    await stub.CleanupJob(dpb.CleanupJobRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job_id)), timeout=60)
    assert not [j for j in ray_jobs(head) if (j.get("metadata") or {}).get("dlsched_job_id") == job_id]


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


async def test_a_forged_submission_is_not_the_job_and_a_stop_stops_the_refs_submission(stub, head):
    """From inside the cluster anything may POST a job with our metadata: one without the
    uid, ended SUCCEEDED, is never reported as the job, and TerminateJob stops the ref's own
    submission (an earlier attempt's ref leaves the running newer attempt alone)."""
    import urllib.request

    job_id, uid = new_id("victim"), str(uuid.uuid4())
    ref = dpb.JobRef(job_id=job_id, job_uid=uid)

    async def launch_uid(spec: S.JobSpec, attempt: int) -> dpb.LaunchJobResponse:
        return await stub.LaunchJob(dpb.LaunchJobRequest(cluster=CLUSTER, job_id=job_id, spec=spec,
                                                         attempt=attempt, job_uid=uid), timeout=30)

    def ray(method: str, path: str, body: dict | None = None) -> None:
        req = urllib.request.Request(f"{head.address}{path}", method=method, data=json.dumps(body).encode()
                                     if body is not None else None, headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10).close()

    first = await launch_uid(single("print('first')"), 1)
    assert (await wait_state(stub, job_id)).state == S.JOB_STATE_SUCCEEDED
    second = await launch_uid(single("import time; time.sleep(300)"), 2)
    await wait_state(stub, job_id, (S.JOB_STATE_RUNNING,))
    forged = new_id("forged")
    ray("POST", "/api/jobs/", {"submission_id": forged, "entrypoint": "true",
                               "metadata": {"dlsched_job_id": job_id, "dlsched_attempt": "2"}})
    try:
        deadline = time.monotonic() + 60
        while not [j for j in ray_jobs(head) if j["submission_id"] == forged and j["status"] == "SUCCEEDED"]:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)
        await asyncio.sleep(2.5)  # polls listing the forged one ended, started after the job
        obs = await wait_state(stub, job_id, tuple(S.JobState.values()))
        assert (obs.state, obs.backend_job_id) == (S.JOB_STATE_RUNNING, second.backend_job_id), obs
        old = dpb.JobRef(job_id=job_id, backend_job_id=first.backend_job_id, job_uid=uid)
        resp = await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=old), timeout=20)
        assert resp.observation.state == S.JOB_STATE_SUCCEEDED, resp
        assert (await wait_state(stub, job_id, tuple(S.JobState.values()))).state == S.JOB_STATE_RUNNING
        ref.backend_job_id = second.backend_job_id
        resp = await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=ref), timeout=20)
        assert resp.observation.state == S.JOB_STATE_STOPPING, resp
        obs = await wait_state(stub, job_id, within=60)
        assert (obs.state, obs.backend_job_id) == (S.JOB_STATE_STOPPED, second.backend_job_id), obs
        await stub.CleanupJob(dpb.CleanupJobRequest(cluster=CLUSTER, job=ref), timeout=60)
        left = [j["submission_id"] for j in ray_jobs(head) if (j.get("metadata") or {}).get("dlsched_job_id") == job_id]
        assert left == [forged]  # not the driver's to delete
    finally:
        ray("DELETE", f"/api/jobs/{forged}")


async def test_mpi_is_refused(stub):
    spec = S.JobSpec(run_mode=S.RUN_MODE_MPI, replica_groups=[
        S.ReplicaGroup(role="launcher", replicas=1, command=["true"]),
        S.ReplicaGroup(role="worker", replicas=1, command=["true"])])
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await launch(stub, new_id("mpi"), spec)
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(ei.value).reason == "MPI_NOT_SUPPORTED"


PROBE = """
import json, os, sys, time
out = sys.argv[1]
name = f"{os.environ['DLSCHED_ROLE']}-{os.environ['DLSCHED_REPLICA_INDEX']}-{os.environ.get('RANK', '')}"
with open(os.path.join(out, name + '.tmp'), 'w') as f:
    json.dump({**os.environ, 'PROBE_PID': str(os.getpid()), 'PROBE_CWD': os.getcwd()}, f)
os.replace(os.path.join(out, name + '.tmp'), os.path.join(out, name + '.json'))
print('probe', name, flush=True)
""" + AWAIT_RECORDS + """if os.environ.get('PROBE_FOREVER') == os.environ['DLSCHED_ROLE']:
    while True:
        time.sleep(1)
"""


def probe_group(role: str, out, replicas: int = 1, ppr: int = 0, **env: str) -> S.ReplicaGroup:
    return S.ReplicaGroup(role=role, replicas=replicas, processes_per_replica=ppr,
                          command=[PY, "-c", PROBE, str(out)], env=env)


def probes(out) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


async def test_multi_process_runs_every_rank_on_the_entrypoint_node(stub, tmp_path):
    job_id = new_id("multi")
    spec = S.JobSpec(run_mode=S.RUN_MODE_MULTI_PROCESS, replica_groups=[probe_group("worker", tmp_path, replicas=2, ppr=2)])
    await launch(stub, job_id, spec)
    obs = await wait_state(stub, job_id)
    assert obs.state == S.JOB_STATE_SUCCEEDED, obs
    envs = probes(tmp_path)
    assert sorted(int(e["RANK"]) for e in envs) == [0, 1, 2, 3]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"} and {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}
    assert len({e["MASTER_PORT"] for e in envs}) == 1
    # The head's own DLSCHED_* settings (the suite's TLS and token files) and the job's JSON are
    # no job's; PWD is where the process runs.
    assert {k for k in envs[0] if k.upper().startswith("DLSCHED_")} == CONTRACT_NAMES
    assert {e["PWD"] == e["PROBE_CWD"] for e in envs} == {True}
    entries = await logs(stub, job_id, replica_index=3)
    assert [(e.role, e.replica_index, e.text) for e in entries] == [("worker", 3, "probe worker-1-3")]


CONTRACT_NAMES = {"DLSCHED_JOB_ID", "DLSCHED_JOB_NAME", "DLSCHED_ROLE", "DLSCHED_REPLICA_INDEX",
                  "DLSCHED_NUM_REPLICAS"}


ALL_REDUCE = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group('gloo')
t = torch.tensor([float(os.environ['RANK']) + 1])
dist.all_reduce(t)
print('sum', int(t.item()), 'rank', os.environ['RANK'], 'world', dist.get_world_size(), flush=True)
dist.barrier()  # leave together, and skip gloo's teardown: it may abort a rank whose peers left (exit 134)
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
async def test_master_worker_gloo_all_reduce_across_placement_group_replicas(stub):
    job_id = new_id("mw")
    group = lambda role, n: S.ReplicaGroup(role=role, replicas=n, command=[PY, "-c", ALL_REDUCE])  # noqa: E731
    spec = S.JobSpec(run_mode=S.RUN_MODE_MASTER_WORKER, replica_groups=[group("worker", 2), group("master", 1)])
    await launch(stub, job_id, spec)
    obs = await wait_state(stub, job_id, within=120)
    entries = await logs(stub, job_id)
    assert obs.state == S.JOB_STATE_SUCCEEDED, "\n".join(e.text for e in entries)
    sums = sorted((e.role, e.replica_index, e.text) for e in entries if e.text.startswith("sum "))
    assert sums == [("master", 0, "sum 6 rank 0 world 3"), ("worker", 0, "sum 6 rank 1 world 3"),
                    ("worker", 1, "sum 6 rank 2 world 3")]


async def test_ps_worker_tf_config_and_ps_stopped_after_workers(stub, tmp_path):
    job_id = new_id("ps")
    spec = S.JobSpec(run_mode=S.RUN_MODE_PS_WORKER, replica_groups=[
        probe_group("ps", tmp_path, PROBE_FOREVER="ps"),
        probe_group("worker", tmp_path, replicas=2, PROBE_AWAIT="3")])
    await launch(stub, job_id, spec)
    obs = await wait_state(stub, job_id, within=120)
    assert obs.state == S.JOB_STATE_SUCCEEDED, obs
    configs = {(e["DLSCHED_ROLE"], int(e["DLSCHED_REPLICA_INDEX"])): json.loads(e["TF_CONFIG"])
               for e in probes(tmp_path)}
    assert sorted(configs) == [("ps", 0), ("worker", 0), ("worker", 1)]
    cluster = configs[("ps", 0)]["cluster"]
    assert [len(cluster["ps"]), len(cluster["worker"])] == [1, 2]
    for (role, index), c in configs.items():
        assert c == {"cluster": cluster, "task": {"type": role, "index": index}}
    [ps] = [e for e in probes(tmp_path) if e["DLSCHED_ROLE"] == "ps"]
    deadline = time.monotonic() + 20
    while os.path.exists(f"/proc/{ps['PROBE_PID']}"):  # the ps is stopped once the workers are done
        assert time.monotonic() < deadline, "the ps process outlived its job"
        await asyncio.sleep(0.2)


def ray_nodes(head: RayHead) -> list[dict]:
    import urllib.request
    with urllib.request.urlopen(f"{head.address}/api/v0/nodes", timeout=10) as r:
        return json.loads(r.read())["data"]["result"]["result"]


async def test_rendezvous_address_is_the_one_ray_registered_the_node_with(stub, head, tmp_path):
    [node] = await asyncio.to_thread(ray_nodes, head)
    job_id = new_id("addr")
    spec = S.JobSpec(run_mode=S.RUN_MODE_MASTER_WORKER, replica_groups=[
        probe_group("master", tmp_path), probe_group("worker", tmp_path)])
    await launch(stub, job_id, spec)
    obs = await wait_replicas(stub, job_id, within=120)
    assert obs.state == S.JOB_STATE_SUCCEEDED, obs
    assert {e["MASTER_ADDR"] for e in probes(tmp_path)} == {node["node_ip"]}
    ip, ok = node["node_ip"], S.REPLICA_STATE_SUCCEEDED
    assert sorted((r.role, r.index, r.state, r.host) for r in obs.replicas) == [("master", 0, ok, ip),
                                                                             ("worker", 0, ok, ip)]


async def test_stop_of_a_placement_group_job_ends_every_replica_process(stub, tmp_path):
    job_id = new_id("mwstop")
    spec = S.JobSpec(run_mode=S.RUN_MODE_MASTER_WORKER, replica_groups=[
        probe_group("master", tmp_path, PROBE_FOREVER="master"), probe_group("worker", tmp_path, PROBE_FOREVER="worker")])
    await launch(stub, job_id, spec)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("*.json"))) < 2:
        assert time.monotonic() < deadline, "the replicas never started"
        await asyncio.sleep(0.2)
    pids = [e["PROBE_PID"] for e in probes(tmp_path)]
    await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job_id)), timeout=20)
    obs = await wait_state(stub, job_id, within=60)
    assert obs.state == S.JOB_STATE_STOPPED, obs
    deadline = time.monotonic() + 30
    while alive := [p for p in pids if os.path.exists(f"/proc/{p}")]:
        assert time.monotonic() < deadline, f"replica processes {alive} outlived the stop"
        await asyncio.sleep(0.2)


#: Records its SIGTERMs in <dir>/<role>-<index>.terms and exits $TERM_EXIT on one ($TERM_SLEEP
#: seconds later); exits $EXIT_<role>_<index> once every process of the job ($PROBE_AWAIT) is up.
TERM_PROBE = """
import os, signal, sys, time
out = sys.argv[1]
name = f"{os.environ['DLSCHED_ROLE']}-{os.environ['DLSCHED_REPLICA_INDEX']}-{os.environ.get('RANK', '')}"
def term(*_):
    with open(os.path.join(out, name + '.terms'), 'a') as f:
        f.write('T')
    time.sleep(float(os.environ.get('TERM_SLEEP', '0')))
    os._exit(int(os.environ.get('TERM_EXIT', '143')))
signal.signal(signal.SIGTERM, term)
with open(os.path.join(out, name + '.tmp'), 'w') as f:
    f.write('up')
os.replace(os.path.join(out, name + '.tmp'), os.path.join(out, name + '.json'))
""" + AWAIT_RECORDS + """code = os.environ.get(f"EXIT_{os.environ['DLSCHED_ROLE']}_{os.environ.get('RANK')}")
if code is not None:
    sys.exit(int(code))
while True:
    time.sleep(0.1)
"""


async def stop_a_term_probe(stub, tmp_path, name: str, **env: str) -> dpb.JobObservation:
    """A single process running TERM_PROBE with ``env``, stopped once it runs: its end with replicas."""
    job_id = new_id(name)
    await launch(stub, job_id, S.JobSpec(run_mode=S.RUN_MODE_SINGLE_PROCESS, replica_groups=[S.ReplicaGroup(
        role="main", replicas=1, command=[PY, "-c", TERM_PROBE, str(tmp_path)], env=env)]))
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("*.json")):
        assert time.monotonic() < deadline, "the process never started"
        await asyncio.sleep(0.2)
    await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job_id)), timeout=20)
    return await wait_replicas(stub, job_id, within=90)


async def test_a_stop_signals_each_process_once_and_one_exiting_0_on_it_is_stopped(stub, tmp_path):
    """Ray's job supervisor SIGTERMs every descendant of the entrypoint; the launcher sent each
    process a second one. A process exiting 0 on the stop's SIGTERM is STOPPED with its code, as
    on local and Slurm (it was SUCCEEDED inside the STOPPED job)."""
    obs = await stop_a_term_probe(stub, tmp_path, "stop1", TERM_EXIT="0", TERM_SLEEP="0.5")
    assert obs.state == S.JOB_STATE_STOPPED, obs
    assert [(r.role, r.index, r.state, r.exit_code) for r in obs.replicas] == [("main", 0, S.REPLICA_STATE_STOPPED, 0)]
    assert [p.read_text() for p in tmp_path.glob("*.terms")] == ["T"]


async def test_a_daemon_the_job_left_ends_with_it(stub, tmp_path):
    """A replica that starts a daemon (a new session, its parent gone) and exits 0: the job
    SUCCEEDS and the daemon is ended with it, as on local (it outlived the job, holding its
    output pipes: the end waited for them). Single process (the entrypoint) and placement-group
    (a replica's task) modes."""
    code = ("import os, subprocess, sys\n"
            "d = subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
            "open(os.path.join(sys.argv[1], os.environ['DLSCHED_ROLE'] + '.daemon'), 'w').write(str(d.pid))\n"
            "print('started', flush=True)\n")
    for mode, roles in ((S.RUN_MODE_SINGLE_PROCESS, ("main",)), (S.RUN_MODE_MASTER_WORKER, ("master", "worker"))):
        job_id = new_id("daemon")
        await launch(stub, job_id, S.JobSpec(run_mode=mode, replica_groups=[
            S.ReplicaGroup(role=role, replicas=1, command=[PY, "-c", code, str(tmp_path)]) for role in roles]))
        obs = await wait_replicas(stub, job_id, within=120)
        assert obs.state == S.JOB_STATE_SUCCEEDED, obs
        for role in roles:
            pid = int((tmp_path / f"{role}.daemon").read_text())
            deadline = time.monotonic() + 30
            while _alive(pid):
                assert time.monotonic() < deadline, f"{role}'s daemon {pid} outlived the job"
                await asyncio.sleep(0.2)


def _alive(pid: int) -> bool:
    """A live process (not a zombie) has ``pid``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


async def test_a_process_taking_its_grace_on_a_stop_keeps_its_exit_code(stub, tmp_path):
    """A process that takes 4 s to end on the stop's SIGTERM (within the launcher's 5 s grace,
    past Ray's default 3 s stop wait): Ray's supervisor SIGKILLed the launcher before it wrote
    the replicas' ends, and the job had none. It waits for the launcher now: STOPPED 143."""
    obs = await stop_a_term_probe(stub, tmp_path, "stopgrace", TERM_SLEEP="4")
    assert obs.state == S.JOB_STATE_STOPPED, obs
    assert [(r.role, r.index, r.state, r.exit_code) for r in obs.replicas] == [
        ("main", 0, S.REPLICA_STATE_STOPPED, 143)]


async def test_placement_group_replicas_end_each_with_its_own_process_codes(stub, tmp_path):
    """A master process failing (exit 3) stops its sibling in the same replica and the worker
    replica: each is STOPPED with the code it exited with on the SIGTERM (143), as on local and
    Slurm (the sibling was SUCCEEDED 0, the worker STOPPED without a code)."""
    job_id = new_id("pgends")
    group = lambda role, ppr: S.ReplicaGroup(  # noqa: E731
        role=role, replicas=1, processes_per_replica=ppr, command=[PY, "-c", TERM_PROBE, str(tmp_path)],
        env={"PROBE_AWAIT": "3", "EXIT_master_1": "3"})
    spec = S.JobSpec(run_mode=S.RUN_MODE_MASTER_WORKER, replica_groups=[group("master", 2), group("worker", 1)])
    await launch(stub, job_id, spec)
    obs = await wait_replicas(stub, job_id, within=120)
    assert obs.state == S.JOB_STATE_FAILED and obs.exit_code == 3, obs
    assert sorted((r.role, r.index, r.state, r.exit_code) for r in obs.replicas) == [
        ("master", 0, S.REPLICA_STATE_STOPPED, 143), ("master", 1, S.REPLICA_STATE_FAILED, 3),
        ("worker", 0, S.REPLICA_STATE_STOPPED, 143)]


async def test_a_replica_whose_ray_worker_dies_fails_the_job_and_never_runs_again(stub, tmp_path):
    """Ray retries a task 3 times by default: a replica whose Ray worker (or node) died ran a
    second time behind the job's back, the rest of the world waiting on the first, and the
    job could end SUCCEEDED. The replica's task is not retried: the job FAILS, naming it."""
    code = ("import os, sys, time\n"
            "open(os.path.join(sys.argv[1], os.environ['DLSCHED_ROLE'] + '.starts'), 'a')"
            ".write(f'{os.getpid()} {os.getppid()}\\n')\n"
            "while True:\n    time.sleep(0.5)\n")
    job_id = new_id("wkill")
    spec = S.JobSpec(run_mode=S.RUN_MODE_MASTER_WORKER, replica_groups=[
        S.ReplicaGroup(role=role, replicas=1, command=[PY, "-c", code, str(tmp_path)])
        for role in ("master", "worker")])
    await launch(stub, job_id, spec)
    starts = tmp_path / "worker.starts"
    deadline = time.monotonic() + 90
    while not (starts.exists() and starts.read_text().strip()):
        assert time.monotonic() < deadline, "the worker replica never started"
        await asyncio.sleep(0.2)
    pid, ray_worker = map(int, starts.read_text().split()[:2])
    os.kill(ray_worker, signal.SIGKILL)  # the Ray worker running the replica's task dies
    obs = await wait_state(stub, job_id, within=120)
    assert obs.state == S.JOB_STATE_FAILED, obs
    await asyncio.sleep(3)  # a retried task would have started it again by now
    assert len(starts.read_text().splitlines()) == 1, starts.read_text()


async def test_unreachable_head_keeps_last_state_as_backend_stale(stub, head):
    from tests.harness import free_port
    cluster = f"clusters/{new_id('stale')}"
    await stub.ConfigureCluster(dpb.ConfigureClusterRequest(cluster=cluster, address=head.address), timeout=20)
    job_id = new_id("stale")
    await stub.LaunchJob(dpb.LaunchJobRequest(cluster=cluster, job_id=job_id, attempt=1,
                                              spec=single("import time; time.sleep(300)")), timeout=30)
    ref = dpb.JobRef(job_id=job_id)

    async def obs() -> dpb.JobObservation:
        r = await stub.BatchGetJobObservations(dpb.BatchGetJobObservationsRequest(cluster=cluster, jobs=[ref]),
                                               timeout=10)
        return r.observations[0]

    deadline = time.monotonic() + 60
    while (await obs()).state != S.JOB_STATE_RUNNING:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    await stub.ConfigureCluster(dpb.ConfigureClusterRequest(
        cluster=cluster, address=f"http://127.0.0.1:{free_port()}"), timeout=20)
    deadline = time.monotonic() + 60
    while (o := await obs()).reason != "BackendStale":
        assert time.monotonic() < deadline, o
        await asyncio.sleep(0.1)
    assert o.state == S.JOB_STATE_RUNNING and o.found
    await stub.ConfigureCluster(dpb.ConfigureClusterRequest(cluster=cluster, address=head.address), timeout=20)
    await stub.TerminateJob(dpb.TerminateJobRequest(cluster=cluster, job=ref), timeout=20)
    deadline = time.monotonic() + 60
    while (o := await obs()).state != S.JOB_STATE_STOPPED:
        assert time.monotonic() < deadline, o
        await asyncio.sleep(0.1)


# --------------------------------------------------------------------------- the whole stack


async def test_retried_submit_through_the_services_is_one_job_and_one_ray_submission(etcd, head, tmp_path):
    from dlsched.v1 import cluster_manager_service_pb2 as cm_pb
    from dlsched.v1 import cluster_manager_service_pb2_grpc as cm_grpc
    from dlsched.v1 import cluster_pb2
    from dlsched.v1 import job_manager_service_pb2 as jpb
    from dlsched.v1 import job_manager_service_pb2_grpc as jm_grpc

    prefix = f"/dlsched-ray-{uuid.uuid4().hex[:8]}/"
    procs = [ServiceProcess("drivers.ray", ["--poll-interval", "0.2"], name="ray-driver-stack"),
             ServiceProcess("cluster_manager", ["--etcd", etcd.endpoint, "--prefix", prefix,
                                                "--monitor-interval", "0.5"], name="cm-ray")]
    try:
        for p in procs:
            p.start()
        jm_proc = ServiceProcess("job_manager", ["--etcd", etcd.endpoint, "--prefix", prefix,
                                                 "--cluster-manager", procs[1].address], name="jm-ray")
        procs.append(jm_proc)
        jm_proc.start()
        async with security.channel(procs[1].address) as ch:
            cm = cm_grpc.ClusterManagerServiceStub(ch)
            await cm.CreateCluster(cm_pb.CreateClusterRequest(cluster_id="ray", cluster=cluster_pb2.Cluster(
                type=S.CLUSTER_TYPE_RAY, address=head.address, driver_address=procs[0].address,
                options={"python": PY})), timeout=20)
            deadline = time.monotonic() + 60
            while (c := (await cm.GetCluster(cm_pb.GetClusterRequest(name=CLUSTER))).cluster).state != \
                    cluster_pb2.CLUSTER_STATE_READY:
                assert time.monotonic() < deadline, c
                await asyncio.sleep(0.3)
        async with security.channel(jm_proc.address) as ch:
            jm = jm_grpc.JobManagerServiceStub(ch)
            req = jpb.SubmitJobRequest(spec=single("print('through the stack')"), request_id=new_id("req"))
            a, b = await asyncio.gather(jm.SubmitJob(req, timeout=30), jm.SubmitJob(req, timeout=30))
            c = await jm.SubmitJob(req, timeout=30)
            assert a.job.name == b.job.name == c.job.name
            deadline = time.monotonic() + 90
            while (job := (await jm.GetJob(jpb.GetJobRequest(name=a.job.name), timeout=10)).job).state \
                    not in TERMINAL:
                assert time.monotonic() < deadline, job
                await asyncio.sleep(0.2)
            assert job.state == S.JOB_STATE_SUCCEEDED and job.cluster == CLUSTER, job
        job_id = a.job.name.split("/", 1)[1]
        assert len([j for j in ray_jobs(head) if (j.get("metadata") or {}).get("dlsched_job_id") == job_id]) == 1
    finally:
        for p in reversed(procs):
            p.stop()


# --------------------------------------------------------------------------- a fake head: edges a real one will not show


class FakeHead:
    """Ray's job endpoints as canned answers, recording every request."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, str]] = []  # method, path, Authorization
        self.jobs: dict[str, dict] = {}
        self.list_jobs = True  # False: the list lags behind (the job is only found by id)
        self.files: dict[str, bytes] = {}  # served by the log file endpoint
        self.runner = None
        self.address = ""

    async def start(self) -> FakeHead:
        from aiohttp import web

        async def handle(req: web.Request) -> web.Response:
            self.requests.append((req.method, req.path, req.headers.get("Authorization", "")))
            if req.method == "GET" and req.path == "/api/jobs/":
                return web.json_response(list(self.jobs.values()) if self.list_jobs else [])
            if req.method == "POST" and req.path == "/api/jobs/":
                body = await req.json()
                sid = body["submission_id"]
                if sid in self.jobs:
                    return web.Response(status=500, text=f"ValueError: Job with submission_id {sid} already exists.")
                self.jobs[sid] = {"type": "SUBMISSION", "submission_id": sid, "status": "RUNNING",
                                  "metadata": body["metadata"], "message": "running", "start_time": 1000}
                return web.json_response({"submission_id": sid})
            if req.method == "GET" and req.path.startswith("/api/jobs/"):
                job = self.jobs.get(req.path.split("/")[3])
                return web.json_response(job) if job else web.Response(status=404, text="no such job")
            if req.path == "/api/v0/logs/file" and req.query.get("filename") in self.files:
                return web.Response(body=self.files[req.query["filename"]])
            if req.path == "/api/cluster_status":
                return web.json_response({"data": {"clusterStatus": {"loadMetricsReport": {
                    "usage": {"CPU": [1.0, 4.0], "memory": [0.0, 8e9], "GPU": [1.0, 2.0]},
                    "usageByNode": {"n1": {"CPU": [1.0, 4.0], "memory": [0.0, 8e9], "GPU": [1.0, 2.0]}}}}}})
            return web.Response(status=404, text="not here")

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.address = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def fake() -> AsyncIterator[FakeHead]:
    h = await FakeHead().start()
    yield h
    await h.stop()


def _spec():
    from drivers.common.base import JobSpec, ReplicaGroup, RunMode
    return JobSpec(RunMode.SINGLE_PROCESS, (ReplicaGroup(role="main", replicas=1, command=("true",)),))


async def test_token_is_sent_as_bearer_on_every_call_and_never_logged(fake, caplog):
    from drivers.common.base import ClusterConfig, TokenCredentials
    from drivers.ray.driver import RayConfig, RayDriver

    caplog.set_level("DEBUG")
    d = RayDriver(RayConfig(poll_interval=0.05))
    try:
        info = await d.configure_cluster(ClusterConfig("clusters/t", fake.address,
                                                       credentials=TokenCredentials("s3cret-token")))
        assert (info.capacity.cpus_total, info.capacity.cpus_free, info.capacity.gpus_free) == (4.0, 3.0, 1)
        await d.launch("clusters/t", "tok", _spec(), 1)
        await asyncio.sleep(0.2)
    finally:
        await d.close()
    assert {m for m, *_ in fake.requests} >= {"GET", "POST"}
    assert {a for *_, a in fake.requests} == {"Bearer s3cret-token"}
    assert "s3cret" not in caplog.text


async def test_refused_resubmit_is_the_first_submission(fake):
    from drivers.common.base import ClusterConfig, JobState
    from drivers.ray.driver import RayConfig, RayDriver

    fake.list_jobs = False  # the driver cannot know from its poll that the job exists
    first = RayDriver(RayConfig(poll_interval=0.05))
    second = RayDriver(RayConfig(poll_interval=0.05))  # a restarted driver, knowing nothing
    try:
        for d in (first, second):
            await d.configure_cluster(ClusterConfig("clusters/t", fake.address))
        a = await first.launch("clusters/t", "dup", _spec(), 1)
        b = await second.launch("clusters/t", "dup", _spec(), 1)
    finally:
        await first.close()
        await second.close()
    assert a.backend_job_id == b.backend_job_id == "dlsched-dup-1"
    assert b.observation.state is JobState.RUNNING and b.observation.found
    assert len(fake.jobs) == 1 and [m for m, p, _ in fake.requests if p == "/api/jobs/"].count("POST") == 2


async def test_a_job_id_used_again_gets_a_submission_id_of_its_own_uid(fake):
    """Ray's monitor of a deleted submission may still run and would fail a new submission of
    the same id: a new job (a new uid) of a used id never uses that id again, and its launch
    deletes nothing first."""
    from drivers.common.base import ClusterConfig, JobRef, JobState
    from drivers.ray.driver import RayConfig, RayDriver

    d = RayDriver(RayConfig(poll_interval=0.05))
    try:
        await d.configure_cluster(ClusterConfig("clusters/t", fake.address))
        a = await d.launch("clusters/t", "again", _spec(), 1, uid="uid-a")
        fake.jobs[a.backend_job_id]["status"] = "SUCCEEDED"
        while (await d.observe("clusters/t", [JobRef("again", "")]))[0].state is not JobState.SUCCEEDED:
            await asyncio.sleep(0.05)
        assert await d.forget("clusters/t", [JobRef("again", a.backend_job_id)]) == 1
        b = await d.launch("clusters/t", "again", _spec(), 1, uid="uid-b")
        await asyncio.sleep(0.3)  # polls that list both submissions of one attempt
        [now] = await d.observe("clusters/t", [JobRef("again", "")])
    finally:
        await d.close()
    assert (a.backend_job_id, b.backend_job_id) == ("dlsched-again-1_uida", "dlsched-again-1_uidb")
    assert not [r for r in fake.requests if r[0] == "DELETE"]
    assert now.backend_job_id == b.backend_job_id and now.uid == "uid-b", now


async def test_of_one_attempts_submissions_of_two_uids_a_restarted_driver_tracks_the_last(fake):
    """An ended job left without its cleanup and the new job of its id, both attempt 1: the
    poller tracks the one submitted last, whatever the list's order."""
    from drivers.common.base import ClusterConfig, JobRef, JobState
    from drivers.ray.driver import RayConfig, RayDriver

    for uid, status, start in (("old", "FAILED", 1000), ("new", "RUNNING", 2000)):
        fake.jobs[f"dlsched-j-1_{uid}"] = {
            "type": "SUBMISSION", "submission_id": f"dlsched-j-1_{uid}", "status": status, "start_time": start,
            "message": "", "metadata": {"dlsched_job_id": "j", "dlsched_attempt": "1", "dlsched_job_uid": uid}}
    d = RayDriver(RayConfig(poll_interval=0.05))
    try:
        await d.configure_cluster(ClusterConfig("clusters/t", fake.address))
        [now] = await d.observe("clusters/t", [JobRef("j", "")])
    finally:
        await d.close()
    assert (now.backend_job_id, now.state, now.uid) == ("dlsched-j-1_new", JobState.RUNNING, "new"), now


async def test_a_new_job_of_an_id_is_followed_beside_an_earlier_jobs_higher_attempt(fake):
    """An earlier job of the id (attempt 3, left without its cleanup) listed beside the new
    job's attempt 1: the new job's states are followed, before and after a driver restart."""
    from drivers.common.base import ClusterConfig, JobRef, JobState
    from drivers.ray.driver import RayConfig, RayDriver

    fake.jobs["dlsched-j-3_old"] = {
        "type": "SUBMISSION", "submission_id": "dlsched-j-3_old", "status": "FAILED", "start_time": 500,
        "message": "", "metadata": {"dlsched_job_id": "j", "dlsched_attempt": "3", "dlsched_job_uid": "old"}}
    for restarted in (False, True):
        d = RayDriver(RayConfig(poll_interval=0.05))
        try:
            await d.configure_cluster(ClusterConfig("clusters/t", fake.address))
            if not restarted:
                b = await d.launch("clusters/t", "j", _spec(), 1, uid="new")
                await asyncio.sleep(0.2)  # polls listing both
                fake.jobs[b.backend_job_id]["status"] = "SUCCEEDED"
                want = JobState.SUCCEEDED
            else:
                fake.jobs[b.backend_job_id]["status"] = "RUNNING"
                want = JobState.RUNNING
            deadline = time.monotonic() + 10
            while (now := (await d.observe("clusters/t", [JobRef("j", "")]))[0]).state is not want:
                assert time.monotonic() < deadline, now
                await asyncio.sleep(0.05)
        finally:
            await d.close()
        assert now.backend_job_id == "dlsched-j-1_new", now


async def test_a_launch_an_earlier_driver_submitted_without_the_uid_in_its_id_is_adopted(fake):
    """Submissions made before ids named uids: a restarted driver's launch of the same job,
    attempt and uid is that one, ended or not; another uid's is not adopted, nor an ended one
    without a uid (no telling whose it was: a job id used again is a new job)."""
    from drivers.common.base import ClusterConfig, JobState
    from drivers.ray.driver import RayConfig, RayDriver

    for job, uid, status in (("ended", "u1", "SUCCEEDED"), ("runs", "u2", "RUNNING"), ("other", "u3", "FAILED"),
                             ("bare", "", "SUCCEEDED")):
        fake.jobs[f"dlsched-{job}-1"] = {
            "type": "SUBMISSION", "submission_id": f"dlsched-{job}-1", "status": status, "start_time": 1000,
            "end_time": 2000 if status != "RUNNING" else None, "message": "",
            "metadata": {"dlsched_job_id": job, "dlsched_attempt": "1", **({"dlsched_job_uid": uid} if uid else {})}}
    d = RayDriver(RayConfig(poll_interval=0.05))
    try:
        await d.configure_cluster(ClusterConfig("clusters/t", fake.address))
        ended = await d.launch("clusters/t", "ended", _spec(), 1, uid="u1")
        runs = await d.launch("clusters/t", "runs", _spec(), 1, uid="u2")
        other = await d.launch("clusters/t", "other", _spec(), 1, uid="u4")
        bare = await d.launch("clusters/t", "bare", _spec(), 1, uid="u5")
    finally:
        await d.close()
    assert (ended.backend_job_id, ended.observation.state) == ("dlsched-ended-1", JobState.SUCCEEDED)
    assert (runs.backend_job_id, runs.observation.state) == ("dlsched-runs-1", JobState.RUNNING)
    assert other.backend_job_id == "dlsched-other-1_u4" and other.observation.state is JobState.PENDING
    assert bare.backend_job_id == "dlsched-bare-1_u5" and bare.observation.state is JobState.PENDING
    assert [m for m, p, _ in fake.requests if p == "/api/jobs/"].count("POST") == 2


async def test_head_never_reached_is_unavailable_not_not_found():
    from dlsched.errors import Unavailable
    from drivers.common.base import ClusterConfig, ClusterState, JobRef
    from drivers.ray.driver import RayConfig, RayDriver
    from tests.harness import free_port

    d = RayDriver(RayConfig(poll_interval=0.05, request_timeout=2))
    try:
        info = await d.configure_cluster(ClusterConfig("clusters/t", f"http://127.0.0.1:{free_port()}"))
        assert info.state is ClusterState.UNREACHABLE
        with pytest.raises(Unavailable) as e:
            await d.observe("clusters/t", [JobRef("x")])
        assert e.value.reason == "BACKEND_UNAVAILABLE"
    finally:
        await d.close()


async def test_one_list_call_per_interval_serves_every_job(fake):
    from drivers.common.base import ClusterConfig, JobRef
    from drivers.ray.driver import RayConfig, RayDriver

    d = RayDriver(RayConfig(poll_interval=0.1))
    try:
        await d.configure_cluster(ClusterConfig("clusters/t", fake.address))
        for i in range(20):
            await d.launch("clusters/t", f"j{i}", _spec(), 1)
        fake.requests.clear()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.0:
            obs = await d.observe("clusters/t", [JobRef(f"j{i}") for i in range(20)])
            assert all(o.found for o in obs)
            await asyncio.sleep(0.01)
    finally:
        await d.close()
    assert {(m, p) for m, p, _ in fake.requests} == {("GET", "/api/jobs/")}
    assert 5 <= len(fake.requests) <= 12


# --------------------------------------------------------------------------- usage, log streams, log cost


def fetched_bytes(svc: ServiceProcess) -> float:
    """``dlsched_backend_bytes_fetched_total`` of the Ray driver (its /metrics), all calls."""
    from tests.harness import metrics_samples, sample

    return sample(metrics_samples(svc), "dlsched_backend_bytes_fetched_total", backend="ray")


BUSY = """
import os, sys, time
block = bytearray(64 << 20)  # resident: written below
for i in range(0, len(block), 4096):
    block[i] = 1
print('busy', os.environ['DLSCHED_ROLE'], flush=True)
while not os.path.exists(sys.argv[1]):
    sum(range(100000))
    time.sleep(0.001)
"""


async def usage(stub: driver_service_pb2_grpc.DriverServiceStub, job_id: str) -> list[S.ReplicaUsage]:
    resp = await stub.MeasureJobUsage(dpb.MeasureJobUsageRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job_id)),
                                      timeout=20)
    return list(resp.usage.replicas)


async def test_usage_of_a_master_worker_job_per_replica_then_not_running(stub, tmp_path):
    job_id = new_id("usage")
    stop = tmp_path / "stop"
    group = lambda role: S.ReplicaGroup(role=role, replicas=1, command=[PY, "-c", BUSY, str(stop)])  # noqa: E731
    await launch(stub, job_id, S.JobSpec(run_mode=S.RUN_MODE_MASTER_WORKER,
                                         replica_groups=[group("master"), group("worker")]))
    deadline = time.monotonic() + 120
    while True:
        got = await usage(stub, job_id)
        busy = {(u.role, u.replica_index) for u in got
                if u.running and u.cpu_seconds > 0.2 and u.memory_bytes > 64 << 20}
        if busy == {("master", 0), ("worker", 0)}:
            break
        assert time.monotonic() < deadline, f"usage never covered every replica: {got}"
        await asyncio.sleep(0.5)
    stop.touch()
    obs = await wait_state(stub, job_id, within=60)
    assert obs.state == S.JOB_STATE_SUCCEEDED, obs
    final = await usage(stub, job_id)
    assert sorted((u.role, u.replica_index) for u in final) == [("master", 0), ("worker", 0)]
    for u in final:
        assert not u.running and u.cpu_seconds > 0.2 and u.peak_memory_bytes > 64 << 20, u


async def test_single_process_stdout_and_stderr_apart_without_rays_lines(stub):
    job_id = new_id("streams")
    code = ("import sys\n"
            "for i in range(3):\n"
            "    print('out', i, flush=True)\n"
            "    print('err', i, file=sys.stderr, flush=True)\n")
    await launch(stub, job_id, single(code))
    await wait_state(stub, job_id)
    err = await logs(stub, job_id, streams=[S.LOG_STREAM_STDERR])
    assert [(e.stream, e.text) for e in err] == [(S.LOG_STREAM_STDERR, f"err {i}") for i in range(3)]
    out = await logs(stub, job_id, streams=[S.LOG_STREAM_STDOUT])
    assert [(e.stream, e.text) for e in out] == [(S.LOG_STREAM_STDOUT, f"out {i}") for i in range(3)]
    both = await logs(stub, job_id)
    assert sorted(e.text for e in both) == sorted([f"out {i}" for i in range(3)] + [f"err {i}" for i in range(3)])
    assert all(e.HasField("time") and e.time.seconds > 0 for e in both)  # the launcher dates every line


LINE = 1024
LOUD = f"""
import os, sys, time
print('ready', flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
pad = 'x' * {LINE - 8 - 1}
out = sys.stdout
for i in range(int(sys.argv[2])):
    out.write('%07d %s\\n' % (i, pad))
out.flush()
"""


async def test_a_follower_of_50_mb_gets_every_line_in_order_for_at_most_twice_the_bytes(stub, driver, tmp_path):
    job_id = new_id("loud")
    go, n = tmp_path / "go", 50 * 1024  # 50 MB of 1 KB lines
    await launch(stub, job_id, S.JobSpec(run_mode=S.RUN_MODE_SINGLE_PROCESS, replica_groups=[S.ReplicaGroup(
        role="main", replicas=1, command=[PY, "-u", "-c", LOUD, str(go), str(n)])]))
    await wait_state(stub, job_id, (S.JOB_STATE_RUNNING, *TERMINAL))
    before = fetched_bytes(driver)
    got: list[str] = []
    req = dpb.TailJobLogsRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job_id), follow=True)
    async for r in stub.TailJobLogs(req, timeout=300):
        for e in r.entries:
            if e.text == "ready":
                go.touch()
            else:
                got.append(e.text)
    spent = fetched_bytes(driver) - before
    assert len(got) == n and all(t.startswith(f"{i:07d} ") for i, t in enumerate(got)), (len(got), got[:2])
    written = n * LINE
    assert spent <= 2 * written, f"fetched {spent:.0f} bytes for {written} written"


async def test_a_file_read_through_the_dashboard_is_bounded_to_its_first_or_newest_lines(fake):
    """A job's files can grow without bound: a read keeps at most ``limit`` bytes, the first
    ones (the manifest), or with ``newest`` the last whole lines (a log's history)."""
    from drivers.common.base import ClusterConfig
    from drivers.ray.api import RayApi

    fake.files["f"] = b"".join(b"%07d\n" % i for i in range(100_000))  # 800,000 bytes
    api = RayApi(ClusterConfig("clusters/t", fake.address), 30)
    try:
        first = await api.read_file("n", "f", limit=100_000)
        assert first == fake.files["f"][:100_000]
        newest = await api.read_file("n", "f", limit=100_003, newest=True)
        assert newest is not None and len(newest) <= 100_003 and fake.files["f"].endswith(newest)
        assert newest.startswith(b"%07d\n" % (100_000 - len(newest) // 8))  # whole lines only
        assert await api.read_file("n", "f") == fake.files["f"]  # under the limit: all of it
    finally:
        await api.close()
