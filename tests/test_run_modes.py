# ruff: noqa: ASYNC109, ASYNC110, ASYNC230  -- tests poll real processes and files
"""The five run modes on the local backend, for real: the examples (PyTorch DDP
with gloo, a parameter-server job over HTTP, mpi4py under mpirun) and probe
jobs that dump what every replica saw, through the local driver over gRPC and
through the whole stack (ClusterManager + JobManager over etcd)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import pathlib
import shutil
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from dlsched.client import load_job_file
from dlsched.kit.rpc_errors import error_info
from dlsched.v1 import driver_service_pb2 as dpb
from dlsched.v1 import driver_service_pb2_grpc, job_pb2
from dlsched.v1 import job_manager_service_pb2 as jpb
from dlsched.v1 import job_manager_service_pb2_grpc as jm_grpc
from tests import security
from tests.harness import AWAIT_RECORDS, ROOT, EtcdServer, ServiceProcess, Stack, pid_alive

S = job_pb2
PY = sys.executable
CLUSTER = "clusters/local"
EXAMPLES = ROOT / "examples"
TERMINAL = (S.JOB_STATE_SUCCEEDED, S.JOB_STATE_FAILED, S.JOB_STATE_STOPPED)
IN_CI = os.environ.get("CI") == "true"


def needs(module: str) -> pytest.MarkDecorator:
    """Skip when ``module`` is missing, except in CI, where a missing one fails."""
    missing = importlib.util.find_spec(module) is None
    return pytest.mark.skipif(missing and not IN_CI, reason=f"{module} is not installed")


needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None and not IN_CI,
                                  reason="mpirun is not installed (scripts/install-system-deps.sh)")


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def driver() -> Iterator[ServiceProcess]:
    state = tempfile.mkdtemp(prefix="dlsched-modes-")
    svc = ServiceProcess("drivers.local", ["--state-dir", state, "--grace-seconds", "3"],
                         name="local-driver-modes").start()
    yield svc
    svc.stop()
    shutil.rmtree(state, ignore_errors=True)


@pytest.fixture
async def stub(driver: ServiceProcess) -> AsyncIterator[driver_service_pb2_grpc.DriverServiceStub]:
    async with security.channel(driver.address) as ch:
        s = driver_service_pb2_grpc.DriverServiceStub(ch)
        await s.ConfigureCluster(dpb.ConfigureClusterRequest(cluster=CLUSTER), timeout=10)
        yield s


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def example(path: str, out: pathlib.Path, **env: str) -> S.JobSpec:
    """An example's spec as written (``python3`` is the driver's Python: it comes first on the jobs'
    PATH), writing its records to ``out``."""
    _, spec = load_job_file(EXAMPLES / path)
    for g in spec.replica_groups:
        g.env["EXAMPLE_OUT"] = str(out)
        g.env.update(env)
    return spec


PROBE = """
import json, os, sys, time
out = sys.argv[1]
name = f"{os.environ['DLSCHED_ROLE']}-{os.environ['DLSCHED_REPLICA_INDEX']}-{os.environ.get('RANK', '')}"
tmp = os.path.join(out, f'{name}.{os.getpid()}.tmp')  # its own: MPI ranks share one name
with open(tmp, 'w') as f:  # whole or not there: readers poll
    json.dump({'env': dict(os.environ), 'pid': os.getpid()}, f)
os.replace(tmp, os.path.join(out, name + '.json'))
""" + AWAIT_RECORDS + """mode = os.environ.get('PROBE_' + os.environ['DLSCHED_ROLE'].upper(), 'exit0')
if mode == 'forever':
    while True:
        time.sleep(1)
if mode.startswith('exit'):
    time.sleep(float(os.environ.get('PROBE_SLEEP', '0')))
    raise SystemExit(int(mode[4:]))
