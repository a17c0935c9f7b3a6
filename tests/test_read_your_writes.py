# ruff: noqa: ASYNC109  -- tests wait on real processes
"""Read-your-writes across JobManager replicas (issue 18 item 1).

A client that got an answer from SubmitJob or StopJob on replica A sees that
write in GetJob and ListJobs on replica B, although B serves both from its
watch cache: B reads etcd's current revision and waits until its watch has
shown it, proved by an etcd progress notification when the revision moved
through keys that bring no job event (``WatchHub.wait_current``).

Real etcd, real processes. B reaches etcd through ``FreezingProxy``, a TCP
proxy that can hold back what etcd sends to B: while it does, B's watch lags
(as a replica's watch does under load, only longer); B's read of the
revision is held back with it, and arrives after the events etcd sent
before it. Without the consistent read, B answers from its stale cache at
once and the test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import aetcd
import pytest

from dlsched.errors import InvalidArgument
from dlsched.kit.etcd import EtcdClient, connect
from dlsched.v1 import job_manager_service_pb2 as pb
from dlsched.v1 import job_manager_service_pb2_grpc as pb_grpc
from dlsched.v1 import job_pb2
from job_manager.cache import JobCache
from job_manager.convert import job_to_bytes
from job_manager.domain.model import Job, JobSpec, JobState, ReplicaGroup
from job_manager.store import JobStore
from job_manager.watch import Freshness, WatchHub, _SharedRead
from tests import security
from tests.harness import EtcdServer, ServiceProcess, Stack

# ------------------------------------------------------------ the hub against a real etcd

def _job(i: int) -> Job:
    return Job(id=f"r{i}", uid=f"u{i}", state=JobState.PENDING, cluster="clusters/x",
               spec=JobSpec(run_mode=1, replica_groups=[ReplicaGroup(role="m", replicas=1,
                                                                     command=["true"])]))


async def _moved_on(client: aetcd.Client, prefix: str, store: JobStore, hub: WatchHub) -> int:
    """A job written and seen by the hub, then writes to other keys: etcd's
    revision, past the last job event."""
    assert hub.cache is not None
    await client.put(f"{prefix}jobs/r1".encode(), job_to_bytes(_job(1)))
    deadline = time.monotonic() + 20
    while hub.cache.get("r1") is None:  # the watch is past its replay and keeps up
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    for i in range(5):  # keys outside jobs/: no job event, a higher revision
        await client.put(f"{prefix}other/{i}".encode(), b"x")
    now = await store.revision()
    assert hub.cache.revision < now
    return now


async def test_progress_notification_proves_the_cache_current(etcd: EtcdServer,
                                                              etcd_prefix: str) -> None:
    """etcd's revision moved past the last job event (other keys): the hub
    proves its cache current with a progress notification, writing nothing.
    (Forced on: the etcd here predates 3.5.13, where progress answers are
    ordered after the events they cover; the watch keeps up, so none is queued.)"""
    client = await connect(etcd.endpoint)
    assert isinstance(client, EtcdClient)
    store = JobStore(client, etcd_prefix)
    hub = WatchHub(client, etcd_prefix, cache=JobCache(), store=store, progress=True)
    try:
        await hub.start()
        assert hub.cache is not None and hub.proves_by_progress
        now = await _moved_on(client, etcd_prefix, store, hub)
        assert await hub.wait_current(within=20)
        assert hub.cache.synced >= now  # proved by progress, not by an event
        assert hub.progress_answers >= 1 and hub.sync_writes == 0
        # Quiet: the next read needs no new answer once the cache is at etcd's revision.
        answers = hub.progress_answers
        assert await hub.wait_current(within=20)
        assert hub.progress_answers == answers
        assert hub.stale_reads == 0
    finally:
        await hub.stop()
        await client.delete_prefix(etcd_prefix.encode())
        await client.close()


@pytest.mark.parametrize("plain", [False, True], ids=["etcd-version", "plain-aetcd"])
async def test_sync_write_proves_the_cache_current(etcd: EtcdServer, etcd_prefix: str,
                                                   plain: bool) -> None:
    """Where progress answers are not ordered (this etcd, by its version) or
    cannot be asked for (a plain aetcd client): one write of the sync key,
    whose event proves the cache current; none while it stays current."""
    client = (aetcd.Client(host="127.0.0.1", port=etcd.client_port) if plain
              else await connect(etcd.endpoint))
    store = JobStore(client, etcd_prefix)
    hub = WatchHub(client, etcd_prefix, cache=JobCache(), store=store)
    try:
        await hub.start()
        assert hub.cache is not None and not hub.proves_by_progress
        now = await _moved_on(client, etcd_prefix, store, hub)
        results = await asyncio.gather(*(hub.wait_current(within=20) for _ in range(20)))
        assert all(results)
        assert hub.cache.synced > now
        assert 1 <= hub.sync_writes <= 2  # shared by the reads waiting together
        writes = hub.sync_writes
        assert await hub.wait_current(within=20)
        assert hub.sync_writes == writes  # etcd did not move: nothing to prove
        # The sync key is no job: not in the cache, not an event.
        assert len(hub.cache) == 1 and hub.cache.get("r1") is not None
        assert hub.stale_reads == 0
    finally:
        await hub.stop()
        await client.delete_prefix(etcd_prefix.encode())
        await client.close()


# ------------------------------------------------------------ two JobManager processes

class FreezingProxy:
    """A TCP proxy to etcd whose etcd→client direction can be held back (``freeze``)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._open = asyncio.Event()
        self._open.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> FreezingProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for t in list(self._tasks):
            t.cancel()

    def freeze(self) -> None:
        self._open.clear()

    def thaw(self) -> None:
        self._open.set()

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        er, ew = await asyncio.open_connection("127.0.0.1", self.target_port)
        up = asyncio.create_task(self._pipe(cr, ew, gated=False))
        down = asyncio.create_task(self._pipe(er, cw, gated=True))
        self._tasks |= {up, down}
        await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        for t in (up, down):
            t.cancel()
        for w in (cw, ew):
            w.close()

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, *, gated: bool) -> None:
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while data := await r.read(65536):
                if gated:
                    await self._open.wait()
                w.write(data)
                await w.drain()


