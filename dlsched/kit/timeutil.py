"""Conversions between protobuf Timestamp/Duration and Python values."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import overload

from google.protobuf import duration_pb2, timestamp_pb2


@overload
def to_timestamp(dt: datetime | float) -> timestamp_pb2.Timestamp: ...
@overload
def to_timestamp(dt: None) -> None: ...
@overload
def to_timestamp(dt: datetime | float | None) -> timestamp_pb2.Timestamp | None: ...
def to_timestamp(dt: datetime | float | None) -> timestamp_pb2.Timestamp | None:
    if dt is None:
        return None
    ts = timestamp_pb2.Timestamp()
    if isinstance(dt, datetime):
        ts.FromDatetime(dt.astimezone(UTC))
    else:
        ts.FromNanoseconds(int(dt * 1e9))
    return ts


def from_timestamp(ts: timestamp_pb2.Timestamp | None) -> datetime | None:
    if ts is None or (ts.seconds == 0 and ts.nanos == 0):
        return None
    return ts.ToDatetime(tzinfo=UTC)


@overload
def to_duration(seconds: float) -> duration_pb2.Duration: ...
@overload
def to_duration(seconds: None) -> None: ...
@overload
def to_duration(seconds: float | None) -> duration_pb2.Duration | None: ...
def to_duration(seconds: float | None) -> duration_pb2.Duration | None:
    if seconds is None:
        return None
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


def from_duration(d: duration_pb2.Duration | None) -> float | None:
    if d is None or (d.seconds == 0 and d.nanos == 0):
        return None
    return d.ToNanoseconds() / 1e9
