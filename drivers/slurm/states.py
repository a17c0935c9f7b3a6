"""Slurm job states -> dlsched states, in one total table.

``job_state(slurm_state, reason)`` maps every state Slurm reports (squeue
``%T`` / scontrol ``JobState``, long or short form, with flags such as
``CANCELLED by 0`` or ``+`` suffixes tolerated) to a ``JobState`` and an
UpperCamelCase reason; the ``reason`` column (``Resources``, ``Priority``,
``PartitionDown`` ...) is kept in the message so a pending job says why.
A state not in the table maps to PENDING with reason ``UnknownSlurmState``:
non-terminal, so dlsched keeps observing it and never fails a job on a
state it does not know.

Terminal: COMPLETED -> SUCCEEDED; CANCELLED -> STOPPED; FAILED, TIMEOUT,
OUT_OF_MEMORY, NODE_FAIL, BOOT_FAIL, DEADLINE, PREEMPTED (when not requeued),
SPECIAL_EXIT, REVOKED -> FAILED (NODE_FAIL of a job whose exits file shows
every process ended and none failed is SUCCEEDED: ``jobs.TrackedJob.apply``,
``LOST_END_STATES``). Non-terminal: PENDING / REQUEUED /
REQUEUE_HOLD / REQUEUE_FED / RESV_DEL_HOLD -> QUEUED (waiting in Slurm's
queue), CONFIGURING / RUNNING / COMPLETING / SUSPENDED / STOPPED / SIGNALING
/ STAGE_OUT / RESIZING / UPDATE_DB / POWER_UP_NODE -> RUNNING (with the
Slurm state as reason where it is not plain RUNNING).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dlsched.kit.parse import decimal
from drivers.common.base import JobSpec, JobState, ReplicaGroup, ReplicaState, RunMode
from drivers.common.planner import success_rule

REASON_STALE = "BackendStale"
REASON_UNKNOWN = "UnknownSlurmState"
REASON_LOST = "LeftSlurm"
REASON_SUBMITTED = "Submitted"
#: a job that ended after a stop reached it (every backend's word; a scancel of someone else's
#: is CANCELLED's "Cancelled")
REASON_STOPPED = "Stopped"


@dataclass(frozen=True)
class Mapped:
    state: JobState
    reason: str
    message: str


#: COMPLETED's word, for a job whose every process decides (``success_message``: what others say)
COMPLETED_MESSAGE = "every process exited 0"

#: Slurm state (long form) -> (unified state, reason, description).
TABLE: dict[str, tuple[JobState, str, str]] = {
    "PENDING": (JobState.QUEUED, "Pending", "waiting in the Slurm queue"),
    "REQUEUED": (JobState.QUEUED, "Requeued", "requeued by Slurm; it will run again"),
    "REQUEUE_HOLD": (JobState.QUEUED, "RequeueHold", "requeued and held"),
    "REQUEUE_FED": (JobState.QUEUED, "RequeueFed", "requeued by the federation"),
    "RESV_DEL_HOLD": (JobState.QUEUED, "ReservationDeletedHold", "held: its reservation was deleted"),
    "CONFIGURING": (JobState.RUNNING, "Configuring", "allocated; nodes are being configured"),
    "POWER_UP_NODE": (JobState.RUNNING, "PowerUpNode", "allocated; nodes are powering up"),
    "RUNNING": (JobState.RUNNING, "Running", "running"),
    "RESIZING": (JobState.RUNNING, "Resizing", "running; the allocation is being resized"),
    "SUSPENDED": (JobState.RUNNING, "Suspended", "suspended by Slurm; it resumes later"),
    "STOPPED": (JobState.RUNNING, "SlurmStopped", "stopped with SIGSTOP; it keeps its allocation"),
    "SIGNALING": (JobState.RUNNING, "Signaling", "being signalled"),
    "COMPLETING": (JobState.RUNNING, "Completing", "ending; processes are being cleaned up"),
    "STAGE_OUT": (JobState.RUNNING, "StageOut", "ending; staging out"),
    "UPDATE_DB": (JobState.RUNNING, "UpdateDb", "updating the accounting database"),
    "COMPLETED": (JobState.SUCCEEDED, "Completed", COMPLETED_MESSAGE),
    "CANCELLED": (JobState.STOPPED, "Cancelled", "cancelled"),
    "FAILED": (JobState.FAILED, "NonZeroExit", "exited with a non-zero code"),
    "TIMEOUT": (JobState.FAILED, "TimeLimitExceeded", "ran past its time limit"),
    "OUT_OF_MEMORY": (JobState.FAILED, "OutOfMemory", "ran out of memory"),
    "NODE_FAIL": (JobState.FAILED, "NodeFail", "a node of the allocation failed"),
    "BOOT_FAIL": (JobState.FAILED, "BootFail", "a node failed to boot"),
    "DEADLINE": (JobState.FAILED, "Deadline", "missed its deadline"),
    "PREEMPTED": (JobState.FAILED, "Preempted", "preempted"),
    "SPECIAL_EXIT": (JobState.FAILED, "SpecialExit", "held after a special exit code"),
    "REVOKED": (JobState.FAILED, "Revoked", "revoked by the federation"),
}

SHORT: dict[str, str] = {
    "PD": "PENDING", "RQ": "REQUEUED", "RH": "REQUEUE_HOLD", "RF": "REQUEUE_FED",
    "RD": "RESV_DEL_HOLD", "CF": "CONFIGURING", "PU": "POWER_UP_NODE", "R": "RUNNING",
    "RS": "RESIZING", "S": "SUSPENDED", "ST": "STOPPED", "SI": "SIGNALING", "CG": "COMPLETING",
    "SO": "STAGE_OUT", "CD": "COMPLETED", "CA": "CANCELLED", "F": "FAILED", "TO": "TIMEOUT",
    "OOM": "OUT_OF_MEMORY", "NF": "NODE_FAIL", "BF": "BOOT_FAIL", "DL": "DEADLINE",
    "PR": "PREEMPTED", "SE": "SPECIAL_EXIT", "RV": "REVOKED",
}

#: Pending reasons that mean the job can never start as asked (the partition's limits or
#: configuration refuse it; nothing but an administrator's change would let it run). A job
#: pending for one is FAILED ``Unschedulable`` and cancelled, not left queued forever.
#: Not here: reasons that pass (Resources, Priority, QOSJobLimit, ReqNodeNotAvail, PartitionDown).
UNSCHEDULABLE_REASONS = frozenset({
    "PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints",
    "InvalidAccount", "InvalidQOS",
})
REASON_UNSCHEDULABLE = "Unschedulable"
#: Slurm states that can end a job whose processes all finished (the node's word of the end
#: lost, e.g. across a controller restart): the exits file decides.
LOST_END_STATES = frozenset({"NODE_FAIL"})


def normalise(slurm_state: str) -> str:
    """``"CANCELLED by 0"`` -> ``"CANCELLED"``; ``"cd"`` -> ``"COMPLETED"``; ``"RUNNING+"`` ok."""
    s = (slurm_state or "").strip().split(" ", 1)[0].split(",", 1)[0].rstrip("+*").upper()
    return SHORT.get(s, s)


def job_state(slurm_state: str, reason: str = "") -> Mapped:
    """The unified state of a Slurm state and its reason column; total."""
    s = normalise(slurm_state)
    entry = TABLE.get(s)
    why = (reason or "").strip()
    if why in ("None", "(null)"):
        why = ""
    if entry is None:
        text = f"Slurm state {slurm_state.strip()!r} is not known to dlsched"
        return Mapped(JobState.PENDING, REASON_UNKNOWN, f"{text} ({why})" if why else text)
    state, r, desc = entry
    if state is JobState.QUEUED and why:
        return Mapped(state, why if why.isidentifier() else r, f"{desc}: {why}")
    if why and state.is_terminal() and state is not JobState.SUCCEEDED:
        return Mapped(state, r, f"{desc} ({why})")
    return Mapped(state, r, desc)


def replica_state(state: JobState) -> ReplicaState:
    """The replicas' state, from the job's: Slurm reports one state per job. Used while the job
    runs, and at its end only when its exits file could not be read (``exits`` has each one's)."""
    return {
        JobState.SUCCEEDED: ReplicaState.SUCCEEDED,
        JobState.FAILED: ReplicaState.FAILED,
        JobState.STOPPED: ReplicaState.STOPPED,
        JobState.RUNNING: ReplicaState.RUNNING,
        JobState.STOPPING: ReplicaState.RUNNING,
    }.get(state, ReplicaState.PENDING)


def exit_code(value: str) -> int | None:
    """scontrol's ``ExitCode=2:0`` / sacct's ``2:0`` -> 2; killed by signal N -> 128+N."""
    code, _, sig = (value or "").partition(":")
    if not decimal(code.strip()):
        return None
    c = int(code)
    if decimal(sig.strip()) and int(sig) and not c:
        return 128 + int(sig)
    return c


def success_message(roles: Iterable[str]) -> str:
    """What a succeeded job's success meant (the planner's words, as every backend says them:
    ``the chief exited 0; the rest (ps, worker) stopped``), from the roles of its replicas: Slurm
    keeps no spec. A ``launcher`` beside a ``worker`` is MPI's, a ``ps`` beside a ``worker``
    PS-Worker's; any other job succeeds when every process exited 0."""
    names = frozenset(roles)
    mode = (RunMode.MPI if {"launcher", "worker"} <= names
            else RunMode.PS_WORKER if {"ps", "worker"} <= names else RunMode.UNSPECIFIED)
    if mode is RunMode.UNSPECIFIED:
        return COMPLETED_MESSAGE
    return success_rule(JobSpec(mode, tuple(ReplicaGroup(role=r, replicas=1, command=("-",))
                                            for r in sorted(names)))).description
