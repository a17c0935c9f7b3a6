"""The Slurm commands of one cluster, on its login node over SSH; one mapping of their exits to errors.

``SlurmClient`` holds one cluster configuration's two SSH connections
(``ssh.SshClient``: the control connection for every command, and a second
one, opened on first use, for log followers' long-lived streams, so that they
never take the channels polls, submits and stops need) and runs the Slurm
commands the driver needs: ``sbatch`` (``submit``), the look-up of an
attempt by name, ``scancel``, the cluster's nodes and accounting type
(``info``) and removing a job's files. Transport failures are mapped once, in
``ssh`` (``BACKEND_UNAVAILABLE``, ``HOST_KEY_MISMATCH``); a command's exit is
mapped once, here, by ``exit_error``:

- 0, or ``scancel`` of a job that has already ended or left Slurm: no error;
- ``sbatch`` refused for the submitted-job limit (``SUBMIT_LIMIT_RE``) is
  RESOURCE_EXHAUSTED ``BACKEND_QUOTA_EXCEEDED`` (JobManager retries);
- ``sbatch`` with a message that says nothing about the controller
  (``TRANSIENT_RE``) is FAILED_PRECONDITION ``SBATCH_REJECTED`` (an unknown
  partition), carrying Slurm's message;
- anything else is UNAVAILABLE ``BACKEND_UNAVAILABLE``: retry later.

Submission (exactly once). The script goes to ``sbatch --parsable --hold``
on stdin (the first launch of a cluster configuration also makes the state
dir: ``mkdir -p <state dir> && sbatch ...``; the script makes its attempt dir
itself, see render): every Slurm job dlsched submits starts held (priority
0), and only the one job the driver adopts for the attempt (comment
``dlsched-<job_id>.<attempt>``) is released (``scontrol release``). So a
submission that lands late (``sbatch`` timed out here, its job appears
afterwards) can never start: it stays held until the driver's next poll
round sees it and cancels it (see the driver). The adopted job is the
oldest Slurm job with the attempt's comment: a late landing always gets a
larger id than one already there. Whether Slurm may already hold the
attempt is known without a call in the common case: the last poll round
listed every job of the user (``--states=all``), so an attempt it did not
list, that this process never sent an unanswered ``sbatch`` for, is
submitted straight away, and one it listed is adopted (and released if it
is still held: its driver died between ``sbatch`` and the release). Only
before this process's first round (a restart: an earlier process may have
submitted it) and after a failed or ambiguous ``sbatch`` (an error exit, a
dead connection, a timeout) is the attempt looked up (``squeue
--states=all --name=dlsched-<job_id>``) and the oldest it finds adopted;
only when Slurm holds no such job is it submitted (again), and then looked
up once more: should an earlier ``sbatch`` have landed meanwhile, the
oldest is kept and the others are cancelled, before anything is released
or reported. A look-up that fails fails the launch (UNAVAILABLE; nothing
was released, so nothing runs) and the retry looks up again. The adopted
job's ``scontrol release`` runs after the launch answered, in the
background (the driver's ``to_release``, asked again each poll round until
Slurm no longer holds it; a driver that dies first releases it when it
adopts the job again). So a launch costs what a bare ``sbatch`` on the open
connection costs: a warm ``mkdir -p <state dir> && exec
sbatch --parsable --hold`` per cluster is started ahead of the launch and
waits for the script on stdin (``_WarmSubmitter``), so the first try costs
writing the script and sbatch's RPC; retries use a fresh command. A
transient refusal is retried, and after the last try is UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shlex
import time
from collections.abc import (
    Awaitable,
    Container,
    Iterable,
    Mapping,
    MutableMapping,
    MutableSet,
)

from dlsched.errors import DlschedError, FailedPrecondition, ResourceExhausted, Unavailable
from dlsched.kit.parse import decimal
from drivers.common.base import NameCollision, SshCredentials
from drivers.common.launches import PreviousAttemptActive, StaleAttempt
from drivers.common.registry import BackendUnavailable
from drivers.slurm import poller as poll
from drivers.slurm import render, states
from drivers.slurm.render import SlurmScript
from drivers.slurm.shell import STOP_MARK
from drivers.slurm.ssh import Congested, SshClient, Started

log = logging.getLogger("dlsched.driver.slurm")
_NONE: Mapping[str, bool] = {}

SUBMIT_TRIES = 3
#: squeue look-ups of one attempt before a launch says UNAVAILABLE.
LOOKUP_TRIES = 3
#: Seconds after an ambiguous sbatch (failed, timed out) during which its job may still land:
#: the driver keeps polling the attempt that long, to cancel a late landing on sight.
LATE_WINDOW = 600.0
#: A warm sbatch older than this is replaced before use (seconds).
WARM_MAX_AGE = 300.0
#: Seconds ``info`` waits for the controller (ClusterManager's default deadline for GetClusterInfo is 5 s).
INFO_TIME_LIMIT = 3.0
#: Each step of ``close`` is bounded: a login node that stops answering must not hold a caller.
CLOSE_STEP_SECONDS = 5.0
ACCOUNTING_MARK = "--- accounting"
#: sbatch errors that say nothing about the job itself: retried (after a look-up), never a refusal.
TRANSIENT_RE = re.compile(r"Socket timed out|Unable to contact slurm controller|temporarily unavailable|"
                          r"Slurm temporarily unable|Connection refused|Zero Bytes were transmitted")
#: Every submission starts held; only the job the driver adopts is released (see the docstring).
SBATCH = "sbatch --parsable --hold"
#: Pending reasons of a job held since its submission (``--hold``; the first is a user's, the
#: second an operator's): an adopted job in one of them is released.
HELD_REASONS = frozenset({"JobHeldUser", "JobHeldAdmin"})
#: scancel / scontrol release of a job that has ended or that Slurm no longer holds: nothing to do.
_GONE_RE = re.compile(r"already|Invalid job id")


class SbatchRejected(FailedPrecondition):
    reason = "SBATCH_REJECTED"


#: sbatch's words when the user's (or account's) submitted-job limit is reached: the job is
#: refused now and would be taken once some end (AssocMaxSubmitJobLimit, AssocGrpSubmitJobsLimit,
#: QOSMaxSubmitJobPerUserLimit, QOSGrpSubmitJobsLimit, ...), like a Kubernetes quota: retried.
SUBMIT_LIMIT_RE = re.compile(r"(?:Max|Grp)SubmitJobs?(?:PerUser|PerAccount)?Limit")


class SubmitLimit(ResourceExhausted):
    """sbatch refused the job for the user's submitted-job limit; nothing was submitted."""

    reason = "BACKEND_QUOTA_EXCEEDED"


