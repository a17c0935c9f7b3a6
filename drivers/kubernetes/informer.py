"""One list + watch per cluster over the dlsched pods (the informer pattern), and the request budget.

``PodInformer`` runs in a daemon thread (the official client blocks): it
lists the pods with label ``dlsched.io/job-id`` in the cluster's namespace,
hands the whole set to ``on_sync``, then watches from the list's
``resourceVersion`` and hands each event to ``on_event``. A watch that ends
after it was answered (``timeout_seconds``, a dropped connection, one read
timeout) resumes from the last resourceVersion seen (bookmarks included);
``410 Gone`` (the version was compacted away) re-lists. Any failure to reach
the API server (connection refused, 5xx, a request never answered) calls
``on_stale`` and retries with capped exponential backoff; the next
successful list calls ``on_sync`` again. So do watches that keep ending at
once with nothing read (a proxy that cuts them: ``MAX_EMPTY_WATCHES`` in a
row), after backing off between them, and a second read timeout in a row (a
healthy server ends every watch at ``timeout_seconds``, before the read
timeout, and sends bookmarks: a watch silent that long hangs). So status needs one
long-lived request per cluster, however many jobs it runs: no per-job GETs.

Callbacks run on the informer thread; the driver hops them onto its event
loop (``loop.call_soon_threadsafe``). Events are plain JSON dicts (the
client's ``deserialize=False``), the same shape ``states.replica_of`` reads.

``RequestBudget`` is the client-side QPS/burst token bucket every API call
of the driver takes a token from (the informer's long-lived watch takes one
per (re)connect), so a busy driver stays polite to the API server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from dlsched.kit import metrics

log = logging.getLogger("dlsched.driver.kubernetes")

#: watches in a row that ended (cleanly or dropped) within ``QUICK_WATCH_SECONDS`` with nothing read:
#: backed off between them, and this many call ``on_stale`` and re-list
MAX_EMPTY_WATCHES = 3
QUICK_WATCH_SECONDS = 2.0


class RequestBudget:
    """A token bucket: ``qps`` tokens a second, at most ``burst`` saved up. Thread-safe.

    ``acquire`` blocks (``sleep``) until a token is there: a full bucket lets
    ``burst`` requests through at once, then one every ``1/qps`` seconds.
    """

    def __init__(self, qps: float, burst: int, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self._qps = max(qps, 0.001)
        self._burst = max(1, burst)
        self._tokens = float(self._burst)
        self._clock = clock
        self._sleep = sleep
        self._last = clock()
        self._lock = threading.Lock()

    def _take(self) -> float:
        """0 when a token was taken, else the seconds until one is there."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self._burst, self._tokens + (now - self._last) * self._qps)
            self._last = now
            if self._tokens >= 1 - 1e-9:  # a token earned by the last sleep, rounding aside
                self._tokens = max(0.0, self._tokens - 1)
                return 0.0
            return (1 - self._tokens) / self._qps

    def acquire(self) -> None:
        while wait := self._take():
            self._sleep(wait)

    async def acquire_async(self) -> None:
        """``acquire`` on the event loop (a pod log read), sleeping without a thread."""
        while wait := self._take():  # noqa: ASYNC110 - a token bucket: the wait is computed, no event
            await asyncio.sleep(wait)


