"""The etcd adapter for jobs.

Layout under the prefix: ``jobs/{id}`` holds the Job proto bytes (without its
etag: the etag is the key's mod revision); ``job-requests/{request_id}`` holds
the id of the job that SubmitJob request made, and ``job-request-of/{id}`` that
request id (written and deleted with the job, so a delete finds its request
key without reading every one).

Every write touches exactly one ``jobs/`` key per transaction, so a revision
names one job event (the watch hub relies on that). Submission is one
transaction that creates the request key and the job key together, only if
neither exists; updates are compare-and-swap on the job key's mod revision and
re-apply the caller's (domain) change on conflict. aetcd and grpc errors are
translated to ``StoreUnavailable`` here.

Reads of many jobs are paged (``scan``): the keys first, then ranges of at
most ``page_size`` jobs between known keys, all pinned at one revision, so
the result is one consistent view, no response nears the etcd client's
4 MiB receive limit, and no range makes etcd walk every key. The server reads every job only to fill
its watch cache (``cache.py``); requests never do.

Fencing: an update made for a cluster's tracking carries the ``Fence`` of the
replica's ownership of that cluster (``job_manager/ownership.py``): the
transaction also compares the owner key's mod revision with the one the
replica claimed it at. A replica whose lease expired (the key is gone) or
whose cluster another replica claimed since (a new mod revision) cannot
write; the update raises ``OwnershipLost`` instead.

Every transaction also compares the sole writer's key (``sole_writer.py``):
absent, or this process's claim. A write another replica's claim refuses
waits for its release (``_txn``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TypeVar

import aetcd
import aetcd.exceptions
import grpc
from aetcd import rpc

from dlsched.errors import Aborted, StoreUnavailable
from job_manager.convert import job_from_bytes, job_to_bytes
from job_manager.domain.errors import EtagMismatch, JobAlreadyExists, JobNotFound
from job_manager.domain.model import Job
from job_manager.sole_writer import SoleWriter

log = logging.getLogger("job_manager.store")

MAX_CAS_ATTEMPTS = 50
#: how long a job write refused by another replica's sole-writer key waits for it to go
#: (past that replica's lease TTL: a frozen holder's key expires with its lease)
FENCED_WAIT_SECONDS = 15.0
#: keys per keys-only range of a scan (a key is the prefix plus a job id: ~100 bytes at most)
KEYS_PAGE = 10_000
#: what a scan aims for per value range: well under the etcd client's 4 MiB receive limit
PAGE_BYTES = 1 << 20


def _utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class KeyValue:
    """One job key as read: the job id, its stored bytes, mod revision and version."""

    job_id: str
    value: bytes
    mod_revision: int
    version: int = 0


class PageTooLarge(StoreUnavailable):
    """A page of jobs exceeded the etcd client's receive limit."""


class RevisionCompacted(StoreUnavailable):
    """The revision a paged read was pinned at has been compacted away."""


class OwnershipLost(Aborted):
    """A fenced write found that this replica no longer owns the cluster."""

    reason = "OWNERSHIP_LOST"


class RequestJobGone(Aborted):
    """A SubmitJob's request key names a job no longer in etcd (archived, or
    deleted and its request key about to go): the scheduler looks for it in
    the job history; the client sees ABORTED (retry) otherwise."""

    def __init__(self, message: str, job_id: str, revision: int = 0) -> None:
        super().__init__(message)
        self.job_id = job_id
        self.revision = revision  # the request key's mod revision, as read


@dataclass
class Fence:
    """An ownership a write must still hold: ``key`` at mod revision ``revision``.

    ``counts`` tallies the fenced writes by outcome (applied, conflict, fenced).
    """

    cluster: str
    key: bytes
    revision: int
    counts: dict[str, int] = field(default_factory=dict)
    on_write: Callable[[str, str], None] | None = None

    def note(self, result: str) -> None:
        self.counts[result] = self.counts.get(result, 0) + 1
        if self.on_write is not None:
            self.on_write(self.cluster, result)


def archived_mark_key(prefix: str) -> bytes:
    """The key the archiver writes (the job's id) in the transaction that deletes an
    archived job's key, so watches tell an archived job from a deleted one. Inside
    the watch hub's range (``jobs.sync`` up to the end of ``jobs/``)."""
    return f"{prefix}jobs.sync.archived".encode()


