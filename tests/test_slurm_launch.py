"""The Slurm driver launching jobs: every run mode on a real Slurm, stop and cleanup, refusals
at submit, the warm sbatch, exactly-once submission (an ambiguous sbatch, a restarted
driver) and Slurm's requeues (``slurm_peer``: the driver as a real process, real sshd)."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import shutil
import signal
import subprocess
import time

import grpc
import pytest
from google.protobuf import duration_pb2

from dlsched.kit.rpc_errors import error_info
from dlsched.v1 import cluster_pb2, driver_service_pb2_grpc, job_pb2
from dlsched.v1 import driver_service_pb2 as dpb
from drivers.slurm import render
from tests import security, slurm_cluster
from tests.harness import ServiceProcess
from tests.slurm_peer import (
    CLUSTER,
    PY,
    TERMINAL,
    configure_request,
    driver_fixtures,
    launch,
    logs,
    new_id,
    observe,
    sbatch_processes,
    single,
    wait_state,
)

cluster, driver, stub = driver_fixtures()


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


#: A program that saves its work on SIGTERM, for longer than the test cluster's KillWait (5 s).
SAVES_ON_TERM = """
import signal, sys, time
def term(*_):
    print('term', flush=True)
    time.sleep(8)
    print('saved', flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
print('up', flush=True)
time.sleep(300)
"""


async def test_a_stop_gives_the_processes_its_grace_after_sigterm(stub):
    """SIGTERM reaches the processes and they get the stop's grace to end (not Slurm's KillWait,
    5 s here): a handler that saves its work for 8 s finishes. The job, ended after the stop
    reached it, is STOPPED although its process exited 0."""
    jid = new_id("grace")
    await launch(stub, jid, single(SAVES_ON_TERM))
    await wait_state(stub, jid, [job_pb2.JOB_STATE_RUNNING])
    deadline = time.monotonic() + 60  # Slurm says RUNNING once the script starts; the handler is set after
    while "up" not in [e.text for e in await logs(stub, jid)]:
        assert time.monotonic() < deadline, "the program never started"
        await asyncio.sleep(0.5)
    grace = duration_pb2.Duration(seconds=120)
    resp = await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=jid),
                                                           grace_period=grace), timeout=30)
    assert resp.observation.state == job_pb2.JOB_STATE_STOPPING
    obs = await wait_state(stub, jid, within=120)
    assert obs.state == job_pb2.JOB_STATE_STOPPED, obs
    assert [e.text for e in await logs(stub, jid) if e.stream == job_pb2.LOG_STREAM_STDOUT] == ["up", "term", "saved"]
    # its exit 0 came after the stop: STOPPED, as on every backend (docs/ENVIRONMENT.md)
    assert [(r.state, r.exit_code) for r in obs.replicas] == [(job_pb2.REPLICA_STATE_STOPPED, 0)], obs.replicas


async def test_a_process_that_ignores_sigterm_is_killed_after_the_grace(stub):
    """... and by SIGKILL: no second SIGTERM (a plain scancel's) and Slurm's KillWait after it."""
    jid = new_id("ignores")
    await launch(stub, jid, single("import signal, time\n"
                                   "n = 0\n"
                                   "def h(*_):\n"
                                   "    global n\n"
                                   "    n += 1\n"
                                   "    print(f'term {n}', flush=True)\n"
                                   "signal.signal(signal.SIGTERM, h)\n"
                                   "print('up', flush=True)\n"
                                   "time.sleep(300)\n"))
    await wait_state(stub, jid, [job_pb2.JOB_STATE_RUNNING])
    deadline = time.monotonic() + 60
    while "up" not in [e.text for e in await logs(stub, jid)]:
        assert time.monotonic() < deadline, "the program never started"
        await asyncio.sleep(0.5)
    ref = dpb.JobRef(job_id=jid)
    grace = duration_pb2.Duration(seconds=1)
    await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=ref, grace_period=grace), timeout=30)
    obs = await wait_state(stub, jid, within=120)  # the grace, then SIGKILL
    assert (obs.state, obs.reason) == (job_pb2.JOB_STATE_STOPPED, "Stopped"), obs  # as on every backend
    assert [e.text for e in await logs(stub, jid) if e.text.startswith("term")] == ["term 1"]
    again = await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=ref), timeout=30)
    assert again.observation.state == job_pb2.JOB_STATE_STOPPED


async def test_a_stop_of_processes_that_end_apart_gives_each_one_sigterm(stub):
    """A stop's SIGTERM ends one rank at once (143); the script's success rule, hearing a
    failure, stopped the rest itself: a second SIGTERM to the other, and its SIGKILL after the
    driver's default grace, not the stop's. Now the stop is the driver's alone."""
    jid = new_id("apart")
    code = ("import os, signal, time\n"
            "rank = os.environ['RANK']\n"
            "n = 0\n"
            "def h(*_):\n"
            "    global n\n"
            "    n += 1\n"
            "    print(f'term {rank} {n}', flush=True)\n"
            "    if rank == '0':\n"
            "        os._exit(143)\n"
            "signal.signal(signal.SIGTERM, h)\n"
            "print('up', flush=True)\n"
            "time.sleep(300)\n")
    spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_MULTI_PROCESS, replica_groups=[job_pb2.ReplicaGroup(
        role="worker", replicas=1, processes_per_replica=2, command=[PY, "-u", "-c"], args=[code])])
    await launch(stub, jid, spec)
    deadline = time.monotonic() + 60
    while [e.text for e in await logs(stub, jid)].count("up") < 2:
        assert time.monotonic() < deadline, "the processes never started"
        await asyncio.sleep(0.5)
    await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=jid),
                                                    grace_period=duration_pb2.Duration(seconds=3)), timeout=30)
    assert (await wait_state(stub, jid, within=120)).state == job_pb2.JOB_STATE_STOPPED
    assert sorted(e.text for e in await logs(stub, jid) if e.text.startswith("term")) == ["term 0 1", "term 1 1"]


