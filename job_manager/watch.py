"""The watch hub: ONE etcd prefix watch on ``jobs/`` per JobManager process.

Each event is applied to the watch cache (``cache.py``) first, then goes to
a ring buffer of encoded events bounded by bytes (``--watch-buffer-bytes``,
and optionally by count, ``--watch-buffer``) and to one bounded queue per
subscriber. Every event with a revision above ``horizon`` is in the buffer,
so a resume token T (an etcd revision) can be honoured exactly when T >=
horizon: the buffered events after T are replayed, then live ones, with no
duplicate and no gap. An older token raises ``WatchTokenExpired``.

At start the cache is loaded (paged, at one revision R) and the etcd watch
begins ``history`` revisions before R (or at the compaction revision), so
tokens a previous JobManager process issued still resume after a restart.
The watch asks etcd for fragmented responses, so a burst of large events
never makes a message past the client's receive limit. When etcd compacted
revisions the watch had not seen yet, the cache is loaded again and every
subscriber ends with ``WatchTokenExpired`` (they re-list).

Consistent reads (``wait_current``, before GetJob and ListJobs): read etcd's
current revision R (one single-key range; concurrent readers share one, but
never one that started before they came), then wait, bounded, until the
cache reflects R (kube-apiserver's consistent reads from cache, KEP-2340).
Writes to other keys (leases, ownership, clusters) move R without a job
event, so the cache has to be proved current another way:

- etcd 3.5.13+ / 3.4.31+: a progress notification. The hub asks for one on
  its watch stream (``WatchProgressRequest``); the answer, revision P, comes
  after every job event up to P.
- older etcd answers a progress request at once, ahead of events still
  queued or being replayed (etcd #15220), so there the hub writes the sync
  key ``jobs.sync``, which its watch covers (the watch spans ``jobs.sync`` up
  to the end of ``jobs/``; ``jobs/`` scans never see it): its event, at
  revision S > R, arrives after every job event before it. One write serves
  every read waiting at the time, and none is made while the cache is at R.

When neither proves it in time the caller falls back (GetJob reads the key).
A replica holding the sole-writer claim (``sole_writer.py``) needs none of
this: no other process writes a job while it holds it (``sole_current``).

Two marks share the range. The archiver writes ``jobs.sync.archived`` (the
job id) in the transaction that deletes an archived job's key: that DELETE
goes to the cache but to no subscriber (the job still exists, in the
history). DeleteJob of an archived job writes ``jobs.sync.purged`` (the job
as last stored): subscribers get it DELETED, like a live job's delete.

A subscriber whose queue overflows (a client that reads too slowly) is ended
with UNAVAILABLE, reason ``WATCH_SUBSCRIBER_LAGGING``: it reconnects with its
last token and resumes from the buffer while the buffer still covers it.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aetcd
import aetcd.exceptions
import aetcd.utils
import grpc
from aetcd import rpc
from google.protobuf.message import DecodeError

from dlsched.errors import DlschedError, InvalidArgument, Unavailable, WatchTokenExpired
from dlsched.kit import tokens
from dlsched.kit.etcd import EtcdClient, WatchProgress, progress_exact
from dlsched.kit.parse import decimal
from dlsched.v1 import job_pb2
from job_manager.convert import job_from_bytes
from job_manager.domain.model import Job
from job_manager.sole_writer import sole_clock
from job_manager.store import archived_mark_key, parse_purged_mark, purged_mark_key

if TYPE_CHECKING:
    from job_manager.cache import JobCache
    from job_manager.sole_writer import SoleWriter
    from job_manager.store import JobStore

log = logging.getLogger("job_manager.watch")

_TOKEN_PREFIX = "j1:"
#: the token of an EXISTING event: a stream cut mid-snapshot resumes by sending the snapshot again
_SNAPSHOT_PREFIX = "j1s:"


def encode_token(revision: int) -> str:
    return tokens.encode(f"{_TOKEN_PREFIX}{revision}")


def encode_snapshot_token(revision: int) -> str:
    """The token of a snapshot's EXISTING event (the snapshot at ``revision``)."""
    return tokens.encode(f"{_SNAPSHOT_PREFIX}{revision}")


