# ruff: noqa: ASYNC109  -- tests wait on real processes
"""The sole writer (issue 18 item 1): a JobManager alone proves its consistent
reads by a claim on the job store instead of an etcd round trip per read, and
no read it serves misses a write another process made.

Real etcd; the process test runs real JobManager replicas. The claim fences
every job write of every process (``JobStore._txn``); a replica holding it
serves reads only while etcd must still hold its lease (a replica frozen with
SIGSTOP or cut off stops serving before the key can expire and another
process write): the ownership test fails if the claim's validity outlives the
lease's TTL past its last refresh.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import pytest

from dlsched.errors import StoreUnavailable
from dlsched.kit.etcd import connect
from dlsched.v1 import job_manager_service_pb2 as pb
from dlsched.v1 import job_manager_service_pb2_grpc as pb_grpc
from dlsched.v1 import job_pb2
from job_manager.domain.errors import JobAlreadyExists
from job_manager.domain.model import Job, JobSpec, JobState, ReplicaGroup
from job_manager.sole_writer import SoleWriter, sole_clock
from job_manager.store import JobStore
from tests import security
from tests.harness import EtcdServer, ServiceProcess, Stack, metrics_samples, sample


def _job(i: int) -> Job:
    return Job(id=f"s{i}", uid=f"u{i}", state=JobState.PENDING, cluster="clusters/x",
               spec=JobSpec(run_mode=1, replica_groups=[ReplicaGroup(role="m", replicas=1,
                                                                     command=["true"])]))


async def _claim(store: JobStore) -> int:
    """Claim the key as the ownership round does (without a lease here)."""
    from aetcd import rpc

    sole = store.sole
    resp = await store.client.kvstub.Txn(rpc.TxnRequest(
        compare=[sole.compare(0)],
        success=[rpc.RequestOp(request_put=rpc.PutRequest(key=sole.key, value=sole.token))]),
        metadata=store.client.metadata)
    assert resp.succeeded
    sole.claimed(int(resp.header.revision), sole_clock() + 600)
    return int(resp.header.revision)


async def test_a_claim_fences_every_other_writer_until_it_is_released(
        etcd: EtcdServer, etcd_prefix: str) -> None:
    from job_manager.cache import JobCache
    from job_manager.watch import WatchHub

    client = await connect(etcd.endpoint)
    holder = JobStore(client, etcd_prefix, sole=SoleWriter(etcd_prefix, "a"))
    hub = WatchHub(client, etcd_prefix, cache=JobCache(), store=holder)
    hub.sole = holder.sole  # the holder's watch: it sees a waiting writer's join mark
    other = JobStore(client, etcd_prefix, fenced_wait=120)
    now = sole_clock
    try:
        await hub.start()
        claim = await _claim(holder)
        sole = holder.sole
        mine, created = await holder.create(_job(1))
        assert created
        # its own write counts: a cache behind it is not current, one at it is
        assert not sole.serves(now(), int(mine.etag) - 1)
        assert sole.serves(now(), int(mine.etag))
        assert not sole.serves(now(), claim - 1)

        # another process's write waits and posts the join mark; the holder's watch sees
        # it: the claim stops serving at once and is not taken again for a while
        waiting = asyncio.create_task(other.create(_job(2)))
        deadline = time.monotonic() + 60
        while sole.claim_revision:
            assert time.monotonic() < deadline, "the holder never heard the waiting writer"
            assert not waiting.done()
            await asyncio.sleep(0.02)
        assert await client.get(sole.join_key) is not None
        assert sole.cooling(now()) and sole.stale_revision == claim
        assert not sole.serves(now(), 10**9)
        assert await client.get(other.job_key("s2")) is None
        # its ownership round deletes the key (here by hand); the write goes through
        await holder.delete_claim(sole.stale_revision)
        theirs, created = await asyncio.wait_for(waiting, 60)
        assert created and int(theirs.etag) > int(mine.etag)

        # a writer that waits less than the claim lasts gets a clear UNAVAILABLE, writes nothing
        await _claim(holder)
        impatient = JobStore(client, etcd_prefix, fenced_wait=0.5)
        with pytest.raises(StoreUnavailable, match="sole-writer"):
            await impatient.create(_job(3))
        assert await client.get(impatient.job_key("s3")) is None
        # the holder's own compare failures still reach it as before
        with pytest.raises(JobAlreadyExists):
            await holder.create(_job(1))

        # its key gone behind its back (the lease ended): its next write stops the
        # claim's reads and goes through unfenced
        await client.delete(sole.key)
        await holder.create(_job(4))
        assert sole.claim_revision == 0 and not sole.serves(now(), 10**9)
        assert await client.get(holder.job_key("s4")) is not None
    finally:
        await hub.stop()
        await client.delete_prefix(etcd_prefix.encode())
        await client.close()


async def test_under_the_claim_a_job_the_cache_lacks_is_not_read_from_etcd(
        etcd: EtcdServer, etcd_prefix: str) -> None:
    """GetJob proved by the claim: a cache miss is NOT_FOUND (or the history's) without an etcd
    read; without the claim it reads etcd, as before."""
    from dlsched.auth.interceptor import _CALLER
    from dlsched.auth.model import Principal, Role
    from dlsched.errors import NotFound
    from job_manager.cache import JobCache
    from job_manager.servicer import JobManagerServicer
    from job_manager.watch import WatchHub

    client = await connect(etcd.endpoint)
    store = JobStore(client, etcd_prefix, sole=SoleWriter(etcd_prefix, "a"))
    hub = WatchHub(client, etcd_prefix, cache=JobCache(), store=store)
    hub.sole = store.sole
    reads: list[str] = []

    class _Counted(JobStore):
        async def get(self, job_id: str, *, within: float | None = None) -> Job:
            reads.append(job_id)
            return await super().get(job_id, within=within)

    class _Scheduler:
        pass

    sched = _Scheduler()
    sched.store = _Counted(client, etcd_prefix)  # type: ignore[attr-defined]
    servicer = JobManagerServicer(sched, hub)  # type: ignore[arg-type]
    _CALLER.set(Principal("admin", roles={"*": Role.ADMIN}))  # as the interceptor does
    try:
        await hub.start()
        with pytest.raises(NotFound):  # no claim: proved by etcd's revision, then etcd is read
            await servicer.GetJob(pb.GetJobRequest(name="jobs/missing"), None)  # type: ignore[arg-type]
        assert reads == ["missing"]
        await _claim(store)
        assert await hub.wait_current(within=30)  # the cache proved at the claim's revision
        with pytest.raises(NotFound) as missing:
            await servicer.GetJob(pb.GetJobRequest(name="jobs/missing"), None)  # type: ignore[arg-type]
        assert reads == ["missing"], "a miss proved by the claim read etcd"
        assert missing.value.metadata == {"name": "jobs/missing"}
    finally:
        await hub.stop()
        await client.delete_prefix(etcd_prefix.encode())
        await client.close()


def test_a_claim_serves_reads_only_until_its_lease_may_end() -> None:
    sole = SoleWriter("/p/")
    sole.claimed(10, until=100.0)
    assert sole.serves(99.9, 10) and not sole.serves(100.0, 10)
    sole.extend(200.0)
    assert sole.serves(150.0, 12)
    sole.drop()
    assert not sole.serves(150.0, 12) and sole.stale_revision == 10
    sole.extend(300.0)  # a refresh after the drop does not bring it back
    assert not sole.serves(250.0, 12)


# ------------------------------------------------------------ real replicas

def _spec() -> job_pb2.JobSpec:
    return job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[
        job_pb2.ReplicaGroup(role="main", replicas=1, command=["sleep", "300"])])


def _reads(svc: ServiceProcess, proof: str) -> float:
    return sample(metrics_samples(svc), "dlsched_job_manager_reads_total", proof=proof)


async def _until_sole(stub: pb_grpc.JobManagerServiceStub, svc: ServiceProcess, name: str) -> None:
    """Until a GetJob on ``svc`` is proved by its claim (it claims on an ownership round)."""
    deadline = time.monotonic() + 60
    while True:
        before = _reads(svc, "sole_writer")
        await stub.GetJob(pb.GetJobRequest(name=name), timeout=30)
        if _reads(svc, "sole_writer") > before:
            return
        assert time.monotonic() < deadline, "the lone replica never proved a read by its claim"
        await asyncio.sleep(0.2)


def _replica(etcd: EtcdServer, stack: Stack, name: str) -> ServiceProcess:
    return ServiceProcess("job_manager", [*etcd.service_args(), "--prefix", stack.prefix,
                                          "--cluster-manager", stack.cm.address,
                                          "--metrics-listen", "127.0.0.1:0"], name=name)


async def test_a_lone_replica_reads_without_etcd_and_a_joining_one_is_read_at_once(etcd: EtcdServer) -> None:
    stack = Stack(etcd, f"/dlsched-sole-{uuid.uuid4().hex[:8]}/", jm_args=["--metrics-listen", "127.0.0.1:0"])
    b: ServiceProcess | None = None
    try:
        await asyncio.to_thread(stack.start)
        await stack.register_local()
        assert stack.jm is not None
        async with security.channel(stack.jm.address) as ca:
            a = pb_grpc.JobManagerServiceStub(ca)
            first = (await a.SubmitJob(pb.SubmitJobRequest(spec=_spec()), timeout=60)).job
            await _until_sole(a, stack.jm, first.name)

            # alone: every write it answered is in its reads, proved by its claim
            sole = _reads(stack.jm, "sole_writer")
            for _ in range(3):
                made = (await a.SubmitJob(pb.SubmitJobRequest(spec=_spec()), timeout=60)).job
                got = (await a.GetJob(pb.GetJobRequest(name=made.name), timeout=30)).job
                assert int(got.etag) >= int(made.etag)
                stopped = (await a.StopJob(pb.StopJobRequest(name=made.name), timeout=60)).job
                listed = (await a.ListJobs(pb.ListJobsRequest(page_size=1000), timeout=30)).jobs
                row = next(j for j in listed if j.name == made.name)
                assert int(row.etag) >= int(stopped.etag)
            # (a launch or stop the replica writes in the background may make a read wait for
            # etcd until its cache shows that write: most, not all, are proved by the claim)
            assert _reads(stack.jm, "sole_writer") > sole

            # a job the proved cache lacks is NOT_FOUND without an etcd read (none is in etcd)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                sole = _reads(stack.jm, "sole_writer")
                with pytest.raises(grpc.aio.AioRpcError) as missing:
                    await a.GetJob(pb.GetJobRequest(name="jobs/never-submitted"), timeout=30)
                assert missing.value.code() is grpc.StatusCode.NOT_FOUND
                if _reads(stack.jm, "sole_writer") == sole + 1:
                    break
                await asyncio.sleep(0.2)  # a background write the cache has not shown yet
            else:
                raise AssertionError("no GetJob of a missing job was proved by the claim")

            # a second replica: its first write waits for A's release, and A reads it at once
            b = await asyncio.to_thread(_replica(etcd, stack, "job-manager-b").start)
            async with security.channel(b.address) as cb:
                bstub = pb_grpc.JobManagerServiceStub(cb)
                theirs = (await bstub.SubmitJob(pb.SubmitJobRequest(spec=_spec()), timeout=60)).job
                got = (await a.GetJob(pb.GetJobRequest(name=theirs.name), timeout=30)).job
                assert int(got.etag) >= int(theirs.etag)
                before = _reads(stack.jm, "consistent")
                got = (await a.GetJob(pb.GetJobRequest(name=theirs.name), timeout=30)).job
                assert _reads(stack.jm, "consistent") == before + 1  # A proves its reads by etcd again
    finally:
        if b is not None:
            await asyncio.to_thread(b.stop)
        await asyncio.to_thread(stack.stop)


async def test_the_claim_serves_reads_no_longer_than_etcd_must_keep_its_lease(
        etcd: EtcdServer, etcd_prefix: str) -> None:
    """The ownership rounds claim the key while the replica is alone, and each lease refresh
    lets the claim serve reads at most ``VALID_FRACTION`` of the TTL past the refresh's send
    time: etcd keeps the key a whole TTL past it, so a replica frozen (SIGSTOP) or cut off
    stops serving before the key can expire and another process write. Another member
    appears: the claim stops serving and its key is deleted."""
    from job_manager.cache import JobCache
    from job_manager.ownership import ClusterOwnership
    from job_manager.watch import WatchHub

    class _Tracker:
        async def take_over(self, cluster: str) -> None: ...
        async def release(self, cluster: str) -> None: ...
        def on_job(self, job: Job) -> None: ...

    client = await connect(etcd.endpoint)
    sole = SoleWriter(etcd_prefix, "a")
    store = JobStore(client, etcd_prefix, sole=sole)
    hub = WatchHub(client, etcd_prefix, cache=JobCache(), store=store)
    hub.sole = sole
    own = ClusterOwnership(client, store, hub, identity="a", ttl=3, prefix=etcd_prefix, cache=hub.cache)
    try:
        await hub.start()
        own.start(_Tracker())
        deadline = time.monotonic() + 60
        while not sole.claim_revision:
            assert time.monotonic() < deadline, "the lone replica never claimed"
            await asyncio.sleep(0.05)
        kv = await client.get(sole.key)
        assert kv is not None and kv.value == sole.token and int(kv.lease) != 0  # bound to a lease
        seen = 0
        for _ in range(30):  # over several refreshes
            now = sole_clock()
            if sole.claim_revision:
                # at most 3/4 of the TTL (3 s) past a refresh sent before now
                assert sole._until - now <= 2.25
                seen += 1
            await asyncio.sleep(0.1)
        assert seen > 0
        await store.create(_job(1))
        deadline = time.monotonic() + 60
        while not sole.served:  # a read proved by the claim, once the cache shows the write
            assert await hub.wait_current(within=30)
            assert time.monotonic() < deadline, "no read was proved by the claim"
            await asyncio.sleep(0.05)

        # another replica joins: the claim stops serving and its key goes
        lease = await client.lease(10)
        await client.put(own.member_key("b"), b"", lease=lease)
        deadline = time.monotonic() + 60
        while sole.claim_revision or await client.get(sole.key) is not None:
            assert time.monotonic() < deadline, "the claim was kept beside another member"
            await asyncio.sleep(0.05)
        await lease.revoke()
    finally:
        await own.close()
        await hub.stop()
        await client.delete_prefix(etcd_prefix.encode())
        await client.close()
