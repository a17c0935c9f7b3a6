"""The access view (``dlsched/auth/store.py``) against a real etcd: a watch that stops delivering
without an error (its events dropped on the client) cannot keep a revoked token usable for good;
the relist (after ``relist_seconds`` without an event) finds the view behind etcd, replaces it
and watches again. A healthy watch relists without touching the view, and a write of this
process that a relist overlaps is not undone by the relist's older read."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from dlsched.auth.model import ApiToken
from dlsched.auth.store import AccessStore
from dlsched.kit.etcd import connect
from tests.harness import EtcdServer


def _token(tid: str) -> ApiToken:
    return ApiToken(id=tid, service_account="ci", sha256="00" * 32)


async def _until(ok: Callable[[], bool], what: str, within: float = 60) -> None:
    deadline = time.monotonic() + within
    while not ok():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def _views(etcd: EtcdServer, prefix: str, relist: float) -> AsyncIterator[tuple[Any, AccessStore, AccessStore]]:
    """(the view's etcd client, a view relisting every ``relist`` s, a writer on a client of its own)."""
    client, other = await connect(etcd.endpoint), await connect(etcd.endpoint)
    view = AccessStore(client, prefix, relist_seconds=relist)
    writer = AccessStore(other, prefix, relist_seconds=3600)
    try:
        await writer.start()
        yield client, view, writer
    finally:
        await view.close()
        await writer.close()
        await client.delete_prefix(prefix.encode())
        await client.close()
        await other.close()


async def test_a_revocation_the_watch_missed_reaches_the_view_by_the_relist(
        etcd: EtcdServer, etcd_prefix: str) -> None:
    async with _views(etcd, etcd_prefix, 1.0) as (client, view, writer):
        await writer.put_token(_token("t1"))
        await view.start()
        assert "t1" in view.tokens
        watcher = client._watcher  # noqa: SLF001 - the stream under the view
        await _until(lambda: bool(watcher._callbacks), "the view never watched")  # noqa: SLF001
        for watch_id in list(watcher._callbacks):  # noqa: SLF001
            watcher._callbacks.pop(watch_id)  # noqa: SLF001 - its events go nowhere now
        await writer.delete_token("t1")
        await _until(lambda: "t1" not in view.tokens, "the revoked token stayed in the view")
        repairs = view.relist_repairs
        assert repairs >= 1
        await writer.put_token(_token("t2"))  # the watch opened again delivers (no relist needed)
        await _until(lambda: "t2" in view.tokens, "the view missed a token after the relist")
        assert view.relist_repairs == repairs


async def test_a_healthy_watch_relists_without_repairs(etcd: EtcdServer, etcd_prefix: str) -> None:
    async with _views(etcd, etcd_prefix, 0.3) as (_, view, writer):
        await view.start()
        for i in range(20):
            await writer.put_token(_token(f"t{i}"))
            await asyncio.sleep(0.05)
        await writer.delete_token("t3")
        await _until(lambda: set(view.tokens) == {f"t{i}" for i in range(20)} - {"t3"},
                     "the view did not follow the writes")
        await asyncio.sleep(1.5)  # several relists
        assert set(view.tokens) == {f"t{i}" for i in range(20)} - {"t3"}
        assert view.relist_repairs == 0


async def test_a_relist_never_undoes_a_write_of_this_process_it_overlaps(
        etcd: EtcdServer, etcd_prefix: str) -> None:
    """A revocation of this process in flight while a relist reads etcd, either way round: the
    relist's read may predate the delete, so the view keeps the revocation (a relist that
    replaced the view would bring the token back until the watch said otherwise)."""
    client = await connect(etcd.endpoint)
    view = AccessStore(client, etcd_prefix, relist_seconds=3600)
    real_get_prefix, real_delete = client.get_prefix, client.delete
    try:
        await view.start()
        for tid, delete_first in (("t1", True), ("t2", False)):
            await view.put_token(_token(tid))
            read, go = asyncio.Event(), asyncio.Event()

            async def slow_read(*a: object, read: asyncio.Event = read, go: asyncio.Event = go,
                                **kw: object) -> object:
                res = await real_get_prefix(*a, **kw)  # etcd still has the token here
                read.set()
                await go.wait()
                return res

            async def slow_delete(*a: object, read: asyncio.Event = read, first: bool = delete_first,
                                  **kw: object) -> object:
                await (read.wait() if first else asyncio.sleep(0))
                return await real_delete(*a, **kw)

            client.get_prefix, client.delete = slow_read, slow_delete  # type: ignore[method-assign]
            if delete_first:  # the delete starts, then the relist, whose read comes first
                deleting = asyncio.ensure_future(view.delete_token(tid))
                await asyncio.sleep(0.05)
                relist = asyncio.ensure_future(view._relist_once(1))  # noqa: SLF001
                read.set()  # (a relist that skips reads nothing)
            else:  # the relist reads, then the delete starts and lands
                relist = asyncio.ensure_future(view._relist_once(1))  # noqa: SLF001
                await read.wait()
                deleting = asyncio.ensure_future(view.delete_token(tid))
            await deleting
            go.set()
            await relist
            client.get_prefix, client.delete = real_get_prefix, real_delete  # type: ignore[method-assign]
            assert tid not in view.tokens and view.relist_repairs == 0, tid
    finally:
        client.get_prefix, client.delete = real_get_prefix, real_delete  # type: ignore[method-assign]
        await view.close()
        await client.delete_prefix(etcd_prefix.encode())
        await client.close()