class Replicas:
    def __init__(self, etcd: EtcdServer, prefix: str, b_etcd_port: int) -> None:
        self.stack = Stack(etcd, prefix)
        self.b_port = b_etcd_port
        self.b: ServiceProcess | None = None

    def start(self) -> Replicas:
        self.stack.start()
        self.b = ServiceProcess("job_manager", ["--etcd", f"127.0.0.1:{self.b_port}", "--prefix",
                                                self.stack.prefix, "--cluster-manager",
                                                self.stack.cm.address, "--metrics-listen", "127.0.0.1:0"],
                                   name="job-manager-b")
        self.b.start()
        return self

    def stop(self) -> None:
        if self.b is not None:
            self.b.stop()
        self.stack.stop()


async def test_a_read_etcd_does_not_answer_says_how(etcd: EtcdServer, etcd_prefix: str) -> None:
    """etcd gives no revision in time (frozen): the read ends NO_ANSWER (GetJob
    then reads etcd briefly); once etcd answers, reads are proved; etcd gone
    (connections refused): UNREACHABLE (GetJob answers from the cache)."""
    proxy: FreezingProxy | None = FreezingProxy(etcd.client_port)
    assert proxy is not None
    await proxy.__aenter__()
    client = await connect(f"127.0.0.1:{proxy.port}")
    store = JobStore(client, etcd_prefix)
    hub = WatchHub(client, etcd_prefix, cache=JobCache(), store=store)
    try:
        await hub.start()
        assert await hub.read_current(within=20) is Freshness.CURRENT
        with frozen(proxy):
            assert await hub.read_current(within=1) is Freshness.NO_ANSWER
            assert not await hub.wait_current(within=1)
        assert await hub.read_current(within=20) is Freshness.CURRENT
        await proxy.__aexit__(None, None, None)  # its port closed, its connections cut
        proxy = None
        deadline = time.monotonic() + 60
        while (got := await hub.read_current(within=1)) is not Freshness.UNREACHABLE:
            assert time.monotonic() < deadline, got  # the cut is noticed, then refused
            await asyncio.sleep(0.2)
    finally:
        await hub.stop()
        await client.close()
        if proxy is not None:
            await proxy.__aexit__(None, None, None)