def purged_mark_key(prefix: str) -> bytes:
    """The key DeleteJob of an archived job writes (``purged_mark_value``), so
    watches see the job deleted: its key left etcd when it was archived, with
    no event. One key, overwritten: etcd stays bounded. Inside the watch hub's
    range."""
    return f"{prefix}jobs.sync.purged".encode()


def purged_mark_value(job_id: str, revision: int, data: bytes) -> bytes:
    """The job as last stored (``data``, its etag's ``revision``)."""
    return b"%d %s\n" % (revision, job_id.encode()) + data


def parse_purged_mark(value: bytes) -> tuple[str, int, bytes] | None:
    """(job id, revision, data) of a ``purged_mark_value``; None if it is not one."""
    head, sep, data = value.partition(b"\n")
    rev, _, job_id = head.partition(b" ")
    if not sep or not rev.isdigit() or len(rev) > 20 or not job_id:
        return None
    return job_id.decode(errors="replace"), int(rev), data


def _prefix_end(prefix: bytes) -> bytes:
    b = bytearray(prefix)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"


_R = TypeVar("_R", bound="_Record")


@dataclass(frozen=True)
class _Record:
    """A small record JobManager keeps in etcd as JSON (its fields are strings)."""

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def decode(cls: type[_R], data: bytes) -> _R | None:
        try:
            d = json.loads(data)
            return cls(**{f.name: str(d[f.name]) for f in dataclasses.fields(cls)})
        except (ValueError, KeyError, TypeError):
            return None


@dataclass(frozen=True)
class PendingCleanup(_Record):
    """A deleted job's backend clean-up its driver could not do yet, kept in etcd
    (``job-cleanups/{job}/{uid}``) until done: retried by whichever replica would own
    the cluster, whatever restarts in between."""
    cluster: str
    job_id: str
    backend_job_id: str
    uid: str


@dataclass(frozen=True)
class PendingDelete(_Record):
    """A DeleteJob of a job that could not be stopped yet (its driver unreachable), kept in
    etcd (``job-deletes/{job}``, deleted with the job) until the job has stopped and is
    deleted: whichever replica would own the cluster finishes it, whatever restarts."""
    cluster: str
    job_id: str
    uid: str


