"""The Slurm state map is total (unknown states never crash or end a job), and the parsers of
recorded squeue / scontrol output."""

from __future__ import annotations

import time

import pytest

from drivers.common.base import JobState, ReplicaState
from drivers.slurm import poller, states

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


# --------------------------------------------------------------------------- recorded Slurm output

def sq(*fields: str) -> str:
    """One job of ``squeue_command``'s answer: the fields, then the comment at its fixed width."""
    *head, comment = fields
    return "|".join(head) + "|" + comment.ljust(poller.COMMENT_WIDTH)[:poller.COMMENT_WIDTH] + "|\n"


SQUEUE = (
    sq("1", "FAILED", "768", "2026-12-02T14:34:08", "2026-12-02T14:34:08", "vm", "NonZeroExitCode", "0", "dlsched-x.1")
    + sq("2", "RUNNING", "0", "2026-12-02T14:34:08", "NONE", "vm", "None", "2", "(null)")
    + sq("3", "PENDING", "0", "N/A", "N/A", "", "Resources", "0", "a|b|c")
)
SCONTROL_JOB = (
    "JobId=7 JobName=dlsched-z UserId=root(0) JobState=CANCELLED Reason=None ExitCode=0:15 "
    "StartTime=2026-12-02T14:32:39 EndTime=2026-12-02T14:32:40 NodeList=vm Comment=dlsched-z.2 "
    "Restarts=1 Command=(null) WorkDir=/root with space\n"
)
SCONTROL_NODES = (
    "NodeName=vm Arch=x86_64 CoresPerSocket=1  CPUAlloc=1 CPUEfctv=2 CPUTot=2 CPULoad=0.29 "
    "Gres=gpu:a100:4(S:0-1) NodeAddr=127.0.0.1 RealMemory=1000 AllocMem=250 FreeMem=23604 "
    "State=MIXED CfgTRES=cpu=2,mem=1000M,billing=2 AllocTRES=cpu=1,gres/gpu=1\n"
    "NodeName=vm2 CPUAlloc=0 CPUTot=4 Gres=(null) RealMemory=2000 AllocMem=0 State=DOWN+DRAIN AllocTRES=\n"
)


def test_parse_squeue():
    jobs = poller.parse_squeue(SQUEUE)
    assert jobs["1"].exit_status == 3 and jobs["1"].comment == "dlsched-x.1"
    assert jobs["1"].end_time == jobs["1"].start_time and jobs["1"].start_time is not None
    assert jobs["2"].end_time is None and jobs["2"].state == "RUNNING" and jobs["2"].restarts == 2
    assert jobs["3"].comment == "a|b|c" and jobs["3"].reason == "Resources"


def test_a_comment_with_newlines_or_pipes_shifts_no_column_and_makes_no_job():
    """The comment is the only text a job chooses in the listing (its name is not asked for),
    goes last and has a fixed width: '|' stays in it, and no line after a newline in it is a
    job's, even one that starts with a job id (a forged line)."""
    forged = "x|y|99999999999|\n101|COMPLETED|0|N/A|N/A||None|0|dlsched-victim.1.abc|\nrest ? of it"
    text = (sq("4", "PENDING", "0", "N/A", "N/A", "", "JobHeldUser", "0", forged)
            + sq("5", "RUNNING", "0", "N/A", "N/A", "vm", "None", "123456789012345678901234", "dlsched-q.1"))
    jobs = poller.parse_squeue(text)
    assert set(jobs) == {"4", "5"} and jobs["4"].comment == forged and jobs["4"].restarts == 0
    assert jobs["5"].restarts == 0  # past an int64: not a count


def test_parse_scontrol_job():
    j = poller.parse_scontrol_jobs(SCONTROL_JOB)["7"]
    assert (j.state, j.exit_status, j.comment) == ("CANCELLED", 143, "dlsched-z.2")
    assert j.restarts == 1


def test_wait_status_decoding():
    assert poller.decode_wait_status("0") == 0
    assert poller.decode_wait_status("768") == 3
    assert poller.decode_wait_status("9") == 137
    assert poller.decode_wait_status("") is None