async def test_min_etag_is_proved_also_without_consistent_reads(etcd: EtcdServer, etcd_prefix: str) -> None:
    """``--no-consistent-reads`` serves the cache as it is, but a read that asks for ``min_etag``
    still gets that write or later: a cache behind it is proved by etcd, never taken for proof
    that the etag was never issued (INVALID_ARGUMENT), nor served older (UNAVAILABLE while
    etcd cannot prove it)."""
    from dlsched.errors import StoreUnavailable
    from job_manager.servicer import JobManagerServicer

    proxy = FreezingProxy(etcd.client_port)
    await proxy.__aenter__()
    client = await connect(f"127.0.0.1:{proxy.port}")
    other = await connect(etcd.endpoint)
    store = JobStore(client, etcd_prefix)
    hub = WatchHub(client, etcd_prefix, cache=JobCache(), store=store, consistent_reads=False)

    class _Scheduler:
        store = JobStore(client, etcd_prefix)

    servicer = JobManagerServicer(_Scheduler(), hub)  # type: ignore[arg-type]
    try:
        await hub.start()
        assert hub.cache is not None
        with frozen(proxy):  # the hub hears nothing: its cache lags the write below
            put = await other.put(f"{etcd_prefix}jobs/r9".encode(), job_to_bytes(_job(9)))
            rev = int(put.header.revision)
            assert hub.cache.current < rev
            with pytest.raises(StoreUnavailable):  # etcd does not answer: not served older than asked
                await servicer.ListJobs(pb.ListJobsRequest(min_etag=str(rev)), None)  # type: ignore[arg-type]
            thaw = asyncio.create_task(_thaw_later(proxy, 0.5))
            assert await servicer._freshness(str(rev)) is Freshness.CURRENT
            await thaw
        assert hub.cache.current >= rev and hub.cache.get("r9") is not None
        with pytest.raises(InvalidArgument):
            await servicer._freshness(str(rev + 1000))  # etcd proved: no such write yet
    finally:
        await hub.stop()
        await client.delete_prefix(etcd_prefix.encode())
        await client.close()
        await other.close()
        await proxy.__aexit__(None, None, None)


@pytest.mark.parametrize("how", ["etcd-cancels", "silent"])
async def test_a_watch_that_ends_or_delivers_nothing_is_opened_again(etcd: EtcdServer, etcd_prefix: str,
                                                                     how: str) -> None:
    """etcd cancels the hub's watch: the hub hears it and watches again. A
    watch that delivers nothing without a word (here: its callback dropped on
    the client) would leave the cache behind for good: a consistent read that
    finds etcd's revision still unreached after ``stall_seconds`` reopens it."""
    client = await connect(etcd.endpoint)
    assert isinstance(client, EtcdClient)
    store = JobStore(client, etcd_prefix)
    silent = how == "silent"
    hub = WatchHub(client, etcd_prefix, cache=JobCache(), store=store, progress=True,
                   stall_seconds=1.0 if silent else 3600.0)
    try:
        await hub.start()
        assert hub.cache is not None
        watcher = client._watcher  # noqa: SLF001 - the stream under the hub
        for watch_id in list(watcher._callbacks):  # noqa: SLF001
            if silent:
                watcher._callbacks.pop(watch_id)  # noqa: SLF001 - its events go nowhere now
            else:
                await watcher._enqueue_watch_cancel(watch_id=watch_id)  # noqa: SLF001 - etcd ends it
        await store.create(_job(7), "")
        deadline = time.monotonic() + 60
        while hub.cache.get("r7") is None:
            assert time.monotonic() < deadline, "the cache never got the job"
            await hub.read_current(within=1)
            await asyncio.sleep(0.2)
        assert hub.reopens >= 1 if silent else hub.reopens == 0
        await store.create(_job(8), "")  # and it goes on
        assert await hub.wait_current(within=20) and hub.cache.get("r8") is not None
    finally:
        await hub.stop()
        await client.delete_prefix(etcd_prefix.encode())
        await client.close()


