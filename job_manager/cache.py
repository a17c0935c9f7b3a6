"""The watch cache: JobManager's in-memory, indexed view of every job.

Filled once by a paged read of ``jobs/`` pinned at one revision
(``JobStore.scan``), then kept current by the one prefix watch (``WatchHub``
applies each event here before any subscriber sees it). GetJob, ListJobs,
WatchJobs snapshots, the ownership job view, the scheduler's take-over and
reconcile and the job gauge read it; no request reads every job from etcd.

Memory per job is compact: the stored bytes (decoded only for the jobs a
request returns) plus the fields the indexes and filters need. Indexes, each a
list of sort keys ``(-create_time, id)`` kept sorted (ListJobs' order):
every job, and per ``state``, ``cluster``, ``project``, ``owner`` and
``labels.KEY`` value. A listing walks the smallest index a positive filter
term (or the caller's readable projects) names, from the page token's
position, and stops once the page is full: its cost is the page plus what
the filter skips in that index, not the number of jobs. A ``create_time``
range cuts each index to its slice by bisection (the order is by create
time), so a time-range filter walks only the jobs created in the range; an
``end_time`` range walks the terminal states' indexes.

``revision`` is the revision of the last job event the view applied;
``synced`` the revision the watch has proved it reached with a progress
notification (``WatchHub.wait_current``: etcd's revision moves with writes
to other keys too, which bring no job event). ``current``, the larger, is
what ``wait_for`` waits on: a replica that wrote a job answers its next read
with it, and any replica answers a read with every write etcd had made when
the read came (read-your-writes across replicas).
"""

from __future__ import annotations

import asyncio
import bisect
import heapq
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from dlsched.auth.model import DEFAULT_PROJECT, Principal
from dlsched.v1 import job_pb2
from job_manager.convert import end_us_of_proto, job_from_bytes
from job_manager.domain import access
from job_manager.domain.filter import Filter
from job_manager.domain.model import Job, JobState

if TYPE_CHECKING:
    from job_manager.store import JobStore

SortKey = tuple[float, str]
IndexKey = tuple[str, object]

_UNFINISHED = tuple(s for s in JobState if not s.is_terminal())
_NO_LABELS: dict[str, str] = {}


def sort_key(create_seconds: float, job_id: str) -> SortKey:
    """ListJobs' order: newest first, then by id."""
    return (-create_seconds, job_id)