def test_capacity_from_scontrol_nodes():
    slurm_driver = pytest.importorskip("drivers.slurm.usage", reason="needs asyncssh (the slurm extra)")
    cap = slurm_driver.capacity(SCONTROL_NODES)
    assert (cap.nodes_total, cap.nodes_free) == (2, 1)
    assert (cap.cpus_total, cap.cpus_free) == (6, 1)  # the drained node offers nothing
    assert cap.memory_bytes_total == 3000 << 20 and cap.memory_bytes_free == 750 << 20
    assert (cap.gpus_total, cap.gpus_free, cap.max_gpus_per_node) == (4, 3, 4)
    assert cap.max_cpus_per_node == 4


def test_sstat_durations_and_sizes():
    d = pytest.importorskip("drivers.slurm.usage", reason="needs asyncssh (the slurm extra)")
    assert d._duration("00:00:01") == 1 and d._duration("01:02.500") == 62.5
    assert d._duration("1-00:00:10") == 86410 and d._duration("junk") == 0
    assert d._size("64608K") == 64608 << 10 and d._size("1.5M") == 3 << 19 and d._size("7") == 7
    assert d._size("") == 0


# sstat on a GPU node whose Slurm gathers GPU usage (gpu/nvml: gres/gpuutil, gres/gpumem), and
# this machine's own sstat line (no GPUs: the same TRES list without the gres entries).
SSTAT_GPU = (
    "41.0|00:01:02|2048M|1536M|cpu=00:01:02,energy=0,fs/disk=1690066,gres/gpumem=9216M,gres/gpuutil=87,"
    "mem=1536M,pages=0,vmem=2100M\n"
    "41.1|00:00:30|1024M|1000M|cpu=00:00:30,energy=0,gres/gpumem=0,gres/gpuutil=0,mem=1000M,pages=0\n"
    "41.batch|00:00:00|66276K|66276K|cpu=00:00:00,energy=0,fs/disk=1690066,mem=66276K,pages=0,vmem=70360K\n"
    "41.extern|00:00:00|0|0|cpu=00:00:00,mem=0\n"
)
STEP_NAMES = "41.0|worker-0\n41.1|worker-1\n41.batch|batch\n41.extern|extern\n"


def test_sstat_gives_cpu_memory_and_gpu_figures_per_replica():
    d = pytest.importorskip("drivers.slurm.usage", reason="needs asyncssh (the slurm extra)")
    got = d.parse_sstat(SSTAT_GPU, STEP_NAMES, launcher=None)
    assert set(got) == {("worker", 0), ("worker", 1)}  # the batch and extern steps are no replica here
    w0 = got[("worker", 0)]
    assert (w0.cpu_seconds, w0.peak_memory_bytes, w0.memory_bytes) == (62, 2 << 30, 1536 << 20)
    assert (w0.gpu_utilization_percent, w0.gpu_memory_bytes, w0.running) == (87, 9 << 30, True)
    assert got[("worker", 1)].gpu_utilization_percent == 0
    mpi = d.parse_sstat(SSTAT_GPU, STEP_NAMES, launcher=("launcher", 0))
    assert mpi[("launcher", 0)].peak_memory_bytes == 66276 << 10  # MPI: the batch step is the launcher
    assert mpi[("launcher", 0)].gpu_memory_bytes == 0


def test_sacct_gives_an_ended_jobs_final_figures_per_replica():
    d = pytest.importorskip("drivers.slurm.usage", reason="needs asyncssh (the slurm extra)")
    text = ("41|dlsched-j|01:32.500||\n41.batch|batch|00:00.010|5000K\n41.extern|extern|00:00:00|0\n"
            "41.0|main-0|01:30.250|812M\n41.1|main-1|2-00:00:01|1G\n")
    got = d.parse_sacct_steps(text, launcher=None)
    assert got[("main", 0)].cpu_seconds == 90.25 and got[("main", 0)].peak_memory_bytes == 812 << 20
    assert got[("main", 1)].cpu_seconds == 2 * 86400 + 1 and not got[("main", 1)].running
    assert set(got) == {("main", 0), ("main", 1)}


