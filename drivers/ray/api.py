"""The Ray Jobs REST API adapter: one aiohttp session per cluster, one status → error mapping.

Every call goes through ``RayApi.request``; transport failures (refused
connection, timeout, undecodable body) become ``BackendUnavailable``, HTTP
statuses >= 300 ``RayHttpError`` (status and body), which callers map once
more with ``RayHttpError.unavailable`` or treat (404: not there) themselves.
The token, when the cluster has one, is sent as ``Authorization: Bearer``;
it is never logged or returned.
"""

from __future__ import annotations

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
        finally:
            metrics.backend_call("ray", call_name(method, path), ok)

    async def find(self, sid: str) -> dict[str, Any] | None:
        """``GET /api/jobs/{sid}``: the submission, or ``None`` when Ray has none."""
        try:
            doc = await self.request("GET", f"/api/jobs/{sid}")
        except RayHttpError as e:
            if e.status == 404:
                return None
            raise e.unavailable(f"look up {sid}") from e
        return doc if isinstance(doc, dict) else None