@pytest.fixture
async def replicas(etcd: EtcdServer) -> AsyncIterator[tuple[Replicas, FreezingProxy]]:
    async with FreezingProxy(etcd.client_port) as proxy:
        r = Replicas(etcd, f"/dlsched-ryw-{uuid.uuid4().hex[:8]}/", proxy.port)
        try:
            await asyncio.to_thread(r.start)
            await r.stack.register_local()
            yield r, proxy
        finally:
            proxy.thaw()
            await asyncio.to_thread(r.stop)


@contextlib.contextmanager
def frozen(proxy: FreezingProxy) -> Iterator[None]:
    proxy.freeze()
    try:
        yield
    finally:
        proxy.thaw()


def _spec(cmd: list[str]) -> job_pb2.JobSpec:
    return job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[
        job_pb2.ReplicaGroup(role="main", replicas=1, command=cmd)])


async def _until(pred, within: float = 60) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within
    while not await pred():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)


async def _thaw_later(proxy: FreezingProxy, after: float) -> None:
    await asyncio.sleep(after)
    proxy.thaw()


async def test_writes_on_one_replica_are_read_on_the_other(
        replicas: tuple[Replicas, FreezingProxy], etcd: EtcdServer) -> None:
    r, proxy = replicas
    assert r.stack.jm is not None and r.b is not None
    other = await connect(etcd.endpoint)
    async with security.channel(r.stack.jm.address) as ca, security.channel(r.b.address) as cb:
        a, b = pb_grpc.JobManagerServiceStub(ca), pb_grpc.JobManagerServiceStub(cb)
        first = (await a.SubmitJob(pb.SubmitJobRequest(spec=_spec(["sleep", "300"])),
                                   timeout=60)).job

        async def b_has_first() -> bool:
            return any(j.name == first.name for j in (await b.ListJobs(pb.ListJobsRequest())).jobs)
        await _until(b_has_first)  # B is up and its watch flows

        for round_ in range(3):
            # A write on A, answered while B cannot hear etcd: B's cache lags.
            with frozen(proxy):
                made = (await a.SubmitJob(pb.SubmitJobRequest(spec=_spec(["sleep", "300"])),
                                          timeout=60)).job
                # A write to a key that brings B no job event: etcd's revision moves on.
                await other.put(f"{r.stack.prefix}unrelated/{round_}".encode(), b"x")
                thaw = asyncio.create_task(_thaw_later(proxy, 0.5))
                listed = (await b.ListJobs(pb.ListJobsRequest(page_size=1000), timeout=60)).jobs
                got = (await b.GetJob(pb.GetJobRequest(name=made.name), timeout=60)).job
                await thaw
            assert got.name == made.name and int(got.etag) >= int(made.etag)
            assert made.name in [j.name for j in listed], f"round {round_}: ListJobs on B missed it"

        # StopJob on A; B's GetJob and ListJobs show the stop, not the state B cached before.
        before = (await b.GetJob(pb.GetJobRequest(name=first.name), timeout=60)).job
        with frozen(proxy):
            stopped = (await a.StopJob(pb.StopJobRequest(name=first.name), timeout=60)).job
            assert int(stopped.etag) > int(before.etag)
            await other.put(f"{r.stack.prefix}unrelated/stop".encode(), b"x")
            thaw = asyncio.create_task(_thaw_later(proxy, 0.5))
            got = (await b.GetJob(pb.GetJobRequest(name=first.name), timeout=60)).job
            listed = (await b.ListJobs(pb.ListJobsRequest(page_size=1000), timeout=60)).jobs
            await thaw
        assert int(got.etag) >= int(stopped.etag), (got.state, stopped.state)
        row = next(j for j in listed if j.name == first.name)
        assert int(row.etag) >= int(stopped.etag), (row.state, stopped.state)
    await other.delete_prefix(r.stack.prefix.encode())
    await other.close()


