"""Logging set-up: one line per record, with a filter that masks credentials.

Services never log credentials in the first place; the redacting filter is a
second line of defence for values that look like keys or tokens.

Two formats: ``text`` (the default, for people) and ``json`` (one JSON object
per line, for log pipelines: time, level, service, logger, message, and the
``job_id`` of the job the record is about). Code that works on one job wraps
it in ``job_context(job_id)``; every record logged inside, in that task and
the tasks it starts, carries the id.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import re
import sys
from collections.abc import Iterator
from datetime import UTC, datetime

JOB_ID: contextvars.ContextVar[str] = contextvars.ContextVar("dlsched_job_id", default="")


@contextlib.contextmanager
def job_context(job_id: str) -> Iterator[None]:
    """Records logged inside carry ``job_id``."""
    token = JOB_ID.set(job_id)
    try:
        yield
    finally:
        JOB_ID.reset(token)

#: a longer message (or exception text) is cut after it is redacted, before it is written: text a job
#: or a client chose (a state, a reason) may reach a log line, and its cost stays bounded
MAX_LOG_CHARS = 16384
_KEY_BEGIN = re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----")
_KEY_END = re.compile(r"-----END [A-Z ]*PRIVATE KEY-----")
_SECRET_PATTERNS = [
    re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]{8,}"),
    re.compile(r"(?i)((?:token|password|private_key|kubeconfig)\s*[=:]\s*)\S+"),
]


#: Characters that would end or rewrite a log line (newlines, CR, NUL, escapes): a message
#: quoting a client's value (a percent-decoded path) could forge whole records with them.
_CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f\x85\u2028\u2029]")


def _escaped(m: re.Match[str]) -> str:
    c = m.group()
    return {"\n": "\\n", "\r": "\\r"}.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


class RedactingFilter(logging.Filter):
    """Masks private keys and tokens in formatted log messages, and escapes control characters
    (one record, one line; a traceback, added by the formatter, keeps its lines)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        red = _CONTROL.sub(_escaped, redact(msg))
        if red != msg:
            record.msg = red
            record.args = None
        return True


def _cut(text: str) -> str:
    """Its head and its tail (a traceback's last line, the exception, is the one that matters)."""
    if len(text) <= MAX_LOG_CHARS:
        return text
    half = MAX_LOG_CHARS // 2
    return f"{text[:half]} ... ({len(text) - 2 * half} characters cut) ... {text[-half:]}"


def _redact_keys(text: str) -> str:
    """Each private key block masked; one without its END line is masked to the end (one scan:
    every search starts where the last one stopped)."""
    out, pos = [], 0
    while (b := _KEY_BEGIN.search(text, pos)) is not None:
        out.append(text[pos:b.start()])
        e = _KEY_END.search(text, b.end())
        out.append("[REDACTED]")
        if e is None:
            return "".join(out)
        pos = e.end()
    out.append(text[pos:])
    return "".join(out)


def redact(text: str) -> str:
    """Secrets masked (each scan linear in the text), then cut to ``MAX_LOG_CHARS``: cut first,
    a key whose BEGIN line fell in the cut would show its body."""
    text = _redact_keys(text)
    for pat in _SECRET_PATTERNS:
        text = pat.sub(lambda m: (m.group(1) if m.groups() else "") + "[REDACTED]", text)
    return _cut(text)


class JsonFormatter(logging.Formatter):
    """One JSON object per record (after redaction)."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self._service = service

    def format(self, record: logging.LogRecord) -> str:
        doc = {"time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
               "level": record.levelname, "service": self._service, "logger": record.name,
               "message": record.getMessage()}
        job_id = getattr(record, "job_id", "") or JOB_ID.get()
        if job_id:
            doc["job_id"] = job_id
        if record.exc_info:
            doc["exception"] = redact(self.formatException(record.exc_info))
        return json.dumps(doc, ensure_ascii=False)


def setup(level: str = "INFO", service: str = "dlsched", fmt: str = "text") -> None:
    if fmt not in ("text", "json"):
        raise ValueError(f"log format: want text or json, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service) if fmt == "json" else
                         logging.Formatter(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s"))
    handler.addFilter(RedactingFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
