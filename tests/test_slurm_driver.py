"""The Slurm driver as a real process over real gRPC, against a real Slurm behind a real sshd.

Skips (never fails) where the cluster cannot run: not root, or Debian's
``slurmctld slurmd slurm-client munge openssh-server`` missing
(``bash scripts/install-slurm.sh``), or asyncssh missing (``pip install -e '.[slurm]'``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from dlsched.kit.rpc_errors import error_info
from dlsched.v1 import cluster_pb2, driver_service_pb2_grpc, job_pb2
from dlsched.v1 import driver_service_pb2 as dpb
from drivers.slurm import render
from drivers.slurm.poller import MIN_INTERVAL
from tests import security, slurm_cluster
from tests.harness import ServiceProcess, backend_calls

asyncssh = pytest.importorskip("asyncssh")
if why := slurm_cluster.available():
    pytest.skip(why, allow_module_level=True)

PY = sys.executable
CLUSTER = "clusters/slurm"
TERMINAL = (job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_STOPPED)


@pytest.fixture(scope="module")
def cluster() -> Iterator[slurm_cluster.SlurmCluster]:
    c = slurm_cluster.SlurmCluster().start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def driver(cluster: slurm_cluster.SlurmCluster) -> Iterator[ServiceProcess]:
    svc = ServiceProcess("drivers.slurm", ["--poll-interval", "0.3"], name="slurm-driver").start()
    yield svc
    svc.stop()


def configure_request(c: slurm_cluster.SlurmCluster, name: str = CLUSTER,
                      host_keys: Sequence[str] | None = None) -> dpb.ConfigureClusterRequest:
    return dpb.ConfigureClusterRequest(
        cluster=name, address=c.address, options=c.options(),
        credentials=cluster_pb2.ClusterCredentials(ssh=cluster_pb2.SshCredentials(
            username=c.user, private_key=c.user_key,
            known_host_keys=list(host_keys if host_keys is not None else [c.host_key_pub]))))


@pytest.fixture
async def stub(driver: ServiceProcess, cluster: slurm_cluster.SlurmCluster
               ) -> AsyncIterator[driver_service_pb2_grpc.DriverServiceStub]:
    async with security.channel(driver.address) as ch:
        s = driver_service_pb2_grpc.DriverServiceStub(ch)
        await s.ConfigureCluster(configure_request(cluster), timeout=30)
        yield s


_n = iter(range(10**6))


def new_id(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{next(_n)}"


def single(code: str, **kw: object) -> job_pb2.JobSpec:
    return job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[
        job_pb2.ReplicaGroup(role="main", replicas=1, command=[PY, "-u", "-c"], args=[code], **kw)])  # type: ignore[arg-type]


async def launch(stub, job_id: str, spec: job_pb2.JobSpec, attempt: int = 1) -> dpb.LaunchJobResponse:
    return await stub.LaunchJob(dpb.LaunchJobRequest(cluster=CLUSTER, job_id=job_id, spec=spec,
                                                     attempt=attempt), timeout=60)


async def observe(stub, job_id: str) -> dpb.JobObservation:
    resp = await stub.BatchGetJobObservations(dpb.BatchGetJobObservationsRequest(
        cluster=CLUSTER, jobs=[dpb.JobRef(job_id=job_id)]), timeout=30)
    return resp.observations[0]


async def wait_state(stub, job_id: str, states: Sequence[int] = TERMINAL, within: float = 60.0
                     ) -> dpb.JobObservation:
    deadline = time.monotonic() + within
    while True:
        obs = await observe(stub, job_id)
        if obs.state in states:
            return obs
        if time.monotonic() > deadline:
            raise AssertionError(f"{job_id} still {job_pb2.JobState.Name(obs.state)}: {obs}")
        await asyncio.sleep(0.2)


async def logs(stub, job_id: str, **kw: object) -> list[job_pb2.LogEntry]:
    out: list[job_pb2.LogEntry] = []
    req = dpb.TailJobLogsRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job_id), **kw)  # type: ignore[arg-type]
    async for resp in stub.TailJobLogs(req, timeout=60):
        out.extend(resp.entries)
    return out


async def test_cluster_info_reports_the_node(stub):
    info = (await stub.GetClusterInfo(dpb.GetClusterInfoRequest(cluster=CLUSTER), timeout=30)).info
    assert info.state == cluster_pb2.CLUSTER_STATE_READY, info.message
    assert info.capacity.nodes_total == 1
    assert info.capacity.cpus_total == 2
    assert info.capacity.memory_bytes_total > 0


async def test_single_process_succeeds_with_its_output(stub):
    jid = new_id("single")
    args = ["a b", "$(touch CANARY)", "-x", "line\nbreak"]
    code = "import os, sys; print('hello', os.environ['DLSCHED_JOB_ID']); print(repr(sys.argv[1:]))"
    spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[
        job_pb2.ReplicaGroup(role="main", replicas=1, command=[PY, "-u", "-c", code], args=args)])
    first = await launch(stub, jid, spec)
    assert first.backend_job_id.isdigit()
    assert "#SBATCH --job-name=dlsched-" + jid in first.native_spec.content
    again = await launch(stub, jid, spec)
    assert again.backend_job_id == first.backend_job_id  # idempotent: one Slurm job
    obs = await wait_state(stub, jid)
    assert obs.state == job_pb2.JOB_STATE_SUCCEEDED, obs
    assert obs.exit_code == 0
    lines = [e.text for e in await logs(stub, jid) if e.stream == job_pb2.LOG_STREAM_STDOUT]
    assert lines == [f"hello {jid}", repr(args)]


async def test_multi_process_succeeds_with_ranks(stub):
    jid = new_id("multi")
    code = "import os; print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], os.environ['MASTER_ADDR'])"
    spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_MULTI_PROCESS, replica_groups=[
        job_pb2.ReplicaGroup(role="worker", replicas=1, processes_per_replica=2,
                             command=[PY, "-u", "-c", code])])
    await launch(stub, jid, spec)
    obs = await wait_state(stub, jid)
    assert obs.state == job_pb2.JOB_STATE_SUCCEEDED, obs
    entries = await logs(stub, jid)
    by_index = {e.replica_index: e.text for e in entries if e.stream == job_pb2.LOG_STREAM_STDOUT}
    node = slurm_cluster.socket.gethostname().split(".")[0]
    assert by_index == {0: f"rank 0 of 2 {node}", 1: f"rank 1 of 2 {node}"}


async def test_failure_is_failed_with_the_exit_code(stub):
    jid = new_id("fail")
    await launch(stub, jid, single("import sys; sys.exit(3)"))
    obs = await wait_state(stub, jid)
    assert obs.state == job_pb2.JOB_STATE_FAILED
    assert obs.exit_code == 3


async def test_stop_ends_a_running_job_as_stopped(stub):
    jid = new_id("stop")
    await launch(stub, jid, single("import time; print('up', flush=True); time.sleep(300)"))
    await wait_state(stub, jid, [job_pb2.JOB_STATE_RUNNING])
    ref = dpb.JobRef(job_id=jid)
    await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=ref), timeout=30)
    obs = await wait_state(stub, jid)
    assert obs.state == job_pb2.JOB_STATE_STOPPED, obs
    again = await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=ref), timeout=30)
    assert again.observation.state == job_pb2.JOB_STATE_STOPPED  # idempotent


async def test_cleanup_cancels_a_running_job_and_removes_its_files(stub, cluster):
    jid = new_id("cleanup")
    await launch(stub, jid, single("import time; print('up', flush=True); time.sleep(300)"))
    running = await wait_state(stub, jid, [job_pb2.JOB_STATE_RUNNING])
    job_dir = pathlib.Path(render.attempt_dir(cluster.options(), jid, 1)).parent
    assert job_dir.is_dir()  # the login node is this machine
    ref = dpb.JobRef(job_id=jid, backend_job_id=running.backend_job_id)
    await stub.CleanupJob(dpb.CleanupJobRequest(cluster=CLUSTER, job=ref), timeout=60)
    assert not job_dir.exists()
    assert not list(job_dir.parent.glob(f"{jid}.*.batch.*"))
    assert not (await observe(stub, jid)).found  # forgotten
    r = await asyncio.to_thread(subprocess.run, ["squeue", "--noheader", "--jobs", running.backend_job_id,
                                                  "--states", "RUNNING,PENDING"],
                                capture_output=True, text=True, env=cluster.env)
    assert running.backend_job_id not in r.stdout  # cancelled, not left running
    await stub.CleanupJob(dpb.CleanupJobRequest(cluster=CLUSTER, job=ref), timeout=60)  # idempotent


async def test_a_host_key_that_changes_between_connections_is_refused_and_jobs_kept(stub, cluster):
    """sshd comes back with another host key (a man in the middle, to the driver): the reconnect is
    refused (HOST_KEY_MISMATCH, cluster UNREACHABLE), the running job keeps its state, never FAILED;
    with the pinned key back, the driver reconnects and the job is stopped as asked."""
    jid = new_id("mitm")
    await launch(stub, jid, single("import time; print('up', flush=True); time.sleep(300)"))
    await wait_state(stub, jid, [job_pb2.JOB_STATE_RUNNING])
    hk = cluster.path("ssh", "host_ed25519")
    original = {sfx: pathlib.Path(hk + sfx).read_bytes() for sfx in ("", ".pub")}  # noqa: ASYNC240

    def new_host_key() -> None:  # sshd and its connections killed, back with another key
        cluster.stop_sshd()
        for sfx in original:
            os.unlink(hk + sfx)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", hk], check=True)
        cluster.start_sshd()

    try:
        await asyncio.to_thread(new_host_key)
        deadline = time.monotonic() + 60
        while True:
            info = (await stub.GetClusterInfo(dpb.GetClusterInfoRequest(cluster=CLUSTER), timeout=30)).info
            if info.state == cluster_pb2.CLUSTER_STATE_UNREACHABLE and "HOST_KEY_MISMATCH" in info.message:
                break
            assert time.monotonic() < deadline, info
            await asyncio.sleep(0.5)
        obs = await observe(stub, jid)
        assert obs.state == job_pb2.JOB_STATE_RUNNING, obs  # last known state, never FAILED
    finally:
        await asyncio.to_thread(cluster.stop_sshd)
        for sfx, data in original.items():
            pathlib.Path(hk + sfx).write_bytes(data)  # noqa: ASYNC240
        await asyncio.to_thread(cluster.start_sshd)
    deadline = time.monotonic() + 60
    while (await stub.GetClusterInfo(dpb.GetClusterInfoRequest(cluster=CLUSTER), timeout=30)).info.state != \
            cluster_pb2.CLUSTER_STATE_READY:
        assert time.monotonic() < deadline, "never READY again with the pinned key back"
        await asyncio.sleep(0.5)
    await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=jid)), timeout=30)
    assert (await wait_state(stub, jid)).state == job_pb2.JOB_STATE_STOPPED


async def test_unknown_partition_is_refused_at_submit(stub):
    spec = single("print(1)")
    spec.queue = "no-such-partition"
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await launch(stub, new_id("nopart"), spec)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(e.value).reason == "SBATCH_REJECTED"


async def test_a_host_key_that_is_not_the_pinned_one_is_refused(stub, cluster):
    other = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.ConfigureCluster(configure_request(cluster, "clusters/slurm-mitm", [other]), timeout=30)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(e.value).reason == "HOST_KEY_MISMATCH"
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.ConfigureCluster(configure_request(cluster, "clusters/slurm-tofu", []), timeout=30)
    assert error_info(e.value).reason == "HOST_KEY_MISMATCH"


async def test_master_worker_succeeds_with_rank_zero_on_the_master(stub):
    jid = new_id("mw")
    code = "import os; print(os.environ['DLSCHED_ROLE'], os.environ['RANK'], os.environ['MASTER_ADDR'])"
    spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_MASTER_WORKER, replica_groups=[
        job_pb2.ReplicaGroup(role=r, replicas=1, command=[PY, "-u", "-c", code]) for r in ("worker", "master")])
    await launch(stub, jid, spec)
    obs = await wait_state(stub, jid)
    assert obs.state == job_pb2.JOB_STATE_SUCCEEDED, obs
    node = slurm_cluster.socket.gethostname().split(".")[0]
    out = {(e.role, e.text) for e in await logs(stub, jid) if e.stream == job_pb2.LOG_STREAM_STDOUT}
    assert out == {("master", f"master 0 {node}"), ("worker", f"worker 1 {node}")}


async def test_ps_worker_runs_every_task_in_one_multi_prog_step(stub, cluster):
    """PS-Worker: the tasks share one `srun --multi-prog` step (squeue lists one step, named
    dlsched-tasks, while they run), each with its own TF_CONFIG and log files; usage covers every
    task; the job succeeds when the worker does and the parameter server is stopped."""
    jid = new_id("ps")
    worker = ("import json, os, time; t = json.loads(os.environ['TF_CONFIG']); print(t['task'], len(t['cluster']['ps']), "
              "os.environ['DLSCHED_ROLE'], flush=True); end = time.time() + 4\nwhile time.time() < end: pass")
    spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_PS_WORKER, replica_groups=[
        job_pb2.ReplicaGroup(role="ps", replicas=1, command=[PY, "-u", "-c", "print('ps up'); import time; time.sleep(301)"]),
        job_pb2.ReplicaGroup(role="worker", replicas=1, command=[PY, "-u", "-c", worker])])
    resp = await launch(stub, jid, spec)
    await wait_state(stub, jid, [job_pb2.JOB_STATE_RUNNING])
    req = dpb.MeasureJobUsageRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=jid))
    deadline = time.monotonic() + 30
    while True:
        steps = (await asyncio.to_thread(cluster.run, "squeue", "--noheader", "--steps",
                                         f"--jobs={resp.backend_job_id}", "-o", "%i|%j")).stdout.split()
        usage = {(u.role, u.replica_index): u for u in (await stub.MeasureJobUsage(req, timeout=30)).usage.replicas}
        if steps and all(u.running and u.cpu_seconds > 0 for u in usage.values()):
            break
        assert time.monotonic() < deadline, (steps, usage)
        await asyncio.sleep(0.5)
    assert [s.split("|")[1] for s in steps if not s.split("|")[0].endswith((".batch", ".extern"))] == ["dlsched-tasks"]
    assert set(usage) == {("ps", 0), ("worker", 0)}
    obs = await wait_state(stub, jid)
    assert obs.state == job_pb2.JOB_STATE_SUCCEEDED, obs
    assert [e.text for e in await logs(stub, jid, role="worker")] == ["{'index': 0, 'type': 'worker'} 1 worker"]
    assert [e.text for e in await logs(stub, jid, role="ps")] == ["ps up"]
    # The parameter server never exits by itself: it was stopped once the worker succeeded.
    deadline = time.monotonic() + 15
    while (left := await asyncio.to_thread(subprocess.run, ["pgrep", "-f", r"time\.sleep\(301\)"],
                                           capture_output=True, text=True)).returncode == 0:
        assert time.monotonic() < deadline, left.stdout
        await asyncio.sleep(0.3)


async def test_hostile_env_arrives_byte_for_byte_and_runs_nothing(stub, cluster):
    jid = new_id("hostile")
    canary = os.path.join(cluster.home, "CANARY")
    env = {"H1": f"$(touch {canary})", "H2": f"`touch {canary}`", "H3": f"a\n#SBATCH --wrap=touch {canary}\n",
           "H4": "'; touch CANARY; '", "H5": "ünï ✓ \t\r"}
    code = "import json, os; print(json.dumps({k: os.environ[k] for k in sorted(os.environ) if k[:1] == 'H' and k[1:].isdigit()}))"
    spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[
        job_pb2.ReplicaGroup(role="main", replicas=1, command=[PY, "-u", "-c", code], env=env)])
    await launch(stub, jid, spec)
    obs = await wait_state(stub, jid)
    assert obs.state == job_pb2.JOB_STATE_SUCCEEDED, obs
    lines = [e.text for e in await logs(stub, jid) if e.stream == job_pb2.LOG_STREAM_STDOUT]
    assert json.loads(lines[0]) == env
    assert not await asyncio.to_thread(os.path.exists, canary)


async def test_tail_lines_gives_the_last_lines_of_a_finished_job(stub):
    jid = new_id("taillines")
    # ~1.6 MiB of stdout: more than one read of the log file, so the tail has to come from its end
    code = "import sys\nfor i in range(20000):\n    print(f'line {i:05d} ' + 'x' * 70)\nprint('last', file=sys.stderr)"
    await launch(stub, jid, single(code))
    assert (await wait_state(stub, jid)).state == job_pb2.JOB_STATE_SUCCEEDED
    got = await logs(stub, jid, tail_lines=3)
    out = [e.text[:10] for e in got if e.stream == job_pb2.LOG_STREAM_STDOUT]
    assert out == ["line 19997", "line 19998", "line 19999"]
    assert [e.text for e in got if e.stream == job_pb2.LOG_STREAM_STDERR] == ["last"]
    assert len(await logs(stub, jid, tail_lines=3, streams=[job_pb2.LOG_STREAM_STDOUT])) == 3


async def test_logs_stream_while_the_job_runs(stub):
    jid = new_id("follow")
    code = "import time\nfor i in range(4):\n    print('tick', i, flush=True)\n    time.sleep(0.7)"
    await launch(stub, jid, single(code))
    got: list[str] = []
    seen_running = False
    req = dpb.TailJobLogsRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=jid), follow=True)
    async for resp in stub.TailJobLogs(req, timeout=60):
        got.extend(e.text for e in resp.entries)
        if got and not seen_running:
            seen_running = (await observe(stub, jid)).state == job_pb2.JOB_STATE_RUNNING
    assert got == [f"tick {i}" for i in range(4)]
    assert seen_running  # the first lines came while it still ran
    assert (await observe(stub, jid)).state == job_pb2.JOB_STATE_SUCCEEDED


async def test_sbatch_that_submits_then_fails_yields_one_job(stub, cluster, tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "sbatch").write_text("#!/bin/bash\n/usr/bin/sbatch \"$@\" >/dev/null\n"
                                   "echo 'sbatch: error: Batch job submission failed: Socket timed out' >&2\n"
                                   "exit 1\n")
    (bindir / "sbatch").chmod(0o755)
    req = configure_request(cluster, "clusters/slurm-flaky")
    req.options["PATH"] = f"{bindir}:/usr/bin:/bin"
    await stub.ConfigureCluster(req, timeout=30)
    jid = new_id("flaky")
    resp = await stub.LaunchJob(dpb.LaunchJobRequest(cluster="clusters/slurm-flaky", job_id=jid,
                                                     spec=single("print(1)"), attempt=1), timeout=60)
    assert resp.backend_job_id.isdigit()
    out = cluster.run("squeue", "--noheader", "--states=all", f"--name=dlsched-{jid}", "-o", "%i").stdout
    assert out.split() == [resp.backend_job_id]
    await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster="clusters/slurm-flaky"), timeout=30)


async def test_more_cpus_than_any_node_has_stays_pending_with_slurms_reason(stub):
    jid = new_id("toobig")
    spec = single("print(1)")
    spec.replica_groups[0].resources.cpu = 64
    await launch(stub, jid, spec)
    deadline = time.monotonic() + 30
    while (obs := await observe(stub, jid)).reason in ("Submitted", "Pending"):
        assert time.monotonic() < deadline, obs
        await asyncio.sleep(0.2)
    assert obs.state == job_pb2.JOB_STATE_QUEUED
    assert obs.reason == "PartitionConfig"  # never silent: Slurm's own "why pending"
    await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=jid)), timeout=30)
    assert (await wait_state(stub, jid)).state == job_pb2.JOB_STATE_STOPPED


async def test_many_concurrent_commands_stay_below_the_session_limit(stub):
    jid = new_id("fanout")
    await launch(stub, jid, single("print('x')"))
    await wait_state(stub, jid)
    results = await asyncio.gather(*[logs(stub, jid) for _ in range(24)])  # sshd allows 10 sessions
    assert all([e.text for e in r] == ["x"] for r in results)


def test_a_channel_closed_without_an_exit_status_is_a_transport_failure_not_an_exit_code():
    """A command whose channel closed with no exit status and no signal (seen under CI load as
    'squeue failed: ' with an empty message) raises, so callers treat it as the transport
    failure it is (a look-up retries, a submit looks the job up) rather than as squeue's answer."""
    from drivers.slurm.ssh import BackendUnavailable, _completed

    def done(status: int | None, signal: tuple | None = None) -> asyncssh.SSHCompletedProcess:
        return asyncssh.SSHCompletedProcess(env=None, command="squeue", subsystem=None, exit_status=status,
                                            exit_signal=signal, returncode=status, stdout=b"o", stderr=b"")

    with pytest.raises(BackendUnavailable, match="exit status"):
        _completed(done(None))
    assert _completed(done(3)).exit_status == 3
    assert _completed(done(None, ("KILL", False, "", ""))).exit_status == 137
    assert _completed(done(0)).stdout == b"o"