async def test_cleanup_cancels_a_running_job_and_removes_its_files(stub, cluster):
    jid = new_id("cleanup")
    await launch(stub, jid, single("import time; print('up', flush=True); time.sleep(300)"))
    running = await wait_state(stub, jid, [job_pb2.JOB_STATE_RUNNING])
    job_dir = pathlib.Path(render.attempt_dir(cluster.options(), jid, 1)).parent
    deadline = time.monotonic() + 60  # RUNNING comes from Slurm; the script makes its directory soon after
    while not job_dir.is_dir():  # the login node is this machine
        assert time.monotonic() < deadline, job_dir
        await asyncio.sleep(0.2)
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


async def test_unknown_partition_is_refused_at_submit(stub):
    spec = single("print(1)")
    spec.queue = "no-such-partition"
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await launch(stub, new_id("nopart"), spec)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(e.value).reason == "SBATCH_REJECTED"


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
    release = os.path.join(cluster.home, f"{jid}.release")
    # The worker burns CPU until the test has seen both tasks run (an event, not a wall-clock
    # span: under load a 12 s worker could end before usage was sampled).
    worker = ("import json, os, time; t = json.loads(os.environ['TF_CONFIG']); print(t['task'], len(t['cluster']['ps']), "
              "os.environ['DLSCHED_ROLE'], flush=True)\n"
              f"end = time.time() + 300\nwhile not os.path.exists({release!r}) and time.time() < end:\n"
              "    t = time.process_time() + 0.05\n    while time.process_time() < t: pass")
    spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_PS_WORKER, replica_groups=[
        job_pb2.ReplicaGroup(role="ps", replicas=1, command=[PY, "-u", "-c", "print('ps up'); import time; time.sleep(301)"]),
        job_pb2.ReplicaGroup(role="worker", replicas=1, command=[PY, "-u", "-c", worker])])
    resp = await launch(stub, jid, spec)
    await wait_state(stub, jid, [job_pb2.JOB_STATE_RUNNING])
    req = dpb.MeasureJobUsageRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=jid))
    deadline = time.monotonic() + 120
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
    await asyncio.to_thread(pathlib.Path(release).touch)
    obs = await wait_state(stub, jid, within=120)
    assert obs.state == job_pb2.JOB_STATE_SUCCEEDED, obs
    assert [e.text for e in await logs(stub, jid, role="worker")] == ["{'index': 0, 'type': 'worker'} 1 worker"]
    assert [e.text for e in await logs(stub, jid, role="ps")] == ["ps up"]
    # The parameter server never exits by itself: it was stopped once the worker succeeded.
    deadline = time.monotonic() + 60
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


