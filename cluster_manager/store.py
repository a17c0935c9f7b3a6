"""The etcd adapter: the cluster registry, credentials and the prefix watch.

Layout under the prefix (ARCHITECTURE.md): ``clusters/{id}`` (Cluster proto,
credentials cleared), ``cluster-credentials/{id}`` (ClusterCredentials proto),
``cluster-requests/{request_id}`` (the id a CreateCluster made, written in the
create's transaction). Credentials are envelope-encrypted (``dlsched.kit.envelope``,
aad = the cluster id) on write and decrypted on read; plain text never reaches etcd.
A cluster whose ``has_credentials`` turns false loses its credentials key in the
same transaction. A cluster's etag is its key's mod revision; every
read-modify-write compares it, so concurrent writers never lose an update.
aetcd and grpc errors become ``StoreUnavailable``; a compacted watch start
becomes ``WatchTokenExpired``.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import aetcd
import aetcd.exceptions
import grpc

from dlsched.errors import (
    Aborted,
    DlschedError,
    InvalidArgument,
    StoreUnavailable,
    WatchTokenExpired,
)
from dlsched.kit.envelope import Keyring

from . import convert
from .domain.errors import ClusterAlreadyExists, ClusterEtagMismatch, ClusterNotFound
from .domain.models import Cluster, ClusterType, Credentials, cluster_name

log = logging.getLogger("cluster_manager.store")

T = TypeVar("T")
_UNSET: Any = object()
CAS_RETRIES = 20


class EventKind(enum.Enum):
    CREATED = "CREATED"
    UPDATED = "UPDATED"
    DELETED = "DELETED"


@dataclass(frozen=True)
class StoreEvent:
    """One change of one ``clusters/`` key, at an etcd revision."""

    kind: EventKind
    revision: int
    cluster: Cluster  # after the change; the last state for DELETED
    prev: Cluster | None


@asynccontextmanager
async def _translated(what: str) -> AsyncIterator[None]:
    try:
        yield
    except DlschedError:
        raise
    except aetcd.exceptions.RevisionCompactedError as e:
        raise WatchTokenExpired(
            f"etcd history was compacted (revision {e.compacted_revision}); re-list") from e
    except aetcd.exceptions.InvalidArgumentError as e:  # e.g. a request past etcd's size limit
        log.warning("etcd refused %s: %s", what, str(e)[:200])
        raise InvalidArgument(f"etcd refused the {what} (too large?); a retry would be refused too") from e
    except (TimeoutError, aetcd.exceptions.ClientError, grpc.RpcError, OSError) as e:
        log.warning("etcd %s failed: %s", what, type(e).__name__)
        raise StoreUnavailable(f"etcd is unavailable ({what}); retry later") from e


class ClusterStore:
    def __init__(self, client: aetcd.Client, keyring: Keyring, prefix: str = "/dlsched/") -> None:
        self._c = client
        self._keyring = keyring
        self._tx = client.transactions
        p = prefix if prefix.endswith("/") else prefix + "/"
        self.prefix = p
        self._clusters = f"{p}clusters/".encode()
        #: JobManager's owner keys (job_manager/ownership.py): which replica tracks each cluster.
        self._owners = f"{p}cluster-owners/".encode()
        self._creds = f"{p}cluster-credentials/".encode()
        self._requests = f"{p}cluster-requests/".encode()

    def _ckey(self, cluster_id: str) -> bytes:
        return self._clusters + cluster_id.encode()

    def _credkey(self, cluster_id: str) -> bytes:
        return self._creds + cluster_id.encode()

    def _reqkey(self, request_id: str) -> bytes:
        return self._requests + request_id.encode()

    def _seal(self, cluster_id: str, creds: Credentials) -> bytes:
        return self._keyring.encrypt(convert.credentials_to_bytes(creds), cluster_id)

    def _unseal(self, cluster_id: str, blob: bytes) -> Credentials | None:
        return convert.credentials_from_bytes(self._keyring.decrypt(blob, cluster_id))

    def _decode(self, value: bytes, mod_revision: int) -> Cluster:
        return convert.cluster_from_bytes(value, str(mod_revision))

    async def close(self) -> None:
        async with _translated("close"):
            await self._c.close()

    # --- reads ----------------------------------------------------------

    async def get(self, cluster_id: str) -> Cluster:
        async with _translated("get"):
            kv = await self._c.get(self._ckey(cluster_id))
        if kv is None:
            raise ClusterNotFound(cluster_name(cluster_id))
        return self._decode(kv.value, kv.mod_revision)

    async def tracking_replica(self, cluster_id: str) -> str:
        """The JobManager replica that tracks the cluster now ("" when none)."""
        async with _translated("get"):
            kv = await self._c.get(self._owners + cluster_name(cluster_id).encode())
        return kv.value.decode(errors="replace") if kv is not None else ""

    async def tracking_replicas(self) -> dict[str, str]:
        """Cluster name -> tracking replica, for every cluster some replica tracks (one range read)."""
        async with _translated("list"):
            res = await self._c.get_prefix(self._owners)
        return {bytes(kv.key)[len(self._owners):].decode(errors="replace"): bytes(kv.value).decode(errors="replace")
                for kv in res}

    async def list_all(self) -> tuple[list[Cluster], int]:
        """Every cluster by id, and the etcd revision of the read."""
        async with _translated("list"):
            res = await self._c.get_prefix(self._clusters)
        clusters = [self._decode(kv.value, kv.mod_revision) for kv in res]
        clusters.sort(key=lambda c: c.cluster_id)
        return clusters, res.header.revision

    async def current_revision(self) -> int:
        async with _translated("revision"):
            res = await self._c.get_prefix(self._clusters, keys_only=True)
        return int(res.header.revision)

    async def last_change(self) -> int:
        """The newest mod revision of a cluster record (0 when there is none)."""
        async with _translated("revision"):
            res = await self._c.get_prefix(self._clusters, keys_only=True)
        return max((int(kv.mod_revision) for kv in res), default=0)

    async def get_credentials(self, cluster_id: str) -> tuple[Credentials | None, int]:
        """The stored credentials and their key's mod revision (0 when none).
        DecryptError when the record cannot be decrypted with the keyring."""
        async with _translated("get credentials"):
            kv = await self._c.get(self._credkey(cluster_id))
        if kv is None:
            return None, 0
        return self._unseal(cluster_id, kv.value), int(kv.mod_revision)

    # --- writes ---------------------------------------------------------

    async def create(self, cluster: Cluster, creds: Credentials | None,
                     request_id: str = "", *, released: bool = False) -> Cluster:
        """Store a new cluster. With ``request_id``, a retry (or a concurrent
        twin) returns the cluster the first request made; once that cluster is
        deleted the request id is free again (as SubmitJob's after a DeleteJob):
        its key, naming a cluster no longer stored, is released (compared on
        its revision as read) and the cluster made anew."""
        ckey = self._ckey(cluster.cluster_id)
        compare = [self._tx.create(ckey) == 0]
        success = [self._tx.put(ckey, convert.cluster_to_bytes(cluster))]
        failure = [self._tx.get(ckey)]
        if creds is not None:
            success.append(self._tx.put(self._credkey(cluster.cluster_id),
                                        self._seal(cluster.cluster_id, creds)))
        if request_id:
            rkey = self._reqkey(request_id)
            compare.append(self._tx.create(rkey) == 0)
            success.append(self._tx.put(rkey, cluster.cluster_id.encode()))
            failure.append(self._tx.get(rkey))
        async with _translated("create"):
            ok, resp = await self._c.transaction(compare=compare, success=success,
                                                 failure=failure)
        if ok:
            rev = resp[0].response_put.header.revision
            return self._with_etag(cluster, rev)
        existing = resp[0]
        if request_id and resp[1]:
            made = resp[1][0][0].decode()
            if made != cluster.cluster_id:
                async with _translated("create"):
                    other = await self._c.get(self._ckey(made))
                if other is not None or released:
                    raise InvalidArgument.for_field(
                        "request_id", f"already used to create {cluster_name(made)}")
            if made != cluster.cluster_id or not existing:
                if released:  # released once, and taken again: a concurrent twin's, now
                    raise ClusterNotFound(cluster_name(made),
                                          f"{cluster_name(made)}, made by this request, was deleted")
                rkey = self._reqkey(request_id)
                read_at = resp[1][0][1].mod_revision  # the key as read: not one a twin retry wrote since
                async with _translated("create"):
                    await self._c.transaction(compare=[self._tx.mod(rkey) == read_at],
                                              success=[self._tx.delete(rkey)], failure=[])
                return await self.create(cluster, creds, request_id, released=True)
            value, kv = existing[0]
            return self._decode(value, kv.mod_revision)
        raise ClusterAlreadyExists(cluster.name)

    @staticmethod
    def _with_etag(c: Cluster, rev: int) -> Cluster:
        return replace(c, etag=str(rev))

    async def update(
        self,
        cluster_id: str,
        mutate: Callable[[Cluster], Cluster],
        *,
        etag: str = "",
        credentials: Credentials | None = _UNSET,
    ) -> Cluster:
        """Read, ``mutate``, write back if nobody wrote in between.

        With ``etag`` the stored etag must match (else Aborted); without, a
        conflicting write makes us re-read and re-apply ``mutate``.
        ``credentials``: leave unset to keep them (unless ``mutate`` turns
        ``has_credentials`` false, which deletes them), None to delete them.
        """
        ckey = self._ckey(cluster_id)
        for _ in range(CAS_RETRIES):
            async with _translated("get"):
                kv = await self._c.get(ckey)
            if kv is None:
                raise ClusterNotFound(cluster_name(cluster_id))
            if etag and etag != str(kv.mod_revision):
                raise ClusterEtagMismatch(cluster_name(cluster_id), etag, str(kv.mod_revision))
            current = self._decode(kv.value, kv.mod_revision)
            updated = mutate(current)
            ops = [self._tx.put(ckey, convert.cluster_to_bytes(updated))]
            if credentials is not _UNSET:
                if credentials is None:
                    ops.append(self._tx.delete(self._credkey(cluster_id)))
                else:
                    ops.append(self._tx.put(self._credkey(cluster_id),
                                            self._seal(cluster_id, credentials)))
            elif current.has_credentials and not updated.has_credentials:
                ops.append(self._tx.delete(self._credkey(cluster_id)))
            async with _translated("update"):
                ok, resp = await self._c.transaction(
                    compare=[self._tx.mod(ckey) == kv.mod_revision], success=ops, failure=[])
            if ok:
                return self._with_etag(updated, resp[0].response_put.header.revision)
            if etag:
                raise Aborted(f"{cluster_name(cluster_id)} changed concurrently; re-read and retry")
        raise Aborted(f"{cluster_name(cluster_id)} is changing too often; retry")

    async def delete(self, cluster_id: str, *, etag: str = "") -> Cluster | None:
        """Delete the cluster and its credentials; its last state, or None if missing.
        With ``etag`` only while the record is at that revision, else Aborted (missing:
        None, as without)."""
        ckey = self._ckey(cluster_id)
        compare = [self._tx.mod(ckey) == int(etag)] if etag else []
        async with _translated("delete"):
            ok, resp = await self._c.transaction(
                compare=compare,
                success=[self._tx.delete(ckey, prev_kv=True), self._tx.delete(self._credkey(cluster_id))],
                failure=[self._tx.get(ckey)],
            )
        if not ok:
            if not resp[0]:  # a get's answer: [(value, kv)], empty when missing
                return None
            raise ClusterEtagMismatch(cluster_name(cluster_id), etag, str(resp[0][0][1].mod_revision))
        prev = resp[0].response_delete_range.prev_kvs
        if not prev:
            return None
        return self._decode(prev[0].value, prev[0].mod_revision)

    async def reencrypt_all(self) -> int:
        """Rewrite every credentials record not yet under the keyring's active
        key (including plain-text records from before encryption) under it;
        how many were rewritten. Each rewrite compares the record's mod
        revision, re-reading it when a writer came in between, so a
        concurrent UpdateCluster or delete always wins."""
        async with _translated("list credentials"):
            res = await self._c.get_prefix(self._creds)
        rewritten = 0
        for kv0 in res:
            key = bytes(kv0.key)
            cid = key[len(self._creds):].decode()
            value, mod = bytes(kv0.value), int(kv0.mod_revision)
            for _ in range(CAS_RETRIES):
                if Keyring.key_id_of(value) == self._keyring.active_key_id:
                    break
                if Keyring.key_id_of(value) is None:  # stored before encryption
                    plain = value
                else:
                    plain = self._keyring.decrypt(value, cid)
                blob = self._keyring.encrypt(plain, cid)
                async with _translated("re-encrypt"):
                    ok, _ = await self._c.transaction(
                        compare=[self._tx.mod(key) == mod],
                        success=[self._tx.put(key, blob)], failure=[])
                if ok:
                    rewritten += 1
                    break
                async with _translated("get credentials"):
                    kv = await self._c.get(key)
                if kv is None:
                    break
                value, mod = bytes(kv.value), int(kv.mod_revision)
            else:
                raise Aborted(f"credentials of {cluster_name(cid)} are changing too often; retry")
        return rewritten

    # --- watch ----------------------------------------------------------

    async def watch(self, start_revision: int) -> AsyncIterator[StoreEvent]:
        """Changes of ``clusters/`` from ``start_revision`` (inclusive), forever."""
        async with _translated("watch"):
            w = await self._c.watch_prefix(self._clusters, start_revision=start_revision,
                                           prev_kv=True)
        try:
            async with _translated("watch"):
                async for ev in w:
                    yield self._event(ev)
        finally:
            try:
                await w.cancel()
            except Exception:  # noqa: BLE001 - the stream is going away anyway
                pass
        raise StoreUnavailable("etcd watch ended")

    def _event(self, ev: Any) -> StoreEvent:
        kv = ev.kv
        prev = self._decode(ev.prev_kv.value, ev.prev_kv.mod_revision) if ev.prev_kv else None
        if ev.kind == "DELETE":
            last = prev if prev is not None else Cluster(
                cluster_id=kv.key[len(self._clusters):].decode(), type=ClusterType.UNSPECIFIED,
                driver_address="")
            return StoreEvent(EventKind.DELETED, kv.mod_revision, last, prev)
        kind = EventKind.CREATED if kv.version == 1 else EventKind.UPDATED
        return StoreEvent(kind, kv.mod_revision, self._decode(kv.value, kv.mod_revision), prev)