async def test_ssh_outage_keeps_the_last_state_and_reconnects(stub, cluster):
    jid = new_id("sshdown")
    await launch(stub, jid, single("import time; time.sleep(4)"))
    await wait_state(stub, jid, [job_pb2.JOB_STATE_RUNNING])
    await asyncio.to_thread(cluster.stop_sshd)
    try:
        deadline = time.monotonic() + 30
        while True:
            obs = await observe(stub, jid)
            assert obs.state == job_pb2.JOB_STATE_RUNNING, obs
            if obs.reason == "BackendStale":
                break
            assert time.monotonic() < deadline, obs
            await asyncio.sleep(0.3)
        info = (await stub.GetClusterInfo(dpb.GetClusterInfoRequest(cluster=CLUSTER), timeout=30)).info
        assert info.state == cluster_pb2.CLUSTER_STATE_UNREACHABLE
    finally:
        await asyncio.to_thread(cluster.start_sshd)
    obs = await wait_state(stub, jid, within=60)  # reconnected (with backoff) and caught up
    assert obs.state == job_pb2.JOB_STATE_SUCCEEDED, obs
    info = (await stub.GetClusterInfo(dpb.GetClusterInfoRequest(cluster=CLUSTER), timeout=30)).info
    assert info.state == cluster_pb2.CLUSTER_STATE_READY


