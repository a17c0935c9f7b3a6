"""Pure validation of JobManager requests.

Every violation is collected into one ``InvalidArgument`` whose
FieldViolations name the request fields (``spec.replica_groups[0].replicas``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from dlsched.errors import FieldViolation, InvalidArgument
from job_manager.domain.model import JobSpec, RunMode

JOB_ID_RE = re.compile(r"^[a-z][a-z0-9-]{0,62}\Z")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
ROLE_RE = re.compile(r"^[a-z][a-z0-9-]{0,62}\Z")
# Kubernetes-like label keys: optional DNS prefix "a.b/" then a name.
LABEL_KEY_RE = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?\Z")
LABEL_VALUE_RE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?\Z")

MAX_SPEC_BYTES = 256 * 1024
MAX_LIST_ENTRIES = 1000
MAX_STRING_BYTES = 64 * 1024
MAX_RETRIES = 10
MAX_REQUEST_ID = 128
MAX_LABEL = 63

# role -> (required, max replicas or None) per run mode.
_ROLES: dict[RunMode, dict[str, tuple[bool, int | None]]] = {
    RunMode.MULTI_PROCESS: {"worker": (True, None)},
    RunMode.PS_WORKER: {"ps": (True, None), "worker": (True, None),
                        "chief": (False, 1), "evaluator": (False, None)},
    RunMode.MASTER_WORKER: {"master": (True, 1), "worker": (False, None)},
    RunMode.MPI: {"launcher": (True, 1), "worker": (True, None)},
}


class _Violations:
    def __init__(self) -> None:
        self.items: list[FieldViolation] = []

    def add(self, field: str, description: str) -> None:
        self.items.append(FieldViolation(field, description))

    def raise_if_any(self, what: str) -> None:
        if self.items:
            first = self.items[0]
            more = f" (and {len(self.items) - 1} more)" if len(self.items) > 1 else ""
            raise InvalidArgument(f"invalid {what}: {first.field}: {first.description}{more}",
                                  self.items)


def job_id_from_name(name: str, field: str = "name") -> str:
    """``jobs/{id}`` → id; anything else is INVALID_ARGUMENT on ``field``."""
    prefix, sep, job_id = name.partition("/")
    if prefix != "jobs" or not sep or not JOB_ID_RE.match(job_id):
        raise InvalidArgument.for_field(field, f"want jobs/{{job_id}}, got {name[:80]!r}")
    return job_id


def validate_request_id(request_id: str, v: _Violations | None = None,
                        field: str = "request_id") -> None:
    own = v is None
    vv = v or _Violations()
    if len(request_id) > MAX_REQUEST_ID:
        vv.add(field, f"at most {MAX_REQUEST_ID} characters")
    elif any(not (0x20 < ord(c) < 0x7F) for c in request_id):
        vv.add(field, "printable ASCII only, no spaces")
    if own:
        vv.raise_if_any("request")


def _strings(spec: JobSpec) -> Iterable[str]:
    yield spec.queue
    yield spec.cluster_selector.cluster
    yield from spec.labels.keys()
    yield from spec.labels.values()
    yield from spec.cluster_selector.labels.keys()
    yield from spec.cluster_selector.labels.values()
    for g in spec.replica_groups:
        yield g.role
        yield g.image
        yield g.working_dir
        yield g.resources.gpu_type
        yield from g.command
        yield from g.args
        yield from g.env.keys()
        yield from g.env.values()


def _oversized(spec: JobSpec, spec_bytes: int) -> str | None:
    if spec_bytes > MAX_SPEC_BYTES:
        return f"serialized spec is {spec_bytes} bytes, at most {MAX_SPEC_BYTES}"
    for i, g in enumerate(spec.replica_groups):
        for what, n in (("command", len(g.command)), ("args", len(g.args)), ("env", len(g.env))):
            if n > MAX_LIST_ENTRIES:
                return f"replica_groups[{i}].{what} has {n} entries, at most {MAX_LIST_ENTRIES}"
    if len(spec.replica_groups) > MAX_LIST_ENTRIES:
        return f"{len(spec.replica_groups)} replica groups, at most {MAX_LIST_ENTRIES}"
    for s in _strings(spec):
        if len(s.encode("utf-8", "replace")) > MAX_STRING_BYTES:
            return f"a string of {len(s)} characters; at most {MAX_STRING_BYTES} bytes each"
    return None


def _labels(v: _Violations, field: str, labels: dict[str, str]) -> None:
    for k, val in labels.items():
        if not k or len(k) > MAX_LABEL + 254 or not LABEL_KEY_RE.match(k) or \
                len(k.rpartition("/")[2]) > MAX_LABEL:
            v.add(f"{field}[{k[:40]!r}]", "label keys: up to 63 characters [A-Za-z0-9-_.], "
                  "alphanumeric at both ends, optional DNS prefix")
        if len(val) > MAX_LABEL or not LABEL_VALUE_RE.match(val):
            v.add(f"{field}[{k[:40]!r}]", "label values: up to 63 characters [A-Za-z0-9-_.], "
                  "alphanumeric at both ends")


def validate_submit(job_id: str, spec: JobSpec | None, request_id: str,
                    spec_bytes: int) -> None:
    """Validate a SubmitJob request; raises one InvalidArgument with every violation."""
    v = _Violations()
    if job_id and not JOB_ID_RE.match(job_id):
        v.add("job_id", "1 to 63 characters: lower case letters, digits and '-', "
              "starting with a letter")
    validate_request_id(request_id, v)
    if spec is None:
        v.add("spec", "required")
        v.raise_if_any("job")
        return
    too_big = _oversized(spec, spec_bytes)
    if too_big:
        v.add("spec", too_big)
        v.raise_if_any("job")  # do not walk a huge spec further
    validate_spec(spec, v)
    v.raise_if_any("job")


def validate_spec(spec: JobSpec, v: _Violations) -> None:
    try:
        mode: RunMode | None = RunMode(spec.run_mode)
    except ValueError:
        mode = None
    if mode is None or mode == RunMode.UNSPECIFIED:
        v.add("spec.run_mode", "required: one of " + ", ".join(
            f"RUN_MODE_{m.name}" for m in RunMode if m != RunMode.UNSPECIFIED))
        mode = None
    groups = spec.replica_groups
    if not groups:
        v.add("spec.replica_groups", "at least one replica group")
    seen: set[str] = set()
    for i, g in enumerate(groups):
        f = f"spec.replica_groups[{i}]"
        if g.replicas < 1:
            v.add(f"{f}.replicas", f"at least 1, got {g.replicas}")
        if g.processes_per_replica < 0:
            v.add(f"{f}.processes_per_replica", f"0 or more, got {g.processes_per_replica}")
        if not g.command:
            v.add(f"{f}.command", "must not be empty")
        elif not g.command[0]:
            v.add(f"{f}.command[0]", "the program must not be empty")
        for name in g.env:
            if not ENV_NAME_RE.match(name):
                v.add(f"{f}.env[{name[:40]!r}]", "names match [A-Za-z_][A-Za-z0-9_]*")
            elif name.startswith("DLSCHED_"):
                v.add(f"{f}.env[{name[:40]!r}]", "names starting with DLSCHED_ are reserved")
        r = g.resources
        if not math.isfinite(r.cpu) or r.cpu < 0:
            v.add(f"{f}.resources.cpu", "a finite number, 0 or more")
        if r.memory_bytes < 0:
            v.add(f"{f}.resources.memory_bytes", "0 or more")
        if r.gpus < 0:
            v.add(f"{f}.resources.gpus", "0 or more")
        if g.role in seen:
            v.add(f"{f}.role", f"duplicate role {g.role!r}")
        seen.add(g.role)
        if mode is not None:
            _check_role(v, mode, i, g.role, g.replicas, g.processes_per_replica, len(groups))
    if mode is not None and mode in _ROLES:
        roles = {g.role for g in groups}
        for role, (required, _) in _ROLES[mode].items():
            if required and role not in roles and groups:
                v.add("spec.replica_groups", f"RUN_MODE_{mode.name} needs a {role!r} group")
    if spec.max_retries < 0 or spec.max_retries > MAX_RETRIES:
        v.add("spec.max_retries", f"0 to {MAX_RETRIES}, got {spec.max_retries}")
    if spec.time_limit is not None and (not math.isfinite(spec.time_limit) or spec.time_limit < 0):
        v.add("spec.time_limit", "0 or more")
    _labels(v, "spec.labels", spec.labels)
    _labels(v, "spec.cluster_selector.labels", spec.cluster_selector.labels)


def _check_role(v: _Violations, mode: RunMode, i: int, role: str, replicas: int,
                processes: int, ngroups: int) -> None:
    f = f"spec.replica_groups[{i}]"
    if mode == RunMode.SINGLE_PROCESS:
        if ngroups != 1 and i == 1:
            v.add("spec.replica_groups", "RUN_MODE_SINGLE_PROCESS takes exactly one group")
        if role and not ROLE_RE.match(role):
            v.add(f"{f}.role", "lower case letters, digits and '-', starting with a letter")
        if replicas > 1:
            v.add(f"{f}.replicas", "RUN_MODE_SINGLE_PROCESS takes one replica")
        if processes > 1:
            v.add(f"{f}.processes_per_replica", "RUN_MODE_SINGLE_PROCESS takes one process")
        return
    known = _ROLES[mode]
    if role not in known:
        v.add(f"{f}.role", f"RUN_MODE_{mode.name} knows roles " + ", ".join(map(repr, known)))
        return
    _, max_replicas = known[role]
    if max_replicas is not None and replicas > max_replicas:
        v.add(f"{f}.replicas", f"role {role!r} takes at most {max_replicas} replica")