"""


def probe_group(role: str, out: pathlib.Path, replicas: int = 1, ppr: int = 0, **env: str) -> S.ReplicaGroup:
    return S.ReplicaGroup(role=role, replicas=replicas, processes_per_replica=ppr,
                          command=[PY, "-c", textwrap.dedent(PROBE), str(out)], env=env)


def probes(out: pathlib.Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


async def launch(stub: driver_service_pb2_grpc.DriverServiceStub, job_id: str, spec: S.JobSpec) -> None:
    await stub.LaunchJob(dpb.LaunchJobRequest(cluster=CLUSTER, job_id=job_id, spec=spec, attempt=1), timeout=20)


async def wait_state(stub: driver_service_pb2_grpc.DriverServiceStub, job_id: str,
                     states: tuple[int, ...] = TERMINAL, within: float = 60.0) -> dpb.JobObservation:
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


async def stdout_of(stub: driver_service_pb2_grpc.DriverServiceStub, job_id: str,
                    stream: int = S.LOG_STREAM_STDOUT) -> list[str]:
    out: list[str] = []
    req = dpb.TailJobLogsRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job_id))
    async for resp in stub.TailJobLogs(req, timeout=20):
        out.extend(e.text for e in resp.entries if e.stream == stream)
    return out


async def stderr_of(stub: driver_service_pb2_grpc.DriverServiceStub, job_id: str) -> list[str]:
    return await stdout_of(stub, job_id, S.LOG_STREAM_STDERR)


def states_by_replica(obs: dpb.JobObservation) -> dict[tuple[str, int], int]:
    return {(r.role, r.index): r.state for r in obs.replicas}


# --------------------------------------------------------------------------- probes: the contract


async def test_master_worker_probe_sees_one_world_with_master_rank_zero(stub, tmp_path):
    spec = S.JobSpec(run_mode=S.RUN_MODE_MASTER_WORKER, replica_groups=[
        probe_group("worker", tmp_path, replicas=2, ppr=2), probe_group("master", tmp_path)])
    job = new_id("mw-probe")
    await launch(stub, job, spec)
    obs = await wait_state(stub, job)
    assert obs.state == S.JOB_STATE_SUCCEEDED, obs
    envs = [p["env"] for p in probes(tmp_path)]
    assert len(envs) == 5
    assert sorted(int(e["RANK"]) for e in envs) == list(range(5))
    assert [e["DLSCHED_ROLE"] for e in envs if e["RANK"] == "0"] == ["master"]
    for key in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "NODE_RANK", "DLSCHED_JOB_ID"):
        assert len({e[key] for e in envs}) == 1, key
    assert envs[0]["WORLD_SIZE"] == "5" and envs[0]["MASTER_PORT"] != "29500"  # a free port, picked at launch
    assert sorted(int(e["LOCAL_RANK"]) for e in envs) == list(range(5))
    assert {e["DLSCHED_NUM_REPLICAS"] for e in envs if e["DLSCHED_ROLE"] == "worker"} == {"2"}


async def test_ps_worker_probe_tf_config_and_ps_stopped_after_workers(stub, tmp_path):
    spec = S.JobSpec(run_mode=S.RUN_MODE_PS_WORKER, replica_groups=[
        probe_group("ps", tmp_path, replicas=2, PROBE_PS="forever"),
        probe_group("worker", tmp_path, replicas=3, PROBE_SLEEP="0.5", PROBE_AWAIT="6"),
        probe_group("chief", tmp_path, PROBE_CHIEF="exit0", PROBE_SLEEP="1", PROBE_AWAIT="6")])
    job = new_id("ps-probe")
    await launch(stub, job, spec)
    obs = await wait_state(stub, job)
    assert obs.state == S.JOB_STATE_SUCCEEDED and obs.exit_code == 0, obs
    got = probes(tmp_path)
    configs = {(p["env"]["DLSCHED_ROLE"], int(p["env"]["DLSCHED_REPLICA_INDEX"])): json.loads(p["env"]["TF_CONFIG"])
               for p in got}
    assert len(configs) == 6
    cluster = configs[("chief", 0)]["cluster"]
    assert sorted(cluster) == ["chief", "ps", "worker"]
    assert [len(cluster[r]) for r in ("chief", "ps", "worker")] == [1, 2, 3]
    addrs = [a for r in cluster.values() for a in r]
    assert len(set(addrs)) == len(addrs)  # a port of its own per task
    for (role, index), c in configs.items():
        assert c["cluster"] == cluster
        assert c["task"] == {"type": role, "index": index}
    st = states_by_replica(obs)
    assert st[("chief", 0)] == S.REPLICA_STATE_SUCCEEDED
    assert {st[("ps", i)] for i in range(2)} == {S.REPLICA_STATE_STOPPED}
    for p in got:
        assert not pid_alive(p["pid"])


async def test_ps_worker_failing_worker_fails_the_job_naming_it(stub, tmp_path):
    spec = S.JobSpec(run_mode=S.RUN_MODE_PS_WORKER, replica_groups=[
        probe_group("ps", tmp_path, PROBE_PS="forever"),
        probe_group("worker", tmp_path, replicas=2, PROBE_AWAIT="3")])
    # worker 1 fails: give it its own exit code through its index
    spec.replica_groups[1].command[2] = textwrap.dedent(PROBE).replace(
        "mode = os.environ.get(", "mode = 'exit3' if os.environ['DLSCHED_ROLE'] == 'worker' and "
        "os.environ['DLSCHED_REPLICA_INDEX'] == '1' else os.environ.get(")
    job = new_id("ps-fail")
    await launch(stub, job, spec)
    obs = await wait_state(stub, job)
    assert obs.state == S.JOB_STATE_FAILED, obs
    assert obs.exit_code == 3 and obs.reason == "NonZeroExit"
    assert "worker-1" in obs.message
    st = states_by_replica(obs)
    assert st[("worker", 1)] == S.REPLICA_STATE_FAILED
    assert st[("ps", 0)] == S.REPLICA_STATE_STOPPED


async def test_stop_during_a_distributed_run_stops_every_replica(stub, tmp_path):
    spec = S.JobSpec(run_mode=S.RUN_MODE_PS_WORKER, replica_groups=[
        probe_group("ps", tmp_path, replicas=2, PROBE_PS="forever"),
        probe_group("worker", tmp_path, replicas=2, PROBE_WORKER="forever")])
    job = new_id("ps-stop")
    await launch(stub, job, spec)
    deadline = time.monotonic() + 120
    while len(probes(tmp_path)) < 4:
        assert time.monotonic() < deadline, "the replicas did not all start"
        await asyncio.sleep(0.1)
    await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job)), timeout=60)
    obs = await wait_state(stub, job)
    assert obs.state == S.JOB_STATE_STOPPED, obs
    assert set(states_by_replica(obs).values()) == {S.REPLICA_STATE_STOPPED}
    for p in probes(tmp_path):
        assert not pid_alive(p["pid"])


@needs_mpirun
async def test_mpi_probe_hostfile_and_launcher_decides(stub, tmp_path):
    launcher = probe_group("launcher", tmp_path)
    spec = S.JobSpec(run_mode=S.RUN_MODE_MPI, replica_groups=[
        launcher, probe_group("worker", tmp_path, replicas=2, ppr=3)])
    job = new_id("mpi-probe")
    await launch(stub, job, spec)
    obs = await wait_state(stub, job)
    assert obs.state == S.JOB_STATE_SUCCEEDED, obs
    got = probes(tmp_path)
    assert len(got) == 1  # the workers are only slots: mpirun ran -np 6 copies under one file name
    env = got[0]["env"]
    assert open(env["DLSCHED_MPI_HOSTFILE"]).read() == "127.0.0.1 slots=6\n"
    assert env["OMPI_COMM_WORLD_SIZE"] == "6"
    assert set(states_by_replica(obs).values()) == {S.REPLICA_STATE_SUCCEEDED}


ARGV_PROBE = """
import json, os, sys
with open(os.path.join(sys.argv[1], 'rank-' + os.environ['OMPI_COMM_WORLD_RANK'] + '.json'), 'w') as f:
    json.dump({'argv': sys.argv[2:], 'size': os.environ['OMPI_COMM_WORLD_SIZE'],
               'env': {k: v for k, v in os.environ.items() if k.startswith('DLSCHED_') or k == 'MY_VAR'}}, f)
