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
    for msg in (response, request):
        for f in _RESPONSE_OBJECTS:
            obj = getattr(msg, f, None) if msg is not None else None
            name = getattr(obj, "name", "") if obj is not None else ""
            if isinstance(name, str) and name:
                return name[:300]
    name = getattr(request, "name", "")
    if isinstance(name, str) and name:
        return name[:300]
    for f, collection in _ID_FIELDS:
        v = getattr(request, f, "")
        if isinstance(v, str) and v:
            return f"{collection}/{v}"[:300]
    return ""


class AuditLog:
    def __init__(self, path: str | None = None) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._fd: int | None = None
        if path:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def write(self, *, principal: str, method: str, obj: str, result: str) -> None:
        line = json.dumps({"time": datetime.now(UTC).isoformat(), "principal": principal,
                           "method": method, "object": obj, "result": result},
                          ensure_ascii=True)
        if self._fd is None:
            log.info("%s", line)
            return
        with self._lock:
            os.write(self._fd, (line + "\n").encode())

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
