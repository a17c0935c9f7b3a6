"""JobManager's own errors, with their reasons."""

from __future__ import annotations

from dlsched.errors import AlreadyExists, FailedPrecondition, NotFound


class JobNotFound(NotFound):
    reason = "JOB_NOT_FOUND"


class JobAlreadyExists(AlreadyExists):
    reason = "JOB_ALREADY_EXISTS"


class NoMatchingCluster(FailedPrecondition):
    reason = "NO_MATCHING_CLUSTER"


class JobNotLaunched(FailedPrecondition):
    reason = "JOB_NOT_LAUNCHED"