"""


@needs_mpirun
async def test_mpi_user_argv_reaches_every_rank_verbatim_and_never_mpirun(stub, tmp_path):
    """mpirun parses no user token: ``:`` starts no second program, ``-np 1`` and ``--host`` change
    nothing, ``--version`` is the program's argument; every rank gets exactly the argv."""
    canary, out = tmp_path / "canary", tmp_path / "out"
    out.mkdir()
    hostile = [":", "touch", str(canary), "-np", "1", "--version", "--host", "x", "-x", "PATH", "--",
               "a b", "it's", "$HOME", "$(id)", "*", "x\ny", "é", ""]
    launcher = S.ReplicaGroup(role="launcher", replicas=1, command=[PY, "-c", ARGV_PROBE, str(out)], args=hostile,
                              env={"MY_VAR": "v 1"})
    spec = S.JobSpec(run_mode=S.RUN_MODE_MPI, replica_groups=[
        launcher, S.ReplicaGroup(role="worker", replicas=2, processes_per_replica=2, command=["unused"])])
    job = new_id("mpi-argv")
    await launch(stub, job, spec)
    obs = await wait_state(stub, job)
    assert obs.state == S.JOB_STATE_SUCCEEDED, (obs, await stderr_of(stub, job))
    got = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
    assert len(got) == 4 and {g["size"] for g in got} == {"4"}  # -np stays the workers' slots
    assert all(g["argv"] == hostile for g in got)
    assert all(g["env"]["DLSCHED_JOB_ID"] == job and g["env"]["MY_VAR"] == "v 1" for g in got)
    assert not canary.exists()  # no second program

    # a command that mpirun would take as its own option is the program's name: it is not found
    job = new_id("mpi-version")
    spec.replica_groups[0].command[:] = ["--version"]
    del spec.replica_groups[0].args[:]
    await launch(stub, job, spec)
    obs = await wait_state(stub, job)
    assert obs.state == S.JOB_STATE_FAILED, obs
    assert not any("Open MPI" in line for line in await stdout_of(stub, job))


