# ruff: noqa: ASYNC109, ASYNC110, ASYNC230, ASYNC240  -- tests poll a real Slurm, files and /proc
"""Slurm jobs through the services only: a real one-node Slurm behind a real
sshd (tests/slurm_cluster.py), the Slurm driver as a process, ClusterManager
and JobManager over a real etcd, cluster ``slurm`` registered with its SSH
credentials through CreateCluster; every job is submitted, watched, tailed,
measured and stopped through JobManagerService alone, and the cluster's
health is read from ClusterManagerService.

slurmd runs the jobs on this machine as the test's user, so the replicas'
probes write what they saw as JSON files into the test's tmp dir (the #3
contract, docs/ENVIRONMENT.md); the driver's own files live in the cluster
option ``state_dir`` (an absolute path in the cluster's temp dir, as in
tests/slurm_peer.py).

Skips where the cluster cannot run (not root, Debian's ``slurmctld slurmd
slurm-client munge openssh-server`` missing, asyncssh missing); under CI
(CI=true) conftest turns that skip into a failure.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from dlsched.kit.rpc_errors import error_info, field_violations
from dlsched.v1 import cluster_manager_service_pb2 as cm_pb
from dlsched.v1 import cluster_manager_service_pb2_grpc as cm_grpc
from dlsched.v1 import cluster_pb2, job_pb2
from dlsched.v1 import job_manager_service_pb2 as jpb
from dlsched.v1 import job_manager_service_pb2_grpc as jm_grpc
from tests import security, slurm_cluster
from tests.harness import EtcdServer, ServiceProcess, Stack
from tests.through_services import (
    TERMINAL,
    Run,
    assert_one_torch_world,
    cleanup,
    new_id,
    probe_group,
    probes,
    wait_dead,
    wait_file,
)
from tests.through_services import run_to_end as run_spec_to_end

asyncssh = pytest.importorskip("asyncssh")
if why := slurm_cluster.available():
    pytest.skip(why, allow_module_level=True)

S = job_pb2
C = cluster_pb2
PY = sys.executable
CLUSTER = "clusters/slurm"
JOB_TIMEOUT = 90.0
ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
NODE = slurm_cluster.socket.gethostname().split(".")[0]


# --------------------------------------------------------------------------- fixtures: one Slurm, one stack


@pytest.fixture(scope="module")
def slurm() -> Iterator[slurm_cluster.SlurmCluster]:
    c = slurm_cluster.SlurmCluster().start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def slurm_driver(slurm: slurm_cluster.SlurmCluster) -> Iterator[ServiceProcess]:
    svc = ServiceProcess("drivers.slurm", ["--poll-interval", "0.3", "--command-timeout", "10"],
                         name="slurm-driver-services").start()
    try:
        yield svc
    finally:
        svc.stop()


def get_cluster(cm: cm_grpc.ClusterManagerServiceStub) -> C.Cluster:
    return cm.GetCluster(cm_pb.GetClusterRequest(name=CLUSTER), timeout=10).cluster


@pytest.fixture(scope="module")
def stack(etcd: EtcdServer, slurm: slurm_cluster.SlurmCluster, slurm_driver: ServiceProcess) -> Iterator[Stack]:
    """ClusterManager + JobManager (and the local driver Stack brings) with ``clusters/slurm`` READY."""
    st = Stack(etcd, f"/dlsched-slurm-services-{uuid.uuid4().hex[:8]}/", jm_args=["--stop-grace-seconds", "15"])
    try:
        st.start()
        with security.sync_channel(st.cm.address) as ch:
            cm = cm_grpc.ClusterManagerServiceStub(ch)
            creds = C.ClusterCredentials(ssh=C.SshCredentials(
                username=slurm.user, private_key=slurm.user_key, known_host_keys=[slurm.host_key_pub]))
            cm.CreateCluster(cm_pb.CreateClusterRequest(
                cluster_id="slurm", request_id=f"register-slurm-{uuid.uuid4().hex[:8]}",
                cluster=C.Cluster(type=S.CLUSTER_TYPE_SLURM, address=slurm.address, credentials=creds,
                                  driver_address=slurm_driver.address, options=slurm.options())),
                timeout=20)
            deadline = time.monotonic() + 60
            while (c := get_cluster(cm)).state != C.CLUSTER_STATE_READY:
                assert time.monotonic() < deadline, f"{CLUSTER} never READY: {c}"
                time.sleep(0.3)
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


@pytest.fixture
async def cm(stack: Stack) -> AsyncIterator[cm_grpc.ClusterManagerServiceStub]:
    async with security.channel(stack.cm.address) as ch:
        yield cm_grpc.ClusterManagerServiceStub(ch)


# --------------------------------------------------------------------------- helpers


def on_slurm(mode: int, *groups: S.ReplicaGroup) -> S.JobSpec:
    """A spec whose selector names the Slurm cluster (the local cluster could run it too)."""
    return S.JobSpec(run_mode=mode, replica_groups=list(groups),
                     cluster_selector=S.ClusterSelector(cluster="slurm"))


def single(code: str, *args: str, **kw: object) -> S.JobSpec:
    return on_slurm(S.RUN_MODE_SINGLE_PROCESS, S.ReplicaGroup(
        role="main", replicas=1, command=[PY, "-u", "-c", textwrap.dedent(code)], args=list(args),
        **kw))  # type: ignore[arg-type]


def run_of(jm: jm_grpc.JobManagerServiceStub, spec: S.JobSpec) -> Run:
    return Run(jm, spec, prefix="slurm-svc", cluster=CLUSTER, job_timeout=JOB_TIMEOUT, submit_timeout=60)


@pytest.fixture
async def runs(jm: jm_grpc.JobManagerServiceStub) -> AsyncIterator[list[Run]]:
    """Runs made by a test; their watches are closed and unfinished jobs stopped after it."""
    made: list[Run] = []
    yield made
    await cleanup(jm, made)


async def run_to_end(jm: jm_grpc.JobManagerServiceStub, runs: list[Run], spec: S.JobSpec) -> tuple[Run, S.Job]:
    return await run_spec_to_end(run_of(jm, spec), runs)


async def launch_settled(jm: jm_grpc.JobManagerServiceStub, job: S.Job, within: float = 60) -> S.Job:
    """The job once its launch is decided (SubmitJob answers before it: PENDING LaunchQueued)."""
    deadline = time.monotonic() + within
    while job.state == S.JOB_STATE_PENDING and not job.backend_job_id and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        job = (await jm.GetJob(jpb.GetJobRequest(name=job.name), timeout=10)).job
    return job


def assert_one_slurm_world(envs: list[dict], size: int) -> None:
    assert_one_torch_world(envs, size)
    assert envs[0]["MASTER_ADDR"] == NODE  # the allocation's (only) node

# --------------------------------------------------------------------------- the cluster, as ClusterManager sees it


async def test_the_cluster_is_ready_with_slurms_capacity_and_every_mode(cm):
    c = (await cm.GetCluster(cm_pb.GetClusterRequest(name=CLUSTER), timeout=10)).cluster
    assert c.state == C.CLUSTER_STATE_READY and c.type == S.CLUSTER_TYPE_SLURM, c
    assert c.has_credentials and not c.HasField("credentials")  # write-only: never returned
    cap = c.capacity
    assert (cap.nodes_total, cap.cpus_total, cap.max_cpus_per_node) == (1, 2, 2), cap  # CPUs=2 in slurm.conf
    assert 0 < cap.memory_bytes_total <= 1000 << 20, cap  # RealMemory=1000 (MiB)
    assert 0 <= cap.cpus_free <= cap.cpus_total and 0 <= cap.nodes_free <= cap.nodes_total, cap
    assert set(c.supported_run_modes) == {S.RUN_MODE_SINGLE_PROCESS, S.RUN_MODE_MULTI_PROCESS,
                                          S.RUN_MODE_MASTER_WORKER, S.RUN_MODE_PS_WORKER, S.RUN_MODE_MPI}


# --------------------------------------------------------------------------- the five run modes


async def test_single_process_succeeds_with_the_job_environment(jm, runs, tmp_path):
    r, job = await run_to_end(jm, runs, on_slurm(S.RUN_MODE_SINGLE_PROCESS, probe_group("main", tmp_path)))
    assert job.state == S.JOB_STATE_SUCCEEDED and job.exit_code == 0, job
    assert job.cluster == CLUSTER and job.backend_job_id.isdigit() and job.attempt == 1, job
    assert r.states[0] == S.JOB_STATE_PENDING and r.states[-1] == S.JOB_STATE_SUCCEEDED, r.states
    [rec] = probes(tmp_path)
    env = rec["env"]
    assert (env["DLSCHED_JOB_ID"], env["DLSCHED_JOB_NAME"]) == (r.id, r.name)
    assert (env["DLSCHED_ROLE"], env["DLSCHED_REPLICA_INDEX"], env["DLSCHED_NUM_REPLICAS"]) == ("main", "0", "1")
    assert env["SLURM_JOB_ID"] == job.backend_job_id  # it ran under that Slurm job
    assert [(e.role, e.replica_index, e.text) for e in await r.logs()] == [("main", 0, "probe main-0-")]


async def test_multi_process_every_rank_distinct_in_one_world(jm, runs, tmp_path):
    spec = on_slurm(S.RUN_MODE_MULTI_PROCESS, probe_group("worker", tmp_path, replicas=2))
    r, job = await run_to_end(jm, runs, spec)
    assert job.state == S.JOB_STATE_SUCCEEDED, job
    envs = [p["env"] for p in probes(tmp_path)]
    assert len(envs) == 2
    assert_one_slurm_world(envs, 2)
    assert len({e["SLURM_JOB_ID"] for e in envs}) == 1  # one allocation
    assert len({e["SLURM_STEP_ID"] for e in envs}) == 2  # a step per process
    entries = await r.logs(replica_index=1)
    assert [(e.role, e.replica_index, e.text) for e in entries] == [("worker", 1, "probe worker-1-1")]


async def test_master_worker_one_world_with_rank_zero_on_the_master(jm, runs, tmp_path):
    spec = on_slurm(S.RUN_MODE_MASTER_WORKER, probe_group("worker", tmp_path),  # listed first on purpose
                    probe_group("master", tmp_path))
    r, job = await run_to_end(jm, runs, spec)
    assert job.state == S.JOB_STATE_SUCCEEDED, job
    envs = [p["env"] for p in probes(tmp_path)]
    assert len(envs) == 2
    assert_one_slurm_world(envs, 2)
    assert [e["DLSCHED_ROLE"] for e in envs if e["RANK"] == "0"] == ["master"]  # the master holds rank 0
    lines = sorted((e.role, e.text) for e in await r.logs())
    assert lines == [("master", "probe master-0-0"), ("worker", "probe worker-0-1")]


async def test_ps_worker_tf_config_and_parameter_servers_stopped_after_workers(jm, runs, tmp_path):
    spec = on_slurm(S.RUN_MODE_PS_WORKER, probe_group("ps", tmp_path, PROBE_PS="forever"),
                    probe_group("worker", tmp_path, PROBE_AWAIT="2"))
    _, job = await run_to_end(jm, runs, spec)
    assert job.state == S.JOB_STATE_SUCCEEDED and job.exit_code == 0, job
    got = probes(tmp_path)
    configs = {(p["env"]["DLSCHED_ROLE"], int(p["env"]["DLSCHED_REPLICA_INDEX"])): json.loads(p["env"]["TF_CONFIG"])
               for p in got}
    assert sorted(configs) == [("ps", 0), ("worker", 0)]
    cluster = configs[("ps", 0)]["cluster"]
    assert sorted(cluster) == ["ps", "worker"] and [len(cluster["ps"]), len(cluster["worker"])] == [1, 1]
    addrs = [a for tasks in cluster.values() for a in tasks]
    assert len(set(addrs)) == len(addrs)  # a port of its own per task
    assert {a.rpartition(":")[0] for a in addrs} == {NODE}
    for (role, index), c in configs.items():
        assert c == {"cluster": cluster, "task": {"type": role, "index": index}}  # same cluster, own task
    # The parameter servers never exit by themselves: the job succeeded on the workers and they were stopped.
    await wait_dead([p["pid"] for p in got])


async def test_mpi_runs_np_ranks_from_the_hostfile(jm, runs, tmp_path):
    spec = on_slurm(S.RUN_MODE_MPI, probe_group("launcher", tmp_path, **ROOT_OK),
                    probe_group("worker", tmp_path, replicas=1, ppr=2))
    dry = await jm.SubmitJob(jpb.SubmitJobRequest(job_id=new_id("mpi-dry"), spec=spec, dry_run=True), timeout=30)
    assert dry.dry_run.cluster == CLUSTER
    assert '"$dlsched_mpirun_bin" -np 2 --hostfile' in dry.dry_run.native_spec.content, dry.dry_run.native_spec.content
    r, job = await run_to_end(jm, runs, spec)
    assert job.state == S.JOB_STATE_SUCCEEDED, job
    envs = [p["env"] for p in probes(tmp_path)]
    assert sorted(int(e["OMPI_COMM_WORLD_RANK"]) for e in envs) == [0, 1]  # as many ranks as -np, each once
    assert {e["OMPI_COMM_WORLD_SIZE"] for e in envs} == {"2"}
    [hostfile] = {e["DLSCHED_MPI_HOSTFILE"] for e in envs}
    assert pathlib.Path(hostfile).read_text() == f"{NODE} slots=2\n"  # the allocation's node, -np slots
    assert sorted(e.text for e in await r.logs()) == ["probe launcher-0-0", "probe launcher-0-1"]


# --------------------------------------------------------------------------- logs, usage, stop


async def test_logs_stream_and_usage_is_measured_while_the_job_runs(jm, runs, tmp_path):
    go = tmp_path / "go"
    code = """
    import os, sys, time
    ballast = bytearray(64 << 20)
    for i in range(len(ballast) // 4096):
        ballast[i * 4096] = 1  # touch every page: 64 MiB resident
    print('ready', flush=True)
    while not os.path.exists(sys.argv[1]):  # busy: CPU time accrues until the test lets it end
        pass
    time.sleep(2)  # more than the log index's second between the lines
    print('done', flush=True)
    """
    r = run_of(jm, single(code, str(go)))
    runs.append(r)
    await r.submit()
    texts: list[str] = []
    stamps: list[int] = []
    usage: S.ReplicaUsage | None = None
    req = jpb.StreamJobLogsRequest(name=r.name, follow=True)
    async for resp in jm.StreamJobLogs(req, timeout=JOB_TIMEOUT):
        for e in resp.entries:
            texts.append(e.text)
            stamps.append(e.time.ToNanoseconds())
            if e.text != "ready":
                continue
            assert (await r.get()).state not in TERMINAL  # a line of a job that has not ended
            await r.until((S.JOB_STATE_RUNNING,), within=30)  # the poller may see it start a round later
            deadline = time.monotonic() + 30
            while True:  # sstat samples every second (JobAcctGatherFrequency=1)
                u = (await jm.GetJobUsage(jpb.GetJobUsageRequest(name=r.name), timeout=30)).usage
                if u.replicas and u.replicas[0].cpu_seconds >= 1 and u.replicas[0].peak_memory_bytes >= 64 << 20:
                    usage = u.replicas[0]
                    break
                assert time.monotonic() < deadline, u
                await asyncio.sleep(0.5)
            go.touch()
    assert texts == ["ready", "done"], texts  # the stream ended OK after the job's last line
    assert usage is not None
    assert (usage.role, usage.replica_index, usage.running) == ("main", 0, True), usage
    assert usage.cpu_seconds < 60 and usage.peak_memory_bytes < 1 << 30, usage  # plausible for this job
    job = await r.until()
    assert job.state == S.JOB_STATE_SUCCEEDED, job
    # no accounting storage: Slurm keeps no usage of an ended job, so the driver's last sample stands
    after = (await jm.GetJobUsage(jpb.GetJobUsageRequest(name=r.name), timeout=30)).usage
    assert [(u.role, u.replica_index, u.running) for u in after.replicas] == [("main", 0, False)], after
    last = after.replicas[0]
    assert last.cpu_seconds >= usage.cpu_seconds and last.peak_memory_bytes >= 64 << 20, after
    assert last.memory_bytes == 0 and after.HasField("sample_time"), after
    # each line dated when it was written, to about a second (the log index): since_time picks the last
    assert stamps[0] + 2_000_000_000 < stamps[1], stamps
    since = Timestamp()
    since.FromNanoseconds(stamps[1] - 500_000_000)
    later = [e.text async for resp in jm.StreamJobLogs(jpb.StreamJobLogsRequest(name=r.name, since_time=since),
                                                         timeout=30) for e in resp.entries]
    assert later == ["done"], later


async def test_a_log_stream_resumed_from_any_cursor_sends_exactly_the_rest(jm, runs):
    """A follower gets most lines before the log index covers them (dated by their file's
    mtime), a resume reads them again dated by the index: resuming from each cursor of the
    followed stream still sends every later line once and no earlier one."""
    code = """
    import sys, time
    for i in range(60):
        print(f'out-{i}', flush=True)
        if i % 7 == 0:
            print(f'err-{i}', file=sys.stderr, flush=True)
        time.sleep(0.05)
    """
    r = run_of(jm, single(code))
    runs.append(r)
    await r.submit()
    batches: list[tuple[list[tuple[int, str]], str]] = []
    async for resp in jm.StreamJobLogs(jpb.StreamJobLogsRequest(name=r.name, follow=True), timeout=JOB_TIMEOUT):
        batches.append(([(e.stream, e.text) for e in resp.entries], resp.resume_cursor))
    everything = [x for b, _ in batches for x in b]
    assert [t for s, t in everything if s == S.LOG_STREAM_STDOUT] == [f"out-{i}" for i in range(60)], everything
    assert (await r.until()).state == S.JOB_STATE_SUCCEEDED
    for i, (_, cursor) in enumerate(batches):
        if not cursor:
            continue
        rest = [(e.stream, e.text) async for resp in jm.StreamJobLogs(
            jpb.StreamJobLogsRequest(name=r.name, follow=True, resume_cursor=cursor), timeout=60)
            for e in resp.entries]
        done = [x for b, _ in batches[:i + 1] for x in b]
        for stream in (S.LOG_STREAM_STDOUT, S.LOG_STREAM_STDERR):
            pick = [t for s, t in done + rest if s == stream]
            assert pick == [t for s, t in everything if s == stream], (i, stream, rest)


async def test_stop_job_ends_a_running_job_stopped(jm, runs, tmp_path):
    r = run_of(jm, on_slurm(S.RUN_MODE_SINGLE_PROCESS, probe_group("main", tmp_path, PROBE_MAIN="forever")))
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
    assert job.state == S.JOB_STATE_STOPPED, job  # Slurm's CANCELLED
    assert set(r.states) <= {S.JOB_STATE_PENDING, S.JOB_STATE_QUEUED, S.JOB_STATE_RUNNING,
                             S.JOB_STATE_STOPPING, S.JOB_STATE_STOPPED}, r.states
    await wait_dead([p["pid"] for p in got])
    again = (await jm.StopJob(jpb.StopJobRequest(name=r.name), timeout=20)).job  # ended: unchanged
    assert again.state == S.JOB_STATE_STOPPED


async def test_a_stop_outlives_a_driver_killed_in_its_grace(jm, runs, slurm_driver, tmp_path):
    """The driver is SIGKILLed after a stop's SIGTERM, within its grace, so the scancel that would
    end processes that ignore SIGTERM is never sent. JobManager asks the restarted driver again
    (it reports the job running): the job ends STOPPED and its process is gone."""
    pid_file = tmp_path / "pid"
    r = run_of(jm, single("""
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with open(sys.argv[1] + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(sys.argv[1] + ".tmp", sys.argv[1])
        time.sleep(600)""", str(pid_file)))
    runs.append(r)
    await r.submit()
    await r.until((S.JOB_STATE_RUNNING,))
    await wait_file(pid_file)
    pid = int(pid_file.read_text())
    stopped = (await jm.StopJob(jpb.StopJobRequest(name=r.name), timeout=20)).job
    assert stopped.state == S.JOB_STATE_STOPPING, stopped  # SIGTERM sent (ignored), the grace (15 s) runs
    args, address = list(slurm_driver.args), slurm_driver.address
    slurm_driver.kill()
    try:
        slurm_driver.args = [*args, "--listen", address]  # where ClusterManager knows it
        await asyncio.to_thread(slurm_driver.start)
    finally:
        slurm_driver.args = args
    job = await r.until()
    assert job.state == S.JOB_STATE_STOPPED, job
    await wait_dead([pid], within=60)


# --------------------------------------------------------------------------- jobs that cannot start


async def test_a_job_that_cannot_start_is_refused_or_says_why(jm, runs, tmp_path):
    too_big = single("print(1)")
    too_big.replica_groups[0].resources.cpu = 64
    with pytest.raises(grpc.aio.AioRpcError) as ei:  # the matcher knows the node has 2 CPUs
        await jm.SubmitJob(jpb.SubmitJobRequest(job_id=new_id("toobig"), spec=too_big), timeout=30)
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(ei.value).reason == "NO_MATCHING_CLUSTER"

    no_partition = single("print(1)")
    no_partition.queue = "no-such-partition"
    job = (await jm.SubmitJob(jpb.SubmitJobRequest(job_id=new_id("nopart"), spec=no_partition), timeout=30)).job
    job = await launch_settled(jm, job)
    assert job.state == S.JOB_STATE_FAILED and job.reason == "LaunchRejected", job  # stored, says why
    assert "SBATCH_REJECTED" in job.message, job.message

    # Three processes of one CPU each (the least Slurm gives a task) on the 2-CPU node (asking no
    # CPUs, so the matcher leaves it to the site): Slurm queues it for PartitionConfig, which no
    # wait resolves, so the job FAILS Unschedulable saying Slurm's why, and nothing ran.
    r = run_of(jm, on_slurm(S.RUN_MODE_MULTI_PROCESS, probe_group("worker", tmp_path, replicas=3)))
    runs.append(r)
    await r.submit()
    job = await r.until()
    assert (job.state, job.reason) == (S.JOB_STATE_FAILED, "Unschedulable"), job
    assert "PartitionConfig" in job.message, job.message
    assert not probes(tmp_path)  # nothing ran


# --------------------------------------------------------------------------- hostile specs

# Every one of these, as an argument, a command word, an env value or in the working directory's name,
# must reach the program as it is and run nothing.
HOSTILE = [
    "$(touch CANARY)", "`touch CANARY`", "a\n#SBATCH --wrap=touch CANARY\n", "\n#SBATCH --chdir=/nonexistent",
    "'; touch CANARY; '", '"; touch CANARY; "', "; touch CANARY", "&& touch CANARY", "| touch CANARY",
    "-x", "--help", ":", "-np", "--export=NONE", "$HOME ${PATH} $$ $1 !! ~ * ?", "\\", "\\'", "%j %u %x", "",
    "ünï ✓ \t\r", "x\x1by", "'", '"',
]


async def test_hostile_args_env_and_working_dir_arrive_byte_for_byte_and_run_nothing(jm, runs, slurm, tmp_path):
    work = tmp_path / "w $(touch CANARY) `touch CANARY`; '\"-x"
    work.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    code = """
    import json, os, sys
    with open(os.environ['OUT_FILE'], 'w') as f:
        json.dump({'argv': sys.argv[1:], 'env': {k: v for k, v in os.environ.items() if k.startswith('H_')},
                   'cwd': os.getcwd()}, f)
    """
    env = {f"H_{i}": v for i, v in enumerate(HOSTILE)}
    env["OUT_FILE"] = str(out / "seen.json")
    spec = on_slurm(S.RUN_MODE_SINGLE_PROCESS, S.ReplicaGroup(
        role="main", replicas=1, command=[PY, "-c", textwrap.dedent(code), *HOSTILE[:3]], args=HOSTILE[3:],
        env=env, working_dir=str(work)))
    _, job = await run_to_end(jm, runs, spec)
    assert job.state == S.JOB_STATE_SUCCEEDED, job
    seen = json.loads((out / "seen.json").read_text())
    assert seen["argv"] == HOSTILE  # byte for byte, in order, none dropped or split
    assert seen["env"] == {k: v for k, v in env.items() if k.startswith("H_")}
    assert seen["cwd"] == str(work)
    canaries = [p / "CANARY" for p in (tmp_path, work, out, pathlib.Path.home(), pathlib.Path(slurm.home))]
    assert not [str(p) for p in canaries if p.exists()], "a hostile value ran as shell code"


async def test_a_working_dir_that_does_not_exist_fails_the_job_in_every_mode(jm, runs, slurm, tmp_path):
    """srun --chdir to a missing directory runs the step in /tmp instead (slurmstepd's
    fallback): a job SUCCEEDED there, scattering its files, while PS_WORKER's wrapper failed
    it. Every mode fails it, exit 126, as the `cd` of the other paths does."""
    missing = str(tmp_path / "no" / "such" / "dir")
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'a').write('ran\\n')"
    for mode, roles in ((S.RUN_MODE_SINGLE_PROCESS, ("main",)), (S.RUN_MODE_MULTI_PROCESS, ("worker",))):
        spec = on_slurm(mode, *(S.ReplicaGroup(role=role, replicas=1, command=[PY, "-c", code],
                                               working_dir=missing) for role in roles))
        _, job = await run_to_end(jm, runs, spec)
        assert job.state == S.JOB_STATE_FAILED and job.exit_code == 126, job
    assert not marker.exists(), "a process ran outside its working directory"


@pytest.mark.parametrize(("field", "mutate"), [
    ("job_id", lambda req: setattr(req, "job_id", "x;touch-canary$(id)")),
    ("spec.labels", lambda req: req.spec.labels.__setitem__("team", "$(touch CANARY)")),
    ("spec.labels", lambda req: req.spec.labels.__setitem__("a\n#SBATCH", "x")),
    ("spec.replica_groups[0].role", lambda req: setattr(req.spec.replica_groups[0], "role", "main;touch x")),
    ("spec.replica_groups[0].env", lambda req: req.spec.replica_groups[0].env.__setitem__("A;touch X", "1")),
    ("spec.replica_groups[0].env", lambda req: req.spec.replica_groups[0].env.__setitem__("-A", "1")),
], ids=["job_id", "label_value", "label_key", "role", "env_name", "env_name_dash"])
async def test_hostile_names_are_refused_naming_the_field(jm, field, mutate):
    req = jpb.SubmitJobRequest(job_id=new_id("hostile"), spec=single("print(1)"))
    req.spec.replica_groups[0].role = "main"
    mutate(req)
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await jm.SubmitJob(req, timeout=30)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(ei.value).reason == "INVALID_ARGUMENT"
    assert any(v.startswith(field) for v in _violated_fields(ei.value)), _violated_fields(ei.value)
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await jm.GetJob(jpb.GetJobRequest(name=f"jobs/{req.job_id}"), timeout=10)
    assert ei.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)  # nothing stored


async def test_hostile_partition_never_reaches_an_sbatch_line(jm):
    spec = single("print(1)")
    spec.queue = "debug\n#SBATCH --wrap=touch CANARY"
    job_id = new_id("hostile-queue")
    try:
        resp = await jm.SubmitJob(jpb.SubmitJobRequest(job_id=job_id, spec=spec), timeout=30)
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert any(v.startswith("spec.queue") for v in _violated_fields(e)), _violated_fields(e)
    else:  # stored, then refused by the driver: FAILED with the reason, never run
        job = await launch_settled(jm, resp.job)
        assert job.state == S.JOB_STATE_FAILED and job.reason == "LaunchRejected", job
        assert "spec.queue" in job.message, job.message
        assert not job.backend_job_id
    assert not (pathlib.Path.home() / "CANARY").exists()


def _violated_fields(e: grpc.aio.AioRpcError) -> list[str]:
    return [v.field for v in field_violations(e)]


# --------------------------------------------------------------------------- an outage, seen from ClusterManager


class ClusterWatch:
    """WatchClusters on the Slurm cluster: every state it shows, in order."""

    def __init__(self, cm: cm_grpc.ClusterManagerServiceStub) -> None:
        self.states: list[int] = []
        self.last: C.Cluster | None = None
        self._call = cm.WatchClusters(cm_pb.WatchClustersRequest(filter="type=SLURM"))
        self._it = self._call.__aiter__()

    async def until(self, state: int, within: float) -> C.Cluster:
        """The cluster once it is in ``state``. The driver process runs throughout, so ClusterManager
        calling it DRIVER_UNAVAILABLE is wrong at once: the backend is what is down, not the driver."""
        deadline = time.monotonic() + within
        while True:
            left = deadline - time.monotonic()
            try:
                ev = await asyncio.wait_for(self._it.__anext__(), max(left, 0.01))
            except TimeoutError:
                raise AssertionError(f"{CLUSTER} not {C.ClusterState.Name(state)} in {within:g} s; it went "
                                     f"{[C.ClusterState.Name(s) for s in self.states]}: {self.last}") from None
            if ev.cluster.name != CLUSTER:
                continue
            self.last = ev.cluster
            if not self.states or self.states[-1] != ev.cluster.state:
                self.states.append(ev.cluster.state)
            assert ev.cluster.state != C.CLUSTER_STATE_DRIVER_UNAVAILABLE, ev.cluster
            if ev.cluster.state == state:
                return ev.cluster

    def close(self) -> None:
        self._call.cancel()


# slurmctld down: `scontrol show nodes` takes ~9 s to fail (the Slurm client retries the
# controller), so the driver bounds GetClusterInfo's call to stay within ClusterManager's deadline.
@pytest.mark.parametrize("outage", ["sshd", "slurmctld"])
async def test_an_outage_turns_the_cluster_unreachable_and_keeps_the_job_state(jm, cm, runs, slurm, tmp_path,
                                                                                outage):
    """sshd killed with its connections (SSH unreachable) or slurmctld stopped (every Slurm command fails):
    ClusterManager shows the cluster UNREACHABLE, JobManager keeps the running job RUNNING with reason
    BackendStale while it ends unseen; once the outage is over the cluster is READY again and the job
    reaches its true end."""
    stop, start = getattr(slurm, f"stop_{outage}"), getattr(slurm, f"start_{outage}")
    go, started = tmp_path / "go", tmp_path / "started"
    r = run_of(jm, single("""
    import os, sys, time
    open(sys.argv[2], 'w').close()
    print('up', flush=True)
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.1)
    """, str(go), str(started)))
    runs.append(r)
    watch = ClusterWatch(cm)
    try:
        await watch.until(C.CLUSTER_STATE_READY, 20)
        await r.submit()
        await r.until((S.JOB_STATE_RUNNING,))
        # Slurm says R once the batch script starts; srun still needs slurmctld to create the step, so
        # the outage begins once the program itself runs (an outage before the step is a real failure).
        await wait_file(started)
        await asyncio.to_thread(stop)
        try:
            down = await watch.until(C.CLUSTER_STATE_UNREACHABLE, 60)
            assert down.state_message, down
            # The job ends while nobody can see it; JobManager keeps its last state, saying why.
            go.touch()
            deadline = time.monotonic() + 30
            while (job := await r.get()).reason != "BackendStale":
                assert job.state == S.JOB_STATE_RUNNING, job  # never FAILED on an outage
                assert time.monotonic() < deadline, job
                await asyncio.sleep(0.3)
            assert job.state == S.JOB_STATE_RUNNING, job
            got = await cm.GetCluster(cm_pb.GetClusterRequest(name=CLUSTER), timeout=10)
            assert got.cluster.state == C.CLUSTER_STATE_UNREACHABLE, got.cluster
        finally:
            await asyncio.to_thread(start)
        up = await watch.until(C.CLUSTER_STATE_READY, 90)  # reconnected (with backoff), answering
        assert up.capacity.cpus_total == 2, up
        job = await r.until(within=90)
        why = f"{job}\nstates {r.states} reasons {r.reasons}\n{slurm.diagnosis(job.backend_job_id)}"
        assert job.state == S.JOB_STATE_SUCCEEDED and job.exit_code == 0, why  # its true end
        assert S.JOB_STATE_FAILED not in r.states, why
        assert "BackendStale" in r.reasons, r.reasons
        assert watch.states[-3:] == [C.CLUSTER_STATE_READY, C.CLUSTER_STATE_UNREACHABLE, C.CLUSTER_STATE_READY], \
            watch.states
    finally:
        watch.close()


async def test_a_job_id_used_again_after_a_delete_runs_again(jm):
    """DeleteJob, then SubmitJob with the same id while squeue still lists the first job (its
    comment ``dlsched-<id>.1`` is the new attempt's too): the new job runs, it is not the old
    Slurm job adopted (which ended SUCCEEDED at once, with no log, never run)."""
    job_id = f"reuse-{uuid.uuid4().hex[:6]}"
    seen = []
    for word in ("first", "second"):
        spec = on_slurm(S.RUN_MODE_SINGLE_PROCESS, S.ReplicaGroup(role="main", replicas=1,
                                                                    command=["/bin/echo", word]))
        name = (await jm.SubmitJob(jpb.SubmitJobRequest(job_id=job_id, spec=spec), timeout=30)).job.name
        deadline = time.monotonic() + JOB_TIMEOUT
        while (j := (await jm.GetJob(jpb.GetJobRequest(name=name), timeout=30)).job).state not in (
                S.JOB_STATE_SUCCEEDED, S.JOB_STATE_FAILED, S.JOB_STATE_STOPPED):
            assert time.monotonic() < deadline, j
            await asyncio.sleep(0.3)
        lines = [e.text async for r in jm.StreamJobLogs(jpb.StreamJobLogsRequest(name=name), timeout=60)
                 for e in r.entries]
        seen.append((j.state, j.backend_job_id, lines))
        if word == "first":
            await jm.DeleteJob(jpb.DeleteJobRequest(name=name), timeout=60)
    (s1, b1, l1), (s2, b2, l2) = seen
    assert (s1, l1, s2, l2) == (S.JOB_STATE_SUCCEEDED, ["first"], S.JOB_STATE_SUCCEEDED, ["second"]), seen
    assert b1 != b2