def mpi_spec(code: str) -> job_pb2.JobSpec:
    """An MPI job: a launcher running ``code`` on two ranks (one worker of two slots), as root."""
    root_ok = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_MPI, replica_groups=[
        job_pb2.ReplicaGroup(role="launcher", replicas=1, command=[PY, "-u", "-c", code], env=root_ok),
        job_pb2.ReplicaGroup(role="worker", replicas=1, processes_per_replica=2, command=["unused"])])


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun (bash scripts/install-system-deps.sh)")
async def test_mpi_runs_mpirun_inside_the_allocation(stub):
    jid = new_id("mpi")
    code = "import os; print('rank', os.environ['OMPI_COMM_WORLD_RANK'], 'of', os.environ['OMPI_COMM_WORLD_SIZE'])"
    await launch(stub, jid, mpi_spec(code))
    obs = await wait_state(stub, jid)
    assert obs.state == job_pb2.JOB_STATE_SUCCEEDED, obs
    lines = sorted(e.text for e in await logs(stub, jid) if e.stream == job_pb2.LOG_STREAM_STDOUT)
    assert lines == ["rank 0 of 2", "rank 1 of 2"]
    # every replica is reported, the worker (a host of the ranks, no process of its own) with the job's end
    assert [(r.role, r.index, r.state) for r in obs.replicas] == [
        ("launcher", 0, job_pb2.REPLICA_STATE_SUCCEEDED), ("worker", 0, job_pb2.REPLICA_STATE_SUCCEEDED)], obs


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun (bash scripts/install-system-deps.sh)")
async def test_an_mpi_job_is_cancelled_at_once_whatever_the_grace(stub):
    """MPI's ranks are mpirun's children in the batch step, which a signal to the steps misses:
    the stop is Slurm's own cancel (SIGTERM to every process, SIGKILL after KillWait), not a
    SIGTERM that reaches nothing and a wait of the whole grace before it."""
    jid = new_id("mpistop")
    code = "import os, time; print('up', os.environ['OMPI_COMM_WORLD_RANK'], flush=True); time.sleep(600)"
    await launch(stub, jid, mpi_spec(code))
    deadline = time.monotonic() + 90
    while len([e for e in await logs(stub, jid) if e.text.startswith("up ")]) < 2:
        assert time.monotonic() < deadline, "the ranks never started"
        await asyncio.sleep(0.5)
    await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=jid),
                                                    grace_period=duration_pb2.Duration(seconds=600)), timeout=30)
    obs = await wait_state(stub, jid, within=120)  # KillWait is 5 s here; the grace, 600
    assert obs.state == job_pb2.JOB_STATE_STOPPED, obs


async def test_more_cpus_than_any_node_has_fails_unschedulable_and_leaves_the_queue(stub, cluster):
    """Slurm queues it with reason PartitionConfig, which no wait resolves: the job is FAILED
    Unschedulable, naming Slurm's reason, and cancelled (not QUEUED forever)."""
    jid = new_id("toobig")
    spec = single("print(1)")
    spec.replica_groups[0].resources.cpu = 64
    backend_id = (await launch(stub, jid, spec)).backend_job_id
    obs = await wait_state(stub, jid)
    assert (obs.state, obs.reason) == (job_pb2.JOB_STATE_FAILED, "Unschedulable"), obs
    assert "PartitionConfig" in obs.message  # never silent: Slurm's own "why"
    # Its retry at once (JobManager's max_retries), while Slurm still lists it pending: the driver
    # ended it, so the next attempt launches (it was PREVIOUS_ATTEMPT_ACTIVE, a permanent refusal).
    retry = await launch(stub, jid, spec, attempt=2)
    assert retry.backend_job_id != backend_id
    assert (await wait_state(stub, jid)).reason == "Unschedulable"
    deadline = time.monotonic() + 30
    while cluster.run("squeue", "--noheader", "--jobs", backend_id, "-o", "%i").stdout.strip():
        assert time.monotonic() < deadline, "the unschedulable job is still in Slurm's queue"
        await asyncio.sleep(0.3)


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


