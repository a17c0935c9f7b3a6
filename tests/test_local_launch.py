"""The local driver: clusters, launching, states, stops, cleanup and validation, as a real process over real gRPC."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import shlex
import shutil
import socket
import sys
import time

import grpc
import pytest

from dlsched.kit.rpc_errors import error_info, field_violations
from dlsched.v1 import driver_service_pb2 as dpb
from dlsched.v1 import job_pb2
from tests import security
from tests.harness import ServiceProcess, pid_alive
from tests.local_peer import (
    CLUSTER,
    TERMINAL,
    driver_fixtures,
    group,
    launch,
    logs,
    multi,
    new_id,
    observe,
    single,
    texts,
    wait_state,
)

state_dir, driver, stub = driver_fixtures()


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


async def test_single_process_job_succeeds_with_planner_and_user_env(stub, tmp_path):
    job_id = new_id("single")
    code = ("import os\n"
            "for k in ('DLSCHED_JOB_ID','DLSCHED_JOB_NAME','DLSCHED_ROLE','DLSCHED_REPLICA_INDEX',"
            "'DLSCHED_NUM_REPLICAS','FOO','RANK'):\n"
            "    print(f'{k}={os.environ.get(k)}')\n"
            "print('CWD=' + os.getcwd())\n"
            "print('PWD=' + os.environ.get('PWD', ''))\n"
            "print('OURS=' + ','.join(sorted(k for k in os.environ if k.upper().startswith('DLSCHED_'))))\n")
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
    assert f"PWD={tmp_path}" in out  # as a shell sets it (it was the driver's own)
    # the driver's own DLSCHED_* settings (its TLS key file, the admin token's file) are no job's
    assert "OURS=DLSCHED_JOB_ID,DLSCHED_JOB_NAME,DLSCHED_NUM_REPLICAS,DLSCHED_REPLICA_INDEX,DLSCHED_ROLE" in out, out


def test_the_supervisor_gives_its_processes_no_ignored_or_blocked_signal():
    """A driver started by ``cmd &`` in a script ignores SIGINT and SIGQUIT, and exec keeps ignored
    signals: its jobs had them ignored, where Slurm and Ray give every signal its default."""
    code = ("import signal, subprocess\n"
            "signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGQUIT, signal.SIG_IGN)\n"
            "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})\n"
            "from drivers.local.supervisor import _default_signals\n"
            "_default_signals()\n"
            "subprocess.run(['grep', '-E', '^Sig(Ign|Blk)', '/proc/self/status'], check=True)\n")
    out = subprocess_out([sys.executable, "-c", code])
    assert out.split() == ["SigBlk:", "0" * 16, "SigIgn:", "0" * 16], out


def subprocess_out(argv: list[str]) -> str:
    import subprocess
    root = pathlib.Path(__file__).resolve().parent.parent
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)}).stdout


async def test_failing_job_reports_failed_with_exit_code(stub):
    job_id = new_id("fail")
    await launch(stub, job_id, single("import sys; print('boom', file=sys.stderr); sys.exit(3)"))
    obs = await wait_state(stub, job_id)
    assert obs.state == job_pb2.JOB_STATE_FAILED
    assert obs.exit_code == 3 and obs.reason == "NonZeroExit"
    assert obs.replicas[0].state == job_pb2.REPLICA_STATE_FAILED and obs.replicas[0].exit_code == 3
    assert texts(await logs(stub, job_id), job_pb2.LOG_STREAM_STDERR) == ["boom"]


async def test_missing_program_fails_to_start(stub):
    """As on Slurm and Ray: the job fails as its program exited 127 (NonZeroExit, the replica named)
    and the replica's stderr says why (the job said StartFailed, its log nothing)."""
    job_id = new_id("nostart")
    spec = single("pass")
    spec.replica_groups[0].command[:] = ["/nonexistent/program"]
    await launch(stub, job_id, spec)
    obs = await wait_state(stub, job_id)
    assert obs.state == job_pb2.JOB_STATE_FAILED
    assert (obs.reason, obs.message, obs.exit_code) == ("NonZeroExit", "main-0 exited with code 127", 127)
    (err,) = texts(await logs(stub, job_id), job_pb2.LOG_STREAM_STDERR)
    assert err.startswith("dlsched: cannot start '/nonexistent/program'"), err


