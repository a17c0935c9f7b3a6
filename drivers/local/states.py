"""How process outcomes map to dlsched states, in one total table.

A process's exit status becomes an exit code (signal N -> 128+N) and a
``ReplicaState``: 0 is SUCCEEDED; anything else is STOPPED when dlsched had
already asked the job to stop (a TerminateJob, the time limit, or the
success rule stopping the rest after a failure), else FAILED. Anything not
covered (a status we cannot read) maps to FAILED with reason ``Unknown``,
the UNKNOWN fallback.

The job's state follows the run mode's success rule (the plan's
``SuccessRule``; the driver stops the non-deciding roles once the deciding
ones succeeded, and those stops are not failures): see ``job_outcome``.
"""

from __future__ import annotations

from dataclasses import dataclass

from drivers.common.base import JobState, ReplicaState

REASON_STARTED = "Started"
REASON_COMPLETED = "Completed"
REASON_NON_ZERO_EXIT = "NonZeroExit"
REASON_STOPPING = "StopRequested"
REASON_STOPPED = "Stopped"
REASON_REPLICA_FAILED = "ReplicaFailed"
REASON_TIME_LIMIT = "TimeLimitExceeded"
#: the job's supervisor died before the job ended (killed, the host rebooted): its processes are stopped
REASON_SUPERVISOR_LOST = "SupervisorLost"
#: the attempt's directory was removed under a running job: its supervisor stopped it
REASON_FILES_REMOVED = "FilesRemoved"
#: a record written before jobs had supervisors, found running after a restart
REASON_DRIVER_RESTARTED = "DriverRestarted"
REASON_UNKNOWN = "Unknown"


def exit_code_of(returncode: int | None) -> int | None:
    """``Popen.returncode`` -> exit code; killed by signal N -> 128+N."""
    if returncode is None:
        return None
    return returncode if returncode >= 0 else 128 - returncode


def replica_state(exit_code: int | None, *, stop_signalled: bool) -> ReplicaState:
    if exit_code is None:
        return ReplicaState.FAILED  # the UNKNOWN fallback: no status to read
    if stop_signalled:  # stopped (even one that exits 0 on SIGTERM), as on every backend
        return ReplicaState.STOPPED
    return ReplicaState.SUCCEEDED if exit_code == 0 else ReplicaState.FAILED


@dataclass(frozen=True)
class Outcome:
    state: JobState
    reason: str
    message: str
    exit_code: int | None


def job_outcome(*, stop_requested: bool, stop_final: tuple[JobState, str] | None,
                failure: tuple[str, int, int, str] | None,
                success_message: str = "every process exited 0") -> Outcome:
    """The terminal state once every process has ended.

    ``failure`` is the first failing process (role, index, exit code, reason);
    ``stop_final`` the state and reason a stop asked for (STOPPED/Stopped for
    TerminateJob, FAILED/TimeLimitExceeded for the time limit).
    """
    if stop_requested and stop_final is not None:
        state, reason = stop_final
        return Outcome(state, reason, "stopped on request" if state is JobState.STOPPED
                       else "the job ran past its time limit", None)
    if failure is not None:
        role, index, code, reason = failure
        return Outcome(JobState.FAILED, reason, f"{role}-{index} exited with code {code}", code)
    return Outcome(JobState.SUCCEEDED, REASON_COMPLETED, success_message, 0)
