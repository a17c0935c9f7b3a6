"""Ray job statuses -> unified states, in one total table.

Ray's ``JobStatus`` (``PENDING``, ``RUNNING``, ``STOPPED``, ``SUCCEEDED``,
``FAILED``) maps one to one; Ray's ``message`` becomes the observation's
message and its ``error_type`` (``JOB_ENTRYPOINT_COMMAND_ERROR``,
``JOB_SUPERVISOR_ACTOR_START_FAILURE``, ...) the reason, in UpperCamelCase.
A status this table does not know (a newer Ray) maps to PENDING with reason
``Unknown``: never a terminal state we cannot take back.
"""

from __future__ import annotations

from collections.abc import Mapping

from drivers.common.base import JobState

REASON_UNKNOWN = "Unknown"
REASON_STALE = "BackendStale"

STATES: Mapping[str, tuple[JobState, str]] = {
    "PENDING": (JobState.PENDING, "Pending"),
    "RUNNING": (JobState.RUNNING, "Running"),
    "STOPPED": (JobState.STOPPED, "Stopped"),
    "SUCCEEDED": (JobState.SUCCEEDED, "Completed"),
    "FAILED": (JobState.FAILED, "Failed"),
}


def camel(value: str) -> str:
    """``JOB_ENTRYPOINT_COMMAND_ERROR`` -> ``JobEntrypointCommandError``."""
    return "".join(w.capitalize() for w in value.replace("-", "_").split("_") if w)


def map_status(status: str | None, error_type: str | None = None) -> tuple[JobState, str]:
    """(unified state, reason) of a Ray status."""
    state, reason = STATES.get(status or "", (JobState.PENDING, REASON_UNKNOWN))
    if state is JobState.FAILED and error_type:
        reason = camel(error_type)
    return state, reason
