"""Conversions between protobuf Timestamp/Duration and Python values, and the
one check of a Timestamp or Duration a client sent (``check_timestamp``,
``check_duration``) before anything converts it: protobuf's own conversions
raise on an out-of-range value (an INTERNAL for the client) or normalise
nanos silently."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Protocol, overload

from google.protobuf import duration_pb2, timestamp_pb2

from dlsched.errors import InvalidArgument

#: A Timestamp's range (google/protobuf/timestamp.proto): 0001-01-01T00:00:00Z ...
MIN_TIMESTAMP_SECONDS = -62135596800
#: ... to 9999-12-31T23:59:59Z.
MAX_TIMESTAMP_SECONDS = 253402300799
#: A Duration's range (google/protobuf/duration.proto): about +-10,000 years.
MAX_DURATION_SECONDS = 315576000000
_MAX_NANOS = 999_999_999


class _SecondsNanos(Protocol):
    @property
    def seconds(self) -> int: ...
    @property
    def nanos(self) -> int: ...


def check_timestamp(ts: _SecondsNanos, field: str) -> None:
    """INVALID_ARGUMENT naming ``field`` unless ``ts`` is a valid Timestamp:
    seconds within 0001-01-01..9999-12-31, nanos 0 to 999,999,999."""
    if not MIN_TIMESTAMP_SECONDS <= ts.seconds <= MAX_TIMESTAMP_SECONDS:
        raise InvalidArgument.for_field(
            field, f"seconds must be from {MIN_TIMESTAMP_SECONDS} to {MAX_TIMESTAMP_SECONDS} "
                   "(0001-01-01T00:00:00Z to 9999-12-31T23:59:59Z)")
    if not 0 <= ts.nanos <= _MAX_NANOS:
        raise InvalidArgument.for_field(field, f"nanos must be from 0 to {_MAX_NANOS}")


def check_duration(d: _SecondsNanos, field: str) -> None:
    """INVALID_ARGUMENT naming ``field`` unless ``d`` is a valid Duration: seconds
    within +-315,576,000,000, nanos within +-999,999,999 and of the sign of seconds."""
    if not -MAX_DURATION_SECONDS <= d.seconds <= MAX_DURATION_SECONDS:
        raise InvalidArgument.for_field(
            field, f"seconds must be from {-MAX_DURATION_SECONDS} to {MAX_DURATION_SECONDS}")
    if not -_MAX_NANOS <= d.nanos <= _MAX_NANOS:
        raise InvalidArgument.for_field(field, f"nanos must be from {-_MAX_NANOS} to {_MAX_NANOS}")
    if (d.seconds < 0 < d.nanos) or (d.nanos < 0 < d.seconds):
        raise InvalidArgument.for_field(field, "seconds and nanos must have the same sign")


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