async def test_a_submit_limit_is_retried_as_a_quota_not_a_failure(stub, cluster, tmp_path):
    """sbatch refusing the job for the user's submitted-job limit (accounting's words, as Slurm
    prints them; this cluster runs no slurmdbd to enforce one) is RESOURCE_EXHAUSTED
    BACKEND_QUOTA_EXCEEDED, retried by JobManager: it was SBATCH_REJECTED, the job FAILED."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "sbatch").write_text(
        "#!/bin/bash\ncat >/dev/null\n"
        "echo 'sbatch: error: QOSMaxSubmitJobPerUserLimit' >&2\n"
        "echo 'sbatch: error: Batch job submission failed: Job violates accounting/QOS policy "
        "(job submit limit, user size and/or time limits)' >&2\nexit 1\n")
    (bindir / "sbatch").chmod(0o755)
    req = configure_request(cluster, "clusters/slurm-full")
    req.options["PATH"] = f"{bindir}:/usr/bin:/bin"
    await stub.ConfigureCluster(req, timeout=30)
    jid = new_id("full")
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await stub.LaunchJob(dpb.LaunchJobRequest(cluster="clusters/slurm-full", job_id=jid,
                                                  spec=single("print(1)"), attempt=1), timeout=60)
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, ei.value
    assert error_info(ei.value).reason == "BACKEND_QUOTA_EXCEEDED"  # type: ignore[union-attr]
    assert "QOSMaxSubmitJobPerUserLimit" in (ei.value.details() or "")
    out = cluster.run("squeue", "--noheader", "--states=all", f"--name=dlsched-{jid}", "-o", "%i").stdout
    assert out.split() == []
    await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster="clusters/slurm-full"), timeout=30)
    from drivers.slurm import adapter

    # every limit of accounting's on submitted jobs, as Slurm words them
    for word in ("AssocMaxSubmitJobLimit", "AssocGrpSubmitJobsLimit", "QOSMaxSubmitJobPerUserLimit",
                 "QOSMaxSubmitJobPerAccountLimit", "QOSGrpSubmitJobsLimit"):
        err = adapter.exit_error("sbatch", 1, f"sbatch: error: {word}\nsbatch: error: Batch job submission failed")
        assert err is not None and err.reason == "BACKEND_QUOTA_EXCEEDED", word
    assert adapter.exit_error("sbatch", 1, "sbatch: error: invalid partition specified").reason == "SBATCH_REJECTED"  # type: ignore[union-attr]


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

    deadline = time.monotonic() + 60
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
    deadline = time.monotonic() + 60
    while [p for p in sbatch_processes() if p not in before]:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    for jid, backend in zip(ids, backends, strict=True):
        out = cluster.run("squeue", "--noheader", "--states=all", f"--name=dlsched-{jid}", "-o", "%i").stdout
        assert out.split() == [backend]
    jobs = cluster.run("squeue", "--noheader", "--states=all", "-o", "%j").stdout.split()
    assert not [j for j in jobs if not j.startswith("dlsched-")]  # the given-up sbatch made none


async def test_a_program_that_cannot_start_exits_127_or_126_as_on_every_backend(stub, tmp_path):
    """docs/ENVIRONMENT.md: a command that cannot start fails the job with exit 127 (126: not
    executable), as a shell says; srun passed on slurmstepd's execve errno (2, 13)."""
    plain = tmp_path / "not-executable"
    plain.write_text("#!/bin/sh\nexit 0\n")
    plain.chmod(0o644)
    for command, code in ((["/nonexistent/program", "-x"], 127), ([str(plain)], 126)):
        jid = new_id("nostart")
        await launch(stub, jid, job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[
            job_pb2.ReplicaGroup(role="main", replicas=1, command=command)]))
        obs = await wait_state(stub, jid, within=120)
        assert (obs.state, obs.exit_code) == (job_pb2.JOB_STATE_FAILED, code), obs


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