async def test_follow_keeps_odd_bytes_and_an_unterminated_last_line(stub):
    jid = new_id("bytes")
    code = ("import sys, time\nsys.stdout.buffer.write(b'a\\xff\\n'); sys.stdout.flush(); time.sleep(1)\n"
            "sys.stdout.write('end'); sys.stdout.flush(); time.sleep(1)")
    await launch(stub, jid, single(code))
    lines = [e.text for e in await logs(stub, jid, follow=True) if e.stream == job_pb2.LOG_STREAM_STDOUT]
    assert lines == ["a\ufffd", "end"]


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun (bash scripts/install-system-deps.sh)")
async def test_mpi_runs_mpirun_inside_the_allocation(stub):
    jid = new_id("mpi")
    code = "import os; print('rank', os.environ['OMPI_COMM_WORLD_RANK'], 'of', os.environ['OMPI_COMM_WORLD_SIZE'])"
    root_ok = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_MPI, replica_groups=[
        job_pb2.ReplicaGroup(role="launcher", replicas=1, command=[PY, "-u", "-c", code], env=root_ok),
        job_pb2.ReplicaGroup(role="worker", replicas=1, processes_per_replica=2, command=["unused"])])
    await launch(stub, jid, spec)
    obs = await wait_state(stub, jid)
    assert obs.state == job_pb2.JOB_STATE_SUCCEEDED, obs
    lines = sorted(e.text for e in await logs(stub, jid) if e.stream == job_pb2.LOG_STREAM_STDOUT)
    assert lines == ["rank 0 of 2", "rank 1 of 2"]