def is_snapshot_token(token: str) -> bool:
    """Whether ``token`` is an EXISTING event's: resuming with it resends the snapshot, since
    the events after it (the rest of the snapshot) have no revision of their own to resume at."""
    raw = tokens.decode(token) or ""
    return raw.startswith(_SNAPSHOT_PREFIX) and decimal(raw[len(_SNAPSHOT_PREFIX):])


def decode_token(token: str, field: str = "resume_token") -> int:
    try:
        raw = tokens.decode(token) or ""
        if not raw.startswith(_TOKEN_PREFIX) or not decimal(raw[len(_TOKEN_PREFIX):]):
            raise ValueError(raw[:40])  # '1_000', ' 5' and '²' are no revision this server wrote
        return int(raw[len(_TOKEN_PREFIX):])
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidArgument.for_field(field, "not a resume token this server issued") from e


class Freshness(enum.Enum):
    """How a consistent read (``WatchHub.read_current``) ended."""

    CURRENT = "current"  # the cache has every write etcd had made when it began
    LAGGING = "lagging"  # etcd answered; the cache did not show it in time: read etcd
    NO_ANSWER = "no-answer"  # etcd gave no revision in time (frozen or slow): read it, briefly
    UNREACHABLE = "unreachable"  # etcd refused the connection: reading a key fails too


def _refused(e: BaseException) -> bool:
    """etcd cannot be reached at all (no connection), as opposed to a slow answer
    (etcd's own UNAVAILABLE, ``etcdserver: no leader`` and the like, is one)."""
    if isinstance(e, grpc.RpcError):
        code = e.code() if callable(getattr(e, "code", None)) else None
        details = e.details() if callable(getattr(e, "details", None)) else ""
        return bool(code == grpc.StatusCode.UNAVAILABLE) and not str(details or "").startswith("etcdserver:")
    return isinstance(e, (aetcd.exceptions.ConnectionFailedError, ConnectionError))


class EventType(enum.Enum):
    CREATED = "CREATED"
    UPDATED = "UPDATED"
    DELETED = "DELETED"


#: what one buffered event costs beyond its bytes (the object, the deque slot)
EVENT_OVERHEAD = 160
#: how long a consistent read waits for the cache (then the caller falls back)
CONSISTENT_READ_SECONDS = 2.0
#: a watch that has not reached a revision etcd reported this long ago is opened again
WATCH_STALL_SECONDS = 30.0
#: while consistent reads keep coming, each read of etcd's revision waits one round trip after
#: the previous returned, at most this many seconds after that one was sent: on a busy replica a
#: read costs more than the wait (its round trips grow, and so do the batches), so GetJob's
#: throughput at 16 in flight rose by a third, and it did not drop at 4 (bench/bench_scale.py)
REVISION_READ_PERIOD = 0.0015
#: how long the hub waits for etcd to answer a progress request before asking again
_PROGRESS_ANSWER_SECONDS = 1.0


class _SharedRead:
    """One etcd read at a time, shared by every caller that came before it was
    sent, and only by them: a read already sent may predate a write a later
    caller saw answered, so that caller waits for the next one. That one is
    sent a round trip after the one in flight returns (the callers of two
    round trips share it), or as it returns when that is ``gap`` seconds or
    more after it was sent. Alone, a caller's read is sent at once (in the
    loop's next turn, with the callers of this one)."""

    def __init__(self, fetch: Callable[[], Awaitable[int]], gap: float = 0.0) -> None:
        self._fetch = fetch
        self._gap = gap  # the most a read queued behind another waits after that one was sent
        self._sent_at = 0.0
        self._next: asyncio.Future[int] | None = None  # the read the next caller joins, not sent yet
        self._busy = False
        self._task: asyncio.Future[int] | None = None  # the read in flight (held: not collected)
        self.sent = 0  # reads sent (the benchmark reports reads per request)

    async def get(self) -> int:
        fut = self._next
        if fut is None:
            loop = asyncio.get_running_loop()
            fut = self._next = loop.create_future()
            fut.add_done_callback(_retrieve)
            if not self._busy:  # sent once the callers ready to run now have joined it
                self._busy = True
                loop.call_soon(self._send)
        return await asyncio.shield(fut)

    def _send(self) -> None:
        fut, self._next, self._busy = self._next, None, True
        assert fut is not None
        self.sent += 1
        loop = asyncio.get_running_loop()
        self._sent_at = loop.time()
        task = self._task = asyncio.ensure_future(self._fetch())

        def done(t: asyncio.Future[int]) -> None:
            self._busy, self._task = False, None
            if t.cancelled():
                fut.cancel()
            elif (e := t.exception()) is not None:
                fut.set_exception(e)
            else:
                fut.set_result(t.result())
            if self._next is not None:  # callers came while it was in flight
                # one more round trip's callers join it (a busy loop's round trips are longer)
                now = loop.time()
                wait = min(self._gap, 2 * (now - self._sent_at)) - (now - self._sent_at)
                if wait > 0:
                    self._busy = True
                    loop.call_later(wait, self._send)
                else:
                    self._send()

        task.add_done_callback(done)


