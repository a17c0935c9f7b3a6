# ruff: noqa: ASYNC240  -- tests poll real files written by real processes
"""Jobs driven only through JobManagerService, for the backend suites that run
every mode on a real backend through the services (test_ray_services,
test_slurm_services): a ``Run`` (a job with its own WatchJobs stream, opened
before the submit), the probe program every rank runs, and the checks of what
the ranks saw.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from dlsched.v1 import job_manager_service_pb2 as jpb
from dlsched.v1 import job_manager_service_pb2_grpc as jm_grpc
from dlsched.v1 import job_pb2 as S
from tests.harness import AWAIT_RECORDS, pid_alive

PY = sys.executable
TERMINAL = (S.JOB_STATE_SUCCEEDED, S.JOB_STATE_FAILED, S.JOB_STATE_STOPPED)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


class Run:
    """One job, submitted through JobManager with a WatchJobs stream on it opened first."""

    def __init__(self, jm: jm_grpc.JobManagerServiceStub, spec: S.JobSpec, *, prefix: str, cluster: str,
                 job_timeout: float, submit_timeout: float = 60) -> None:
        self.jm = jm
        self.spec = spec
        self.id = new_id(prefix)
        self.name = f"jobs/{self.id}"
        self.cluster = cluster
        self.job_timeout = job_timeout
        self.submit_timeout = submit_timeout
        self.spec.labels["t"] = self.id
        self.states: list[int] = []  # every state the watch showed, in order
        self.reasons: list[str] = []  # every reason the watch showed, in order
        self.job: S.Job | None = None
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._it: AsyncIterator[jpb.WatchJobsResponse] | None = None

    async def submit(self) -> S.Job:
        self._call = self.jm.WatchJobs(jpb.WatchJobsRequest(filter=f'labels.t="{self.id}"'))
        self._it = self._call.__aiter__()
        while (await asyncio.wait_for(self._it.__anext__(), 20)).type != \
                S.WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE:
            pass
        resp = await self.jm.SubmitJob(jpb.SubmitJobRequest(job_id=self.id, spec=self.spec,
                                                            request_id=new_id("req")),
                                       timeout=self.submit_timeout)
        assert resp.job.name == self.name and resp.job.cluster == self.cluster, resp.job
        return resp.job

    async def until(self, states: tuple[int, ...] = TERMINAL, within: float | None = None) -> S.Job:
        """Reads the watch until the job is in one of ``states``; returns it."""
        assert self._it is not None
        within = self.job_timeout if within is None else within
        if self.states and self.states[-1] in states:
            assert self.job is not None
            return self.job
        deadline = time.monotonic() + within
        while True:
            left = deadline - time.monotonic()
            try:
                ev = await asyncio.wait_for(self._it.__anext__(), max(left, 0.01))
            except TimeoutError:
                raise AssertionError(f"{self.name} not {[S.JobState.Name(s) for s in states]} in {within:g} s: "
                                     f"{self.job}") from None
            if ev.job.name != self.name:
                continue
            self.job = ev.job
            if not self.states or self.states[-1] != ev.job.state:
                self.states.append(ev.job.state)
            if not self.reasons or self.reasons[-1] != ev.job.reason:
                self.reasons.append(ev.job.reason)
            if ev.job.state in states:
                return ev.job

    async def get(self) -> S.Job:
        return (await self.jm.GetJob(jpb.GetJobRequest(name=self.name), timeout=10)).job

    async def logs(self, **kw: object) -> list[S.LogEntry]:
        out: list[S.LogEntry] = []
        req = jpb.StreamJobLogsRequest(name=self.name, **kw)  # type: ignore[arg-type]
        async for r in self.jm.StreamJobLogs(req, timeout=self.job_timeout):
            out.extend(r.entries)
        return out

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()


async def cleanup(jm: jm_grpc.JobManagerServiceStub, made: list[Run]) -> None:
    """After a test: close the runs' watches and stop their unfinished jobs."""
    for r in made:
        r.close()
        if r.job is None or r.job.state not in TERMINAL:
            try:
                await jm.StopJob(jpb.StopJobRequest(name=r.name), timeout=20)
            except grpc.aio.AioRpcError:
                pass


async def run_to_end(r: Run, runs: list[Run]) -> tuple[Run, S.Job]:
    runs.append(r)
    await r.submit()
    job = await r.until()
    assert (await r.get()).state == job.state  # the store holds what the watch said
    if job.state != S.JOB_STATE_SUCCEEDED:
        print("\n".join(f"{e.role}-{e.replica_index} {e.text}" for e in await r.logs()))
    return r, job


# Every process writes what it saw (argv, cwd, environment, pid) to <out>/<role>-<index>-<rank>.json,
# rank being RANK or, under mpirun, OMPI_COMM_WORLD_RANK; PROBE_<ROLE>=forever keeps it running;
# PROBE_AWAIT=n waits until n records exist first.
PROBE = """
import json, os, sys, time
out = sys.argv[1]
rank = os.environ.get('RANK', os.environ.get('OMPI_COMM_WORLD_RANK', ''))
name = f"{os.environ['DLSCHED_ROLE']}-{os.environ['DLSCHED_REPLICA_INDEX']}-{rank}"
with open(os.path.join(out, name + '.tmp'), 'w') as f:
    json.dump({'env': dict(os.environ), 'pid': os.getpid(), 'argv': sys.argv[1:], 'cwd': os.getcwd()}, f)
os.replace(os.path.join(out, name + '.tmp'), os.path.join(out, name + '.json'))
print('probe', name, flush=True)
""" + AWAIT_RECORDS + """if os.environ.get('PROBE_' + os.environ['DLSCHED_ROLE'].upper()) == 'forever':
    while True:
        time.sleep(1)
"""


def probe_group(role: str, out: pathlib.Path, replicas: int = 1, ppr: int = 0, **env: str) -> S.ReplicaGroup:
    return S.ReplicaGroup(role=role, replicas=replicas, processes_per_replica=ppr,
                          command=[PY, "-c", textwrap.dedent(PROBE), str(out)], env=env)


def probes(out: pathlib.Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


async def wait_dead(pids: list[int], within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    while alive := [p for p in pids if pid_alive(p)]:
        assert time.monotonic() < deadline, f"processes outlived their job: {alive}"
        await asyncio.sleep(0.2)


async def wait_file(path: pathlib.Path, within: float = 90.0) -> None:
    deadline = time.monotonic() + within
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        await asyncio.sleep(0.1)


def assert_one_torch_world(envs: list[dict], size: int) -> None:
    assert sorted(int(e["RANK"]) for e in envs) == list(range(size))  # every rank once
    for key in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DLSCHED_JOB_ID"):
        assert len({e[key] for e in envs}) == 1, key
    assert envs[0]["WORLD_SIZE"] == str(size)
