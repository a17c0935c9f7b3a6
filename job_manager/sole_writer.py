"""The sole writer: consistent reads without etcd round trips for a JobManager alone.

A consistent read (GetJob, ListJobs, a WatchJobs snapshot) shows every job
write made before it began. When other replicas write jobs, only etcd knows
the last one, so each read costs a read of etcd's revision (``watch.py``). A
replica that can prove no other process writes a job needs none: its cache has
every write made before it became the only writer (one revision it waits for
once) and its own since (whose revisions it knows). Kubernetes' and etcd's
leader leases make the same bargain: a lease kept alive on a bounded clock.

The proof is one key, ``{prefix}jobs-writer``:

- Every job write of every ``JobStore`` is a transaction that also compares
  it: absent, or created at the revision this writer claimed it at. While a
  replica holds it, no other process writes a job. A write it refuses posts
  the join mark ``jobs.sync.join`` (the holder's watch sees it at once) and
  waits, bounded, for the key to go.
- A replica claims it, bound to its ownership lease, only when its ownership
  round finds it the only member and no join mark came in the last
  ``COOLDOWN_SECONDS``. Another member or a join mark: it stops serving reads
  from it first, then deletes it.
- It serves reads from it only until the send time of the lease's last grant
  or refresh plus ``VALID_FRACTION`` of its TTL. etcd keeps the key at least a
  TTL past that time, so a replica frozen (SIGSTOP) or cut off stops serving
  before its key can expire and another process write.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Protocol

from aetcd import rpc

#: after a join mark, how long the replica does not claim the key again
COOLDOWN_SECONDS = 10.0
#: the share of the lease's TTL a claim serves reads for after the lease's last refresh was sent
VALID_FRACTION = 0.75


_CLOCK = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)  # BOOTTIME: Linux only


def sole_clock() -> float:
    """The claim's clock: seconds on CLOCK_BOOTTIME, which, unlike the event loop's
    CLOCK_MONOTONIC, goes on while the machine sleeps (etcd's lease clock does)."""
    return time.clock_gettime(_CLOCK)


class _KV(Protocol):
    create_revision: int
    value: bytes


class SoleWriter:
    """One process's side of the key: its claim, its own writes, its join marks."""

    def __init__(self, prefix: str, identity: str = "") -> None:
        if not prefix.endswith("/"):
            prefix += "/"
        self.key = f"{prefix}jobs-writer".encode()
        #: in the job watch's range (``watch.py``): the holder sees a waiting writer at once
        self.join_key = f"{prefix}jobs.sync.join".encode()
        # the key's value: this process alone (a restarted replica keeps its identity)
        self.token = f"{identity or 'writer'}/{uuid.uuid4().hex}".encode()
        self.claim_revision = 0  # the key's create revision while this process holds it
        self.stale_revision = 0  # a claim dropped, its key not yet deleted
        self._until = 0.0  # sole_clock() time the claim serves reads until
        self._written = 0  # the highest revision of a job write made here
        self._cool_until = 0.0
        self.nudge: Callable[[], None] = lambda: None  # the ownership round, to release at once
        self.served = 0  # reads proved by the claim

    # -- writes (JobStore)

    def compare(self, claim_revision: int) -> rpc.Compare:
        """The fence a job write carries: the key absent, or this claim's."""
        if claim_revision:
            return rpc.Compare(key=self.key, result=rpc.Compare.EQUAL, target=rpc.Compare.CREATE,
                               create_revision=claim_revision)
        return rpc.Compare(key=self.key, result=rpc.Compare.EQUAL, target=rpc.Compare.VERSION, version=0)

    @staticmethod
    def admits(claim_revision: int, kvs: Sequence[_KV]) -> bool:
        """Whether the key as read (``kvs``) passes the fence ``compare(claim_revision)``."""
        if claim_revision:
            return bool(kvs) and int(kvs[0].create_revision) == claim_revision
        return not kvs

    def wrote(self, revision: int) -> None:
        """A job write made here: reads wait for the cache to show it."""
        self._written = max(self._written, revision)

    # -- the claim (ClusterOwnership)

    def cooling(self, now: float) -> bool:
        return now < self._cool_until

    def claimed(self, revision: int, until: float) -> None:
        self.claim_revision, self._until = revision, until

    def extend(self, until: float) -> None:
        """The lease was refreshed: the claim serves reads until ``until``."""
        if self.claim_revision:
            self._until = until

    def drop(self) -> None:
        """Stop serving reads from the claim (its key is deleted after: ``stale_revision``)."""
        if self.claim_revision:
            self.stale_revision = self.claim_revision
        self.claim_revision, self._until = 0, 0.0

    def joined(self, now: float) -> None:
        """Another process waits to write a job: release now, and not claim for a while."""
        self._cool_until = now + COOLDOWN_SECONDS
        if self.claim_revision:
            self.drop()
            self.nudge()

    # -- reads (WatchHub)

    def serves(self, now: float, current: int) -> bool:
        """Whether a cache at revision ``current`` has every job write made before ``now``."""
        return (self.claim_revision != 0 and now < self._until
                and current >= self.claim_revision and current >= self._written)


__all__ = ["COOLDOWN_SECONDS", "VALID_FRACTION", "SoleWriter", "sole_clock"]
