"""``LaunchRules``: the attempt rules of ``Driver.launch``, once for every backend.

A launch names (cluster, job id, attempt). Whatever the backend, the driver
answers it the same way, from what the backend knows of the job's newest
attempt (``Known``, from the backend's ``known`` hook):

- nothing known: the backend submits it (the ``submit`` hook);
- known for another job uid (the launch's ``uid`` and ``Known.uid``, both
  given and different): a job of the same id that was deleted while its
  driver could not clean it up. It is never adopted (the new job would take
  its state and never run): when it has ended, the ``discard`` hook cleans
  it up as its DeleteJob would have and the rules apply again; while it
  runs, FAILED_PRECONDITION ``NAME_COLLISION`` (deleting the new job cleans
  the old one up). A job id used again after a cleanup is a new job: the
  backend marks each submission with its uid.
- known on another cluster of this driver: FAILED_PRECONDITION
  ``JOB_ON_OTHER_CLUSTER`` (only a backend whose jobs span the cluster names
  it serves can report one: the local driver, one host under many names;
  the others look a job up per cluster, and JobManager never moves a job);
- the same attempt: that launch's result again, nothing submitted;
- a lower attempt: FAILED_PRECONDITION ``STALE_ATTEMPT``;
- a higher attempt while the known one has not ended: FAILED_PRECONDITION
  ``PREVIOUS_ATTEMPT_ACTIVE`` (a retry never overlaps the attempt it retries);
- a higher attempt after the known one ended: the backend submits it.

Launches of one job id are serialised: the rules are checked and the
submission made under one lock per job id (whatever the cluster, so the
cross-cluster rule has no race either), and a concurrent launch of the same
attempt waits and gets the first one's result. A lock lives only while a
launch holds or waits for it, so the table never grows with the jobs seen.

A stop or a clean-up of a job (``settled``) takes the same lock: it waits for
a launch in flight, so it never stops what the backend had so far while the
launch goes on to create the rest (Kubernetes pods made after their stop).

A launch is owned by the driver, not by its caller: the checks and the
submission run in a task of their own that the caller only waits for. A
caller that goes away (its deadline, a cancelled RPC, a killed JobManager)
leaves the submission to complete; the backend records it like any other,
and the retry of the same attempt is answered with its result. A submission
cancelled half-way could leave a job killed mid-spawn, reported FAILED
without having run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from dlsched.errors import FailedPrecondition
from dlsched.kit.locks import KeyedLocks
from drivers.common.base import LaunchResult, NameCollision, same_job

log = logging.getLogger("dlsched.driver.launches")


class StaleAttempt(FailedPrecondition):
    """A launch of an attempt lower than the newest the driver knows."""

    reason = "STALE_ATTEMPT"

    def __init__(self, job_id: str, known: int) -> None:
        super().__init__(f"job {job_id!r} is already at attempt {known}", metadata={"attempt": str(known)})


class PreviousAttemptActive(FailedPrecondition):
    """A launch of a new attempt while the previous one has not ended."""

    reason = "PREVIOUS_ATTEMPT_ACTIVE"

    def __init__(self, job_id: str, known: int) -> None:
        super().__init__(f"attempt {known} of job {job_id!r} has not ended", metadata={"attempt": str(known)})


class JobOnOtherCluster(FailedPrecondition):
    """A launch of a job the driver runs on another cluster."""

    reason = "JOB_ON_OTHER_CLUSTER"

    def __init__(self, job_id: str, cluster: str) -> None:
        super().__init__(f"job {job_id!r} runs on {cluster}", metadata={"cluster": cluster})


@dataclass(frozen=True)
class Known:
    """What the backend knows of a job's newest attempt."""

    cluster: str  #: the cluster it was launched on
    attempt: int
    active: bool  #: not ended yet
    result: Callable[[], LaunchResult]  #: that attempt's launch result, for a repeated launch
    uid: str = ""  #: the uid of the job it was launched for ("" when the launch gave none)


class LaunchRules:
    """The attempt rules and the per-job launch lock of one driver."""

    def __init__(self) -> None:
        self._locks = KeyedLocks()
        self._inflight: set[asyncio.Task[LaunchResult]] = set()

    @property
    def inflight(self) -> int:
        """Launches running now (callers gone or not)."""
        return len(self._inflight)

    async def drain(self, within: float) -> None:
        """Wait up to ``within`` seconds for launches in flight (a driver closing)."""
        if self._inflight:
            await asyncio.wait(list(self._inflight), timeout=within)

    def __len__(self) -> int:
        """Locks held or waited for now (0 when no launch is in flight)."""
        return len(self._locks)


    @contextlib.asynccontextmanager
    async def settled(self, job_id: str) -> AsyncIterator[None]:
        """Hold ``job_id``'s launch lock: a stop or a clean-up waits for a launch of the job in
        flight, so it finds (and stops or removes) everything that launch made, rather than what
        the backend had so far while the launch goes on creating the rest."""
        async with self._locks.hold(job_id):
            yield

    async def launch(self, cluster: str, job_id: str, attempt: int, *,
                     known: Callable[[], Known | None],
                     submit: Callable[[], Awaitable[LaunchResult]], uid: str = "",
                     discard: Callable[[Known], Awaitable[None]] | None = None) -> LaunchResult:
        """Apply the rules to what ``known()`` reports; ``submit()`` when they allow a launch.
        ``uid``: the job's; ``discard(known)``: clean up what the backend knows of the job id
        (an ended job of another uid, see the module's doc), on the cluster ``known`` names.

        Both hooks run under the job's lock; ``known`` may raise a backend's own
        refusal (a name collision) before any rule applies. The work runs in a
        driver-owned task: cancelling the caller does not cancel it.
        """
        task = asyncio.ensure_future(self._launch(cluster, job_id, attempt, uid, known, submit, discard))
        self._inflight.add(task)
        task.add_done_callback(self._done)
        return await asyncio.shield(task)

    def _done(self, task: asyncio.Task[LaunchResult]) -> None:
        self._inflight.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a caller that left does not hear of it

    async def _launch(self, cluster: str, job_id: str, attempt: int, uid: str,
                      known: Callable[[], Known | None],
                      submit: Callable[[], Awaitable[LaunchResult]],
                      discard: Callable[[Known], Awaitable[None]] | None) -> LaunchResult:
        async with self._locks.hold(job_id):
            prev = known()
            if prev is not None and not same_job(prev.uid, uid) and not prev.active and discard is not None:
                log.warning("launch of %s (uid %s): cleaning up the ended job of the same id, uid %s, "
                            "deleted without its cleanup", job_id, uid, prev.uid)
                await discard(prev)
                prev = known()
            if prev is not None:
                if not same_job(prev.uid, uid):
                    raise NameCollision(
                        f"attempt {prev.attempt} of an earlier job {job_id!r} (uid {prev.uid}), deleted without "
                        "its cleanup, still runs on the backend; delete this job to stop and clean it up, then "
                        "submit it again", metadata={"job_uid": prev.uid})
                if prev.cluster != cluster:
                    raise JobOnOtherCluster(job_id, prev.cluster)
                if prev.attempt == attempt:
                    return prev.result()
                if attempt < prev.attempt:
                    raise StaleAttempt(job_id, prev.attempt)
                if prev.active:
                    raise PreviousAttemptActive(job_id, prev.attempt)
            return await submit()
