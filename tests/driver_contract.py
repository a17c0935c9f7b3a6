"""The four drivers on their real peers, for the one contract suite (``test_driver_contract.py``).

``started(name)`` runs one driver as a real process (``ServiceProcess``) on
the peer its own tests use: ``local`` on this host; ``slurm`` on the test
Slurm behind sshd (``tests/slurm_cluster.py``); ``kubernetes`` on kmock's
emulator (``tests/kube_emulator.py``'s ``Emulator``, in this
process); ``ray`` on a real Ray head (``tests/ray_head.py``). It configures
``peer.cluster`` and yields a ``Peer``: the driver's ``DriverService`` stub
over the control plane's certificate (``security.channel``) plus the few
things that differ per backend: the simplest job the backend runs, how to
count a job's runs, and which optional RPCs it refuses. A peer whose backend
this machine lacks is skipped with its reason (a failure under CI).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import pathlib
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pytest

from dlsched.v1 import cluster_pb2, driver_service_pb2_grpc, job_pb2
from dlsched.v1 import driver_service_pb2 as dpb
from tests import security
from tests.harness import ServiceProcess

PY = sys.executable
DRIVERS = ("local", "slurm", "kubernetes", "ray")
TERMINAL = (job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_STOPPED)
#: The whole suite's CI runs install every backend; DLSCHED_REQUIRE_RAY=1 makes a missing Ray fail.
REQUIRE_RAY = os.environ.get("DLSCHED_REQUIRE_RAY") == "1"


def new_id(prefix: str = "c") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


class Peer:
    """One driver process, configured with ``cluster`` on its backend."""

    name = ""
    #: Seconds a LaunchJob may take on this backend (an sbatch over SSH, a POST to Ray).
    call_timeout = 30.0
    #: Optional RPCs the backend does not offer (UNIMPLEMENTED, reason UNSUPPORTED).
    unsupported: tuple[str, ...] = ()
    #: One backend serves every cluster name, so a job id names one job across them (JOB_ON_OTHER_CLUSTER).
    jobs_span_clusters = False

    def __init__(self, cluster: str) -> None:
        self.cluster = cluster
        self.driver: ServiceProcess | None = None
        self.stub: driver_service_pb2_grpc.DriverServiceStub = None  # type: ignore[assignment]
        self.launched: list[str] = []
        self.uids: dict[str, str] = {}  # job id -> the uid its launches carry
        self._stack: contextlib.AsyncExitStack | None = None

    # -- per backend

    def configure_request(self, cluster: str) -> dpb.ConfigureClusterRequest:
        return dpb.ConfigureClusterRequest(cluster=cluster)

    def group(self, code: str) -> job_pb2.ReplicaGroup:
        return job_pb2.ReplicaGroup(role="main", replicas=1, command=[PY, "-c"], args=[code])

    async def runs(self, job_id: str, marker: str) -> int:
        """How many times the job of ``marking(marker)`` ran: the lines it wrote, once it ended."""
        await self.wait_state(job_id)
        text = await asyncio.to_thread(pathlib.Path(marker).read_text)
        return len(text.splitlines())

    # -- shared

    def sleeping(self, seconds: int = 120) -> job_pb2.JobSpec:
        """A single process that runs until stopped (or ``seconds``)."""
        return job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS,
                               replica_groups=[self.group(f"import time; time.sleep({seconds})")])

    def line(self, i: int) -> str:
        """Line ``i`` of ``run_printing``'s job."""
        return f"line {i:05d} " + "x" * 40

    async def run_printing(self, job_id: str, lines: int) -> None:
        """Runs a job whose one replica prints ``line(0..lines-1)`` to stdout, until it ended."""
        code = f"import sys\nfor i in range({lines}): sys.stdout.write(f'line {{i:05d}} ' + 'x' * 40 + '\\n')"
        await self.launch(job_id, job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS,
                                                  replica_groups=[self.group(code)]))
        await self.wait_state(job_id)

    def long_lines(self) -> list[str]:
        """What ``run_long_lines``'s job writes: one 200,000-character line and
        60 of 40,000 (2.4 MB at once)."""
        return ["L" * 200000] + [f"{i:05d}" + "y" * 39995 for i in range(60)]

    async def run_long_lines(self, job_id: str) -> None:
        """Runs a job whose one replica prints ``long_lines()`` to stdout, until it ended."""
        code = ("import sys\nsys.stdout.write('L' * 200000 + '\\n')\n"
                "for i in range(60): sys.stdout.write(f'{i:05d}' + 'y' * 39995 + '\\n')\n")
        await self.launch(job_id, job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS,
                                                  replica_groups=[self.group(code)]))
        await self.wait_state(job_id)

    def marking(self, marker: str) -> job_pb2.JobSpec:
        """A single process that appends one line to ``marker`` and exits 0."""
        return job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS,
                               replica_groups=[self.group(f"open({marker!r}, 'a').write('ran\\n')")])

    async def launch(self, job_id: str, spec: job_pb2.JobSpec, attempt: int = 1,
                     cluster: str | None = None, uid: str | None = None) -> dpb.LaunchJobResponse:
        """LaunchJob as JobManager sends it: with the job's uid (``uid``, else one per job id)."""
        self.launched.append(job_id)
        if uid is None:
            uid = self.uids.setdefault(job_id, str(uuid.uuid4()))
        return await self.stub.LaunchJob(dpb.LaunchJobRequest(
            cluster=cluster or self.cluster, job_id=job_id, spec=spec, attempt=attempt, job_uid=uid),
            timeout=self.call_timeout)

    async def observe(self, *job_ids: str) -> list[dpb.JobObservation]:
        resp = await self.stub.BatchGetJobObservations(dpb.BatchGetJobObservationsRequest(
            cluster=self.cluster, jobs=[dpb.JobRef(job_id=j) for j in job_ids]), timeout=self.call_timeout)
        return list(resp.observations)

    async def terminate(self, job_id: str, ref: dpb.JobRef | None = None) -> dpb.JobObservation:
        resp = await self.stub.TerminateJob(dpb.TerminateJobRequest(
            cluster=self.cluster, job=ref or dpb.JobRef(job_id=job_id)), timeout=self.call_timeout)
        return resp.observation

    async def cleanup(self, job_id: str, ref: dpb.JobRef | None = None) -> None:
        await self.stub.CleanupJob(dpb.CleanupJobRequest(cluster=self.cluster, job=ref or dpb.JobRef(job_id=job_id)),
                                   timeout=max(self.call_timeout, 60))

    async def wait_state(self, job_id: str, states: Sequence[int] = TERMINAL,
                         within: float = 90.0) -> dpb.JobObservation:
        deadline = time.monotonic() + within
        while True:
            obs = (await self.observe(job_id))[0]
            if obs.state in states:
                return obs
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: {job_id} still {job_pb2.JobState.Name(obs.state)}: {obs}")
            await asyncio.sleep(0.1)

    async def forget_launched(self) -> None:
        """Stop and remove every job a test launched, so the next finds the backend idle."""
        jobs, self.launched = list(dict.fromkeys(self.launched)), []
        for job_id in jobs:
            with contextlib.suppress(Exception):
                await self.cleanup(job_id)

    async def _open(self, driver: ServiceProcess, stack: contextlib.AsyncExitStack) -> Peer:
        stack.callback(driver.stop)
        self._stack = stack
        self.driver = await asyncio.to_thread(driver.start)
        channel = await stack.enter_async_context(security.channel(driver.address))
        self.stub = driver_service_pb2_grpc.DriverServiceStub(channel)
        await self.stub.ConfigureCluster(self.configure_request(self.cluster), timeout=60)
        return self

    async def restart(self) -> None:
        """SIGKILL the driver, start it again (a new address) and configure ``cluster`` again."""
        assert self.driver is not None and self._stack is not None
        await asyncio.to_thread(self.driver.kill)
        await asyncio.to_thread(self.driver.start)
        channel = await self._stack.enter_async_context(security.channel(self.driver.address))
        self.stub = driver_service_pb2_grpc.DriverServiceStub(channel)
        await self.stub.ConfigureCluster(self.configure_request(self.cluster), timeout=60)

    @classmethod
    async def open(cls, stack: contextlib.AsyncExitStack) -> Peer:
        """Start the backend and the driver (stopped when ``stack`` closes); configure ``cluster``."""
        raise NotImplementedError