@pytest.mark.parametrize("mpirun", [None, "#!/bin/sh\necho 'HYDRA build details:'\n"], ids=["none", "mpich"])
async def test_mpi_without_open_mpi_is_failed_precondition(tmp_path, mpirun):
    bindir = tmp_path / "bin"  # a PATH with python and nothing else: no mpirun, or not Open MPI's
    bindir.mkdir()
    os.symlink(PY, bindir / "python3")
    if mpirun is not None:
        (bindir / "mpirun").write_text(mpirun)
        (bindir / "mpirun").chmod(0o755)
    svc = ServiceProcess("drivers.local", ["--state-dir", str(tmp_path / "state")],
                         env={"PATH": str(bindir)}, name="local-driver-no-mpi").start()
    try:
        async with security.channel(svc.address) as ch:
            s = driver_service_pb2_grpc.DriverServiceStub(ch)
            info = (await s.ConfigureCluster(dpb.ConfigureClusterRequest(cluster=CLUSTER), timeout=10)).info
            assert S.RUN_MODE_MPI not in info.supported_run_modes
            assert S.RUN_MODE_PS_WORKER in info.supported_run_modes
            spec = S.JobSpec(run_mode=S.RUN_MODE_MPI, replica_groups=[
                probe_group("launcher", tmp_path), probe_group("worker", tmp_path)])
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await launch(s, new_id("no-mpi"), spec)
            assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert error_info(ei.value).reason == "MPI_NOT_AVAILABLE"
    finally:
        svc.stop()


# --------------------------------------------------------------------------- the examples


@needs("torch")
async def test_ddp_example_all_reduces_across_master_and_workers(stub, tmp_path):
    job = new_id("ddp")
    await launch(stub, job, example("ddp/ddp.yaml", tmp_path, DDP_STEPS="3"))
    obs = await wait_state(stub, job, within=180)
    assert obs.state == S.JOB_STATE_SUCCEEDED, (obs.reason, obs.message, await stderr_of(stub, job))
    got = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank-*.json"))]
    assert sorted(int(g["env"]["RANK"]) for g in got) == [0, 1, 2]
    assert [g["env"]["DLSCHED_ROLE"] for g in got if g["env"]["RANK"] == "0"] == ["master"]
    assert {g["env"]["WORLD_SIZE"] for g in got} == {"3"}
    assert len({(g["env"]["MASTER_ADDR"], g["env"]["MASTER_PORT"]) for g in got}) == 1
    assert {g["allreduce_sum"] for g in got} == {6.0}
    assert all(g["params_identical"] for g in got)
    assert any("final loss" in line for line in await stdout_of(stub, job))


