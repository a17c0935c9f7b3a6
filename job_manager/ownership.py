"""One owner per cluster among JobManager replicas.

Any replica serves any call; the *tracking* of a cluster (its one
WatchJobObservations stream, launches, retries and terminations of its jobs,
their reconciliation) is done by exactly one replica, its owner.

- Each replica grants one etcd lease (``ttl`` seconds) and keeps it alive; it
  registers ``job-managers/{id}`` bound to it. The live replicas are those keys.
- A cluster's owner is the live replica that rendezvous hashing
  (``rendezvous``) picks for it: every replica computes the same answer from
  the same member list, and a joining or leaving replica moves only the
  clusters it wins or held.
- The owner holds ``cluster-owners/{cluster}`` = its id, bound to its lease,
  created only when absent. The key's mod revision is the ownership's epoch:
  every tracking write is fenced on it (``store.Fence``), so a replica whose
  lease expired (SIGKILL, a partition, SIGSTOP) cannot write after its key is
  gone, even before it notices.
- Every round (``ttl/4``, or at once when a cluster with unfinished jobs
  appears) a replica refreshes its lease, reads members and owner keys, drops
  what it no longer holds, *releases* the clusters another replica now wins
  (stops their work, then deletes its key: the winner claims it on its next
  round; the new owner's stream starts with a snapshot of the backend, so a
  transition during the hand-over is applied late, never missed) and claims
  the free clusters it wins that have unfinished jobs.
- A replica that cannot refresh its lease drops every cluster at once and
  starts a new session (new lease, registered again).

Which clusters have unfinished jobs, and which jobs of an owned cluster wait
for a launch or a termination, come from the one job watch (``WatchHub``):
SubmitJob on any replica stores the job, and its cluster's owner sees it there
and launches it. No call goes between replicas.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import os
import socket
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import aetcd
import aetcd.exceptions
import grpc
from aetcd import rpc

from dlsched.errors import DlschedError
from job_manager.cache import JobCache
from job_manager.domain.model import Job
from job_manager.job_metrics import CLUSTER_OWNED, OWNERSHIP_CHANGES, TRACKING_WRITES
from job_manager.sole_writer import VALID_FRACTION, sole_clock
from job_manager.store import Fence, JobStore
from job_manager.watch import EventType, WatchHub

log = logging.getLogger("job_manager.ownership")

_ETCD_ERRORS = (aetcd.exceptions.ClientError, grpc.RpcError, OSError, asyncio.TimeoutError)


def default_identity() -> str:
    return f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:6]}"


def rendezvous(cluster: str, replicas: Iterable[str]) -> str | None:
    """The replica that owns ``cluster`` among ``replicas`` (highest random weight)."""
    best: tuple[bytes, str] | None = None
    for r in replicas:
        score = hashlib.sha256(f"{r}\0{cluster}".encode()).digest()
        if best is None or (score, r) > best:
            best = (score, r)
    return best[1] if best else None


class Tracker(Protocol):
    """What the owner of a cluster runs (the scheduler)."""

    async def take_over(self, cluster: str) -> None: ...
    async def release(self, cluster: str) -> None: ...
    def on_job(self, job: Job) -> None: ...


class Ownership(Protocol):
    """The scheduler's view: which clusters this replica tracks, and the fence of each."""

    def owns(self, cluster: str) -> bool: ...
    def fence(self, cluster: str) -> Fence | None: ...
    async def claim(self, cluster: str) -> bool: ...
    def lost(self, cluster: str) -> None: ...
    def would_own(self, cluster: str) -> bool: ...


class SoleOwner:
    """One replica owning every cluster, without etcd keys (tests, embedding)."""

    def owns(self, cluster: str) -> bool:
        return True

    def fence(self, cluster: str) -> Fence | None:
        return None

    async def claim(self, cluster: str) -> bool:
        return True

    def lost(self, cluster: str) -> None:
        pass

    def would_own(self, cluster: str) -> bool:
        return True


def _count_write(cluster: str, result: str) -> None:
    TRACKING_WRITES.labels(cluster, result).inc()


@dataclass
class _Held:
    fence: Fence
    work: asyncio.Task[None] | None = None  # take_over, cancelled by a release


