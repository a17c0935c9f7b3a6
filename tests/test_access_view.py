"""The access view (``dlsched/auth/store.py``) against a real etcd: a watch that stops delivering
without an error (its events dropped on the client) cannot keep a revoked token usable for good;
the periodic relist finds the view behind etcd, replaces it and watches again. A healthy watch
relists without touching the view."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

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


async def test_a_revocation_the_watch_missed_reaches_the_view_by_the_relist(
        etcd: EtcdServer, etcd_prefix: str) -> None:
    client, other = await connect(etcd.endpoint), await connect(etcd.endpoint)
    view = AccessStore(client, etcd_prefix, relist_seconds=1.0)
    writer = AccessStore(other, etcd_prefix, relist_seconds=3600)
    try:
        await writer.start()
        await writer.put_token(_token("t1"))
        await view.start()
        assert "t1" in view.tokens
        watcher = client._watcher  # noqa: SLF001 - the stream under the view
        await _until(lambda: bool(watcher._callbacks), "the view never watched")  # noqa: SLF001
        for watch_id in list(watcher._callbacks):  # noqa: SLF001
            watcher._callbacks.pop(watch_id)  # noqa: SLF001 - its events go nowhere now
        await writer.delete_token("t1")
        await _until(lambda: "t1" not in view.tokens, "the revoked token stayed in the view")
        assert view.relist_repairs >= 1
        await writer.put_token(_token("t2"))  # the watch opened again delivers
        await _until(lambda: "t2" in view.tokens, "the view missed a token after the relist")
    finally:
        await view.close()
        await writer.close()
        await client.delete_prefix(etcd_prefix.encode())
        await client.close()
        await other.close()


async def test_a_healthy_watch_relists_without_repairs(etcd: EtcdServer, etcd_prefix: str) -> None:
    client, other = await connect(etcd.endpoint), await connect(etcd.endpoint)
    view = AccessStore(client, etcd_prefix, relist_seconds=0.3)
    writer = AccessStore(other, etcd_prefix, relist_seconds=3600)
    try:
        await view.start()
        await writer.start()
        for i in range(20):
            await writer.put_token(_token(f"t{i}"))
            await asyncio.sleep(0.05)
        await writer.delete_token("t3")
        await _until(lambda: set(view.tokens) == {f"t{i}" for i in range(20)} - {"t3"},
                     "the view did not follow the writes")
        await asyncio.sleep(1.5)  # several relists
        assert set(view.tokens) == {f"t{i}" for i in range(20)} - {"t3"}
        assert view.relist_repairs == 0
    finally:
        await view.close()
        await writer.close()
        await client.delete_prefix(etcd_prefix.encode())
        await client.close()
        await other.close()
