# ruff: noqa: ASYNC109, ASYNC110  -- tests poll real processes
"""JobManager's watch cache (``job_manager/cache.py``) against a real etcd, and
20,000 synthetic jobs through a real stack: past etcd's 4 MiB client limit,
ListJobs, WatchJobs, the job gauge and reconcile work, and keep working after
a restart."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import sys
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta

import aetcd.exceptions
import grpc
import pytest
from aetcd import rpc
from prometheus_client.parser import text_string_to_metric_families

from dlsched.auth.model import Principal, Role
from dlsched.errors import WatchTokenExpired
from dlsched.kit.etcd import connect
from dlsched.v1 import job_manager_service_pb2 as pb
from dlsched.v1 import job_manager_service_pb2_grpc as pb_grpc
from dlsched.v1 import job_pb2
from job_manager import convert
from job_manager.cache import JobCache
from job_manager.convert import job_to_bytes
from job_manager.domain import access
from job_manager.domain.filter import Filter, parse_filter
from job_manager.domain.model import Job, JobSpec, JobState, ReplicaGroup
from job_manager.store import JobStore
from job_manager.watch import WatchHub
from tests import security
from tests.harness import EtcdServer, Stack

S = job_pb2
T0 = datetime(2026, 1, 1, tzinfo=UTC)
SYNTHETIC = 20_000


def synthetic(i: int, *, state: JobState = JobState.SUCCEEDED, cluster: str = "clusters/local",
              project: str = "", command: list[str] | None = None) -> Job:
    """A job of ~900 bytes as JobManager stores it; create times one ms apart."""
    return Job(id=f"s{i:06d}", uid=f"uid-{i}", state=state, cluster=cluster, attempt=1,
               create_time=T0 + timedelta(milliseconds=i), update_time=T0,
               labels={"group": f"g{i % 20}", "rare": "yes"} if i % 1000 == 7 else {"group": f"g{i % 20}"},
               project=project, owner="synthetic",
               message="m" * 700 if state.is_terminal() else "",
               backend_job_id="" if state == JobState.PENDING else f"b{i}",
               spec=JobSpec(run_mode=1, replica_groups=[ReplicaGroup(
                   role="main", replicas=1, command=command or ["true"])]))


async def put_jobs(client, prefix: str, jobs: list[Job]) -> None:  # type: ignore[no-untyped-def]
    """Straight into etcd with the store's encoding, 128 keys per transaction."""
    await client.connect()
    key = f"{prefix}jobs/".encode()
    for start in range(0, len(jobs), 128):
        batch = jobs[start:start + 128]
        ops = [rpc.RequestOp(request_put=rpc.PutRequest(key=key + j.id.encode(), value=job_to_bytes(j)))
               for j in batch]
        await client.kvstub.Txn(rpc.TxnRequest(success=ops), timeout=30, metadata=client.metadata)


async def delete_prefix(client, prefix: str) -> None:  # type: ignore[no-untyped-def]
    await client.delete_prefix(prefix.encode())


# ---------------------------------------------------------------- the cache itself

@pytest.fixture
async def store(etcd: EtcdServer, etcd_prefix: str) -> AsyncIterator[JobStore]:
    client = await connect(etcd.endpoint)
    yield JobStore(client, etcd_prefix)
    await delete_prefix(client, etcd_prefix)
    await client.close()


@pytest.fixture
async def hub(store: JobStore, etcd_prefix: str) -> AsyncIterator[WatchHub]:
    h = WatchHub(store.client, etcd_prefix, cache=JobCache(page_size=32), store=store)
    yield h
    await h.stop()


def brute(jobs: list[Job], flt: Filter, p: Principal | None) -> list[str]:
    """What ListJobs returned when it read and sorted every job."""
    ok = [j for j in jobs if flt.matches(j) and (p is None or access.may_read(p, j))]
    ok.sort(key=lambda j: (-(j.create_time.timestamp() if j.create_time else 0.0), j.id))
    return [j.id for j in ok]


