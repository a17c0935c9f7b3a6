"""The Slurm driver's usage: sstat samples of a running job, kept once it ends, and no sacct
where the cluster has no accounting storage (``slurm_peer``: the driver as a real process)."""

from __future__ import annotations

import asyncio
import time

from dlsched.v1 import cluster_pb2, job_pb2
from dlsched.v1 import driver_service_pb2 as dpb
from tests import slurm_cluster
from tests.slurm_peer import (
    CLUSTER,
    TERMINAL,
    configure_request,
    driver_fixtures,
    launch,
    new_id,
    single,
    wait_state,
)

cluster, driver, stub = driver_fixtures()


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
