"""The Ray Jobs REST API adapter: one aiohttp session per cluster, one status → error mapping.

Every call goes through ``RayApi.request``; transport failures (refused
connection, timeout, undecodable body) become ``BackendUnavailable``, HTTP
statuses >= 300 ``RayHttpError`` (status and body), which callers map once
more with ``RayHttpError.unavailable`` or treat (404: not there) themselves.
The token, when the cluster has one, is sent as ``Authorization: Bearer``;
it is never logged or returned.

Files in a node's Ray log directory (what the launcher writes) are read
through Ray's state API: ``GET /api/v0/logs/file`` (``node_id``,
``filename``, ``lines``: the last N lines, -1 all) and, to follow one,
``GET /api/v0/logs/stream`` (the same, plus ``interval``: Ray's agent sends
what was appended, checking every ``interval`` seconds, until the client
closes it). A file that is not there (yet) is ``None`` / ``FileMissing``.
Every byte read is counted in ``dlsched_backend_bytes_fetched_total``.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from dlsched.errors import Unavailable
from dlsched.kit import metrics
from drivers.common.base import ClusterConfig, TokenCredentials
from drivers.common.registry import BackendUnavailable


class RayHttpError(Exception):
    """Ray answered with an HTTP status >= 300."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text[-300:]}")
        self.status, self.text = status, text

    def unavailable(self, what: str) -> BackendUnavailable:
        """This answer as the backend refusing ``what`` for now (UNAVAILABLE, retried)."""
        return BackendUnavailable(f"Ray could not {what}: {last_line(self.text)}")


def last_line(text: str) -> str:
    """The last meaningful line of Ray's answer (its tracebacks end with the error)."""
    lines = [ln for ln in text.strip().splitlines() if any(ch.isalnum() for ch in ln)]
    return (lines[-1] if lines else text)[:500]


def call_name(method: str, path: str) -> str:
    """A bounded metric label for a call: ``GET /api/jobs/{id}/logs``, never the id itself."""
    parts = path.split("?", 1)[0].strip("/").split("/")
    if len(parts) > 2 and parts[:2] == ["api", "jobs"]:
        parts[2] = "{id}"
    return f"{method} /{'/'.join(parts[:4])}"


class FileMissing(Exception):
    """The file (or its node) is not there, or not yet."""


#: the most of one file read through the dashboard (a job's own files: their size is its choice)
MAX_FILE_READ = 64 << 20
#: Ray's answers for a file or node it cannot find (HTTP 500 with this text; 404 on some versions)
MISSING_MARKERS = ("not found", "doesn't exist", "does not exist", "Cannot find")


def _missing(e: RayHttpError) -> bool:
    return e.status == 404 or (e.status == 500 and any(m in e.text for m in MISSING_MARKERS))


class Stream:
    """One followed file: ``read`` returns what arrived (b"" once Ray closed it); safe to cancel."""

    def __init__(self, content: aiohttp.StreamReader, counter: Any, unavailable: Any) -> None:
        self._content, self._counter, self._unavailable = content, counter, unavailable

    async def read(self) -> bytes:
        try:
            data = await self._content.readany()
        except aiohttp.ClientError as e:
            raise self._unavailable(e) from e
        self._counter.inc(len(data))
        return data