def exit_error(call: str, rc: int, err: str, *, job_id: str = "") -> DlschedError | None:
    """The error a Slurm command's exit means (None: none); see the module docstring."""
    text = err.strip()
    if rc == 0 or (call in ("scancel", "scontrol release") and _GONE_RE.search(err)):
        return None
    if call == "sbatch" and rc != 255 and SUBMIT_LIMIT_RE.search(err):
        return SubmitLimit(f"Slurm refused the job for now, the submitted-job limit is reached: {text[:500]}",
                           metadata={"job_id": job_id})
    if call == "sbatch" and rc != 255 and text and not TRANSIENT_RE.search(err):
        return SbatchRejected(f"sbatch refused the job: {text[:500]}", metadata={"job_id": job_id})
    return BackendUnavailable(f"{call} exited {rc}: {text[:300]}")


class _WarmSubmitter:
    """One ``sbatch --parsable --hold`` per cluster started ahead of the next launch, waiting for
    its script on stdin: a launch pays only writing the script and sbatch's own RPC, not
    opening a channel and exec'ing. At most one idle process per cluster; it holds one
    channel of the bound (so it is used only where the bound is at least 3); one that died
    (a lost connection) or is older than ``WARM_MAX_AGE`` is closed and replaced; ``close``
    (RemoveCluster, reconfigure, driver close) gives it up. Given up unused, sbatch reads an
    empty script and submits nothing. The command and environment are the cold path's."""

    def __init__(self, ssh: SshClient, command: str, enabled: bool) -> None:
        self._ssh = ssh
        self._command = command
        self._enabled = enabled
        self._idle: Started | None = None
        self._starting: asyncio.Task[None] | None = None
        self._closed = False

    def take(self) -> Started | None:
        """The idle process if it is usable (then the next one starts in the background)."""
        p, self._idle = self._idle, None
        if p is not None and (not p.alive() or time.monotonic() - p.started > WARM_MAX_AGE):
            p.close()
            p = None
        self.refill()
        return p

    def refill(self) -> None:
        if not self._enabled or self._closed or self._idle is not None:
            return
        if self._starting is not None and not self._starting.done():
            return
        self._starting = asyncio.create_task(self._start(), name="slurm-warm-sbatch")

    async def _start(self) -> None:
        try:
            p = await self._ssh.start(self._command, call="sbatch")
        except DlschedError as e:
            log.debug("no warm sbatch: %s", e.message)
            return
        if self._closed or self._idle is not None:
            p.close()
        else:
            self._idle = p

    async def close(self) -> None:
        self._closed = True
        if self._starting is not None:
            self._starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._starting
        if self._idle is not None:
            self._idle.close()
            self._idle = None