async def until(pred, within: float = 20) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_cache_follows_etcd_and_answers_like_a_full_read(store: JobStore, hub: WatchHub) -> None:
    jobs = [synthetic(i, state=[JobState.RUNNING, JobState.SUCCEEDED, JobState.PENDING][i % 3],
                      cluster=f"clusters/c{i % 4}", project=["", "p1", "p2"][i % 5 % 3])
            for i in range(300)]
    await put_jobs(store.client, store.prefix, jobs[:200])
    await hub.start()  # loads 200, paged: 7 pages of 32
    cache = hub.cache
    assert cache is not None and len(cache) == 200
    await put_jobs(store.client, store.prefix, jobs[200:])  # 100 more through the watch
    for j in jobs[:30]:
        await store.update(j.id, lambda j: dataclasses.replace(j, state=JobState.FAILED,
                                                               labels={"moved": "1"}))
    for j in jobs[30:40]:
        await store.delete(j.id)
    rev = await store.revision()
    assert await cache.wait_for(rev)
    stored, _ = await store.list_all()
    assert len(cache) == len(stored) == 290
    for j in stored[:20]:
        e = cache.get(j.id)
        assert e is not None and e.proto() == convert.job_to_proto(j)  # bytes + etag, no domain trip
    viewer = Principal("v", roles={"p1": Role.VIEWER, "p2": Role.VIEWER})
    only_p1 = Principal("w", roles={"p1": Role.VIEWER})
    for text in ("", "state=RUNNING", "state!=RUNNING", "cluster=c1 AND state=PENDING",
                 "labels.moved=1", "labels.group=g3", "run_mode=SINGLE_PROCESS", "project=p2",
                 "owner=synthetic AND labels.group!=g1", "labels.none=x"):
        flt = parse_filter(text)
        for p in (None, viewer, only_p1):
            want = brute(stored, flt, p)
            assert [e.id for e in cache.select(flt, p)] == want, (text, p)
            # paging: continue after any position, as a page token does
            for cut in (0, 5, len(want) // 2):
                if cut < len(want):
                    after = cache.get(want[cut])
                    assert after is not None
                    assert [e.id for e in cache.select(flt, p, after.key)] == want[cut + 1:]
    unfinished, _ = cache.unfinished("clusters/c2")
    assert sorted(j.id for j in unfinished) == sorted(
        j.id for j in stored if j.cluster == "clusters/c2" and not j.state.is_terminal())
    states, at = cache.states()
    assert at == cache.revision and states == {j.id: j.state for j in stored}


class CountingFilter(Filter):
    checked = 0

    def matches(self, job: Job) -> bool:
        CountingFilter.checked += 1
        return super().matches(job)


async def test_a_filtered_page_walks_its_index_not_every_job(store: JobStore, hub: WatchHub) -> None:
    jobs = [synthetic(i, project="p1" if i % 100 == 0 else "") for i in range(5000)]
    await put_jobs(store.client, store.prefix, jobs)
    await hub.start()
    cache = hub.cache
    assert cache is not None and len(cache) == 5000
    for text, p, expect in (("labels.rare=yes", None, 5),
                            ("", Principal("v", roles={"p1": Role.VIEWER}), 50),
                            ("state=SUCCEEDED AND labels.group=g7", None, 250)):
        CountingFilter.checked = 0
        got = list(cache.select(CountingFilter(parse_filter(text).terms), p))
        assert len(got) == expect
        assert CountingFilter.checked == expect, text  # only the index's jobs were looked at
    CountingFilter.checked = 0
    page = list(itertools.islice(cache.select(CountingFilter(()), None), 51))
    assert len(page) == 51 and CountingFilter.checked == 51  # a page of 50 (+1) costs 51


async def test_watch_history_is_bounded_by_bytes(store: JobStore, etcd_prefix: str) -> None:
    h = WatchHub(store.client, etcd_prefix, buffer_bytes=20_000)
    await h.start()
    try:
        live = h.subscribe(h.horizon)  # (the shared etcd may be past the hub's history window)
        first, _ = await store.create(synthetic(1))
        for i in range(60):  # ~1 kB each: far more than 20 kB
            def bump(j: Job, i: int = i) -> Job:
                return dataclasses.replace(j, attempt=i + 2)
            await store.update("s000001", bump)
        for _ in range(61):
            await asyncio.wait_for(live.next(), 10)
        assert 0 < h.buffered_bytes <= 20_000
        assert h.horizon > int(first.etag)
        assert len(h._buffer) < 30
    finally:
        await h.stop()


async def test_a_compaction_the_watch_missed_reloads_the_cache() -> None:
    own = EtcdServer().start()  # compacting the shared etcd would expire other tests' tokens
    client = await connect(own.endpoint)
    store = JobStore(client, "/c/")
    h = WatchHub(client, "/c/", cache=JobCache(page_size=10), store=store)
    try:
        await put_jobs(client, "/c/", [synthetic(i) for i in range(30)])
        await h.start()
        cache = h.cache
        assert cache is not None and len(cache) == 30 and cache.loads == 1
        live = h.subscribe(cache.revision)
        # The watch is down (an etcd outage, say) while jobs change and etcd compacts.
        assert h._task is not None
        h._task.cancel()
        await asyncio.gather(h._task, return_exceptions=True)
        missed_from = cache.revision + 1
        for i in range(5):
            await store.delete(f"s{i:06d}")
        await store.create(synthetic(99))
        await client.compact(await store.revision())
        # It comes back where it left off: those revisions are gone.
        h._task = asyncio.create_task(h._run(missed_from))
        await until(lambda: cache.loads == 2)
        assert len(cache) == 26 and cache.get("s000000") is None and cache.get("s000099") is not None
        with pytest.raises(WatchTokenExpired):
            await asyncio.wait_for(live.next(), 10)  # its subscribers re-list
        after = h.subscribe(cache.revision)
        await store.update("s000099", lambda j: dataclasses.replace(j, state=JobState.FAILED))
        ev = await asyncio.wait_for(after.next(), 10)  # and the watch goes on
        assert ev.job.state == JobState.FAILED
        await until(lambda: (e := cache.get("s000099")) is not None and e.state == JobState.FAILED)
    finally:
        await h.stop()
        await client.close()
        own.stop()


async def test_a_reload_that_fails_after_a_compaction_is_tried_again() -> None:
    """The reload after a compaction fails (etcd unreachable for that read): the watch must not
    go on from the compaction, which would skip the missed events for good while the cache
    passed for current (a PENDING job written in the gap never launched, its request key swept,
    a retried SubmitJob made a second job). It meets the compaction again and reloads."""
    from dlsched.errors import StoreUnavailable

    own = EtcdServer().start()
    client = await connect(own.endpoint)
    store = JobStore(client, "/g/")
    h = WatchHub(client, "/g/", cache=JobCache(page_size=10), store=store)
    try:
        await put_jobs(client, "/g/", [synthetic(i) for i in range(3)])
        await h.start()
        cache = h.cache
        assert cache is not None and cache.loads == 1
        assert h._task is not None
        h._task.cancel()
        await asyncio.gather(h._task, return_exceptions=True)
        missed_from = cache.revision + 1
        await store.create(synthetic(50, state=JobState.PENDING))  # written in the gap
        await store.delete("s000000")
        await client.compact(await store.revision())  # compacted past the gap's job
        scan, failed = store.scan, []

        def scan_once_unreachable(*a, **k):  # type: ignore[no-untyped-def]
            if not failed:
                failed.append(True)
                raise StoreUnavailable("etcd did not answer (injected: the reload's first read)")
            return scan(*a, **k)

        store.scan = scan_once_unreachable  # type: ignore[method-assign]
        h._task = asyncio.create_task(h._run(missed_from))
        await until(lambda: cache.get("s000050") is not None)  # the gap's job, by the retried load
        assert failed and cache.loads == 2
        await store.create(synthetic(51))
        await until(lambda: cache.get("s000051") is not None)  # and the watch goes on
    finally:
        await h.stop()
        await client.close()
        own.stop()


# ---------------------------------------------------------------- 20,000 jobs through the stack

M = ["--metrics-listen", "127.0.0.1:0"]


def jobs_gauge(stack: Stack) -> dict[str, float]:
    assert stack.jm is not None
    with open(stack.jm.port_file + ".metrics") as f:
        url = f"http://{f.read().strip()}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {s.labels["state"]: s.value for fam in text_string_to_metric_families(text)
            if fam.name == "dlsched_jobs" for s in fam.samples}


