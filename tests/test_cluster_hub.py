"""ClusterManager's watch hub (``cluster_manager/hub.py``) against a real etcd: a watch that stops
delivering without an error (its events dropped on the client) would leave WatchClusters and the
monitors (which start one per new cluster from the hub) behind for good; the watchdog finds a
change the watch has not delivered and watches again from the last revision published."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aetcd

from cluster_manager.domain.models import Cluster, ClusterType
from cluster_manager.hub import WatchHub
from cluster_manager.store import ClusterStore
from dlsched.kit.envelope import Keyring, generate_key_file
from tests.harness import EtcdServer


def _cluster(cid: str) -> Cluster:
    return Cluster(cluster_id=cid, type=ClusterType.LOCAL, driver_address="127.0.0.1:1")


async def test_a_silent_cluster_watch_is_opened_again(etcd: EtcdServer, etcd_prefix: str,
                                                      tmp_path: Path) -> None:
    generate_key_file(tmp_path / "key.json")
    keyring = Keyring.load(tmp_path / "key.json")
    client = aetcd.Client(host="127.0.0.1", port=etcd.client_port)
    writer = aetcd.Client(host="127.0.0.1", port=etcd.client_port)
    store, other = ClusterStore(client, keyring, etcd_prefix), ClusterStore(writer, keyring, etcd_prefix)
    hub = WatchHub(store, stall_seconds=0.5)
    try:
        await hub.start()
        sub = await hub.subscribe()
        await other.create(_cluster("a"), None)
        first = await asyncio.wait_for(sub.next(), 60)
        assert first.cluster is not None and first.cluster.cluster_id == "a"
        assert hub.reopens == 0  # a watch that delivers is left alone
        watcher = client._watcher  # noqa: SLF001 - the stream under the hub
        for watch_id in list(watcher._callbacks):  # noqa: SLF001
            watcher._callbacks.pop(watch_id)  # noqa: SLF001 - its events go nowhere now
        await other.create(_cluster("b"), None)
        ev = await asyncio.wait_for(sub.next(), 60)  # never, without the watchdog
        assert ev.cluster is not None and ev.cluster.cluster_id == "b"
        reopens = hub.reopens
        assert reopens >= 1
        await other.create(_cluster("c"), None)  # and the watch opened again delivers
        ev = await asyncio.wait_for(sub.next(), 60)
        assert ev.cluster is not None and ev.cluster.cluster_id == "c"
        assert hub.reopens == reopens
    finally:
        await hub.close()
        await client.delete_prefix(etcd_prefix.encode())
        await store.close()
        await other.close()


async def test_closing_while_the_watchdog_reopens_ends_both(etcd: EtcdServer, etcd_prefix: str,
                                                            tmp_path: Path) -> None:
    """close() during a reopen (the old watch slow to end) still ends the watchdog and the
    new watch task; a cancel swallowed there hung close()."""
    generate_key_file(tmp_path / "key.json")
    client = aetcd.Client(host="127.0.0.1", port=etcd.client_port)
    store = ClusterStore(client, Keyring.load(tmp_path / "key.json"), etcd_prefix)
    hub = WatchHub(store, stall_seconds=3600)
    try:
        await hub.start()
        old = hub._task  # noqa: SLF001
        assert old is not None
        hub._watchdog.cancel()  # type: ignore[union-attr]  # noqa: SLF001 - a reopen driven by hand below
        slow = asyncio.Event()

        async def slow_end() -> None:
            try:
                await asyncio.Event().wait()
            finally:
                await slow.wait()  # ends only when let go

        old.cancel()
        await asyncio.gather(old, return_exceptions=True)
        hub._task = asyncio.create_task(slow_end())  # noqa: SLF001 - a watch task slow to end
        await asyncio.sleep(0)
        hub._stall = 0.01  # noqa: SLF001
        hub._watchdog = asyncio.create_task(hub._watch_stalls())  # noqa: SLF001
        await other_change(store)
        await asyncio.sleep(0.3)  # the watchdog owes a change and waits for the old task's end
        closing = asyncio.ensure_future(hub.close())
        await asyncio.sleep(0.1)
        slow.set()
        await asyncio.wait_for(closing, 30)
        assert hub._watchdog.done()  # noqa: SLF001
        assert hub._task is not None and hub._task.done()  # noqa: SLF001
    finally:
        await client.delete_prefix(etcd_prefix.encode())
        await store.close()


async def other_change(store: ClusterStore) -> None:
    await store.create(_cluster("x"), None)