class RayApi:
    """HTTP calls to one Ray head's dashboard."""

    def __init__(self, config: ClusterConfig, timeout: float) -> None:
        self.base = config.address.rstrip("/")
        headers = {}
        if isinstance(config.credentials, TokenCredentials) and config.credentials.token:
            headers["Authorization"] = f"Bearer {config.credentials.token}"
        self.session = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=timeout))

    async def close(self) -> None:
        await self.session.close()

    def _unavailable(self, e: BaseException) -> Unavailable:
        what = type(e).__name__ if not str(e) else f"{type(e).__name__}: {e}"
        return BackendUnavailable(f"Ray head {self.base} unreachable: {what}"[:500])

    def _replaced(self, e: RuntimeError) -> Exception:
        """aiohttp's "Session is closed": the cluster was configured anew (or removed) while this
        call ran on its old connection: UNAVAILABLE, retried on the new one (not INTERNAL).
        Another RuntimeError is raised as it is."""
        if not self.session.closed:
            raise e
        return BackendUnavailable(f"Ray head {self.base}: the cluster's connection was replaced while "
                                  "the call ran; retry")

    async def request(self, method: str, path: str, body: Any = None) -> Any:
        """The decoded answer (JSON, else text); ``RayHttpError`` / ``BackendUnavailable`` otherwise."""
        ok = False
        try:
            async with self.session.request(method, self.base + path, json=body) as r:
                text = await r.text()
                if r.status >= 300:
                    raise RayHttpError(r.status, text)
                ctype = r.headers.get("Content-Type", "")
                out = await r.json(content_type=None) if "json" in ctype or text[:1] in "[{" else text
                ok = True
                return out
        except RayHttpError:
            raise
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise self._unavailable(e) from e
        except RuntimeError as e:
            raise self._replaced(e) from e
        finally:
            metrics.backend_call("ray", call_name(method, path), ok)

    async def read_file(self, node_id: str, filename: str, lines: int = -1,
                        limit: int = MAX_FILE_READ, *, newest: bool = False) -> bytes | None:
        """A file in ``node_id``'s Ray log directory (its last ``lines`` lines; -1: all), at most
        ``limit`` bytes of it (jobs write these files: a read is bounded): its first, or with
        ``newest`` its last whole lines; ``None``: not there."""
        params = {"node_id": node_id, "filename": filename, "lines": str(lines)}
        ok = False
        try:
            async with self.session.get(self.base + "/api/v0/logs/file", params=params) as r:
                kept: collections.deque[bytes] = collections.deque()
                size, cut = 0, False
                async for chunk in r.content.iter_chunked(1 << 16):
                    kept.append(chunk)
                    size += len(chunk)
                    if size >= limit and not newest:
                        break
                    while newest and size - len(kept[0]) >= limit:  # whole chunks past the limit
                        size -= len(kept.popleft())
                        cut = True
                data = b"".join(kept)
                if newest and len(data) > limit:
                    data, cut = data[len(data) - limit:], True
                elif not newest:
                    data = data[:limit]
                if cut:  # the oldest line kept may be torn: from the next whole line on
                    data = data[data.find(b"\n") + 1:]
                metrics.BACKEND_BYTES.labels("ray", "GET /api/v0/logs/file").inc(len(data))
                if r.status >= 300:
                    err = RayHttpError(r.status, data.decode(errors="replace"))
                    if _missing(err):
                        ok = True
                        return None
                    raise err.unavailable(f"read {filename}")
                ok = True
                return data
        except (aiohttp.ClientError, TimeoutError) as e:
            raise self._unavailable(e) from e
        except RuntimeError as e:
            raise self._replaced(e) from e
        finally:
            metrics.backend_call("ray", "GET /api/v0/logs/file", ok)

    @contextlib.asynccontextmanager
    async def stream_file(self, node_id: str, filename: str, interval: float,
                          lines: int = -1) -> AsyncIterator[Stream]:
        """Follow a file from its last ``lines`` lines (-1: its start); ``Stream.read``: what was appended.

        Raises ``FileMissing``."""
        params = {"node_id": node_id, "filename": filename, "lines": str(lines), "interval": repr(interval)}
        call = "GET /api/v0/logs/stream"
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.session.timeout.total)
        try:
            async with self.session.get(self.base + "/api/v0/logs/stream", params=params, timeout=timeout) as r:
                if r.status >= 300:
                    data = await r.read()
                    metrics.backend_call("ray", call, False)
                    err = RayHttpError(r.status, data.decode(errors="replace"))
                    if _missing(err):
                        raise FileMissing(filename)
                    raise err.unavailable(f"follow {filename}")
                metrics.backend_call("ray", call, True)
                yield Stream(r.content, metrics.BACKEND_BYTES.labels("ray", call), self._unavailable)
        except (aiohttp.ClientError, TimeoutError) as e:
            raise self._unavailable(e) from e
        except RuntimeError as e:
            raise self._replaced(e) from e

    async def find(self, sid: str) -> dict[str, Any] | None:
        """``GET /api/jobs/{sid}``: the submission, or ``None`` when Ray has none."""
        try:
            doc = await self.request("GET", f"/api/jobs/{sid}")
        except RayHttpError as e:
            if e.status == 404:
                return None
            raise e.unavailable(f"look up {sid}") from e
        return doc if isinstance(doc, dict) else None
