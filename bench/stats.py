"""What every benchmark prints with: percentiles and millisecond formatting."""

from __future__ import annotations


def pct(xs: list[float], p: float) -> float:
    """The p-th percentile (nearest rank) of ``xs``; NaN when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))
    return s[k]


def ms(x: float) -> str:
    """Seconds as a fixed-width millisecond figure."""
    return f"{x * 1000:8.2f} ms"
