# ruff: noqa: ASYNC109, ASYNC110  -- polling etcd and /metrics in tests
"""One owner per cluster among JobManager replicas (job_manager/ownership.py).

Real etcd, one ClusterManager, two local drivers (one cluster each, plus a
third cluster on the first driver for the partition test) and three
JobManagers with a 2 s ownership lease, all separate processes. Jobs are
submitted through replicas that do not own their cluster (the store is the
hand-off), and each job's command appends to a marker file, so a job run
twice shows.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
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
from job_manager.ownership import rendezvous
from tests import security
from tests.harness import EtcdServer, ServiceProcess, sample
from tests.harness import metrics_samples as scrape

TTL = 2
S = job_pb2


class System:
    def __init__(self, etcd: EtcdServer) -> None:
        self.etcd = etcd
        self.prefix = f"/dlsched-own-{uuid.uuid4().hex[:8]}/"
        self.markers = pathlib.Path(tempfile.mkdtemp(prefix="dlsched-own-markers-"))
        self.drivers = [ServiceProcess("drivers.local", [
            "--state-dir", tempfile.mkdtemp(prefix="dlsched-local-"), "--grace-seconds", "2",
            "--metrics-listen", "127.0.0.1:0"], name=f"own-driver-{i}") for i in range(2)]
        self.cm = ServiceProcess("cluster_manager", [*etcd.service_args(), "--prefix", self.prefix,
                                                     "--monitor-interval", "0.5"], name="own-cm")
        self.jms: dict[str, ServiceProcess] = {}

    def jm(self, rid: str) -> ServiceProcess:
        return ServiceProcess("job_manager", [
            *self.etcd.service_args(), "--prefix", self.prefix, "--cluster-manager", self.cm.address,
            "--owner-ttl", str(TTL), "--replica-id", rid, "--metrics-listen", "127.0.0.1:0"],
            name=f"own-{rid}")

    def start(self) -> System:
        for d in self.drivers:
            d.start()
        self.cm.start()
        for rid in ("jm-a", "jm-b", "jm-c"):
            self.jms[rid] = self.jm(rid).start()
        return self

    def stop(self) -> None:
        for p in [*self.jms.values(), self.cm, *self.drivers]:
            if p.proc is not None and p.proc.poll() is None:
                os.kill(p.proc.pid, signal.SIGCONT)
            p.stop()

    def alive(self) -> dict[str, ServiceProcess]:
        return {rid: p for rid, p in self.jms.items() if p.proc is not None and p.proc.poll() is None}

    async def etcd_get(self, key: str) -> str | None:
        client = await etcd_kit.connect(self.etcd.endpoint)
        try:
            kv = await client.get((self.prefix + key).encode())
            return kv.value.decode() if kv is not None else None
        finally:
            await client.close()

    async def members(self) -> list[str]:
        client = await etcd_kit.connect(self.etcd.endpoint)
        try:
            p = (self.prefix + "job-managers/").encode()
            return sorted(kv.key[len(p):].decode() for kv in await client.get_prefix(p, keys_only=True))
        finally:
            await client.close()

    async def owner(self, cluster: str) -> str | None:
        return await self.etcd_get(f"cluster-owners/{cluster}")

    async def settled_owner(self, cluster: str, within: float = 30) -> str:
        """The owner, once it is the one rendezvous hashing picks among the live replicas."""
        deadline = time.monotonic() + within
        while True:
            members = await self.members()
            owner = await self.owner(cluster)
            if owner is not None and sorted(members) == sorted(self.alive()) and \
                    owner == rendezvous(cluster, members):
                return owner
            assert time.monotonic() < deadline, (cluster, owner, members)
            await asyncio.sleep(0.2)

    def spec(self, cluster: str, tag: str, seconds: float) -> job_pb2.JobSpec:
        marker = self.markers / tag
        spec = job_pb2.JobSpec(run_mode=S.RUN_MODE_SINGLE_PROCESS, replica_groups=[job_pb2.ReplicaGroup(
            role="main", replicas=1, command=["sh", "-c", f"echo run >> {marker}; sleep {seconds}"])])
        spec.cluster_selector.cluster = cluster
        return spec

    def runs(self, tag: str) -> int:
        p = self.markers / tag
        return len(p.read_text().splitlines()) if p.exists() else 0


@pytest.fixture(scope="module")
def system(etcd: EtcdServer) -> Iterator[System]:
    s = System(etcd)
    try:
        yield s.start()
    finally:
        s.stop()


@pytest.fixture
async def api(system: System) -> AsyncIterator[dict[str, pb_grpc.JobManagerServiceStub]]:
    for rid, p in system.jms.items():  # a test that killed one left it dead
        if p.proc is None or p.proc.poll() is not None:
            system.jms[rid] = p.start()
    chans: list[grpc.aio.Channel] = []
    stubs = {}
    for rid, p in system.jms.items():
        chans.append(security.channel(p.address))
        stubs[rid] = pb_grpc.JobManagerServiceStub(chans[-1])
    cm_chan = security.channel(system.cm.address)
    cm = cm_grpc.ClusterManagerServiceStub(cm_chan)
    for cid, drv in (("one", 0), ("two", 1), ("part", 0)):
        await cm.CreateCluster(cm_pb.CreateClusterRequest(
            cluster_id=cid, request_id=f"reg-{cid}", cluster=cluster_pb2.Cluster(
                type=S.CLUSTER_TYPE_LOCAL, driver_address=system.drivers[drv].address)))
    deadline = time.monotonic() + 30
    for cid in ("one", "two", "part"):
        while (await cm.GetCluster(cm_pb.GetClusterRequest(name=f"clusters/{cid}"))).cluster.state != \
                cluster_pb2.CLUSTER_STATE_READY:
            assert time.monotonic() < deadline, f"clusters/{cid} never READY"
            await asyncio.sleep(0.2)
    while await system.members() != sorted(system.alive()):
        assert time.monotonic() < deadline, (await system.members(), sorted(system.alive()))
        await asyncio.sleep(0.2)
    try:
        yield stubs
    finally:
        for c in [*chans, cm_chan]:
            await c.close()


class Recorder:
    """Every CREATED/UPDATED event of a WatchJobs stream: one per etcd write of a job,
    as (state, launched)."""

    def __init__(self, stub: pb_grpc.JobManagerServiceStub) -> None:
        self.writes: dict[str, list[tuple[int, bool]]] = {}
        self._call = stub.WatchJobs(pb.WatchJobsRequest())
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for ev in self._call:
            if ev.type in (S.WATCH_EVENT_TYPE_CREATED, S.WATCH_EVENT_TYPE_UPDATED):
                self.writes.setdefault(ev.job.name, []).append((ev.job.state, bool(ev.job.backend_job_id)))

    def states(self, name: str) -> list[int]:
        return [state for state, _ in self.writes.get(name, [])]

    async def until_all(self, names: list[str], state: int, within: float) -> None:
        deadline = time.monotonic() + within
        while True:
            left = [n for n in names if state not in self.states(n)]
            if not left:
                return
            assert not self._task.done(), self._task
            assert time.monotonic() < deadline, {n: self.states(n) for n in left[:5]}
            await asyncio.sleep(0.2)

    def close(self) -> None:
        self._call.cancel()


def assert_one_write_per_transition(rec: Recorder, names: list[str]) -> None:
    """Each write a transition (the launch record counts: PENDING -> PENDING launched)."""
    for n in names:
        states, writes = rec.states(n), rec.writes.get(n, [])
        assert states and states[-1] == S.JOB_STATE_SUCCEEDED, (n, states)
        assert S.JOB_STATE_RUNNING in states, (n, states)
        repeats = [a for a, b in zip(writes, writes[1:], strict=False) if a == b]
        assert not repeats, f"{n}: a transition written twice: {writes}"
        assert sum(1 for s, launched in writes if launched and s == S.JOB_STATE_SUCCEEDED) == 1, writes


async def submit_all(system: System, via: pb_grpc.JobManagerServiceStub, cluster: str, n: int,
                     seconds: float, tag: str) -> list[str]:
    async def one(i: int) -> str:
        jid = f"{tag}-{i}"
        job = (await via.SubmitJob(pb.SubmitJobRequest(
            job_id=jid, request_id=jid, spec=system.spec(cluster, jid, seconds)), timeout=60)).job
        return job.name
    return list(await asyncio.gather(*(one(i) for i in range(n))))


def streams(driver: ServiceProcess) -> float:
    return sample(scrape(driver), "dlsched_rpc_streams_active", method="WatchJobObservations")


async def until_streams(driver: ServiceProcess, want: float, within: float = 20) -> None:
    deadline = time.monotonic() + within
    while (got := streams(driver)) != want:
        assert time.monotonic() < deadline, f"{driver.name}: {got} WatchJobObservations streams, want {want}"
        await asyncio.sleep(0.2)


async def test_one_stream_per_cluster_and_one_write_per_transition(system: System, api) -> None:
    rec = Recorder(api["jm-a"])
    try:
        names = []
        for cluster in ("clusters/one", "clusters/two"):
            for rid, stub in api.items():  # through every replica, owner or not
                names += await submit_all(system, stub, cluster, 2, 1, f"w-{cluster[9:]}-{rid}")
        await rec.until_all(names, S.JOB_STATE_SUCCEEDED, 90)
        assert_one_write_per_transition(rec, names)
        for n in names:
            assert system.runs(n.split("/", 1)[1]) == 1, n

        owners = {c: await system.settled_owner(c) for c in ("clusters/one", "clusters/two")}
        # The admin view: ClusterManager says which replica tracks each cluster, and so does the CLI.
        async with security.channel(system.cm.address) as ch:
            cm = cm_grpc.ClusterManagerServiceStub(ch)
            for cluster, owner in owners.items():
                got = (await cm.GetCluster(cm_pb.GetClusterRequest(name=cluster), timeout=10)).cluster
                assert got.tracking_replica == owner, (cluster, got.tracking_replica)
            listed = (await cm.ListClusters(cm_pb.ListClustersRequest(), timeout=10)).clusters
            assert {c.name: c.tracking_replica for c in listed if c.name in owners} == owners
        cli = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "dlsched", "cluster", "get", "one",
                                                       "--cluster-manager", system.cm.address, "-o", "yaml"],
                                      capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0 and owners["clusters/one"] in cli.stdout, cli.stderr
        for d in system.drivers:
            await until_streams(d, 1)  # exactly one replica watches each cluster
        per_replica = {rid: scrape(p) for rid, p in system.jms.items()}
        for cluster, owner in owners.items():
            for rid, m in per_replica.items():
                owned = sample(m, "dlsched_job_manager_cluster_owned", cluster=cluster)
                writes = sample(m, "dlsched_job_manager_tracking_writes_total", cluster=cluster,
                                result="applied")
                assert owned == (1.0 if rid == owner else 0.0), (rid, cluster)
                assert (writes > 0) == (rid == owner), (rid, cluster, writes)
        for rid, m in per_replica.items():  # no lost CAS race, nothing refused
            assert sample(m, "dlsched_job_manager_tracking_writes_total", result="conflict") == 0, rid
            assert sample(m, "dlsched_job_manager_tracking_writes_total", result="fenced") == 0, rid
    finally:
        rec.close()


async def test_sigkill_of_the_owner_hands_over_within_the_ttl(system: System, api) -> None:
    cluster = "clusters/one"
    owner = await system.settled_owner(cluster)
    via = next(rid for rid in api if rid != owner)
    rec = Recorder(api[via])
    try:
        names = await submit_all(system, api[via], cluster, 50, 10, f"k{uuid.uuid4().hex[:4]}")
        await rec.until_all(names, S.JOB_STATE_RUNNING, 120)
        system.jms[owner].kill()
        killed = time.monotonic()
        while (now := await system.owner(cluster)) in (None, owner):
            assert time.monotonic() - killed < TTL * 4, f"no new owner of {cluster} (still {now})"
            await asyncio.sleep(0.1)
        took = time.monotonic() - killed
        assert took < TTL * 4, took
        await rec.until_all(names, S.JOB_STATE_SUCCEEDED, 120)
        assert_one_write_per_transition(rec, names)
        for n in names:
            assert system.runs(n.split("/", 1)[1]) == 1, f"{n} launched twice"
            job = (await api[via].GetJob(pb.GetJobRequest(name=n))).job
            assert job.attempt == 1 and job.state == S.JOB_STATE_SUCCEEDED, job
        await until_streams(system.drivers[0], 1)
    finally:
        rec.close()


async def test_a_joining_replica_takes_over_without_a_gap(system: System, api) -> None:
    cluster = "clusters/two"
    rec = Recorder(api["jm-a"])
    await rec.until_all(await submit_all(system, api["jm-b"], cluster, 1, 0.1, f"q{uuid.uuid4().hex[:4]}"),
                        S.JOB_STATE_SUCCEEDED, 60)
    rec.close()
    old = await system.settled_owner(cluster)
    members = await system.members()
    rid = next(f"jm-d{i}" for i in range(100) if rendezvous(cluster, [*members, f"jm-d{i}"]) == f"jm-d{i}")
    rec = Recorder(api["jm-a"] if old != "jm-a" else api["jm-b"])
    try:
        tag = f"j{uuid.uuid4().hex[:4]}"
        # Jobs that start before the join and end after it, some during the hand-over.
        names = await submit_all(system, api[old], cluster, 12, 15, tag)
        await rec.until_all(names, S.JOB_STATE_RUNNING, 60)
        system.jms[rid] = system.jm(rid).start()
        deadline = time.monotonic() + TTL * 10
        free_for = 0.0
        while (now := await system.owner(cluster)) != rid:
            t0 = time.monotonic()
            await asyncio.sleep(0.05)
            if now is None:
                free_for += time.monotonic() - t0
            assert time.monotonic() < deadline, f"{rid} never took {cluster} (owner {now})"
        assert free_for < TTL, f"{cluster} had no owner for {free_for:.1f}s"
        late = await submit_all(system, api[old], cluster, 3, 1, tag + "-late")
        await rec.until_all(names + late, S.JOB_STATE_SUCCEEDED, 90)
        assert_one_write_per_transition(rec, names + late)
        for n in names + late:
            assert system.runs(n.split("/", 1)[1]) == 1, n
        await until_streams(system.drivers[1], 1)
        assert sample(scrape(system.jms[rid]), "dlsched_job_manager_cluster_owned", cluster=cluster) == 1
        m_old = scrape(system.jms[old])
        assert sample(m_old, "dlsched_job_manager_cluster_owned", cluster=cluster) == 0
        assert sample(m_old, "dlsched_job_manager_ownership_changes_total", cluster=cluster,
                      change="released") >= 1
    finally:
        rec.close()
        system.jms.pop(rid).stop()


async def test_a_partitioned_owner_writes_nothing_after_losing_ownership(system: System, api) -> None:
    cluster = "clusters/part"  # a cluster only this test uses: one epoch per owner
    rec = Recorder(api["jm-a"])
    probe = await submit_all(system, api["jm-a"], cluster, 1, 0.1, f"p{uuid.uuid4().hex[:4]}")
    await rec.until_all(probe, S.JOB_STATE_SUCCEEDED, 60)
    owner = await system.settled_owner(cluster)
    via = next(rid for rid in api if rid != owner)
    rec.close()
    rec = Recorder(api[via])
    proc = system.jms[owner].proc
    assert proc is not None
    stopped = False
    try:
        tag = f"s{uuid.uuid4().hex[:4]}"
        names = await submit_all(system, api[via], cluster, 6, TTL * 3, tag)
        await rec.until_all(names, S.JOB_STATE_RUNNING, 60)
        applied_before = sample(scrape(system.jms[owner]), "dlsched_job_manager_tracking_writes_total",
                                cluster=cluster, result="applied")
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = True
        deadline = time.monotonic() + TTL * 6
        while await system.owner(cluster) in (None, owner):
            assert time.monotonic() < deadline, f"no owner took {cluster} from the stopped {owner}"
            await asyncio.sleep(0.1)
        await rec.until_all(names, S.JOB_STATE_SUCCEEDED, 60)  # ended while the old owner slept
        os.kill(proc.pid, signal.SIGCONT)
        stopped = False
        # The woken replica finds its lease gone: it logs what it wrote under that epoch.
        deadline = time.monotonic() + 30
        line = ""
        while not line:
            line = next((ln for ln in system.jms[owner].log().splitlines()
                         if f"no longer owns {cluster} (lost;" in ln), "")
            assert time.monotonic() < deadline, system.jms[owner].log()[-3000:]
            await asyncio.sleep(0.2)
        applied = int(line.split("writes applied")[0].rsplit(":", 1)[1])
        assert applied == applied_before, line  # nothing after SIGSTOP: nothing once the key was gone
        assert_one_write_per_transition(rec, names)
        deadline = time.monotonic() + 30
        while owner not in await system.members():  # it rejoined, under a new lease
            assert time.monotonic() < deadline, system.jms[owner].log()[-3000:]
            await asyncio.sleep(0.2)
    finally:
        if stopped:
            os.kill(proc.pid, signal.SIGCONT)
        rec.close()


async def test_a_slurm_cluster_is_tracked_by_one_replica_too(system: System, api) -> None:
    """The real Slurm behind its driver: three JobManagers, jobs submitted through every replica;
    the Slurm driver serves exactly one WatchJobObservations stream, every job runs once, only the
    owner writes and no write loses a race or is fenced. (Slurm's QUEUED changes its reason as the
    queue moves - Submitted, then Slurm's own - so a state may be written more than once here.)"""
    import importlib.util

    from tests import slurm_cluster

    if importlib.util.find_spec("asyncssh") is None or (why := slurm_cluster.available()):
        pytest.skip("no Slurm here" if importlib.util.find_spec("asyncssh") is None else why)
    backend = await asyncio.to_thread(slurm_cluster.SlurmCluster().start)
    driver = ServiceProcess("drivers.slurm", ["--poll-interval", "0.5", "--metrics-listen", "127.0.0.1:0"],
                            name="own-slurm-driver")
    rec = Recorder(api["jm-b"])
    try:
        await asyncio.to_thread(driver.start)
        async with security.channel(system.cm.address) as ch:
            cm = cm_grpc.ClusterManagerServiceStub(ch)
            await cm.CreateCluster(cm_pb.CreateClusterRequest(
                cluster_id="slurm", request_id="reg-slurm", cluster=cluster_pb2.Cluster(
                    type=S.CLUSTER_TYPE_SLURM, driver_address=driver.address, address=backend.address,
                    options=backend.options(),
                    credentials=cluster_pb2.ClusterCredentials(ssh=cluster_pb2.SshCredentials(
                        username=backend.user, private_key=backend.user_key,
                        known_host_keys=[backend.host_key_pub])))))
            deadline = time.monotonic() + 60
            while (await cm.GetCluster(cm_pb.GetClusterRequest(name="clusters/slurm"))).cluster.state != \
                    cluster_pb2.CLUSTER_STATE_READY:
                assert time.monotonic() < deadline, "clusters/slurm never READY"
                await asyncio.sleep(0.3)
        names = []
        for rid, stub in api.items():
            names += await submit_all(system, stub, "clusters/slurm", 2, 1, f"s-{rid}")
        await rec.until_all(names, S.JOB_STATE_SUCCEEDED, 120)
        for n in names:
            assert system.runs(n.split("/", 1)[1]) == 1, n
            states = rec.states(n)
            assert states == sorted(states) and states[-1] == S.JOB_STATE_SUCCEEDED, (n, states)
        owner = await system.settled_owner("clusters/slurm")
        await until_streams(driver, 1)
        for rid, p in system.alive().items():
            writes = sample(scrape(p), "dlsched_job_manager_tracking_writes_total", cluster="clusters/slurm",
                            result="applied")
            assert (writes > 0) == (rid == owner), (rid, writes)
            for result in ("conflict", "fenced"):
                assert sample(scrape(p), "dlsched_job_manager_tracking_writes_total", cluster="clusters/slurm",
                              result=result) == 0, (rid, result)
    finally:
        rec.close()
        driver.stop()
        await asyncio.to_thread(backend.stop)