async def test_a_read_with_min_etag_is_served_from_the_cache_once_it_shows_that_write(
        replicas: tuple[Replicas, FreezingProxy], etcd: EtcdServer) -> None:
    """GetJob/ListJobs with ``min_etag`` (Kubernetes' resourceVersionMatch=NotOlderThan): the
    replica answers from its cache, without reading etcd's revision, once its cache shows that
    write; while its cache lags behind it, it proves the write as a consistent read does; an etag
    newer than every write, or not one, is INVALID_ARGUMENT naming min_etag."""
    import grpc

    from tests.harness import metrics_samples, sample

    r, proxy = replicas
    assert r.stack.jm is not None and r.b is not None
    b_proc = r.b

    def reads(proof: str) -> float:
        return sample(metrics_samples(b_proc), "dlsched_job_manager_reads_total", proof=proof)

    async with security.channel(r.stack.jm.address) as ca, security.channel(r.b.address) as cb:
        a, b = pb_grpc.JobManagerServiceStub(ca), pb_grpc.JobManagerServiceStub(cb)
        first = (await a.SubmitJob(pb.SubmitJobRequest(spec=_spec(["sleep", "300"])), timeout=60)).job
        await _until(lambda: _has(b, first.name))

        # B's cache shows the write: answered from it, no consistent read.
        cached0, consistent0 = reads("cache"), reads("consistent")
        for _ in range(5):
            got = (await b.GetJob(pb.GetJobRequest(name=first.name, min_etag=first.etag), timeout=60)).job
            assert got.name == first.name and int(got.etag) >= int(first.etag)
            page = await b.ListJobs(pb.ListJobsRequest(page_size=1000, min_etag=first.etag), timeout=60)
            assert first.name in [j.name for j in page.jobs]
        assert reads("cache") - cached0 == 10 and reads("consistent") == consistent0
        await b.GetJob(pb.GetJobRequest(name=first.name), timeout=60)  # the default: consistent
        assert reads("consistent") == consistent0 + 1

        # A write on A that B's lagging cache has not shown: B proves it before answering.
        with frozen(proxy):
            made = (await a.SubmitJob(pb.SubmitJobRequest(spec=_spec(["sleep", "300"])), timeout=60)).job
            thaw = asyncio.create_task(_thaw_later(proxy, 0.5))
            got = (await b.GetJob(pb.GetJobRequest(name=made.name, min_etag=made.etag), timeout=60)).job
            listed = (await b.ListJobs(pb.ListJobsRequest(page_size=1000, min_etag=made.etag), timeout=60)).jobs
            await thaw
        assert got.name == made.name and int(got.etag) >= int(made.etag)
        assert made.name in [j.name for j in listed]

        for bad in (str(int(made.etag) + 10**6), "0", "-1", "12a", " 12", "9" * 40):
            for call in (b.GetJob(pb.GetJobRequest(name=made.name, min_etag=bad), timeout=60),
                         b.ListJobs(pb.ListJobsRequest(min_etag=bad), timeout=60)):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_etag" in (e.value.details() or "")
        for job in (first, made):
            await a.StopJob(pb.StopJobRequest(name=job.name), timeout=60)


async def _has(stub: pb_grpc.JobManagerServiceStub, name: str) -> bool:
    return any(j.name == name for j in (await stub.ListJobs(pb.ListJobsRequest(page_size=1000))).jobs)


async def test_one_revision_read_at_a_time_answers_only_the_callers_that_came_before_it_was_sent() -> None:
    """The read shared by GetJob/ListJobs: callers arriving while one is in flight wait for the
    next (a read already sent may predate a write they saw answered), which is sent when it returns."""
    gates: list[asyncio.Future[int]] = []

    async def fetch() -> int:
        gates.append(asyncio.get_running_loop().create_future())
        return await gates[-1]

    shared = _SharedRead(fetch)
    first = [asyncio.create_task(shared.get()) for _ in range(3)]
    await asyncio.sleep(0.01)
    assert len(gates) == 1  # three callers, one read
    later = [asyncio.create_task(shared.get()) for _ in range(3)]
    await asyncio.sleep(0.01)
    assert len(gates) == 1  # not sent while one is in flight
    gates[0].set_result(10)
    assert await asyncio.gather(*first) == [10] * 3
    await asyncio.sleep(0.01)
    assert len(gates) == 2 and not any(t.done() for t in later)  # theirs was sent after the first returned
    gates[1].set_exception(OSError("etcd down"))
    for t in later:
        with pytest.raises(OSError):
            await t
    alone = asyncio.create_task(shared.get())
    await asyncio.sleep(0.01)
    assert len(gates) == 3  # nothing in flight: sent at once
    gates[2].set_result(12)
    assert await alone == 12 and shared.sent == 3


