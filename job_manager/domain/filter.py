"""The ListJobs / WatchJobs filter: terms joined by AND (AIP-160 style).

Equality terms ``field=value`` or ``field!=value`` on ``state`` (RUNNING or
JOB_STATE_RUNNING), ``run_mode`` (MULTI_PROCESS or RUN_MODE_MULTI_PROCESS),
``cluster`` (clusters/local or local), ``project``, ``owner`` and
``labels.KEY``; values may be double-quoted. Time terms ``create_time OP
"RFC 3339"`` or ``end_time OP "RFC 3339"`` with OP one of ``<``, ``<=``,
``>``, ``>=`` (e.g. ``create_time >= "2026-12-01T00:00:00Z"``): each becomes
a half-open range of whole microseconds (job times have microsecond
precision), and the terms on one field intersect (``Filter.create_range``,
``Filter.end_range``). A ``create_time`` range makes the watch cache and the
history walk only that slice of their create-time order. ``end_time`` is
when a job reached its terminal state (``end_us_of``); a job that has not
ended matches no ``end_time`` term, so the cache walks only its terminal
jobs (or a smaller index another term names) and the history bounds its
``end_us`` column.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone

from dlsched import spec_rules
from dlsched.auth.model import PROJECT_RE
from dlsched.errors import InvalidArgument
from job_manager.domain.model import Job, JobState, RunMode

_TERM_RE = re.compile(
    r'^\s*([A-Za-z_][A-Za-z0-9_]*(?:\.[^\s=!<>]+)?)\s*(!=|<=|>=|=|<|>)\s*("[^"]*"|\'[^\']*\'|[^\s"\']+)\s*\Z')
# Split only at a whitespace run's first character: one scan, however long the runs.
_AND_RE = re.compile(r"(?<!\s)\s+AND\s+")
#: the longest filter taken (checked before any parsing: a request's work is bounded first)
MAX_FILTER_CHARS = 8192
_RFC3339 = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?(?:([Zz])|([+-])(\d{2}):(\d{2}))",
    re.ASCII)  # RFC 3339's digits are ASCII (\d matched '٢٠٢٦')
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)
#: the fields time terms compare
TIME_FIELDS = ("create_time", "end_time")


@dataclass(frozen=True)
class Term:
    field: str
    negate: bool
    value: str | int

    def matches(self, job: Job) -> bool:
        if self.field == "state":
            got: str | int = int(job.state)
        elif self.field == "run_mode":
            got = int(job.spec.run_mode)
        elif self.field == "cluster":
            got = job.cluster
        elif self.field == "project":
            got = job.project or "default"
        elif self.field == "owner":
            got = job.owner
        else:
            key = self.field[len("labels."):]
            if key not in job.labels:
                return self.negate
            got = job.labels[key]
        return (got == self.value) != self.negate


@dataclass(frozen=True)
class TimeRange:
    """``lo <= field < hi`` in microseconds since the epoch (None: unbounded)."""

    field: str
    lo: int | None = None
    hi: int | None = None

    def contains(self, us: int) -> bool:
        return (self.lo is None or us >= self.lo) and (self.hi is None or us < self.hi)

    def empty(self) -> bool:
        return self.lo is not None and self.hi is not None and self.lo >= self.hi


def create_us_of(job: object) -> int:
    """A job's create time in microseconds: ``create_us`` of the cache's and
    the history's entries, else the domain ``Job``'s ``create_time``."""
    us = getattr(job, "create_us", None)
    if us is not None:
        return int(us)
    ct = getattr(job, "create_time", None)
    return (ct - _EPOCH) // _US if isinstance(ct, datetime) else 0


def end_us_of(job: object) -> int | None:
    """When a job ended, in microseconds (None: not ended): ``end_us`` of the
    cache's and the history's entries, else the domain ``Job``'s ``end_time``
    (``update_time``, then ``create_time``, when a terminal job lacks it, as
    ``convert.end_us_of_proto``)."""
    if hasattr(job, "end_us"):
        us = job.end_us
        return None if us is None else int(us)
    state = getattr(job, "state", None)
    if not isinstance(state, JobState) or not state.is_terminal():
        return None
    for f in ("end_time", "update_time", "create_time"):
        t = getattr(job, f, None)
        if isinstance(t, datetime):
            return (t - _EPOCH) // _US
    return 0


@dataclass(frozen=True)
class Filter:
    terms: tuple[Term, ...] = ()
    #: at most one per field of ``TIME_FIELDS``, the intersection of its terms
    times: tuple[TimeRange, ...] = ()

    def matches(self, job: Job) -> bool:
        if not all(t.matches(job) for t in self.terms):
            return False
        for r in self.times:
            us = create_us_of(job) if r.field == "create_time" else end_us_of(job)
            if us is None or not r.contains(us):
                return False
        return True

    @property
    def create_range(self) -> TimeRange | None:
        return next((r for r in self.times if r.field == "create_time"), None)

    @property
    def end_range(self) -> TimeRange | None:
        """The ``end_time`` range; only terminal jobs can match one."""
        return next((r for r in self.times if r.field == "end_time"), None)


def _enum_value(enum: type[JobState] | type[RunMode], prefix: str, raw: str) -> int:
    name = raw.upper()
    if name.startswith(prefix):
        name = name[len(prefix):]
    try:
        member = enum[name]
    except KeyError:
        member = None
    if member is None or member == 0:
        names = ", ".join(m.name for m in enum if m != 0)
        raise InvalidArgument.for_field("filter", f"unknown value {raw!r}; one of {names}")
    return int(member)


def parse_rfc3339_ns(raw: str) -> int:
    """Nanoseconds since the epoch of an RFC 3339 timestamp (the whole string)."""
    m = _RFC3339.fullmatch(raw)
    if not m:
        raise InvalidArgument.for_field(
            "filter", f"bad time {raw[:40]!r}; want RFC 3339, e.g. \"2026-12-01T00:00:00Z\"")
    year, month, day, hour, minute, second = (int(m.group(i)) for i in range(1, 7))
    frac = m.group(7) or ""
    tz = UTC
    if m.group(9):
        oh, om = int(m.group(10)), int(m.group(11))
        off = timedelta(hours=oh, minutes=om)
        if oh > 23 or om > 59:
            raise InvalidArgument.for_field("filter", f"bad time {raw[:40]!r}: offset out of range")
        tz = timezone(off if m.group(9) == "+" else -off)
    try:
        dt = datetime(year, month, day, hour, minute, second, tzinfo=tz)
    except ValueError as e:
        raise InvalidArgument.for_field("filter", f"bad time {raw[:40]!r}: {e}") from e
    return (dt - _EPOCH) // _US * 1000 + int(frac.ljust(9, "0") if frac else 0)


def _ceil_us(ns: int) -> int:
    return -(-ns // 1000)


def _time_range(field: str, op: str, raw: str) -> TimeRange:
    ns = parse_rfc3339_ns(raw)
    # Job times are whole microseconds: t*1000 OP ns, as a half-open range of t.
    if op == ">=":
        return TimeRange(field, lo=_ceil_us(ns))
    if op == ">":
        return TimeRange(field, lo=ns // 1000 + 1)
    if op == "<":
        return TimeRange(field, hi=_ceil_us(ns))
    if op == "<=":
        return TimeRange(field, hi=ns // 1000 + 1)
    raise InvalidArgument.for_field(
        "filter", f"{field} takes <, <=, > or >= and an RFC 3339 time, not {op!r}")


def _intersect(a: TimeRange, b: TimeRange) -> TimeRange:
    lo = b.lo if a.lo is None else a.lo if b.lo is None else max(a.lo, b.lo)
    hi = b.hi if a.hi is None else a.hi if b.hi is None else min(a.hi, b.hi)
    return TimeRange(a.field, lo, hi)


def parse_filter(text: str) -> Filter:
    if len(text) > MAX_FILTER_CHARS:
        raise InvalidArgument.for_field("filter", f"{len(text)} characters; at most {MAX_FILTER_CHARS}")
    if "\x00" in text:  # (no stored value holds one; PostgreSQL's text cannot even take it)
        raise InvalidArgument.for_field("filter", "must not contain NUL")
    text = text.strip()
    if not text:
        return Filter()
    terms = []
    times: dict[str, TimeRange] = {}
    for part in _AND_RE.split(text):
        m = _TERM_RE.match(part)
        if not m:
            raise InvalidArgument.for_field(
                "filter", f"bad term {part[:80]!r}; want field=value, field!=value or "
                "create_time or end_time <, <=, >, >= \"RFC 3339\", joined by AND")
        field, op, raw = m.group(1), m.group(2), m.group(3)
        if raw[:1] in ('"', "'"):  # either quote, as ListClusters' filter takes
            raw = raw[1:-1]
        if field in TIME_FIELDS:
            r = _time_range(field, op, raw)
            times[field] = _intersect(times[field], r) if field in times else r
            continue
        if op not in ("=", "!="):
            raise InvalidArgument.for_field(
                "filter", f"{field} takes = or !=; <, <=, >, >= are for {', '.join(TIME_FIELDS)}")
        value: str | int
        if field == "state":
            value = _enum_value(JobState, "JOB_STATE_", raw)
        elif field == "run_mode":
            value = _enum_value(RunMode, "RUN_MODE_", raw)
        elif field == "cluster":
            if spec_rules.check_selected_cluster(raw, "filter") or not raw:
                raise InvalidArgument.for_field("filter", f"cluster: {raw[:80]!r} is not a cluster's name or id")
            value = raw if raw.startswith("clusters/") else f"clusters/{raw}"
        elif field == "project":
            if not PROJECT_RE.fullmatch(raw):
                raise InvalidArgument.for_field("filter", f"project: {raw[:80]!r} is not a project name")
            value = raw
        elif field.startswith("labels.") and len(field) > len("labels."):
            if spec_rules.check_labels({field[len("labels."):]: raw}, "filter"):
                raise InvalidArgument.for_field(
                    "filter", f"{field[:80]}: not a label key and value (keys and values as in job labels)")
            value = raw
        elif field == "owner":
            value = raw
        else:
            raise InvalidArgument.for_field(
                "filter", f"unknown field {field!r}; one of state, cluster, run_mode, project, "
                "owner, labels.KEY, create_time, end_time")
        terms.append(Term(field, op == "!=", value))
    return Filter(tuple(terms), tuple(times.values()))