async def test_usage_of_a_running_job_is_plausible_and_kept_after_it_ends(stub):
    jid = new_id("usage")
    code = "import time\nx = bytearray(64 << 20)\nt = time.time()\nwhile time.time() - t < 5: pass"
    await launch(stub, jid, single(code))
    await wait_state(stub, jid, [job_pb2.JOB_STATE_RUNNING])
    req = dpb.MeasureJobUsageRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=jid))
    deadline = time.monotonic() + 20
    while True:
        u = (await stub.MeasureJobUsage(req, timeout=30)).usage.replicas[0]
        if u.running and u.cpu_seconds >= 1 and u.peak_memory_bytes >= 64 << 20:
            break
        assert time.monotonic() < deadline, u
        await asyncio.sleep(0.5)
    assert (u.role, u.replica_index) == ("main", 0)
    assert u.cpu_seconds < 30 and u.peak_memory_bytes < 1 << 30
    await wait_state(stub, jid)
    after = (await stub.MeasureJobUsage(req, timeout=30)).usage.replicas[0]
    assert not after.running and after.cpu_seconds >= u.cpu_seconds


async def test_controller_outage_keeps_the_last_state_and_recovers(stub, cluster):
    jid = new_id("outage")
    await launch(stub, jid, single("import time; time.sleep(6)"))
    await wait_state(stub, jid, [job_pb2.JOB_STATE_RUNNING])
    await asyncio.to_thread(cluster.stop_slurmctld)
    try:
        deadline = time.monotonic() + 40
        while True:
            obs = await observe(stub, jid)
            assert obs.state == job_pb2.JOB_STATE_RUNNING, obs  # never FAILED on an outage
            if obs.reason == "BackendStale":
                break
            assert time.monotonic() < deadline, obs
            await asyncio.sleep(0.3)
    finally:
        await asyncio.to_thread(cluster.start_slurmctld)
    obs = await wait_state(stub, jid, within=90)
    assert obs.state == job_pb2.JOB_STATE_SUCCEEDED, obs


