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
duplicates nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta

import grpc
import pytest

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
           "run_mode=SINGLE_PROCESS", "state=RUNNING"]
PRINCIPALS = [None, Principal("v", roles={"p1": Role.VIEWER}),
              Principal("w", roles={"p1": Role.VIEWER, "default": Role.VIEWER}),
              Principal("nobody", roles={})]


async def test_keyset_pages_and_filters_answer_like_a_full_read(history: HistoryStore) -> None:
    jobs = [make(i, state=TERMINAL[i % 3], project=["", "p1", "p2"][i % 7 % 3],
                 cluster=f"clusters/c{i % 4}", owner=["alice", "bob"][i % 2]) for i in range(600)]
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
                         "labels.group!=g2 AND state!=STOPPED", "labels.rare=yes"]:
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

            # DeleteJob of an archived job removes it from the history
            gone = old[10]
            resp = await jm.DeleteJob(pb.DeleteJobRequest(name=gone.name), timeout=30)
            assert resp.job.name == gone.name
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
        arch = Archiver(store, hub.cache, history, ArchiveConfig(retention_seconds=3600, batch=100),
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
        # the round swept the request keys of jobs gone from etcd; the live job's stays
        keys = [k for page in [p async for p in store.request_keys(await store.revision())]
                for k, _, _ in page]
        assert keys == [store.request_key(f"req-{live.id}")]
        assert arch.stats.request_keys_swept == 10
        moved = await history.get(changed.id)
        assert moved is not None and moved.job().message == "changed"
        assert await history.count() == 39
    finally:
        await hub.stop()
        await client.delete_prefix(etcd_prefix.encode())
        await client.close()
