"""The local job state machine (``drivers.local.machine``), pure: the transitions the supervisor
drives and the status file the driver reads back."""

from __future__ import annotations

from drivers.common.base import JobSpec, JobState, ReplicaGroup, ReplicaState, RunMode
from drivers.local import render
from drivers.local.machine import JobMachine


def _machine(mode: RunMode, *groups: tuple[str, int]) -> JobMachine:
    spec = JobSpec(run_mode=mode, replica_groups=tuple(
        ReplicaGroup(role=role, replicas=n, command=("true",)) for role, n in groups))
    return JobMachine(render.plan_job("j", spec, attempt=1, state_dir="/s"))


def _start_all(m: JobMachine) -> None:
    for i in range(len(m.procs)):
        assert not m.started(i, 100 + i, 1, now=10.0)
    m.all_spawned()


def test_a_failure_stops_the_rest_and_fails_the_job_with_the_first_exit_code():
    m = _machine(RunMode.MULTI_PROCESS, ("worker", 3))
    _start_all(m)
    assert m.state is JobState.RUNNING and m.start_time == 10.0
    assert m.exited(1, 4)  # stop the others
    assert m.reason == "ReplicaFailed" and m.signalled
    assert not m.exited(0, -15) and not m.finish(11.0)
    assert not m.exited(2, -15) and m.finish(12.0)
    assert (m.state, m.reason, m.exit_code, m.end_time) == (JobState.FAILED, "NonZeroExit", 4, 12.0)
    assert [p.state for p in m.procs] == [ReplicaState.STOPPED, ReplicaState.FAILED, ReplicaState.STOPPED]
    assert m.procs[0].exit_code == 128 + 15


def test_ps_worker_succeeds_when_the_workers_do_and_stops_the_ps_without_failing():
    m = _machine(RunMode.PS_WORKER, ("ps", 1), ("worker", 2))
    _start_all(m)
    roles = [p.role for p in m.procs]
    workers = [i for i, r in enumerate(roles) if r == "worker"]
    assert not m.exited(workers[0], 0)
    assert m.exited(workers[1], 0) and m.succeeding
    assert not m.request_stop(5.0)  # a TerminateJob now changes nothing
    m.exited(roles.index("ps"), -15)
    assert m.finish(3.0) and m.state is JobState.SUCCEEDED
    assert m.procs[roles.index("ps")].message == "stopped: the job succeeded"


def test_stop_and_time_limit_decide_the_outcome_whatever_the_exit_codes():
    stopped = _machine(RunMode.SINGLE_PROCESS, ("main", 1))
    _start_all(stopped)
    assert stopped.request_stop(2.0) and stopped.state is JobState.STOPPING
    stopped.exited(0, -9)
    assert stopped.finish(1.0) and (stopped.state, stopped.reason) == (JobState.STOPPED, "Stopped")
    limited = _machine(RunMode.SINGLE_PROCESS, ("main", 1))
    _start_all(limited)
    assert limited.time_limit() and not limited.time_limit()
    limited.exited(0, 0)
    assert limited.finish(1.0) and (limited.state, limited.reason) == (JobState.FAILED, "TimeLimitExceeded")
    # A process that exits 0 on the SIGTERM is stopped, not done (docs/ENVIRONMENT.md; Slurm, Ray)
    assert (limited.procs[0].state, limited.procs[0].exit_code) == (ReplicaState.STOPPED, 0)
    clean = _machine(RunMode.MULTI_PROCESS, ("worker", 2))
    _start_all(clean)
    assert not clean.exited(0, 0)  # done before the stop
    assert clean.request_stop(2.0)
    clean.exited(1, 0)
    assert clean.finish(2.0) and [p.state for p in clean.procs] == [ReplicaState.SUCCEEDED, ReplicaState.STOPPED]


def test_the_status_file_round_trips_and_a_lost_supervisor_fails_what_still_ran():
    m = _machine(RunMode.MULTI_PROCESS, ("worker", 2))
    _start_all(m)
    m.exited(0, 0)
    back = JobMachine.from_json(m.plan, m.to_json())
    assert back.to_json() == m.to_json()
    assert back.observation("j", "local-j-1", 1, "h") == m.observation("j", "local-j-1", 1, "h")
    back.lost("SupervisorLost", "gone", 5.0)
    assert (back.state, back.reason, back.logs_done) == (JobState.FAILED, "SupervisorLost", True)
    assert [p.state for p in back.procs] == [ReplicaState.SUCCEEDED, ReplicaState.FAILED]
