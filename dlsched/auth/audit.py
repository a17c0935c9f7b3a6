"""The audit log: one JSON line per mutating call — who, what, on which
object, and how it ended (the status code name; refused calls included).

Written by ``AuthInterceptor`` for every method whose name starts with a
mutating verb, after the call ends. ``--audit-log PATH`` appends to a file
(0600); without it the lines go to the service log (logger ``dlsched.audit``).
Never carries request bodies, so no credential or secret can reach it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from datetime import UTC, datetime
from typing import Any

_MUTATING = ("Submit", "Create", "Update", "Delete", "Stop", "Launch", "Terminate", "Cleanup",
             "Configure", "Remove")
# Request fields holding a bare id, and the collection its resource name is in.
_ID_FIELDS = (("job_id", "jobs"), ("cluster_id", "clusters"))
_RESPONSE_OBJECTS = ("job", "cluster", "role_binding", "api_token")

log = logging.getLogger("dlsched.audit")


def is_mutating(method: str) -> bool:
    """``/dlsched.v1.JobManagerService/SubmitJob`` → True."""
    return method.rsplit("/", 1)[-1].startswith(_MUTATING)


def object_of(request: Any, response: Any = None) -> str:
    """The resource name of the object a call acts on (``jobs/x``,
    ``clusters/y``, ``apiTokens/z``): from the response's object, else the
    request's object or ``name``, else its bare id made a name — so every line
    about one object names it the same way, whether the call ended OK or not."""
    for f in _RESPONSE_OBJECTS:
        obj = getattr(response, f, None) if response is not None else None
        name = getattr(obj, "name", "") if obj is not None else ""
        if isinstance(name, str) and name:
            return name[:300]
    # A refused call has no response: the request's id (a create's cluster_id, which names
    # what it makes) comes before an object's own name, which a create ignores (a caller's
    # choice: a refused CreateCluster named clusters/prod while it asked for clusters/evil).
    for f, collection in _ID_FIELDS:
        v = getattr(request, f, "")
        if isinstance(v, str) and v:
            return f"{collection}/{v}"[:300]
    obj = getattr(request, "cluster", None)  # UpdateCluster: the cluster it names
    name = getattr(obj, "name", "") if obj is not None else ""
    if not (isinstance(name, str) and name):
        name = getattr(request, "name", "")
    return name[:300] if isinstance(name, str) else ""


class AuditLog:
    """Appends audit lines. Refusals of unauthenticated callers are capped at
    ``unauthenticated_per_second`` lines (a token bucket): an anonymous flood
    cannot grow the log without bound; the next line written says how many
    were left out (``suppressed``)."""

    def __init__(self, path: str | None = None, *, unauthenticated_per_second: float = 20.0,
                 clock: Any = None) -> None:
        import time

        self._path = path
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._rate = unauthenticated_per_second
        self._clock = clock or time.monotonic
        self._tokens = unauthenticated_per_second
        self._last = self._clock()
        self._suppressed = 0
        if path:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def _admit_unauthenticated(self) -> bool:
        now = self._clock()
        self._tokens = min(self._rate, self._tokens + (now - self._last) * self._rate)
        self._last = now
        if self._tokens < 1:
            self._suppressed += 1
            return False
        self._tokens -= 1
        return True

    def write(self, *, principal: str, method: str, obj: str, result: str) -> None:
        with self._lock:
            if principal == "unauthenticated" and not self._admit_unauthenticated():
                return
            entry: dict[str, Any] = {"time": datetime.now(UTC).isoformat(), "principal": principal,
                                     "method": method, "object": obj, "result": result}
            if self._suppressed:
                entry["suppressed"] = self._suppressed  # unauthenticated lines left out before
                self._suppressed = 0
            line = json.dumps(entry, ensure_ascii=True)
            if self._fd is None:
                log.info("%s", line)
                return
            os.write(self._fd, (line + "\n").encode())

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
