"""JobManager's own errors, with their reasons."""

from __future__ import annotations

from dlsched.errors import Aborted, AlreadyExists, FailedPrecondition, NotFound


class JobNotFound(NotFound):
    reason = "JOB_NOT_FOUND"


class JobAlreadyExists(AlreadyExists):
    reason = "JOB_ALREADY_EXISTS"


class RequestIdInUse(AlreadyExists):
    """A SubmitJob ``request_id`` whose first job this caller may not have: it made none of
    them, or may no longer read it (the job is not named)."""

    reason = "REQUEST_ID_IN_USE"

    def __init__(self) -> None:
        super().__init__("request_id already used by another caller", metadata={"field": "request_id"})


class EtagMismatch(Aborted):
    """A write's etag (AIP-154) is not the job's: nothing was changed."""

    reason = "ETAG_MISMATCH"

    def __init__(self, job_id: str, etag: str, current: str) -> None:
        super().__init__(f"jobs/{job_id} changed since etag {etag}; re-read and retry",
                         metadata={"name": f"jobs/{job_id}", "etag": current})
        self.given, self.current = etag, current


class NoMatchingCluster(FailedPrecondition):
    reason = "NO_MATCHING_CLUSTER"


class JobNotLaunched(FailedPrecondition):
    reason = "JOB_NOT_LAUNCHED"
