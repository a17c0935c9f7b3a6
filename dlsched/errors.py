"""Errors every dlsched layer raises, free of grpc.

Each class carries the gRPC status code *name* and a stable ``reason`` (the
``google.rpc.ErrorInfo.reason`` clients branch on). Services subclass these
with their own reasons (``class JobNotFound(NotFound): reason = "JOB_NOT_FOUND"``);
``dlsched.kit.rpc_errors`` turns them into ``google.rpc.Status`` at the edge.
Domains raise these; they never import grpc.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DOMAIN = "dlsched.io"


@dataclass(frozen=True)
class FieldViolation:
    """One invalid field: its path (``spec.replica_groups[0].replicas``) and why."""

    field: str
    description: str


class DlschedError(Exception):
    """Base of every error that may reach a client."""

    code: str = "INTERNAL"
    reason: str = "INTERNAL"

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if reason is not None:
            self.reason = reason
        self.metadata: dict[str, str] = dict(metadata or {})


class InvalidArgument(DlschedError):
    """The request is malformed; ``violations`` name the fields."""

    code = "INVALID_ARGUMENT"
    reason = "INVALID_ARGUMENT"

    def __init__(
        self,
        message: str,
        violations: Sequence[FieldViolation] = (),
        *,
        reason: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self.violations = list(violations)
        md = dict(metadata or {})
        if self.violations and "field" not in md:
            md["field"] = self.violations[0].field
        super().__init__(message, reason=reason, metadata=md)

    @classmethod
    def for_field(cls, field: str, description: str, **kw: object) -> InvalidArgument:
        return cls(f"{field}: {description}", [FieldViolation(field, description)], **kw)  # type: ignore[arg-type]


class NotFound(DlschedError):
    code = "NOT_FOUND"
    reason = "NOT_FOUND"


class AlreadyExists(DlschedError):
    code = "ALREADY_EXISTS"
    reason = "ALREADY_EXISTS"


class FailedPrecondition(DlschedError):
    """The system is not in a state that allows the request.

    ``violations`` lists (subject, description) pairs for a PreconditionFailure.
    """

    code = "FAILED_PRECONDITION"
    reason = "FAILED_PRECONDITION"

    def __init__(
        self,
        message: str,
        violations: Sequence[tuple[str, str]] = (),
        *,
        reason: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self.violations = list(violations)
        super().__init__(message, reason=reason, metadata=metadata)


class Aborted(DlschedError):
    """A concurrency conflict (etag mismatch); the client may retry."""

    code = "ABORTED"
    reason = "ABORTED"


class OutOfRange(DlschedError):
    code = "OUT_OF_RANGE"
    reason = "OUT_OF_RANGE"


class WatchTokenExpired(OutOfRange):
    """A watch resume token can no longer be honoured; the client re-lists."""

    reason = "WATCH_TOKEN_EXPIRED"


class Unavailable(DlschedError):
    """A dependency (etcd, a driver, a backend) cannot be reached; retry later."""

    code = "UNAVAILABLE"
    reason = "UNAVAILABLE"


class StoreUnavailable(Unavailable):
    reason = "STORE_UNAVAILABLE"


class Unimplemented(DlschedError):
    """An optional capability the backend does not offer."""

    code = "UNIMPLEMENTED"
    reason = "UNSUPPORTED"


class DeadlineExceeded(DlschedError):
    code = "DEADLINE_EXCEEDED"
    reason = "DEADLINE_EXCEEDED"


class ResourceExhausted(DlschedError):
    code = "RESOURCE_EXHAUSTED"
    reason = "RESOURCE_EXHAUSTED"


class Unauthenticated(DlschedError):
    """The call carries no valid credential. Says nothing more about why a token
    failed than its reason (``UNAUTHENTICATED``, ``TOKEN_EXPIRED``): a revoked or
    unknown token is plain ``UNAUTHENTICATED``."""

    code = "UNAUTHENTICATED"
    reason = "UNAUTHENTICATED"


class PermissionDenied(DlschedError):
    """The caller is known but its role does not allow the call."""

    code = "PERMISSION_DENIED"
    reason = "PERMISSION_DENIED"


class Internal(DlschedError):
    code = "INTERNAL"
    reason = "INTERNAL"