async def test_ps_worker_example_trains_and_stops_the_parameter_servers(stub, tmp_path):
    job = new_id("ps")
    await launch(stub, job, example("ps_worker/ps_worker.yaml", tmp_path, PS_STEPS="30"))
    obs = await wait_state(stub, job, within=120)
    assert obs.state == S.JOB_STATE_SUCCEEDED, (obs, await stdout_of(stub, job))
    st = states_by_replica(obs)
    assert st == {("ps", 0): S.REPLICA_STATE_STOPPED, ("ps", 1): S.REPLICA_STATE_STOPPED,
                  ("worker", 0): S.REPLICA_STATE_SUCCEEDED, ("worker", 1): S.REPLICA_STATE_SUCCEEDED}
    recs = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert sorted(recs) == ["ps-0", "ps-1", "worker-0", "worker-1"]
    assert len({json.dumps(r["tf_config"]["cluster"], sort_keys=True) for r in recs.values()}) == 1
    for name, r in recs.items():
        role, index = name.split("-")
        assert r["tf_config"]["task"] == {"type": role, "index": int(index)}
    for w in ("worker-0", "worker-1"):
        assert recs[w]["final_loss"] < recs[w]["first_loss"]


@needs("mpi4py")
@needs_mpirun
async def test_mpi_example_allreduces_over_four_ranks(stub, tmp_path):
    job = new_id("mpi")
    await launch(stub, job, example("mpi/mpi.yaml", tmp_path))
    obs = await wait_state(stub, job, within=120)
    assert obs.state == S.JOB_STATE_SUCCEEDED, (obs, await stdout_of(stub, job))
    got = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank-*.json"))]
    assert sorted(g["rank"] for g in got) == [0, 1, 2, 3]
    assert {g["size"] for g in got} == {4}  # == mpirun -np
    assert {g["sum"] for g in got} == {10}
    assert open(got[0]["hostfile"]).read() == "127.0.0.1 slots=4\n"


# --------------------------------------------------------------------------- the whole stack


STACK_GRACE = 2.0


@pytest.fixture(scope="module")
def stack(etcd: EtcdServer) -> Iterator[Stack]:
    with Stack(etcd, f"/dlsched-modes-{uuid.uuid4().hex[:8]}/", jm_args=["--stop-grace-seconds", str(STACK_GRACE)]).running() as st:
        yield st


@pytest.fixture
async def jm(stack: Stack) -> AsyncIterator[jm_grpc.JobManagerServiceStub]:
    assert await stack.register_local() == CLUSTER
    assert stack.jm is not None
    async with security.channel(stack.jm.address) as ch:
        yield jm_grpc.JobManagerServiceStub(ch)


async def submit_and_wait(jm: jm_grpc.JobManagerServiceStub, spec: S.JobSpec, within: float = 120) -> S.Job:
    job = (await jm.SubmitJob(jpb.SubmitJobRequest(job_id=new_id("stack"), spec=spec), timeout=20)).job
    deadline = time.monotonic() + within
    while True:
        job = (await jm.GetJob(jpb.GetJobRequest(name=job.name), timeout=10)).job
        if job.state in TERMINAL:
            return job
        assert time.monotonic() < deadline, f"{job.name} stuck: {job}"
        await asyncio.sleep(0.2)


_STACK_CASES = [
    pytest.param("hello.yaml", id="single_process"),
    pytest.param("multi_process.yaml", id="multi_process"),
    pytest.param("ps_worker/ps_worker.yaml", id="ps_worker"),
    pytest.param("ddp/ddp.yaml", id="master_worker", marks=needs("torch")),
    pytest.param("mpi/mpi.yaml", id="mpi", marks=[needs("mpi4py"), needs_mpirun]),
]


def _records(out: pathlib.Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}


def _check_master_worker(recs: dict[str, dict]) -> None:
    assert sorted(recs) == ["rank-0", "rank-1", "rank-2"]
    assert recs["rank-0"]["env"]["DLSCHED_ROLE"] == "master"
    assert {r["env"]["WORLD_SIZE"] for r in recs.values()} == {"3"}
    assert len({(r["env"]["MASTER_ADDR"], r["env"]["MASTER_PORT"]) for r in recs.values()}) == 1
    assert {r["allreduce_sum"] for r in recs.values()} == {6.0}
    assert all(r["params_identical"] for r in recs.values())


def _check_ps_worker(recs: dict[str, dict]) -> None:
    assert sorted(recs) == ["ps-0", "ps-1", "worker-0", "worker-1"]
    assert len({json.dumps(r["tf_config"]["cluster"], sort_keys=True) for r in recs.values()}) == 1
    for name, r in recs.items():
        role, index = name.split("-")
        assert r["tf_config"]["task"] == {"type": role, "index": int(index)}