@pytest.fixture(scope="module")
def big_stack(etcd: EtcdServer) -> Iterator[Stack]:
    st = Stack(etcd, f"/dlsched-cache-{uuid.uuid4().hex[:8]}/", jm_args=M)
    try:
        st.start()
        yield st
    finally:
        st.stop()


async def list_all(jm: pb_grpc.JobManagerServiceStub, flt: str = "", size: int = 1000) -> list[str]:
    names, token = [], ""
    while True:
        r = await jm.ListJobs(pb.ListJobsRequest(page_size=size, page_token=token, filter=flt),
                              timeout=60)
        names += [j.name for j in r.jobs]
        token = r.next_page_token
        if not token:
            return names


async def snapshot_count(jm: pb_grpc.JobManagerServiceStub) -> int:
    n = 0
    call = jm.WatchJobs(pb.WatchJobsRequest(), timeout=120)
    try:
        async for ev in call:
            if ev.type == S.WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE:
                return n
            assert ev.type == S.WATCH_EVENT_TYPE_EXISTING
            n += 1
    finally:
        call.cancel()
    raise AssertionError("WatchJobs ended before its snapshot completed")


async def wait_gauge(stack: Stack, state: str, value: float, within: float = 120) -> None:
    deadline = time.monotonic() + within
    while (got := jobs_gauge(stack).get(state)) != value:
        assert time.monotonic() < deadline, f"dlsched_jobs{{state={state}}} stays {got}, want {value}"
        await asyncio.sleep(0.5)


