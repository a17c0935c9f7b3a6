"""JobManager's own errors, with their reasons."""

from __future__ import annotations

from dlsched.errors import Aborted, AlreadyExists, FailedPrecondition, NotFound


class JobNotFound(NotFound):
    reason = "JOB_NOT_FOUND"


class JobAlreadyExists(AlreadyExists):
    reason = "JOB_ALREADY_EXISTS"


class EtagMismatch(Aborted):
    """A write's etag (AIP-154) is not the job's: nothing was changed."""

    def __init__(self, job_id: str, etag: str, current: str) -> None:
        super().__init__(f"jobs/{job_id} changed since etag {etag}; re-read and retry",
                         metadata={"name": f"jobs/{job_id}", "etag": current})


class NoMatchingCluster(FailedPrecondition):
    reason = "NO_MATCHING_CLUSTER"


class JobNotLaunched(FailedPrecondition):
    reason = "JOB_NOT_LAUNCHED"