async def test_a_working_directory_that_cannot_be_entered_fails_with_126(stub, tmp_path):
    """As Slurm's scripts (``cd -- DIR || exit 126``): 126 and a stderr line naming the
    directory, not 127 blaming the program (the spawn's chdir failed, not its exec)."""
    job_id = new_id("nocwd")
    spec = single("pass")
    spec.replica_groups[0].working_dir = str(tmp_path / "missing")
    await launch(stub, job_id, spec)
    obs = await wait_state(stub, job_id)
    assert obs.state == job_pb2.JOB_STATE_FAILED
    assert (obs.reason, obs.message, obs.exit_code) == ("NonZeroExit", "main-0 exited with code 126", 126)
    (err,) = texts(await logs(stub, job_id), job_pb2.LOG_STREAM_STDERR)
    assert err.startswith(f"dlsched: cannot enter the working directory '{tmp_path / 'missing'}'"), err


def test_start_failures_read_as_a_shell_says_them(tmp_path):
    """The one rule the local supervisor and the Ray launcher share: what failed (the chdir
    or the exec) and why gives the exit code."""
    import subprocess

    from drivers.common import planner

    cases = [(["/bin/true"], str(tmp_path / "gone"), 126, "cannot enter the working directory"),
             (["/bin/true"], "/etc/passwd", 126, "cannot enter the working directory"),
             ([str(tmp_path / "nope")], str(tmp_path), 127, "cannot start"),
             (["/etc/passwd"], str(tmp_path), 126, "cannot start")]
    for argv, cwd, code, says in cases:
        with pytest.raises(OSError) as ei:
            subprocess.Popen(argv, cwd=cwd)
        got, line = planner.start_failure(ei.value, argv[0], cwd)
        assert got == code and line.startswith(f"dlsched: {says}"), (argv, cwd, got, line)


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
            "time.sleep(600)\n")
    await launch(stub, job_id, multi(code, ppr=3))
    obs = await wait_state(stub, job_id, within=120)  # (the others stopped, not ended by themselves)
    assert obs.state == job_pb2.JOB_STATE_FAILED and obs.exit_code == 4 and obs.reason == "NonZeroExit"
    states = {r.index: (r.state, r.exit_code) for r in obs.replicas}
    assert states[1] == (job_pb2.REPLICA_STATE_FAILED, 4)
    assert states[0] == states[2] == (job_pb2.REPLICA_STATE_STOPPED, 128 + 15)


async def test_what_a_process_that_exits_at_once_leaves_in_its_session_is_killed(stub, tmp_path):
    """A replica that starts a background child and exits at once (its exit may reach the
    supervisor before its start is noted): the child is killed with the session, every time."""
    jobs = [new_id("fast") for _ in range(10)]
    for i, job in enumerate(jobs):
        await launch(stub, job, job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[
            job_pb2.ReplicaGroup(role="main", replicas=1, command=["/bin/sh", "-c"],
                                 args=[f"sleep 300 >/dev/null 2>&1 & echo $! > {tmp_path}/{i}; exit 0"])]))
    for job in jobs:
        assert (await wait_state(stub, job, within=60)).state == job_pb2.JOB_STATE_SUCCEEDED
    children = [int((tmp_path / str(i)).read_text()) for i in range(len(jobs))]
    deadline = time.monotonic() + 10
    while alive := [p for p in children if pid_alive(p)]:
        assert time.monotonic() < deadline, f"background children outlived their replicas: {alive}"
        await asyncio.sleep(0.1)