class JobStore:
    def __init__(self, client: aetcd.Client, prefix: str = "/dlsched/", *,
                 timeout: float = 10.0, clock: Callable[[], datetime] = _utcnow,
                 sole: SoleWriter | None = None, fenced_wait: float = FENCED_WAIT_SECONDS) -> None:
        if not prefix.endswith("/"):
            prefix += "/"
        self.client = client
        self.prefix = prefix
        self.jobs_prefix = f"{prefix}jobs/".encode()
        self.requests_prefix = f"{prefix}job-requests/".encode()
        self.request_of_prefix = f"{prefix}job-request-of/".encode()
        self.cleanups_prefix = f"{prefix}job-cleanups/".encode()
        self.deletes_prefix = f"{prefix}job-deletes/".encode()
        self.archived_mark_key = archived_mark_key(prefix)
        self.purged_mark_key = purged_mark_key(prefix)
        self._timeout = timeout
        self._clock = clock
        # every job write is fenced by the sole writer's key (``sole_writer.py``)
        self.sole = sole or SoleWriter(prefix)
        self._fenced_wait = fenced_wait
        self._joined_at = -1e9  # when this process last posted the join mark

    # -- keys

    def job_key(self, job_id: str) -> bytes:
        return self.jobs_prefix + job_id.encode()

    def request_key(self, request_id: str) -> bytes:
        return self.requests_prefix + request_id.encode()

    def request_of_key(self, job_id: str) -> bytes:
        """The request id a job was made with (written with it): its delete finds its request
        key without reading every one."""
        return self.request_of_prefix + job_id.encode()

    def cleanup_key(self, job_id: str, uid: str) -> bytes:
        return self.cleanups_prefix + f"{job_id}/{uid}".encode()

    def delete_key(self, job_id: str) -> bytes:
        """A DeleteJob of this job that waits for its stop (``PendingDelete``)."""
        return self.deletes_prefix + job_id.encode()

    # -- raw etcd calls, errors translated

    async def _call(self, fn: Callable[..., object], *args: object, **kw: object) -> object:
        try:
            return await fn(*args, **kw)  # type: ignore[misc]
        except (aetcd.exceptions.ClientError, grpc.RpcError, OSError) as e:
            # The detail (gRPC's debug text, etcd's internal address) is logged, not sent.
            log.warning("etcd call failed: %s", str(e).splitlines()[0][:300] if str(e) else type(e).__name__)
            raise StoreUnavailable("etcd is unavailable; retry later") from e
        except TimeoutError as e:
            raise StoreUnavailable("etcd did not answer in time; retry later") from e

    async def _txn(self, compare: list[rpc.Compare], success: list[rpc.RequestOp],
                   failure: list[rpc.RequestOp], *, jobs: bool = True) -> rpc.TxnResponse:
        """One transaction, fenced by the sole writer's key (``sole_writer.py``): refused
        by another process's claim, it posts the join mark and waits (bounded) for the
        key to go, then runs again. ``jobs``: it writes a key the job watch covers."""
        sole = self.sole
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._fenced_wait
        pause = 0.02

        async def go(claim: int) -> rpc.TxnResponse:
            await self.client.connect()
            return await self.client.kvstub.Txn(
                rpc.TxnRequest(compare=[*compare, sole.compare(claim)], success=success,
                               failure=[*failure, self._range(sole.key)]),
                timeout=self._timeout, metadata=self.client.metadata)

        while True:
            claim = sole.claim_revision
            try:
                resp: rpc.TxnResponse = await self._call(go, claim)
            except BaseException:  # no answer (etcd, or the caller cancelled): it may have
                if sole.claim_revision:  # committed unseen, so the claim no longer knows
                    sole.drop()          # every job write made here (claimed again later)
                    sole.nudge()
                raise
            if resp.succeeded:
                if jobs:
                    sole.wrote(int(resp.header.revision))
                return resp
            holder = list(resp.responses[-1].response_range.kvs)
            del resp.responses[-1]
            if sole.admits(claim, holder):
                if jobs:  # the caller's own compare failed; it may answer from what etcd holds now
                    sole.wrote(int(resp.header.revision))
                return resp
            if not holder:  # our claim's key is gone (the lease ended): reads stop trusting it
                if claim and claim == sole.claim_revision:
                    sole.drop()
                continue
            if loop.time() >= deadline:
                raise StoreUnavailable("etcd: another JobManager replica holds the job store's "
                                       "sole-writer key and has not released it; retry")
            held = int(holder[0].create_revision)
            if holder[0].value == sole.token:  # our own key
                if held == sole.claim_revision:
                    continue  # claimed while this write was in flight
                if held == sole.stale_revision:  # a claim dropped, its key not deleted yet
                    try:
                        await self.delete_claim(held)
                        continue
                    except StoreUnavailable:
                        pass  # tried again after the pause
                sole.nudge()  # a claim being taken now, or one whose answer was lost: the round settles it
            else:
                await self._post_join()
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.5)

    async def _post_join(self) -> None:
        """Tell the claim's holder a writer waits (its watch sees the mark): one put per
        process every 2 s, however many writes wait."""
        now = asyncio.get_running_loop().time()
        if now - self._joined_at < 2.0:
            return
        self._joined_at = now
        with contextlib.suppress(StoreUnavailable):
            await self._call(self.client.put, self.sole.join_key, self.sole.token)

    async def delete_claim(self, revision: int) -> None:
        """Delete the sole writer's key if it is still the claim made at ``revision``."""
        key = self.sole.key
        cmp = rpc.Compare(key=key, result=rpc.Compare.EQUAL, target=rpc.Compare.CREATE,
                          create_revision=revision)

        async def go() -> rpc.TxnResponse:
            await self.client.connect()
            return await self.client.kvstub.Txn(
                rpc.TxnRequest(compare=[cmp], success=[
                    rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))]),
                timeout=self._timeout, metadata=self.client.metadata)
        await self._call(go)
        if self.sole.stale_revision == revision:
            self.sole.stale_revision = 0

    @staticmethod
    def _cmp(key: bytes, target: str, value: int) -> rpc.Compare:
        c = rpc.Compare(key=key, result=rpc.Compare.EQUAL)
        if target == "create":
            c.target = rpc.Compare.CREATE
            c.create_revision = value
        else:
            c.target = rpc.Compare.MOD
            c.mod_revision = value
        return c

    @staticmethod
    def _put(key: bytes, value: bytes) -> rpc.RequestOp:
        return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value))

    @staticmethod
    def _range(key: bytes) -> rpc.RequestOp:
        return rpc.RequestOp(request_range=rpc.RangeRequest(key=key))

    # -- reads

    async def revision(self) -> int:
        """The store's current revision (one single-key read, whatever the job count)."""
        async def go() -> rpc.RangeResponse:
            await self.client.connect()
            return await self.client.kvstub.Range(
                rpc.RangeRequest(key=self.jobs_prefix, keys_only=True),
                timeout=self._timeout, metadata=self.client.metadata)
        res = await self._call(go)
        return int(res.header.revision)  # type: ignore[attr-defined]

    async def get(self, job_id: str, *, within: float | None = None) -> Job:
        """The job as stored (``within``: seconds for etcd's answer; default the store's)."""
        res = await self._read_range(self.job_key(job_id), b"", within=within)
        if not res.kvs:
            raise JobNotFound(f"job jobs/{job_id} not found", metadata={"name": f"jobs/{job_id}"})
        # a write this process may not have had the answer of yet: reads proved by the
        # sole-writer claim wait for the cache to show it too (no read goes back in time)
        self.sole.wrote(int(res.kvs[0].mod_revision))
        return job_from_bytes(res.kvs[0].value, res.kvs[0].mod_revision)

    async def _read_range(self, key: bytes, end: bytes, *, limit: int = 0, revision: int = 0,
                          keys_only: bool = False, within: float | None = None) -> rpc.RangeResponse:
        """One etcd range [key, end) at ``revision`` (0: the current one); ``end`` empty: the key."""
        async def go() -> rpc.RangeResponse:
            await self.client.connect()
            return await self.client.kvstub.Range(
                rpc.RangeRequest(key=key, range_end=end, limit=limit, revision=revision,
                                 keys_only=keys_only),
                timeout=self._timeout if within is None else within, metadata=self.client.metadata)
        try:
            res: rpc.RangeResponse = await self._call(go)
            return res
        except StoreUnavailable as e:
            cause = e.__cause__
            if isinstance(cause, grpc.RpcError) and cause.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise PageTooLarge(str(e)) from cause
            if isinstance(cause, grpc.RpcError) and cause.code() == grpc.StatusCode.OUT_OF_RANGE:
                raise RevisionCompacted(str(e)) from cause
            raise

    async def job_keys(self, revision: int = 0) -> tuple[list[bytes], int]:
        """Every job key at ``revision`` (0: now), and that revision; keys only,
        ``KEYS_PAGE`` per range."""
        keys: list[bytes] = []
        start, end = self.jobs_prefix, _prefix_end(self.jobs_prefix)
        while True:
            res = await self._read_range(start, end, limit=KEYS_PAGE, revision=revision, keys_only=True)
            revision = revision or int(res.header.revision)
            keys.extend(kv.key for kv in res.kvs)
            if not res.more or not res.kvs:
                return keys, revision
            start = res.kvs[-1].key + b"\0"

    async def scan(self, page_size: int = 2000) -> AsyncIterator[tuple[list[KeyValue], int]]:
        """Every job's (id, bytes, mod revision), a page at a time, all at one
        revision, which each page names.

        First the keys (small: thousands per range), then the values, each
        range bounded by its page's first and last key. etcd counts every key
        from a range's start to its end, so ranges open to the prefix's end
        would cost O(jobs) each, O(jobs²) in all; bounded ones cost their page.
        A page over ``PAGE_BYTES`` makes the next one smaller; one past the
        client's receive limit (jobs near the size limit) is read again at half
        the size. Raises ``RevisionCompacted`` when etcd compacted the revision
        mid-scan (the caller scans again).
        """
        keys, revision = await self.job_keys()
        n, i, limit = len(self.jobs_prefix), 0, max(1, page_size)
        while i < len(keys):
            chunk = keys[i:i + limit]
            try:
                res = await self._read_range(chunk[0], chunk[-1] + b"\0", revision=revision)
            except PageTooLarge:
                if limit == 1:
                    raise
                limit = max(1, limit // 2)
                continue
            size = 0
            kvs = []
            for kv in res.kvs:
                size += len(kv.value)
                kvs.append(KeyValue(kv.key[n:].decode(), kv.value, int(kv.mod_revision),
                                    int(kv.version)))
            yield kvs, revision
            i += len(chunk)
            # the next page: about PAGE_BYTES, at most page_size keys
            limit = max(1, min(page_size, limit * PAGE_BYTES // max(size, 1)))
        if not keys:
            yield [], revision

    async def list_all(self) -> tuple[list[Job], int]:
        """Every job, and the revision the list was read at (paged: tests, tools;
        the server reads its jobs from the watch cache, ``cache.py``)."""
        jobs: list[Job] = []
        rev = 0
        async for kvs, page_rev in self.scan():
            rev = page_rev
            jobs.extend(job_from_bytes(kv.value, kv.mod_revision) for kv in kvs)
        return jobs, rev or await self.revision()

    async def release_request(self, request_id: str, job_id: str, revision: int = 0) -> bool:
        """Delete ``request_id``'s key while it names ``job_id`` (a job deleted from etcd and the
        history: its request id is free again), or with ``revision`` while it is the key as read
        at that revision (two retries releasing it at once: the second must not delete the key
        the first one's new job just wrote, naming the same job id); whether it was deleted."""
        rkey = self.request_key(request_id)
        named = (rpc.Compare(key=rkey, result=rpc.Compare.EQUAL, target=rpc.Compare.MOD, mod_revision=revision)
                 if revision else
                 rpc.Compare(key=rkey, result=rpc.Compare.EQUAL, target=rpc.Compare.VALUE, value=job_id.encode()))
        resp = await self._txn([named], [rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=rkey))],
                               [], jobs=False)
        return bool(resp.succeeded)

    async def request_job_id(self, request_id: str) -> str | None:
        """The id of the job a SubmitJob with this request_id made, while its request key lasts."""
        kv = await self._call(self.client.get, self.request_key(request_id))
        return None if kv is None else str(kv.value.decode())  # type: ignore[attr-defined]

    async def job_for_request(self, request_id: str) -> Job | None:
        """The job a SubmitJob with this request_id made, if any (in etcd)."""
        job_id = await self.request_job_id(request_id)
        if job_id is None:
            return None
        try:
            return await self.get(job_id)
        except JobNotFound:
            return None

    # -- writes

    async def create(self, job: Job, request_id: str = "") -> tuple[Job, bool]:
        """Store a new job; (job, True), or (the first job, False) for a seen request_id.

        One transaction: the job key and the request key are created together,
        only if neither exists. Raises JobAlreadyExists when only the job id
        collided.
        """
        jkey = self.job_key(job.id)
        data = job_to_bytes(job)
        compare = [self._cmp(jkey, "create", 0)]
        success = [self._put(jkey, data)]
        failure = [self._range(jkey)]
        if request_id:
            rkey = self.request_key(request_id)
            compare.insert(0, self._cmp(rkey, "create", 0))
            success.append(self._put(rkey, job.id.encode()))
            success.append(self._put(self.request_of_key(job.id), request_id.encode()))
            failure.insert(0, self._range(rkey))
        resp = await self._txn(compare, success, failure)
        if resp.succeeded:  # the job as written (parsing back what was just encoded costs a submit 3%)
            return dataclasses.replace(job, etag=str(resp.header.revision)), True
        if request_id:
            rkvs = resp.responses[0].response_range.kvs
            if rkvs:
                other_id = rkvs[0].value.decode()
                for _ in range(20):
                    try:
                        return await self.get(other_id), False
                    except JobNotFound:
                        # The request key is written with its job; a missing job
                        # means it was deleted and its request key goes next.
                        await asyncio.sleep(0.05)
                # (the other job's id stays out of the text: it may be another project's)
                raise RequestJobGone(f"request {request_id!r} names a job no longer stored; retry",
                                     other_id, rkvs[0].mod_revision)
        raise JobAlreadyExists(f"job jobs/{job.id} already exists",
                               metadata={"name": f"jobs/{job.id}"})

    async def update(self, job_id: str, change: Callable[[Job], Job | None], *,
                     fence: Fence | None = None, current: Job | None = None,
                     expect: str = "") -> Job:
        """Compare-and-swap ``change`` onto the stored job; returns the job as stored after.

        ``change`` gets the current job and returns the new one, or None for no
        change. On a conflict the job is re-read and ``change`` applied again.
        With ``fence`` the write also requires the fence's owner key unchanged;
        when it has changed, raises ``OwnershipLost`` and writes nothing. With
        ``current`` (the job as read, its etag set) the first attempt starts
        from it instead of reading the key: one round trip less when it is
        fresh, a conflict and a re-read when it is not. With ``expect`` (an etag)
        the job must be at that revision when written: else ``Aborted``, nothing
        written (AIP-154).
        """
        key = self.job_key(job_id)
        for _ in range(MAX_CAS_ATTEMPTS):
            if current is not None and current.etag:
                cur, current = current, None
            else:
                kv = await self._call(self.client.get, key)
                if kv is None:
                    raise JobNotFound(f"job jobs/{job_id} not found",
                                      metadata={"name": f"jobs/{job_id}"})
                cur = job_from_bytes(kv.value, kv.mod_revision)  # type: ignore[attr-defined]
                self.sole.wrote(int(cur.etag))  # it may be answered as it is (no change)
            if expect and cur.etag != expect:
                raise EtagMismatch(job_id, expect, cur.etag)
            new = change(cur)
            if new is None:
                return cur
            new.update_time = self._clock()
            data = job_to_bytes(new)
            compare = [self._cmp(key, "mod", int(cur.etag))]
            failure: list[rpc.RequestOp] = []
            if fence is not None:
                compare.append(self._cmp(fence.key, "mod", fence.revision))
                failure.append(self._range(fence.key))
            resp = await self._txn(compare, [self._put(key, data)], failure)
            if resp.succeeded:
                if fence is not None:
                    fence.note("applied")
                return job_from_bytes(data, resp.header.revision)
            if fence is not None:
                owner = resp.responses[0].response_range.kvs
                if not owner or owner[0].mod_revision != fence.revision:
                    fence.note("fenced")
                    raise OwnershipLost(f"no longer the owner of {fence.cluster}; "
                                        f"jobs/{job_id} left as it is")
                fence.note("conflict")
        raise Aborted(f"too many concurrent updates of jobs/{job_id}")

    async def delete(self, job_id: str, *, expect: str = "",
                     cleanup: PendingCleanup | None = None) -> Job | None:
        """Delete the job key; its last state, or None when it was missing. With
        ``expect`` (an etag) only while the job is at that revision, else ``Aborted``.
        With ``cleanup``, its record is written in the same transaction."""
        key = self.job_key(job_id)
        op = rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key, prev_kv=True))
        of = rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=self.request_of_key(job_id),
                                                                       prev_kv=True))
        extra = [self._put(self.cleanup_key(cleanup.job_id, cleanup.uid), cleanup.encode())] if cleanup else []
        extra.append(rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=self.delete_key(job_id))))
        compare = [self._cmp(key, "mod", int(expect))] if expect else []
        resp = await self._txn(compare, [op, of, *extra], [self._range(key)] if expect else [])
        if not resp.succeeded:
            kvs = resp.responses[0].response_range.kvs
            if not kvs:
                return None
            raise EtagMismatch(job_id, expect, str(kvs[0].mod_revision))
        made_by = resp.responses[1].response_delete_range.prev_kvs
        if made_by:  # its request key goes now, if it still names this job (a crash here leaves it to the sweep)
            await self.release_request(made_by[0].value.decode(), job_id)
        prev = resp.responses[0].response_delete_range.prev_kvs
        if not prev:
            return None
        return job_from_bytes(prev[0].value, prev[0].mod_revision)

    async def mark_purged(self, job_id: str, revision: int, data: bytes) -> bool:
        """Tell watches the archived job ``job_id`` is deleted (``purged_mark_key``),
        unless a live job has that id again (a delete of the archived one that came
        late, after its row went and the id was reused): whether it was written."""
        absent = rpc.Compare(key=self.job_key(job_id), result=rpc.Compare.EQUAL,
                             target=rpc.Compare.VERSION, version=0)
        put = self._put(self.purged_mark_key, purged_mark_value(job_id, revision, data))
        return bool((await self._txn([absent], [put], [])).succeeded)

    async def delete_unchanged(self, job_id: str, revision: int, *, holder_key: bytes,
                               holder: bytes) -> str:
        """Delete the job key only while its mod revision is ``revision`` and
        ``holder_key`` holds ``holder`` (the archiver's leadership): one
        transaction, one job key. ``deleted``, ``changed`` (written since),
        ``missing`` (deleted since) or ``not-holder``."""
        key = self.job_key(job_id)
        value_cmp = rpc.Compare(key=holder_key, result=rpc.Compare.EQUAL,
                                target=rpc.Compare.VALUE, value=holder)
        # The mark first: a watch sees it, then the delete it explains, at one revision.
        mark = self._put(self.archived_mark_key, job_id.encode())
        op = rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))
        # (its request key stays until the sweep has moved the pair into the history)
        of = rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=self.request_of_key(job_id)))
        resp = await self._txn([self._cmp(key, "mod", revision), value_cmp], [mark, op, of],
                               [self._range(holder_key), self._range(key)])
        if resp.succeeded:
            return "deleted"
        held = resp.responses[0].response_range.kvs
        if not held or held[0].value != holder:
            return "not-holder"
        return "changed" if resp.responses[1].response_range.kvs else "missing"

    async def request_keys(self, revision: int, limit: int = KEYS_PAGE,
                           ) -> AsyncIterator[list[tuple[bytes, str, int]]]:
        """Every request key at ``revision``, a page at a time: (key, job id, mod revision)."""
        start, end = self.requests_prefix, _prefix_end(self.requests_prefix)
        while True:
            res = await self._read_range(start, end, limit=limit, revision=revision)
            yield [(kv.key, kv.value.decode(), int(kv.mod_revision)) for kv in res.kvs]
            if not res.more or not res.kvs:
                return
            start = res.kvs[-1].key + b"\0"

    async def delete_request_key(self, key: bytes, mod_revision: int) -> bool:
        """Delete one request key if unchanged since ``mod_revision``."""
        resp = await self._txn(
            [self._cmp(key, "mod", mod_revision)],
            [rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))], [], jobs=False)
        return bool(resp.succeeded)

    # -- pending clean-ups

    async def put_cleanup(self, cleanup: PendingCleanup) -> None:
        await self._txn([], [self._put(self.cleanup_key(cleanup.job_id, cleanup.uid), cleanup.encode())],
                        [], jobs=False)

    async def delete_cleanup(self, cleanup: PendingCleanup) -> None:
        key = self.cleanup_key(cleanup.job_id, cleanup.uid)
        await self._txn([], [rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))], [],
                        jobs=False)

    async def _records(self, prefix: bytes, kind: type[_R], limit: int) -> AsyncIterator[list[_R]]:
        """The records under ``prefix``, a page at a time (unreadable ones are dropped)."""
        start, end = prefix, _prefix_end(prefix)
        while True:
            res = await self._read_range(start, end, limit=limit)
            yield [r for kv in res.kvs if (r := kind.decode(kv.value)) is not None]
            if not res.more or not res.kvs:
                return
            start = res.kvs[-1].key + b"\0"

    def cleanups(self, limit: int = 1000) -> AsyncIterator[list[PendingCleanup]]:
        """Every pending clean-up, a page at a time."""
        return self._records(self.cleanups_prefix, PendingCleanup, limit)

    async def put_pending_delete(self, d: PendingDelete) -> None:
        await self._txn([], [self._put(self.delete_key(d.job_id), d.encode())], [], jobs=False)

    async def drop_pending_delete(self, d: PendingDelete) -> None:
        """Delete ``d``'s record while it is ``d`` (not a later delete's of a job of that id)."""
        key = self.delete_key(d.job_id)
        same = rpc.Compare(key=key, result=rpc.Compare.EQUAL, target=rpc.Compare.VALUE, value=d.encode())
        await self._txn([same], [rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))], [],
                        jobs=False)

    def pending_deletes(self, limit: int = 1000) -> AsyncIterator[list[PendingDelete]]:
        """Every DeleteJob that waits for its job's stop, a page at a time."""
        return self._records(self.deletes_prefix, PendingDelete, limit)

    async def delete_request_keys(self, job_id: str) -> int:
        """Delete the request keys that name ``job_id`` (each in its own transaction), reading
        them a page at a time (one range of every key passed gRPC's 4 MiB past ~40k keys)."""
        n = 0
        async for page in self.request_keys(await self.revision()):
            for key, named, mod in page:
                if named == job_id:
                    n += await self.delete_request_key(key, mod)
        return n
