"""Shared by the local driver's tests (``tests/test_local_*.py``): the driver as a
real process over real gRPC (module-scoped fixtures ``state_dir``, ``driver``,
``stub``; a test module imports them), job specs and the calls the tests make."""

from __future__ import annotations

import asyncio
import os
import pathlib
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import pytest

from dlsched.v1 import driver_service_pb2 as dpb
from dlsched.v1 import driver_service_pb2_grpc, job_pb2
from tests import security
from tests.harness import ServiceProcess

PY = sys.executable
CLUSTER = "clusters/local"
GOLDEN = pathlib.Path(__file__).parent / "golden" / "local"
TERMINAL = (job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_STOPPED)


# --------------------------------------------------------------------------- fixtures


def driver_fixtures(name: str = "local-driver") -> tuple[Any, Any, Any]:
    """``state_dir, driver, stub = driver_fixtures()`` in a test module: one driver per module
    (``--grace-seconds 3``) on a temp state dir, and a stub with ``CLUSTER`` configured."""

    @pytest.fixture(scope="module")
    def state_dir() -> Iterator[str]:
        d = tempfile.mkdtemp(prefix="dlsched-local-test-")
        yield d
        shutil.rmtree(d, ignore_errors=True)

    @pytest.fixture(scope="module")
    def driver(state_dir: str) -> Iterator[ServiceProcess]:
        svc = ServiceProcess("drivers.local", ["--state-dir", state_dir, "--grace-seconds", "3"], name=name).start()
        yield svc
        svc.stop()

    @pytest.fixture
    async def stub(driver: ServiceProcess) -> AsyncIterator[driver_service_pb2_grpc.DriverServiceStub]:
        async with security.channel(driver.address) as ch:
            s = driver_service_pb2_grpc.DriverServiceStub(ch)
            await s.ConfigureCluster(dpb.ConfigureClusterRequest(cluster=CLUSTER), timeout=10)
            yield s

    return state_dir, driver, stub


_ids = iter(range(10**6))


def new_id(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{next(_ids)}"


def group(code: str, *, role: str = "main", replicas: int = 1, ppr: int = 0,
          env: dict[str, str] | None = None, working_dir: str = "",
          cpu: float = 0.0) -> job_pb2.ReplicaGroup:
    return job_pb2.ReplicaGroup(role=role, replicas=replicas, processes_per_replica=ppr,
                                command=[PY, "-u", "-c"], args=[code], env=env or {},
                                working_dir=working_dir, resources=job_pb2.Resources(cpu=cpu))


def single(code: str, **kw: object) -> job_pb2.JobSpec:
    return job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[group(code, **kw)])  # type: ignore[arg-type]


def multi(code: str, *, replicas: int = 1, ppr: int = 0, **kw: object) -> job_pb2.JobSpec:
    return job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_MULTI_PROCESS,
                           replica_groups=[group(code, role="worker", replicas=replicas, ppr=ppr, **kw)])  # type: ignore[arg-type]


async def launch(stub: driver_service_pb2_grpc.DriverServiceStub, job_id: str, spec: job_pb2.JobSpec,
                 attempt: int = 1, cluster: str = CLUSTER) -> dpb.LaunchJobResponse:
    return await stub.LaunchJob(dpb.LaunchJobRequest(cluster=cluster, job_id=job_id, spec=spec,
                                                     attempt=attempt), timeout=10)


async def observe(stub: driver_service_pb2_grpc.DriverServiceStub, job_id: str,
                  cluster: str = CLUSTER) -> dpb.JobObservation:
    resp = await stub.BatchGetJobObservations(
        dpb.BatchGetJobObservationsRequest(cluster=cluster, jobs=[dpb.JobRef(job_id=job_id)]), timeout=10)
    return resp.observations[0]


async def wait_state(stub: driver_service_pb2_grpc.DriverServiceStub, job_id: str,
                     states: Sequence[int] = TERMINAL, within: float = 15.0,
                     cluster: str = CLUSTER) -> dpb.JobObservation:
    deadline = time.monotonic() + within
    while True:
        obs = await observe(stub, job_id, cluster)
        if obs.state in states:
            return obs
        if time.monotonic() > deadline:
            raise AssertionError(f"{job_id} still {job_pb2.JobState.Name(obs.state)}: {obs}")
        await asyncio.sleep(0.03)


async def logs(stub: driver_service_pb2_grpc.DriverServiceStub, job_id: str,
               cluster: str = CLUSTER, **kw: object) -> list[job_pb2.LogEntry]:
    req = dpb.TailJobLogsRequest(cluster=cluster, job=dpb.JobRef(job_id=job_id), **kw)  # type: ignore[arg-type]
    out: list[job_pb2.LogEntry] = []
    async for resp in stub.TailJobLogs(req, timeout=20):
        out.extend(resp.entries)
    return out


def texts(entries: Sequence[job_pb2.LogEntry], stream: int = job_pb2.LOG_STREAM_STDOUT) -> list[str]:
    return [e.text for e in entries if e.stream == stream]