async def test_a_new_driver_with_slurmctld_down_says_unavailable_not_gone(stub, cluster):
    """A restarted driver asked about a job it does not track yet, while slurmctld does not
    answer (SIGSTOP): UNAVAILABLE, not "not found" (JobManager made the running job FAILED
    LostByBackend); once slurmctld is back, the job is found."""
    jid = new_id("ctlddown")
    first = await launch(stub, jid, single("import time; time.sleep(120)"))
    other = ServiceProcess("drivers.slurm", ["--poll-interval", "0.3"], name="slurm-driver-3").start()
    ctld = cluster.procs["slurmctld"].pid
    try:
        async with security.channel(other.address) as ch:
            fresh = driver_service_pb2_grpc.DriverServiceStub(ch)
            await fresh.ConfigureCluster(configure_request(cluster), timeout=30)
            ref = dpb.JobRef(job_id=jid, backend_job_id=first.backend_job_id)
            os.kill(ctld, signal.SIGSTOP)
            try:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await fresh.BatchGetJobObservations(dpb.BatchGetJobObservationsRequest(
                        cluster=CLUSTER, jobs=[ref]), timeout=180)
                # (squeue waits out its MessageTimeout, 10 s a round: the call may run out of time first)
                assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), e.value
            finally:
                os.kill(ctld, signal.SIGCONT)
            deadline = time.monotonic() + 120
            while True:
                try:
                    obs = (await fresh.BatchGetJobObservations(dpb.BatchGetJobObservationsRequest(
                        cluster=CLUSTER, jobs=[ref]), timeout=60)).observations[0]
                    break
                except grpc.aio.AioRpcError as again:
                    assert time.monotonic() < deadline and again.code() in (
                        grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), again
                    await asyncio.sleep(1)
            assert obs.found and obs.backend_job_id == first.backend_job_id, obs
    finally:
        other.stop()
        await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=jid)), timeout=60)


async def test_a_new_driver_process_keeps_the_attempt_rules(stub, cluster):
    """Attempt 2 runs; a restarted driver (nothing in memory) refuses attempt 3 while it does
    (PREVIOUS_ATTEMPT_ACTIVE) and attempt 1 for good (STALE_ATTEMPT), before its first poll round
    (the look-up) and after (the round's listing): each was submitted as a new Slurm job."""
    jid = new_id("attempts")
    spec = single("import time; print('up', flush=True); time.sleep(300)")
    await launch(stub, jid, spec, attempt=2)
    await wait_state(stub, jid, [job_pb2.JOB_STATE_RUNNING])
    other = ServiceProcess("drivers.slurm", ["--poll-interval", "0.3"], name="slurm-driver-2").start()
    try:
        async with security.channel(other.address) as ch:
            fresh = driver_service_pb2_grpc.DriverServiceStub(ch)
            await fresh.ConfigureCluster(configure_request(cluster), timeout=30)
            for pause in (0, 2):  # before the first round, then from a round's listing
                await asyncio.sleep(pause)
                for attempt, reason in ((3, "PREVIOUS_ATTEMPT_ACTIVE"), (1, "STALE_ATTEMPT")):
                    with pytest.raises(grpc.aio.AioRpcError) as ei:
                        await launch(fresh, jid, spec, attempt=attempt)
                    assert error_info(ei.value).reason == reason, (pause, attempt, ei.value)  # type: ignore[union-attr]
    finally:
        other.stop()
    out = cluster.run("squeue", "--noheader", "--states=all", f"--name=dlsched-{jid}", "-o", "%k").stdout
    assert [render.parse_comment(c)[1] for c in out.split()] == [2]  # type: ignore[index]
    await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=jid)), timeout=30)


async def test_a_requeued_job_runs_again_as_the_same_attempt_and_never_fails(stub, cluster):
    jid = new_id("requeue")
    backend = (await launch(stub, jid, single("import time; time.sleep(10); print('done')"))).backend_job_id
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


# --------------------------------------------------------------------------- exactly once, late sbatch


def _fake_sbatch(bindir: pathlib.Path, body: str) -> str:
    """A remote ``sbatch`` wrapper (``body`` sees the real one as $REAL, the script saved as
    $SCRIPT); returns the cluster's PATH option that puts it first."""
    bindir.mkdir(exist_ok=True)
    (bindir / "sbatch").write_text(f"#!/bin/bash\nREAL={shutil.which('sbatch')}\n"
                                   f"SCRIPT=$(mktemp)\ncat > \"$SCRIPT\"\n{body}\n")
    (bindir / "sbatch").chmod(0o755)
    return f"{bindir}:/usr/bin:/bin"