def test_ps_worker_tasks_share_their_one_steps_figures():
    """PS-Worker's tasks run in one --multi-prog step, measured as a whole: each task gets the
    step's per-task average CPU and memory (so they add up to the step's) and its peak."""
    d = pytest.importorskip("drivers.slurm.usage", reason="needs asyncssh (the slurm extra)")
    tasks = [("ps", 0), ("worker", 0), ("worker", 1)]
    stats = "52.0|00:00:04|300M|100M|cpu=00:00:04,mem=100M\n52.batch|00:00:00|5M|5M|cpu=00:00:00,mem=5M\n"
    got = d.parse_sstat(stats, "52.0|dlsched-tasks\n52.batch|batch\n", launcher=None, tasks=tasks)
    assert set(got) == set(tasks)
    assert all((u.cpu_seconds, u.memory_bytes, u.peak_memory_bytes) == (4, 100 << 20, 300 << 20)
               for u in got.values())
    final = d.parse_sacct_steps("52|dlsched-j|00:12.000||\n52.0|dlsched-tasks|00:12.000|300M\n",
                                launcher=None, tasks=tasks)
    assert set(final) == set(tasks) and sum(u.cpu_seconds for u in final.values()) == 12
    assert final[("ps", 0)].peak_memory_bytes == 300 << 20


def test_parse_sacct_allocations():
    text = ("7|COMPLETED|0:0|2026-12-02T10:00:00|2026-12-02T10:05:00|node1|None|dlsched-a.1\n"
            "7.batch|COMPLETED|0:0|2026-12-02T10:00:00|2026-12-02T10:05:00|node1||\n"
            "8|CANCELLED by 0|0:15|2026-12-02T10:00:00|2026-12-02T10:01:00|node1|None|x|y\n"
            "9|FAILED|3:0|Unknown|Unknown|None assigned|NonZeroExitCode|\n")
    jobs = poller.parse_sacct(text)
    assert set(jobs) == {"7", "8", "9"}  # steps are not jobs
    assert states.job_state(jobs["7"].state).state is JobState.SUCCEEDED and jobs["7"].comment == "dlsched-a.1"
    assert jobs["7"].end_time == jobs["7"].start_time + 300
    assert states.job_state(jobs["8"].state).state is JobState.STOPPED and jobs["8"].exit_status == 128 + 15
    assert jobs["8"].comment == "x|y"  # a '|' in a comment stays in it
    assert jobs["9"].exit_status == 3 and jobs["9"].start_time is None


@pytest.mark.parametrize("reason", sorted(states.UNSCHEDULABLE_REASONS))
def test_a_job_slurm_can_never_start_fails_unschedulable(reason):
    """Pending for a partition limit or bad constraints: FAILED Unschedulable (the driver then
    cancels it), not QUEUED forever; passing reasons keep it queued, a stop keeps STOPPING."""
    from drivers.slurm.jobs import TrackedJob

    job = TrackedJob("clusters/s", "j", 1, "42", "/tmp/j", None, (("main", 0),))
    job.apply(poller.SlurmJob("42", "PENDING", reason))
    obs = job.observation(None)
    assert (obs.state, obs.reason, job.unschedulable) == (JobState.FAILED, "Unschedulable", True)
    assert reason in obs.message and obs.end_time is not None
    for passing in ("Resources", "Priority", "QOSJobLimit", "ReqNodeNotAvail"):
        queued = TrackedJob("clusters/s", "k", 1, "43", "/tmp/k", None)
        queued.apply(poller.SlurmJob("43", "PENDING", passing))
        assert (queued.state, queued.unschedulable) == (JobState.QUEUED, False)
    stopping = TrackedJob("clusters/s", "m", 1, "44", "/tmp/m", None)
    stopping.stop_sent()
    stopping.apply(poller.SlurmJob("44", "PENDING", reason))
    assert stopping.state is JobState.STOPPING and not stopping.unschedulable