class LocalPeer(Peer):
    name = "local"
    jobs_span_clusters = True  # one host and one state dir under every cluster name

    @classmethod
    async def open(cls, stack: contextlib.AsyncExitStack) -> Peer:
        state = tempfile.mkdtemp(prefix="dlsched-contract-local-")
        return await cls("clusters/local")._open(ServiceProcess(
            "drivers.local", ["--state-dir", state, "--grace-seconds", "3"], name="contract-local"), stack)


class SlurmPeer(Peer):
    name = "slurm"
    call_timeout = 60.0

    def __init__(self, cluster: str, backend: Any) -> None:
        super().__init__(cluster)
        self.backend = backend

    def configure_request(self, cluster: str) -> dpb.ConfigureClusterRequest:
        c = self.backend
        return dpb.ConfigureClusterRequest(
            cluster=cluster, address=c.address, options=c.options(),
            credentials=cluster_pb2.ClusterCredentials(ssh=cluster_pb2.SshCredentials(
                username=c.user, private_key=c.user_key, known_host_keys=[c.host_key_pub])))

    @classmethod
    async def open(cls, stack: contextlib.AsyncExitStack) -> Peer:
        from tests import slurm_cluster

        if importlib.util.find_spec("asyncssh") is None:
            pytest.skip("asyncssh is not installed (pip install -e '.[slurm]')")
        if why := slurm_cluster.available():
            pytest.skip(why)
        backend = await asyncio.to_thread(slurm_cluster.SlurmCluster().start)
        stack.callback(backend.stop)
        return await cls("clusters/slurm", backend)._open(ServiceProcess(
            "drivers.slurm", ["--poll-interval", "0.3"], name="contract-slurm"), stack)


