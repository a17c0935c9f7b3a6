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
        assert hub.reopens >= 1
        await other.create(_cluster("c"), None)  # and it goes on
        ev = await asyncio.wait_for(sub.next(), 60)
        assert ev.cluster is not None and ev.cluster.cluster_id == "c"
    finally:
        await hub.close()
        await client.delete_prefix(etcd_prefix.encode())
        await store.close()
        await other.close()
