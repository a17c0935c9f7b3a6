"""``KeyedLocks``: one ``asyncio.Lock`` per key (a job id), alive only while held or waited
for, so the table never grows with the keys seen (JobManager's per-job lock, the driver
kit's launch lock)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class KeyedLocks:
    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}

    def __len__(self) -> int:
        """Locks held or waited for now."""
        return len(self._locks)

    def busy(self, key: str) -> bool:
        """Whether ``key``'s lock is held or waited for now."""
        return key in self._locks

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        entry = self._locks.get(key)
        if entry is None:
            entry = self._locks[key] = (asyncio.Lock(), [0])
        lock, users = entry
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._locks[key]