class CachedJob:
    """One job in the cache: its stored bytes and the fields filters and indexes read.

    It has the attributes ``Filter.matches`` and ``access.may_read`` read of a
    ``Job`` (``state``, ``spec.run_mode``, ``cluster``, ``project``, ``owner``,
    ``labels``), so both apply to it without decoding.
    """

    __slots__ = ("cluster", "data", "end_us", "id", "key", "labels", "owner", "project",
                 "revision", "run_mode", "state")

    def __init__(self, job_id: str, data: bytes, revision: int) -> None:
        p = job_pb2.Job.FromString(data)
        # datetime precision (microseconds), as ``Job.create_time.timestamp()`` gives it
        ct = ((p.create_time.seconds * 1_000_000 + p.create_time.nanos // 1000) / 1_000_000
              if p.HasField("create_time") else 0.0)
        self.id = job_id
        self.data = data
        self.revision = revision
        self.key: SortKey = sort_key(ct, job_id)
        self.state = JobState.of(p.state)
        # when it ended (``end_time`` filter terms); None while it runs
        self.end_us = end_us_of_proto(p) if self.state.is_terminal() else None
        self.run_mode = int(p.spec.run_mode)
        self.cluster = sys.intern(p.cluster)
        self.project = sys.intern(p.project)
        self.owner = sys.intern(p.owner)
        self.labels = dict(p.labels) if p.labels else _NO_LABELS

    @property
    def spec(self) -> CachedJob:  # Filter reads job.spec.run_mode
        return self

    @property
    def name(self) -> str:
        return f"jobs/{self.id}"

    @property
    def create_us(self) -> int:
        """The create time in microseconds (from the sort key: no field of its own)."""
        return round(-self.key[0] * 1_000_000)

    def index_keys(self) -> list[IndexKey]:
        keys: list[IndexKey] = [("state", int(self.state)), ("cluster", self.cluster),
                                ("project", self.project or DEFAULT_PROJECT), ("owner", self.owner)]
        keys.extend((f"labels.{k}", v) for k, v in self.labels.items())
        return keys

    def job(self) -> Job:
        return job_from_bytes(self.data, self.revision)

    def proto(self) -> job_pb2.Job:
        """The API's Job (as ``convert.job_to_proto(self.job())``, without the domain round trip)."""
        p = job_pb2.Job.FromString(self.data)
        p.etag = str(self.revision) if self.revision else ""
        return p


def _remove(lst: list[SortKey], key: SortKey) -> None:
    i = bisect.bisect_left(lst, key)
    if i < len(lst) and lst[i] == key:
        del lst[i]


class JobCache:
    def __init__(self, *, page_size: int = 2000) -> None:
        self.page_size = page_size  # keys per etcd range while loading
        self._jobs: dict[str, CachedJob] = {}
        self._order: list[SortKey] = []
        self._index: dict[IndexKey, list[SortKey]] = {}
        self.revision = 0
        self.synced = 0  # proved by a watch progress notification (no job event needed)
        self._advanced = asyncio.Event()
        self.loads = 0  # full loads so far (a compaction that outran the watch makes one)

    def __len__(self) -> int:
        return len(self._jobs)

    # -- filling

    async def load(self, store: JobStore) -> int:
        """Read every job, paged at one revision, and replace the view; that revision."""
        jobs: dict[str, CachedJob] = {}
        rev = 0
        async for kvs, page_rev in store.scan(self.page_size):
            rev = page_rev
            for kv in kvs:
                jobs[kv.job_id] = CachedJob(kv.job_id, kv.value, kv.mod_revision)
        rev = rev or await store.revision()
        index: dict[IndexKey, list[SortKey]] = {}
        for e in jobs.values():
            for k in e.index_keys():
                index.setdefault(k, []).append(e.key)
        for lst in index.values():
            lst.sort()
        self._jobs, self._index = jobs, index
        self._order = sorted(e.key for e in jobs.values())
        self.loads += 1
        self._advance(rev)
        return rev

    def apply(self, revision: int, job_id: str, data: bytes | None) -> None:
        """A watch event: the job's bytes at ``revision``, or None when deleted.

        Events the view already reflects (at or below a load's revision) change
        nothing; one at the view's revision is the state it already holds.
        """
        if revision < self.revision:
            return
        new = CachedJob(job_id, data, revision) if data is not None else None  # may raise: first
        old = self._jobs.pop(job_id, None)
        old_keys = set(old.index_keys()) if old is not None else set()
        new_keys = set(new.index_keys()) if new is not None else set()
        same_key = old is not None and new is not None and old.key == new.key
        if old is not None:
            if not same_key:
                _remove(self._order, old.key)
            for k in old_keys if not same_key else old_keys - new_keys:
                lst = self._index.get(k)
                if lst is not None:
                    _remove(lst, old.key)
                    if not lst:
                        del self._index[k]
        if new is not None:
            self._jobs[job_id] = new
            if not same_key:
                bisect.insort(self._order, new.key)
            for k in new_keys if not same_key else new_keys - old_keys:
                bisect.insort(self._index.setdefault(k, []), new.key)
        self._advance(revision)

    def _advance(self, revision: int) -> None:
        if revision > self.revision:
            self.revision = revision
            self._wake()

    def confirm(self, revision: int) -> None:
        """The watch has delivered (and this view applied) every job event up
        to ``revision``: a progress notification, with no event of its own."""
        if revision > self.synced:
            self.synced = revision
            self._wake()

    def _wake(self) -> None:
        self._advanced.set()
        self._advanced = asyncio.Event()

    @property
    def current(self) -> int:
        """The etcd revision this view is known to reflect."""
        return max(self.revision, self.synced)

    async def wait_for(self, revision: int, within: float = 5.0) -> bool:
        """Until the view reflects ``revision`` (False after ``within`` seconds)."""
        return await self._wait(lambda: self.current >= revision, within)

    async def wait_gone(self, job_id: str, revision: int, within: float = 5.0) -> bool:
        """Until the view no longer holds ``job_id`` as of ``revision`` or before (a delete)."""
        def gone() -> bool:
            e = self._jobs.get(job_id)
            return e is None or e.revision > revision
        return await self._wait(gone, within)

    async def _wait(self, done: Callable[[], bool], within: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while not done():
            left = deadline - loop.time()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._advanced.wait(), left)
            except TimeoutError:
                return False
        return True

    # -- reads (synchronous: each is one consistent view at ``revision``)

    def get(self, job_id: str) -> CachedJob | None:
        return self._jobs.get(job_id)

    def _sources(self, flt: Filter, p: Principal | None) -> list[tuple[list[SortKey], int, int]]:
        """The smallest set of sorted index slices ``(list, start, end)`` every
        match is in: each list cut to the filter's create-time range."""
        rng = flt.create_range

        def cut(lst: list[SortKey]) -> tuple[list[SortKey], int, int]:
            if rng is None:
                return lst, 0, len(lst)
            # newest first: the range's newer end (hi) starts the slice
            start = 0 if rng.hi is None else bisect.bisect_right(
                lst, -rng.hi / 1_000_000, key=_first)
            end = len(lst) if rng.lo is None else bisect.bisect_right(
                lst, -rng.lo / 1_000_000, key=_first)
            return lst, start, max(start, end)

        options: list[list[tuple[list[SortKey], int, int]]] = []
        for t in flt.terms:
            if not t.negate and t.field != "run_mode":
                options.append([cut(self._index.get((t.field, t.value), []))])
        if p is not None and not p.reads_everything():
            options.append([cut(self._index.get(("project", proj), []))
                            for proj in sorted(p.readable_projects())])
        if flt.end_range is not None:  # only terminal jobs have ended
            options.append([cut(self._index.get(("state", int(s)), []))
                            for s in JobState if s.is_terminal()])
        if not options or rng is not None:
            options.append([cut(self._order)])
        return min(options, key=lambda slices: sum(e - s for _, s, e in slices))

    def select(self, flt: Filter, p: Principal | None = None,
               after: SortKey | None = None) -> Iterator[CachedJob]:
        """The jobs ``flt`` matches and ``p`` may read, in ListJobs' order,
        from just after ``after``. Lazy: consume it without an await between
        steps (or materialise it) - the view changes with every event."""
        starts: list[Iterable[SortKey]] = []
        for lst, start, end in self._sources(flt, p):
            i = max(start, bisect.bisect_right(lst, after)) if after is not None else start
            starts.append(_tail(lst, i, end))
        keys = starts[0] if len(starts) == 1 else heapq.merge(*starts)
        for key in keys:
            e = self._jobs[key[1]]
            if flt.matches(e) and (p is None or access.may_read(p, e)):  # type: ignore[arg-type]
                yield e

    def terminal_oldest_first(self) -> Iterator[CachedJob]:
        """The terminal jobs, oldest created first (the history archiver's
        order). Lazy, as ``select``: consume it without an await between steps."""
        lists = [self._index.get(("state", int(s)), []) for s in JobState if s.is_terminal()]
        for key in heapq.merge(*(reversed(lst) for lst in lists), reverse=True):
            yield self._jobs[key[1]]

    def terminal_count(self) -> int:
        return sum(len(self._index.get(("state", int(s)), ())) for s in JobState if s.is_terminal())

    def unfinished(self, cluster: str | None = None) -> tuple[list[Job], int]:
        """The jobs not in a terminal state (of ``cluster``, when given), decoded, and the revision."""
        if cluster is not None:
            entries = [self._jobs[k[1]] for k in self._index.get(("cluster", cluster), [])]
            jobs = [e.job() for e in entries if not e.state.is_terminal()]
        else:
            jobs = [self._jobs[k[1]].job() for s in _UNFINISHED
                    for k in self._index.get(("state", int(s)), [])]
        return jobs, self.revision

    def states(self) -> tuple[dict[str, JobState], int]:
        """Every job's state by id, and the revision."""
        return {i: e.state for i, e in self._jobs.items()}, self.revision


def _first(key: SortKey) -> float:
    return key[0]


def _tail(lst: list[SortKey], i: int, end: int) -> Iterator[SortKey]:
    """``lst[i:end]`` without copying it (the caller steps through it synchronously)."""
    n = min(end, len(lst))
    while i < n:
        yield lst[i]
        i += 1