async def test_a_daemon_that_left_its_session_ends_with_its_job(stub, tmp_path):
    """A process that calls setsid (a daemon) is in no session the driver signals; its parent
    gone, it comes to the supervisor (a child subreaper), which kills it once the job ended."""
    job = new_id("daemon")
    await launch(stub, job, job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[
        job_pb2.ReplicaGroup(role="main", replicas=1, command=["/bin/sh", "-c"], args=[
            f"setsid -f /bin/sh -c 'echo $$ > {tmp_path}/pid; exec sleep 300' >/dev/null 2>&1 </dev/null; "
            f"while [ ! -s {tmp_path}/pid ]; do sleep 0.1; done; exit 0"])]))
    assert (await wait_state(stub, job, within=60)).state == job_pb2.JOB_STATE_SUCCEEDED
    daemon = int((tmp_path / "pid").read_text())
    deadline = time.monotonic() + 30
    while pid_alive(daemon):
        assert time.monotonic() < deadline, f"a daemon ({daemon}) outlived its job"
        await asyncio.sleep(0.1)


#: A replica that starts a daemon (setsid: a session of its own) which records the SIGTERM it gets.
DAEMON = """import os, pathlib, signal, subprocess, sys, time
out = pathlib.Path(sys.argv[1])
code = (
    "import os, pathlib, signal, sys, time\\n"
    "out = pathlib.Path(sys.argv[1])\\n"
    "def term(*_):\\n"
    "    (out / 'term').write_text('TERM')\\n"
    "    sys.exit(143)\\n"
    "signal.signal(signal.SIGTERM, term)\\n"
    "(out / 'pid').write_text(str(os.getpid()))\\n"
    "time.sleep(300)\\n")
subprocess.Popen([sys.executable, "-c", code, str(out)], start_new_session=True,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
time.sleep(300)
"""


async def test_a_stop_reaches_a_daemon_that_left_its_session(stub, tmp_path):
    """StopJob: the daemon a replica started in a session of its own gets the stop's SIGTERM
    too (it has come to the supervisor once its parent ended), and is gone after."""
    job = new_id("daemonstop")
    out = tmp_path / "out"
    out.mkdir()
    await launch(stub, job, job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[
        job_pb2.ReplicaGroup(role="main", replicas=1, command=[sys.executable, "-c", DAEMON, str(out)])]))
    deadline = time.monotonic() + 60
    while not (out / "pid").exists() or not (out / "pid").read_text():
        assert time.monotonic() < deadline, "the daemon never started"
        await asyncio.sleep(0.1)
    daemon = int((out / "pid").read_text())
    await stub.TerminateJob(dpb.TerminateJobRequest(
        cluster=CLUSTER, job=dpb.JobRef(job_id=job), grace_period={"seconds": 5}), timeout=10)
    assert (await wait_state(stub, job, within=60)).state == job_pb2.JOB_STATE_STOPPED
    deadline = time.monotonic() + 30
    while pid_alive(daemon):
        assert time.monotonic() < deadline, f"a daemon ({daemon}) outlived its stopped job"
        await asyncio.sleep(0.1)
    assert (out / "term").exists()


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


async def test_a_stop_sends_each_process_one_sigterm(stub):
    """Each replica leads its session and its process group: both were signalled, so every
    process got two SIGTERMs (a second one is "abort now" to many trainers)."""
    job_id = new_id("once")
    code = ("import os, signal, sys, time\n"
            "n = 0\n"
            "def h(*_):\n"
            "    global n\n"
            "    n += 1\n"
            "    print(f'term {os.environ[\"RANK\"]} {n}', flush=True)\n"
            "signal.signal(signal.SIGTERM, h)\n"
            "print('up', flush=True)\n"
            "while n == 0:\n"
            "    time.sleep(0.05)\n"
            "time.sleep(1)\n")  # a second SIGTERM would come within this
    await launch(stub, job_id, multi(code, ppr=2))
    deadline = time.monotonic() + 60
    while texts(await logs(stub, job_id)).count("up") < 2:
        assert time.monotonic() < deadline, "the processes never started"
        await asyncio.sleep(0.1)
    await stub.TerminateJob(dpb.TerminateJobRequest(
        cluster=CLUSTER, job=dpb.JobRef(job_id=job_id), grace_period={"seconds": 30}), timeout=10)
    assert (await wait_state(stub, job_id, within=60)).state == job_pb2.JOB_STATE_STOPPED
    assert sorted(t for t in texts(await logs(stub, job_id)) if t.startswith("term")) == ["term 0 1", "term 1 1"]


