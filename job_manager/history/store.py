"""The job history database: SQLAlchemy 2 Core, async (aiosqlite or asyncpg).

``HistoryStore.open(dsn)`` connects, runs the Alembic migrations to head
(``migrate.py``) and starts the one writer task. Every write (upserts from
the archiver, deletes, pruning) is queued to that task, which runs what is
queued in one transaction at a time: on SQLite (WAL mode, so readers never
wait for it) there is never a second writer to find the database locked,
whatever the number of concurrent callers; PostgreSQL gets the same batching.
Reads use pooled connections of their own.

Listing is keyset pagination on ``(create_us DESC, id)``, the watch cache's
order (``cache.sort_key``), from the position a page token names; a filter's
terms and the caller's readable projects become WHERE terms on indexed
columns, a positive ``labels.KEY=VALUE`` term walks the labels index, a
``create_time`` range bounds the walked index's create-time column.

Pruning deletes in batches (``prune_batch`` rows per statement, each its own
short transaction through the writer), by age of ``end_us`` and/or a count
of rows kept; a deleted job's labels and request ids go in the same
transaction.

``job_requests`` keeps SubmitJob's request ids of archived jobs
(``put_requests``, by the archiver's request-key sweep;
``job_for_request``), so a retried SubmitJob answers its archived job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from dlsched.auth.model import DEFAULT_PROJECT, Principal
from dlsched.errors import StoreUnavailable
from dlsched.v1 import job_pb2
from job_manager.convert import end_us_of_proto, job_from_bytes
from job_manager.domain.filter import Filter, Term
from job_manager.domain.model import Job, JobState
from job_manager.history import migrate
from job_manager.history.schema import deleted as D
from job_manager.history.schema import jobs as T
from job_manager.history.schema import labels as L
from job_manager.history.schema import requests as R

log = logging.getLogger("job_manager.history")

SortKey = tuple[float, str]

#: rows per pruning DELETE (one short transaction each)
PRUNE_BATCH = 5000
#: how long a deleted id keeps an archiver that paused before the delete from storing it again
DELETED_KEPT_SECONDS = 7 * 86400.0
#: most operations the writer runs in one transaction
WRITER_BATCH = 256


def to_us(seconds: float) -> int:
    return round(seconds * 1_000_000)


def _ts_us(ts: Any) -> int:
    return int(ts.seconds) * 1_000_000 + int(ts.nanos) // 1000


def url_of(dsn: str) -> str:
    """The SQLAlchemy URL of ``dsn``: a ``postgresql://``/``postgres://`` DSN
    (asyncpg), a ``sqlite:///`` URL or a plain file path (aiosqlite)."""
    if dsn.startswith(("postgresql://", "postgres://")):
        return "postgresql+asyncpg://" + dsn.split("://", 1)[1]
    if dsn.startswith("sqlite:///"):
        return "sqlite+aiosqlite:///" + dsn[len("sqlite:///"):]
    if "://" in dsn:
        return dsn  # already a SQLAlchemy async URL (postgresql+asyncpg://, sqlite+aiosqlite://)
    return "sqlite+aiosqlite:///" + os.path.abspath(dsn)


class ArchivedJob:
    """One job as the history holds it: its stored bytes, the etcd mod
    revision it was archived at and the fields filters and access rules read
    (so ``Filter.matches``/``access.may_read`` apply without decoding)."""

    __slots__ = ("cluster", "create_us", "data", "end_us", "id", "key", "labels", "owner",
                 "project", "revision", "run_mode", "state")

    def __init__(self, job_id: str, data: bytes, revision: int) -> None:
        p = job_pb2.Job.FromString(data)
        self.id = job_id
        self.data = data
        self.revision = revision
        self.create_us = _ts_us(p.create_time) if p.HasField("create_time") else 0
        self.end_us = end_us_of_proto(p)
        self.key: SortKey = (-self.create_us / 1_000_000, job_id)
        self.state = JobState.of(p.state)
        self.run_mode = int(p.spec.run_mode)
        self.cluster = p.cluster
        self.project = p.project
        self.owner = p.owner
        self.labels = dict(p.labels)

    @property
    def spec(self) -> ArchivedJob:  # Filter reads job.spec.run_mode
        return self

    @property
    def name(self) -> str:
        return f"jobs/{self.id}"

    def job(self) -> Job:
        return job_from_bytes(self.data, self.revision)

    def proto(self) -> job_pb2.Job:
        p = job_pb2.Job.FromString(self.data)
        p.etag = str(self.revision) if self.revision else ""
        return p