async def wait_done(jm: pb_grpc.JobManagerServiceStub, names: list[str], within: float = 120) -> None:
    deadline = time.monotonic() + within
    for n in names:
        while (j := (await jm.GetJob(pb.GetJobRequest(name=n))).job).state != S.JOB_STATE_SUCCEEDED:
            assert time.monotonic() < deadline, f"{n} stays {S.JobState.Name(j.state)}: {j.reason} {j.message}"
            await asyncio.sleep(0.2)


async def test_twenty_thousand_jobs_list_watch_count_and_reconcile_across_restarts(
        big_stack: Stack, etcd: EtcdServer) -> None:
    stack = big_stack
    cluster = await stack.register_local()
    client = await connect(etcd.endpoint)
    try:
        # JobManager down; 20,000 finished jobs and 3 waiting for a launch appear.
        assert stack.jm is not None
        stack.jm.kill()
        done = [synthetic(i) for i in range(SYNTHETIC)]
        waiting = [synthetic(SYNTHETIC + i, state=JobState.PENDING, cluster=cluster,
                             command=[sys.executable, "-c", "pass"]) for i in range(3)]
        await put_jobs(client, stack.prefix, done + waiting)
        # The one-range read the store used to make (and ListJobs, WatchJobs,
        # reconcile and the gauge with it) is past the etcd client's limit.
        with pytest.raises(aetcd.exceptions.ClientError) as ei:
            await client.get_prefix(f"{stack.prefix}jobs/".encode())
        cause = ei.value.__cause__
        assert isinstance(cause, grpc.RpcError)
        assert cause.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        stack.jm.start(timeout=120)
        total = SYNTHETIC + 3
        async with security.channel(stack.jm.address) as ch:
            jm = pb_grpc.JobManagerServiceStub(ch)
            names = await list_all(jm)
            assert len(names) == len(set(names)) == total
            assert names[0] == f"jobs/s{total - 1:06d}" and names[-1] == "jobs/s000000"  # newest first
            assert len(await list_all(jm, "labels.rare=yes", size=7)) == SYNTHETIC // 1000
            assert await snapshot_count(jm) == total
            # reconcile: the owner launched what waited, and it ran
            await wait_done(jm, [f"jobs/{j.id}" for j in waiting])
            await wait_gauge(stack, "SUCCEEDED", total)
            assert jobs_gauge(stack).get("PENDING") == 0
            # read-your-writes on the replica that wrote
            new = (await jm.SubmitJob(pb.SubmitJobRequest(job_id="fresh", spec=job_pb2.JobSpec(
                run_mode=S.RUN_MODE_SINGLE_PROCESS, labels={"fresh": "1"},
                replica_groups=[job_pb2.ReplicaGroup(role="main", replicas=1,
                                                     command=[sys.executable, "-c", "pass"])])))).job
            got = (await jm.ListJobs(pb.ListJobsRequest(filter="labels.fresh=1"))).jobs
            assert [j.name for j in got] == [new.name] and got[0].etag >= new.etag
            await wait_done(jm, [new.name])

        # SIGKILL and start again: the cache loads 20,004 jobs page by page.
        more = [synthetic(SYNTHETIC + 10 + i, state=JobState.PENDING, cluster=cluster,
                          command=[sys.executable, "-c", "pass"]) for i in range(2)]
        stack.jm.kill()
        await put_jobs(client, stack.prefix, more)
        stack.jm.start(timeout=120)
        async with security.channel(stack.jm.address) as ch:
            jm = pb_grpc.JobManagerServiceStub(ch)
            assert len(await list_all(jm, size=500)) == total + 1 + 2
            await wait_done(jm, [f"jobs/{j.id}" for j in more])
            await wait_gauge(stack, "SUCCEEDED", total + 1 + 2)
            assert await snapshot_count(jm) == total + 1 + 2
        log = stack.jm.log()
        assert "job gauge restarts" not in log and "ownership job view restarts" not in log
    finally:
        await delete_prefix(client, stack.prefix)
        await client.close()


@pytest.mark.parametrize("text", ["state=RUNNING", "labels.team=ml", "run_mode!=MPI", "run_mode=MPI",
                                  "cluster=local AND project=p1", 'create_time >= "2026-01-01T00:00:00Z"'])
def test_an_updated_events_prev_is_read_by_filters_as_the_job(text: str) -> None:
    """An UPDATED event keeps the job before the change as filters read it (a filtered watch
    tells a job that stops matching): every filter term reads it as it reads the whole job
    (``run_mode!=MPI`` took the cleared spec's run mode 0 for 'not MPI', and every update of
    an MPI job reached a watch that excluded them)."""
    from job_manager.watch import EventType, JobEvent, filter_view

    for mode in (1, 5):  # SINGLE_PROCESS, MPI
        job = dataclasses.replace(synthetic(7, state=JobState.RUNNING, project="p1"), labels={"team": "ml"})
        job.spec.run_mode = mode
        data = job_to_bytes(job)
        ev = JobEvent(2, EventType.UPDATED, job.id, data, 2, prev=filter_view(data))
        assert ev.prev_job is not None and len(ev.prev) < len(data)
        flt = parse_filter(text)
        assert flt.matches(ev.prev_job) == flt.matches(ev.job), (text, mode)
