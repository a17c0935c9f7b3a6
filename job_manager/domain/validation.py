"""Pure validation of JobManager requests.

Every violation is collected into one ``InvalidArgument`` whose
FieldViolations name the request fields (``spec.replica_groups[0].replicas``).
"""

from __future__ import annotations

from dlsched import spec_rules
from dlsched.errors import FieldViolation, InvalidArgument
from job_manager.domain.model import JobSpec

JOB_ID_RE = spec_rules.ID_RE
MAX_SPEC_BYTES = spec_rules.MAX_SPEC_BYTES
MAX_REQUEST_ID = 128


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


def _selector_bounds(spec: JobSpec) -> list[FieldViolation]:
    labels = spec.cluster_selector.labels
    at = "spec.cluster_selector"
    if len(labels) > spec_rules.MAX_LIST_ENTRIES:
        return [FieldViolation(f"{at}.labels", f"at most {spec_rules.MAX_LIST_ENTRIES} labels")]
    if len(spec.cluster_selector.cluster.encode("utf-8", "surrogatepass")) > spec_rules.MAX_STRING_BYTES:
        return [FieldViolation(f"{at}.cluster", f"at most {spec_rules.MAX_STRING_BYTES} bytes")]
    for s in (*labels.keys(), *labels.values()):
        if len(s.encode("utf-8", "surrogatepass")) > spec_rules.MAX_STRING_BYTES:
            return [FieldViolation(f"{at}.labels", f"at most {spec_rules.MAX_STRING_BYTES} bytes per string")]
    return []


def validate_submit(job_id: str, spec: JobSpec | None, request_id: str,
                    spec_bytes: int) -> None:
    """Validate a SubmitJob request; raises one InvalidArgument with every violation.

    The spec's rules are ``dlsched.spec_rules``, the ones every driver applies
    again: what JobManager accepts, no driver refuses for its shape. What
    bounds the work (sizes, counts) is checked before anything else walks it.
    """
    v = _Violations()
    if job_id and not JOB_ID_RE.match(job_id):
        v.add("job_id", "1 to 63 characters: lower case letters, digits and '-', "
              "starting with a letter")
    validate_request_id(request_id, v)
    if spec is None:
        v.add("spec", "required")
        v.raise_if_any("job")
        return
    bounds = spec_rules.check_bounds(spec, spec_bytes)
    bounds += _selector_bounds(spec)
    if bounds:
        v.items += bounds
        v.raise_if_any("job")  # do not walk a huge spec further
    validate_spec(spec, v)
    v.raise_if_any("job")


def validate_spec(spec: JobSpec, v: _Violations) -> None:
    v.items += spec_rules.check_spec(spec, time_limit_seconds=spec.time_limit, admission=True)
    v.items += spec_rules.check_labels(spec.cluster_selector.labels, "spec.cluster_selector.labels")
    v.items += spec_rules.check_selected_cluster(spec.cluster_selector.cluster, "spec.cluster_selector.cluster")
