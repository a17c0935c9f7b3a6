"""Parsing helpers for text from outside the process (clients, backends, files a job can write)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

#: the most digits taken: an int64 (an etcd revision, a Slurm id, a time in seconds) fits
MAX_DIGITS = 19


def decimal(s: str) -> bool:
    """``s`` is 1 to ``MAX_DIGITS`` ASCII digits: what ``int(s)`` takes as a plain decimal,
    at a bounded cost. ``str.isdigit`` alone is not that: it is True for '²' and other
    Unicode digits, which ``int`` refuses (ValueError), and for 5,000 digits, past
    Python's limit for ``int`` of a string (ValueError too)."""
    return len(s) <= MAX_DIGITS and s.isascii() and s.isdigit()


def flag_number(kind: type[int] | type[float], minimum: float, *,
                inclusive: bool = True) -> Callable[[str], float]:
    """An argparse ``type`` for a service flag: a finite ``kind`` of at least ``minimum``
    (more than it when not ``inclusive``). ``float('nan')`` compares false with
    everything, so a range check alone lets it through; an interval of 0 spins, a
    channel count of 0 waits forever: each is refused at start with the flag's name."""
    what = "an integer" if kind is int else "a number"

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not math.isfinite(value) or value < minimum or (not inclusive and value == minimum):
            raise argparse.ArgumentTypeError(
                f"must be a finite number {'at least' if inclusive else 'more than'} {minimum:g}, not {text}")
        return value

    parse.__name__ = kind.__name__
    return parse
