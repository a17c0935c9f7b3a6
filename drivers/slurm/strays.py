"""The Slurm jobs no driver will ever release, found in a poll round's listing (exactly once).

Every dlsched submission starts held and only the job adopted for an attempt (the
oldest with its ``dlsched-<job_id>.<attempt>.<uid>`` comment) is released, so a job that
is held and wanted by no launch never ran and never will: the round cancels it.
``find`` says which, from the round's unfinished jobs grouped by attempt:

- of an attempt this cluster configuration tracks, every job but the tracked one, at
  once (a late landing, or the loser of two racing sbatch calls);
- of an attempt it does not track, only held jobs that no configuration of this
  process launches or tracks (``wanted``): another driver replica or configuration
  sharing the SSH user may still adopt them. One that is not the oldest (every
  driver adopts only the oldest, a late landing is always newer) after
  ``DUPLICATE_GRACE``, so that its own driver cancels it first. The oldest after
  ``grace`` (``--held-grace``), and only once JobManager has had ``window``
  (``--adopt-window``) to claim it: LaunchJob answers before the release, so JobManager may hold the
  id of a job still held (the driver died before releasing it, or was
  reconfigured). JobManager's owner of the cluster keeps a WatchJobObservations
  open and, right after its snapshot, asks for every launched job the snapshot
  lacked, which adopts it; so the oldest held job is cancelled only while such a
  watch has been open ``window`` seconds without asking for it (``observed_for``).
  A launch that JobManager never got the answer of (then gave up: the job was
  deleted) is what is left.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence

from drivers.slurm import render, states
from drivers.slurm.adapter import is_held, oldest_first
from drivers.slurm.poller import SlurmJob

#: Seconds a held job that is not the oldest of an attempt tracked elsewhere waits before it is
#: cancelled (its own driver cancels it sooner; this is for a driver that went away).
DUPLICATE_GRACE = 60.0


def find(attempts: Mapping[str, Sequence[SlurmJob]], *, tracked: Callable[[str, int, str], str | None],
         wanted: Callable[[str, str, int, str], bool], held_since: MutableMapping[str, float], now: float,
         grace: float, window: float, observed_for: float | None) -> list[tuple[str, str]]:
    """(Slurm job id, why) of each job to cancel now. ``attempts``: comment -> the round's
    jobs of that attempt; ``tracked(job_id, attempt, uid)``: the Slurm id this configuration
    tracks for it, or None (``uid``: the comment's, "" for none); ``wanted(comment, job_id, attempt, uid)``: whether a configuration of
    this process launches or tracks it. ``held_since`` (Slurm id -> when a round first saw
    it held and unwanted) is updated: jobs no longer in that case leave it. ``observed_for``:
    seconds a watch of the cluster has been open past its snapshot (None: none is open)."""
    adoptable = observed_for is None or observed_for < window  # JobManager may still claim it
    out: list[tuple[str, str]] = []
    held: set[str] = set()
    for comment, sjs in attempts.items():
        if (parsed := render.parse_comment(comment)) is None:
            continue
        mine = tracked(*parsed)
        for i, sj in enumerate(oldest_first(sjs)):
            if states.job_state(sj.state, sj.reason).state.is_terminal():
                continue
            if mine is not None:
                if sj.job_id != mine:
                    out.append((sj.job_id, f"a duplicate of {comment}'s job {mine}"))
                continue
            if not is_held(sj) or wanted(comment, *parsed):
                continue
            held.add(sj.job_id)
            waited = now - held_since.setdefault(sj.job_id, now)
            if i and waited >= min(DUPLICATE_GRACE, grace) or not i and waited >= grace and not adoptable:
                out.append((sj.job_id, f"{comment} held {waited:.0f}s and "
                            + ("not the oldest of its attempt" if i else "adopted by no launch")))
    for jid in [j for j in held_since if j not in held]:
        del held_since[jid]
    return out
