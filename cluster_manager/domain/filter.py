"""The ListClusters / WatchClusters filter and page tokens.

Grammar: terms joined by ``AND`` (any case); each term ``field=value`` or
``field!=value``; field one of ``type``, ``state``, ``labels.KEY``. Enum
values may be short (``SLURM``) or full (``CLUSTER_TYPE_SLURM``), any case;
values may be quoted with ``"`` or ``'``. Problems raise InvalidArgument on
field ``filter``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dlsched.errors import InvalidArgument
from dlsched.kit import tokens

from .models import Cluster, ClusterState, ClusterType
from .validation import CLUSTER_ID_RE

_TERM_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_./-]*)\s*(!=|=)(.*)\Z", re.S)  # the value is stripped after
# Split only at a whitespace run's first character: one scan, however long the runs.
_AND_RE = re.compile(r"(?<!\s)\s+AND\s+", re.I)
#: the longest filter taken (checked before any parsing: a request's work is bounded first)
MAX_FILTER_CHARS = 8192


@dataclass(frozen=True)
class Term:
    field: str  # "type", "state" or "labels.KEY"
    negate: bool
    value: str  # enum member value for type/state

    def matches(self, c: Cluster) -> bool:
        if self.field == "type":
            hit = c.type.value == self.value
        elif self.field == "state":
            hit = c.state.value == self.value
        else:
            hit = c.labels.get(self.field[len("labels."):]) == self.value
        return hit != self.negate


@dataclass(frozen=True)
class ClusterFilter:
    terms: tuple[Term, ...] = ()

    def matches(self, c: Cluster) -> bool:
        return all(t.matches(c) for t in self.terms)


def _bad(desc: str) -> InvalidArgument:
    return InvalidArgument.for_field("filter", desc)


def _enum_value(raw: str, enum_cls: type[ClusterType] | type[ClusterState], prefix: str) -> str:
    v = raw.upper()
    if v.startswith(prefix):
        v = v[len(prefix):]
    names = [m.value for m in enum_cls if m.value != "UNSPECIFIED"]
    if v not in names:
        raise _bad(f"unknown value {raw!r}; want one of {', '.join(names)}")
    return v


def parse_filter(text: str) -> ClusterFilter:
    if len(text) > MAX_FILTER_CHARS:
        raise _bad(f"{len(text)} characters; at most {MAX_FILTER_CHARS}")
    if "\x00" in text:  # (no cluster's value holds one; as ListJobs)
        raise _bad("must not contain NUL")
    text = text.strip()
    if not text:
        return ClusterFilter()
    terms = []
    for part in _AND_RE.split(text):
        m = _TERM_RE.match(part)
        if not m:
            raise _bad(f"cannot parse term {part.strip()!r}; want field=value or field!=value "
                       "joined by AND")
        field, op, value = m.group(1), m.group(2), m.group(3).strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        elif any(ch.isspace() or ch in "\"'=!" for ch in value):
            raise _bad(f"bad value {value!r} in term {part.strip()!r}")
        if field == "type":
            value = _enum_value(value, ClusterType, "CLUSTER_TYPE_")
        elif field == "state":
            value = _enum_value(value, ClusterState, "CLUSTER_STATE_")
        elif field.startswith("labels.") and len(field) > len("labels."):
            pass
        else:
            raise _bad(f"unknown field {field!r}; want type, state or labels.KEY")
        terms.append(Term(field, op == "!=", value))
    return ClusterFilter(tuple(terms))


# --- page tokens ------------------------------------------------------------

_FILTERED_PREFIX = "p2:"  # p2:<hash of the filter>:<last cluster id>


def encode_page_token(last_cluster_id: str, filter_text: str = "") -> str:
    return tokens.encode(f"{_FILTERED_PREFIX}{tokens.filter_hash(filter_text)}:{last_cluster_id}")


def decode_page_token(token: str, filter_text: str = "") -> str:
    """The last cluster id of the previous page; InvalidArgument ``page_token`` if garbage or
    issued for another filter (only ``p2`` tokens, which name their filter: an older server's
    ``p1`` named none, so one made up would page any filter)."""
    raw = tokens.decode(token) or ""
    issued_for, _, last = raw[len(_FILTERED_PREFIX):].partition(":")
    if not raw.startswith(_FILTERED_PREFIX) or not CLUSTER_ID_RE.match(last):
        raise InvalidArgument.for_field("page_token", "not a next_page_token of ListClusters")
    if issued_for != tokens.filter_hash(filter_text):
        raise InvalidArgument.for_field("page_token", "issued for a ListClusters call with another filter")
    return last


DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


def page_size(requested: int) -> int:
    if requested < 0:
        raise InvalidArgument.for_field("page_size", "must not be negative (0 means 100; more than 1000 means 1000)")
    if requested == 0:
        return DEFAULT_PAGE_SIZE
    return min(requested, MAX_PAGE_SIZE)
