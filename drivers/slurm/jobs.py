"""A tracked Slurm job: what the poller's answers make of it, and what the driver reports.

``TrackedJob`` is one dlsched attempt the driver knows (launched, or adopted
after a restart). ``apply`` takes one poll answer for it (``poller.SlurmJob``,
mapped by ``states.job_state``); ``lost`` ends it when Slurm no longer knows
it; ``stop_sent`` marks a ``scancel``; ``observation`` is what every RPC and
the watch report, with the last round's error when the job is stale.

Requeues: Slurm's ``RestartCnt`` growing is a new run of the same dlsched
attempt (a node failure, ``scontrol requeue``): the old run's start, end, exit
code and usage are forgotten, ``backend_restarts`` carries the count and every
message says ``(Slurm restart N)``. ``JobObservation.attempt`` stays the
dlsched attempt on purpose: JobManager drops observations of any other
attempt, and a requeue is not a dlsched retry.

Per-replica truth: Slurm reports one state for the job, so when it reports
the end the job holds it (``held``, still reporting what it reported before)
until the driver has read the attempt's exits file (``needs_exits``,
``exits_read``; ``exits``): then the end is reported once, with each
replica's own state and exit code and the failure that decided the job named
in the message. JobManager keeps the first terminal report it gets, so the
replicas must be right in that one. A file that cannot be read
(``exits.MAX_READS`` tries, one per round) leaves each replica with the
job's state.

Forgotten jobs (``ForgetJobs``: JobManager recorded the end): ``record`` is
what the driver writes to the attempt's ``recorded.json`` on the login node
before it lets go of the job, and ``from_record`` rebuilds the ended job
from it when asked (observations, logs, usage, cleanup), without keeping it.
Kept compact (slots; no native spec: the launch that needs it renders it):
issue 18 bounds a tracked job at 2 KiB.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from dlsched.spec_rules import same_job
from drivers.common.base import (
    JobObservation,
    JobState,
    NativeSpec,
    ReplicaState,
    ReplicaStatus,
    ReplicaUsage,
)
from drivers.common.registry import LOST_BEFORE_START, STOP_REQUESTED
from drivers.slurm import exits, render, states
from drivers.slurm.poller import SlurmJob

#: the file in the attempt directory that marks a forgotten job and holds its end
RECORDED = "recorded.json"
RECORD_VERSION = 1


#: The pseudo Slurm state of a job no round lists any more (``TrackedJob.vanished``).
VANISHED = "DLSCHED_VANISHED"
#: A job no complete round ever listed is gone once this many complete rounds over this many
#: seconds have missed it (slurmctld killed before it saved the job).
UNSEEN_ROUNDS = 3
UNSEEN_SECONDS = 30.0


class TrackedJob:
    """One attempt of a dlsched job on one Slurm cluster."""

    __slots__ = ("cluster", "job_id", "attempt", "backend_job_id", "dir", "native", "state", "reason",
                 "message", "exit_code", "start_time", "end_time", "nodes", "stale", "stop_requested", "seen",
                 "restarts", "roles", "usage", "accounted", "unschedulable", "held", "exits", "exit_reads",
                 "release_error", "uid", "hosts", "kill_at", "killed", "unseen", "released", "id_lost")

    def __init__(self, cluster: str, job_id: str, attempt: int, backend_job_id: str, adir: str,
                 native: NativeSpec | None, roles: tuple[tuple[str, int], ...] = (), uid: str = "",
                 hosts: tuple[tuple[str, int], ...] = ()) -> None:
        self.cluster = cluster
        self.hosts = hosts  # (role, index) of the replicas whose state is the job's (MPI's workers)
        self.uid = uid  # the job's uid as its comment carries it ("" for none)
        self.job_id = job_id
        self.attempt = attempt
        self.backend_job_id = backend_job_id
        self.dir = adir
        self.native = native  # None for a job adopted after a restart (or launched: the launch renders it)
        self.state = JobState.QUEUED
        self.reason = states.REASON_SUBMITTED
        self.message = "submitted to Slurm"
        self.exit_code: int | None = None
        self.start_time: float | None = None
        self.end_time: float | None = None
        self.nodes = ""
        self.stale = False
        self.stop_requested = False
        self.kill_at: float | None = None  # (monotonic) a stop's grace ends: scancel then
        self.killed = False  # that scancel was sent
        self.seen = False  # Slurm has answered about it at least once
        self.unseen: tuple[int, float] | None = None  # complete rounds missing it, never seen: (how many, since)
        self.released = False  # this driver's scontrol release of it worked
        self.id_lost = False  # slurmctld lost it and handed its Slurm id out again: no command names the id
        self.restarts = 0  # Slurm requeues seen (RestartCnt)
        self.roles = roles  # (role, index) of every replica the script runs a step for
        self.usage: dict[tuple[str, int], ReplicaUsage] = {}  # last sample per replica
        self.accounted = False  # usage holds sacct's final figures
        self.unschedulable = False  # Slurm can never start it (or lost its run): FAILED here, to be cancelled there
        self.held: SlurmJob | None = None  # Slurm's word that it ended, held until the exits file is read
        # why the last ``scontrol release`` of the job (submitted held) failed; None once one worked
        self.release_error: str | None = None
        self.exits: exits.Exits | None = None  # each process's end, read once the job ended
        self.exit_reads = 0  # failed reads of the exits file

    def note_release(self, error: str | None, released: bool = False) -> bool:
        """Why the last ``scontrol release`` failed (its first line), None once released
        or held no more (``released``: by this driver); whether that changed."""
        self.released = self.released or released
        error = error.strip().split("\n", 1)[0][:200] if error is not None else None
        changed, self.release_error = error != self.release_error, error
        return changed

    def _reported(self) -> tuple[object, ...]:
        return (self.state, self.reason, self.message, self.exit_code, self.stale, self.start_time,
                self.end_time, self.nodes)

    def round(self, sj: SlurmJob | None, error: str | None, complete: bool) -> bool:
        """One poll round's word on the job (``error``: the round failed; ``complete``:
        a job missing from the answer is known to be gone); True when the report changed."""
        before = self._reported()
        if error is not None:
            self.stale = True
        else:
            self.stale = False
            if sj is not None:
                self.apply(sj)
            elif complete and self.seen:
                self.vanished()
            elif complete and self.backend_job_id:
                # Never listed: slurmctld lost it before any round saw it (killed before it saved
                # the job). A round that began before its sbatch answered misses it once, never
                # UNSEEN_ROUNDS rounds over UNSEEN_SECONDS.
                n, since = self.unseen or (0, time.monotonic())
                self.unseen = (n + 1, since)
                if n + 1 >= UNSEEN_ROUNDS and time.monotonic() - since >= UNSEEN_SECONDS:
                    self.vanished()
        return self._reported() != before

    def listed(self, sj: SlurmJob | None) -> SlurmJob | None:
        """``sj`` if it is this attempt (``listed_as``); else None, and the job is gone: a
        restarted slurmctld lost it and gave its Slurm id to another job, which no stop, kill
        or cleanup of this one may touch."""
        if sj is None or self.listed_as(sj):
            return sj
        self.id_lost = True
        self.vanished()
        return None

    def listed_as(self, sj: SlurmJob) -> bool:
        """Whether Slurm's job ``sj`` (listed under this job's Slurm id) is this attempt: its
        comment names it. A restarted slurmctld that lost the job hands its id out again. (No
        comment at all: sacct's follow-up without AccountingStoreFlags=job_comment cannot tell.)"""
        if not sj.comment:
            return True
        parsed = render.parse_comment(sj.comment)
        return parsed is not None and parsed[:2] == (self.job_id, self.attempt) and same_job(self.uid, parsed[2])

    def apply(self, sj: SlurmJob) -> None:
        """Slurm's current word on the job."""
        if sj.state == VANISHED:  # its exits file is read (or could not be): it decides
            self.held = None
            self._end_from_exits(sj)
            return
        self.seen = True
        if (self.start_time is not None and sj.state.startswith("PENDING") and sj.reason == "JobHeldUser"
                and sj.restarts <= self.restarts and not self.stop_requested):
            # Seen running, now held again: a restarted slurmctld recovered it from a state saved
            # before its release (and killed what ran). Released again it would run a second time;
            # held, it waited for ever: it ends here (a retry is JobManager's, by its policy).
            self.unschedulable = True  # (cancelled there)
            self.state, self.reason = JobState.FAILED, states.REASON_LOST
            self.message = ("slurmctld restarted from a state saved before the job ran: its run was lost "
                            "(Slurm holds it again); cancelled")
            self.end_time = time.time()
            return
        m = states.job_state(sj.state, sj.reason)
        if m.state is JobState.QUEUED and sj.reason in states.UNSCHEDULABLE_REASONS and not self.stop_requested:
            self.unschedulable = True
            self.state, self.reason = JobState.FAILED, states.REASON_UNSCHEDULABLE
            self.message = f"Slurm can never start the job as asked ({sj.reason}); cancelled"
            self.end_time = time.time()
            return
        if m.state.is_terminal() and self.exits is None and self.exit_reads < exits.MAX_READS:
            self.held = sj  # reported once the exits file is read (``exits_read``)
            self.start_time = sj.start_time or self.start_time
            self.nodes = sj.nodes if sj.nodes not in ("", "(null)") else self.nodes
            return
        self.held = None
        if (m.state is JobState.FAILED and states.normalise(sj.state) in states.LOST_END_STATES
                and self.exits is not None and self.exits.succeeded()):
            # Slurm lost the end of a job whose processes all finished (e.g. its completion
            # came while slurmctld was down and the restarted controller failed the node's
            # job): the exits file is the truth.
            m = states.Mapped(JobState.SUCCEEDED, "", f"{self.success_message()} (Slurm reported "
                                                      f"{states.normalise(sj.state)}: its end was lost)")
            sj = dataclasses.replace(sj, exit_status=0)
        self.state, self.reason, self.message = m.state, m.reason, m.message
        if m.state is JobState.SUCCEEDED and m.message == states.COMPLETED_MESSAGE:
            self.message = self.success_message()  # (the PS and MPI rules stop the rest)
        if sj.restarts > self.restarts:  # requeued: a new run of the same attempt; forget the old one's end
            self.restarts = sj.restarts
            self.start_time = self.end_time = self.exit_code = None
            self.usage.clear()
            self.exits, self.exit_reads = None, 0
        if self.restarts:
            self.message = f"{self.message} (Slurm restart {self.restarts})"
        if self.stop_requested and not m.state.is_terminal():
            self.state, self.reason = JobState.STOPPING, STOP_REQUESTED
        elif self.stop_requested and m.state.is_terminal():
            # It ended after a stop reached it: its processes' ends (a SIGTERM's status, or 0
            # from a handler that saved its work) and the batch script's are the stop's.
            self.state, self.reason = JobState.STOPPED, states.REASON_STOPPED
            if m.state is not JobState.STOPPED:
                self.message = f"stopped by dlsched (Slurm reported {states.normalise(sj.state)})"
        if m.state in (JobState.RUNNING, JobState.STOPPING) or m.state.is_terminal():
            self.start_time = sj.start_time or self.start_time
        self.nodes = sj.nodes if sj.nodes not in ("", "(null)") else self.nodes
        if m.state.is_terminal():
            self.exit_code = sj.exit_status
            self.end_time = sj.end_time or time.time()
            if self.state is JobState.FAILED and sj.exit_status:
                self.message = f"{m.message}; exit code {sj.exit_status}"

    @property
    def needs_exits(self) -> bool:
        """Slurm said the job ended; its exits file is to be read before that is reported."""
        return self.held is not None and not self.state.is_terminal()

    def exits_read(self, found: exits.Exits | None, absent: bool = False) -> bool:
        """The exits file (None: it could not be read; ``absent``: the read found none, the
        batch script never wrote it); True when the job's end is now reported."""
        if self.held is None or self.state.is_terminal():
            return False
        if found is None and absent and self.held.state == VANISHED and not self.nodes \
                and self.start_time is None and not self.restarts:
            # Slurm forgot a job it never started (slurmctld died before saving it, and may
            # have given its id to another job since) and the script never ran: it never ran.
            self.held = None
            self.lost(before_start=True)
            return True
        if found is None:
            self.exit_reads += 1 if self.nodes else exits.MAX_READS  # one that never ran has none
            if self.exit_reads < exits.MAX_READS:
                return False
        else:
            self.exits = found
            if not self.roles and not self.hosts:  # adopted without its record: the file names them
                self.hosts = tuple(r for r in map(exits.split_label, found.hosts) if r is not None)
        self.apply(self.held)
        return True

    def vanished(self) -> None:
        """Neither squeue nor the follow-up lists the job any more, and its end was never seen
        (Slurm purges an ended job after MinJobAge, 5 minutes by default: e.g. it ended while
        the login node was out of reach). Its exits file is read first, as for any end: the
        script's record of each process's end decides, not a guess of FAILED."""
        if self.held is None:
            self.held = SlurmJob(self.backend_job_id, VANISHED, nodes=self.nodes)

    def _end_from_exits(self, sj: SlurmJob) -> None:
        ex = self.exits
        failure = ex.first_failure() if ex is not None else None
        if ex is None or not (ex.succeeded() or failure is not None):
            self.lost()  # no file, or processes with no recorded end: nobody knows how it ended
            return
        how = self.success_message() if failure is None else f"{failure.label} exited {failure.status}"
        if self.stop_requested:  # scancel'ed: it ended because it was stopped
            self.apply(dataclasses.replace(sj, state="CANCELLED"))
            return
        self.apply(dataclasses.replace(sj, state="COMPLETED" if failure is None else "FAILED",
                                       exit_status=0 if failure is None else failure.status))
        self.message = f"{how} (its exits file; Slurm no longer lists the job)"

    def success_message(self) -> str:
        """What the job's success meant (``states.success_message``), from its replicas' roles (a
        job adopted without them: its exits file's)."""
        labels = self.exits.labels + self.exits.hosts if self.exits is not None else ()
        named = [r for r, _ in self.roles + self.hosts] or [
            r[0] for r in map(exits.split_label, labels) if r is not None]
        return states.success_message(named)

    def lost(self, before_start: bool = False) -> None:
        """Neither squeue nor the follow-up knows the job any more, and its end was never seen
        (``before_start``: nor its start, and its script never ran: ``LOST_BEFORE_START``)."""
        self.state, self.reason = JobState.FAILED, states.REASON_LOST
        self.message = "Slurm no longer knows the job and its end was never seen"
        if before_start:
            self.reason = LOST_BEFORE_START
            self.message = ("Slurm lost the job before it started (slurmctld restarted without it) "
                            "and its script never ran")
        self.end_time = time.time()

    def stop_sent(self, grace: float | None = None) -> None:
        """A stop reached the job: ``scancel`` (``grace`` None), or SIGTERM to its steps and
        ``scancel`` once ``grace`` seconds have passed (``kill_due``); STOPPING until Slurm
        reports the end."""
        self.stop_requested = True
        self.state, self.reason = JobState.STOPPING, STOP_REQUESTED
        if grace is None:
            self.kill_at, self.killed, self.message = None, True, "scancel sent"
        else:
            self.kill_at = time.monotonic() + grace
            self.message = f"SIGTERM sent; scancel after {grace:g}s"

    def kill_due(self, now: float) -> bool:
        """A stop's grace is over and the job has not ended: ``scancel`` it."""
        return (self.stop_requested and not self.killed and self.kill_at is not None
                and now >= self.kill_at and not self.state.is_terminal() and not self.id_lost)

    def observation(self, last_error: str | None) -> JobObservation:
        """What the driver reports; a stale job keeps its state, the error in the message."""
        reason, message = self.reason, self.message
        if self.stale and not self.state.is_terminal():
            reason, message = states.REASON_STALE, f"last known: {self.reason} ({self.message}); {last_error}"
        elif self.release_error is not None and self.state is JobState.QUEUED:
            message = (f"{message}; dlsched could not release the job Slurm holds for it, "
                       f"retrying each poll round: {self.release_error}")
        exit_code = self.exit_code
        if self.state.is_terminal() and self.exits is not None:
            replicas, failure = exits.replicas(self.exits, self.roles, self.state, self.nodes)
            if failure is not None:  # the process whose exit decided the job: named, its code the job's
                named = f"{failure.label} exited with code {failure.status}"
                message = named if reason == "NonZeroExit" else f"{named}; {message}"
                if self.restarts and reason == "NonZeroExit":
                    message += f" (Slurm restart {self.restarts})"
                exit_code = failure.status
        else:
            rstate = states.replica_state(self.state)
            replicas = tuple(ReplicaStatus(role=r, index=i, state=rstate, host=self.nodes,
                                           exit_code=self.exit_code if self.state.is_terminal() else None)
                             for r, i in self.roles)
        if self.hosts:  # no process of their own: running while the job runs, then done with it
            hstate = states.replica_state(self.state)
            if self.state.is_terminal():
                hstate = ReplicaState.SUCCEEDED if self.state is JobState.SUCCEEDED else ReplicaState.STOPPED
            replicas += tuple(ReplicaStatus(role=r, index=i, state=hstate, host=self.nodes,
                                            message="hosts the launcher's ranks") for r, i in self.hosts)
        return JobObservation(job_id=self.job_id, backend_job_id=self.backend_job_id, found=True,
                              state=self.state, reason=reason, message=message, exit_code=exit_code,
                              replicas=replicas, start_time=self.start_time, end_time=self.end_time,
                              attempt=self.attempt, backend_restarts=self.restarts, uid=self.uid)

    def record(self) -> dict[str, Any]:
        """What ``recorded.json`` keeps of an ended job: its reported end, its replicas'
        ends (the exits file) and its last usage samples."""
        return {"version": RECORD_VERSION, "job_id": self.job_id, "attempt": self.attempt, "uid": self.uid,
                "backend_job_id": self.backend_job_id, "state": self.state.name, "reason": self.reason,
                "message": self.message, "exit_code": self.exit_code, "start_time": self.start_time,
                "end_time": self.end_time, "nodes": self.nodes, "restarts": self.restarts,
                "roles": [list(r) for r in self.roles], "hosts": [list(r) for r in self.hosts],
                "accounted": self.accounted,
                "exits": None if self.exits is None else {
                    "labels": list(self.exits.labels),
                    "ends": [[e.label, e.status, e.stopped] for e in self.exits.ends]},
                "usage": [dataclasses.asdict(u) for u in self.usage.values()]}

    @classmethod
    def from_record(cls, cluster: str, adir: str, doc: dict[str, Any]) -> TrackedJob:
        """The ended job ``record`` wrote (raises KeyError/TypeError/ValueError when malformed)."""
        job = cls(cluster, str(doc["job_id"]), int(doc["attempt"]), str(doc["backend_job_id"]), adir, None,
                  roles=tuple((str(r), int(i)) for r, i in doc.get("roles") or ()), uid=str(doc.get("uid") or ""),
                  hosts=tuple((str(r), int(i)) for r, i in doc.get("hosts") or ()))
        job.state = JobState[doc["state"]]
        if not job.state.is_terminal():
            raise ValueError(f"a recorded job must have ended, not {job.state.name}")
        job.reason, job.message = str(doc["reason"]), str(doc["message"])
        job.exit_code = None if doc.get("exit_code") is None else int(doc["exit_code"])
        job.start_time, job.end_time = doc.get("start_time"), doc.get("end_time")
        job.nodes, job.restarts = str(doc.get("nodes") or ""), int(doc.get("restarts") or 0)
        job.seen, job.accounted = True, bool(doc.get("accounted"))
        if (ex := doc.get("exits")) is not None:
            job.exits = exits.Exits(tuple(ex["labels"]),
                                    tuple(exits.End(str(lb), int(st), bool(sp)) for lb, st, sp in ex["ends"]))
        for u in doc.get("usage") or ():
            ru = ReplicaUsage(**u)
            job.usage[(ru.role, ru.replica_index)] = ru
        return job