def _retrieve(fut: asyncio.Future[int]) -> None:
    """A read's error is its callers'; none left (all timed out) is no error."""
    if not fut.cancelled():
        fut.exception()


class JobEvent:
    """One job event; the job is decoded from ``data`` once, when first asked for."""

    __slots__ = ("_job", "_prev", "archived", "data", "job_id", "job_revision", "memo", "prev", "revision",
                 "type")

    def __init__(self, revision: int, type: EventType, job_id: str, data: bytes,
                 job_revision: int, archived: bool = False, prev: bytes = b"") -> None:
        self.revision = revision
        self.type = type
        self.job_id = job_id
        self.data = data  # the job as stored (DELETED: as it was last)
        self.job_revision = job_revision  # its etag's revision
        # UPDATED: what filters read of the job before the change (``filter_view``), so a
        # filtered watch tells a job that stops matching it (empty: not known)
        self.prev = prev
        self._prev: Job | None = None
        # DELETED because the archiver moved the job to the history (it still
        # exists): the cache drops it, WatchJobs sends nothing for it.
        self.archived = archived
        self._job: Job | None = None
        # What the servicer sends for this event, built once for every stream
        # (not kept in the buffer: ``compact`` drops it).
        self.memo: object | None = None

    @property
    def job(self) -> Job:
        if self._job is None:
            job = job_from_bytes(self.data, self.job_revision)
            if not job.id:
                job.id = self.job_id
            self._job = job
        return self._job

    @property
    def prev_job(self) -> Job | None:
        """The job before this change as filters read it (no spec); None when not known."""
        if self._prev is None and self.prev:
            self._prev = job_from_bytes(self.prev, 0)
        return self._prev

    @property
    def size(self) -> int:
        return len(self.data) + len(self.prev) + len(self.job_id) + EVENT_OVERHEAD

    def compact(self) -> JobEvent:
        """This event without its decoded job (what the buffer keeps)."""
        return JobEvent(self.revision, self.type, self.job_id, self.data, self.job_revision, self.archived,
                        self.prev)


def filter_view(data: bytes) -> bytes:
    """A stored job with what no filter reads left out (its spec but its run mode, its message
    and replicas): the ``prev`` of an UPDATED event. Empty when ``data`` does not decode."""
    p = job_pb2.Job()
    try:
        p.ParseFromString(data)
    except DecodeError:
        return b""
    run_mode = p.spec.run_mode  # (run_mode!=X read a cleared spec's 0 as "not X")
    for f in ("spec", "message", "replicas"):
        p.ClearField(f)
    p.spec.run_mode = run_mode
    out: bytes = p.SerializeToString(deterministic=True)
    return out