async def test_one_squeue_per_round_for_many_jobs_however_many_launches_and_stops(stub, cluster, tmp_path):
    """Against the real Slurm: squeue/scontrol wrappers on the remote PATH log every call.
    A burst of launches and stops (each wakes the poller) adds no round; each round is one
    squeue for every tracked job; once a round has listed the user's jobs, a launch is one
    sbatch with no look-up."""
    interval = max(0.3, MIN_INTERVAL)  # the driver fixture asks for 0.3; the floor wins
    calls = str(tmp_path / "calls.log")
    req = configure_request(cluster, "clusters/slurm-count")
    req.options["PATH"] = slurm_cluster.command_log_path(str(tmp_path / "bin"), calls)
    await stub.ConfigureCluster(req, timeout=30)

    async def launch_pending(jid: str) -> None:
        spec = single("print(1)")
        spec.replica_groups[0].resources.cpu = 64  # never starts: stays tracked, PENDING
        await stub.LaunchJob(dpb.LaunchJobRequest(cluster="clusters/slurm-count", job_id=jid, spec=spec,
                                                  attempt=1), timeout=60)

    async def observed(ids: list[str]) -> list[dpb.JobObservation]:
        resp = await stub.BatchGetJobObservations(dpb.BatchGetJobObservationsRequest(
            cluster="clusters/slurm-count", jobs=[dpb.JobRef(job_id=j) for j in ids]), timeout=30)
        return list(resp.observations)

    ids = [new_id("many") for _ in range(40)]
    try:
        await asyncio.gather(*(launch_pending(j) for j in ids[:30]))
        deadline = time.monotonic() + 30
        while any(o.reason != "PartitionConfig" for o in await observed(ids[:30])):  # rounds cover all
            assert time.monotonic() < deadline, await observed(ids[:30])
            await asyncio.sleep(0.3)
        settled = time.time()
        await asyncio.gather(*(launch_pending(j) for j in ids[30:]))  # after a round: no look-ups
        await asyncio.gather(*(stub.TerminateJob(dpb.TerminateJobRequest(
            cluster="clusters/slurm-count", job=dpb.JobRef(job_id=j)), timeout=30) for j in ids[:10]))
        await asyncio.sleep(3 * interval)
        log = slurm_cluster.read_command_log(calls)
        rounds = [t for t, name, args in log if name == "squeue" and "--name" not in args]
        gaps = [b - a for a, b in zip(rounds, rounds[1:], strict=False)]
        # Rounds start `interval` apart in the driver (test_slurm_poller.py pins that exactly);
        # as the login node sees them a start can lag (a free channel, a loaded host), so count
        # the rounds in every window, with room for a lag of 2.5 intervals. A round per wake
        # would put dozens in a few seconds.
        assert len(rounds) >= 3
        for i, j in itertools.combinations(range(len(rounds)), 2):
            assert j - i <= (rounds[j] - rounds[i]) / interval + 2.5, gaps
        for a, b in zip(rounds, rounds[1:] + [float("inf")], strict=False):
            follow_ups = [t for t, name, args in log if name == "scontrol" and "show job" in args and a < t < b]
            assert len(follow_ups) <= 1
        assert not [args for t, name, args in log if "--name" in args and t > settled]
        assert len(await observed(ids)) == 40
    finally:
        await asyncio.gather(*(stub.TerminateJob(dpb.TerminateJobRequest(
            cluster="clusters/slurm-count", job=dpb.JobRef(job_id=j)), timeout=30) for j in ids),
            return_exceptions=True)
        await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster="clusters/slurm-count"), timeout=30)


