"""JobManager's history flags, and starting the history and its archiver."""

from __future__ import annotations

import argparse
import logging
import os
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aetcd
import sqlalchemy.exc

from dlsched.errors import StoreUnavailable
from dlsched.kit import etcd
from dlsched.kit.election import Leadership
from job_manager.cache import JobCache
from job_manager.history.archiver import ArchiveConfig, Archiver
from job_manager.history.store import HistoryStore, database_down, url_of
from job_manager.store import JobStore

log = logging.getLogger("job_manager.history")

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([smhd]?)\s*")


def parse_duration(text: str) -> float:
    """Seconds of ``90``, ``90s``, ``15m``, ``12h`` or ``1d``."""
    m = _DURATION.fullmatch(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: want seconds, or a number with s, m, h or d")
    return float(m.group(1)) * _UNITS[m.group(2)]


@dataclass(frozen=True)
class HistoryOptions:
    #: SQLAlchemy-able DSN (postgresql://..., sqlite:///path) or a file path; "" = off
    dsn: str = ""
    retention_seconds: float = 86400.0
    max_terminal: int = 0
    interval_seconds: float = 30.0
    prune_max_age_seconds: float = 0.0
    prune_max_jobs: int = 0
    request_sweep_seconds: float = 300.0

    @property
    def enabled(self) -> bool:
        return bool(self.dsn)


def add_history_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("job history (terminal jobs moved out of etcd)")
    g.add_argument("--data-dir", default=os.environ.get("DLSCHED_DATA_DIR", ""),
                   help="JobManager's local state; the job history defaults to the SQLite "
                        "file history.db here (env DLSCHED_DATA_DIR)")
    g.add_argument("--history-dsn", default=os.environ.get("DLSCHED_HISTORY_DSN", ""),
                   help="the job history database: postgresql://user:pw@host:port/db, "
                        "sqlite:///path or a file path (default: DATA_DIR/history.db; 'off', or "
                        "neither this nor --data-dir: no history, terminal jobs stay in etcd)")
    g.add_argument("--history-retention", type=parse_duration, default=86400.0,
                   help="terminal jobs that ended longer ago move from etcd to the history "
                        "(seconds, or 30m, 12h, 1d; default 1d)")
    g.add_argument("--history-max-terminal", type=int, default=0,
                   help="at most this many terminal jobs stay in etcd: the oldest beyond it "
                        "move to the history whatever their age (0: no bound)")
    g.add_argument("--history-max-age", type=parse_duration, default=0.0,
                   help="archived jobs that ended longer ago are deleted (0: kept)")
    g.add_argument("--history-max-jobs", type=int, default=0,
                   help="at most this many archived jobs are kept, the oldest-ended go (0: all)")
    g.add_argument("--archive-interval", type=parse_duration, default=30.0,
                   help="how often the archiver looks for jobs to move (default 30s)")
    g.add_argument("--request-sweep-interval", type=parse_duration, default=300.0,
                   help="how often SubmitJob request ids of jobs gone from etcd leave etcd; an "
                        "archived job's go to the history, where a retried SubmitJob finds "
                        "its job (default 5m)")


def history_options_from_args(a: argparse.Namespace, p: argparse.ArgumentParser) -> HistoryOptions:
    dsn = a.history_dsn
    if dsn.lower() in ("off", "none"):
        dsn = ""
    elif not dsn and a.data_dir:
        dsn = os.path.join(a.data_dir, "history.db")
    if a.history_max_terminal < 0 or a.history_max_jobs < 0:
        p.error("--history-max-terminal and --history-max-jobs must be 0 (no bound) or more")
    if a.archive_interval <= 0:
        p.error("--archive-interval must be more than 0")
    if a.request_sweep_interval <= 0:
        p.error("--request-sweep-interval must be more than 0")
    return HistoryOptions(dsn=dsn, retention_seconds=a.history_retention,
                          max_terminal=a.history_max_terminal,
                          interval_seconds=a.archive_interval,
                          prune_max_age_seconds=a.history_max_age,
                          prune_max_jobs=a.history_max_jobs,
                          request_sweep_seconds=a.request_sweep_interval)


async def start_history(opts: HistoryOptions, client: aetcd.Client, store: JobStore,
                        cache: JobCache, prefix: str, identity: str,
                        wait_current: Callable[[], Awaitable[bool]],
                        ) -> tuple[HistoryStore | None, Leadership | None]:
    """The opened (migrated) history and the archiver's campaign; (None, None) when off."""
    if not opts.enabled:
        log.info("no job history (--history-dsn/--data-dir unset): terminal jobs stay in etcd")
        return None, None
    if url_of(opts.dsn).startswith("sqlite"):
        history = await HistoryStore.open(opts.dsn)  # a file: nothing to wait for
    else:
        # A database down or frozen when JobManager starts (or is restarted) is waited for, as
        # etcd is: it exited with a traceback and stayed down after the database came back.
        history = await etcd.until_reachable(
            "JobManager: the job history", lambda: _open_when_up(opts.dsn),
            store="the job history's database", also=(sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError))
    log.info("job history: %s (%s)", _redacted(opts.dsn), history.dialect)
    if not prefix.endswith("/"):
        prefix += "/"
    key = f"{prefix}leaders/job-archiver".encode()
    leadership = Leadership(client, key, identity)
    archiver = Archiver(store, cache, history, ArchiveConfig(
        retention_seconds=opts.retention_seconds, max_terminal=opts.max_terminal,
        interval_seconds=opts.interval_seconds, prune_max_age_seconds=opts.prune_max_age_seconds,
        prune_max_jobs=opts.prune_max_jobs, request_sweep_seconds=opts.request_sweep_seconds),
        holder_key=key, holder=identity,
        wait_current=wait_current)
    leadership.start(archiver.run)
    return history, leadership


async def _open_when_up(dsn: str) -> HistoryStore:
    """The history opened; a database not there or not taking connections yet (PostgreSQL
    still recovering after a crash answers "not yet accepting connections") raises
    StoreUnavailable, which ``until_reachable`` waits out; a refused login is raised as is."""
    try:
        return await HistoryStore.open(dsn)
    except sqlalchemy.exc.DBAPIError as e:
        if database_down(e):
            raise StoreUnavailable(f"the job history's database cannot be reached ({e.orig or e})") from e
        raise


def _redacted(dsn: str) -> str:
    """The DSN without its password."""
    return re.sub(r"(://[^:/@]+):[^@]*@", r"\1:***@", dsn)
