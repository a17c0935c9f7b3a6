"""The Slurm driver's GetClusterInfo at a bounded controller cost (real Slurm behind a real sshd;
the login node logs every squeue and scontrol it runs): while jobs are polled, health comes from
the poll rounds and capacity is looked up once per ``--capacity-interval``; with nothing
polled, once per ``--idle-check-interval``, however often ClusterManager asks."""

from __future__ import annotations

import asyncio
import time

from dlsched.v1 import cluster_pb2
from dlsched.v1 import driver_service_pb2 as dpb
from tests import slurm_cluster
from tests.slurm_peer import configure_request, driver_fixtures, new_id, single

cluster, driver, stub = driver_fixtures()
IDLE_INTERVAL = 10.0  # the driver's --idle-check-interval default


def show_nodes(calls: str) -> int:
    return sum(1 for _, name, args in slurm_cluster.read_command_log(calls)
               if name == "scontrol" and "show nodes" in args)


def rounds(calls: str) -> int:
    return sum(1 for _, name, args in slurm_cluster.read_command_log(calls)
               if name == "squeue" and "--name" not in args)


async def info(stub, name: str) -> dpb.GetClusterInfoResponse:
    return await stub.GetClusterInfo(dpb.GetClusterInfoRequest(cluster=name), timeout=30)


async def test_cluster_info_adds_no_controller_call_while_jobs_are_polled(stub, cluster, tmp_path):
    calls = str(tmp_path / "calls.log")
    name = "clusters/slurm-health"
    req = configure_request(cluster, name)
    req.options["PATH"] = slurm_cluster.command_log_path(str(tmp_path / "bin"), calls)
    await stub.ConfigureCluster(req, timeout=30)
    start = time.monotonic()

    def due() -> int:
        """Look-ups the idle interval (10 s) allows so far: a loaded machine may take longer than
        one interval over the calls below; one per call would still be far more."""
        return 1 + int((time.monotonic() - start) // IDLE_INTERVAL)

    try:
        first = (await info(stub, name)).info
        assert first.state == cluster_pb2.CLUSTER_STATE_READY and first.capacity.cpus_total == 2, first
        assert show_nodes(calls) == 1
        # idle (nothing polled): asked 20 times within the 10 s idle interval, looked up once
        for _ in range(20):
            assert (await info(stub, name)).info.state == cluster_pb2.CLUSTER_STATE_READY
            await asyncio.sleep(0.1)
        assert show_nodes(calls) <= due()
        # a polled job: the rounds (squeue) say health, capacity stays the last look-up's
        jid = new_id("health")
        await stub.LaunchJob(dpb.LaunchJobRequest(cluster=name, job_id=jid, attempt=1,
                                                  spec=single("import time; time.sleep(30)")), timeout=60)
        asked = 0
        while rounds(calls) < 3 or asked < 30:  # asked throughout three poll rounds at least
            got = (await info(stub, name)).info
            assert got.state == cluster_pb2.CLUSTER_STATE_READY and got.capacity.cpus_total == 2, got
            asked += 1
            assert asked < 3000
            await asyncio.sleep(0.1)
        assert show_nodes(calls) <= due() + 1  # the idle look-ups due, never one per call
    finally:
        await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster=name), timeout=30)