async def test_under_load_revision_reads_wait_a_round_trip_more() -> None:
    """Callers that queue behind a read in flight get the next one a round trip after it
    returned (up to ``gap`` after it was sent; one read answers them all); a lone caller's read
    goes at once."""
    loop = asyncio.get_running_loop()
    sent: list[float] = []
    rtt = 0.05

    async def fetch() -> int:
        sent.append(loop.time())
        await asyncio.sleep(rtt)
        return len(sent)

    shared = _SharedRead(fetch, 3600)
    first = asyncio.create_task(shared.get())
    await asyncio.sleep(0)  # its read is sent in the loop's next turn
    queued = [asyncio.create_task(shared.get()) for _ in range(5)]
    assert await first == 1
    assert await asyncio.gather(*queued) == [2] * 5  # one read for the five
    assert len(sent) == 2 and sent[1] - sent[0] >= 2 * rtt
    # Alone, nothing in flight: sent at once, not an hour after the last read.
    lone = _SharedRead(fetch, 3600)
    assert await lone.get() == 3
    assert await asyncio.wait_for(lone.get(), 60) == 4


async def test_a_replica_cut_off_from_etcd_answers_from_its_last_view(
        replicas: tuple[Replicas, FreezingProxy]) -> None:
    """While B cannot hear etcd, GetJob and ListJobs of a job B has seen answer
    from B's cache (as they would a moment before), not UNAVAILABLE; a job B has
    never seen is UNAVAILABLE STORE_UNAVAILABLE (retry), never NOT_FOUND."""
    import grpc

    from dlsched.kit.rpc_errors import error_info
    r, proxy = replicas
    assert r.stack.jm is not None and r.b is not None
    async with security.channel(r.stack.jm.address) as ca, security.channel(r.b.address) as cb:
        a, b = pb_grpc.JobManagerServiceStub(ca), pb_grpc.JobManagerServiceStub(cb)
        job = (await a.SubmitJob(pb.SubmitJobRequest(spec=_spec(["sleep", "300"])), timeout=60)).job

        async def b_has_it() -> bool:
            return any(j.name == job.name for j in (await b.ListJobs(pb.ListJobsRequest())).jobs)
        await _until(b_has_it)
        with frozen(proxy):
            got = (await b.GetJob(pb.GetJobRequest(name=job.name), timeout=60)).job
            assert got.name == job.name and got.uid == job.uid
            listed = (await b.ListJobs(pb.ListJobsRequest(page_size=1000), timeout=60)).jobs
            assert job.name in [j.name for j in listed]
            # one attempt (no channel retries), so the server's own answer is seen
            from dlsched.kit import tls as tls_kit
            from dlsched.kit.channel import TokenSource
            once = tls_kit.channel(r.b.address, security.current().service_tls(), client_cert=True,
                                   token=TokenSource(token=security.current().admin_token),
                                   extra_options=[("grpc.enable_retries", 0)])
            async with once:
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await pb_grpc.JobManagerServiceStub(once).GetJob(
                        pb.GetJobRequest(name="jobs/never-made-here"), timeout=120)
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE, ei.value
            info = error_info(ei.value)
            assert info is not None and info.reason == "STORE_UNAVAILABLE", info
        # etcd reachable again: the read is consistent again
        got = (await b.GetJob(pb.GetJobRequest(name=job.name), timeout=60)).job
        assert got.name == job.name
        await a.StopJob(pb.StopJobRequest(name=job.name), timeout=60)
