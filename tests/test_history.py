# ruff: noqa: ASYNC109, ASYNC110, ASYNC220  -- tests poll and start real processes
"""The job history (``job_manager/history``) on a real SQLite file and a real
PostgreSQL server (``tests/postgres.py``), every test on both.

The store: keyset pages and filters against a full read, idempotent upserts,
bulk pruning, the one writer under many concurrent writes, migrations that
hold nothing across a killed process. Through a real stack (etcd,
ClusterManager, local driver, JobManager): jobs past the retention leave etcd
and stay readable through GetJob, ListJobs (pages spanning live and archived,
filters, project access) and the CLI; DeleteJob of an archived job; a
JobManager SIGKILLed between the history write and the etcd deletes loses and
duplicates nothing. ``create_time`` ranges in filters (parsed to microsecond
ranges, walked as a slice of the cache's indexes, a bounded index range in
the history, applied to WatchJobs' events); StopJob, StreamJobLogs and
GetJobUsage of a job archived after it ran on the local driver; the
archiver's metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import pytest
import sqlalchemy as sa
from google.protobuf.timestamp_pb2 import Timestamp

from dlsched.auth.model import Principal, Role
from dlsched.client import AccessClient
from dlsched.kit.etcd import connect
from dlsched.v1 import job_manager_service_pb2 as pb
from dlsched.v1 import job_manager_service_pb2_grpc as pb_grpc
from dlsched.v1 import job_pb2
from job_manager.convert import job_to_bytes
from job_manager.domain import access
from job_manager.domain.filter import Filter, parse_filter
from job_manager.domain.model import Job, JobSpec, JobState, ReplicaGroup
from job_manager.history import migrate
from job_manager.history.store import ArchivedJob, HistoryStore, archived_entries
from job_manager.store import JobStore
from tests import security
from tests.harness import ROOT, EtcdServer, Stack
from tests.postgres import PostgresServer
from tests.test_watch_cache import put_jobs

T0 = datetime(2026, 1, 1, tzinfo=UTC)
TERMINAL = [JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED]


def make(i: int, *, state: JobState = JobState.SUCCEEDED, project: str = "",
         created: datetime | None = None, ended: datetime | None = None,
         cluster: str = "clusters/local", owner: str = "alice") -> Job:
    """A job as JobManager stores it; by default created at T0 + i//2 ms (pairs
    share a create time, so the id breaks ties) and ended then."""
    ct = created or T0 + timedelta(milliseconds=i // 2)
    labels = {"group": f"g{i % 5}"}
    if i % 50 == 3:
        labels["rare"] = "yes"
    return Job(id=f"h{i:05d}", uid=f"uid-{i}", state=state, cluster=cluster, attempt=1,
               create_time=ct, update_time=ended or ct,
               end_time=(ended or ct) if state.is_terminal() else None,
               labels=labels, project=project, owner=owner, message=f"job {i}",
               backend_job_id=f"b{i}",
               spec=JobSpec(run_mode=1, replica_groups=[ReplicaGroup(role="main", replicas=1,
                                                                     command=["true"])]))


def order_key(j: Job) -> tuple[float, str]:
    return (-(j.create_time.timestamp() if j.create_time else 0.0), j.id)


def brute(jobs: list[Job], flt: Filter, p: Principal | None) -> list[str]:
    """What a full read answers: every match the caller may read, newest first, then by id."""
    ok = [j for j in jobs if flt.matches(j) and (p is None or access.may_read(p, j))]
    return [j.id for j in sorted(ok, key=order_key)]


# ---------------------------------------------------------------- databases

@pytest.fixture(scope="module")
def pg() -> Iterator[PostgresServer]:
    try:
        server = PostgresServer()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    server.start()
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
async def dsn(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    if request.param == "sqlite":
        return str(tmp_path_factory.mktemp("history") / "history.db")
    server: PostgresServer = request.getfixturevalue("pg")
    return await server.database()


@pytest.fixture
async def history(dsn: str) -> AsyncIterator[HistoryStore]:
    h = await HistoryStore.open(dsn)
    yield h
    await h.close()


def entries(jobs: list[Job], revision: int = 100) -> list[ArchivedJob]:
    return archived_entries((j.id, job_to_bytes(j), revision + n) for n, j in enumerate(jobs))


# ---------------------------------------------------------------- the store

FILTERS = ["", "state=FAILED", "state!=FAILED", "labels.group=g3", "labels.group!=g3",
           "labels.rare=yes AND state=SUCCEEDED", "project=p1", "project=default",
           "owner=bob", "cluster=c1 AND labels.group=g1", "labels.group=g2 AND labels.rare!=yes",
           "run_mode=SINGLE_PROCESS", "state=RUNNING",
           # time ranges (jobs created at T0 + i//2 ms): alone, with an index, with labels
           'create_time >= "2026-01-01T00:00:00.100Z"',
           'create_time < "2026-01-01T00:00:00.0405Z" AND state=FAILED',
           'labels.group=g2 AND create_time > "2026-01-01T01:00:00.050+01:00"',
           'create_time<="2026-01-01T00:00:00.2Z" AND create_time>"2026-01-01T00:00:00.15Z"'
           ' AND labels.group!=g1',
           'create_time >= "2026-01-01T00:00:00.2Z" AND create_time < "2026-01-01T00:00:00.1Z"',
           # end times (T0 + i//2 + i*37%500 ms): not in create order
           'end_time >= "2026-01-01T00:00:00.400Z"',
           'end_time < "2026-01-01T00:00:00.300Z" AND state=FAILED',
           'labels.group=g2 AND end_time > "2026-01-01T00:00:00.100Z" AND end_time <= '
           '"2026-01-01T00:00:00.450Z" AND create_time < "2026-01-01T00:00:00.2Z"']
PRINCIPALS = [None, Principal("v", roles={"p1": Role.VIEWER}),
              Principal("w", roles={"p1": Role.VIEWER, "default": Role.VIEWER}),
              Principal("nobody", roles={})]


async def test_keyset_pages_and_filters_answer_like_a_full_read(history: HistoryStore) -> None:
    jobs = [make(i, state=TERMINAL[i % 3], project=["", "p1", "p2"][i % 7 % 3],
                 cluster=f"clusters/c{i % 4}", owner=["alice", "bob"][i % 2],
                 ended=T0 + timedelta(milliseconds=i // 2 + i * 37 % 500)) for i in range(600)]
    await history.put(entries(jobs[:300]))
    await history.put(entries(jobs[300:]))
    assert await history.count() == 600
    for text in FILTERS:
        flt = parse_filter(text)
        for p in PRINCIPALS:
            got: list[str] = []
            after = None
            while True:
                page = await history.select(flt, p, after, 17)
                got += [a.id for a in page]
                if len(page) < 17:
                    break
                after = page[-1].key
            assert got == brute(jobs, flt, p), (text, p)
    one = await history.get("h00007")
    assert one is not None and one.proto().name == "jobs/h00007" and one.proto().etag == "107"
    assert one.job().labels == jobs[7].labels
    assert await history.get("nope") is None


async def test_ids_page_in_byte_order_whatever_the_databases_collation(pg: PostgresServer) -> None:
    """ListJobs merges the history's pages with the watch cache's, which orders ids as Python
    does: a PostgreSQL database whose collation ignores punctuation (as en_US.UTF-8 does) must
    not order ``a-c`` after ``ab``, or pages skip and repeat jobs that share a create time."""
    ids = ["aa", "a-c", "ab", "a-b", "job1", "job-10", "job10", "job-2", "b"]
    h = await HistoryStore.open(await pg.database(icu_locale="und-u-ka-shifted"))
    try:
        jobs = []
        for i, job_id in enumerate(ids):
            j = make(i, created=T0)  # one create time: the id alone orders them
            j.id = job_id
            jobs.append(j)
        await h.put(entries(jobs))
        for size in (1, 2, 3, 100):
            got: list[str] = []
            after = None
            while True:
                page = await h.select(parse_filter(""), None, after, size)
                got += [a.id for a in page]
                if len(page) < size:
                    break
                after = page[-1].key
            assert got == sorted(ids), size
    finally:
        await h.close()


async def test_an_owner_or_cluster_of_any_length_is_archived(history: HistoryStore) -> None:
    """Owner and cluster columns take any length (an owner of 400 characters failed every
    PostgreSQL batch it was in, and the archiver retried that batch for ever)."""
    long = make(1, owner="user:" + "s" * 400, cluster="clusters/" + "c" * 300)
    await history.put(entries([long, make(2)]))
    assert await history.count() == 2
    got = await history.get("h00001")
    assert got is not None and got.job().owner == "user:" + "s" * 400


async def test_upserts_are_idempotent_and_a_newer_revision_wins(history: HistoryStore) -> None:
    j = make(1, state=JobState.FAILED)
    await history.put(entries([j], revision=10))
    await history.put(entries([j], revision=10))  # again: a retried archive batch
    newer = make(1, state=JobState.FAILED)
    newer.labels = {"group": "moved"}
    newer.message = "second"
    await history.put(entries([newer], revision=20))
    await history.put(entries([j], revision=10))  # a stale writer: ignored
    got = await history.get(j.id)
    assert got is not None and got.revision == 20 and got.job().message == "second"
    assert [a.id for a in await history.select(parse_filter("labels.group=moved"), None, None, 10)] == [j.id]
    assert await history.select(parse_filter("labels.group=g1"), None, None, 10) == []
    assert await history.count() == 1
    assert not await history.delete(j.id, revision=10)  # only as archived at that revision
    assert await history.delete(j.id, revision=20)
    assert await history.count() == 0
    assert await history.select(parse_filter("labels.group=moved"), None, None, 10) == []


async def test_an_archiver_resumed_after_a_delete_does_not_bring_the_job_back(history: HistoryStore) -> None:
    """An archiver leader picks its batch, then is frozen (SIGSTOP) past its lease; the job is
    deleted meanwhile (DeleteJob: etcd and the history). When it resumes, its put must not store
    the job again (it did: the deleted job reappeared in GetJob and ListJobs). A later job of
    the same id (a higher revision) is archived as ever; deleted ids are forgotten after
    DELETED_KEPT_SECONDS."""
    from job_manager.history.store import DELETED_KEPT_SECONDS

    j = make(1, state=JobState.FAILED)
    picked = entries([j], revision=40)  # the frozen archiver's batch
    await history.put(entries([j], revision=40))  # archived by the new leader, say
    assert await history.delete(j.id, upto=45)  # then deleted by a client (etcd had it at 45)
    await history.put(picked)  # the old leader resumes
    assert await history.get(j.id) is None and await history.count() == 0
    await history.put(entries([make(2)], revision=41))  # other ids are untouched by it
    assert await history.get(make(2).id) is not None
    again = entries([j], revision=90)  # a new job of that id, archived later
    await history.put(again)
    got = await history.get(j.id)
    assert got is not None and got.revision == 90
    assert await history.delete(j.id, revision=90, upto=90)
    assert await history.forget_deleted(now=time.time() + DELETED_KEPT_SECONDS / 2) == 0
    assert await history.forget_deleted(now=time.time() + DELETED_KEPT_SECONDS + 60) == 1
    await history.put(picked)  # forgotten: a put (of a pause past a week) is stored again
    assert await history.get(j.id) is not None


async def test_retention_prunes_in_bulk_batches(history: HistoryStore) -> None:
    now = T0 + timedelta(days=100)
    n = 12_000
    jobs = [make(i, ended=T0 + timedelta(days=100 * i / n)) for i in range(n)]
    for start in range(0, n, 2000):
        await history.put(entries(jobs[start:start + 2000]))
    tx0 = history.stats.transactions
    # older than 50 days: the first half
    deleted = await history.prune(max_age_seconds=50 * 86400, now=now.timestamp(), batch=1000)
    assert deleted == n // 2
    assert await history.count() == n - n // 2
    # bulk: about one transaction per 1,000 rows, not one per job
    assert history.stats.transactions - tx0 <= n // 2 // 1000 + 1
    # then a count bound: the oldest-ended go first
    assert await history.prune(max_jobs=1000, batch=1000) == n - n // 2 - 1000
    left = await history.select(Filter(), None, None, 2000)
    assert sorted(a.id for a in left) == [j.id for j in jobs[-1000:]]
    # labels went with their jobs
    assert [a.id for a in await history.select(parse_filter("labels.group=g1"), None, None, 2000)] \
        == [a.id for a in left if a.labels["group"] == "g1"]


async def test_one_writer_takes_over_a_thousand_concurrent_writes(history: HistoryStore) -> None:
    jobs = [make(i) for i in range(1200)]
    reads = 0

    async def reader() -> None:
        nonlocal reads
        for _ in range(40):
            await history.select(Filter(), None, None, 50)
            reads += 1

    async def writer(k: int) -> None:
        await history.put(entries([jobs[k]], revision=k + 1))
        if k % 3 == 0:
            assert await history.delete(jobs[k].id)

    results = await asyncio.gather(*(writer(k) for k in range(1200)),
                                   *(reader() for _ in range(4)), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]  # never "database is locked", nor anything else
    assert history.stats.failures == 0 and reads == 160
    assert await history.count() == 800
    # batched: many operations per transaction
    assert history.stats.transactions < history.stats.operations / 4


async def test_migrations_reach_head_and_a_killed_migrator_holds_nothing(dsn: str) -> None:
    h = await HistoryStore.open(dsn)
    try:
        assert await migrate.current(h.engine) == migrate.head()
    finally:
        await h.close()
    # A process that dies (SIGKILL) inside its migration transaction, holding
    # the write lock (SQLite) or the migration lock (PostgreSQL): a restart
    # migrates at once.
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, dsn], stdout=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "holding"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
    h = await asyncio.wait_for(HistoryStore.open(dsn), 60)
    try:
        await h.put(entries([make(1)]))
        assert await h.count() == 1
        assert await migrate.current(h.engine) == migrate.head()
    finally:
        await h.close()


_HOLD_LOCK = """
import asyncio, sys
import sqlalchemy as sa
from job_manager.history.store import _engine, url_of
from job_manager.history.migrate import _PG_LOCK

