# ruff: noqa: ASYNC109  -- tests wait on real processes
"""The kit's etcd watcher keeps each watch on its own keys.

Several watches share one etcd watch stream (JobManager: the job watch and the
access watch). A create etcd answers late (etcd starting after a restart, or
slow) times out and is retried, but the request was sent: aetcd gave its late
answer to whichever watch was waiting then, so the job watch could be bound
to the access keys and see no job event again (after an etcd restart,
JobManager's cache stopped and a job submitted then was never launched).
Real etcd; a proxy holds its answers back; and a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator

import aetcd
import pytest

from dlsched.kit.etcd import EtcdClient, WatchProgress, connect
from tests.harness import EtcdServer
from tests.test_read_your_writes import FreezingProxy


@pytest.fixture
def own_etcd() -> AsyncIterator[EtcdServer]:  # type: ignore[misc]
    server = EtcdServer().start()  # its own: this test kills it
    try:
        yield server
    finally:
        server.stop()


async def _follow(client: aetcd.Client, prefix: bytes, seen: set[bytes], *, progress: bool) -> None:
    """Watch ``prefix`` from now on, reconnecting as JobManager's watches do;
    every key an event names goes to ``seen``."""
    end = aetcd.utils.prefix_range_end(prefix)
    next_rev = 0
    while True:
        try:
            if progress:
                assert isinstance(client, EtcdClient)
                watch = await client.watch_progress(prefix, end, start_revision=next_rev or 1)
            else:
                watch = await client.watch(prefix, range_end=end, start_revision=next_rev or 1)
            async for ev in watch:
                if isinstance(ev, WatchProgress):
                    continue
                seen.add(bytes(ev.kv.key))
                next_rev = max(next_rev, int(ev.kv.mod_revision) + 1)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - reconnect on any etcd trouble
            await asyncio.sleep(0.2)


async def _put(client: aetcd.Client, key: bytes, within: float = 60.0) -> None:
    """Put, retried while the client reconnects (gRPC backs off after a refusal)."""
    deadline = time.monotonic() + within
    while True:
        try:
            await client.put(key, b"1")
            return
        except aetcd.exceptions.ClientError:
            assert time.monotonic() < deadline, "etcd did not come back"
            await asyncio.sleep(0.2)


async def _until(pred, within: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within
    while not pred():
        assert time.monotonic() < deadline, "not within the deadline"
        await asyncio.sleep(0.05)


async def test_watches_sharing_a_stream_keep_their_own_keys_across_an_etcd_restart(
        own_etcd: EtcdServer) -> None:
    client = await connect(own_etcd.endpoint, rpc_timeout=1.0)
    writer = await connect(own_etcd.endpoint)
    jobs: set[bytes] = set()
    access: set[bytes] = set()
    tasks = [asyncio.create_task(_follow(client, b"/w/jobs/", jobs, progress=True)),
             asyncio.create_task(_follow(client, b"/w/access/", access, progress=False))]
    try:
        await writer.put(b"/w/jobs/a", b"1")
        await writer.put(b"/w/access/a", b"1")
        await _until(lambda: b"/w/jobs/a" in jobs and b"/w/access/a" in access)
        assert own_etcd.proc is not None
        own_etcd.proc.kill()
        own_etcd.proc.wait()
        await asyncio.sleep(2)  # the watches retry: refused at once
        await asyncio.to_thread(own_etcd.start)
        # Frozen as it comes up (as an etcd still starting): connections are
        # accepted but not answered, so creates time out (rpc_timeout 1 s) and
        # stay queued for the stream; they reach etcd once it answers.
        own_etcd.proc.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(4)
        finally:
            own_etcd.proc.send_signal(signal.SIGCONT)
        for i in range(3):  # each watch sees its own new keys, and only those
            await _put(writer, f"/w/jobs/b{i}".encode())
            await _put(writer, f"/w/access/b{i}".encode())
        await _until(lambda: {b"/w/jobs/b2", b"/w/access/b2"} <= jobs | access)
        await _until(lambda: b"/w/jobs/b2" in jobs and b"/w/access/b2" in access)
        assert all(k.startswith(b"/w/jobs/") for k in jobs), jobs
        assert all(k.startswith(b"/w/access/") for k in access), access
    finally:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)
        await writer.close()
        await client.close()


async def test_a_create_answered_after_its_timeout_binds_no_other_watch(etcd: EtcdServer) -> None:
    async with FreezingProxy(etcd.client_port) as proxy:
        client = await connect(f"127.0.0.1:{proxy.port}", rpc_timeout=1.0)
        writer = await connect(etcd.endpoint)
        assert isinstance(client, EtcdClient)
        prefix = f"/late-{time.monotonic_ns()}/"
        jobs, access = f"{prefix}jobs/".encode(), f"{prefix}access/".encode()
        try:
            # the shared stream open (an unrelated watch)
            other = await client.watch(f"{prefix}other".encode())
            proxy.freeze()  # etcd's answers held back
            try:
                with pytest.raises(aetcd.exceptions.WatchTimeoutError):
                    await client.watch_progress(jobs, aetcd.utils.prefix_range_end(jobs), start_revision=1)
                pending = asyncio.create_task(client.watch(access, range_end=aetcd.utils.prefix_range_end(access)))
                await asyncio.sleep(0.3)  # its create is sent, waiting
            finally:
                proxy.thaw()  # the timed-out create's answer comes first
            watch = await pending
            await writer.put(jobs + b"x", b"1")
            await writer.put(access + b"x", b"1")
            first = await asyncio.wait_for(anext(aiter(watch)), 30)
            assert bytes(first.kv.key) == access + b"x", first.kv.key
            await watch.cancel()
            await other.cancel()
        finally:
            await writer.delete_prefix(prefix.encode())
            await writer.close()
            await client.close()