class PodInformer:
    """List + watch of the dlsched pods of one namespace, in a daemon thread."""

    def __init__(self, core: Any, namespace: str, label_selector: str, budget: RequestBudget, *,
                 on_sync: Callable[[list[dict[str, Any]]], None],
                 on_event: Callable[[str, dict[str, Any]], None],
                 on_stale: Callable[[str], None],
                 watch_timeout: int = 300, read_timeout: float = 330.0,
                 request_timeout: float = 10.0, max_backoff: float = 10.0) -> None:
        self._core = core
        self._ns = namespace
        self._selector = label_selector
        self._budget = budget
        self._on_sync, self._on_event, self._on_stale = on_sync, on_event, on_stale
        self._watch_timeout = watch_timeout
        self._read_timeout = read_timeout
        self._request_timeout = request_timeout
        self._max_backoff = max_backoff
        self._stop = threading.Event()
        self._watch: Any = None
        self._streaming = False  # the open watch was answered (its read timeout means idle)
        self._lines = 0  # lines the open watch delivered
        self._thread = threading.Thread(target=self._run, name=f"informer-{namespace}", daemon=True)
        self.resource_version = ""
        self.lists = 0
        self.watches = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        resp = self._watch  # the open watch response: its socket shut down, its reader ends
        # (closing the response here would wait for the lock its blocked reader holds)
        sock = getattr(getattr(resp, "connection", None), "sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _list(self) -> None:
        self._budget.acquire()
        metrics.backend_call("kubernetes", "list_namespaced_pod")
        resp = self._core.list_namespaced_pod(self._ns, label_selector=self._selector,
                                              _preload_content=False,
                                              _request_timeout=self._request_timeout)
        try:
            doc = json.loads(resp.data)
        finally:
            resp.release_conn()
        self.lists += 1
        self.resource_version = (doc.get("metadata") or {}).get("resourceVersion") or ""
        self._on_sync(list(doc.get("items") or ()))

    def _watch_once(self) -> bool:
        """Watch until the stream ends; False when the resourceVersion is gone (re-list).

        The stream's lines are read here, not through the client's ``Watch``: with
        ``deserialize=False`` it raised ``KeyError('raw_object')`` on an ERROR event, so the
        410 an API server sends inside a watch (a resourceVersion compacted away) was taken
        for a failure of the cluster instead of a re-list."""
        from kubernetes.watch.watch import iter_resp_lines

        self._budget.acquire()
        metrics.backend_call("kubernetes", "watch_namespaced_pod")
        self.watches += 1
        kwargs: dict[str, Any] = {
            "label_selector": self._selector, "allow_watch_bookmarks": True, "watch": True,
            "timeout_seconds": self._watch_timeout, "_preload_content": False,
            "_request_timeout": (self._request_timeout, self._read_timeout),
        }
        if self.resource_version:
            kwargs["resource_version"] = self.resource_version
        try:
            resp = self._core.list_namespaced_pod(self._ns, **kwargs)
        except Exception as e:
            if getattr(e, "status", None) == 410:
                return False
            raise
        self._watch = resp
        try:
            if self._stop.is_set():
                return True
            if resp.status == 410:
                return False
            if not 200 <= resp.status <= 299:
                from kubernetes.client.exceptions import ApiException

                raise ApiException(http_resp=resp)
            self._streaming = True  # answered: a read timeout from here on is an idle watch
            for line in iter_resp_lines(resp):  # type: ignore[no-untyped-call]
                if self._stop.is_set():
                    return True
                self._lines += 1
                ev = json.loads(line)
                kind = ev.get("type")
                obj = ev.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        return False
                    raise RuntimeError(f"watch error {obj.get('code')}: {obj.get('reason')}")
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                if rv:
                    self.resource_version = rv
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self._on_event(kind, obj)
        finally:
            self._watch = None
            with contextlib.suppress(Exception):
                resp.close()
            with contextlib.suppress(Exception):
                resp.release_conn()
        return True

    def _run(self) -> None:
        backoff = 0.2
        need_list = True
        empty = 0  # watches in a row that ended at once with nothing read
        timed_out = False  # the last watch ended in a read timeout
        while not self._stop.is_set():
            self._streaming = False
            self._lines = 0
            started = time.monotonic()
            try:
                if need_list:
                    self._list()
                    need_list = False
                    if not empty:
                        backoff = 0.2
                if not self._watch_once():
                    log.info("watch of %s: resourceVersion gone (410); re-listing", self._ns)
                    need_list = True
                    continue
                timed_out = False
            except Exception as e:  # noqa: BLE001 - the informer never dies
                if self._stop.is_set():
                    return
                read_timeout = _is_read_timeout(e)
                if not (self._streaming and (_is_dropped(e) or (read_timeout and not timed_out))):
                    # Not answered (an API server that accepts and never answers, refused, 5xx),
                    # or a second read timeout in a row: the cluster failing, not an idle watch.
                    self._failed(_describe(e) if not self._streaming else "the watch hangs (no bookmark, no end)")
                    need_list, timed_out, empty = True, False, 0
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, self._max_backoff)
                    continue
                timed_out = read_timeout  # answered, then silent or cut: resume from the last version
            if self._lines or time.monotonic() - started >= QUICK_WATCH_SECONDS:
                empty, backoff = 0, 0.2
                continue
            empty += 1  # ended at once with nothing read: never in a tight loop
            if empty >= MAX_EMPTY_WATCHES:
                self._failed(f"{empty} watches in a row ended at once with nothing read")
                need_list, empty = True, 0
            self._stop.wait(backoff)
            backoff = min(backoff * 2, self._max_backoff)

    def _failed(self, msg: str) -> None:
        log.warning("list/watch of pods in %s failed: %s", self._ns, msg)
        self._on_stale(msg)


def _is_dropped(exc: BaseException) -> bool:
    """The connection ended mid-stream (no final chunk): urllib3's ProtocolError, a reset."""
    seen: BaseException | None = exc
    for _ in range(6):
        if seen is None:
            return False
        if type(seen).__name__ in ("ProtocolError", "IncompleteRead", "InvalidChunkLength",
                                   "ConnectionResetError", "BrokenPipeError"):
            return True
        seen = seen.__cause__ or seen.__context__ or (seen.args[0] if seen.args and
                                                       isinstance(seen.args[0], BaseException) else None)
    return False


def _is_read_timeout(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    for _ in range(6):
        if seen is None:
            return False
        if type(seen).__name__ in ("ReadTimeoutError", "TimeoutError", "timeout"):
            return True
        seen = seen.__cause__ or seen.__context__ or (seen.args[0] if seen.args and
                                                       isinstance(seen.args[0], BaseException) else None)
    return False


def _describe(exc: BaseException) -> str:
    status = getattr(exc, "status", None)
    if isinstance(status, int) and status:
        return f"HTTP {status} {getattr(exc, 'reason', '') or ''}".strip()
    return type(exc).__name__