def _check_mpi(recs: dict[str, dict]) -> None:
    assert sorted(r["rank"] for r in recs.values()) == [0, 1, 2, 3]
    assert {r["size"] for r in recs.values()} == {4}
    assert {r["sum"] for r in recs.values()} == {10}


# What the ranks saw, checked after each example ran through the services
# (the examples without distributed state record nothing).
_STACK_CHECKS = {"ddp/ddp.yaml": _check_master_worker, "ps_worker/ps_worker.yaml": _check_ps_worker,
                 "mpi/mpi.yaml": _check_mpi}


@pytest.mark.parametrize("path", _STACK_CASES)
async def test_every_mode_succeeds_through_the_services(jm, tmp_path, path):
    env = {"DDP_STEPS": "2", "PS_STEPS": "10"}
    job = await submit_and_wait(jm, example(path, tmp_path, **env))
    if job.state != S.JOB_STATE_SUCCEEDED:  # what failed (pytest cuts a Job's repr before it)
        lines = [f"{e.role}-{e.replica_index}: {e.text}" async for r in jm.StreamJobLogs(
            jpb.StreamJobLogsRequest(name=job.name), timeout=30) for e in r.entries]
        raise AssertionError(
            f"{S.JobState.Name(job.state)} {job.reason}: {job.message!r}; replicas "
            f"{[(r.role, r.index, S.ReplicaState.Name(r.state), r.exit_code, r.message) for r in job.replicas]}"
            "; last lines:\n" + "\n".join(lines[-40:]))
    assert job.cluster == CLUSTER
    assert {r.state for r in job.replicas} <= {S.REPLICA_STATE_SUCCEEDED, S.REPLICA_STATE_STOPPED}, job
    if check := _STACK_CHECKS.get(path):
        check(_records(tmp_path))


# Every process of the job writes a file named by its pid, then ignores
# SIGTERM and runs until it is killed: only the group kill after the grace ends it.
STUBBORN = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(os.path.join(sys.argv[1], f"{os.getpid()}.pid"), "w").close()
while True:
    time.sleep(0.1)
"""


def _stubborn(role: str, out: pathlib.Path, replicas: int = 1, ppr: int = 0) -> S.ReplicaGroup:
    return S.ReplicaGroup(role=role, replicas=replicas, processes_per_replica=ppr,
                          command=[PY, "-c", textwrap.dedent(STUBBORN), str(out)])


_STOP_CASES = [
    pytest.param(S.RUN_MODE_MASTER_WORKER, [("master", 1, 0), ("worker", 2, 2)], 5, id="master_worker"),
    pytest.param(S.RUN_MODE_PS_WORKER, [("ps", 2, 0), ("worker", 2, 0), ("chief", 1, 0)], 5, id="ps_worker"),
    pytest.param(S.RUN_MODE_MPI, [("launcher", 1, 0), ("worker", 2, 2)], 4, id="mpi", marks=needs_mpirun),
]


@pytest.mark.parametrize(("mode", "groups", "processes"), _STOP_CASES)
async def test_stop_job_through_the_services_ends_every_process_of_every_role(jm, tmp_path, mode, groups,
                                                                                processes):
    spec = S.JobSpec(run_mode=mode, replica_groups=[_stubborn(role, tmp_path, n, ppr) for role, n, ppr in groups])
    job = (await jm.SubmitJob(jpb.SubmitJobRequest(job_id=new_id("stack-stop"), spec=spec), timeout=20)).job
    deadline = time.monotonic() + 60
    while len(pids := [int(p.stem) for p in tmp_path.glob("*.pid")]) < processes:
        assert time.monotonic() < deadline, f"only {len(pids)} of {processes} processes started"
        await asyncio.sleep(0.1)
    t0 = time.monotonic()
    await jm.StopJob(jpb.StopJobRequest(name=job.name), timeout=10)
    while [p for p in pids if pid_alive(p)] and time.monotonic() - t0 < STACK_GRACE + 1.0:
        await asyncio.sleep(0.05)
    assert not [p for p in pids if pid_alive(p)], f"processes outlived grace + 1 s: {pids}"
    while (job := (await jm.GetJob(jpb.GetJobRequest(name=job.name), timeout=10)).job).state not in TERMINAL:
        assert time.monotonic() - t0 < 30, job
        await asyncio.sleep(0.1)
    assert job.state == S.JOB_STATE_STOPPED, job
    assert {r.state for r in job.replicas} == {S.REPLICA_STATE_STOPPED}, job