def test_a_job_seen_running_then_held_again_ends_lost_not_queued_for_ever():
    """slurmctld SIGKILLed and restarted from a state saved before the job's release: the job
    is PENDING JobHeldUser again and what ran was killed. It stayed QUEUED for good (released
    again it would run twice): FAILED LeftSlurm, cancelled. A requeue (its restart count up),
    a stop, or a job never seen running are not this."""
    from drivers.slurm.jobs import TrackedJob

    job = TrackedJob("clusters/s", "j", 1, "42", "/tmp/j", None, (("main", 0),))
    job.apply(poller.SlurmJob("42", "PENDING", "JobHeldUser"))
    assert job.state is JobState.QUEUED  # (held at submit: released by the driver)
    job.apply(poller.SlurmJob("42", "RUNNING", start_time=1000.0, nodes="n1"))
    job.apply(poller.SlurmJob("42", "PENDING", "JobHeldUser"))
    obs = job.observation(None)
    assert (obs.state, obs.reason, job.unschedulable) == (JobState.FAILED, "LeftSlurm", True), obs
    assert "restarted" in obs.message and obs.end_time is not None
    requeued = TrackedJob("clusters/s", "k", 1, "43", "/tmp/k", None)
    requeued.apply(poller.SlurmJob("43", "RUNNING", start_time=1000.0, nodes="n1"))
    requeued.apply(poller.SlurmJob("43", "PENDING", "JobHeldUser", restarts=1))  # scontrol requeuehold
    assert requeued.state is JobState.QUEUED and not requeued.unschedulable
    stopping = TrackedJob("clusters/s", "m", 1, "44", "/tmp/m", None)
    stopping.apply(poller.SlurmJob("44", "RUNNING", start_time=1000.0, nodes="n1"))
    stopping.stop_sent()
    stopping.apply(poller.SlurmJob("44", "PENDING", "JobHeldUser"))
    assert stopping.state is JobState.STOPPING and not stopping.unschedulable


def test_a_lost_end_is_decided_by_the_exits_file():
    """NODE_FAIL for a job whose every process ended 0 (its end lost across a controller
    restart) is SUCCEEDED; NODE_FAIL with a process that never ended, or one that failed,
    stays FAILED; other failed states are Slurm's word whatever the file says."""
    from drivers.slurm import exits
    from drivers.slurm.jobs import TrackedJob

    def ended(state: str, text: str) -> TrackedJob:
        job = TrackedJob("clusters/s", "j", 1, "42", "/tmp/j", None, (("main", 0), ("worker", 0)))
        job.apply(poller.SlurmJob("42", "RUNNING", nodes="n1"))
        job.apply(poller.SlurmJob("42", state, exit_status=1 if state != "COMPLETED" else 0, nodes="n1"))
        assert job.needs_exits
        assert job.exits_read(exits.parse(text))
        return job

    done = "labels main-0 worker-0\nend worker-0 0 exit\nend main-0 0 exit\n"
    job = ended("NODE_FAIL", done)
    obs = job.observation(None)
    assert (obs.state, obs.exit_code) == (JobState.SUCCEEDED, 0) and "NODE_FAIL" in obs.message
    assert {r.role: r.state for r in obs.replicas} == {"main": ReplicaState.SUCCEEDED, "worker": ReplicaState.SUCCEEDED}
    for text in ("labels main-0 worker-0\nend main-0 0 exit\n",  # worker-0 never ended
                 "labels main-0 worker-0\nend worker-0 3 exit\nend main-0 143 stop\n"):
        assert ended("NODE_FAIL", text).observation(None).state is JobState.FAILED
    assert ended("OUT_OF_MEMORY", done).observation(None).state is JobState.FAILED