async def test_a_new_driver_process_adopts_earlier_jobs_and_never_submits_them_again(stub, cluster):
    """A restarted driver knows nothing: a relaunch before its first poll round is looked up, an
    observation naming a Slurm job adopts it from the next round, and a relaunch after a round
    is answered from that round's listing. Each dlsched attempt stays one Slurm job."""
    before_round, observed_only, after_round = (new_id("adopt") for _ in range(3))
    first = {j: (await launch(stub, j, single("import time; time.sleep(2)"))).backend_job_id
             for j in (before_round, observed_only, after_round)}
    other = ServiceProcess("drivers.slurm", ["--poll-interval", "0.3"], name="slurm-driver-2").start()
    try:
        async with security.channel(other.address) as ch:
            fresh = driver_service_pb2_grpc.DriverServiceStub(ch)
            await fresh.ConfigureCluster(configure_request(cluster), timeout=30)
            again = await launch(fresh, before_round, single("import time; time.sleep(2)"))
            assert again.backend_job_id == first[before_round]
            ref = dpb.JobRef(job_id=observed_only, backend_job_id=first[observed_only])
            obs = (await fresh.BatchGetJobObservations(dpb.BatchGetJobObservationsRequest(
                cluster=CLUSTER, jobs=[ref]), timeout=30)).observations[0]
            assert obs.found and obs.backend_job_id == first[observed_only] and obs.attempt == 1
            again = await launch(fresh, after_round, single("import time; time.sleep(2)"))
            assert again.backend_job_id == first[after_round]
            assert (await wait_state(fresh, observed_only)).state == job_pb2.JOB_STATE_SUCCEEDED
    finally:
        other.stop()
    for jid, backend in first.items():
        out = cluster.run("squeue", "--noheader", "--states=all", f"--name=dlsched-{jid}", "-o", "%i").stdout
        assert out.split() == [backend]


def scrape(svc: ServiceProcess) -> dict[str, float]:
    return backend_calls(svc, "slurm")


async def test_metrics_count_every_remote_command_and_poll_round(cluster, tmp_path):
    """A driver of its own (no other cluster polls): /metrics counts exactly the squeue,
    scontrol and sbatch calls the login node's logging wrappers saw, one poll-duration
    sample per squeue round, and log reads as ``tail``."""
    calls = str(tmp_path / "calls.log")
    svc = ServiceProcess("drivers.slurm", ["--poll-interval", "0.3", "--metrics-listen", "127.0.0.1:0"],
                         name="slurm-driver-metrics").start()
    try:
        async with security.channel(svc.address) as ch:
            s = driver_service_pb2_grpc.DriverServiceStub(ch)
            req = configure_request(cluster)
            req.options["PATH"] = slurm_cluster.command_log_path(
                str(tmp_path / "bin"), calls, ("squeue", "scontrol", "sbatch", "scancel"))
            await s.ConfigureCluster(req, timeout=30)
            ids = [new_id("metrics") for _ in range(2)]
            for jid in ids:
                await launch(s, jid, single("print('m')"))
            for jid in ids:
                assert (await wait_state(s, jid)).state == job_pb2.JOB_STATE_SUCCEEDED
            assert [e.text for e in await logs(s, ids[0])] == ["m"]
            await s.RemoveCluster(dpb.RemoveClusterRequest(cluster=CLUSTER), timeout=30)
            got = scrape(svc)
    finally:
        svc.stop()
    # The job scripts' own `scontrol show hostnames` (inside the allocation) is not the driver's;
    # GetClusterInfo's one-off `scontrol show config` rides in the `show nodes` command.
    log = [e for e in slurm_cluster.read_command_log(calls) if "hostnames" not in e[2] and e[2] != "show config"]
    for name in ("squeue", "scontrol", "sbatch"):
        seen = sum(1 for _, n, _ in log if n == name)
        counted = got.get(f"{name}/ok", 0) + got.get(f"{name}/error", 0)
        assert counted == seen, (name, got, log)
    assert got.get("sbatch/ok") == 2
    rounds = sum(1 for _, n, args in log if n == "squeue" and "--name" not in args)
    assert rounds >= 1 and got.get("poll_rounds") == rounds, (got, log)
    assert got.get("tail/ok", 0) >= 1
    assert not any(k.startswith("other/") for k in got), got


