"""The Slurm state map is total: every state maps, unknown ones never crash or end a job."""

from __future__ import annotations

import pytest

from drivers.common.base import JobState, ReplicaState
from drivers.slurm import states

CASES = [
    ("PENDING", "Resources", JobState.QUEUED, "Resources"),
    ("PENDING", "Priority", JobState.QUEUED, "Priority"),
    ("PENDING", "None", JobState.QUEUED, "Pending"),
    ("PD", "", JobState.QUEUED, "Pending"),
    ("REQUEUED", "", JobState.QUEUED, "Requeued"),
    ("REQUEUE_HOLD", "", JobState.QUEUED, "RequeueHold"),
    ("CONFIGURING", "", JobState.RUNNING, "Configuring"),
    ("RUNNING", "None", JobState.RUNNING, "Running"),
    ("R", "", JobState.RUNNING, "Running"),
    ("COMPLETING", "", JobState.RUNNING, "Completing"),
    ("SUSPENDED", "", JobState.RUNNING, "Suspended"),
    ("STOPPED", "", JobState.RUNNING, "SlurmStopped"),
    ("COMPLETED", "None", JobState.SUCCEEDED, "Completed"),
    ("CD", "", JobState.SUCCEEDED, "Completed"),
    ("FAILED", "NonZeroExitCode", JobState.FAILED, "NonZeroExit"),
    ("CANCELLED", "", JobState.STOPPED, "Cancelled"),
    ("CANCELLED by 0", "", JobState.STOPPED, "Cancelled"),
    ("TIMEOUT", "TimeLimit", JobState.FAILED, "TimeLimitExceeded"),
    ("OUT_OF_MEMORY", "", JobState.FAILED, "OutOfMemory"),
    ("NODE_FAIL", "", JobState.FAILED, "NodeFail"),
    ("BOOT_FAIL", "", JobState.FAILED, "BootFail"),
    ("DEADLINE", "", JobState.FAILED, "Deadline"),
    ("PREEMPTED", "", JobState.FAILED, "Preempted"),
    ("SPECIAL_EXIT", "", JobState.FAILED, "SpecialExit"),
    ("RUNNING+", "", JobState.RUNNING, "Running"),
]


@pytest.mark.parametrize(("slurm", "why", "state", "reason"), CASES)
def test_each_slurm_state_maps(slurm, why, state, reason):
    m = states.job_state(slurm, why)
    assert (m.state, m.reason) == (state, reason)
    assert m.message


def test_pending_keeps_slurms_reason_in_the_message():
    m = states.job_state("PENDING", "PartitionDown")
    assert m.state is JobState.QUEUED and "PartitionDown" in m.message


def test_every_table_and_short_state_maps_to_a_real_state():
    for name in [*states.TABLE, *states.SHORT]:
        m = states.job_state(name)
        assert m.state is not JobState.UNSPECIFIED and m.reason != states.REASON_UNKNOWN


@pytest.mark.parametrize("weird", ["", "BRAND_NEW_STATE", "???", "  ", "PENDING_SOMETHING", "\x00"])
def test_unknown_states_stay_non_terminal_with_a_reason(weird):
    m = states.job_state(weird, "Whatever")
    assert not m.state.is_terminal()
    assert m.reason == states.REASON_UNKNOWN


def test_exit_codes():
    assert states.exit_code("0:0") == 0
    assert states.exit_code("3:0") == 3
    assert states.exit_code("0:9") == 137
    assert states.exit_code("") is None
    assert states.exit_code("x") is None


def test_replica_state_follows_the_job():
    assert states.replica_state(JobState.SUCCEEDED) is ReplicaState.SUCCEEDED
    assert states.replica_state(JobState.QUEUED) is ReplicaState.PENDING
    assert states.replica_state(JobState.RUNNING) is ReplicaState.RUNNING
    assert states.replica_state(JobState.STOPPED) is ReplicaState.STOPPED
