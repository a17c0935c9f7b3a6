"""The ListJobs / WatchJobs filter: ``field=value`` or ``field!=value`` terms joined by AND.

Fields: ``state`` (RUNNING or JOB_STATE_RUNNING), ``run_mode`` (MULTI_PROCESS
or RUN_MODE_MULTI_PROCESS), ``cluster`` (clusters/local or local) and
``labels.KEY``. Values may be double-quoted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dlsched.errors import InvalidArgument
from job_manager.domain.model import Job, JobState, RunMode

_TERM_RE = re.compile(r'^\s*([A-Za-z_][A-Za-z0-9_]*(?:\.[^\s=!]+)?)\s*(!=|=)\s*("[^"]*"|[^\s"]+)\s*\Z')
_AND_RE = re.compile(r"\s+AND\s+")


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
class Filter:
    terms: tuple[Term, ...] = ()

    def matches(self, job: Job) -> bool:
        return all(t.matches(job) for t in self.terms)


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


def parse_filter(text: str) -> Filter:
    text = text.strip()
    if not text:
        return Filter()
    terms = []
    for part in _AND_RE.split(text):
        m = _TERM_RE.match(part)
        if not m:
            raise InvalidArgument.for_field(
                "filter", f"bad term {part[:80]!r}; want field=value or field!=value joined by AND")
        field, op, raw = m.group(1), m.group(2), m.group(3)
        if raw.startswith('"'):
            raw = raw[1:-1]
        value: str | int
        if field == "state":
            value = _enum_value(JobState, "JOB_STATE_", raw)
        elif field == "run_mode":
            value = _enum_value(RunMode, "RUN_MODE_", raw)
        elif field == "cluster":
            value = raw if raw.startswith("clusters/") else f"clusters/{raw}"
        elif field in ("project", "owner") or (
                field.startswith("labels.") and len(field) > len("labels.")):
            value = raw
        else:
            raise InvalidArgument.for_field(
                "filter", f"unknown field {field!r}; one of state, cluster, run_mode, project, "
                "owner, labels.KEY")
        terms.append(Term(field, op == "!=", value))
    return Filter(tuple(terms))
