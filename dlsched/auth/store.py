"""Role bindings and API tokens in etcd, with an in-memory view every service
authenticates from.

Keys under the service prefix: ``access/bindings/{id}`` and
``access/tokens/{id}``, each a small JSON object (a token's record holds the
SHA-256 of its secret, never the secret). Every process that authenticates
(JobManager, ClusterManager) loads both prefixes once and follows them with
one etcd watch, so a check is a dict look-up and a revocation reaches every
replica as fast as etcd delivers the event. A write also updates the local
view at once, so the replica that made a change sees it immediately.

The watch is not trusted alone: after ``relist_seconds`` (300 s) without an
event the view is read again at one revision and, when it differs (a watch
that stopped delivering without an error), replaced, and the watch opened
again from there; a revocation is never missed for longer than that. A relist
that overlaps a write of this process changes nothing (its read may be older).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

import aetcd
import aetcd.exceptions

from dlsched.auth.model import ApiToken, Role, RoleBinding
from dlsched.errors import NotFound, StoreUnavailable

log = logging.getLogger("dlsched.auth.store")


class RoleBindingNotFound(NotFound):
    reason = "ROLE_BINDING_NOT_FOUND"


class ApiTokenNotFound(NotFound):
    reason = "API_TOKEN_NOT_FOUND"


def _time(s: str | None) -> datetime | None:
    return datetime.fromisoformat(s) if s else None


def _iso(t: datetime | None) -> str | None:
    return t.isoformat() if t else None


def binding_to_json(b: RoleBinding) -> bytes:
    return json.dumps({"id": b.id, "principal": b.principal, "project": b.project,
                       "role": b.role.name, "create_time": _iso(b.create_time),
                       "creator": b.creator}).encode()


def binding_from_json(data: bytes) -> RoleBinding:
    d = json.loads(data)
    return RoleBinding(d["id"], d["principal"], d["project"], Role[d["role"]],
                       _time(d.get("create_time")), d.get("creator", ""))


def token_to_json(t: ApiToken) -> bytes:
    return json.dumps({"id": t.id, "service_account": t.service_account, "sha256": t.sha256,
                       "description": t.description, "expire_time": _iso(t.expire_time),
                       "create_time": _iso(t.create_time), "creator": t.creator}).encode()


def token_from_json(data: bytes) -> ApiToken:
    d = json.loads(data)
    return ApiToken(d["id"], d["service_account"], d["sha256"], d.get("description", ""),
                    _time(d.get("expire_time")), _time(d.get("create_time")), d.get("creator", ""))


class AccessStore:
    """The etcd records and the live view of them."""

    def __init__(self, client: aetcd.Client, prefix: str, *, relist_seconds: float = 300.0) -> None:
        self._c = client
        self._relist = relist_seconds
        #: the records as etcd holds them (key -> JSON), to compare a relist with
        self._raw: dict[bytes, bytes] = {}
        #: writes this process started, and those not yet applied to the view
        #: (a relist that overlaps one keeps the view: the write may be newer than its read)
        self._writes = 0
        self._inflight = 0
        #: relists that found the view behind etcd
        self.relist_repairs = 0
        self._root = f"{prefix}access/".encode()
        self._bindings_key = self._root + b"bindings/"
        self._tokens_key = self._root + b"tokens/"
        self.bindings: dict[str, RoleBinding] = {}
        self.by_principal: dict[str, list[RoleBinding]] = defaultdict(list)
        self.tokens: dict[str, ApiToken] = {}
        self._task: asyncio.Task[None] | None = None

    # --- the view ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Load everything at one revision, then follow changes."""
        try:
            res = await self._c.get_prefix(self._root)
        except (aetcd.exceptions.ClientError, OSError) as e:
            raise StoreUnavailable(f"etcd: {e}") from e
        for kv in res:
            self._apply(bytes(kv.key), bytes(kv.value))
        rev = int(res.header.revision)
        self._task = asyncio.create_task(self._follow(rev + 1), name="access-watch")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass

    async def _follow(self, next_rev: int) -> None:
        delay = 0.2
        while True:
            try:
                watch = await self._c.watch_prefix(self._root, start_revision=next_rev)
                delay = 0.2
                loop = asyncio.get_running_loop()
                try:
                    # Relist after relist_seconds with no event: a busy watch is not cut
                    # with events still on their way; a silent one is checked.
                    async with asyncio.timeout(self._relist) as quiet:
                        async for ev in watch:
                            key = bytes(ev.kv.key)
                            if ev.kind == "DELETE":
                                self._apply(key, None)
                            else:
                                self._apply(key, bytes(ev.kv.value))
                            next_rev = max(next_rev, int(ev.kv.mod_revision) + 1)
                            quiet.reschedule(loop.time() + self._relist)
                except TimeoutError:
                    if not quiet.expired():
                        raise  # not the relist timer's
                    await watch.cancel()
                    next_rev = await self._relist_once(next_rev)
                    continue
            except asyncio.CancelledError:
                raise
            except aetcd.exceptions.RevisionCompactedError:
                # Missed events: reload the whole (small) view.
                try:
                    res = await self._c.get_prefix(self._root)
                    self._reset([(bytes(kv.key), bytes(kv.value)) for kv in res])
                    next_rev = int(res.header.revision) + 1
                    continue
                except Exception as e:  # noqa: BLE001
                    log.warning("access view reload failed (%s)", e)
            except Exception as e:  # noqa: BLE001 - reconnect on any etcd trouble
                log.warning("access watch interrupted (%s); reconnecting", e)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def _relist_once(self, next_rev: int) -> int:
        """Read the view again at one revision; replace it when it differs and
        nothing newer was applied meanwhile. The revision to watch from."""
        writes = self._writes
        if self._inflight:
            return next_rev
        res = await self._c.get_prefix(self._root)
        rev = int(res.header.revision)
        if rev + 1 < next_rev or writes != self._writes or self._inflight:
            return next_rev  # the view may hold something newer than this read
        fresh = {bytes(kv.key): bytes(kv.value) for kv in res}
        if fresh != self._raw:
            self.relist_repairs += 1
            log.warning("access view was behind etcd (%d records differed); reloaded at revision %d",
                        len(set(fresh.items()) ^ set(self._raw.items())), rev)
            self._reset(list(fresh.items()))
        return rev + 1

    def _reset(self, kvs: list[tuple[bytes, bytes]]) -> None:
        self.bindings.clear()
        self.by_principal.clear()
        self.tokens.clear()
        self._raw.clear()
        for k, v in kvs:
            self._apply(k, v)

    def _apply(self, key: bytes, value: bytes | None) -> None:
        if value is None:
            self._raw.pop(key, None)
        else:
            self._raw[key] = value
        try:
            if key.startswith(self._bindings_key):
                bid = key[len(self._bindings_key):].decode()
                old = self.bindings.pop(bid, None)
                if old is not None:
                    lst = self.by_principal.get(old.principal, [])
                    self.by_principal[old.principal] = [b for b in lst if b.id != bid]
                    if not self.by_principal[old.principal]:
                        del self.by_principal[old.principal]
                if value is not None:
                    b = binding_from_json(value)
                    self.bindings[bid] = b
                    self.by_principal[b.principal].append(b)
            elif key.startswith(self._tokens_key):
                tid = key[len(self._tokens_key):].decode()
                if value is None:
                    self.tokens.pop(tid, None)
                else:
                    self.tokens[tid] = token_from_json(value)
        except (ValueError, KeyError) as e:
            log.warning("ignoring a malformed access record %r (%s)", key, e)

    def bindings_for(self, names: list[str]) -> list[RoleBinding]:
        out: list[RoleBinding] = []
        for n in names:
            out.extend(self.by_principal.get(n, ()))
        return out

    # --- writes -----------------------------------------------------------------------------
    async def put_binding(self, b: RoleBinding) -> RoleBinding:
        for cur in self.by_principal.get(b.principal, ()):
            if cur.project == b.project and cur.role == b.role:
                return cur
        key = self._bindings_key + b.id.encode()
        await self._put(key, binding_to_json(b))
        return b

    async def delete_binding(self, bid: str) -> None:
        key = self._bindings_key + bid.encode()
        if not await self._delete(key):
            raise RoleBindingNotFound(f"role binding {bid} not found",
                                      metadata={"name": f"roleBindings/{bid}"})

    async def put_token(self, t: ApiToken) -> None:
        key = self._tokens_key + t.id.encode()
        await self._put(key, token_to_json(t))

    async def delete_token(self, tid: str) -> None:
        key = self._tokens_key + tid.encode()
        if not await self._delete(key):
            raise ApiTokenNotFound(f"API token {tid} not found", metadata={"name": f"apiTokens/{tid}"})

    async def _put(self, key: bytes, value: bytes) -> None:
        """Write the record and apply it to the view (the writer sees it at once)."""
        self._writes += 1
        self._inflight += 1
        try:
            await self._c.put(key, value)
            self._apply(key, value)
        except (aetcd.exceptions.ClientError, OSError) as e:
            raise StoreUnavailable(f"etcd: {e}") from e
        finally:
            self._inflight -= 1

    async def _delete(self, key: bytes) -> bool:
        """Delete the record (and from the view); whether there was one."""
        self._writes += 1
        self._inflight += 1
        try:
            res: Any = await self._c.delete(key)
            if res is not None:
                self._apply(key, None)
        except (aetcd.exceptions.ClientError, OSError) as e:
            raise StoreUnavailable(f"etcd: {e}") from e
        finally:
            self._inflight -= 1
        return res is not None


def utcnow() -> datetime:
    return datetime.now(UTC)
