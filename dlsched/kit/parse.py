"""Parsing helpers for text from outside the process (clients, backends, files a job can write)."""

from __future__ import annotations


def decimal(s: str) -> bool:
    """``s`` is one or more ASCII digits: what ``int(s)`` takes as a plain decimal.
    ``str.isdigit`` alone is not that: it is True for '²' and other Unicode digits,
    which ``int`` refuses (ValueError), so a parse guarded by it can be crashed."""
    return s.isascii() and s.isdigit()
