"""ClusterManager's own errors, each with its gRPC code and ErrorInfo reason."""

from __future__ import annotations

from collections.abc import Sequence

from dlsched.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    NotFound,
)


class ClusterNotFound(NotFound):
    reason = "CLUSTER_NOT_FOUND"

    def __init__(self, name: str, message: str | None = None) -> None:
        super().__init__(message or f"{name} not found", metadata={"name": name, "cluster": name})


class ClusterAlreadyExists(AlreadyExists):
    reason = "CLUSTER_ALREADY_EXISTS"

    def __init__(self, name: str) -> None:
        super().__init__(f"{name} already exists", metadata={"name": name, "cluster": name})


class ClusterEtagMismatch(Aborted):
    """A write's etag (AIP-154) is not the cluster's: nothing was changed."""

    reason = "ETAG_MISMATCH"

    def __init__(self, name: str, etag: str, current: str) -> None:
        super().__init__(f"{name} changed since etag {etag}; re-read and retry",
                         metadata={"name": name, "etag": current})
        self.given, self.current = etag, current

    def as_never_issued(self, field: str) -> InvalidArgument | None:
        """An etag past the cluster's current one (as etcd has it) was never returned for it:
        INVALID_ARGUMENT naming ``field``, not a retry that cannot succeed."""
        if int(self.given) > int(self.current):
            return InvalidArgument.for_field(field, "newer than the cluster's every write: not an etag this "
                                                    "service returned")
        return None


class NoMatchingCluster(FailedPrecondition):
    """No registered cluster can take the job; ``violations`` are (cluster, reasons)."""

    reason = "NO_MATCHING_CLUSTER"

    def __init__(self, message: str, violations: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__(message, violations)


class UnknownCluster(InvalidArgument):
    """The job's selector names a cluster that is not registered."""

    reason = "UNKNOWN_CLUSTER"
    FIELD = "spec.cluster_selector.cluster"

    def __init__(self, name: str) -> None:
        super().__init__(
            f"{self.FIELD}: {name} is not a registered cluster",
            [FieldViolation(self.FIELD, f"{name} is not a registered cluster")],
            metadata={"cluster": name},
        )