def test_a_success_message_says_what_the_success_rule_stopped():
    """PS-Worker and MPI succeed on their deciding processes and stop the rest: the message says
    so, in the planner's words (every backend's), not "every process exited 0"; adopted jobs too."""
    from drivers.slurm import exits
    from drivers.slurm.jobs import TrackedJob

    ps_exits = ("labels chief-0 ps-0 worker-0\nend worker-0 0 exit\nend chief-0 0 exit\n"
                "end ps-0 143 stop\n")
    for roles in ((("chief", 0), ("ps", 0), ("worker", 0)), ()):  # launched; adopted (roles from its exits)
        job = TrackedJob("clusters/s", "p", 1, "42", "/tmp/p", None, roles)
        job.apply(poller.SlurmJob("42", "RUNNING", nodes="n1"))
        job.apply(poller.SlurmJob("42", "COMPLETED", exit_status=0, nodes="n1"))
        assert job.exits_read(exits.parse(ps_exits))
        obs = job.observation(None)
        assert obs.state is JobState.SUCCEEDED
        assert obs.message == "the chief exited 0; the rest (ps, worker) stopped", roles
        assert {r.role: r.state for r in obs.replicas}["ps"] is ReplicaState.STOPPED
    mpi = TrackedJob("clusters/s", "m", 1, "43", "/tmp/m", None, (("launcher", 0),), hosts=(("worker", 0),))
    mpi.apply(poller.SlurmJob("43", "COMPLETED", exit_status=0, nodes="n1"))
    assert mpi.exits_read(exits.parse("labels launcher-0\nhosts worker-0\nend launcher-0 0 exit\n"))
    assert mpi.observation(None).message == "the launcher (mpirun) exited 0"
    mw = TrackedJob("clusters/s", "w", 1, "44", "/tmp/w", None, (("master", 0), ("worker", 0)))
    mw.apply(poller.SlurmJob("44", "COMPLETED", exit_status=0, nodes="n1"))
    assert mw.exits_read(exits.parse("labels master-0 worker-0\nend worker-0 0 exit\nend master-0 0 exit\n"))
    assert mw.observation(None).message == "every process exited 0"
    # a single process's role may be any name: "launcher" alone is no MPI job
    assert states.success_message(["launcher"]) == "every process exited 0"


def test_mpi_workers_are_reported_with_the_jobs_state_and_survive_the_record():
    """MPI's workers run no step (they host the launcher's ranks): reported RUNNING while the
    job runs, SUCCEEDED when it succeeded, STOPPED when it failed; a record keeps them."""
    from drivers.slurm import exits
    from drivers.slurm.jobs import TrackedJob

    def job_in(state: str) -> TrackedJob:
        job = TrackedJob("clusters/s", "m", 1, "42", "/tmp/m", None, (("launcher", 0),),
                         hosts=(("worker", 0), ("worker", 1)))
        job.apply(poller.SlurmJob("42", "RUNNING", nodes="n1"))
        if state != "RUNNING":
            job.apply(poller.SlurmJob("42", state, exit_status=0 if state == "COMPLETED" else 1, nodes="n1"))
            status = 0 if state == "COMPLETED" else 1
            assert job.exits_read(exits.parse(f"labels launcher-0\nend launcher-0 {status} exit\n"))
        return job

    def states_of(job: TrackedJob) -> list[tuple[str, int, ReplicaState]]:
        return [(r.role, r.index, r.state) for r in job.observation(None).replicas]

    R = ReplicaState
    assert states_of(job_in("RUNNING")) == [("launcher", 0, R.RUNNING), ("worker", 0, R.RUNNING),
                                            ("worker", 1, R.RUNNING)]
    done = job_in("COMPLETED")
    assert states_of(done) == [("launcher", 0, R.SUCCEEDED), ("worker", 0, R.SUCCEEDED), ("worker", 1, R.SUCCEEDED)]
    assert states_of(job_in("FAILED")) == [("launcher", 0, R.FAILED), ("worker", 0, R.STOPPED),
                                           ("worker", 1, R.STOPPED)]
    again = TrackedJob.from_record("clusters/s", "/tmp/m", done.record())
    assert states_of(again) == states_of(done)