def sbatch_processes() -> list[int]:
    """Pids of ``sbatch --parsable`` processes on this host (the login node here)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"sbatch") and b"--parsable" in argv:
            out.append(int(pid))
    return out


async def test_a_launch_hands_its_script_to_an_sbatch_started_before_it(stub, cluster, tmp_path):
    """The warm submitter: the sbatch that takes a launch's script was exec'd before the launch,
    the next one waits (never more than one idle per cluster), concurrent launches still make
    one Slurm job each, and RemoveCluster ends the idle one without a job."""
    calls = str(tmp_path / "calls.log")
    req = configure_request(cluster, "clusters/slurm-warm")
    req.options["PATH"] = slurm_cluster.command_log_path(str(tmp_path / "bin"), calls, ("sbatch",))
    before = set(sbatch_processes())
    await stub.ConfigureCluster(req, timeout=30)

    def sbatch_starts() -> list[float]:
        return [t for t, name, _ in slurm_cluster.read_command_log(calls) if name == "sbatch"]

    async def launch_on(jid: str) -> str:
        return (await stub.LaunchJob(dpb.LaunchJobRequest(cluster="clusters/slurm-warm", job_id=jid,
                                                          spec=single("print(1)"), attempt=1),
                                     timeout=60)).backend_job_id

    deadline = time.monotonic() + 10
    while not sbatch_starts():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    t0 = time.time()
    ids = [new_id("warm") for _ in range(4)]
    first = await launch_on(ids[0])
    assert sbatch_starts()[0] < t0  # started ahead, then fed the script
    backends = [first, *await asyncio.gather(*(launch_on(j) for j in ids[1:]))]
    assert len(set(backends)) == 4
    await asyncio.sleep(1)
    idle = [p for p in sbatch_processes() if p not in before]
    assert len(idle) == 1, idle  # the next one waits; only one
    await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster="clusters/slurm-warm"), timeout=30)
    deadline = time.monotonic() + 10
    while [p for p in sbatch_processes() if p not in before]:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    for jid, backend in zip(ids, backends, strict=True):
        out = cluster.run("squeue", "--noheader", "--states=all", f"--name=dlsched-{jid}", "-o", "%i").stdout
        assert out.split() == [backend]
    jobs = cluster.run("squeue", "--noheader", "--states=all", "-o", "%j").stdout.split()
    assert not [j for j in jobs if not j.startswith("dlsched-")]  # the given-up sbatch made none


async def test_a_requeued_job_runs_again_as_the_same_attempt_and_never_fails(stub, cluster):
    jid = new_id("requeue")
    backend = (await launch(stub, jid, single("import time; time.sleep(4); print('done')"))).backend_job_id
    await wait_state(stub, jid, [job_pb2.JOB_STATE_RUNNING])
    cluster.run("scontrol", "requeue", backend)
    seen: list[dpb.JobObservation] = []
    deadline = time.monotonic() + 60
    released = False
    while True:
        obs = await observe(stub, jid)
        seen.append(obs)
        if obs.reason == "BeginTime" and not released:  # Slurm delays a requeued job; skip the wait
            cluster.run("scontrol", "update", f"JobId={backend}", "StartTime=now")
            released = True
        assert obs.state != job_pb2.JOB_STATE_FAILED, obs
        if obs.state in TERMINAL:
            break
        assert time.monotonic() < deadline, obs
        await asyncio.sleep(0.2)
    assert obs.state == job_pb2.JOB_STATE_SUCCEEDED, obs
    assert obs.backend_job_id == backend and obs.attempt == 1  # same Slurm job, same dlsched attempt
    assert obs.backend_restarts == 1  # the requeue shows as a count, not as another attempt
    assert seen[0].backend_restarts == 0
    states = [o.state for o in seen if "Slurm restart 1" in o.message]
    assert job_pb2.JOB_STATE_QUEUED in states and job_pb2.JOB_STATE_RUNNING in states, seen
    assert states.index(job_pb2.JOB_STATE_QUEUED) < states.index(job_pb2.JOB_STATE_RUNNING)


# --------------------------------------------------------------------------- log streams


def log_stream_pids() -> list[int]:
    """One pid per remote log-stream loop of the driver on this host (the login node here).
    sshd starts each channel's command in a session of its own, so a loop is a session: its
    forks (a stat, a subshell, one orphaned as the loop exits) share it and count once."""
    loops: dict[int, int] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().rstrip(b"\0").split(b"\0")
            if argv[-1:] != [b"dlsched-log-stream"]:
                continue
            with open(f"/proc/{pid}/stat") as f:
                sid = int(f.read().rsplit(")", 1)[1].split()[3])
        except (OSError, ValueError, IndexError):
            continue
        loops[sid] = min(int(pid), loops.get(sid, int(pid)))
    return sorted(loops.values())


async def wait_no_log_streams(within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    left = await asyncio.to_thread(log_stream_pids)
    while left and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        left = await asyncio.to_thread(log_stream_pids)
    assert not left, f"remote log-stream loops outlived their followers: {left}"


TICKS = "import time\nfor i in range({n}):\n    print('tick', i, flush=True)\n    time.sleep({gap})"


async def test_a_follower_streams_on_one_channel_with_each_line_dated(cluster, tmp_path):
    """A follow costs one read and one long-lived stream (``tail`` calls in /metrics), not a
    command per poll; each line is dated by the log index when it was written (the ticks
    are 0.8 s apart, so one mtime for all would fail), and the stream ends with the job."""
    svc = ServiceProcess("drivers.slurm", ["--poll-interval", "0.3", "--metrics-listen", "127.0.0.1:0"],
                         name="slurm-driver-streams").start()
    try:
        async with security.channel(svc.address) as ch:
            s = driver_service_pb2_grpc.DriverServiceStub(ch)
            await s.ConfigureCluster(configure_request(cluster), timeout=30)
            jid = new_id("stream")
            await launch(s, jid, single(TICKS.format(n=5, gap=0.8)))
            t0 = time.time()
            got = await logs(s, jid, follow=True)
            took = time.time() - t0
            assert (await observe(s, jid)).state == job_pb2.JOB_STATE_SUCCEEDED
            tails = scrape(svc)
            await s.RemoveCluster(dpb.RemoveClusterRequest(cluster=CLUSTER), timeout=30)
    finally:
        svc.stop()
    assert [e.text for e in got] == [f"tick {i}" for i in range(5)]
    assert took > 3.0  # it followed the job while it ran
    calls = tails.get("tail/ok", 0) + tails.get("tail/error", 0)
    assert 2 <= calls <= 3, tails  # the first read, the stream (and at most one read before it)
    times = [e.time.ToNanoseconds() / 1e9 for e in got]
    assert all(t > 0 for t in times)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # Dated "to about a second": lines that one read finds before the job's log index covers
    # them share their file's mtime, so a gap may be 0; never backwards, and the 3.2 s the
    # ticks span shows.
    assert all(0 <= g < 2.5 for g in gaps), gaps
    assert 2.2 < times[-1] - times[0] < 4.4, times
    assert t0 - 5 < times[0] < times[-1] < time.time() + 1


async def test_since_time_keeps_the_lines_written_after_it(stub):
    jid = new_id("since")
    code = ("import time\nfor i in range(3):\n    print('early', i, flush=True)\ntime.sleep(3)\n"
            "for i in range(3):\n    print('late', i, flush=True)\nprint('late err', flush=True, file=__import__('sys').stderr)")
    await launch(stub, jid, single(code))
    assert (await wait_state(stub, jid)).state == job_pb2.JOB_STATE_SUCCEEDED
    every = await logs(stub, jid)
    early = [e.time.ToNanoseconds() for e in every if e.text.startswith("early")]
    late = [e.time.ToNanoseconds() for e in every if e.text.startswith("late")]
    assert len(early) == 3 and len(late) == 4 and max(early) + 2_000_000_000 < min(late), every
    since = Timestamp()
    since.FromNanoseconds((max(early) + min(late)) // 2)
    got = await logs(stub, jid, since_time=since)
    assert sorted(e.text for e in got) == ["late 0", "late 1", "late 2", "late err"]
    got = await logs(stub, jid, since_time=since, tail_lines=1, streams=[job_pb2.LOG_STREAM_STDOUT])
    assert [e.text for e in got] == ["late 2"]
    after = Timestamp()
    after.FromNanoseconds(max(late) + 5_000_000_000)
    assert await logs(stub, jid, since_time=after) == []
    assert [e.text for e in await logs(stub, jid, since_time=since, follow=True)
            if e.stream == job_pb2.LOG_STREAM_STDOUT] == ["late 0", "late 1", "late 2"]


async def test_more_followers_than_log_streams_each_get_every_line_once(stub):
    """12 followers of one job: 8 stream (the bound; never more remote loops than that), the
    rest read by polls; every follower gets every line exactly once, the job still ends
    (the control connection is never starved), and no remote loop outlives its follower."""
    await wait_no_log_streams()  # earlier tests' loops are gone before this one counts
    jid = new_id("fanout")
    await launch(stub, jid, single(TICKS.format(n=6, gap=0.5)))
    peak = 0

    async def sample() -> None:
        nonlocal peak
        while True:
            peak = max(peak, len(await asyncio.to_thread(log_stream_pids)))
            await asyncio.sleep(0.1)

    sampler = asyncio.create_task(sample())
    followers = [asyncio.create_task(logs(stub, jid, follow=True)) for _ in range(12)]
    try:  # sampled while all follow: as streams end, a poller may take a freed slot before the loop exits
        await asyncio.wait(followers, return_when=asyncio.FIRST_COMPLETED)
    finally:
        sampler.cancel()
    results = await asyncio.gather(*followers)
    for got in results:
        assert [e.text for e in got] == [f"tick {i}" for i in range(6)]
    assert peak == 8, peak  # the bound, used and never passed
    assert (await observe(stub, jid)).state == job_pb2.JOB_STATE_SUCCEEDED
    await wait_no_log_streams()


async def test_a_follower_that_leaves_ends_its_remote_loop(stub):
    jid = new_id("leave")
    await launch(stub, jid, single(TICKS.format(n=40, gap=0.25)))
    req = dpb.TailJobLogsRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=jid), follow=True)
    call = stub.TailJobLogs(req, timeout=60)
    seen = 0
    async for resp in call:
        seen += len(resp.entries)
        if seen >= 3 and await asyncio.to_thread(log_stream_pids):
            break
    call.cancel()
    await wait_no_log_streams()
    await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=jid)), timeout=30)


async def test_a_stream_that_dies_falls_back_without_losing_or_repeating_a_line(stub):
    """The remote loop killed mid-job (as when the log connection drops): the follower goes on
    from the last whole round, by a poll and then a new stream."""
    jid = new_id("streamkill")
    await launch(stub, jid, single(TICKS.format(n=10, gap=0.4)))
    got: list[str] = []
    killed = False
    req = dpb.TailJobLogsRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=jid), follow=True)
    async for resp in stub.TailJobLogs(req, timeout=60):
        got.extend(e.text for e in resp.entries)
        if not killed and len(got) >= 3 and (pids := await asyncio.to_thread(log_stream_pids)):
            for pid in pids:
                os.kill(pid, 9)
            killed = True
    assert killed
    assert got == [f"tick {i}" for i in range(10)]


async def test_without_accounting_storage_sacct_is_never_called(stub, cluster, tmp_path):
    """GetClusterInfo asks once whether the cluster has accounting storage (this one has
    none), so an ended job's usage and the poller's follow-ups never try sacct."""
    calls = str(tmp_path / "calls.log")
    name = "clusters/slurm-noacct"
    req = configure_request(cluster, name)
    req.options["PATH"] = slurm_cluster.command_log_path(str(tmp_path / "bin"), calls, ("scontrol", "sacct"))
    await stub.ConfigureCluster(req, timeout=30)
    try:
        for _ in range(3):
            info = (await stub.GetClusterInfo(dpb.GetClusterInfoRequest(cluster=name), timeout=30)).info
            assert info.state == cluster_pb2.CLUSTER_STATE_READY
        jid = new_id("noacct")
        await stub.LaunchJob(dpb.LaunchJobRequest(cluster=name, job_id=jid, spec=single("print(1)"), attempt=1),
                             timeout=60)
        ref = dpb.JobRef(job_id=jid)
        deadline = time.monotonic() + 60
        while True:
            obs = (await stub.BatchGetJobObservations(dpb.BatchGetJobObservationsRequest(
                cluster=name, jobs=[ref]), timeout=30)).observations[0]
            if obs.state in TERMINAL:
                break
            assert time.monotonic() < deadline, obs
            await asyncio.sleep(0.2)
        assert obs.state == job_pb2.JOB_STATE_SUCCEEDED
        for _ in range(2):
            await stub.MeasureJobUsage(dpb.MeasureJobUsageRequest(cluster=name, job=ref), timeout=30)
    finally:
        await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster=name), timeout=30)
    log = slurm_cluster.read_command_log(calls)
    assert [a for _, n, a in log if n == "scontrol" and "config" in a] == ["show config"]
    assert not [e for e in log if e[1] == "sacct"], log