async def main():
    engine = _engine(url_of(sys.argv[1]))
    conn = await engine.connect()
    if engine.dialect.name == "postgresql":
        await conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_LOCK})
        await conn.execute(sa.text("CREATE TABLE half_done (x int)"))
    else:
        await conn.exec_driver_sql("BEGIN IMMEDIATE")
        await conn.exec_driver_sql("CREATE TABLE half_done (x int)")
    print("holding", flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


# ---------------------------------------------------------------- through the stack

def history_args(dsn: str) -> list[str]:
    return ["--history-dsn", dsn, "--history-retention", "1h", "--archive-interval", "0.3"]


@pytest.fixture
def stack(etcd: EtcdServer, dsn: str) -> Iterator[Stack]:
    st = Stack(etcd, f"/dlsched-hist-{uuid.uuid4().hex[:8]}/", jm_args=history_args(dsn))
    try:
        yield st
    finally:
        st.stop()


def population(n_old: int) -> tuple[list[Job], list[Job]]:
    """(jobs due to move: terminal, ended long ago; jobs that stay: recent or unfinished)."""
    now = datetime.now(UTC)
    old = [make(i, state=TERMINAL[i % 3], project=["", "p1"][i % 2]) for i in range(n_old)]
    stay = [make(n_old + i, state=TERMINAL[i % 3], project=["", "p1"][i % 2],
                 created=now - timedelta(minutes=5), ended=now) for i in range(10)]
    # unfinished, on a cluster nobody registered: untouched whatever their age
    stay += [make(n_old + 10 + i, state=JobState.RUNNING, cluster="clusters/ghost",
                  project=["", "p1"][i % 2]) for i in range(10)]
    return old, stay


async def etcd_ids_without(store: JobStore, job_id: str) -> bool:
    return job_id not in await etcd_ids(store)


async def etcd_ids(store: JobStore) -> set[str]:
    keys, _ = await store.job_keys()
    n = len(store.jobs_prefix)
    return {k[n:].decode() for k in keys}


async def until(pred, within: float = 120, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within
    while not await pred():
        assert time.monotonic() < deadline, f"{what} not reached within {within}s"
        await asyncio.sleep(0.2)


async def list_ids(jm: pb_grpc.JobManagerServiceStub, flt: str = "", size: int = 7) -> list[str]:
    out, token = [], ""
    while True:
        r = await jm.ListJobs(pb.ListJobsRequest(page_size=size, page_token=token, filter=flt),
                              timeout=60)
        out += [j.name.removeprefix("jobs/") for j in r.jobs]
        token = r.next_page_token
        if not token:
            return out


async def watch_snapshot(watch: Any) -> tuple[set[str], str]:
    """A WatchJobs stream's snapshot: (job ids, the resume token after it)."""
    ids = set()
    async for r in watch:
        if r.type == job_pb2.WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE:
            return ids, r.resume_token
        if r.type == job_pb2.WATCH_EVENT_TYPE_EXISTING:
            ids.add(r.job.name.removeprefix("jobs/"))
    raise AssertionError("the watch ended before its snapshot")


async def next_event(watch: Any, but: frozenset[str] = frozenset()) -> pb.WatchJobsResponse:
    """The next response of a WatchJobs stream that is not a heartbeat nor a
    change to a job named in ``but``."""
    async for r in watch:
        if r.type != job_pb2.WATCH_EVENT_TYPE_HEARTBEAT and r.job.name not in but:
            return r
    raise AssertionError("the watch ended")


def cli(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    assert stack.jm is not None
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DLSCHED_SERVER", None)
    r = subprocess.run([sys.executable, "-m", "dlsched", "--server", stack.jm.address, *args],
                       capture_output=True, text=True, timeout=90, cwd=ROOT, env=env)
    assert "Traceback" not in r.stderr, r.stderr
    return r


async def test_archived_jobs_leave_etcd_and_stay_readable(stack: Stack, etcd: EtcdServer,
                                                          dsn: str) -> None:
    old, stay = population(120)
    everything = old + stay
    client = await connect(etcd.endpoint)
    store = JobStore(client, stack.prefix)
    try:
        await put_jobs(client, stack.prefix, everything)
        stack.start()
        assert stack.jm is not None

        async def moved() -> bool:
            return await etcd_ids(store) == {j.id for j in stay}
        await until(moved, what="old terminal jobs leaving etcd")

        async with security.channel(stack.jm.address) as ch:
            jm = pb_grpc.JobManagerServiceStub(ch)
            # GetJob: archived jobs as they were stored
            for j in old[::7]:
                got = (await jm.GetJob(pb.GetJobRequest(name=j.name), timeout=30)).job
                assert got.state == int(j.state) and dict(got.labels) == j.labels
                assert got.create_time.ToDatetime(UTC) == j.create_time and got.message == j.message
            # ListJobs: keyset pages of 7 across live and archived, and filters
            assert await list_ids(jm) == brute(everything, Filter(), None)
            for text in ["state=FAILED", "labels.group=g2", "project=p1", "state=RUNNING",
                         "labels.group!=g2 AND state!=STOPPED", "labels.rare=yes",
                         # archived (T0 + ms) and live (T0 + ms, unfinished; or minutes ago)
                         'create_time >= "2026-01-01T00:00:00.030Z"',
                         'create_time < "2026-01-01T00:00:00.065Z" AND create_time >= '
                         '"2026-01-01T00:00:00.020Z"',
                         'project=p1 AND create_time < "2026-01-01T00:00:00.065Z"',
                         # ended: archived ones (T0 + ms) and live ones that ended just now
                         'end_time >= "2026-01-01T00:00:00.030Z"',
                         'end_time < "2026-01-01T00:00:00.065Z" AND state!=FAILED']:
                assert await list_ids(jm, text, 5) == brute(everything, parse_filter(text), None), text

            # Access: a viewer of p1 sees p1's archived jobs only, and not the others by id
            acc = AccessClient(stack.jm.address, channel=ch)
            sa_name = f"hv{uuid.uuid4().hex[:6]}"
            await acc.create_role_binding(f"sa:{sa_name}", "p1", "viewer")
            _, secret = await acc.create_api_token(sa_name)
            viewer = Principal(f"sa:{sa_name}", roles={"p1": Role.VIEWER})
            async with security.user_channel(stack.jm.address, secret) as vch:
                vjm = pb_grpc.JobManagerServiceStub(vch)
                assert await list_ids(vjm) == brute(everything, Filter(), viewer)
                other = next(j for j in old if not j.project)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await vjm.GetJob(pb.GetJobRequest(name=other.name), timeout=30)
                assert e.value.code() == grpc.StatusCode.NOT_FOUND
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await vjm.DeleteJob(pb.DeleteJobRequest(name=next(
                        j for j in old if j.project == "p1").name), timeout=30)
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED

            # The CLI goes through the same API
            r = cli(stack, "get", old[4].id)
            assert r.returncode == 0, r.stderr
            assert f"jobs/{old[4].id}" in r.stdout and JobState(old[4].state).name in r.stdout
            r = cli(stack, "list", "--filter", "labels.group=g3", "-o", "json")
            assert r.returncode == 0, r.stderr
            assert [j["name"] for j in json.loads(r.stdout)["jobs"]] == [
                f"jobs/{i}" for i in brute(everything, parse_filter("labels.group=g3"), None)]

            # An archived job's id stays taken: a new job must not hide it
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await jm.SubmitJob(pb.SubmitJobRequest(
                    job_id=old[5].id, request_id=uuid.uuid4().hex,
                    spec=job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[
                        job_pb2.ReplicaGroup(role="main", replicas=1, command=["true"])])), timeout=30)
            assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS, e.value.details()
            got = (await jm.GetJob(pb.GetJobRequest(name=old[5].name), timeout=30)).job
            assert got.state == int(old[5].state)

            # DeleteJob of an archived job removes it from the history, and a
            # watch sees it DELETED (archiving it sent nothing)
            gone = old[10]
            watch = jm.WatchJobs(pb.WatchJobsRequest(), timeout=120)
            snapshot, token = await watch_snapshot(watch)
            assert snapshot == {j.id for j in stay}
            resp = await jm.DeleteJob(pb.DeleteJobRequest(name=gone.name), timeout=30)
            assert resp.job.name == gone.name
            ev = await asyncio.wait_for(next_event(watch, frozenset(j.name for j in stay)), 60)
            watch.cancel()
            assert (ev.type, ev.job.name, ev.job.state) == (
                job_pb2.WATCH_EVENT_TYPE_DELETED, gone.name, int(gone.state))
            assert dict(ev.job.labels) == gone.labels
            # A snapshot taken after that DELETED resumes past it: its token
            # covers the purge (the next event is a new job's, not the DELETED)
            later = jm.WatchJobs(pb.WatchJobsRequest(), timeout=120)
            _, later_token = await watch_snapshot(later)
            later.cancel()
            resumed = jm.WatchJobs(pb.WatchJobsRequest(resume_token=later_token), timeout=120)
            fresh = make(99_999, state=JobState.RUNNING, cluster="clusters/ghost")
            await put_jobs(client, stack.prefix, [fresh])
            ev = await asyncio.wait_for(next_event(resumed, frozenset(j.name for j in stay)), 60)
            resumed.cancel()
            assert (ev.type, ev.job.name) == (job_pb2.WATCH_EVENT_TYPE_CREATED, fresh.name)
            await client.delete(f"{stack.prefix}jobs/{fresh.id}".encode())
            await until(lambda: etcd_ids_without(store, fresh.id), what="the new job's key gone")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await jm.GetJob(pb.GetJobRequest(name=gone.name), timeout=30)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            assert gone.id not in await list_ids(jm, size=1000)
            await jm.DeleteJob(pb.DeleteJobRequest(name=gone.name, allow_missing=True), timeout=30)

        # A restarted JobManager reads the same history
        stack.restart_jm()
        async with security.channel(stack.jm.address) as ch:
            jm = pb_grpc.JobManagerServiceStub(ch)
            want = brute([j for j in everything if j.id != gone.id], Filter(), None)
            assert await list_ids(jm, size=50) == want
            # and resumes a watch from before the delete with it (the watch history)
            resumed = jm.WatchJobs(pb.WatchJobsRequest(resume_token=token), timeout=120)
            ev = await asyncio.wait_for(next_event(resumed, frozenset(j.name for j in stay)), 60)
            resumed.cancel()
            assert (ev.type, ev.job.name) == (job_pb2.WATCH_EVENT_TYPE_DELETED, gone.name)
    finally:
        await client.delete_prefix(stack.prefix.encode())
        await client.close()


@pytest.mark.parametrize("fault", ["after-history", "mid-delete"])
async def test_sigkill_mid_archive_loses_and_duplicates_nothing(
        stack: Stack, etcd: EtcdServer, dsn: str, fault: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    old, stay = population(300)
    everything = old + stay
    client = await connect(etcd.endpoint)
    store = JobStore(client, stack.prefix)
    try:
        await put_jobs(client, stack.prefix, everything)
        monkeypatch.setenv("DLSCHED_FAULT_ARCHIVE", fault)
        stack.start()
        assert stack.jm is not None and stack.jm.proc is not None
        stack.jm.env.pop("DLSCHED_FAULT_ARCHIVE")  # the next start runs clean
        stack.jm.proc.wait(120)
        assert stack.jm.proc.returncode == -signal.SIGKILL, stack.jm.log()

        # Dead mid-archive: every job is in etcd or in the history (or both), none in neither.
        live = await etcd_ids(store)
        h = await HistoryStore.open(dsn)
        try:
            archived = {a.id for a in await h.select(Filter(), None, None, 10_000)}
        finally:
            await h.close()
        assert {j.id for j in everything} <= live | archived
        assert archived <= {j.id for j in old}
        assert archived == {j.id for j in old}  # the batch was committed before any delete
        if fault == "after-history":
            assert live == {j.id for j in everything}
        else:
            assert {j.id for j in stay} < live < {j.id for j in everything}

        stack.restart_jm(kill=False)

        async def moved() -> bool:
            return await etcd_ids(store) == {j.id for j in stay}
        await until(moved, what="the archive finishing after the restart")
        async with security.channel(stack.jm.address) as ch:
            jm = pb_grpc.JobManagerServiceStub(ch)
            ids = await list_ids(jm, size=100)
            assert len(ids) == len(set(ids)) == len(everything)  # nothing twice, nothing lost
            assert ids == brute(everything, Filter(), None)
            for j in old[::13]:
                got = (await jm.GetJob(pb.GetJobRequest(name=j.name), timeout=30)).job
                assert got.state == int(j.state) and got.message == j.message
        h = await HistoryStore.open(dsn)
        try:
            assert await h.count() == len(old)
        finally:
            await h.close()
    finally:
        await client.delete_prefix(stack.prefix.encode())
        await client.close()


def test_job_states_used_here_are_terminal() -> None:
    assert all(s.is_terminal() for s in TERMINAL) and not JobState.RUNNING.is_terminal()
    assert job_pb2.JOB_STATE_SUCCEEDED == int(JobState.SUCCEEDED)


# ---------------------------------------------------------------- the archiver's races, in process

async def test_archiver_keeps_changed_jobs_drops_deleted_ones_and_is_fenced(
        etcd: EtcdServer, etcd_prefix: str, history: HistoryStore) -> None:
    """A job written between the history write and its etcd delete stays in
    etcd (etcd wins); a job a client deleted meanwhile leaves the history too
    (it never comes back); a replica that lost the archiver's key deletes nothing."""
    import dataclasses

    from job_manager.cache import JobCache
    from job_manager.history.archiver import ArchiveConfig, Archiver, LeadershipLost
    from job_manager.watch import WatchHub

    client = await connect(etcd.endpoint)
    store = JobStore(client, etcd_prefix)
    hub = WatchHub(client, etcd_prefix, cache=JobCache(page_size=16), store=store)
    jobs = [make(i, state=TERMINAL[i % 3]) for i in range(40)]
    live = make(99, state=JobState.RUNNING, cluster="clusters/ghost")
    holder_key = f"{etcd_prefix}leaders/job-archiver".encode()
    try:
        await put_jobs(client, etcd_prefix, [*jobs, live])
        # SubmitJob's request keys (request_id -> job id) of some jobs
        for j in [*jobs[:10], live]:
            await client.put(store.request_key(f"req-{j.id}"), j.id.encode())
        await client.put(holder_key, b"me")
        await hub.start()
        assert hub.cache is not None
        arch = Archiver(store, hub.cache, history, ArchiveConfig(retention_seconds=3600, batch=100,
                                                                 request_key_grace_seconds=0),
                        holder_key=holder_key, holder="me", wait_current=hub.wait_current)
        assert await hub.wait_current()
        oldest_first = [j.id for j in sorted(jobs, key=order_key, reverse=True)]
        # By count alone (no age bound): the oldest beyond 15 finished jobs in etcd.
        by_count = Archiver(store, hub.cache, history, ArchiveConfig(retention_seconds=-1, max_terminal=15),
                            holder_key=holder_key, holder="me", wait_current=hub.wait_current)
        assert [a.id for a in by_count.candidates()] == oldest_first[:25]
        due = arch.candidates()
        assert [a.id for a in due] == oldest_first
        changed, deleted = jobs[5], jobs[6]
        await store.update(changed.id, lambda j: dataclasses.replace(j, message="changed"))
        await store.delete(deleted.id)
        await arch._move(due)
        assert arch.stats.archived == 38 and arch.stats.kept_changed == 1
        assert arch.stats.dropped_deleted == 1
        assert await etcd_ids(store) == {changed.id, live.id}
        assert await history.get(deleted.id) is None
        shadow = await history.get(changed.id)
        assert shadow is not None and shadow.job().message == changed.message  # etcd wins reads

        # Another replica holds the key now: this one deletes nothing.
        await client.put(holder_key, b"other")
        assert await hub.wait_current()
        due = arch.candidates()
        assert [a.id for a in due] == [changed.id]
        with pytest.raises(LeadershipLost):
            await arch._move(due)
        assert await etcd_ids(store) == {changed.id, live.id}

        # Holding it again, the next round moves the changed job as it is now.
        await client.put(holder_key, b"me")
        assert not await arch.round()
        assert await etcd_ids(store) == {live.id}
        # the round swept the request keys of jobs gone from etcd: a deleted job's at once,
        # an archived job's once its pair is in the history (the next sweep); the live job's stays
        async def request_keys() -> list[bytes]:
            return sorted(k for page in [p async for p in store.request_keys(await store.revision())]
                          for k, _, _ in page)
        assert await request_keys() == sorted(store.request_key(f"req-{j.id}")
                                              for j in [*jobs[:10], live] if j is not deleted)
        assert arch.stats.request_keys_swept == 1
        archived_req = await history.job_for_request(f"req-{jobs[0].id}")
        assert archived_req is not None and archived_req.id == jobs[0].id
        assert await history.job_for_request(f"req-{deleted.id}") is None
        assert await hub.wait_current()
        # The round's own sweep may have run before the cache saw its last delete (the changed
        # job's, under load): that job's pair is then recorded by this sweep and its key goes
        # by the next. Either way every archived job's key goes, one sweep after its pair.
        swept = await arch.sweep_requests(hub.cache.current)
        swept += await arch.sweep_requests(hub.cache.current)
        assert swept == 9
        assert await request_keys() == [store.request_key(f"req-{live.id}")]
        assert arch.stats.request_keys_swept == 10
        moved = await history.get(changed.id)
        assert moved is not None and moved.job().message == "changed"
        assert await history.count() == 39

        # With the default grace a key outlives the sweeps after its pair is recorded (a retried
        # SubmitJob that looked in the history just before the pair was there, then matched for
        # up to 15 s, must still find the key: with a 1 s sweep interval it ran a job twice).
        late = make(98, state=JobState.SUCCEEDED)
        await put_jobs(client, etcd_prefix, [late])
        await client.put(store.request_key(f"req-{late.id}"), late.id.encode())
        patient = Archiver(store, hub.cache, history, ArchiveConfig(retention_seconds=3600),
                           holder_key=holder_key, holder="me", wait_current=hub.wait_current)
        assert await hub.wait_current()
        await patient._move(patient.candidates())
        assert await hub.wait_current()
        for _ in range(3):
            await patient.sweep_requests(hub.cache.current)
        assert store.request_key(f"req-{late.id}") in await request_keys()
        assert (await history.job_for_request(f"req-{late.id}")) is not None
        await history.delete(late.id, upto=0)

        # /metrics: jobs moved and pruned, the last round
        from prometheus_client import REGISTRY

        def metric(name: str) -> float:
            return REGISTRY.get_sample_value(name) or 0.0
        archived0, pruned0 = metric("dlsched_history_jobs_archived_total"), \
            metric("dlsched_history_jobs_pruned_total")
        last0 = metric("dlsched_history_archive_last_round_timestamp_seconds")
        await put_jobs(client, etcd_prefix, jobs[:3])  # back in etcd: due again
        assert await hub.wait_current()
        pruner = Archiver(store, hub.cache, history, ArchiveConfig(retention_seconds=3600,
                                                                   prune_max_jobs=30),
                          holder_key=holder_key, holder="me", wait_current=hub.wait_current)
        assert not await pruner.round()
        assert metric("dlsched_history_jobs_archived_total") - archived0 == 3
        assert metric("dlsched_history_jobs_pruned_total") - pruned0 == 39 - 30
        assert metric("dlsched_history_archive_last_round_timestamp_seconds") > last0
        assert metric("dlsched_history_archive_due_jobs") == 3
        assert await history.count() == 30
        # pruning took the request ids of the jobs it deleted with them
        async with history.engine.connect() as conn:
            rows = (await conn.execute(sa.text("SELECT request_id, job_id FROM job_requests"))).all()
        kept = {j.id for j in jobs[:10] if await history.get(j.id) is not None}
        assert len(kept) < 9 and {r[1] for r in rows} == kept
    finally:
        await hub.stop()
        await client.delete_prefix(etcd_prefix.encode())
        await client.close()


# ---------------------------------------------------------------- time ranges: the filter and the cache

def us(text: str) -> int:
    """Microseconds since the epoch of an ISO time (for the expectations below)."""
    return (datetime.fromisoformat(text) - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)


def test_create_time_terms_are_half_open_microsecond_ranges() -> None:
    t = "2026-12-01T00:00:00+00:00"
    rng = parse_filter('create_time >= "2026-12-01T00:00:00Z"').create_range
    assert rng is not None and (rng.lo, rng.hi) == (us(t), None)
    rng = parse_filter("create_time<2026-12-01T00:00:00Z").create_range  # unquoted, no spaces
    assert rng is not None and (rng.lo, rng.hi) == (None, us(t))
    rng = parse_filter('create_time > "2026-12-01T01:00:00+01:00"').create_range  # the offset applies
    assert rng is not None and (rng.lo, rng.hi) == (us(t) + 1, None)
    # nanoseconds: t*1000 OP ns, over whole microseconds
    rng = parse_filter('create_time >= "2026-12-01T00:00:00.000000001Z" AND '
                       'create_time <= "2026-12-01T00:00:00.000002999z"').create_range
    assert rng is not None and (rng.lo, rng.hi) == (us(t) + 1, us(t) + 3)
    flt = parse_filter('state=RUNNING AND create_time >= "2026-12-01T00:00:00Z" AND '
                       'create_time < "2026-12-02T00:00:00Z"')
    at = datetime(2026, 12, 1, tzinfo=UTC)
    inside, before = make(1, state=JobState.RUNNING, created=at), make(2, state=JobState.RUNNING,
                                                                       created=at - timedelta(microseconds=1))
    assert flt.matches(inside) and not flt.matches(before)  # a domain Job, as WatchJobs' events
    assert not flt.matches(make(3, state=JobState.RUNNING, created=at + timedelta(days=1)))
    assert not flt.matches(make(4, state=JobState.FAILED, created=at))


def test_end_time_terms_match_jobs_that_ended_in_the_range() -> None:
    at = datetime(2026, 12, 1, tzinfo=UTC)
    flt = parse_filter('end_time >= "2026-12-01T00:00:00Z" AND end_time < "2026-12-02T00:00:00Z"')
    rng = flt.end_range
    assert rng is not None and (rng.lo, rng.hi) == (us("2026-12-01T00:00:00+00:00"),
                                                    us("2026-12-02T00:00:00+00:00"))
    assert flt.create_range is None
    old = at - timedelta(days=3)
    assert flt.matches(make(1, state=JobState.FAILED, created=old, ended=at))
    assert not flt.matches(make(2, state=JobState.FAILED, created=old,
                                ended=at - timedelta(microseconds=1)))
    assert not flt.matches(make(3, state=JobState.SUCCEEDED, created=old, ended=at + timedelta(days=1)))
    # a job still running has no end, whatever its other times
    assert not flt.matches(make(4, state=JobState.RUNNING, created=at, ended=at))
    assert not parse_filter('end_time > "2000-01-01T00:00:00Z"').matches(
        make(5, state=JobState.RUNNING, created=at))
    # a terminal job without end_time ended at its last update, as the history counts it
    nameless = make(6, state=JobState.STOPPED, created=old, ended=at)
    nameless.end_time = None
    assert flt.matches(nameless)
    [archived] = entries([nameless])
    assert archived.end_us == us("2026-12-01T00:00:00+00:00") and flt.matches(archived)


@pytest.mark.parametrize("text", [
    'create_time >= "2026-12-01"', 'create_time >= "2026-12-01T00:00:00"',  # no zone
    'create_time >= "2026-13-01T00:00:00Z"', 'create_time >= "2026-02-30T00:00:00Z"',
    'create_time >= "2026-12-01T00:00:60Z"', 'create_time >= "2026-12-01T00:00:00Zjunk"',
    'create_time >= " 2026-12-01T00:00:00Z"', 'create_time >= "2026-12-01T00:00:00+24:00"',
    'create_time >= "2026-12-01T00:00:00.Z"', 'create_time >= "2026-12-01T00:00:00.1234567890Z"',
    'create_time = "2026-12-01T00:00:00Z"', 'create_time != "2026-12-01T00:00:00Z"',
    "state > RUNNING", "labels.a>=b", 'update_time < "2026-12-01T00:00:00Z"', "create_time >= ",
    'end_time = "2026-12-01T00:00:00Z"', 'end_time >= "yesterday"',
])
def test_bad_time_terms_name_the_filter(text: str) -> None:
    from dlsched.errors import InvalidArgument
    with pytest.raises(InvalidArgument) as ei:
        parse_filter(text)
    assert [v.field for v in ei.value.violations] == ["filter"]


def test_the_cache_walks_only_the_create_time_slice() -> None:
    from job_manager.cache import JobCache

    class Counting(Filter):
        checked = 0

        def matches(self, job: Job) -> bool:
            Counting.checked += 1
            return super().matches(job)

    cache = JobCache()
    # a third running; the rest ended in reverse create order
    jobs = [make(i, state=JobState.RUNNING if i % 3 == 2 else TERMINAL[i % 3], project=["", "p1"][i % 2],
                 ended=T0 + timedelta(milliseconds=4000 - i)) for i in range(4000)]
    for rev, j in enumerate(jobs, start=1):
        cache.apply(rev, j.id, job_to_bytes(j))
    viewer = Principal("v", roles={"p1": Role.VIEWER})
    for text, p, walked in [
            # 1000 ms of 2000: jobs 2000..3999
            ('create_time >= "2026-01-01T00:00:01Z"', None, 2000),
            # 10 ms: 20 jobs, whichever index names them
            ('create_time >= "2026-01-01T00:00:00.5Z" AND create_time < "2026-01-01T00:00:00.51Z"',
             None, 20),
            ('state=FAILED AND create_time >= "2026-01-01T00:00:00.5Z" AND '
             'create_time < "2026-01-01T00:00:00.51Z"', None, 20 // 3 + 1),
            ('create_time < "2026-01-01T00:00:00.005Z"', viewer, 5),
            ('create_time < "2026-01-01T00:00:00.005Z" AND labels.group!=g1', None, 10),
            # ended: the terminal states' indexes (a third of the jobs are still running)
            ('end_time >= "2026-01-01T00:00:01Z"', None, 4000 * 2 // 3 + 1),
            ('end_time >= "2026-01-01T00:00:01Z" AND create_time < "2026-01-01T00:00:00.5Z"', None,
             1000 * 2 // 3 + 1),
            ('labels.group=g1 AND end_time >= "2026-01-01T00:00:01Z"', None, 800)]:
        flt = parse_filter(text)
        Counting.checked = 0
        got = [e.id for e in cache.select(Counting(flt.terms, flt.times), p)]
        assert got == brute(jobs, flt, p), text
        assert Counting.checked <= walked, (text, Counting.checked)
        for cut in (0, len(got) // 3):  # pages: after any position, as a page token does
            if cut < len(got):
                e = cache.get(got[cut])
                assert e is not None
                assert [x.id for x in cache.select(flt, p, e.key)] == got[cut + 1:]


# ---------------------------------------------------------------- an archived job answers like a job

def rfc3339(ts: Timestamp) -> str:
    return ts.ToDatetime(UTC).isoformat().replace("+00:00", "Z")


async def events(call, n: int, within: float = 120) -> list[pb.WatchJobsResponse]:  # type: ignore[no-untyped-def]
    """The next ``n`` WatchJobs responses that are not heartbeats."""
    out: list[pb.WatchJobsResponse] = []

    async def take() -> None:
        while len(out) < n:
            r = await call.read()
            assert r is not grpc.aio.EOF
            if r.type != job_pb2.WATCH_EVENT_TYPE_HEARTBEAT:
                out.append(r)
    await asyncio.wait_for(take(), within)
    return out


async def test_an_archived_job_answers_stop_logs_and_usage(etcd: EtcdServer, dsn: str) -> None:
    """StopJob, StreamJobLogs and GetJobUsage of a job that ran on the local
    driver and was then archived answer as for a live ended job (its driver
    answers from its records); a time-range filter reaches WatchJobs' events;
    the archiver's metrics show on /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.test_metrics import scrape

    st = Stack(etcd, f"/dlsched-hist-{uuid.uuid4().hex[:8]}/", jm_args=[
        "--history-dsn", dsn, "--history-retention", "0", "--archive-interval", "0.3",
        "--metrics-listen", "127.0.0.1:0"])
    client = await connect(etcd.endpoint)
    store = JobStore(client, st.prefix)
    try:
        st.start()
        assert st.jm is not None
        cluster = await st.register_local()
        code = "import sys\nprint('one')\nprint('two', flush=True)\nprint('err', file=sys.stderr)\n"
        spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[
            job_pb2.ReplicaGroup(role="main", replicas=1, command=["python3", "-c", code])])
        spec.cluster_selector.cluster = cluster
        async with security.channel(st.jm.address) as ch:
            jm = pb_grpc.JobManagerServiceStub(ch)
            # A job id the history is asked about is a job id first: NUL (which PostgreSQL
            # refuses: UNAVAILABLE, retried) or a megabyte is INVALID_ARGUMENT naming it.
            for bad in ("a\x00b", "a" * 1_000_000):
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await jm.SubmitJob(pb.SubmitJobRequest(job_id=bad, spec=spec), timeout=60)
                assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value.details()
                assert "job_id" in (ei.value.details() or "")
            job = (await jm.SubmitJob(pb.SubmitJobRequest(
                job_id=f"a{uuid.uuid4().hex[:8]}", spec=spec), timeout=60)).job

            async def archived() -> bool:
                return job.name.removeprefix("jobs/") not in await etcd_ids(store)
            await until(archived, what="the job ending and leaving etcd")
            got = (await jm.GetJob(pb.GetJobRequest(name=job.name), timeout=30)).job
            assert got.state == job_pb2.JOB_STATE_SUCCEEDED and got.backend_job_id

            # StopJob of an ended job changes nothing and returns it, archived or not
            stopped = (await jm.StopJob(pb.StopJobRequest(
                name=job.name, request_id=uuid.uuid4().hex), timeout=30)).job
            assert stopped == got
            assert (await jm.GetJob(pb.GetJobRequest(name=job.name), timeout=30)).job == got

            # Logs and usage: from its driver, with the archived backend id
            async def lines(**kw: Any) -> list[tuple[int, str]]:
                return [(e.stream, e.text) async for r in jm.StreamJobLogs(
                    pb.StreamJobLogsRequest(name=job.name, **kw), timeout=60) for e in r.entries]
            out = job_pb2.LOG_STREAM_STDOUT
            assert sorted(await lines()) == sorted([(out, "one"), (out, "two"),
                                                    (job_pb2.LOG_STREAM_STDERR, "err")])
            assert await lines(follow=True, streams=[out]) == [(out, "one"), (out, "two")]
            assert await lines(tail_lines=1, streams=[out]) == [(out, "two")]
            usage = (await jm.GetJobUsage(pb.GetJobUsageRequest(name=job.name), timeout=30)).usage
            assert usage.HasField("sample_time")

            # An archived job its driver never knew: the driver's NOT_FOUND, as for a live job
            ghost = make(7, created=T0 + timedelta(days=1), ended=datetime.now(UTC), cluster=cluster)
            ghost.id = f"g{uuid.uuid4().hex[:8]}"
            await put_jobs(client, st.prefix, [ghost])

            async def ghost_archived() -> bool:
                return ghost.id not in await etcd_ids(store)
            await until(ghost_archived, what="the ghost leaving etcd")
            assert (await jm.StopJob(pb.StopJobRequest(name=ghost.name), timeout=30)).job.name == ghost.name
            for call in (jm.GetJobUsage(pb.GetJobUsageRequest(name=ghost.name), timeout=30),
                         lines_of(jm, ghost.name)):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call
                assert e.value.code() == grpc.StatusCode.NOT_FOUND

            # WatchJobs with a time range: events of jobs created in it only
            cut = rfc3339(got.create_time)
            # A consistent read first: the cache shows the archiver's deletes (the
            # watches' snapshots come from it)
            await jm.ListJobs(pb.ListJobsRequest(page_size=1), timeout=60)
            newer = jm.WatchJobs(pb.WatchJobsRequest(filter=f'create_time > "{cut}"'))
            older = jm.WatchJobs(pb.WatchJobsRequest(filter=f'create_time <= "{cut}"'))
            try:
                for w in (newer, older):  # snapshots: no live job in either range
                    (first,) = await events(w, 1)
                    assert first.type == job_pb2.WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE
                b = (await jm.SubmitJob(pb.SubmitJobRequest(spec=spec), timeout=60)).job
                (ev,) = await events(newer, 1)
                assert ev.type == job_pb2.WATCH_EVENT_TYPE_CREATED and ev.job.name == b.name
                # an unfinished job created long ago (nobody runs clusters/ghost): older's
                # first event, though B's came before it
                old_live = make(9, state=JobState.RUNNING, cluster="clusters/ghost")
                old_live.id = f"o{uuid.uuid4().hex[:8]}"
                await put_jobs(client, st.prefix, [old_live])
                (ev,) = await events(older, 1)
                assert ev.job.name == old_live.name
                c = (await jm.SubmitJob(pb.SubmitJobRequest(spec=spec), timeout=60)).job
                seen: set[str] = set()
                while c.name not in seen:
                    seen |= {r.job.name for r in await events(newer, 1)}
                assert seen <= {b.name, c.name}
                # ListJobs: the same ranges over live and archived jobs
                a = got.name.removeprefix("jobs/")
                assert await list_ids(jm, f'create_time <= "{cut}"', 1) == [a, ghost.id, old_live.id]
                assert await list_ids(jm, f'create_time <= "{cut}" AND create_time > '
                                          '"2026-01-01T00:00:00.004Z"', 1) == [a, ghost.id]
                assert await list_ids(jm, f'create_time > "{cut}"', 1) == [
                    c.name.removeprefix("jobs/"), b.name.removeprefix("jobs/")]

                # Archiving is no deletion: B and C move to the history and their
                # watchers hear nothing of it; a job deleted from etcd is DELETED
                archived_ids = {b.name.removeprefix("jobs/"), c.name.removeprefix("jobs/")}

                async def both_archived() -> bool:
                    return not archived_ids & await etcd_ids(store)
                await until(both_archived, what="B and C leaving etcd")
                gone = make(12, state=JobState.RUNNING, cluster="clusters/ghost",
                            created=datetime.now(UTC))
                gone.id = f"d{uuid.uuid4().hex[:8]}"
                await put_jobs(client, st.prefix, [gone])
                assert await store.delete(gone.id) is not None
                rest: list[pb.WatchJobsResponse] = []
                while not any(r.type == job_pb2.WATCH_EVENT_TYPE_DELETED for r in rest):
                    rest += await events(newer, 1)
                assert [(r.type, r.job.name) for r in rest][-2:] == [
                    (job_pb2.WATCH_EVENT_TYPE_CREATED, gone.name),
                    (job_pb2.WATCH_EVENT_TYPE_DELETED, gone.name)], rest
                assert {r.job.name for r in rest[:-2]} <= {b.name, c.name}
                assert all(r.type == job_pb2.WATCH_EVENT_TYPE_UPDATED for r in rest[:-2])
            finally:
                newer.cancel()
                older.cancel()

        # The archiver's metrics
        text, s = scrape(st.jm)
        assert s[("dlsched_history_jobs_archived_total", ())] >= 2
        assert s[("dlsched_history_archive_last_round_timestamp_seconds", ())] > time.time() - 600
        assert ("dlsched_history_archive_round_seconds", ()) in s
        assert ("dlsched_history_jobs_pruned_total", ()) in s
        assert [f.name for f in text_string_to_metric_families(text)].count(
            "dlsched_history_jobs_archived") == 1
    finally:
        st.stop()
        await client.delete_prefix(st.prefix.encode())
        await client.close()


async def lines_of(jm: pb_grpc.JobManagerServiceStub, name: str) -> list[str]:
    return [e.text async for r in jm.StreamJobLogs(pb.StreamJobLogsRequest(name=name), timeout=60)
            for e in r.entries]


async def test_deleting_an_archived_job_while_its_driver_is_down_cleans_it_up_later(
        etcd: EtcdServer, tmp_path: pathlib.Path) -> None:
    """DeleteJob of an archived job while its driver is down (SIGKILLed): the clean-up that
    failed is retried, and once the driver is back the job's files go (the failure was logged
    "ignored": its directory, logs and all, stayed for good)."""
    st = Stack(etcd, f"/dlsched-hist-{uuid.uuid4().hex[:8]}/", jm_args=[
        "--history-dsn", str(tmp_path / "history.db"), "--history-retention", "0", "--archive-interval", "0.3"])
    client = await connect(etcd.endpoint)
    store = JobStore(client, st.prefix)
    try:
        st.start()
        assert st.jm is not None
        cluster = await st.register_local()
        spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[
            job_pb2.ReplicaGroup(role="main", replicas=1, command=["python3", "-c", "print('done')"])])
        spec.cluster_selector.cluster = cluster
        async with security.channel(st.jm.address) as ch:
            jm = pb_grpc.JobManagerServiceStub(ch)
            job = (await jm.SubmitJob(pb.SubmitJobRequest(job_id=f"d{uuid.uuid4().hex[:8]}", spec=spec),
                                      timeout=60)).job
            job_id = job.name.removeprefix("jobs/")

            async def archived() -> bool:
                return job_id not in await etcd_ids(store)
            await until(archived, what="the job ending and leaving etcd")
            files = pathlib.Path(st.driver.args[1]) / "jobs" / job_id
            assert files.is_dir()
            args, address = list(st.driver.args), st.driver.address
            st.driver.kill()
            await jm.DeleteJob(pb.DeleteJobRequest(name=job.name), timeout=60)
            st.driver.args = [*args, "--listen", address]  # where ClusterManager knows it
            try:
                await asyncio.to_thread(st.driver.start)
            finally:
                st.driver.args = args

            async def gone() -> bool:
                return not files.exists()
            await until(gone, what="the deleted job's files going once its driver is back")
    finally:
        await client.close()
        st.stop()


async def test_a_postgresql_that_is_down_is_unavailable_not_an_internal_error() -> None:
    """asyncpg raises bare OSErrors (connection refused) when PostgreSQL is down: every read says
    STORE_UNAVAILABLE (retry), never an INTERNAL traceback, and gives up in bounded time."""
    from dlsched.errors import StoreUnavailable
    from tests.harness import free_port

    store = await HistoryStore.open(f"postgresql://u:p@127.0.0.1:{free_port()}/db", migrate_schema=False)
    try:
        for read in (store.count(), store.get("x"), store.select(Filter(), None, None, 10)):
            with pytest.raises(StoreUnavailable):
                await asyncio.wait_for(read, 60)
    finally:
        await store.close()


@pytest.mark.parametrize("outage", ["down", "recovering"])
async def test_a_jobmanager_started_while_its_postgresql_is_down_waits_for_it(etcd: EtcdServer, outage: str) -> None:
    """JobManager started (or restarted by its supervisor) while its history's PostgreSQL is down
    waits for it, as for etcd, then serves: it exited with a traceback (the migration's
    connection refused) and stayed down once the database was back. ``recovering``: the server
    runs but takes no connection yet ("not yet accepting connections", SQLSTATE 57P03, as after
    a crash while it replays its log): waited for too (it exited, as CI saw once after a restart)."""
    from tests.harness import ServiceProcess

    try:
        server = PostgresServer()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    server.start()
    st = Stack(etcd, f"/dlsched-hist-{uuid.uuid4().hex[:8]}/", jm_args=history_args(await server.database()))
    try:
        if outage == "down":
            server.signal_all(signal.SIGKILL)
            assert server.proc is not None
            server.proc.wait()
        else:
            await asyncio.to_thread(server.standby)
        st.driver.start()
        st.cm.start()
        st.jm = ServiceProcess("job_manager", [*etcd.service_args(), "--prefix", st.prefix,
                                               "--cluster-manager", st.cm.address, *st.jm_args], name="job-manager")
        jm_up = asyncio.create_task(asyncio.to_thread(st.jm.start, 240))
        deadline = time.monotonic() + 120
        while "the job history's database cannot be reached" not in st.jm.log():
            assert time.monotonic() < deadline, st.jm.log()[-2000:]
            assert not jm_up.done() and (st.jm.proc is None or st.jm.proc.poll() is None), st.jm.log()[-2000:]
            await asyncio.sleep(0.5)
        assert st.jm.proc is not None and st.jm.proc.poll() is None  # waiting, alive
        await asyncio.to_thread(server.restart if outage == "down" else server.promote)
        await jm_up
        await st.register_local()
        async with security.channel(st.jm.address) as ch:
            stub = pb_grpc.JobManagerServiceStub(ch)
            job = (await stub.SubmitJob(pb.SubmitJobRequest(spec=job_pb2.JobSpec(
                run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS,
                replica_groups=[job_pb2.ReplicaGroup(role="main", replicas=1, command=["true"])])))).job
            assert (await stub.GetJob(pb.GetJobRequest(name=job.name))).job.uid == job.uid
    finally:
        if "jm_up" in locals():  # its thread may still be starting JobManager: not left running
            with contextlib.suppress(Exception):
                await jm_up
        st.stop()
        server.stop()


async def test_a_frozen_postgresql_fails_in_bounded_time_and_the_store_recovers() -> None:
    """Every PostgreSQL process SIGSTOPped: the connections stay open and nothing answers.
    Reads (SubmitJob waits on the request-id look-up) end STORE_UNAVAILABLE, not never
    (asyncpg's command timeout), and the reads right after fail at once; a batch of writes
    fails as one, not each alone after its own timeout; once PostgreSQL is let go the same
    store reads and writes again."""
    from dlsched.errors import StoreUnavailable

    try:
        server = PostgresServer()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    server.start()
    try:
        store = await HistoryStore.open(await server.database())
        try:
            await store.put(entries([make(1)]))
            server.signal_all(signal.SIGSTOP)
            try:
                with pytest.raises(StoreUnavailable, match="no answer"):
                    await asyncio.wait_for(store.get("h00001"), 60)  # a hang fails here, TimeoutError
                # The reads right after fail at once, holding no connection for a timeout of their own.
                for read in (store.job_for_request("r"), store.count(), store.select(Filter(), None, None, 10)):
                    with pytest.raises(StoreUnavailable, match="did not answer just now"):
                        await asyncio.wait_for(read, 60)
                writes = [store.put(entries([make(i)])) for i in range(2, 22)]
                got = await asyncio.wait_for(asyncio.gather(*writes, return_exceptions=True), 300)
                assert all(isinstance(r, StoreUnavailable) for r in got), got
                assert store.stats.isolated == 0  # the batch was not retried op by op
            finally:
                server.signal_all(signal.SIGCONT)
            await asyncio.wait_for(store.put(entries([make(2)])), 120)
            deadline = time.monotonic() + 120
            while True:  # reads are asked again a few seconds after the last failure
                try:
                    got2 = await store.get("h00002")
                    break
                except StoreUnavailable:
                    assert time.monotonic() < deadline, "reads never came back"
                    await asyncio.sleep(0.5)
            assert got2 is not None and got2.job().id == "h00002"
        finally:
            await store.close()
    finally:
        server.stop()


async def test_a_slow_statement_fails_alone_and_migrations_wait_past_the_timeout(
        pg: PostgresServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The statement timeout (here 1 s) is for a database that stopped answering: a batch-mate
    that is only slow fails alone (the database still answers), and a replica's schema upgrade
    waits for another's migration lock longer than that and starts."""
    import asyncpg  # type: ignore[import-untyped]

    from dlsched.errors import StoreUnavailable
    from job_manager.history import store as store_mod

    monkeypatch.setattr(store_mod, "COMMAND_TIMEOUT_SECONDS", 1.0)
    dsn = await pg.database()
    store = await HistoryStore.open(dsn)
    try:
        async def slow(conn: Any) -> None:
            await conn.execute(sa.text("SELECT pg_sleep(3)"))

        held = asyncio.ensure_future(store._write(slow))  # noqa: SLF001 - an op of the writer's batch
        mates = [store.put(entries([make(i)])) for i in range(1, 6)]
        got = await asyncio.wait_for(asyncio.gather(held, *mates, return_exceptions=True), 120)
        assert isinstance(got[0], StoreUnavailable) and "within 1 s" in got[0].message, got[0]
        assert got[1:] == [None] * 5, got  # the others were written
        assert store.stats.isolated == 6  # one batch, split: the slow one failed alone
        assert await store.count() == 5
        # Writes that all hang while the database answers (another migration's lock): a
        # batch fails after two of its operations timed out alone, not one timeout each.
        before = store.stats.isolated
        ops = [asyncio.ensure_future(store._write(slow)) for _ in range(6)]  # noqa: SLF001
        got = await asyncio.wait_for(asyncio.gather(*ops, return_exceptions=True), 120)
        assert all(isinstance(r, StoreUnavailable) for r in got), got
        assert store.stats.isolated - before == 2
    finally:
        await store.close()
    # Another replica migrating: its transaction holds the lock 3 s, past the timeout.
    conn = await asyncpg.connect(dsn)
    try:
        tr = conn.transaction()
        await tr.start()
        await conn.execute(f"SELECT pg_advisory_xact_lock({migrate._PG_LOCK})")  # noqa: SLF001
        opening = asyncio.ensure_future(HistoryStore.open(dsn))
        await asyncio.sleep(3)
        assert not opening.done()  # waiting for the lock, not failed at 1 s
        await tr.rollback()
        second = await asyncio.wait_for(opening, 60)
        await second.close()
    finally:
        await conn.close()


# ---------------------------------------------------------------- request ids of archived jobs

@contextlib.asynccontextmanager
async def archiving_stack(etcd: EtcdServer, dsn: str, marker: pathlib.Path, *,
                          sweep: str) -> AsyncIterator[tuple[Stack, JobStore, job_pb2.JobSpec]]:
    """A stack that archives every ended job at once (its request keys swept every ``sweep``
    seconds), its store, and a spec that appends a line to ``marker`` each time it runs."""
    st = Stack(etcd, f"/dlsched-hist-{uuid.uuid4().hex[:8]}/", jm_args=[
        "--history-dsn", dsn, "--history-retention", "0", "--archive-interval", "0.3",
        "--request-sweep-interval", sweep])
    client = await connect(etcd.endpoint)
    try:
        st.start()
        cluster = await st.register_local()
        code = f"open({str(marker)!r}, 'a').write('ran\\n')"
        spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[
            job_pb2.ReplicaGroup(role="main", replicas=1, command=["python3", "-c", code])])
        spec.cluster_selector.cluster = cluster
        yield st, JobStore(client, st.prefix), spec
    finally:
        st.stop()
        await client.delete_prefix(st.prefix.encode())
        await client.close()


async def test_a_retried_submit_finds_its_archived_job_and_runs_nothing_twice(
        etcd: EtcdServer, dsn: str, tmp_path: Any) -> None:
    """A SubmitJob retried with the request_id of a job that ran, was archived
    and whose etcd request key was swept answers that job (same uid), with or
    without its job_id and whatever the clusters now; nothing new is stored or
    run. Another principal's retry with that request_id is refused."""
    from tests.test_cluster_manager import reason

    marker = tmp_path / "runs"
    async with archiving_stack(etcd, dsn, marker, sweep="0.5") as (st, store, spec):
        assert st.jm is not None
        job_id, rid = f"r{uuid.uuid4().hex[:8]}", f"req-{uuid.uuid4().hex}"
        async with security.channel(st.jm.address) as ch:
            jm = pb_grpc.JobManagerServiceStub(ch)

            async def submit(job_id: str = "", spec: job_pb2.JobSpec = spec,
                             stub: pb_grpc.JobManagerServiceStub = jm) -> job_pb2.Job:
                resp: pb.SubmitJobResponse = await stub.SubmitJob(pb.SubmitJobRequest(
                    job_id=job_id, request_id=rid, spec=spec), timeout=60)
                return resp.job
            first = await submit(job_id)

            async def archived() -> bool:
                return job_id not in await etcd_ids(store)
            await until(archived, what="the job ending and leaving etcd")
            # Its request key may still be in etcd, or already swept: the same job
            again = await submit()
            assert again.uid == first.uid and again.state == job_pb2.JOB_STATE_SUCCEEDED

            async def swept() -> bool:
                return await store.request_job_id(rid) is None
            await until(swept, what="the request key leaving etcd")
            for retry in (await submit(), await submit(job_id)):
                assert retry.name == first.name and retry.uid == first.uid
                assert retry.state == job_pb2.JOB_STATE_SUCCEEDED
            # whatever the clusters now: no cluster matches this one
            nowhere = job_pb2.JobSpec()
            nowhere.CopyFrom(spec)
            nowhere.cluster_selector.cluster = "clusters/nowhere"
            assert (await submit(spec=nowhere)).uid == first.uid

            # another principal's retry with that request id: refused, never handed the job
            acc = AccessClient(st.jm.address, channel=ch)
            sa_name = f"hr{uuid.uuid4().hex[:6]}"
            await acc.create_role_binding(f"sa:{sa_name}", "default", "member")
            _, secret = await acc.create_api_token(sa_name)
            async with security.user_channel(st.jm.address, secret) as och:
                other = pb_grpc.JobManagerServiceStub(och)
                for jid in ("", job_id):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await submit(jid, stub=other)
                    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
                    assert reason(e.value) == "REQUEST_ID_IN_USE"

            # nothing new stored, nothing ran twice
            assert await etcd_ids(store) == set()
            assert await list_ids(jm) == [job_id]
        await asyncio.sleep(2)  # a launch made by mistake would have run by now
        assert marker.read_text() == "ran\n"


async def test_deleting_an_archived_job_frees_its_request_id(etcd: EtcdServer, dsn: str,
                                                             tmp_path: Any) -> None:
    """DeleteJob of an archived job whose request key the sweep has not reached yet frees its
    request_id, as a live delete does (SubmitJobRequest.request_id): the same request makes a
    new job, which runs. The key names the deleted job: it answered ABORTED naming that job
    (maybe another project's) until the sweep came. While archived, another job with its id
    is ALREADY_EXISTS in the words a live one gets (not that it has ended)."""
    marker = tmp_path / "runs"
    async with archiving_stack(etcd, dsn, marker, sweep="3600") as (st, store, spec):
        assert st.jm is not None
        job_id, rid = f"f{uuid.uuid4().hex[:8]}", f"req-{uuid.uuid4().hex}"
        async with security.channel(st.jm.address) as ch:
            jm = pb_grpc.JobManagerServiceStub(ch)
            first = (await jm.SubmitJob(pb.SubmitJobRequest(job_id=job_id, request_id=rid, spec=spec),
                                        timeout=60)).job

            async def archived() -> bool:
                return job_id not in await etcd_ids(store)
            await until(archived, what="the job ending and leaving etcd")
            assert await store.request_job_id(rid) == job_id  # not swept (an hour)
            with pytest.raises(grpc.aio.AioRpcError) as taken:
                await jm.SubmitJob(pb.SubmitJobRequest(job_id=job_id, spec=spec), timeout=60)
            assert taken.value.code() == grpc.StatusCode.ALREADY_EXISTS
            assert taken.value.details() == f"job jobs/{job_id} already exists"

            await jm.DeleteJob(pb.DeleteJobRequest(name=first.name), timeout=60)
            again = (await jm.SubmitJob(pb.SubmitJobRequest(request_id=rid, spec=spec), timeout=60)).job
            assert again.uid != first.uid and again.name != first.name
            retried = (await jm.SubmitJob(pb.SubmitJobRequest(request_id=rid, spec=spec), timeout=60)).job
            assert retried.uid == again.uid  # the new job is the request's now

            async def ran_again() -> bool:
                return _lines(marker) == 2
            await until(ran_again, what="the new job running")
        await asyncio.sleep(2)  # a third run made by mistake would have happened by now
        assert _lines(marker) == 2


def _lines(path: pathlib.Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


async def test_a_sqlite_file_removed_under_a_running_store_fails_its_writes_and_reads(
        tmp_path: pathlib.Path) -> None:
    """The SQLite file removed (or replaced) while JobManager runs: pooled connections wrote into
    the unlinked file and new ones into a new empty one, each write 'committed', so the archiver
    deleted from etcd jobs no history kept (3,000 lost). Writes and reads now fail
    (STORE_UNAVAILABLE) while the file opened is not the one at its path: the jobs stay in etcd."""
    from dlsched.errors import StoreUnavailable

    path = tmp_path / "history.db"
    store = await HistoryStore.open(f"sqlite+aiosqlite:///{path}")
    try:
        await store.put(entries([make(1)]))
        assert (await store.get("h00001")) is not None
        for f in ("history.db", "history.db-wal", "history.db-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_path / f)
        with pytest.raises(StoreUnavailable):
            await store.put(entries([make(2), make(3)]))
        with pytest.raises(StoreUnavailable):
            await store.get("h00001")
        path.write_bytes(b"")  # another file at the path: not the one opened either
        with pytest.raises(StoreUnavailable):
            await store.put(entries([make(4)]))
    finally:
        await store.close()


async def test_a_sqlite_write_lock_held_elsewhere_fails_a_batch_at_once(tmp_path: pathlib.Path) -> None:
    """Another process holds SQLite's write lock past the busy timeout: the batch fails as one,
    not each operation run again alone, waiting out its own timeout one after another (eight
    writes took 80 s, the last DeleteJobs ran into their deadline)."""
    import sqlite3

    from dlsched.errors import StoreUnavailable

    path = tmp_path / "history.db"
    store = await HistoryStore.open(f"sqlite+aiosqlite:///{path}")
    other = sqlite3.connect(path, isolation_level=None)
    try:
        await store.put(entries([make(0)]))
        other.execute("BEGIN IMMEDIATE")  # the write lock, held
        writes = [asyncio.ensure_future(store.put(entries([make(i)]))) for i in range(1, 9)]
        done = await asyncio.gather(*writes, return_exceptions=True)
        assert all(isinstance(r, StoreUnavailable) for r in done), done
        assert store.stats.isolated == 0, store.stats  # none run again alone
        other.execute("ROLLBACK")
        await store.put(entries([make(9)]))  # the lock let go: writes go through again
        assert (await store.get("h00009")) is not None
    finally:
        other.close()
        await store.close()


async def test_a_pending_delete_whose_job_was_archived_deletes_the_archived_copy(
        etcd: EtcdServer, etcd_prefix: str, history: HistoryStore) -> None:
    """DeleteJob answered JOB_STOP_PENDING ("it is deleted once it has stopped, no need to ask
    again"); the job stopped and was archived before a replica acted on the record (its owner
    died, the successor's sweep came after the archiver): the record's job is gone from etcd,
    and the record was dropped, the job living on in the history. Its archived copy of the
    same uid is deleted (and its clean-up recorded); another uid's is left alone."""
    from job_manager.scheduler import Scheduler, SchedulerConfig
    from job_manager.store import JobStore, PendingDelete
    from tests.test_job_manager_scheduler import FakeCM, FakeDriver, FakePool

    client = await connect(etcd.endpoint)
    store = JobStore(client, etcd_prefix)
    drv = FakeDriver()
    sched = Scheduler(store, FakeCM(), FakePool(drv), SchedulerConfig(), history=history)  # type: ignore[arg-type]
    try:
        mine, other = make(1, state=JobState.STOPPED), make(2, state=JobState.STOPPED)
        await history.put(entries([mine, other]))
        for job, uid in ((mine, mine.uid), (other, "another-uid")):
            d = PendingDelete(job.cluster, job.id, uid)
            await store.put_pending_delete(d)
            await sched._delete_stopped(d)
        assert await history.get(mine.id) is None
        assert await history.get(other.id) is not None  # not the record's job
        assert not [d for page in [p async for p in store.pending_deletes()] for d in page]
        async with asyncio.timeout(60):  # its clean-up, recorded and done by its driver
            while drv.cleaned != [mine.id]:
                await asyncio.sleep(0.05)
    finally:
        await sched.close()
        await client.close()