def _slurm_jobs(cluster, jid: str) -> dict[str, str]:
    """Slurm job id -> state of every Slurm job of the dlsched job."""
    out = cluster.run("squeue", "--noheader", "--states=all", f"--name=dlsched-{jid}", "-o", "%i|%T").stdout
    return dict(line.split("|", 1) for line in out.split())


async def _until(what, ok, within: float = 90.0):
    deadline = time.monotonic() + within
    while not ok(value := await asyncio.to_thread(what)):
        assert time.monotonic() < deadline, value
        await asyncio.sleep(0.3)
    return value


def _marking(marker: pathlib.Path) -> job_pb2.JobSpec:
    return single(f"open({str(marker)!r}, 'a').write('ran\\n')")


async def test_an_sbatch_landing_after_its_timeout_never_runs_a_second_job(cluster, tmp_path):
    """The first sbatch times out and its job lands only afterwards (after the retry's job was
    adopted): it was submitted held and is never released; the next round cancels it. One Slurm
    job ran."""
    marker = pathlib.Path(cluster.home) / f"late-{os.getpid()}-{time.monotonic_ns()}"
    landed = tmp_path / "landed"
    late = (f"if mkdir {tmp_path}/late 2>/dev/null; then\n"
            f"  setsid nohup bash -c 'sleep 10; r=$0 s=$1; shift; \"$r\" \"$@\" < \"$s\" > {landed}' "
            f"\"$REAL\" \"$SCRIPT\" \"$@\" "
            f"</dev/null >/dev/null 2>&1 &\n  sleep 60; exit 0\nfi\nexec \"$REAL\" \"$@\" < \"$SCRIPT\"")
    other = ServiceProcess("drivers.slurm", ["--poll-interval", "0.3", "--command-timeout", "4"],
                           name="slurm-driver-late").start()
    try:
        async with security.channel(other.address) as ch:
            fresh = driver_service_pb2_grpc.DriverServiceStub(ch)
            req = configure_request(cluster)
            req.options["PATH"] = _fake_sbatch(tmp_path / "bin", late)
            await fresh.ConfigureCluster(req, timeout=30)
            jid = new_id("late")
            adopted = (await launch(fresh, jid, _marking(marker))).backend_job_id
            assert (await wait_state(fresh, jid, within=90)).state == job_pb2.JOB_STATE_SUCCEEDED
            jobs = await _until(lambda: _slurm_jobs(cluster, jid), lambda j: len(j) == 2, 60)  # the late one landed
            stray = next(j for j in jobs if j != adopted)
            await _until(lambda: landed.exists() and landed.read_text().strip(), bool, 30)
            assert landed.read_text().strip().split(";")[0] == stray  # the late sbatch's job
            jobs = await _until(lambda: _slurm_jobs(cluster, jid), lambda j: j[stray] == "CANCELLED", 30)
            assert jobs[adopted] == "COMPLETED"
    finally:
        other.stop()
    assert marker.read_text().splitlines() == ["ran"]  # exactly one Slurm job ran


async def test_an_sbatch_that_submits_twice_runs_one_job_and_the_other_is_cancelled(stub, cluster, tmp_path):
    """A duplicate that sbatch never reported (its job lands beside the one it prints) is held
    and cancelled by the next round; only the reported one is released and runs."""
    marker = pathlib.Path(cluster.home) / f"twice-{os.getpid()}-{time.monotonic_ns()}"
    req = configure_request(cluster, "clusters/slurm-twice")
    req.options["PATH"] = _fake_sbatch(tmp_path / "bin", "\"$REAL\" \"$@\" < \"$SCRIPT\" >/dev/null\n"
                                                         "exec \"$REAL\" \"$@\" < \"$SCRIPT\"")
    await stub.ConfigureCluster(req, timeout=30)
    try:
        jid = new_id("twice")
        resp = await stub.LaunchJob(dpb.LaunchJobRequest(cluster="clusters/slurm-twice", job_id=jid,
                                                         spec=_marking(marker), attempt=1), timeout=60)
        jobs = await _until(lambda: _slurm_jobs(cluster, jid),
                            lambda j: j.get(resp.backend_job_id) == "COMPLETED"
                            and all(s == "CANCELLED" for k, s in j.items() if k != resp.backend_job_id))
        assert len(jobs) == 2, jobs
    finally:
        await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster="clusters/slurm-twice"), timeout=30)
    assert marker.read_text().splitlines() == ["ran"]