@dataclass
class _Op:
    fn: Callable[[AsyncConnection], Awaitable[Any]]
    done: asyncio.Future[Any] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass
class WriterStats:
    transactions: int = 0
    operations: int = 0
    failures: int = 0
    #: operations run again alone after their batch failed on one of them
    isolated: int = 0


class HistoryStore:
    """The history database behind one writer task; see the module docstring."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name
        self._queue: asyncio.Queue[_Op] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None
        self.stats = WriterStats()
        self._down_until = 0.0  # loop time before which reads fail at once (``_reading``)
        #: SQLite: the file opened, (path, device, inode): every read and write checks it is
        #: still the one at the path (removed or replaced, pooled connections wrote into the
        #: unlinked file and new ones into a new empty one: archived jobs lost)
        self._file: tuple[str, int, int] | None = None

    @classmethod
    async def open(cls, dsn: str, *, migrate_schema: bool = True) -> HistoryStore:
        url = url_of(dsn)
        engine = _engine(url)
        store = cls(engine)
        try:
            if migrate_schema:
                # On an engine of its own, without the statement timeout: a migration may
                # rewrite a large table, and waits for another replica's migration (lock).
                migrator = _engine(url, statement_timeout=False)
                try:
                    await migrate.upgrade(migrator)
                finally:
                    await migrator.dispose()
            store._file = _file_identity(url)
        except Exception:
            await engine.dispose()
            raise
        store._writer = asyncio.create_task(store._write_loop(), name="history-writer")
        return store

    def _check_file(self) -> None:
        """Raise ``HistoryFileGone`` when the SQLite file opened is no longer at its path."""
        if self._file is None:
            return
        path, dev, ino = self._file
        try:
            st = os.stat(path)
        except OSError as e:
            raise HistoryFileGone(f"history: the database file {path} is gone ({e.strerror})") from e
        if (st.st_dev, st.st_ino) != (dev, ino):
            raise HistoryFileGone(f"history: the database file {path} was replaced; restart JobManager")

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
            self._writer = None
        while not self._queue.empty():
            op = self._queue.get_nowait()
            if not op.done.done():
                op.done.set_exception(StoreUnavailable("history: closed"))
        await self.engine.dispose()

    # -- the one writer

    async def _write(self, fn: Callable[[AsyncConnection], Awaitable[Any]]) -> Any:
        if self._writer is None or self._writer.done():
            raise StoreUnavailable("history: writer not running")
        op = _Op(fn)
        self._queue.put_nowait(op)
        return await op.done

    async def _write_loop(self) -> None:
        while True:
            ops = [await self._queue.get()]
            while len(ops) < WRITER_BATCH and not self._queue.empty():
                ops.append(self._queue.get_nowait())
            try:
                results = await self._run(ops)
            except Exception as e:  # one failing op must not fail its batch-mates
                if len(ops) == 1 or database_down(e) or _locked(e) or (
                        _timed_out(e) and not await self._answers()):
                    # A database that is down fails them all (each alone would wait
                    # out its own timeout, one after the other), and the reads for a while.
                    if (len(ops) > 1 and not _locked(e)) or database_down(e) or _timed_out(e):  # (reads go on under a write lock)
                        self._down_until = asyncio.get_running_loop().time() + DOWN_SECONDS
                    self.stats.failures += len(ops)
                    for op in ops:
                        _settle(op, exc=_unavailable(e))
                    continue
                stuck: BaseException | None = None
                timeouts = 0
                for op in ops:  # each alone: only the failing one fails
                    if stuck is not None:  # two alone timed out: writes hang (a lock, a standby)
                        self.stats.failures += 1
                        _settle(op, exc=_unavailable(stuck))
                        continue
                    self.stats.isolated += 1
                    try:
                        (r,) = await self._run([op])
                        _settle(op, result=r)
                    except Exception as e1:
                        self.stats.failures += 1
                        _settle(op, exc=_unavailable(e1))
                        timeouts += _timed_out(e1) or _locked(e1)
                        if timeouts >= 2:
                            stuck = e1
                continue
            for op, r in zip(ops, results, strict=True):
                _settle(op, result=r)

    async def _answers(self) -> bool:
        """Whether the database answers a trivial query now (within its timeouts)."""
        try:
            async with self.engine.connect() as conn:
                await conn.execute(sa.text("SELECT 1"))
        except Exception:  # noqa: BLE001 - any failure: it does not
            return False
        return True

    async def _run(self, ops: list[_Op]) -> list[Any]:
        self._check_file()
        async with self.engine.begin() as conn:
            out = [await op.fn(conn) for op in ops]
        self._check_file()  # (committed into a file removed meanwhile: not kept, say so)
        self.stats.transactions += 1
        self.stats.operations += len(ops)
        return out

    # -- writes

    def _insert(self, table: sa.Table) -> Any:
        return (pg_dialect.insert(table) if self.dialect == "postgresql"
                else sqlite_dialect.insert(table))

    async def put(self, entries: Sequence[ArchivedJob]) -> None:
        """Upsert ``entries`` (idempotent; a row archived at a newer revision is
        kept over an older one; none of an id deleted at or after its revision),
        committed when this returns."""
        if not entries:
            return
        latest: dict[str, ArchivedJob] = {}
        for e in entries:  # one row per id (an upsert may touch a row once per statement)
            if e.id not in latest or latest[e.id].revision <= e.revision:
                latest[e.id] = e
        entries = list(latest.values())
        now = to_us(time.time())
        rows = [{"id": e.id, "create_us": e.create_us, "end_us": e.end_us, "archived_us": now,
                 "state": int(e.state), "run_mode": e.run_mode, "cluster": e.cluster,
                 "project": e.project or DEFAULT_PROJECT, "owner": e.owner,
                 "revision": e.revision, "data": e.data} for e in entries]
        label_rows = [{"job_id": e.id, "key": k, "value": v, "create_us": e.create_us}
                      for e in entries for k, v in e.labels.items()]
        ids = [e.id for e in entries]
        revisions = {e.id: e.revision for e in entries}
        ins = self._insert(T)
        upsert = ins.on_conflict_do_update(
            index_elements=[T.c.id],
            set_={c.name: ins.excluded[c.name] for c in T.columns if c.name != "id"},
            where=T.c.revision <= ins.excluded.revision)

        async def go(conn: AsyncConnection) -> None:
            gone = {str(r[0]): int(r[1]) for r in await conn.execute(
                sa.select(D.c.id, D.c.revision).where(D.c.id.in_(ids)))}
            live = [r for r in rows if revisions[str(r["id"])] > gone.get(str(r["id"]), -1)]
            if not live:
                return
            await conn.execute(upsert, live)
            # The labels of the rows as stored now (a newer revision may have won).
            stored = {str(r[0]) for r in await conn.execute(
                sa.select(T.c.id, T.c.revision).where(T.c.id.in_(ids))) if revisions[r[0]] == r[1]}
            if not stored:
                return
            await conn.execute(L.delete().where(L.c.job_id.in_(sorted(stored))))
            keep = [r for r in label_rows if r["job_id"] in stored]
            if keep:
                await conn.execute(L.insert(), keep)
        await self._write(go)

    async def delete(self, job_id: str, revision: int | None = None, *, upto: int = 0) -> bool:
        """Delete one job (only as archived at ``revision``, when given); whether it was there.
        ``upto``: the job is deleted as of this etcd revision: ``put`` stores no row of its id
        at or below it from now on (an archiver that picked the job before the delete)."""
        cond = T.c.id == job_id
        if revision is not None:
            cond = sa.and_(cond, T.c.revision == revision)
        mark = self._insert(D).values(id=job_id, revision=upto, deleted_us=to_us(time.time()))
        mark = mark.on_conflict_do_update(
            index_elements=[D.c.id], set_={"revision": sa.func.max(D.c.revision, mark.excluded.revision)
                                          if self.dialect != "postgresql"
                                          else sa.func.greatest(D.c.revision, mark.excluded.revision),
                                          "deleted_us": mark.excluded.deleted_us})

        async def go(conn: AsyncConnection) -> bool:
            if upto:
                await conn.execute(mark)
            res = await conn.execute(T.delete().where(cond))
            if res.rowcount:
                await conn.execute(L.delete().where(L.c.job_id == job_id))
                await conn.execute(R.delete().where(R.c.job_id == job_id))
            return bool(res.rowcount)
        return bool(await self._write(go))

    async def put_requests(self, pairs: Iterable[tuple[str, str]]) -> tuple[set[str], set[str]]:
        """Record (request_id, job id) pairs whose job is archived here (an
        idempotent upsert; a pair whose job is not here is skipped), committed
        when this returns: (the request ids already recorded before, those
        recorded now)."""
        wanted = dict(pairs)
        if not wanted:
            return set(), set()
        ins = self._insert(R)
        upsert = ins.on_conflict_do_update(index_elements=[R.c.request_id],
                                           set_={"job_id": ins.excluded.job_id})

        async def go(conn: AsyncConnection) -> tuple[set[str], set[str]]:
            before = {str(r[0]) for r in await conn.execute(
                sa.select(R.c.request_id).where(R.c.request_id.in_(sorted(wanted))))}
            ids = sorted({j for r, j in wanted.items() if r not in before})
            here = {str(r[0]) for r in await conn.execute(
                sa.select(T.c.id).where(T.c.id.in_(ids)))} if ids else set()
            rows = [{"request_id": r, "job_id": j} for r, j in wanted.items()
                    if r not in before and j in here]
            if rows:
                await conn.execute(upsert, rows)
            return before, {r["request_id"] for r in rows}
        before, now = await self._write(go)
        return set(before), set(now)

    async def _delete_batch(self, cond: sa.ColumnElement[bool], limit: int) -> int:
        """Delete up to ``limit`` of the oldest-ended rows matching ``cond`` in one transaction."""
        async def go(conn: AsyncConnection) -> int:
            ids = [r[0] for r in await conn.execute(
                sa.select(T.c.id).where(cond).order_by(T.c.end_us, T.c.id).limit(limit))]
            if not ids:
                return 0
            await conn.execute(L.delete().where(L.c.job_id.in_(ids)))
            await conn.execute(R.delete().where(R.c.job_id.in_(ids)))
            res = await conn.execute(T.delete().where(T.c.id.in_(ids)))
            return int(res.rowcount)
        return int(await self._write(go))

    async def prune(self, *, max_age_seconds: float = 0.0, max_jobs: int = 0,
                    batch: int = PRUNE_BATCH, now: float | None = None) -> int:
        """Delete jobs that ended more than ``max_age_seconds`` ago and the
        oldest-ended beyond ``max_jobs`` (0: no such bound), ``batch`` rows per
        transaction; the number deleted."""
        deleted = 0
        if max_age_seconds > 0:
            cutoff = to_us((now if now is not None else time.time()) - max_age_seconds)
            while True:
                n = await self._delete_batch(T.c.end_us < cutoff, batch)
                deleted += n
                if n < batch:
                    break
        if max_jobs > 0:
            excess = await self.count() - max_jobs
            while excess > 0:
                n = await self._delete_batch(sa.true(), min(batch, excess))
                if n == 0:
                    break
                deleted += n
                excess -= n
        return deleted

    async def forget_deleted(self, *, batch: int = PRUNE_BATCH, now: float | None = None) -> int:
        """Forget deleted ids older than ``DELETED_KEPT_SECONDS`` (far past any archiver
        pause), ``batch`` per transaction; how many."""
        old = to_us((now if now is not None else time.time()) - DELETED_KEPT_SECONDS)

        async def go(conn: AsyncConnection) -> int:
            ids = sa.select(D.c.id).where(D.c.deleted_us < old).limit(batch)
            return int((await conn.execute(D.delete().where(D.c.id.in_(ids)))).rowcount)
        total = 0
        while (n := int(await self._write(go))) > 0:
            total += n
            if n < batch:
                break
        return total

    # -- reads

    @contextlib.asynccontextmanager
    async def _reading(self) -> AsyncIterator[AsyncConnection]:
        """A connection for one read. A database that just failed to answer
        (refused, lost, timed out) is not asked again for ``DOWN_SECONDS``: the
        reads meanwhile fail at once instead of each holding a connection for
        its own timeout (the callers, SubmitJob among them, retry)."""
        loop = asyncio.get_running_loop()
        if loop.time() < self._down_until:
            raise StoreUnavailable("history: the database did not answer just now; retry")
        self._check_file()
        try:
            async with self.engine.connect() as conn:
                if loop.time() < self._down_until:  # found down while this read waited for its connection
                    raise StoreUnavailable("history: the database did not answer just now; retry")
                yield conn
        except _DOWN as e:
            if database_down(e) or _timed_out(e):
                self._down_until = loop.time() + DOWN_SECONDS
            raise _unavailable(e) from e

    async def count(self) -> int:
        async with self._reading() as conn:
            return int((await conn.execute(sa.select(sa.func.count()).select_from(T))).scalar_one())

    async def get(self, job_id: str) -> ArchivedJob | None:
        async with self._reading() as conn:
            row = (await conn.execute(
                sa.select(T.c.data, T.c.revision).where(T.c.id == job_id))).first()
        return ArchivedJob(job_id, row[0], int(row[1])) if row is not None else None

    async def job_for_request(self, request_id: str) -> ArchivedJob | None:
        """The archived job a SubmitJob with ``request_id`` made, if recorded (``put_requests``)."""
        async with self._reading() as conn:
            row = (await conn.execute(
                sa.select(T.c.id, T.c.data, T.c.revision)
                .select_from(R.join(T, T.c.id == R.c.job_id))
                .where(R.c.request_id == request_id))).first()
        return ArchivedJob(str(row[0]), row[1], int(row[2])) if row is not None else None

    async def select(self, flt: Filter, p: Principal | None, after: SortKey | None,
                     limit: int) -> list[ArchivedJob]:
        """Up to ``limit`` jobs ``flt`` matches and ``p`` may read, in ListJobs'
        order, from just after ``after``: one index range."""
        q = _select_query(flt, p, after, limit)
        if q is None:
            return []
        async with self._reading() as conn:
            rows = (await conn.execute(q)).all()
        return [ArchivedJob(r[0], r[1], int(r[2])) for r in rows]


#: What a read raises when the database cannot answer: SQLAlchemy's errors, and the driver's own
#: (asyncpg raises a bare ConnectionRefusedError / TimeoutError when PostgreSQL is down).
_DOWN = (sa.exc.SQLAlchemyError, OSError, TimeoutError)
#: the longest one PostgreSQL statement may take (asyncpg cancels it then)
COMMAND_TIMEOUT_SECONDS = 10.0
#: the longest a read or write waits for a pooled connection (SQLAlchemy's default, 30 s, held
#: a burst of reads of a frozen PostgreSQL past their callers' deadlines)
POOL_WAIT_SECONDS = 5.0
#: how long reads fail at once after the database failed to answer one
DOWN_SECONDS = 5.0


#: SQLSTATEs of a database that is there but takes no connection now: a connection exception
#: (class 08), too many connections, shut down by an operator or a crash, and still starting or
#: recovering ("the database system is not yet accepting connections", 57P03).
_NOT_ACCEPTING_STATES = frozenset({"53300", "57P01", "57P02", "57P03"})


def database_down(e: BaseException) -> bool:
    """The database is not there, or not taking connections yet (a refused or lost
    connection, a server starting or recovering), as opposed to refusing one statement
    of a batch or a login. A statement that timed out may be the database gone quiet
    or one slow statement: ``HistoryStore._answers`` tells."""
    if isinstance(e, OSError | HistoryFileGone) and not isinstance(e, TimeoutError):
        return True
    if not isinstance(e, sa.exc.DBAPIError):
        return False
    state = str(getattr(e.orig, "sqlstate", None) or "")
    return (e.connection_invalidated or (isinstance(e.orig, OSError) and not isinstance(e.orig, TimeoutError))
            or state.startswith("08") or state in _NOT_ACCEPTING_STATES)


class HistoryFileGone(StoreUnavailable):
    """The SQLite file the history opened was removed or replaced (read as the database down)."""


def _locked(e: BaseException) -> bool:
    """SQLite's write lock held by another process past the busy timeout: the whole batch fails
    at once (run again alone, each operation waited out its own timeout, one after another)."""
    return isinstance(e, sa.exc.OperationalError) and "locked" in str(e.orig)


def _timed_out(e: BaseException) -> bool:
    return isinstance(e, (TimeoutError, sa.exc.TimeoutError)) or (
        isinstance(e, sa.exc.DBAPIError) and isinstance(e.orig, TimeoutError))


def _settle(op: _Op, *, result: Any = None, exc: BaseException | None = None) -> None:
    if op.done.done():
        return
    if exc is not None:
        op.done.set_exception(exc)
    else:
        op.done.set_result(result)


def _unavailable(e: BaseException) -> StoreUnavailable:
    if isinstance(e, StoreUnavailable):
        return e
    if isinstance(e, sa.exc.TimeoutError):  # (the pool's: every connection busy, none freed in time)
        return StoreUnavailable(f"history: no database connection free within {POOL_WAIT_SECONDS:g} s")
    if _timed_out(e):
        return StoreUnavailable(f"history: no answer from the database within {COMMAND_TIMEOUT_SECONDS:g} s")
    # The database's own text (its host, user, SQL) is logged, not sent to the client.
    log.warning("history: %s: %s", e.__class__.__name__, str(e).splitlines()[0][:300] if str(e) else "")
    return StoreUnavailable("history: the database is unavailable; retry later")


def _file_identity(url: str) -> tuple[str, int, int] | None:
    """(path, device, inode) of a SQLite URL's file; None: not SQLite, in memory, or not there
    (never created: nothing to tell apart)."""
    path = _sqlite_path(url)
    if path is None:
        return None
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return path, st.st_dev, st.st_ino


def _sqlite_path(url: str) -> str | None:
    """The file of a SQLite URL (None: not SQLite, or in memory)."""
    if not url.startswith("sqlite"):
        return None
    path = url.split(":///", 1)[1].split("?", 1)[0]
    return os.path.abspath(path) if path and path != ":memory:" else None


def _engine(url: str, *, statement_timeout: bool = True) -> AsyncEngine:
    if url.startswith("sqlite"):
        path = _sqlite_path(url)
        if path is not None:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        engine = create_async_engine(url, pool_size=4, max_overflow=4, pool_timeout=POOL_WAIT_SECONDS)
        sa.event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        return engine
    # A connection attempt to a PostgreSQL that is down fails in 5 s, not asyncpg's 60;
    # a statement on a PostgreSQL that stopped answering (SIGSTOP, a network partition:
    # the connection stays open) in COMMAND_TIMEOUT_SECONDS, not never: SubmitJob waits on
    # the history's request-id look-up, so a frozen history must end in STORE_UNAVAILABLE.
    connect: dict[str, Any] = {"timeout": 5}
    if statement_timeout:
        connect["command_timeout"] = COMMAND_TIMEOUT_SECONDS
    return create_async_engine(url, pool_size=4, max_overflow=4, pool_pre_ping=True,
                               pool_timeout=POOL_WAIT_SECONDS, connect_args=connect)


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    # Only this process's one writer writes; the timeout covers another
    # process's migration or a checkpoint, never a second writer here.
    cur.execute("PRAGMA busy_timeout=10000")
    cur.close()


_COLUMNS = {"state": T.c.state, "run_mode": T.c.run_mode, "cluster": T.c.cluster,
            "project": T.c.project, "owner": T.c.owner}


def _select_query(flt: Filter, p: Principal | None, after: SortKey | None,
                  limit: int) -> sa.Select[Any] | None:
    where: list[sa.ColumnElement[bool]] = []
    label_terms: list[Term] = []
    for t in flt.terms:
        if t.field in _COLUMNS:
            col = _COLUMNS[t.field]
            where.append(col != t.value if t.negate else col == t.value)
        else:
            label_terms.append(t)
    if p is not None and not p.reads_everything():
        projects = sorted(p.readable_projects())
        if not projects:
            return None
        where.append(T.c.project.in_(projects))
    # The first positive label term drives the walk (its index is in listing order).
    drive = next((t for t in label_terms if not t.negate), None)
    for t in label_terms:
        if t is drive:
            continue
        key = t.field[len("labels."):]
        # The job's value of that label (NULL: none) by a primary-key look-up
        # per row walked: a correlated scalar subquery the planners cannot
        # turn into a scan of every row with that label.
        other = L.alias()  # not the driving labels row
        value = (sa.select(other.c.value).where(other.c.job_id == T.c.id, other.c.key == key)
                 .scalar_subquery())
        where.append(value.is_distinct_from(str(t.value)) if t.negate else value == str(t.value))
    if drive is not None:
        order_ct, order_id = L.c.create_us, L.c.job_id
        q = (sa.select(T.c.id, T.c.data, T.c.revision)
             .select_from(L.join(T, T.c.id == L.c.job_id))
             .where(L.c.key == drive.field[len("labels."):], L.c.value == str(drive.value)))
    else:
        order_ct, order_id = T.c.create_us, T.c.id
        q = sa.select(T.c.id, T.c.data, T.c.revision)
    rng = flt.create_range
    if rng is not None:  # the same index range, cut to the create times asked for
        if rng.lo is not None:
            where.append(order_ct >= rng.lo)
        if rng.hi is not None:
            where.append(order_ct < rng.hi)
    ended = flt.end_range
    if ended is not None:  # every archived job has ended (``ArchivedJob.end_us``)
        if ended.lo is not None:
            where.append(T.c.end_us >= ended.lo)
        if ended.hi is not None:
            where.append(T.c.end_us < ended.hi)
    if after is not None:
        ct, after_id = to_us(-after[0]), after[1]
        # newest first: strictly older, or as old with a greater id. The first
        # term bounds the index range; the second trims its first step.
        where.append(order_ct <= ct)
        where.append(sa.or_(order_ct < ct, order_id > after_id))
    return q.where(*where).order_by(order_ct.desc(), order_id.asc()).limit(limit)


def archived_entries(items: Iterable[tuple[str, bytes, int]]) -> list[ArchivedJob]:
    """``ArchivedJob``s of (id, stored bytes, mod revision) triples."""
    return [ArchivedJob(i, d, r) for i, d, r in items]
