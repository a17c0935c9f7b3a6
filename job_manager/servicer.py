"""dlsched.v1.JobManagerService: transport only.

Checks request shapes, converts proto ⇄ domain (``convert.py``), calls the
scheduler or the store, converts back. GetJob, ListJobs and WatchJobs
snapshots are served from the watch cache (``cache.py``): ListJobs walks the
smallest index its filter names from the page token on, so a page costs the
page, not every job; GetJob reads etcd only for a job the cache does not
hold (yet). SubmitJob, StopJob and DeleteJob answer once this replica's
cache shows their write, so the caller's next read here sees it; another
replica's cache follows within the watch's delay (a job it lacks is read
from etcd). WatchJobs ends with OUT_OF_RANGE / WATCH_TOKEN_EXPIRED for a
token older than the watch buffer, and with UNAVAILABLE /
WATCH_SUBSCRIBER_LAGGING when the client reads too slowly to keep up - it
then resumes with its last token.

With a job history (``history/``: finished jobs moved out of etcd), GetJob
looks there for a job neither the cache nor etcd holds, ListJobs merges the
history's keyset page after the same token into the cache's (a job in both
is etcd's: the archiver is moving it), and DeleteJob of an archived job
deletes its row, after writing the purge mark that makes watches send it
DELETED (the archive itself sends none); the same access rules apply. StopJob of an archived job
returns it unchanged (it has ended, as StopJob of a live terminal job does);
StreamJobLogs and GetJobUsage ask its driver with the archived record's
cluster and backend id, as for a live job.

Both streams send a heartbeat when they have sent nothing for
``heartbeat_seconds`` (``--stream-heartbeat-seconds``; 0: never): WatchJobs a
HEARTBEAT event with the current resume token, StreamJobLogs a response with
no entries. L7 proxies close streams idle for a while and HTTP/2 PINGs end at
the first one; a message keeps the stream open through all of them. Each
heartbeat, like each event or batch of lines, re-checks the caller as of now
(``Principal.current``, in memory): a revoked or expired token ends either
stream UNAUTHENTICATED; StreamJobLogs ends NOT_FOUND (what GetJob then answers)
once the caller may no longer read the job's project, WatchJobs then leaves the
project's events out.

StreamJobLogs puts a resume cursor (``domain/log_cursor.py``) on every
response, heartbeats included: the position after the last line sent. A
call with that cursor asks the driver again for the whole attempt (no
tail) and skips what the cursor says was delivered, so a client whose
stream ended (this server shut down, a replica died) continues on any
replica with no line lost or repeated.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import itertools
import logging
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import grpc
from prometheus_client import Counter

from dlsched import spec_rules
from dlsched.auth.interceptor import caller
from dlsched.auth.model import Principal
from dlsched.errors import (
    DlschedError,
    InvalidArgument,
    NotFound,
    StoreUnavailable,
    WatchTokenExpired,
)
from dlsched.kit import logs, tokens
from dlsched.kit.timeutil import (
    MAX_TIMESTAMP_SECONDS,
    MIN_TIMESTAMP_SECONDS,
    check_timestamp,
    to_timestamp,
)
from dlsched.spec_rules import ROLE_RE
from dlsched.v1 import job_manager_service_pb2 as pb
from dlsched.v1 import job_manager_service_pb2_grpc as pb_grpc
from dlsched.v1 import job_pb2
from job_manager import convert
from job_manager.cache import CachedJob, JobCache, SortKey
from job_manager.domain import access
from job_manager.domain.errors import (
    EtagMismatch,
    JobAlreadyExists,
    JobNotFound,
    JobNotLaunched,
    RequestIdInUse,
)
from job_manager.domain.filter import Filter, parse_filter
from job_manager.domain.log_cursor import FIELD as CURSOR_FIELD
from job_manager.domain.log_cursor import LogCursor, Skipper
from job_manager.domain.model import Job, JobState
from job_manager.domain.validation import (
    JOB_ID_RE,
    MAX_SPEC_BYTES,
    job_id_from_name,
    validate_request_id,
)
from job_manager.heartbeats import waiting
from job_manager.history.store import ArchivedJob, HistoryStore
from job_manager.scheduler import Scheduler
from job_manager.watch import (
    EventType,
    Freshness,
    JobEvent,
    WatchHub,
    decode_token,
    encode_snapshot_token,
    encode_token,
    is_snapshot_token,
)

log = logging.getLogger("job_manager.servicer")

_EVENT_TYPES = {
    EventType.CREATED: job_pb2.WATCH_EVENT_TYPE_CREATED,
    EventType.UPDATED: job_pb2.WATCH_EVENT_TYPE_UPDATED,
    EventType.DELETED: job_pb2.WATCH_EVENT_TYPE_DELETED,
}
MAX_PAGE = 1000
#: The most bytes of jobs one ListJobs page carries: a page stops before the job that would pass
#: it (one job at least), with a next_page_token, as AIP-158 allows. Jobs reach ~256 KiB (their
#: spec), so a full page could pass the 8 MiB a response may be.
MAX_PAGE_BYTES = 4 << 20
# How long a followed log stream waits for the job's state after its attempt's logs end.
_ATTEMPT_SETTLE_SECONDS = 30.0
DEFAULT_PAGE = 100


#: how long a write waits for this replica's cache to show it (read-your-writes)
_CACHE_WAIT_SECONDS = 5.0
#: GetJob's read of etcd after etcd gave no revision in time (then: the cache's view)
_NO_ANSWER_READ_SECONDS = 2.0
#: how each GetJob/ListJobs proved this replica's cache fresh enough
READS = Counter("dlsched_job_manager_reads",
                "GetJob and ListJobs calls by how the cache was proved fresh: cache (it showed the "
                "min_etag asked for), sole_writer (this replica holds the sole-writer claim: no "
                "other process writes jobs), consistent (etcd's current revision read, unless "
                "--no-consistent-reads and no min_etag)", ["proof"])
_READ_CACHED = READS.labels("cache")
_READ_CONSISTENT = READS.labels("consistent")
_READ_SOLE = READS.labels("sole_writer")
def _check_same_job(request: pb.SubmitJobRequest, job: Job, p: Principal) -> Job:
    """``job``, as SubmitJob answers it to ``p``. A retried ``request_id`` answers its first
    job only to a caller who may still read it (one whose role in its project is gone gets
    what another caller's request id gets), and only for the same ``job_id``: a request id
    reused for another request is refused, as CreateCluster refuses it (AIP-155)."""
    if not access.may_read(p, job):
        raise RequestIdInUse()
    if request.job_id and job.id != request.job_id:
        raise InvalidArgument.for_field("request_id", f"already used to submit jobs/{job.id}")
    return job


def _encode_page(key: SortKey, filter_text: str) -> str:
    ct = -key[0] if key[0] else 0.0
    return tokens.encode(f"p2:{tokens.filter_hash(filter_text)}:{ct!r}:{key[1]}")


#: a page token's create time as ``_encode_page`` writes it (``repr`` of a float within a
#: Timestamp's range): no nan, inf, '_' or spaces, which ``float()`` takes
_PAGE_TIME_RE = re.compile(r"-?[0-9]{1,12}(?:\.[0-9]{1,17})?(?:e[-+]?[0-9]{1,3})?")


def _decode_page(token: str, filter_text: str) -> SortKey:
    try:
        # Only p2 tokens, which name their filter: a p1 (an older server's) named none,
        # so one made up would page any filter (AIP-158: a token ends with its filter).
        tag, issued_for, ct, job_id = (tokens.decode(token) or "").split(":", 3)
        if tag != "p2" or not _PAGE_TIME_RE.fullmatch(ct) or not JOB_ID_RE.match(job_id):
            raise ValueError(tag)
        if issued_for != tokens.filter_hash(filter_text):
            raise InvalidArgument.for_field("page_token", "issued for a ListJobs call with another filter")
        seconds = float(ct)
        if not MIN_TIMESTAMP_SECONDS <= seconds <= MAX_TIMESTAMP_SECONDS:
            raise ValueError(ct)
        return (-seconds, job_id)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidArgument.for_field("page_token", "not a page token this server issued") from e


def _response(ev: JobEvent) -> pb.WatchJobsResponse:
    """The WatchJobs response of ``ev``, built once and shared by every stream
    that sends it (never changed after: each stream only serializes it)."""
    resp = ev.memo
    if not isinstance(resp, pb.WatchJobsResponse):
        job = job_pb2.Job.FromString(ev.data)
        if not job.name:
            job.name = f"jobs/{ev.job_id}"
        job.etag = str(ev.job_revision) if ev.job_revision else ""
        resp = pb.WatchJobsResponse(type=_EVENT_TYPES[ev.type], job=job,
                                    resume_token=encode_token(ev.revision))
        ev.memo = resp
    return resp


def _time_ns(e: job_pb2.LogEntry) -> int:
    return e.time.seconds * 1_000_000_000 + e.time.nanos if e.HasField("time") else 0


def _still_reading(p: Principal, job: Job) -> Principal:
    """The caller as of now, while it may still read ``job`` (else NOT_FOUND)."""
    return _Readable(job.name, access.project_of(job)).check(p)


@dataclasses.dataclass(frozen=True, slots=True)
class _Readable:
    """A streamed job's name and project: what a stream re-checks its caller
    against per response, without the job (a follower may wait for days)."""

    name: str
    project: str

    def check(self, p: Principal) -> Principal:
        """``p`` as of now (``Principal.current``: UNAUTHENTICATED once its token was
        revoked or expired, an in-memory check), still a reader of the job: else
        NOT_FOUND, what GetJob answers for a job the caller may not read."""
        p = p.current()
        if not p.may_read(self.project):
            raise JobNotFound(f"job {self.name} not found", metadata={"name": self.name})
        return p


class JobManagerServicer(pb_grpc.JobManagerServiceServicer):
    def __init__(self, scheduler: Scheduler, hub: WatchHub, *,
                 heartbeat_seconds: float = 15.0, history: HistoryStore | None = None) -> None:
        if hub.cache is None:
            raise ValueError("JobManagerServicer reads from the hub's job cache")
        self.scheduler = scheduler
        self.store = scheduler.store
        self.hub = hub
        self.cache: JobCache = hub.cache
        self.heartbeat_seconds = heartbeat_seconds
        # Archived jobs (job_manager/history): read after the cache and etcd, which win.
        self.history = history

    async def SubmitJob(self, request: pb.SubmitJobRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> pb.SubmitJobResponse:
        if request.job_id and not JOB_ID_RE.match(request.job_id):  # before the history reads it
            raise InvalidArgument.for_field("job_id", "1 to 63 characters: lower case letters, digits "
                                                      "and '-', starting with a letter")
        validate_request_id(request.request_id)
        spec_bytes = request.spec.ByteSize()
        if spec_bytes > MAX_SPEC_BYTES:  # before any conversion: a request costs at most its size
            raise InvalidArgument.for_field("spec", f"serialized spec is {spec_bytes} bytes, at most {MAX_SPEC_BYTES}")
        if request.spec.HasField("time_limit"):  # before conversion, which would normalise it
            spec_rules.check_time_limit(request.spec.time_limit, "spec.time_limit")
        spec = convert.spec_from_proto(request.spec) if request.HasField("spec") else None
        if spec is None:
            raise InvalidArgument.for_field("spec", "required")
        p = caller()
        spec.project = p.resolve_project(spec.project)
        if request.job_id and self.history is not None and await self.history.get(request.job_id) is not None:
            # A retry of the request that made it answers it; else an id that lives
            # on in the history: a new job must not hide the archived one (a dry run
            # is told so too, AIP-163).
            first = await self.scheduler.archived_request(request.request_id, p.name)
            if first is None:
                # (the same words as for a live job: whose it is, and that it ended, stay unsaid)
                raise JobAlreadyExists(f"job jobs/{request.job_id} already exists",
                                       metadata={"name": f"jobs/{request.job_id}"})
            first = _check_same_job(request, first, p)
            if not request.dry_run:
                return pb.SubmitJobResponse(job=convert.job_to_proto(first))
        job, dry = await self.scheduler.submit(
            request.job_id, spec, request.request_id, dry_run=request.dry_run,
            spec_bytes=spec_bytes, owner=p.name)
        _check_same_job(request, job, p)
        await self._written(job)
        resp = pb.SubmitJobResponse(job=convert.job_to_proto(job))
        if dry is not None:
            resp.dry_run.CopyFrom(pb.DryRunResult(
                cluster=dry.cluster,
                candidates=[convert.candidate_to_proto(c) for c in dry.candidates],
                native_spec=convert.native_to_proto(dry.native_spec) if dry.native_spec else None))
        return resp

    async def GetJob(self, request: pb.GetJobRequest,  # noqa: N802
                     context: grpc.aio.ServicerContext) -> pb.GetJobResponse:
        job_id = job_id_from_name(request.name)
        # Consistent read: the cache has every write made before this call (or the
        # write ``min_etag`` names), or etcd is read.
        claimed = not request.min_etag and self.hub.sole_current()
        if claimed:
            _READ_SOLE.inc()
            fresh = Freshness.CURRENT
        else:
            fresh = await self._freshness(request.min_etag)
        cached = self.cache.get(job_id)
        if cached is None and claimed:  # proved by the claim: not in etcd, so archived or none
            return pb.GetJobResponse(job=await self._archived_or_missing(job_id))
        if fresh is Freshness.UNREACHABLE and cached is not None and self._reached(request.min_etag):
            fresh = Freshness.CURRENT  # etcd refuses connections: this replica's last view, as below
        if cached is None or fresh is not Freshness.CURRENT:  # not here yet (written on another replica
            try:                                              # a moment ago), or not proved current
                # etcd gave no revision in time: it is frozen or very slow, so read briefly
                within = _NO_ANSWER_READ_SECONDS if fresh is Freshness.NO_ANSWER else None
                job = access.check_read(caller(), await self.store.get(job_id, within=within))
                return pb.GetJobResponse(job=convert.job_to_proto(job))
            except StoreUnavailable:
                if cached is None or not self._reached(request.min_etag):
                    raise
                # etcd cannot be reached: this replica's last view of the job, as ListJobs
                # answers then (a write made meanwhile through a replica that reaches etcd may
                # be missing from it; none made through this one can be; never one older
                # than the min_etag asked for).
            except JobNotFound:
                return pb.GetJobResponse(job=await self._archived_or_missing(job_id))
        if not access.may_read(caller(), cached):  # type: ignore[arg-type]
            raise JobNotFound(f"job {cached.name} not found", metadata={"name": cached.name})
        return pb.GetJobResponse(job=cached.proto())

    async def _freshness(self, min_etag: str) -> Freshness:
        """How fresh this replica's cache is for a read: without ``min_etag``, a consistent
        read (``WatchHub.read_current``); with it, CURRENT at once when the cache shows that
        write, else the consistent read (which covers every write a caller could hold an etag
        of), after which a cache still behind it proves the etag was never issued."""
        if not min_etag:
            if self.hub.sole_current():
                _READ_SOLE.inc()
                return Freshness.CURRENT
            _READ_CONSISTENT.inc()
            return await self.hub.read_current()
        want = tokens.parse_etag(min_etag, "min_etag")
        if self.cache.current >= want:
            _READ_CACHED.inc()
            return Freshness.CURRENT
        _READ_CONSISTENT.inc()
        fresh = await self.hub.read_current(prove=True)  # etcd's revision, whatever --consistent-reads
        if fresh is Freshness.CURRENT and self.cache.current < want:
            raise InvalidArgument.for_field("min_etag", "newer than every write: not an etag this service returned")
        return fresh

    async def _refuse_never_issued(self, etag: str, mismatch: EtagMismatch) -> None:
        """A write's etag past the job's (``mismatch``) and past every write etcd has made (a
        consistent read first: this replica's cache may lag) was never returned: INVALID_ARGUMENT
        naming ``etag``, not an ABORTED that no re-read and retry can get past."""
        if not mismatch.current or int(etag) <= int(mismatch.current):
            return
        fresh = await self.hub.read_current(prove=True)
        if fresh is Freshness.CURRENT and self.cache.current < int(etag):
            raise InvalidArgument.for_field("etag", "newer than every write: not an etag this service returned")

    def _reached(self, min_etag: str) -> bool:
        """Whether this replica's cache shows the write ``min_etag`` names (validated); the
        cache's own view is never served older than that."""
        return not min_etag or self.cache.current >= int(min_etag)

    async def _written(self, job: Job | None) -> None:
        """Once this replica's cache shows ``job`` as written (bounded)."""
        if job is not None and job.etag:
            await self.cache.wait_for(int(job.etag), _CACHE_WAIT_SECONDS)

    async def ListJobs(self, request: pb.ListJobsRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> pb.ListJobsResponse:
        if request.page_size < 0:
            raise InvalidArgument.for_field("page_size", "must not be negative (0 means 100; more than 1000 means 1000)")
        size = min(request.page_size or DEFAULT_PAGE, MAX_PAGE)
        flt = parse_filter(request.filter)
        after = _decode_page(request.page_token, request.filter) if request.page_token else None
        await self._freshness(request.min_etag)  # every write made before this call (bounded)
        if not self._reached(request.min_etag):
            raise StoreUnavailable("this replica has not seen the write min_etag names and etcd did not "
                                   "answer in time; retry")
        # One synchronous walk: the page and whether another follows, at one revision.
        page: list[CachedJob | ArchivedJob] = list(
            itertools.islice(self.cache.select(flt, caller(), after), size + 1))
        if self.history is not None:
            page = await self._with_archived(page, flt, after, size + 1)
        jobs: list[job_pb2.Job] = []
        budget = MAX_PAGE_BYTES
        for entry in page[:size]:
            proto = entry.proto()
            budget -= proto.ByteSize() + 8  # (its field tag and length)
            if jobs and budget < 0:
                break
            jobs.append(proto)
        token = _encode_page(page[len(jobs) - 1].key, request.filter) if len(page) > len(jobs) else ""
        return pb.ListJobsResponse(jobs=jobs, next_page_token=token)

    async def _archived_or_missing(self, job_id: str) -> job_pb2.Job:
        """The archived job ``job_id`` the caller may read, else NOT_FOUND."""
        archived = await self._archived(job_id)
        if archived is None:
            raise JobNotFound(f"job jobs/{job_id} not found", metadata={"name": f"jobs/{job_id}"})
        return archived.proto()

    async def _archived(self, job_id: str) -> ArchivedJob | None:
        """The archived job ``job_id`` if the caller may read it (else None)."""
        if self.history is None:
            return None
        archived = await self.history.get(job_id)
        if archived is None or not access.may_read(caller(), archived):  # type: ignore[arg-type]
            return None
        return archived

    async def _with_archived(self, live: list[CachedJob | ArchivedJob], flt: Filter,
                             after: SortKey | None, want: int) -> list[CachedJob | ArchivedJob]:
        """The first ``want`` of ``live`` (the cache's page, read before this)
        and the history's matches after ``after``, in ListJobs' order. A job
        the cache holds is taken from it (etcd wins over a copy being archived);
        history rows past the cache's page end are not read beyond ``want``."""
        assert self.history is not None
        p = caller()
        bound = live[-1].key if len(live) >= want else None
        seen = {e.id for e in live}
        archived: list[ArchivedJob] = []
        cursor = after
        while len(archived) < want:
            rows = await self.history.select(flt, p, cursor, want)
            for r in rows:
                if bound is not None and r.key > bound:
                    rows = []
                    break
                if r.id not in seen and self.cache.get(r.id) is None:
                    archived.append(r)
            if len(rows) < want:
                break
            cursor = rows[-1].key
        return list(itertools.islice(heapq.merge(live, archived, key=lambda e: e.key), want))

    async def StopJob(self, request: pb.StopJobRequest,  # noqa: N802
                      context: grpc.aio.ServicerContext) -> pb.StopJobResponse:
        job_id = job_id_from_name(request.name)
        logs.JOB_ID.set(job_id)  # this handler's task: its records name the job
        validate_request_id(request.request_id)
        try:
            access.check_write(caller(), await self.store.get(job_id))
            stopped = await self.scheduler.stop(job_id)
        except JobNotFound:
            # An archived job has ended: stopping it changes nothing, as for a
            # live terminal job (the archiver may have moved it just now).
            archived = await self._archived(job_id)
            if archived is None:
                raise
            access.check_write(caller(), archived.job())
            return pb.StopJobResponse(job=archived.proto())
        await self._written(stopped)
        return pb.StopJobResponse(job=convert.job_to_proto(stopped))

    async def DeleteJob(self, request: pb.DeleteJobRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> pb.DeleteJobResponse:
        job_id = job_id_from_name(request.name)
        logs.JOB_ID.set(job_id)
        if request.etag:
            tokens.parse_etag(request.etag, "etag")
        try:
            access.check_write(caller(), await self.store.get(job_id))
        except JobNotFound:
            archived = await self._archived(job_id)
            if archived is not None:
                return await self._delete_archived(archived, request.etag)
            if not request.allow_missing:
                raise
            return pb.DeleteJobResponse()
        try:
            last = await self.scheduler.delete(job_id, True, etag=request.etag)
        except EtagMismatch as e:
            await self._refuse_never_issued(request.etag, e)
            raise
        if last is None:  # archived while its delete ran (its clean-up waited for a driver)
            archived = await self._archived(job_id)
            if archived is not None:
                # (the etag held at the first write; the clean-up was done, or recorded, above)
                return await self._delete_archived(archived, "", clean_up=False)
            if not request.allow_missing:
                raise JobNotFound(f"job jobs/{job_id} not found", metadata={"name": f"jobs/{job_id}"})
        if self.history is not None:
            # A copy the archiver wrote before the delete (etcd won until now) goes too, and
            # an archiver that picked the job before the delete never stores it again.
            await self.scheduler.delete_from_history(job_id, int(last.etag) if last is not None and last.etag else 0)
        if last is not None and last.etag:
            await self.cache.wait_gone(job_id, int(last.etag), _CACHE_WAIT_SECONDS)
        resp = pb.DeleteJobResponse()
        if last is not None:
            resp.job.CopyFrom(convert.job_to_proto(last))
        return resp

    async def _delete_archived(self, archived: ArchivedJob, etag: str, *,
                               clean_up: bool = True) -> pb.DeleteJobResponse:
        assert self.history is not None
        job = access.check_write(caller(), archived.job())
        if etag and etag != job.etag:  # it keeps the etag it was archived with
            mismatch = EtagMismatch(job.id, etag, job.etag)
            await self._refuse_never_issued(etag, mismatch)
            raise mismatch
        if job.cluster and clean_up:  # its backend objects (logs kept for it), as a live delete does
            try:
                drv = await self.scheduler.driver_for(job.cluster)
                await drv.cleanup(job.cluster, job.id, job.backend_job_id, job.uid)
            except DlschedError as e:  # (its files and objects would stay for good)
                log.warning("cleanup of archived %s on %s failed (retried): %s", job.id, job.cluster, e)
                await self.scheduler.clean_up_later(job.cluster, job.id, job.backend_job_id, job.uid)
        await self.scheduler.purge_archived(job.id, archived.revision, archived.data)
        return pb.DeleteJobResponse(job=archived.proto())

    async def WatchJobs(self, request: pb.WatchJobsRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.WatchJobsResponse]:
        # One task and one generator per stream: the heartbeat is the
        # subscription's own timeout, not a task per step (``with_heartbeats``),
        # and an event's response is built once for every stream (``_response``).
        flt: Filter = parse_filter(request.filter)
        p = caller()
        # An EXISTING event's token: cut mid-snapshot, the stream starts over with a snapshot
        # (resumed after its revision, the rest of the snapshot was lost, silently).
        resume = "" if is_snapshot_token(request.resume_token) else request.resume_token
        if resume:
            after = decode_token(resume)
            if after > self.cache.current and after > (now := await self.store.revision()):
                # A revision etcd never had: a token of another etcd (restored, replaced).
                # Subscribed, it would skip every event up to it, silently.
                raise WatchTokenExpired("resume_token is from another etcd; re-list",
                                        metadata={"revision": str(now)})
            sub = self.hub.subscribe(after)
        else:
            sub = self.hub.subscribe()  # queue live events before reading the snapshot
        try:
            # The resume token a heartbeat carries: that of the last event the
            # stream sent or skipped (filtered out, unreadable), so resuming
            # with it loses and repeats nothing.
            at = resume
            if not resume:
                # The snapshot and the subscription meet at the revision the
                # cache is known to reflect (``current``: past a purge mark or
                # sync write after its last job event, which a token must not
                # replay): no await between subscribe() and here.
                snapshot, rev = list(self.cache.select(flt, p)), self.cache.current
                sub.skip_to(rev)
                token, in_snapshot = encode_token(rev), encode_snapshot_token(rev)
                for j in snapshot:
                    yield pb.WatchJobsResponse(type=job_pb2.WATCH_EVENT_TYPE_EXISTING,
                                               job=j.proto(), resume_token=in_snapshot)
                # Heartbeats carry a token only from here: one taken mid-snapshot
                # would resume without the rest of it.
                at = token
                yield pb.WatchJobsResponse(type=job_pb2.WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE,
                                           resume_token=token)
            every = self.heartbeat_seconds if self.heartbeat_seconds > 0 else None
            loop = asyncio.get_running_loop()
            sent = loop.time()  # events filtered out send nothing: the heartbeat counts from here
            while True:
                ev = await sub.next_within(every, sent)
                if ev is None:
                    # A quiet stream re-checks its caller too: a revoked or
                    # expired token ends it here, not at the next event.
                    p = p.current()
                    yield pb.WatchJobsResponse(type=job_pb2.WATCH_EVENT_TYPE_HEARTBEAT,
                                               resume_token=at)
                    sent = loop.time()
                    continue
                if ev.archived:  # moved to the history: the job still exists, unchanged
                    at = encode_token(ev.revision)
                    continue
                resp = _response(ev)
                at = resp.resume_token
                # The caller as of now: a revoked or expired token ends the
                # stream (UNAUTHENTICATED), a lost role hides what follows.
                p = p.current()
                if access.may_read(p, ev.job) and (
                        flt.matches(ev.job)
                        # one that stops matching: its new state, once (as a job that starts
                        # matching comes as UPDATED), so a view kept from the stream stays true
                        or ((prev := ev.prev_job) is not None and flt.matches(prev))):
                    yield resp
                    sent = loop.time()
        finally:
            sub.close()

    async def _readable(self, name: str) -> Job:
        """The job ``name`` the caller may read: from etcd, else from the history
        (an archived job keeps its cluster, backend id and attempt, which its
        driver answers logs and usage of a forgotten job by)."""
        job_id = job_id_from_name(name)
        try:
            return access.check_read(caller(), await self.store.get(job_id))
        except JobNotFound:
            archived = await self._archived(job_id)
            if archived is None:
                raise
            return archived.job()

    async def _launched(self, job: Job, follow: bool) -> Job | None:
        """``job`` once launched (waited for when followed), or None: nothing to tail."""
        if not job.launched:
            if not follow or job.state.is_terminal():
                return None
            launched = await self.scheduler.wait_launched(job.id)
            if launched.uid != job.uid or not launched.launched:
                return None  # gone, or its id reused by another job
            job = launched
        return job

    async def StreamJobLogs(self, request: pb.StreamJobLogsRequest,  # noqa: N802
                            context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[pb.StreamJobLogsResponse]:
        # One generator per follower, no task of its own while it tails: the
        # heartbeat (a response with no entries and the current cursor) is the
        # tail's own timeout; the waits for a launch and for a retry's next
        # attempt beat from a task of their own (``waiting``), briefly.
        if request.tail_lines < 0:
            raise InvalidArgument.for_field("tail_lines", "0 or more")
        for i, s in enumerate(request.streams):
            if s not in (job_pb2.LOG_STREAM_STDOUT, job_pb2.LOG_STREAM_STDERR):
                raise InvalidArgument.for_field(f"streams[{i}]", "LOG_STREAM_STDOUT or LOG_STREAM_STDERR")
        if request.HasField("since_time"):  # before the driver converts it
            check_timestamp(request.since_time, "since_time")
        if request.role and not ROLE_RE.match(request.role):  # before any wait (a driver checks again)
            raise InvalidArgument.for_field("role", "a role name: [a-z][a-z0-9-]{0,62}")
        if request.HasField("replica_index") and request.replica_index < 0:
            raise InvalidArgument.for_field("replica_index", "0 or more")
        resumed = LogCursor.decode(request.resume_cursor) if request.resume_cursor else None
        every = self.heartbeat_seconds
        p = caller()
        first = await self._readable(request.name)  # its project: what heartbeats re-check against
        _check_log_replicas(request, first)
        if resumed is not None and resumed.job_uid != first.uid:  # before any wait for a launch
            raise InvalidArgument.for_field(CURSOR_FIELD, f"not a cursor of {first.name}")
        if resumed is not None and not resumed.attempt and not resumed.streams:
            resumed = None  # issued before any line: the first call again (its tail_lines too)
        # The cursor of the last response sent: every response carries one, the heartbeats
        # before the first line too (this job's, with nothing delivered).
        at = request.resume_cursor or LogCursor(first.uid).encode()
        if request.follow and every > 0:
            # At once, not after the first lines or heartbeat: a client whose follow is cut
            # from here on knows it was established, and resumes instead of failing.
            yield pb.StreamJobLogsResponse(resume_cursor=at)
        got: list[Job | None] = []
        async with contextlib.aclosing(waiting(self._launched(first, request.follow), every, got)) as beats:
            async for _ in beats:
                # Waiting for the launch: the caller as of now, as on every response below.
                p = _still_reading(p, first)
                yield pb.StreamJobLogsResponse(resume_cursor=at)
        job = got.pop()
        if job is None:
            return
        # What the caller's access is re-checked against on every response (the
        # caller as of now: a revoked or expired token ends the stream
        # UNAUTHENTICATED, a lost role in the job's project NOT_FOUND, as GetJob
        # then answers), kept here: no etcd read per batch.
        readable = _Readable(job.name, access.project_of(job))
        p = readable.check(p)
        skip: Skipper | None = None
        upstream = request
        unproved = ""  # an attempt id only the client's cursor names
        if resumed is None:
            cursor = LogCursor(job.uid)
        else:
            # Kubernetes may rotate a container's log (its first lines leave what the API reads):
            # there the dates decide; elsewhere a whole stream's counts are its positions.
            by_count = not request.HasField("since_time") and \
                await self.scheduler.cm.cluster_type(job.cluster) != job_pb2.CLUSTER_TYPE_KUBERNETES
            cursor, skip = resumed, Skipper(resumed, by_count)
            if resumed.attempt and resumed.attempt != job.backend_job_id:
                # Finish the attempt the stream was on, then go on as it would have.
                # (Its id is the cursor's word alone: one the driver does not know for
                # this job is a cursor this server never issued.)
                job = dataclasses.replace(job, backend_job_id=resumed.attempt)
                unproved = resumed.attempt
            # Every line of the attempt again; the skipper drops what was delivered.
            upstream = pb.StreamJobLogsRequest()
            upstream.CopyFrom(request)
            upstream.tail_lines = 0
        # What the tail needs of the job, not the job (a follower may wait for days).
        job_id, uid, cluster, attempt = job.id, job.uid, job.cluster, job.backend_job_id
        del job
        while True:
            cursor.at_attempt(attempt, upstream.tail_lines == 0 and not upstream.HasField("since_time"))
            drv = await self.scheduler.driver_for(cluster)
            stream = drv.tail_logs(cluster, job_id, attempt, upstream, idle=every)
            try:
                async for entries in stream:
                    p = readable.check(p)
                    if not entries:  # nothing for ``every`` seconds
                        yield pb.StreamJobLogsResponse(resume_cursor=at)
                        continue
                    out = []
                    for e in entries:
                        key, t = (e.role, e.replica_index, int(e.stream)), _time_ns(e)
                        if skip is not None and skip.seen(key, t):
                            continue
                        cursor.delivered(key, t)
                        out.append(e)
                    del entries, e
                    if out:
                        at = cursor.encode()
                        yield pb.StreamJobLogsResponse(entries=out, resume_cursor=at)
                        del out
            except NotFound as e:
                if attempt != unproved or isinstance(e, JobNotFound):  # (the caller's access, not the driver)
                    raise
                raise InvalidArgument.for_field(
                    CURSOR_FIELD, "names an attempt of this job its cluster does not know") from e
            finally:
                await stream.aclose()  # ends the tail
            skip, upstream = None, request
            if not request.follow:
                return
            # The driver's stream ends when its attempt's processes are gone;
            # the stored state follows a moment later. End only once the job
            # is terminal, and follow a retry's new attempt if one starts.
            after: list[Job | None] = []
            async with contextlib.aclosing(waiting(self._after_attempt(job_id, uid, attempt), every,
                                                   after)) as beats:
                async for _ in beats:
                    p = readable.check(p)
                    yield pb.StreamJobLogsResponse(resume_cursor=at)
            nxt = after.pop()
            if nxt is None:
                return
            readable = _Readable(nxt.name, access.project_of(nxt))
            p = readable.check(p)
            cluster, attempt = nxt.cluster, nxt.backend_job_id
            del nxt

    async def _after_attempt(self, job_id: str, uid: str, attempt: str) -> Job | None:
        """The job once its attempt has ended: None when terminal (or gone),
        the job of the next attempt when a retry was launched."""
        loop_deadline = datetime.now(UTC).timestamp() + _ATTEMPT_SETTLE_SECONDS
        while datetime.now(UTC).timestamp() < loop_deadline:
            try:
                cur = await self.store.get(job_id)
            except JobNotFound:
                return None
            if cur.uid != uid or cur.state.is_terminal():
                return None  # ended, or deleted and its id reused by another job
            if cur.launched and cur.backend_job_id != attempt:
                return cur
            await asyncio.sleep(0.05)
        log.warning("job %s: log stream ended but the job is still running", job_id)
        return None

    async def GetJobUsage(self, request: pb.GetJobUsageRequest,  # noqa: N802
                          context: grpc.aio.ServicerContext) -> pb.GetJobUsageResponse:
        job = await self._readable(request.name)
        if not job.launched:
            if job.state == JobState.PENDING or job.state.is_terminal():
                raise JobNotLaunched(f"job {job.name} has not been launched",
                                     metadata={"name": job.name})
        drv = await self.scheduler.driver_for(job.cluster)
        usage = await drv.usage(job.cluster, job.id, job.backend_job_id)
        if not usage.HasField("sample_time"):
            usage.sample_time.CopyFrom(to_timestamp(datetime.now(UTC)))
        return pb.GetJobUsageResponse(usage=usage)


def _check_log_replicas(request: pb.StreamJobLogsRequest, job: Job) -> None:
    """A role the job does not have, or a replica index past its processes, is INVALID_ARGUMENT
    (as ``kubectl logs -c`` of a container the pod lacks), not a stream that never has a line."""
    sizes = {g.role: max(1, g.replicas) * max(1, g.processes_per_replica) for g in job.spec.replica_groups}
    if request.role and request.role not in sizes:
        roles = ", ".join(sorted(sizes)[:10]) + (", ..." if len(sizes) > 10 else "")
        raise InvalidArgument.for_field("role", f"{job.name} has no role {request.role!r} (its roles: {roles})")
    if request.HasField("replica_index") and sizes:
        bound = sizes[request.role] if request.role else max(sizes.values())
        if request.replica_index >= bound:
            raise InvalidArgument.for_field(
                "replica_index", f"{job.name} has {bound} replica process(es){' of role ' + request.role if request.role else ''}: 0 to {bound - 1}")