async def test_a_job_left_held_is_released_when_the_release_works_again_or_a_new_driver_adopts_it(
        stub, cluster, tmp_path):
    """The launch answers once sbatch gave the held job's id; its ``scontrol release`` runs
    after, in the background. While the release fails the job stays held (it does not run)
    and the driver asks again each poll round: once it works (the cluster fixed) the job runs.
    A job whose driver never released it (here: the cluster removed from it) is released by a
    new driver process that adopts it from an observation. Each runs once, as one Slurm job."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "scontrol").write_text(f"#!/bin/bash\n[ \"$1\" = release ] && {{ echo 'slurm_suspend error: "
                                     f"Socket timed out' >&2; exit 1; }}\nexec {shutil.which('scontrol')} \"$@\"\n")
    (bindir / "scontrol").chmod(0o755)
    names = {"fixed": "clusters/slurm-norelease", "observed": "clusters/slurm-norelease-2"}
    for name in names.values():
        req = configure_request(cluster, name)
        req.options["PATH"] = f"{bindir}:/usr/bin:/bin"
        await stub.ConfigureCluster(req, timeout=30)
    markers = {k: pathlib.Path(cluster.home) / f"held-{k}-{os.getpid()}-{time.monotonic_ns()}" for k in names}
    ids = {k: new_id(f"held-{k}") for k in names}
    try:
        launched = {}
        for k, jid in ids.items():
            resp = await stub.LaunchJob(dpb.LaunchJobRequest(cluster=names[k], job_id=jid, spec=_marking(markers[k]),
                                                             attempt=1), timeout=60)
            launched[k] = resp.backend_job_id
        held = {k: list(_slurm_jobs(cluster, jid)) for k, jid in ids.items()}
        assert held == {k: [launched[k]] for k in names}, (held, launched)
        await asyncio.sleep(2)  # several poll rounds, each asking for the release again
        for k, jid in ids.items():
            assert _slurm_jobs(cluster, jid) == {launched[k]: "PENDING"}  # held: nothing ran
            assert not markers[k].exists()
        await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster=names["observed"]), timeout=30)
        # The cluster fixed: the next round's release works and the job runs.
        await stub.ConfigureCluster(configure_request(cluster, names["fixed"]), timeout=30)
        await _until(lambda: _slurm_jobs(cluster, ids["fixed"]), lambda j: "COMPLETED" in j.values())
        again = await stub.LaunchJob(dpb.LaunchJobRequest(cluster=names["fixed"], job_id=ids["fixed"],
                                                          spec=_marking(markers["fixed"]), attempt=1), timeout=60)
        assert again.backend_job_id == launched["fixed"]
        assert _slurm_jobs(cluster, ids["observed"]) == {launched["observed"]: "PENDING"}  # nobody released it
    finally:
        await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster=names["fixed"]), timeout=30)
    # A new driver process adopting the job from an observation releases it.
    other = ServiceProcess("drivers.slurm", ["--poll-interval", "0.3"], name="slurm-driver-held").start()
    try:
        async with security.channel(other.address) as ch:
            fresh = driver_service_pb2_grpc.DriverServiceStub(ch)
            await fresh.ConfigureCluster(configure_request(cluster), timeout=30)
            ref = dpb.JobRef(job_id=ids["observed"], backend_job_id=launched["observed"])
            obs = (await fresh.BatchGetJobObservations(dpb.BatchGetJobObservationsRequest(
                cluster=CLUSTER, jobs=[ref]), timeout=30)).observations[0]
            assert obs.found, obs
            assert (await wait_state(fresh, ids["observed"])).state == job_pb2.JOB_STATE_SUCCEEDED
    finally:
        other.stop()
    for k, jid in ids.items():
        assert _slurm_jobs(cluster, jid) == {launched[k]: "COMPLETED"}
        assert markers[k].read_text().splitlines() == ["ran"]