class SlurmClient:
    """The Slurm commands of one cluster configuration (address, credentials, options)."""

    def __init__(self, address: str, creds: SshCredentials, env: Mapping[str, str], options: Mapping[str, str],
                 *, command_timeout: float, max_channels: int, max_log_streams: int) -> None:
        self.ssh = SshClient(address, creds.username, creds.private_key, creds.known_host_keys, env=env,
                             max_channels=max(1, min(9, max_channels)))
        #: log followers' streams: a connection of their own, opened on first use
        self.log_ssh = SshClient(address, creds.username, creds.private_key, creds.known_host_keys, env=env,
                                 max_channels=max(0, min(9, max_log_streams)))
        self.username = creds.username
        self.timeout = command_timeout
        self.state_dir = render.state_dir_of(options)
        self.retired: Container[str] = frozenset()  # ``submit``'s: Slurm ids never to adopt
        self._state_dir_made = False
        self.warm = _WarmSubmitter(self.ssh, f"mkdir -p -- {shlex.quote(self.state_dir)} && exec {SBATCH}",
                                   max_channels >= 3)

    async def run(self, command: str, input: str | None = None) -> tuple[int, str, str]:
        """One command; a non-zero exit is returned, transport failures raise."""
        r = await self.ssh.run(command, input=input, time_limit=self.timeout)
        return r.exit_status, r.stdout, r.stderr

    async def close(self) -> None:
        """Give up the warm sbatch and both connections, each step bounded."""
        for step in (self.warm.close, self.ssh.close, self.log_ssh.close):
            await bounded(step())

    # ------------------------------------------------------------------ commands

    async def info(self, ask_accounting: bool) -> tuple[str, bool | None]:
        """``scontrol show nodes`` (and, when asked, whether the cluster has accounting
        storage: None when the answer did not say), bounded by ``INFO_TIME_LIMIT``."""
        cmd = "scontrol --oneliner show nodes"
        if ask_accounting:
            cmd += f"; echo {ACCOUNTING_MARK}; scontrol show config | grep '^AccountingStorageType'"
        r = await self.ssh.run(cmd, time_limit=INFO_TIME_LIMIT)
        if e := exit_error("scontrol", r.exit_status, r.stderr):
            raise e
        nodes, mark, config = r.stdout.partition(f"{ACCOUNTING_MARK}\n")
        accounting = "accounting_storage/none" not in config if mark and "AccountingStorageType" in config else None
        return nodes, accounting

    async def controller_down(self) -> str:
        """Why slurmctld does not answer at all (``scontrol ping``: one quick RPC, DOWN at once
        when nothing listens, where squeue retries for ~10 s), or "" when it answers or the
        ping itself was too slow to tell; transport failures other than slowness raise."""
        try:
            r = await self.ssh.run("scontrol ping", time_limit=INFO_TIME_LIMIT)
        except Congested:
            return ""
        if r.exit_status != 0 and "DOWN" in r.stdout:
            return " ".join(r.stdout.split("*", 1)[0].split())[:300]
        return ""

    async def cancel(self, backend_job_id: str) -> bool:
        """``scancel`` (Slurm sends SIGTERM, then SIGKILL after KillWait); an ended job is fine
        (False: Slurm said it had ended already)."""
        rc, _, err = await self.run(f"scancel {shlex.quote(backend_job_id)}")
        if e := exit_error("scancel", rc, err):
            raise e
        return rc == 0

    async def kill(self, backend_job_id: str) -> bool:
        """A stop's grace is over: SIGKILL to the processes of each of the job's steps now
        (``scancel --signal=KILL <job>.<step>``; the batch script records their ends and the job
        ends), a plain ``scancel`` when that failed or found no step. A job's SIGKILL, plain or
        through ``--signal``, is a cancel: SIGTERM again, SIGKILL after Slurm's KillWait (30 s by
        default). False as ``cancel``'s."""
        q = shlex.quote(backend_job_id)
        steps = f"squeue -h -s -j {q} -o %i | grep -E {shlex.quote('^' + re.escape(backend_job_id) + '[.][0-9]+$')}"
        rc, _, err = await self.run(f"s=$({steps}); if [ -n \"$s\" ]; then timeout 10 scancel --signal=KILL $s; "
                                    f"else scancel {q}; fi")  # (a step just ended: "already completing")
        if e := exit_error("scancel", rc, err):
            raise e
        return rc == 0

    async def stop(self, backend_job_id: str, mark: str, *, signal: bool, running: bool) -> str | None:
        """dlsched's stop, in one command: the ``stopping`` mark in the attempt directory ``mark``
        first, whatever follows (the script then records every end after it ``halt``, never a
        success, and signals nothing itself), then SIGTERM to the steps of a job the last poll
        round saw RUNNING (``scancel --signal``: the processes; the batch script, which records
        their ends, is left to finish), else a plain ``scancel`` (``scancel --signal`` waits for
        a pending job to start; MPI, no grace). Slurm is not asked first: a poll round's one
        squeue is the driver's only. Returns "signal" or "cancel", what was sent; None: Slurm
        said the job had ended already."""
        q = shlex.quote(backend_job_id)
        cmd = f"touch -- {shlex.quote(mark + '/' + STOP_MARK)} 2>/dev/null; "
        if signal and running:
            cmd += f"scancel --signal=TERM {q} && echo signal"
        else:
            cmd += f"scancel {q} && echo cancel"
        rc, out, err = await self.run(cmd)
        if e := exit_error("scancel", rc, err):
            raise e
        return out.strip() if rc == 0 and out.strip() in ("signal", "cancel") else None

    async def release(self, backend_job_id: str) -> None:
        """``scontrol release``: a held job may start; one not held, running or ended is fine."""
        rc, _, err = await self.run(f"scontrol release {shlex.quote(backend_job_id)}")
        if e := exit_error("scontrol release", rc, err):
            raise e

    async def remove_files(self, job_id: str, job_dir: str) -> None:
        """The job's directory and its batch outputs in the state dir (errors ignored)."""
        batch = shlex.quote(f"{self.state_dir}/{job_id}.")  # ids hold no dot
        await self.run(f"rm -rf -- {shlex.quote(job_dir)} {batch}*.batch.stdout {batch}*.batch.stderr")

    async def lookup(self, script: SlurmScript) -> list[poll.SlurmJob]:
        """Slurm's jobs of this attempt, oldest first; raises when Slurm cannot tell."""
        return [j for j in await self._listed(script) if script.marks(j.comment)]

    async def running(self, job_id: str) -> list[poll.SlurmJob]:
        """Slurm's jobs of this job id (any attempt or uid, retired ones too) that have not
        ended; raises when Slurm cannot tell."""
        return [j for j in await self._named(render.job_name(job_id)) if not ended(j)
                and (parsed := render.parse_comment(j.comment)) is not None and parsed[0] == job_id]

    async def _listed(self, script: SlurmScript) -> list[poll.SlurmJob]:
        """Slurm's jobs with this job's name, oldest first (voided and retired ones left out);
        raises when Slurm cannot tell."""
        return [j for j in await self._named(script.job_name) if not voided(j) and j.job_id not in self.retired]

    async def _named(self, job_name: str) -> list[poll.SlurmJob]:
        """Slurm's jobs named ``job_name``, oldest first. squeue only reads, so a failed look-up
        is tried again (a loaded controller or login node fails one now and then) before the
        caller hears."""
        error: DlschedError | None = None
        for tries in range(LOOKUP_TRIES):
            if tries:
                await asyncio.sleep(0.3 * tries)
            try:
                rc, out, err = await self.run(poll.squeue_command(self.username, job_name))
            except Unavailable:  # transport: a changed host key etc. is not retried
                if tries + 1 == LOOKUP_TRIES:
                    raise
                continue
            error = exit_error("squeue", rc, err)
            if error is None:
                return oldest_first(poll.parse_squeue(out).values())
            log.warning("look-up of %s: %s", job_name, error.message)
        assert error is not None
        raise error

    async def submit(self, script: SlurmScript, listed: Mapping[str, Mapping[str, poll.SlurmJob]] | None,
                     unsure: MutableSet[str], late: MutableMapping[str, float],
                     retired: Container[str] = frozenset(), ending: Mapping[str, bool] = _NONE,
                     attempt_rules: bool = True) -> tuple[str, bool]:
        """Submit the attempt once, held, and adopt one job for it (see the module
        docstring): that job's Slurm id, and whether it is still held. The caller
        releases a held one (``release``), after it tracks the id: the release is
        off the launch's critical path, and a driver that dies first finds the job
        held and releases it when it adopts it again.

        ``listed``: the oldest Slurm job of every dlsched attempt the last good poll round
        listed (``listing``; None before one); ``unsure``: comments of attempts whose sbatch
        may have landed unseen (kept by the caller across reconfigurations). A comment
        leaves ``unsure`` once a job is adopted for it. ``late``: comment -> when
        (monotonic) an sbatch of it last failed or timed out, so that a job may still land.
        ``attempt_rules``: the driver does not track the job (it restarted), so the listing's other
        attempts decide (STALE_ATTEMPT, PREVIOUS_ATTEMPT_ACTIVE); a tracked job's were decided from
        memory (the listing may still show an attempt the driver has ended: an unschedulable one).
        ``retired``: Slurm ids of deleted jobs (``listed`` leaves them out): never adopted,
        their attempt's comment may be a new job's that reuses the id. ``ending``: those of this
        job id, each with whether it was retired lately: while Slurm runs one (a cancelled job
        ends after KillWait) it may still write in the attempt's directory, so the launch is
        UNAVAILABLE (JobManager tries again), and NAME_COLLISION once it is not lately."""
        self.retired = retired
        looked = listed is None or script.comment in unsure
        if looked:
            seen = await self._listed(script)  # Slurm may hold it and no round has said so
            listed = listing({}, seen)
        assert listed is not None
        existing = script.in_listing(listed)  # (a round before a delete may still list it)
        if existing is not None and existing.job_id in retired:
            existing = None
        if existing is None and ending and (still := [j for j in await self.running(script.job_id)
                                                      if j.job_id in ending]):
            if not any(ending[j.job_id] for j in still):
                raise NameCollision(f"Slurm job {still[0].job_id} of an earlier job {script.job_id!r}, deleted, "
                                    "has not ended long after its cancel (a node not responding?); submit this "
                                    "job again once it has", metadata={"slurm_job_id": still[0].job_id})
            for j in still:  # (again: the cleanup's cancel may not have reached a job Slurm still queues)
                with contextlib.suppress(DlschedError):
                    await self.cancel(j.job_id)
            raise BackendUnavailable(f"Slurm job {still[0].job_id} of an earlier job {script.job_id!r}, "
                                     "deleted, is still ending")
        if existing is None and (running := [j for j in script.rivals(listed)
                                             if not ended(j) and j.job_id not in ending]):
            theirs = (render.parse_comment(running[0].comment) or ("", 0, ""))[2]
            raise NameCollision(f"Slurm job {running[0].job_id} of an earlier job {script.job_id!r} (uid "
                                f"{theirs}), deleted without its cleanup, still runs in its directory; "
                                "scancel it, then submit this job again", metadata={"job_uid": theirs})
        if existing is None and attempt_rules:  # from Slurm's word: the driver knows nothing of the job
            others = [(a, j) for a, j in script.other_attempts(listed) if j.job_id not in retired]
            if others and (newest := max(a for a, _ in others)) > script.attempt:
                raise StaleAttempt(script.job_id, newest)
            if active := [a for a, j in others if not ended(j)]:
                raise PreviousAttemptActive(script.job_id, max(active))
        if existing is not None:
            log.info("adopting Slurm job %s for %s", existing.job_id, script.comment)
            unsure.discard(script.comment)
            return existing.job_id, is_held(existing)  # held: submitted by a driver that never released it
        unsure.add(script.comment)  # until a job is adopted (a cancelled launch leaves it here)
        try:
            jid = await self._sbatch(script, looked, late)
        except (SbatchRejected, SubmitLimit):
            unsure.discard(script.comment)  # refused, and the look-up found nothing
            raise
        unsure.discard(script.comment)
        return jid, True

    async def _sbatch(self, script: SlurmScript, looked: bool, late: MutableMapping[str, float]) -> str:
        """sbatch (held) until Slurm holds the attempt: the id of the job to adopt (not yet
        released). ``looked``: the attempt was looked up first (an earlier sbatch may land)."""
        cmd = f"exec {SBATCH}"  # exec: the shell never forks, sbatch replaces it
        if not self._state_dir_made:  # the batch output goes there; it must exist before the job starts
            cmd = f"mkdir -p -- {shlex.quote(self.state_dir)} && {cmd}"
        last = ""
        for attempt in range(SUBMIT_TRIES):
            if attempt:
                await asyncio.sleep(0.5 * attempt)
            rc, out, err, error = 255, "", "", None
            try:
                if attempt:
                    rc, out, err = await self.run(cmd, input=script.script)
                else:  # the warm sbatch, if one is ready: the same command, started earlier
                    rc, out, err = await self._submit_warm(script.script, cmd)
                error = exit_error("sbatch", rc, err, job_id=script.job_id)
            except DlschedError as e:
                error = e
            if error is None and decimal(jid := out.strip().split(";")[0].strip()):
                self._state_dir_made = True
                return jid if not (attempt or looked) else await self._converge(script, jid)
            last = f"{error.reason}: {error.message}" if error is not None else f"sbatch printed {out.strip()[:300]!r}"
            if not isinstance(error, SbatchRejected | SubmitLimit):
                late[script.comment] = time.monotonic()  # its job may land any time from now
            # Failed or ambiguous: Slurm may hold the job anyway. Look before any retry.
            try:
                found = await self.lookup(script)
            except DlschedError as e:
                last = f"{e.reason}: {e.message}"
                continue
            if found:
                log.warning("sbatch for %s reported failure but submitted job %s; adopting it",
                            script.comment, found[0].job_id)
                return await self._converge(script, found[0].job_id, found)
            if isinstance(error, SbatchRejected | SubmitLimit):
                raise error  # refused, and the look-up found nothing
        raise BackendUnavailable(f"could not submit to Slurm: {last}")

    async def _submit_warm(self, script: str, cold: str) -> tuple[int, str, str]:
        """``script`` to the warm sbatch if one is ready, else ``cold`` (a fresh command)."""
        p = self.warm.take()
        if p is None:
            return await self.run(cold, input=script)
        r = await p.finish(script.encode(), self.timeout)
        return r.exit_status, r.stdout.decode("utf-8", "replace"), r.stderr.decode("utf-8", "replace")

    async def _converge(self, script: SlurmScript, submitted: str,
                        found: list[poll.SlurmJob] | None = None) -> str:
        """After an sbatch that an earlier, ambiguous one may have raced: the oldest job of
        the attempt is the one to adopt; the others (held, never released) are cancelled.
        A look-up that fails raises: nothing is released, the launch's retry looks again."""
        if found is None:
            found = await self.lookup(script)
        if not found:
            return submitted  # squeue does not list it yet; a later duplicate is newer
        keep, extra = found[0].job_id, [j.job_id for j in found[1:]]
        if extra:
            log.warning("duplicate Slurm jobs %s for %s; keeping %s", extra, script.comment, keep)
            for jid in extra:  # held: none of them ever ran; a failure is retried by the poll rounds
                with contextlib.suppress(DlschedError):
                    await self.cancel(jid)
        return keep