class KubernetesPeer(Peer):
    """kmock plays the API server; nothing runs a pod, so a job is its pods: it stays
    PENDING (active) until stopped, and it ran once when it has one pod per replica."""

    name = "kubernetes"
    unsupported = ("MeasureJobUsage",)  # the emulator serves no metrics.k8s.io

    def __init__(self, cluster: str, emu: Any, url: str) -> None:
        super().__init__(cluster)
        self.emu, self.url = emu, url

    def configure_request(self, cluster: str) -> dpb.ConfigureClusterRequest:
        from tests.kube_emulator import NS, TOKEN

        return dpb.ConfigureClusterRequest(
            cluster=cluster, address=self.url, options={"namespace": NS, "default_image": "python:3.11-slim"},
            credentials=cluster_pb2.ClusterCredentials(kubernetes=cluster_pb2.KubernetesCredentials(token=TOKEN)))

    def group(self, code: str) -> job_pb2.ReplicaGroup:
        return job_pb2.ReplicaGroup(role="main", replicas=1, command=["python", "-c"], args=[code],
                                    resources=job_pb2.Resources(cpu=1, memory_bytes=1 << 30))

    async def runs(self, job_id: str, marker: str) -> int:
        from tests.kube_emulator import pods_created

        return pods_created(self.emu, job_id)

    async def run_printing(self, job_id: str, lines: int) -> None:
        """The pod's log is written as its kubelet would, then the pod succeeds."""
        from tests.kube_emulator import exited, kubelet

        await self.launch(job_id, self.sleeping())
        pod = f"{job_id}-1-main-0"
        await kubelet(self.url, pod, "Running")
        for i in range(lines):
            self.emu.write_log(pod, self.line(i))
        await kubelet(self.url, pod, "Succeeded", **exited(0, "Completed"))
        await self.wait_state(job_id)

    async def run_long_lines(self, job_id: str) -> None:
        from tests.kube_emulator import exited, kubelet

        await self.launch(job_id, self.sleeping())
        pod = f"{job_id}-1-main-0"
        await kubelet(self.url, pod, "Running")
        for text in self.long_lines():
            self.emu.write_log(pod, text)
        await kubelet(self.url, pod, "Succeeded", **exited(0, "Completed"))
        await self.wait_state(job_id)

    @classmethod
    async def open(cls, stack: contextlib.AsyncExitStack) -> Peer:
        for module in ("kmock", "kubernetes"):
            if importlib.util.find_spec(module) is None:
                pytest.skip(f"{module} is not installed (pip install -e '.[dev]')")
        from tests.kube_emulator import emulator

        emu, url = await stack.enter_async_context(emulator())
        return await cls("clusters/k8s", emu, url)._open(ServiceProcess(
            "drivers.kubernetes", ["--request-timeout", "3", "--watch-read-timeout", "60", "--qps", "500",
                                   "--burst", "1000", "--grace-seconds", "1"], name="contract-kubernetes"), stack)


