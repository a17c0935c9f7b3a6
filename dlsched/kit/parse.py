"""Parsing helpers for text from outside the process (clients, backends, files a job can write)."""

from __future__ import annotations

#: the most digits taken: an int64 (an etcd revision, a Slurm id, a time in seconds) fits
MAX_DIGITS = 19


def decimal(s: str) -> bool:
    """``s`` is 1 to ``MAX_DIGITS`` ASCII digits: what ``int(s)`` takes as a plain decimal,
    at a bounded cost. ``str.isdigit`` alone is not that: it is True for '²' and other
    Unicode digits, which ``int`` refuses (ValueError), and for 5,000 digits, past
    Python's limit for ``int`` of a string (ValueError too)."""
    return len(s) <= MAX_DIGITS and s.isascii() and s.isdigit()
