"""Scale-out over one etcd: two JobManagers and two ClusterManagers.

A job submitted through one JobManager is watched and tailed through the other; the
ClusterManager leader (the one that monitors clusters) is SIGKILLed and the
other takes over: a cluster registered afterwards still becomes READY, and
jobs submitted afterwards still run to their end, their states flowing to
both JobManagers' watches.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from dlsched.kit import etcd as etcd_kit
from dlsched.v1 import cluster_manager_service_pb2 as cm_pb
from dlsched.v1 import cluster_manager_service_pb2_grpc as cm_grpc
from dlsched.v1 import cluster_pb2, job_pb2
from dlsched.v1 import job_manager_service_pb2 as pb
from dlsched.v1 import job_manager_service_pb2_grpc as pb_grpc
from tests import security
from tests.harness import EtcdServer, ServiceProcess

TTL = 2


class Pair:
    def __init__(self, etcd: EtcdServer, prefix: str) -> None:
        self.prefix = prefix
        self.driver = ServiceProcess("drivers.local", ["--grace-seconds", "2"], name="local-driver-so")
        cm_args = ["--etcd", etcd.endpoint, "--prefix", prefix, "--monitor-interval", "0.5",
                   "--leader-ttl", str(TTL)]
        self.cms = [ServiceProcess("cluster_manager", cm_args, name=f"cm-{i}") for i in range(2)]
        self.jms: list[ServiceProcess] = []
        self.etcd = etcd

    def start(self) -> Pair:
        self.driver.start()
        for cm in self.cms:
            cm.start()
        target = "ipv4:" + ",".join(cm.address for cm in self.cms)
        self.jms = [ServiceProcess("job_manager", ["--etcd", self.etcd.endpoint, "--prefix", self.prefix,
                                                   "--cluster-manager", target], name=f"jm-{i}")
                    for i in range(2)]
        for jm in self.jms:
            jm.start()
        return self

    def stop(self) -> None:
        for p in [*self.jms, *self.cms, self.driver]:
            p.stop()


@pytest.fixture(scope="module")
def pair(etcd: EtcdServer) -> Iterator[Pair]:
    p = Pair(etcd, f"/dlsched-scale-{uuid.uuid4().hex[:8]}/")
    try:
        yield p.start()
    finally:
        p.stop()


async def leader_of(pair: Pair) -> str | None:
    client = await etcd_kit.connect(pair.etcd.endpoint)
    try:
        kv = await client.get(f"{pair.prefix}leaders/cluster-manager".encode())
        return kv.value.decode() if kv is not None else None
    finally:
        await client.close()


async def wait_ready(cm: cm_grpc.ClusterManagerServiceStub, name: str, within: float = 30) -> None:
    deadline = time.monotonic() + within
    while (await cm.GetCluster(cm_pb.GetClusterRequest(name=name))).cluster.state != \
            cluster_pb2.CLUSTER_STATE_READY:
        assert time.monotonic() < deadline, f"{name} never READY"
        await asyncio.sleep(0.2)


async def create_local(pair: Pair, cm: cm_grpc.ClusterManagerServiceStub, cluster_id: str, *,
                       ready_on: cm_grpc.ClusterManagerServiceStub) -> None:
    """Register a local cluster through ``cm`` and wait until ``ready_on`` shows it READY."""
    await cm.CreateCluster(cm_pb.CreateClusterRequest(
        cluster_id=cluster_id, cluster=cluster_pb2.Cluster(type=job_pb2.CLUSTER_TYPE_LOCAL,
                                                           driver_address=pair.driver.address)))
    await wait_ready(ready_on, f"clusters/{cluster_id}")


class Watcher:
    """A WatchJobs stream on one JobManager, collecting states per job."""

    def __init__(self, stub: pb_grpc.JobManagerServiceStub) -> None:
        self.states: dict[str, list[int]] = {}
        self._call = stub.WatchJobs(pb.WatchJobsRequest())
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for ev in self._call:
            if ev.job.name:
                seen = self.states.setdefault(ev.job.name, [])
                if not seen or seen[-1] != ev.job.state:
                    seen.append(ev.job.state)

    async def until(self, name: str, state: int, within: float = 60) -> list[int]:
        deadline = time.monotonic() + within
        while state not in self.states.get(name, []):
            assert not self._task.done(), self._task
            assert time.monotonic() < deadline, (name, self.states.get(name))
            await asyncio.sleep(0.1)
        return self.states[name]

    def close(self) -> None:
        self._call.cancel()


@pytest.fixture
async def stubs(pair: Pair) -> AsyncIterator[tuple[list[pb_grpc.JobManagerServiceStub], list[grpc.aio.Channel]]]:
    chans = [security.channel(p.address) for p in [*pair.jms, *pair.cms]]
    try:
        yield [pb_grpc.JobManagerServiceStub(c) for c in chans[:2]], chans
    finally:
        for c in chans:
            await c.close()


def job_spec(cluster: str) -> job_pb2.JobSpec:
    spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[
        job_pb2.ReplicaGroup(role="main", replicas=1, command=["sh", "-c", "sleep 0.5; echo done"])])
    spec.cluster_selector.cluster = cluster
    return spec


async def test_a_frozen_cluster_manager_replica_costs_a_submit_one_attempt_not_its_deadline(
        pair: Pair, stubs) -> None:
    """One of two ClusterManagers SIGSTOPped: every other SubmitJob (the channel's round robin
    sent its MatchClusters there) waited JobManager's whole 15 s and failed UNAVAILABLE. An
    attempt without an answer is sent again, to the other replica: each submit succeeds
    within a deadline well under 15 s."""
    import signal

    jms, chans = stubs
    cms = [cm_grpc.ClusterManagerServiceStub(c) for c in chans[2:]]
    await create_local(pair, cms[0], "frozen-cm", ready_on=cms[0])
    for i in range(4):  # JobManager's channel to both replicas up (a replica frozen before it
        # was connected to is never in the rotation)
        await jms[0].SubmitJob(pb.SubmitJobRequest(
            job_id=f"fzw-{i}-{uuid.uuid4().hex[:6]}", spec=job_spec("clusters/frozen-cm")), timeout=30)
    leader = await leader_of(pair)
    assert leader is not None
    frozen = next(cm for cm in pair.cms if not leader.endswith("/" + cm.address))
    assert frozen.proc is not None
    frozen.proc.send_signal(signal.SIGSTOP)
    try:
        for i in range(6):
            await jms[0].SubmitJob(pb.SubmitJobRequest(
                job_id=f"fz-{i}-{uuid.uuid4().hex[:6]}", spec=job_spec("clusters/frozen-cm")), timeout=12)
    finally:
        frozen.proc.send_signal(signal.SIGCONT)


async def test_two_of_each_share_jobs_and_survive_the_cluster_manager_leader(pair: Pair, stubs) -> None:
    jms, chans = stubs
    cms = [cm_grpc.ClusterManagerServiceStub(c) for c in chans[2:]]
    await create_local(pair, cms[1], "local", ready_on=cms[0])

    watchers = [Watcher(jm) for jm in jms]
    try:
        # Submitted through one JobManager, watched through the other, and both agree.
        first = (await jms[0].SubmitJob(pb.SubmitJobRequest(job_id=f"so-{uuid.uuid4().hex[:6]}",
                                                            spec=job_spec("clusters/local")))).job
        seen_b = await watchers[1].until(first.name, job_pb2.JOB_STATE_SUCCEEDED)
        seen_a = await watchers[0].until(first.name, job_pb2.JOB_STATE_SUCCEEDED)
        assert seen_a == seen_b and seen_a[-1] == job_pb2.JOB_STATE_SUCCEEDED
        got = (await jms[1].GetJob(pb.GetJobRequest(name=first.name))).job
        assert got.state == job_pb2.JOB_STATE_SUCCEEDED
        # ... and its logs tail to the end through the other one too.
        lines = [e.text async for r in jms[1].StreamJobLogs(pb.StreamJobLogsRequest(name=first.name, follow=True))
                 for e in r.entries]
        assert lines == ["done"]

        # Exactly one ClusterManager leads; SIGKILL it.
        leader = await leader_of(pair)
        assert leader is not None
        dead = next(i for i, cm in enumerate(pair.cms) if leader.endswith("/" + cm.address))
        alive = 1 - dead
        pair.cms[dead].kill()

        deadline = time.monotonic() + TTL * 5
        while (now := await leader_of(pair)) is None or now == leader:
            assert time.monotonic() < deadline, f"no new leader after {TTL * 5}s (still {now})"
            await asyncio.sleep(0.2)
        assert now.endswith("/" + pair.cms[alive].address)

        # The new leader monitors: a cluster registered now becomes READY.
        await cms[alive].CreateCluster(cm_pb.CreateClusterRequest(
            cluster_id="local-two", cluster=cluster_pb2.Cluster(type=job_pb2.CLUSTER_TYPE_LOCAL,
                                                                driver_address=pair.driver.address)))
        await wait_ready(cms[alive], "clusters/local-two")

        # Job states keep flowing, through both JobManagers, to both watches.
        for jm, cluster in ((jms[1], "clusters/local-two"), (jms[0], "clusters/local")):
            job = (await jm.SubmitJob(pb.SubmitJobRequest(job_id=f"so-{uuid.uuid4().hex[:6]}",
                                                          spec=job_spec(cluster)), timeout=30)).job
            for w in watchers:
                states = await w.until(job.name, job_pb2.JOB_STATE_SUCCEEDED)
                assert job_pb2.JOB_STATE_RUNNING in states, states
    finally:
        for w in watchers:
            w.close()