class ClusterOwnership:
    """The etcd-backed ownership (see the module docstring)."""

    def __init__(self, client: aetcd.Client, store: JobStore, hub: WatchHub, *,
                 identity: str = "", ttl: int = 5, prefix: str = "/dlsched/",
                 cache: JobCache | None = None) -> None:
        if ttl < 2:
            raise ValueError("ttl must be at least 2 seconds")
        if not prefix.endswith("/"):
            prefix += "/"
        self.identity = identity or default_identity()
        self.ttl = ttl
        self.interval = ttl / 4
        self._client, self._store, self._hub = client, store, hub
        self._cache = cache  # the watch cache; without one, the view pages through etcd
        self._sole = store.sole  # the sole-writer claim, taken while this replica is alone
        self._lease_until = 0.0  # sole_clock() time before which etcd still holds our lease's keys
        self.members_prefix = f"{prefix}job-managers/".encode()
        self.owners_prefix = f"{prefix}cluster-owners/".encode()
        self._held: dict[str, _Held] = {}
        self._members: list[str] = []
        self._lease_id = 0
        self._nudge = asyncio.Event()
        self._sole.nudge = self._nudge.set  # a writer waits: release at once
        self._lock = asyncio.Lock()  # claims and releases, one at a time
        # The job view: unfinished jobs per cluster, from the job watch.
        self._unfinished: dict[str, str] = {}  # job id -> cluster
        self._per_cluster: collections.Counter[str] = collections.Counter()
        self._view_ready = asyncio.Event()
        self._tracker: Tracker | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False

    # -- keys

    def owner_key(self, cluster: str) -> bytes:
        return self.owners_prefix + cluster.encode()

    def member_key(self, identity: str) -> bytes:
        return self.members_prefix + identity.encode()

    # -- the scheduler's view

    def owns(self, cluster: str) -> bool:
        return cluster in self._held

    def fence(self, cluster: str) -> Fence | None:
        h = self._held.get(cluster)
        return h.fence if h is not None else None

    def owned(self) -> list[str]:
        return sorted(self._held)

    async def owner_of(self, cluster: str) -> str | None:
        kv = await self._client.get(self.owner_key(cluster))
        return kv.value.decode() if kv is not None else None

    def lost(self, cluster: str) -> None:
        """A fenced write was refused: look at the keys now."""
        self._nudge.set()

    def would_own(self, cluster: str) -> bool:
        """Whether this replica owns ``cluster`` or would, were it claimed (its work that
        needs no fence: a deleted job's clean-up on a cluster with no unfinished job)."""
        return cluster in self._held or (
            bool(self._lease_id) and rendezvous(cluster, self._members) == self.identity)

    async def claim(self, cluster: str) -> bool:
        """Own ``cluster`` now if this replica is its owner-to-be and it is free
        (SubmitJob's path, so the replica that stores a job it owns launches it
        inline); True when this replica owns it."""
        if cluster in self._held:
            return True
        if not self._lease_id or rendezvous(cluster, self._members) != self.identity:
            return False
        try:
            async with self._lock:
                if cluster not in self._held:
                    await self._claim(cluster)
        except _ETCD_ERRORS as e:
            log.warning("claiming %s: %s", cluster, e)
        return cluster in self._held

    # -- life cycle

    def start(self, tracker: Tracker) -> None:
        self._tracker = tracker
        self._tasks = [asyncio.create_task(self._view(), name="ownership-view"),
                       asyncio.create_task(self._run(), name="ownership")]

    async def close(self) -> None:
        """Release every cluster (work stopped, keys deleted with the lease)."""
        self._closing = True  # a cancel an etcd error swallowed still ends the session loop
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- the job view

    def _note(self, job: Job | None, job_id: str) -> None:
        before = self._unfinished.pop(job_id, None)
        if before is not None:
            self._per_cluster[before] -= 1
            if self._per_cluster[before] <= 0:
                del self._per_cluster[before]
        if job is not None and job.cluster and not job.state.is_terminal():
            self._unfinished[job_id] = job.cluster
            if job.cluster not in self._per_cluster:
                self._nudge.set()  # a cluster to claim, perhaps
            self._per_cluster[job.cluster] += 1

    async def _view(self) -> None:
        while True:
            sub = self._hub.subscribe()
            try:
                # From the cache with no await since subscribe(): nothing falls between.
                jobs, rev = (self._cache.unfinished() if self._cache is not None
                             else await self._store.list_all())
                sub.skip_to(rev)
                self._unfinished.clear()
                self._per_cluster.clear()
                for j in jobs:
                    self._note(j, j.id)
                self._view_ready.set()
                self._nudge.set()
                while True:
                    ev = await sub.next()
                    deleted = ev.type is EventType.DELETED
                    self._note(None if deleted else ev.job, ev.job.id)
                    if not deleted and ev.job.cluster in self._held and self._tracker is not None:
                        self._tracker.on_job(ev.job)
            except DlschedError as e:
                log.info("ownership job view restarts: %s", e)
            except Exception:  # a job that fails to decode, a bug: never a silent, dead view
                log.exception("ownership job view failed; restarting it")
            finally:
                sub.close()
            await asyncio.sleep(1.0)

    # -- sessions and rounds

    async def _run(self) -> None:
        await self._view_ready.wait()
        while not self._closing:
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except (*_ETCD_ERRORS, DlschedError) as e:
                if self._closing:
                    return
                log.warning("ownership session of %s ended: %s; starting another", self.identity, e)
            except Exception:  # never a dead session loop: the replica would own nothing, silently
                log.exception("ownership session of %s failed; starting another", self.identity)
            await asyncio.sleep(self.interval)

    async def _session(self) -> None:
        sent = sole_clock()
        lease = await self._client.lease(self.ttl)
        self._lease_id = lease.id
        self._lease_until = sent + self.ttl * VALID_FRACTION
        change = "lost"
        try:
            await self._client.put(self.member_key(self.identity), b"", lease=lease)
            log.info("%s joined the JobManager replicas (lease ttl %ds)", self.identity, self.ttl)
            while True:
                await self._round()
                # asyncio.timeout, not wait_for: Python 3.11's wait_for can lose a cancel that
                # comes as the awaited call fails (close() then waited for ever on etcd down)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.interval):
                        await self._nudge.wait()
                self._nudge.clear()
                sent = sole_clock()
                async with asyncio.timeout(self.interval):
                    resp = await lease.refresh()
                if resp is None or resp.TTL <= 0:
                    raise aetcd.exceptions.ClientError("lease expired")
                # etcd keeps the lease (and the sole-writer key) at least a TTL past `sent`
                self._lease_until = sent + min(int(resp.TTL), self.ttl) * VALID_FRACTION
                self._sole.extend(self._lease_until)
        except asyncio.CancelledError:
            change = "released"  # closing: hand over at once
            raise
        finally:
            self._sole.drop()  # reads stop trusting the claim before anything else
            self._lease_id = 0
            self._lease_until = 0.0
            self._members = []
            await asyncio.shield(self._drop_all(change))
            with contextlib.suppress(*_ETCD_ERRORS):  # our keys go now, not after the TTL
                await asyncio.shield(lease.revoke())

    async def _round(self) -> None:
        # The keys are read under the lock claim() takes: a cluster claimed by a SubmitJob
        # between this read and the checks below would look "lost" (its key not in the
        # read), be dropped, and, its key still ours, never be claimed again.
        async with self._lock:
            members = sorted(kv.key[len(self.members_prefix):].decode()
                             for kv in await self._client.get_prefix(self.members_prefix, keys_only=True))
            owners = {kv.key[len(self.owners_prefix):].decode(): kv
                      for kv in await self._client.get_prefix(self.owners_prefix)}
            self._members = members
            for cluster in list(self._held):
                kv = owners.get(cluster)
                if kv is None or kv.mod_revision != self._held[cluster].fence.revision:
                    await self._drop(cluster, "lost")
                elif rendezvous(cluster, members) != self.identity:
                    await self._release(cluster)
            await self._sole_round(members)
            if self.identity not in members:
                return  # our member key is gone: the lease is too; the refresh says so
            for cluster in sorted(self._per_cluster):
                if (cluster not in self._held and cluster not in owners
                        and rendezvous(cluster, members) == self.identity):
                    await self._claim(cluster)

    async def _sole_round(self, members: list[str]) -> None:
        """Claim the sole-writer key while this replica is the only one and no other
        process waited to write a job lately; release it otherwise (``sole_writer.py``).
        Run under the round's lock: no other claim is in flight here."""
        sole = self._sole
        alone = (members == [self.identity] and self._lease_id != 0
                 and not sole.cooling(sole_clock()) and sole_clock() < self._lease_until)
        if sole.claim_revision and not alone:
            sole.drop()
            log.info("%s releases the sole-writer claim", self.identity)
        kv = await self._client.get(sole.key)
        held = int(kv.create_revision) if kv is not None else 0
        if sole.claim_revision and held != sole.claim_revision:
            sole.drop()  # its key is gone (deleted, or the lease ended): reads stop trusting it
            log.warning("%s: the sole-writer key is no longer its claim", self.identity)
        if kv is not None and kv.value == sole.token and held != sole.claim_revision:
            await self._store.delete_claim(held)  # ours, not the claim: dropped, or its answer lost
            kv = None
        if sole.stale_revision and sole.stale_revision != (held if kv is not None else 0):
            sole.stale_revision = 0
        if alone and kv is None and not sole.claim_revision:
            resp = await self._txn(
                [sole.compare(0)],
                [rpc.RequestOp(request_put=rpc.PutRequest(key=sole.key, value=sole.token,
                                                          lease=self._lease_id))])
            if not resp.succeeded:
                return
            sole.claimed(int(resp.header.revision), self._lease_until)
            if sole.cooling(sole_clock()):  # a writer came to wait meanwhile: release at once
                sole.drop()
                self._nudge.set()
                return
            log.info("%s is the only JobManager replica: it holds the sole-writer claim "
                     "(revision %d); consistent reads need no etcd round trip", self.identity,
                     sole.claim_revision)

    async def _claim(self, cluster: str) -> None:
        key = self.owner_key(cluster)
        resp = await self._txn(
            [rpc.Compare(key=key, result=rpc.Compare.EQUAL, target=rpc.Compare.CREATE, create_revision=0)],
            [rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=self.identity.encode(),
                                                      lease=self._lease_id))])
        if not resp.succeeded:
            return
        epoch = int(resp.header.revision)  # the key's mod revision: this ownership's epoch
        held = _Held(Fence(cluster, key, epoch, on_write=_count_write))
        self._held[cluster] = held
        CLUSTER_OWNED.labels(cluster).set(1)
        OWNERSHIP_CHANGES.labels(cluster, "gained").inc()
        log.info("%s owns %s (epoch %d)", self.identity, cluster, epoch)
        if self._tracker is not None:
            held.work = asyncio.create_task(self._tracker.take_over(cluster),
                                            name=f"take-over-{cluster}")

    async def _drop(self, cluster: str, change: str) -> None:
        """Stop the cluster's work; the key is the caller's business."""
        held = self._held.pop(cluster, None)
        if held is None:
            return
        if held.work is not None:
            held.work.cancel()
            await asyncio.gather(held.work, return_exceptions=True)
        if self._tracker is not None:
            await self._tracker.release(cluster)
        CLUSTER_OWNED.labels(cluster).set(0)
        OWNERSHIP_CHANGES.labels(cluster, change).inc()
        c = held.fence.counts
        log.info("%s no longer owns %s (%s; epoch %d: %d writes applied, %d conflicts, %d fenced)",
                 self.identity, cluster, change, held.fence.revision, c.get("applied", 0),
                 c.get("conflict", 0), c.get("fenced", 0))

    async def _release(self, cluster: str) -> None:
        """Hand over: stop writing, then free the key for the replica that wins it."""
        epoch = self._held[cluster].fence.revision
        await self._drop(cluster, "released")
        key = self.owner_key(cluster)
        await self._txn(
            [rpc.Compare(key=key, result=rpc.Compare.EQUAL, target=rpc.Compare.MOD, mod_revision=epoch)],
            [rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))])

    async def _txn(self, compare: list[rpc.Compare], success: list[rpc.RequestOp]) -> rpc.TxnResponse:
        await self._client.connect()
        return await self._client.kvstub.Txn(
            rpc.TxnRequest(compare=compare, success=success, failure=[]),
            timeout=self.ttl, metadata=self._client.metadata)

    async def _drop_all(self, change: str) -> None:
        async with self._lock:
            for cluster in list(self._held):
                await self._drop(cluster, change)


__all__ = ["ClusterOwnership", "Ownership", "SoleOwner", "Tracker", "default_identity", "rendezvous"]
