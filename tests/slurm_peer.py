"""Shared by the Slurm driver's tests (``tests/test_slurm_{launch,logs,usage,outages,calls}.py``):
the driver as a real process over real gRPC against a real Slurm behind a real sshd
(``driver_fixtures()``: module-scoped ``cluster`` and ``driver``, a ``stub`` with ``CLUSTER``
configured; a test module assigns them), job specs and the calls the tests make.

Importing it skips (never fails) the importing module where the cluster cannot run: not
root, or Debian's ``slurmctld slurmd slurm-client munge openssh-server`` missing (``bash
scripts/install-slurm.sh``), or asyncssh missing (``pip install -e '.[slurm]'``).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import pytest

from dlsched.v1 import cluster_pb2, driver_service_pb2_grpc, job_pb2
from dlsched.v1 import driver_service_pb2 as dpb
from tests import security, slurm_cluster
from tests.harness import ServiceProcess, backend_calls

asyncssh = pytest.importorskip("asyncssh")
if why := slurm_cluster.available():
    pytest.skip(why, allow_module_level=True)

PY = sys.executable
CLUSTER = "clusters/slurm"
TERMINAL = (job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_STOPPED)
TICKS = "import time\nfor i in range({n}):\n    print('tick', i, flush=True)\n    time.sleep({gap})"


# --------------------------------------------------------------------------- fixtures


def driver_fixtures() -> tuple[Any, Any, Any]:
    """``cluster, driver, stub = driver_fixtures()`` in a test module: one Slurm cluster and
    one driver (``--poll-interval 0.3``) per module, and a stub with ``CLUSTER`` configured."""

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

    @pytest.fixture
    async def stub(driver: ServiceProcess, cluster: slurm_cluster.SlurmCluster
                   ) -> AsyncIterator[driver_service_pb2_grpc.DriverServiceStub]:
        async with security.channel(driver.address) as ch:
            s = driver_service_pb2_grpc.DriverServiceStub(ch)
            await s.ConfigureCluster(configure_request(cluster), timeout=30)
            yield s

    return cluster, driver, stub


def configure_request(c: slurm_cluster.SlurmCluster, name: str = CLUSTER,
                      host_keys: Sequence[str] | None = None) -> dpb.ConfigureClusterRequest:
    return dpb.ConfigureClusterRequest(
        cluster=name, address=c.address, options=c.options(),
        credentials=cluster_pb2.ClusterCredentials(ssh=cluster_pb2.SshCredentials(
            username=c.user, private_key=c.user_key,
            known_host_keys=list(host_keys if host_keys is not None else [c.host_key_pub]))))


# --------------------------------------------------------------------------- specs and calls

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


def scrape(svc: ServiceProcess) -> dict[str, float]:
    return backend_calls(svc, "slurm")


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
