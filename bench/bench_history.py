"""The job history (job_manager/history) against bare database baselines, in one run.

    .venv/bin/python bench/bench_history.py [--archived 1000000] [--db sqlite|postgresql|both]
        [--archive-jobs 5000] [--prune 100000] [--pages 200]

For each database (a SQLite file in a temp dir; a real PostgreSQL started in
a temp dir from Debian's packages, tests/postgres.py):

- bare insert: ``--archived`` synthetic archived jobs (the store's encoding,
  ~400 bytes each, one label row each) written straight into the history's
  tables with the bare driver (sqlite3 executemany / asyncpg COPY), rows/s;
  then the history's own upsert (``HistoryStore.put``, 500 per batch, through
  the one writer) of 20,000 more, rows/s;
- bare keyset query: the same page (50 rows, newest first, after a key deep in
  the table) as a hand-written SQL statement on the bare driver, p50/p99;
- ListJobs page p50/p99 through a real JobManager (TLS, tokens, etcd with a
  few live jobs, ``--history-dsn`` at that database): the first page, a deep
  page by token, ``state=FAILED``, ``labels.group=g3``, ``labels.rare=yes``
  (1 job in 1,000) and ``labels.group=g3 AND labels.rare!=yes``; target
  p50 <= 20 ms at 1,000,000 archived;
- archive rate: once JobManager's archiver leads, ``--archive-jobs`` finished
  jobs past the retention written into etcd; the time from the first write
  until etcd holds none (history write, then one fenced etcd delete per
  job), jobs/s;
- pruning: ``--prune`` of the oldest-ended jobs deleted by
  ``HistoryStore.prune`` (5,000 per transaction), jobs/s; target >= 1,000/s.

Building 1,000,000 rows takes a few minutes per database on a small machine;
``--archived 100000`` gives the same rows in a minute (the report says the
size it measured).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import sqlite3
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aetcd import rpc  # noqa: E402

from bench.stats import ms, pct  # noqa: E402
from dlsched.kit import etcd as etcd_kit  # noqa: E402
from dlsched.v1 import job_manager_service_pb2 as jms  # noqa: E402
from dlsched.v1 import job_manager_service_pb2_grpc as jms_grpc  # noqa: E402
from dlsched.v1 import job_pb2  # noqa: E402
from job_manager.convert import job_to_bytes  # noqa: E402
from job_manager.domain.model import Job, JobSpec, JobState, ReplicaGroup  # noqa: E402
from job_manager.history.store import ArchivedJob, HistoryStore  # noqa: E402
from tests import security  # noqa: E402
from tests.harness import EtcdServer, Stack  # noqa: E402
from tests.postgres import PostgresServer  # noqa: E402

T0 = datetime(2025, 1, 1, tzinfo=UTC)
STATES = [int(JobState.SUCCEEDED), int(JobState.FAILED), int(JobState.STOPPED)]
PAGE = 50


def template() -> job_pb2.Job:
    j = Job(id="x", uid="u", state=JobState.SUCCEEDED, cluster="clusters/local", attempt=1,
            create_time=T0, update_time=T0, end_time=T0, owner="user:bench", project="team-a",
            message="exited 0", backend_job_id="b1",
            spec=JobSpec(run_mode=1, replica_groups=[ReplicaGroup(
                role="main", replicas=1, command=["python", "train.py", "--epochs", "10"])]))
    return job_pb2.Job.FromString(job_to_bytes(j))


def rows(start: int, n: int) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """(job rows, label rows) of synthetic archived jobs ``start``..``start+n``:
    one per ms from T0, ended a minute later."""
    p = template()
    jobs, labels = [], []
    for i in range(start, start + n):
        jid = f"a{i:08d}"
        ct_us = int(T0.timestamp() * 1_000_000) + i * 1000
        end_us = ct_us + 60_000_000
        state = STATES[i % 3]
        group = f"g{i % 20}"
        p.name = f"jobs/{jid}"
        p.uid = f"u{i}"
        p.state = state  # type: ignore[assignment]
        p.create_time.seconds, p.create_time.nanos = divmod(ct_us, 1_000_000)
        p.create_time.nanos *= 1000
        p.end_time.seconds, p.end_time.nanos = divmod(end_us, 1_000_000)
        p.end_time.nanos *= 1000
        p.labels.clear()
        p.labels["group"] = group
        if i % 1000 == 7:
            p.labels["rare"] = "yes"
        data = p.SerializeToString(deterministic=True)
        jobs.append((jid, ct_us, end_us, end_us, state, 1, "clusters/local", "team-a",
                     "user:bench", 1000 + i, data))
        labels.append((jid, "group", group, ct_us))
        if i % 1000 == 7:
            labels.append((jid, "rare", "yes", ct_us))
    return jobs, labels


CHUNK = 50_000


def fill_sqlite(path: str, n: int) -> float:
    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    dt = 0.0  # the inserts only, not making the rows
    for start in range(0, n, CHUNK):
        jobs, labels = rows(start, min(CHUNK, n - start))
        t = time.perf_counter()
        with db:
            db.executemany("INSERT INTO job_history (id, create_us, end_us, archived_us, state, "
                           "run_mode, cluster, project, owner, revision, data) "
                           "VALUES (?,?,?,?,?,?,?,?,?,?,?)", jobs)
            db.executemany("INSERT INTO job_history_labels (job_id, key, value, create_us) "
                           "VALUES (?,?,?,?)", labels)
        dt += time.perf_counter() - t
    db.execute("ANALYZE")
    db.close()
    return dt


async def fill_pg(dsn: str, n: int) -> float:
    import asyncpg  # type: ignore[import-untyped]

    conn = await asyncpg.connect(dsn)
    dt = 0.0
    for start in range(0, n, CHUNK):
        jobs, labels = rows(start, min(CHUNK, n - start))
        t = time.perf_counter()
        await conn.copy_records_to_table("job_history", records=jobs, columns=[
            "id", "create_us", "end_us", "archived_us", "state", "run_mode", "cluster",
            "project", "owner", "revision", "data"])
        await conn.copy_records_to_table("job_history_labels", records=labels,
                                         columns=["job_id", "key", "value", "create_us"])
        dt += time.perf_counter() - t
    await conn.execute("ANALYZE")
    await conn.close()
    return dt


KEYSET_SQL = ("SELECT id, data, revision FROM job_history WHERE create_us <= {ct} AND "
              "(create_us < {ct} OR id > {id}) ORDER BY create_us DESC, id ASC LIMIT 50")


async def bare_keyset(db: str, target: str, n: int, reps: int) -> list[float]:
    mid = n // 2
    ct = int(T0.timestamp() * 1_000_000) + mid * 1000
    jid = f"a{mid:08d}"
    out = []
    if db == "sqlite":
        conn = sqlite3.connect(target)
        q = KEYSET_SQL.format(ct=":ct", id=":id")
        for _ in range(reps):
            t = time.perf_counter()
            conn.execute(q, {"ct": ct, "id": jid}).fetchall()
            out.append(time.perf_counter() - t)
        conn.close()
    else:
        import asyncpg

        conn = await asyncpg.connect(target)
        q = KEYSET_SQL.format(ct="$1", id="$2")
        for _ in range(reps):
            t = time.perf_counter()
            await conn.fetch(q, ct, jid)
            out.append(time.perf_counter() - t)
        await conn.close()
    return out


async def upsert_rate(target: str, n: int, count: int = 20_000) -> float:
    h = await HistoryStore.open(target)
    try:
        jobs, _ = rows(n, count)
        entries = [ArchivedJob(r[0], r[10], r[9]) for r in jobs]
        t = time.perf_counter()  # rows made before, as for the bare insert
        await asyncio.gather(*(h.put(entries[i:i + 500]) for i in range(0, count, 500)))
        return count / (time.perf_counter() - t)
    finally:
        await h.close()


async def list_pages(address: str, reps: int, n: int) -> dict[str, list[float]]:
    async with security.channel(address) as ch:
        stub = jms_grpc.JobManagerServiceStub(ch)
        first = await stub.ListJobs(jms.ListJobsRequest(page_size=PAGE), timeout=60)
        # a token deep in the list (keyset: a deep page costs what the first does)
        deep = first.next_page_token
        for _ in range(3):
            deep = (await stub.ListJobs(jms.ListJobsRequest(page_size=1000, page_token=deep),
                                        timeout=60)).next_page_token
        cases = {"first page": ("", ""), "page 3,050 deep": ("", deep),
                 "state=FAILED": ("state=FAILED", ""), "labels.group=g3": ("labels.group=g3", ""),
                 "labels.rare=yes (1/1000)": ("labels.rare=yes", ""),
                 "group=g3 AND rare!=yes": ("labels.group=g3 AND labels.rare!=yes", "")}
        out: dict[str, list[float]] = {}
        for name, (flt, token) in cases.items():
            xs = []
            for _ in range(reps):
                t = time.perf_counter()
                r = await stub.ListJobs(jms.ListJobsRequest(page_size=PAGE, filter=flt,
                                                            page_token=token), timeout=60)
                xs.append(time.perf_counter() - t)
            assert len(r.jobs) == PAGE or n < 100_000, (name, len(r.jobs))
            out[name] = xs
        return out


async def put_old_jobs(client, prefix: str, count: int) -> None:  # type: ignore[no-untyped-def]
    await client.connect()
    key = f"{prefix}jobs/".encode()
    old = datetime.now(UTC) - timedelta(days=3)
    for start in range(0, count, 128):
        ops = []
        for i in range(start, min(count, start + 128)):
            j = Job(id=f"live{i:06d}", uid=f"l{i}", state=JobState.SUCCEEDED, cluster="clusters/local",
                    create_time=old + timedelta(milliseconds=i), update_time=old, end_time=old,
                    labels={"group": f"g{i % 20}"}, owner="user:bench", project="team-a",
                    spec=JobSpec(run_mode=1, replica_groups=[ReplicaGroup(role="main", replicas=1,
                                                                          command=["true"])]))
            ops.append(rpc.RequestOp(request_put=rpc.PutRequest(key=key + j.id.encode(),
                                                                value=job_to_bytes(j))))
        await client.kvstub.Txn(rpc.TxnRequest(success=ops), timeout=30, metadata=client.metadata)


async def etcd_jobs(client, prefix: str) -> int:  # type: ignore[no-untyped-def]
    res = await client.kvstub.Range(rpc.RangeRequest(key=f"{prefix}jobs/".encode(),
                                                     range_end=f"{prefix}jobs0".encode(),
                                                     count_only=True),
                                    timeout=30, metadata=client.metadata)
    return int(res.count)


async def run_db(db: str, args: argparse.Namespace, etcd: EtcdServer, work: str) -> None:
    n = args.archived
    pg: PostgresServer | None = None
    try:
        if db == "sqlite":
            target = os.path.join(work, f"history-{uuid.uuid4().hex[:6]}.db")
        else:
            pg = PostgresServer().start()
            target = await pg.database()
        h = await HistoryStore.open(target)  # the schema, by the migrations
        await h.close()
        print(f"\n== {db}: {n:,} archived jobs")
        dt = fill_sqlite(target, n) if db == "sqlite" else await fill_pg(target, n)
        print(f"  bare insert ({'sqlite3 executemany' if db == 'sqlite' else 'asyncpg COPY'}, "
              f"the history's indexes): {n / dt:10,.0f} rows/s  ({dt:.1f} s)")
        rate = await upsert_rate(target, n)
        print(f"  HistoryStore.put (upsert, 500/batch, one writer):     {rate:10,.0f} rows/s")
        n += 20_000
        bare = await bare_keyset(db, target, n, args.pages)
        print(f"  bare keyset query (50 rows, mid-table):   p50 {ms(pct(bare, 50))}  p99 {ms(pct(bare, 99))}")

        prefix = f"/dlsched-bench-history-{uuid.uuid4().hex[:6]}/"
        client = await etcd_kit.connect(etcd.endpoint)
        stack = Stack(etcd, prefix, jm_args=["--history-dsn", target, "--history-retention", "1d",
                                             "--archive-interval", "0.2"])
        try:
            stack.start()
            while await client.get(f"{prefix}leaders/job-archiver".encode()) is None:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            t = time.perf_counter()  # the archiver leads: the writes, then the moves
            await put_old_jobs(client, prefix, args.archive_jobs)
            while await etcd_jobs(client, prefix) > 0:
                if time.perf_counter() - t > 600:
                    raise RuntimeError("archive did not finish in 600 s")
                await asyncio.sleep(0.05)
            dt = time.perf_counter() - t
            print(f"  archive {args.archive_jobs:,} jobs etcd -> history (from their etcd put):  "
                  f"{args.archive_jobs / dt:8,.0f} jobs/s ({dt:.1f} s)")
            n += args.archive_jobs
            assert stack.jm is not None
            pages = await list_pages(stack.jm.address, args.pages, n)
            for name, xs in pages.items():
                print(f"  ListJobs {name:26s} p50 {ms(pct(xs, 50))}  p99 {ms(pct(xs, 99))}"
                      f"   (target p50 <= 20 ms)")
        finally:
            stack.stop()
            await client.delete_prefix(prefix.encode())
            await client.close()

        h = await HistoryStore.open(target)
        try:
            t = time.perf_counter()
            deleted = await h.prune(max_jobs=n - args.prune)
            dt = time.perf_counter() - t
            print(f"  prune {deleted:,} oldest (5,000 per transaction): {deleted / dt:10,.0f} jobs/s"
                  f"   (target >= 1,000/s)")
        finally:
            await h.close()
    finally:
        if pg is not None:
            pg.stop()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archived", type=int, default=1_000_000)
    ap.add_argument("--db", choices=["sqlite", "postgresql", "both"], default="both")
    ap.add_argument("--archive-jobs", type=int, default=5000)
    ap.add_argument("--prune", type=int, default=100_000)
    ap.add_argument("--pages", type=int, default=200)
    args = ap.parse_args()
    security.install()
    etcd = EtcdServer().start()
    work = tempfile.mkdtemp(prefix="dlsched-bench-history-")
    try:
        for db in (["sqlite", "postgresql"] if args.db == "both" else [args.db]):
            await run_db(db, args, etcd, work)
    finally:
        etcd.stop()
        import shutil

        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
