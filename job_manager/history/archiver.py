"""The archiver: moves terminal jobs out of etcd into the history database.

One replica archives at a time: the leader of ``{prefix}leaders/job-archiver``
(``dlsched.kit.election.Leadership``), and every etcd delete it makes is
fenced on that key holding its identity, so a replica that lost the
leadership deletes nothing.

A round, every ``interval`` seconds:

1. waits until the watch cache is proved to reflect every write etcd had
   made (``WatchHub.wait_current``: every delete of earlier rounds and of
   earlier leaders shows), or skips the round;
2. picks, oldest created first, the terminal jobs that ended more than
   ``retention`` seconds ago, and the oldest beyond ``max_terminal``
   terminal jobs in etcd (0: no count bound);
3. per batch: upserts them into the history (committed; idempotent), then
   deletes each key in etcd in a transaction that requires its mod revision
   unchanged. A job written meanwhile stays in etcd (etcd wins; its history
   row is shadowed, and replaced when it is archived again). A job deleted
   meanwhile by a client (the key is gone although the cache was current at
   the round's start and no other archiver can delete) loses its history row
   too, so a deleted job never comes back;
4. every ``request_sweep_seconds``, deletes the request keys (SubmitJob's
   request_id → job id, made with the job) of jobs no longer in etcd as of
   the round's proved revision, so they do not outgrow etcd either; first
   the pairs (request id, job id) of archived jobs are committed to the
   history (``put_requests``), a sweep before their keys go, so a SubmitJob
   retried with the request_id of an archived job answers that job for as
   long as the history keeps it (the scheduler looks there);
5. prunes the history (``prune_max_age`` / ``prune_max_jobs``).

Metrics (JobManager's /metrics): ``dlsched_history_jobs_archived_total``,
``dlsched_history_jobs_pruned_total``, the last round's duration
(``dlsched_history_archive_round_seconds``), when it ended
(``..._last_round_timestamp_seconds``: how far behind the archiver is) and
how many jobs it found due (``dlsched_history_archive_due_jobs``).

A crash at any point leaves each job in etcd, in the history, or in both
(etcd wins: reads look in the cache and etcd first); never in neither.

``DLSCHED_FAULT_ARCHIVE`` (tests only) kills the process with SIGKILL at a
point of the first batch: ``after-history`` (the rows committed, no etcd
delete yet) or ``mid-delete`` (half of the batch's keys deleted).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from prometheus_client import Counter, Gauge

from dlsched.errors import StoreUnavailable
from job_manager.cache import JobCache
from job_manager.history.store import ArchivedJob, HistoryStore, to_us
from job_manager.store import JobStore

log = logging.getLogger("job_manager.history.archiver")

# On JobManager's /metrics (registered once, at import); only the leader's move.
ARCHIVED = Counter(
    "dlsched_history_jobs_archived",
    "terminal jobs this replica's archiver moved from etcd into the job history")
PRUNED = Counter(
    "dlsched_history_jobs_pruned",
    "archived jobs this replica's archiver deleted from the job history (retention)")
ROUND_SECONDS = Gauge(
    "dlsched_history_archive_round_seconds",
    "how long this replica's last completed archive round took")
LAST_ROUND = Gauge(
    "dlsched_history_archive_last_round_timestamp_seconds",
    "when this replica's last archive round completed (Unix time; lag: now minus this)")
DUE = Gauge(
    "dlsched_history_archive_due_jobs",
    "terminal jobs due to move out of etcd at the start of the last archive round")

#: concurrent etcd deletes per batch
_DELETES_IN_FLIGHT = 32
#: A request key stays at least this long after its (request id, job) pair is in the history:
#: a retried SubmitJob looks in the history beside its match (which may take its 15 s) and then
#: creates its job only if the key is not there; a key gone in between let the retry store and
#: run the job a second time (a sweep interval of 1 s opened that window, found by review).
REQUEST_KEY_GRACE_SECONDS = 60.0


@dataclass(frozen=True)
class ArchiveConfig:
    retention_seconds: float = 86400.0
    max_terminal: int = 0
    interval_seconds: float = 30.0
    batch: int = 500
    max_per_round: int = 20_000
    prune_max_age_seconds: float = 0.0
    prune_max_jobs: int = 0
    #: how often request keys (SubmitJob's request_id → job) of jobs no longer in etcd are swept
    request_sweep_seconds: float = 300.0
    #: how long a request key stays once its pair is in the history (``REQUEST_KEY_GRACE_SECONDS``)
    request_key_grace_seconds: float = REQUEST_KEY_GRACE_SECONDS


@dataclass
class ArchiveStats:
    rounds: int = 0
    archived: int = 0
    kept_changed: int = 0
    dropped_deleted: int = 0
    pruned: int = 0
    request_keys_swept: int = 0


class Archiver:
    def __init__(self, store: JobStore, cache: JobCache, history: HistoryStore,
                 config: ArchiveConfig, *, holder_key: bytes, holder: str,
                 wait_current: Callable[[], Awaitable[bool]],
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.cache = cache
        self.history = history
        self.config = config
        self.holder_key = holder_key
        self.holder = holder.encode()
        self._wait_current = wait_current
        self._clock = clock
        self.stats = ArchiveStats()
        self._fault = os.environ.get("DLSCHED_FAULT_ARCHIVE", "")
        self._swept_at: float | None = None
        #: request ids whose pair this archiver put in the history: since when (monotonic), until
        #: their key goes (``REQUEST_KEY_GRACE_SECONDS``)
        self._paired: dict[str, float] = {}

    async def run(self) -> None:
        """The leader's work: rounds until cancelled."""
        while True:
            more = False
            try:
                more = await self.round()
            except StoreUnavailable as e:
                log.warning("archive round failed: %s; next in %gs", e, self.config.interval_seconds)
            except LeadershipLost:
                log.warning("archiver lost its leadership mid-round")
                return
            except Exception:  # never a tight loop of failed rounds (or of re-elections)
                log.exception("archive round failed; next in %gs", self.config.interval_seconds)
                more = False
            if not more:
                await asyncio.sleep(self.config.interval_seconds)

    def candidates(self) -> list[ArchivedJob]:
        """The terminal jobs due to move, oldest created first (at most ``max_per_round``)."""
        cfg = self.config
        cutoff = to_us(self._clock() - cfg.retention_seconds) if cfg.retention_seconds >= 0 else None
        excess = self.cache.terminal_count() - cfg.max_terminal if cfg.max_terminal > 0 else 0
        out: list[ArchivedJob] = []
        for i, e in enumerate(self.cache.terminal_oldest_first()):
            if len(out) >= cfg.max_per_round:
                break
            if i < excess:
                out.append(ArchivedJob(e.id, e.data, e.revision))
                continue
            if cutoff is None or round(-e.key[0] * 1_000_000) >= cutoff:
                break  # created after the cutoff: it ended after it too
            a = ArchivedJob(e.id, e.data, e.revision)
            if a.end_us < cutoff:
                out.append(a)
        return out

    async def round(self) -> bool:
        """One round; whether jobs were left for another at once."""
        started = time.monotonic()
        more = await self._round()
        if more is None:
            return False
        ROUND_SECONDS.set(time.monotonic() - started)
        LAST_ROUND.set_to_current_time()
        return more

    async def _round(self) -> bool | None:
        """A round; None when skipped."""
        self.stats.rounds += 1
        if not await self._wait_current():
            # Not proved current: a job deleted before now could look "missing"
            # only because of us. Nothing this round.
            log.warning("archive round skipped: the job cache is not proved current")
            return None
        proved = self.cache.current
        due = self.candidates()
        DUE.set(len(due))
        for start in range(0, len(due), self.config.batch):
            await self._move(due[start:start + self.config.batch])
        now = time.monotonic()
        if self._swept_at is None or now - self._swept_at >= self.config.request_sweep_seconds:
            self._swept_at = now
            n = await self.sweep_requests(proved)
            if n:
                log.info("request keys of jobs gone from etcd: %d deleted", n)
        if self.config.prune_max_age_seconds > 0 or self.config.prune_max_jobs > 0:
            n = await self.history.prune(max_age_seconds=self.config.prune_max_age_seconds,
                                         max_jobs=self.config.prune_max_jobs)
            self.stats.pruned += n
            PRUNED.inc(n)
            if n:
                log.info("history pruned: %d jobs", n)
        await self.history.forget_deleted()
        if due:
            log.info("archived %d jobs (total %d)", len(due), self.stats.archived)
        return len(due) >= self.config.max_per_round

    async def sweep_requests(self, proved: int) -> int:
        """Delete the request keys (as of ``proved``, a revision the cache is
        proved to reflect) whose job is no longer in etcd: archived, or
        deleted. A key made after ``proved`` is not read; one whose job is
        live stays. Their number, deleted."""
        n = 0
        sem = asyncio.Semaphore(_DELETES_IN_FLIGHT)

        async def one(key: bytes, mod: int) -> None:
            nonlocal n
            async with sem:
                deleted = await self.store.delete_request_key(key, mod)
            n += deleted  # after the await: concurrent callers each add theirs

        n_prefix = len(self.store.requests_prefix)
        async for page in self.store.request_keys(proved):
            gone = {key[n_prefix:].decode(): (key, job_id, mod)
                    for key, job_id, mod in page if self.cache.get(job_id) is None}
            # An archived job's pair is committed to the history one sweep
            # before its key goes: a retried SubmitJob that looked in the
            # history just before the pair was there still finds the key
            # (a whole sweep interval later). A deleted job's key goes now.
            _, recorded_now = await self.history.put_requests(
                (rid, job_id) for rid, (_, job_id, _) in gone.items())
            now = time.monotonic()
            for rid in recorded_now:
                self._paired.setdefault(rid, now)
            grace = self.config.request_key_grace_seconds
            due = [(rid, k, m) for rid, (k, _, m) in gone.items()
                   if rid not in recorded_now and now - self._paired.get(rid, now - grace) >= grace]
            await asyncio.gather(*(one(k, m) for _, k, m in due))
            for rid, _, _ in due:
                self._paired.pop(rid, None)
        # (a key gone otherwise, a job deleted from etcd with its key: not held for ever)
        if len(self._paired) > 100_000:
            self._paired = dict(sorted(self._paired.items(), key=lambda kv: kv[1])[-50_000:])
        self.stats.request_keys_swept += n
        return n

    async def _move(self, batch: list[ArchivedJob]) -> None:
        await self.history.put(batch)  # committed before any etcd delete
        if self._fault == "after-history":
            _die()
        sem = asyncio.Semaphore(_DELETES_IN_FLIGHT)
        half = len(batch) // 2
        done = 0

        async def one(a: ArchivedJob) -> None:
            nonlocal done
            async with sem:
                if self._fault == "mid-delete" and done >= half:
                    _die()
                outcome = await self.store.delete_unchanged(
                    a.id, a.revision, holder_key=self.holder_key, holder=self.holder)
                done += 1
            if outcome == "deleted":
                self.stats.archived += 1
                ARCHIVED.inc()
            elif outcome == "changed":
                self.stats.kept_changed += 1  # etcd wins; archived again once due
            elif outcome == "missing":
                # Deleted by a client since the round began: no history either.
                await self.history.delete(a.id, a.revision, upto=a.revision)
                self.stats.dropped_deleted += 1
            else:
                raise LeadershipLost()

        results = await asyncio.gather(*(one(a) for a in batch), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r


class LeadershipLost(Exception):
    """The archiver's key is another replica's now: this one deletes nothing more."""


def _die() -> None:
    log.warning("DLSCHED_FAULT_ARCHIVE: SIGKILL now")
    for h in logging.getLogger().handlers:
        h.flush()
    os.kill(os.getpid(), signal.SIGKILL)