class Subscription:
    """One subscriber's bounded queue of events with revision > ``after``.

    Small while idle (thousands are): no queue until an event comes, and a
    future only while its reader waits. The ``next_within`` deadline is one
    timer per subscription, armed while the reader waits for the first time
    and moved lazily: an event only notes the time, and the timer, when it
    goes off early, sets itself again for the deadline then due (one timer
    per idle period, not one per event: fan-out to thousands stays cheap)."""

    __slots__ = ("_active", "_error", "_fired", "_hub", "_items", "_limit", "_timer", "_waiter",
                 "_within", "after")

    def __init__(self, hub: WatchHub, after: int, limit: int) -> None:
        self._hub = hub
        self.after = after
        self._limit = limit
        self._items: collections.deque[JobEvent] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._error: DlschedError | None = None
        self._fired = False
        self._timer: asyncio.TimerHandle | None = None
        self._within = 0.0
        self._active = 0.0  # loop time the current wait began

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _push(self, ev: JobEvent) -> None:
        if self._error is not None or ev.revision <= self.after:
            return
        if self._items is None:
            self._items = collections.deque()
        if len(self._items) >= self._limit:
            self._fail(Unavailable("watch subscriber fell behind; resume with the last token",
                                   reason="WATCH_SUBSCRIBER_LAGGING"))
            return
        self._items.append(ev)
        self._wake()

    def _fail(self, err: DlschedError) -> None:
        if self._error is None:
            self._error = err
            self._items = None
            self._wake()

    def skip_to(self, revision: int) -> None:
        """Drop queued events at or below ``revision`` and ignore later ones too."""
        self.after = max(self.after, revision)
        items = self._items
        while items and items[0].revision <= self.after:
            items.popleft()

    async def next(self) -> JobEvent:
        """The next event."""
        ev = await self.next_within(None)
        assert ev is not None
        return ev

    async def next_within(self, within: float | None, since: float | None = None) -> JobEvent | None:
        """The next event; None when none came within ``within`` seconds (None: wait on) of
        ``since`` (a loop time: when the reader last sent something; default now)."""
        loop = asyncio.get_running_loop()
        self._fired = False
        self._active = loop.time() if since is None else since
        self._within = within if within is not None and within > 0 else 0.0
        while True:
            items = self._items
            if items:
                ev = items.popleft()
                if not items:
                    self._items = None  # an idle subscription keeps no queue
                if ev.revision > self.after:
                    self.after = ev.revision
                    return ev
                continue
            if self._error is not None:
                raise self._error
            if self._fired:
                return None
            if self._within and self._timer is None:
                self._timer = loop.call_at(self._active + self._within, self._timed_out)
            self._waiter = loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _timed_out(self) -> None:
        self._timer = None
        if not self._within:
            return
        due = self._active + self._within
        loop = asyncio.get_running_loop()
        if loop.time() < due:  # events came meanwhile: the wait began later
            self._timer = loop.call_at(due, self._timed_out)
            return
        if self._waiter is not None:  # the reader waits: the deadline is its own
            self._fired = True
            self._wake()

    def close(self) -> None:
        self._hub._subs.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class WatchHub:
    def __init__(self, client: aetcd.Client, prefix: str, *, buffer_size: int = 0,
                 buffer_bytes: int = 64 << 20, history: int = 5000,
                 subscriber_limit: int | None = None, cache: JobCache | None = None,
                 store: JobStore | None = None, progress: bool | None = None,
                 consistent_reads: bool = True, stall_seconds: float = WATCH_STALL_SECONDS) -> None:
        if not prefix.endswith("/"):
            prefix += "/"
        if (cache is None) != (store is None):
            raise ValueError("a cache needs the store it loads from")
        self._client = client
        self._key = f"{prefix}jobs/".encode()
        self._buffer: collections.deque[JobEvent] = collections.deque()
        self._buffer_size = buffer_size  # events; 0: bounded by bytes only
        self._buffer_bytes = max(1, buffer_bytes)
        self.buffered_bytes = 0
        self._history = history
        self._sub_limit = subscriber_limit or max(10000, buffer_size)
        self.cache, self._store = cache, store
        self._subs: set[Subscription] = set()
        self.horizon = 0
        self.last_revision = 0
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._start_error: BaseException | None = None
        # consistent reads: see the module's doc
        self._sync_key = f"{prefix}jobs.sync".encode()
        self._archived_mark = archived_mark_key(prefix)
        self._archiving: tuple[int, bytes] = (0, b"")  # the last mark: its revision, the job id
        self._purged_mark = purged_mark_key(prefix)
        #: the sole writer (``sole_writer.py``): while it holds its claim, reads need no etcd
        #: revision; set by the server when this process takes part in ownership
        self.sole: SoleWriter | None = None
        self._loaded_at = 0  # the revision the cache was loaded at: join marks before it are old
        self._consistent = consistent_reads  # False: wait_current answers at once
        self._can_progress = isinstance(client, EtcdClient) and cache is not None
        # etcd sends a progress answer after the events it covers (None: ask its version)
        self._exact = bool(progress)
        self._ask_version = progress is None
        self._live = False  # the watch is open: a progress answer speaks for it
        self._answered = asyncio.Event()
        self._want = 0  # the largest revision a consistent read waits for
        self._waiting = 0
        self._pump: asyncio.Task[None] | None = None
        self._current = _SharedRead(self._revision, REVISION_READ_PERIOD)
        self._synced_write = _SharedRead(self._write_sync)
        self.progress_answers = 0
        self.sync_writes = 0
        self.stale_reads = 0  # consistent reads that gave up waiting (the caller fell back)
        # The watchdog: a revision etcd reported and when, until the cache reaches it;
        # not reached within ``stall_seconds``, the watch is taken for stuck and reopened.
        self._stall = stall_seconds
        self._probe: tuple[int, float] | None = None
        self._last_read = 0.0  # loop time of the last consistent read (the idle check asks otherwise)
        self._watchdog: asyncio.Task[None] | None = None
        self._stopping = False
        self.reopens = 0

    async def _revision(self) -> int:
        """etcd's current revision (one single-key read)."""
        await self._client.connect()
        res = await self._client.kvstub.Range(rpc.RangeRequest(key=self._key, keys_only=True),
                                              timeout=CONSISTENT_READ_SECONDS,
                                              metadata=self._client.metadata)
        return int(res.header.revision)

    async def _write_sync(self) -> int:
        """Write the sync key; its revision."""
        await self._client.connect()
        res = await self._client.kvstub.Put(rpc.PutRequest(key=self._sync_key, value=b""),
                                            timeout=CONSISTENT_READ_SECONDS,
                                            metadata=self._client.metadata)
        self.sync_writes += 1
        return int(res.header.revision)

    @property
    def proves_by_progress(self) -> bool:
        """Whether consistent reads wait for progress notifications (else sync writes)."""
        return self._can_progress and self._exact

    async def wait_current(self, within: float = CONSISTENT_READ_SECONDS, *, prove: bool = False) -> bool:
        """Until the cache reflects every write etcd had made when this was
        called (read-your-writes across replicas); False when that was not
        proved within ``within`` seconds or etcd could not be reached: the
        caller then reads etcd itself, or serves the cache as it is.
        ``--no-consistent-reads`` makes it answer True at once, except with
        ``prove`` (the archiver: a job its cache still shows after its own
        delete must not be taken for one deleted by someone else)."""
        return await self.read_current(within, prove=prove) is Freshness.CURRENT

    def sole_current(self) -> bool:
        """Whether the cache has every job write made so far, proved by this process's
        sole-writer claim (no other process can write a job while it holds it)."""
        sole = self.sole
        if sole is None or self.cache is None:
            return False
        if sole.serves(sole_clock(), self.cache.current):
            sole.served += 1
            return True
        return False

    async def read_current(self, within: float = CONSISTENT_READ_SECONDS, *,
                           prove: bool = False, by_claim: bool = True) -> Freshness:
        """``wait_current``, saying how this read ended when the cache was not proved
        current: etcd's revision came (LAGGING), or not in time (NO_ANSWER), or
        etcd refused the connection (UNREACHABLE)."""
        assert self.cache is not None
        if (not self._consistent and not prove) or (by_claim and self.sole_current()):
            return Freshness.CURRENT
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        self._last_read = loop.time()
        self._waiting += 1  # the progress pump runs while reads wait
        got = Freshness.NO_ANSWER  # until etcd gives its revision
        try:
            async with asyncio.timeout(within):  # no task per read, unlike wait_for
                target = await self._current.get()
                got = Freshness.LAGGING
                self._check_stall(target, loop.time())
                if self.cache.current >= target:
                    return Freshness.CURRENT
                self._want = max(self._want, target)
                if self.proves_by_progress:
                    if self._pump is None:
                        self._pump = asyncio.create_task(self._ask_progress(),
                                                         name="job-watch-progress")
                else:
                    target = await self._synced_write.get()
                if await self.cache.wait_for(target, deadline - loop.time()):
                    return Freshness.CURRENT
        except (TimeoutError, aetcd.exceptions.ClientError, grpc.RpcError, OSError) as e:
            log.debug("consistent read: %s", e)
            if got is Freshness.NO_ANSWER and _refused(e):
                got = Freshness.UNREACHABLE
        finally:
            self._waiting -= 1
        self.stale_reads += 1
        return got

    def _check_stall(self, target: int, now: float) -> None:
        """The watchdog's step on etcd's revision ``target``, just read: a watch that
        delivers nothing (a stream etcd or the client dropped without an error)
        would leave the cache behind for good, and launches and reads with it."""
        assert self.cache is not None
        probe = self._probe
        if probe is not None and self.cache.current >= probe[0]:
            probe = self._probe = None  # it moved on: alive
        if self.cache.current >= target:
            return
        if probe is None:
            self._probe = (target, now)
        elif now - probe[1] > self._stall and self._live:
            self._probe = None
            self._reopen(f"revision {probe[0]} not reached in {now - probe[1]:.0f} s")

    def _reopen(self, why: str) -> None:
        """Open the etcd watch again, from the last revision applied (replayed events are skipped)."""
        assert self.cache is not None
        if self._stopping:
            return
        log.warning("job watch: %s; opening it again", why)
        self.reopens += 1
        if self._task is not None:
            self._task.cancel()
        self._live = False
        start = max(1, min(self.cache.revision, self.last_revision) + 1)
        self._task = asyncio.create_task(self._run(start), name="job-watch-hub")

    async def _watch_idle(self) -> None:
        """The watchdog while no consistent read comes: one check every ``stall_seconds``."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._stall)
            if loop.time() - self._last_read >= self._stall:
                if (not self.proves_by_progress and self.sole is not None and self.cache is not None
                        and self.sole.serves(sole_clock(), self.cache.current)):
                    continue  # no job written since the cache's revision: spare the sync key's write
                try:
                    await self.read_current(prove=True, by_claim=False)  # the watch itself
                except Exception as e:  # noqa: BLE001 - the next round tries again
                    log.warning("job watch: check: %s", e)

    async def _ask_progress(self) -> None:
        """While reads wait for a revision the cache has not shown: ask etcd for
        progress notifications, one at a time."""
        assert self.cache is not None and isinstance(self._client, EtcdClient)
        try:
            while self._waiting and self.cache.current < self._want:
                if not self._live:
                    await asyncio.sleep(0.05)
                    continue
                self._answered.clear()
                try:
                    await self._client.request_progress()
                    await asyncio.wait_for(self._answered.wait(), _PROGRESS_ANSWER_SECONDS)
                except TimeoutError:
                    log.debug("job watch: no answer to a progress request")
                except (aetcd.exceptions.ClientError, grpc.RpcError, OSError) as e:
                    log.debug("job watch: progress request: %s", e)
                    await asyncio.sleep(0.05)
        finally:
            self._pump = None

    def _on_progress(self, revision: int) -> None:
        assert self.cache is not None
        self.progress_answers += 1
        if self._exact and self._live:
            self.cache.confirm(revision)
        self._answered.set()

    async def start(self) -> None:
        try:
            if self.cache is not None and self._store is not None:
                current = await self.cache.load(self._store)
            else:
                current = await self._revision()
            if self._can_progress and self._ask_version:
                assert isinstance(self._client, EtcdClient)
                self._exact = progress_exact(await self._client.server_version())
        except (aetcd.exceptions.ClientError, grpc.RpcError, OSError) as e:
            raise Unavailable(f"etcd: {e}", reason="STORE_UNAVAILABLE") from e
        self._loaded_at = current
        start = max(1, current - self._history)
        self.horizon = start - 1
        self.last_revision = start - 1
        self._task = asyncio.create_task(self._run(start), name="job-watch-hub")
        await asyncio.wait({self._task, asyncio.ensure_future(self._ready.wait())},
                           timeout=15, return_when=asyncio.FIRST_COMPLETED)
        if not self._ready.is_set():
            raise Unavailable("etcd watch did not start", reason="STORE_UNAVAILABLE")
        if self.cache is not None:
            self._watchdog = asyncio.create_task(self._watch_idle(), name="job-watch-watchdog")

    async def stop(self) -> None:
        self._stopping = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._pump is not None:
            self._pump.cancel()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        for s in list(self._subs):
            s._fail(Unavailable("server shutting down", reason="SHUTTING_DOWN"))

    def subscribe(self, after: int | None = None) -> Subscription:
        """A subscription to events with revision > ``after``.

        With ``after`` (a resume token's revision) the buffered events after it
        come first; raises WatchTokenExpired when the buffer no longer covers it.
        Without, every event from now on is queued (the caller then reads a
        snapshot at revision R, from the cache with no await in between, and
        calls ``skip_to(R)``).
        """
        if after is not None and after < self.horizon:
            raise WatchTokenExpired(
                f"resume token (revision {after}) is older than the watch buffer "
                f"(horizon {self.horizon}); re-list", metadata={"horizon": str(self.horizon)})
        replay = [ev for ev in self._buffer if ev.revision > after] if after is not None else []
        sub = Subscription(self, after if after is not None else 0, self._sub_limit + len(replay))
        for ev in replay:
            sub._push(ev)
        self._subs.add(sub)
        return sub

    def _on_event(self, ev: aetcd.rtypes.Event) -> None:
        rev = int(ev.kv.mod_revision)
        if not ev.kv.key.startswith(self._key):
            if ev.kv.key == self._archived_mark:  # the delete at this revision archives the job
                self._archiving = (rev, ev.kv.value)
                return
            if self.cache is not None:  # a sync or purge mark: every job event before it is here
                self.cache.confirm(rev)
            if (self.sole is not None and ev.kv.key == self.sole.join_key and ev.kind != "DELETE"
                    and rev > self._loaded_at and ev.kv.value != self.sole.token):
                self.sole.joined(sole_clock())  # another writer waits
            if ev.kv.key == self._purged_mark and ev.kind != "DELETE" and rev > self.last_revision:
                # DeleteJob of an archived job (its key left with no event): DELETED now
                mark = parse_purged_mark(ev.kv.value)
                je = JobEvent(rev, EventType.DELETED, mark[0], mark[2], mark[1]) if mark else None
                try:
                    if je is not None and je.job.id == je.job_id:  # decoded once, here: never in a reader
                        self._publish(je)
                        return
                except (DecodeError, ValueError):
                    pass
                log.warning("job watch: purge mark at revision %d is not one; skipped", rev)
            return
        raw_id = ev.kv.key[len(self._key):]
        job_id = raw_id.decode()
        deleted = ev.kind == "DELETE"
        if self.cache is not None:
            self.cache.apply(rev, job_id, None if deleted else ev.kv.value)
        if rev <= self.last_revision:
            return
        if deleted:
            prev = ev.prev_kv
            je = JobEvent(rev, EventType.DELETED, job_id, prev.value if prev is not None else b"",
                          int(prev.mod_revision) if prev is not None else 0,
                          archived=self._archiving == (rev, raw_id))
        else:
            etype = EventType.CREATED if ev.kv.version == 1 else EventType.UPDATED
            prev = ev.prev_kv
            je = JobEvent(rev, etype, job_id, ev.kv.value, rev,
                          prev=filter_view(prev.value) if etype is EventType.UPDATED and prev is not None else b"")
        self._publish(je)

    def _publish(self, je: JobEvent) -> None:
        """Buffer ``je`` (the buffer bounded) and give it to every subscriber."""
        kept = je.compact()
        self._buffer.append(kept)
        self.buffered_bytes += kept.size
        while len(self._buffer) > 1 and (
                self.buffered_bytes > self._buffer_bytes
                or (self._buffer_size and len(self._buffer) > self._buffer_size)):
            old = self._buffer.popleft()
            self.buffered_bytes -= old.size
            self.horizon = old.revision
        self.last_revision = je.revision
        for s in list(self._subs):
            s._push(je)

    def _expire_all(self, upto: int, why: str) -> None:
        """Events up to ``upto`` are lost to the buffer: no older token resumes,
        and live subscribers have a gap (they re-list)."""
        self._buffer.clear()
        self.buffered_bytes = 0
        self.horizon = max(self.horizon, upto)
        self.last_revision = max(self.last_revision, upto)
        if self._ready.is_set():
            for s in list(self._subs):
                s._fail(WatchTokenExpired(why))

    async def _past_oversized(self, next_rev: int) -> int:
        """A watch message was over the receive limit (an etcd that does not
        fragment): skip what the cache already holds, or load it again."""
        assert self.cache is not None and self._store is not None
        if next_rev <= self.cache.revision:  # the history replay: give up the history
            log.warning("job watch: history %d..%d too large; older tokens expire",
                        next_rev, self.cache.revision)
            self._buffer.clear()
            self.buffered_bytes = 0
            self.horizon = self.last_revision = max(self.last_revision, self.cache.revision)
            for s in list(self._subs):
                if s.after < self.horizon:
                    s._fail(WatchTokenExpired("the watch history was dropped; re-list"))
            return self.cache.revision + 1
        try:
            rev = await self.cache.load(self._store)
        except DlschedError as le:
            log.warning("job watch: reloading the cache: %s", le)
            return next_rev
        self._expire_all(rev, "the job cache was reloaded; re-list")
        return rev + 1

    async def _run(self, start: int) -> None:
        next_rev = start
        delay = 0.2
        while True:
            try:
                # jobs.sync up to the end of jobs/: the jobs and the sync key
                watch: Any
                end = aetcd.utils.prefix_range_end(self._key)
                if self._can_progress:
                    assert isinstance(self._client, EtcdClient)
                    watch = await self._client.watch_progress(
                        self._sync_key, end, start_revision=next_rev, prev_kv=True, fragment=True)
                else:
                    watch = await self._client.watch(self._sync_key, range_end=end,
                                                     start_revision=next_rev, prev_kv=True,
                                                     fragment=True)
                if delay > 0.2:  # after an interruption
                    log.info("job watch open again from revision %d", next_rev)
                self._ready.set()
                self._live = True
                delay = 0.2
                async for ev in watch:
                    if isinstance(ev, WatchProgress):
                        self._on_progress(ev.revision)
                        continue
                    try:
                        self._on_event(ev)
                    except (DecodeError, UnicodeDecodeError, ValueError) as e:
                        # a key or value no JobManager wrote (one bad event must not stop the
                        # watch: reconnecting would meet it again, forever)
                        log.warning("job watch: event at revision %d skipped: %r",
                                    int(ev.kv.mod_revision), e)
                    next_rev = max(next_rev, int(ev.kv.mod_revision) + 1)
                self._live = False
            except asyncio.CancelledError:
                self._live = False
                raise
            except aetcd.exceptions.RevisionCompactedError as e:
                self._live = False
                compacted = int(e.compacted_revision)
                lost_to = compacted - 1
                if lost_to >= next_rev:
                    # Events in [next_rev, compacted) are gone: no token below
                    # can be honoured, and live subscribers have a gap.
                    log.warning("job watch: revisions %d..%d compacted away", next_rev, lost_to)
                    self._expire_all(lost_to, "events were compacted; re-list")
                if self.cache is not None and self._store is not None and compacted > self.cache.revision + 1:
                    # The cache missed events: read every job again, then go on from there.
                    try:
                        rev = await self.cache.load(self._store)
                    except DlschedError as le:
                        # next_rev stays below the compaction: the next try meets it again and
                        # reloads. Watching on from ``compacted`` would skip the missed events
                        # for good while the cache passed for current.
                        log.warning("job watch: reloading the cache: %s", le)
                    else:
                        log.warning("job watch: cache reloaded at revision %d", rev)
                        self._expire_all(rev, "the job cache was reloaded; re-list")
                        next_rev = rev + 1
                        continue
                else:
                    next_rev = compacted
                    continue
            except Exception as e:  # noqa: BLE001 - reconnect on any etcd trouble
                self._live = False
                log.warning("job watch interrupted (%s); reconnecting from revision %d", e, next_rev)
                if _too_large(e) and self.cache is not None and self._store is not None:
                    next_rev = await self._past_oversized(next_rev)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


def _too_large(e: BaseException) -> bool:
    """Whether ``e`` (or its cause) is gRPC's receive limit."""
    while e is not None:
        if isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return True
        e = e.__cause__  # type: ignore[assignment]
    return False