async def test_an_orphan_in_its_replicas_group_gets_one_sigterm(stub, tmp_path):
    """A process orphaned inside its replica's process group (its parent subshell exited) comes
    to the supervisor: the stop signals it with the group, and not again as an escapee."""
    job_id = new_id("orphan")
    counter = ("import os, signal, sys, time\n"
               "n = 0\n"
               "def h(*_):\n"
               "    global n\n"
               "    n += 1\n"
               f"    open({str(tmp_path / 'terms')!r}, 'a').write('t')\n"
               "signal.signal(signal.SIGTERM, h)\n"
               f"open({str(tmp_path / 'up')!r}, 'w').write('up')\n"
               "while n == 0:\n"
               "    time.sleep(0.05)\n"
               "time.sleep(1)\n")
    script = f"( {shlex.quote(sys.executable)} -c {shlex.quote(counter)} & ); exec sleep 300"
    await launch(stub, job_id, job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[
        job_pb2.ReplicaGroup(role="main", replicas=1, command=["/bin/sh", "-c", script])]))
    deadline = time.monotonic() + 60
    while not (tmp_path / "up").exists():
        assert time.monotonic() < deadline, "the orphan never started"
        await asyncio.sleep(0.1)
    await stub.TerminateJob(dpb.TerminateJobRequest(
        cluster=CLUSTER, job=dpb.JobRef(job_id=job_id), grace_period={"seconds": 30}), timeout=10)
    assert (await wait_state(stub, job_id, within=60)).state == job_pb2.JOB_STATE_STOPPED
    await asyncio.sleep(1.5)
    assert (tmp_path / "terms").read_text() == "t"


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
        if not any(pid_alive(p) for p in pids) or time.monotonic() - t0 > 60:
            break
        await asyncio.sleep(0.02)
    gone_after = time.monotonic() - t0
    assert not any(pid_alive(p) for p in pids)
    # the stop's grace of 1 s, not the driver's default of 10 s (a bound far above any delay)
    assert 0.9 < gone_after < 8, gone_after
    obs = await wait_state(stub, job_id, within=60)
    assert obs.state == job_pb2.JOB_STATE_STOPPED
    assert {(r.state, r.exit_code) for r in obs.replicas} == {(job_pb2.REPLICA_STATE_STOPPED, 128 + 9)}
    # Idempotent: stopping an ended job, or an unknown one, succeeds.
    again = await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job_id)), timeout=10)
    assert again.observation.state == job_pb2.JOB_STATE_STOPPED
    unknown = await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=dpb.JobRef(job_id="nosuchjob")), timeout=10)
    assert not unknown.observation.found


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


async def test_a_relative_working_dir_out_of_the_attempt_directory_is_invalid_argument(stub, state_dir):
    """A relative working directory is taken in the attempt directory and stays inside it:
    one that climbs out (into another job's attempt) is refused, at render and at launch,
    naming the field; one inside runs there; an absolute one is used as it is (documented)."""
    field = "spec.replica_groups[0].working_dir"
    for wd in ("../../other/attempt-1", "..", "sub/../../x"):
        spec = single("import os; print(os.getcwd())", working_dir=wd)
        for call in (stub.LaunchJob(dpb.LaunchJobRequest(cluster=CLUSTER, job_id="climber", attempt=1, spec=spec),
                                    timeout=10),
                     stub.RenderJob(dpb.RenderJobRequest(cluster=CLUSTER, job_id="climber", spec=spec), timeout=10)):
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await call
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, wd
            assert error_info(ei.value).metadata["field"] == field, wd
    assert not (await observe(stub, "climber")).found
    job_id = new_id("inside")
    await launch(stub, job_id, single("import os; print('CWD=' + os.getcwd())", working_dir="sub/../."))
    assert (await wait_state(stub, job_id)).state == job_pb2.JOB_STATE_SUCCEEDED
    assert texts(await logs(stub, job_id)) == [f"CWD={os.path.join(state_dir, 'jobs', job_id, 'attempt-1')}"]


async def test_run_mode_structure_is_invalid_argument(stub):
    spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_PS_WORKER, replica_groups=[group("pass", role="worker")])
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await launch(stub, new_id("ps"), spec)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(ei.value).metadata["field"] == "spec.replica_groups"


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
