"""``drivers.slurm.strays.find``: which of a poll round's jobs are cancelled, and when (the real
Slurm runs of these rules are tests/test_slurm_strays.py and test_slurm_ssh_services.py)."""

from __future__ import annotations

from drivers.slurm import strays
from drivers.slurm.poller import SlurmJob

COMMENT = "dlsched-j1.1"
WINDOW = 60.0


def held(jid: str, comment: str = COMMENT) -> SlurmJob:
    return SlurmJob(jid, "PENDING", "JobHeldUser", comment=comment)


def find(attempts, *, tracked=None, wanted=False, held_since=None, now=0.0, grace=600.0,
         observed_for=WINDOW):
    return strays.find(attempts, tracked=lambda job_id, attempt, uid: tracked,
                       wanted=lambda comment, job_id, attempt, uid: wanted,
                       held_since={} if held_since is None else held_since, now=now, grace=grace,
                       window=WINDOW, observed_for=observed_for)


def test_a_tracked_attempts_other_unfinished_jobs_are_cancelled_at_once_the_tracked_one_never():
    jobs = [SlurmJob("7", "RUNNING", comment=COMMENT), held("9"), SlurmJob("8", "COMPLETED", comment=COMMENT)]
    assert [jid for jid, _ in find({COMMENT: jobs}, tracked="7")] == ["9"]
    assert find({COMMENT: jobs[:1]}, tracked="7") == []


def test_held_jobs_no_configuration_wants_are_cancelled_after_their_grace():
    since: dict[str, float] = {}
    jobs = [held("5"), held("6")]
    assert find({COMMENT: jobs}, held_since=since, now=100.0) == []
    assert since == {"5": 100.0, "6": 100.0}
    # not the oldest: after DUPLICATE_GRACE; the oldest only after --held-grace
    later = find({COMMENT: jobs}, held_since=since, now=100.0 + strays.DUPLICATE_GRACE)
    assert [jid for jid, _ in later] == ["6"]
    assert [jid for jid, _ in find({COMMENT: jobs}, held_since=since, now=100.0 + 600.0)] == ["5", "6"]


def test_a_held_job_some_configuration_of_this_process_launches_or_tracks_is_never_cancelled():
    since = {"5": 0.0}
    assert find({COMMENT: [held("5"), held("6")]}, wanted=True, held_since=since, now=10_000.0) == []
    assert since == {}  # no longer a candidate: its wait starts again if it ever is


def test_released_running_and_foreign_jobs_are_left_alone():
    jobs = {COMMENT: [SlurmJob("5", "PENDING", "Priority", comment=COMMENT), SlurmJob("6", "RUNNING", comment=COMMENT)],
            "someone-else": [held("7", "someone-else")]}
    assert find(jobs, now=10_000.0, held_since={"5": 0.0, "6": 0.0}) == []


def test_the_oldest_held_job_waits_for_jobmanager_to_have_had_the_chance_to_claim_it():
    """LaunchJob answers before the release: JobManager may hold the id of a job still
    held whose driver died or was reconfigured before releasing it. Its grace counts
    only while a watch of the cluster (JobManager's, which claims its launched jobs
    right after the snapshot) has been open the window; a duplicate is not waited for."""
    jobs = [held("5"), held("6")]
    since = {"5": 0.0, "6": 0.0}
    for observed in (None, 0.0, WINDOW - 1):  # no watch (JobManager away), or a new one
        assert [j for j, _ in find({COMMENT: jobs}, held_since=since, now=10_000.0,
                                   observed_for=observed)] == ["6"], observed
    assert [j for j, _ in find({COMMENT: jobs}, held_since=since, now=10_000.0,
                               observed_for=WINDOW)] == ["5", "6"]