class RayPeer(Peer):
    name = "ray"

    def __init__(self, cluster: str, head: Any) -> None:
        super().__init__(cluster)
        self.head = head

    def configure_request(self, cluster: str) -> dpb.ConfigureClusterRequest:
        return dpb.ConfigureClusterRequest(cluster=cluster, address=self.head.address, options={"python": PY})

    @classmethod
    async def open(cls, stack: contextlib.AsyncExitStack) -> Peer:
        from tests.ray_head import RayHead, ray_available

        if not REQUIRE_RAY and (importlib.util.find_spec("aiohttp") is None or not ray_available()):
            pytest.skip("ray[default] is not installed (pip install 'ray[default]')")
        head = await asyncio.to_thread(RayHead().start)
        stack.callback(head.stop)
        return await cls("clusters/ray", head)._open(ServiceProcess(
            "drivers.ray", ["--poll-interval", "0.2", "--log-poll-interval", "0.05"], name="contract-ray"), stack)


PEERS: dict[str, type[Peer]] = {p.name: p for p in (LocalPeer, SlurmPeer, KubernetesPeer, RayPeer)}


@contextlib.asynccontextmanager
async def started(name: str) -> AsyncIterator[Peer]:
    """Driver ``name`` on its backend, configured; everything stopped after."""
    async with contextlib.AsyncExitStack() as stack:
        yield await PEERS[name].open(stack)


# --------------------------------------------------------------------------- every RPC naming a cluster


async def _first(call: Any) -> Any:
    """A server stream's first message (its error, if it fails first)."""
    try:
        async for msg in call:
            return msg
        return None
    finally:
        call.cancel()


def cluster_calls(peer: Peer, job_id: str = "") -> dict[str, Callable[[str], Any]]:
    """One call per DriverService RPC that acts on a configured cluster, by RPC name,
    about ``job_id`` (a job nobody launched when empty)."""
    s, ref, t = peer.stub, dpb.JobRef(job_id=job_id or new_id("nojob")), peer.call_timeout
    spec = peer.sleeping()
    return {
        "GetClusterInfo": lambda c: s.GetClusterInfo(dpb.GetClusterInfoRequest(cluster=c), timeout=t),
        "RenderJob": lambda c: s.RenderJob(dpb.RenderJobRequest(cluster=c, job_id=ref.job_id, spec=spec), timeout=t),
        "LaunchJob": lambda c: s.LaunchJob(dpb.LaunchJobRequest(cluster=c, job_id=ref.job_id, spec=spec, attempt=1),
                                           timeout=t),
        "BatchGetJobObservations": lambda c: s.BatchGetJobObservations(
            dpb.BatchGetJobObservationsRequest(cluster=c, jobs=[ref]), timeout=t),
        "WatchJobObservations": lambda c: _first(s.WatchJobObservations(
            dpb.WatchJobObservationsRequest(cluster=c), timeout=t)),
        "TerminateJob": lambda c: s.TerminateJob(dpb.TerminateJobRequest(cluster=c, job=ref), timeout=t),
        "CleanupJob": lambda c: s.CleanupJob(dpb.CleanupJobRequest(cluster=c, job=ref), timeout=t),
        "TailJobLogs": lambda c: _first(s.TailJobLogs(dpb.TailJobLogsRequest(cluster=c, job=ref), timeout=t)),
        "ForgetJobs": lambda c: s.ForgetJobs(dpb.ForgetJobsRequest(cluster=c, jobs=[ref]), timeout=t),
        "MeasureJobUsage": lambda c: s.MeasureJobUsage(dpb.MeasureJobUsageRequest(cluster=c, job=ref), timeout=t),
    }


CLUSTER_RPCS = ("GetClusterInfo", "RenderJob", "LaunchJob", "BatchGetJobObservations", "WatchJobObservations",
                "TerminateJob", "CleanupJob", "TailJobLogs", "MeasureJobUsage", "ForgetJobs")