def is_held(job: poll.SlurmJob) -> bool:
    """Whether the job waits in the hold every dlsched submission starts in."""
    return job.state.startswith("PENDING") and job.reason in HELD_REASONS


def held_by_dlsched(job: poll.SlurmJob) -> bool:
    """Whether a held job's hold can be dlsched's own: ``sbatch --hold`` is JobHeldUser, root's
    too; an operator's ``scontrol hold`` (JobHeldAdmin) is never dlsched's to release."""
    return is_held(job) and job.reason == "JobHeldUser"


def voided(job: poll.SlurmJob) -> bool:
    """Cancelled while still held, before any allocation: never released, so it never ran and
    no driver adopted it. A launch of its attempt passes over it (submits anew)."""
    return job.state.startswith("CANCELLED") and job.reason in HELD_REASONS and not job.nodes


def listing(attempts: Mapping[str, Iterable[poll.SlurmJob]],
            jobs: Iterable[poll.SlurmJob] = ()) -> dict[str, dict[str, poll.SlurmJob]]:
    """The oldest job of each dlsched attempt (``attempts``: comment -> its jobs, plus ``jobs``),
    by attempt key (``SlurmScript.attempt_key``: the comment without a uid) and comment."""
    by_comment: dict[str, list[poll.SlurmJob]] = {k: list(v) for k, v in attempts.items()}
    for j in jobs:
        by_comment.setdefault(j.comment, []).append(j)
    out: dict[str, dict[str, poll.SlurmJob]] = {}
    for comment, sjs in by_comment.items():
        parsed = render.parse_comment(comment)
        if parsed is not None and sjs:
            out.setdefault(render.job_comment(parsed[0], parsed[1]), {})[comment] = oldest_first(sjs)[0]
    return out


def ended(job: poll.SlurmJob) -> bool:
    """Whether Slurm says the job has ended."""
    return states.job_state(job.state, job.reason).state.is_terminal()


def oldest_first(jobs: Iterable[poll.SlurmJob]) -> list[poll.SlurmJob]:
    """Slurm job ids grow with submission time: the oldest (the one to adopt) first."""
    return sorted(jobs, key=lambda j: int(j.job_id) if decimal(j.job_id) else 0)


async def bounded(step: Awaitable[object], seconds: float = CLOSE_STEP_SECONDS) -> None:
    """Await ``step`` for at most ``seconds``; what did not finish in time is abandoned (logged)."""
    try:
        await asyncio.wait_for(step, seconds)
    except TimeoutError:
        log.warning("closing a cluster: a step took over %ss; abandoned", seconds)
