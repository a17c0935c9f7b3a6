"""The Slurm driver on its login node: pinned host keys, the SSH session bound, outages of
sshd and slurmctld (last known state, never FAILED), and how many commands it runs (one
squeue per round, every command in /metrics). ``slurm_peer``: the driver as a real process."""

from __future__ import annotations

import asyncio
import itertools
import os
import pathlib
import subprocess
import time

import grpc
import pytest

from dlsched.kit.rpc_errors import error_info
from dlsched.v1 import cluster_pb2, driver_service_pb2_grpc, job_pb2
from dlsched.v1 import driver_service_pb2 as dpb
from drivers.slurm.poller import MIN_INTERVAL
from tests import security, slurm_cluster
from tests.harness import ServiceProcess
from tests.slurm_peer import (
    CLUSTER,
    configure_request,
    driver_fixtures,
    launch,
    logs,
    new_id,
    observe,
    scrape,
    single,
    wait_state,
)

asyncssh = pytest.importorskip("asyncssh")
cluster, driver, stub = driver_fixtures()


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


async def test_a_host_key_that_is_not_the_pinned_one_is_refused(stub, cluster):
    other = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.ConfigureCluster(configure_request(cluster, "clusters/slurm-mitm", [other]), timeout=30)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(e.value).reason == "HOST_KEY_MISMATCH"
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.ConfigureCluster(configure_request(cluster, "clusters/slurm-tofu", []), timeout=30)
    assert error_info(e.value).reason == "HOST_KEY_MISMATCH"


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
    # Long enough to outlast the way to the outage on a busy host: its last state stays RUNNING.
    await launch(stub, jid, single("import time; time.sleep(12)"))
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


async def test_controller_outage_keeps_the_last_state_and_recovers(stub, cluster, tmp_path):
    jid = new_id("outage")
    started = tmp_path / "started"
    await launch(stub, jid, single(f"import pathlib, time; pathlib.Path({str(started)!r}).touch(); time.sleep(12)"))
    await wait_state(stub, jid, [job_pb2.JOB_STATE_RUNNING])
    # R comes with the batch script; srun needs slurmctld to create the step, so the outage waits for the program.
    deadline = time.monotonic() + 60
    while not started.exists():
        assert time.monotonic() < deadline, "the job's program never started"
        await asyncio.sleep(0.1)
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
        spec = single("import time; time.sleep(600)")  # runs or queues (2 CPUs): tracked either way
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
        while any(o.reason == "Submitted" for o in await observed(ids[:30])):  # rounds cover all
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