def test_a_job_that_ends_after_a_stop_reached_it_is_stopped_and_killed_after_the_grace():
    """SIGTERM to the steps, then the grace: whatever the processes' statuses (a SIGTERM's, or 0
    from a handler that saved its work), an end after the stop is STOPPED; a job that ends on
    its own is what Slurm says. ``kill_due`` once the grace is over, and only once sent."""
    from drivers.slurm import exits
    from drivers.slurm.jobs import TrackedJob

    for state, code in (("FAILED", 143), ("COMPLETED", 0), ("CANCELLED", 0)):
        job = TrackedJob("clusters/s", "j", 1, "42", "/tmp/j", None, (("main", 0),))
        job.apply(poller.SlurmJob("42", "RUNNING", nodes="n1"))
        job.stop_sent(30)
        assert job.state is JobState.STOPPING and not job.kill_due(time.monotonic())
        assert job.kill_due(time.monotonic() + 31)
        job.apply(poller.SlurmJob("42", state, exit_status=code, nodes="n1"))
        assert job.exits_read(exits.parse(f"labels main-0\nend main-0 {code} exit\n"))
        obs = job.observation(None)
        assert obs.state is JobState.STOPPED, (state, obs)
        # an end recorded unmarked ('exit', not 'halt') came before the stop's mark: as on local and
        # Ray, a process that exited 0 before the stop SUCCEEDED (the mark is written before any signal)
        assert [r.state for r in obs.replicas] == [ReplicaState.STOPPED if code else ReplicaState.SUCCEEDED]
        assert not job.kill_due(time.monotonic() + 31)  # ended: nothing to kill
    alone = TrackedJob("clusters/s", "k", 1, "43", "/tmp/k", None, (("main", 0),))
    alone.apply(poller.SlurmJob("43", "RUNNING", nodes="n1"))
    alone.apply(poller.SlurmJob("43", "FAILED", exit_status=3, nodes="n1"))
    assert alone.exits_read(exits.parse("labels main-0\nend main-0 3 exit\n"))
    assert alone.observation(None).state is JobState.FAILED
    cancelled = TrackedJob("clusters/s", "m", 1, "44", "/tmp/m", None)
    cancelled.stop_sent()  # scancel at once: nothing left to kill
    assert cancelled.state is JobState.STOPPING and not cancelled.kill_due(time.monotonic() + 1e6)


def test_a_slurm_id_handed_out_again_is_not_the_job(monkeypatch):
    """A restarted slurmctld that lost its newest jobs hands their ids out again: the job now
    listed under a tracked job's id is another's (its comment says so), never its end; and a job
    no round ever listed (lost before any) is gone after UNSEEN_ROUNDS rounds over UNSEEN_SECONDS,
    not QUEUED forever. (A fault run: 2 of 3 lost jobs took their successors' SUCCEEDED, 8 lost
    before a round stayed QUEUED.)"""
    from drivers.slurm import jobs as tracked_jobs
    from drivers.slurm import render
    from drivers.slurm.jobs import TrackedJob

    uid = "5" * 32
    job = TrackedJob("clusters/s", "a1", 1, "2", "/tmp/a1", None, (("main", 0),), uid=uid)
    mine = render.job_comment("a1", 1, uid)
    assert job.listed_as(poller.SlurmJob("2", "RUNNING", comment=mine))
    for other in (render.job_comment("b0", 1, uid), render.job_comment("a1", 2, uid),
                  render.job_comment("a1", 1, "6" * 32), "someone's own job"):
        assert not job.listed_as(poller.SlurmJob("2", "COMPLETED", comment=other)), other
    assert job.listed_as(poller.SlurmJob("2", "COMPLETED"))  # sacct without stored comments: cannot tell
    job.stop_sent(5)
    job.kill_at = 0.0  # its grace over
    assert job.kill_due(time.monotonic())
    assert job.listed(poller.SlurmJob("2", "RUNNING", comment=render.job_comment("b0", 1, uid))) is None
    assert job.id_lost and job.needs_exits  # gone: its end is its exits file's
    assert not job.kill_due(time.monotonic())  # no SIGKILL to the id's new owner

    now = [1000.0]
    monkeypatch.setattr(tracked_jobs.time, "monotonic", lambda: now[0])
    never = TrackedJob("clusters/s", "a2", 1, "3", "/tmp/a2", None, (("main", 0),), uid=uid)
    for _ in range(tracked_jobs.UNSEEN_ROUNDS + 2):  # quick rounds: not yet
        never.round(None, None, complete=True)
        now[0] += 1
    assert not never.needs_exits and never.state is JobState.QUEUED
    never.round(None, None, complete=False)  # a round that could not tell counts nothing
    now[0] += tracked_jobs.UNSEEN_SECONDS
    never.round(None, None, complete=True)
    assert never.needs_exits  # vanished: its exits file decides (none: lost)
    seen = TrackedJob("clusters/s", "a3", 1, "4", "/tmp/a3", None, (("main", 0),), uid=uid)
    seen.round(poller.SlurmJob("4", "PENDING", "Priority", comment=render.job_comment("a3", 1, uid)), None, True)
    seen.round(None, None, complete=True)
    assert seen.needs_exits  # listed once, then missing: gone at once, as before


