"""Leader election over etcd: one leader among a service's replicas.

The leader holds ``key`` bound to a lease it keeps alive; the key is created
in a transaction that only succeeds when it does not exist, so at most one
replica holds it. A replica that dies (even SIGKILL) stops refreshing, the
lease expires after ``ttl`` seconds, etcd deletes the key and a waiting
replica's watch sees the delete and campaigns again. A leader that cannot
refresh its lease (etcd unreachable, lease gone) steps down at once: it
cancels its leader work before the lease can expire, so two leaders never
work at the same time for longer than one refresh interval.

Only the leader-only work is gated: every replica keeps serving its RPCs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import aetcd
import aetcd.exceptions
import aetcd.rtypes

log = logging.getLogger("dlsched.election")

_ETCD_ERRORS = (aetcd.exceptions.ClientError, OSError, asyncio.TimeoutError)


class Leadership:
    """Campaign for ``key`` and run ``lead()`` while leader."""

    def __init__(self, client: aetcd.Client, key: bytes, identity: str, *, ttl: int = 5) -> None:
        if ttl < 2:
            raise ValueError("ttl must be at least 2 seconds")
        self._client = client
        self.key = key
        self.identity = identity
        self.ttl = ttl
        self.is_leader = False
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    def start(self, lead: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Campaign in the background; ``lead()`` runs while this replica leads
        and is cancelled when it stops leading."""
        self._task = asyncio.create_task(self._campaign(lead), name=f"election-{self.key.decode()}")

    async def close(self) -> None:
        """Stop campaigning; a leader hands over at once (deletes its key)."""
        self._closing = True  # a cancel an etcd error swallowed still ends the campaign
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def leader(self) -> str | None:
        """The identity of the current leader, if any."""
        kv = await self._client.get(self.key)
        return kv.value.decode() if kv is not None else None

    async def _campaign(self, lead: Callable[[], Coroutine[Any, Any, None]]) -> None:
        while not self._closing:
            try:
                lease = await self._client.lease(self.ttl)
                won, _ = await self._client.transaction(
                    compare=[self._client.transactions.create(self.key) == 0],
                    success=[self._client.transactions.put(self.key, self.identity.encode(), lease=lease)],
                    failure=[])
                if won:
                    await self._lead(lease, lead)
                else:
                    with contextlib.suppress(*_ETCD_ERRORS):
                        await lease.revoke()
                    await self._wait_for_vacancy()
            except asyncio.CancelledError:
                raise
            except _ETCD_ERRORS as e:
                if self._closing:
                    return
                log.warning("election %s: etcd: %s; campaigning again", self.key.decode(), e)
                await asyncio.sleep(1.0)

    async def _wait_for_vacancy(self) -> None:
        """Until the key is deleted (or a timeout: then campaign again anyway)."""
        kv = await self._client.get(self.key)
        if kv is None:
            return
        with contextlib.suppress(aetcd.exceptions.WatchTimeoutError):
            await self._client.watch_once(self.key, timeout=self.ttl * 2, start_revision=kv.mod_revision + 1,
                                          kind=aetcd.rtypes.EventKind.DELETE)

    async def _lead(self, lease: aetcd.leases.Lease, lead: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self.is_leader = True
        log.info("%s leads %s", self.identity, self.key.decode())
        work = asyncio.create_task(lead(), name=f"leader-{self.key.decode()}")
        try:
            while not work.done():
                done, _ = await asyncio.wait({work}, timeout=self.ttl / 3)
                if done:
                    break
                async with asyncio.timeout(self.ttl / 3):  # (not wait_for: see ownership._session)
                    resp = await lease.refresh()
                if resp is None or resp.TTL <= 0:
                    raise aetcd.exceptions.ClientError("lease expired")
            if work.done() and not work.cancelled() and work.exception() is not None:
                log.error("leader work of %s failed", self.key.decode(), exc_info=work.exception())
        finally:
            self.is_leader = False
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            log.info("%s steps down from %s", self.identity, self.key.decode())
            with contextlib.suppress(*_ETCD_ERRORS):
                await asyncio.shield(lease.revoke())