#: logs its arguments, and whether the stop's mark was there when it ran
FAKE_SCANCEL = '#!/bin/sh\n[ -e "$FAKE_DIR/attempt/stopping" ] && m=marked || m=unmarked\necho "$m $*" >>"$FAKE_DIR/scancel.log"\n'


@pytest.mark.parametrize(("slurm_says", "sent"), [("RUNNING", "--signal=TERM 42"), ("PENDING", "42"),
                                                  ("CONFIGURING", "42")])
def test_a_stop_before_a_round_saw_the_job_run_cancels_it_after_the_mark(tmp_path, slurm_says, sent):
    """A stop soon after the start, before the driver's round saw the job RUNNING, was a plain
    scancel of an unmarked script: processes that exit 0 on its SIGTERM were SUCCEEDED. Now the
    mark always comes first (their ends are the stop's); the last round's word decides: steps
    signalled (the stop's grace), or scancel. No squeue of its own: a round's is the only one."""
    import asyncio
    import functools
    import subprocess
    import types

    from drivers.common.base import JobRef
    from drivers.slurm.adapter import SlurmClient
    from drivers.slurm.driver import SlurmDriver
    from drivers.slurm.jobs import TrackedJob

    (tmp_path / "bin").mkdir()
    (tmp_path / "attempt").mkdir()
    (tmp_path / "bin" / "scancel").write_text(FAKE_SCANCEL)
    (tmp_path / "bin" / "scancel").chmod(0o755)

    async def run(command: str, **_: object) -> tuple[int, str, str]:
        import os
        env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "FAKE_DIR": str(tmp_path)}
        p = await asyncio.to_thread(subprocess.run, ["bash", "-c", command], env=env, capture_output=True,
                                    text=True, timeout=60)
        return p.returncode, p.stdout, p.stderr

    client = types.SimpleNamespace(run=run)
    for method in ("stop", "cancel", "kill"):
        setattr(client, method, functools.partial(getattr(SlurmClient, method), client))
    job = TrackedJob("clusters/s", "j", 1, "42", str(tmp_path / "attempt"), None, (("master", 0), ("worker", 0)))
    job.apply(poller.SlurmJob("42", slurm_says, nodes="n1" if slurm_says != "PENDING" else ""))  # the last round's
    cluster = types.SimpleNamespace(client=client, find=lambda ref: job, observation=lambda j: j.observation(None),
                                    poller=types.SimpleNamespace(wake=lambda: None))
    driver = SlurmDriver()
    obs = asyncio.run(driver._terminate(cluster, "clusters/s", JobRef("j", "42"), 30.0))  # type: ignore[arg-type]
    assert obs is not None and obs.state is JobState.STOPPING
    assert (tmp_path / "scancel.log").read_text().splitlines() == [f"marked {sent}"]
    assert (job.kill_at is not None) == (slurm_says == "RUNNING")  # the stop's grace, then SIGKILL
    mpi = TrackedJob("clusters/s", "m", 1, "42", str(tmp_path / "attempt"), None, (("launcher", 0),),
                     hosts=(("worker", 0),))
    (tmp_path / "attempt" / "stopping").unlink()
    cluster.find = lambda ref: mpi
    asyncio.run(driver._terminate(cluster, "clusters/s", JobRef("m", "42"), 30.0))  # type: ignore[arg-type]
    assert (tmp_path / "scancel.log").read_text().splitlines()[1:] == ["marked 42"]  # MPI: scancel, marked
