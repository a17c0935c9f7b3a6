"""JobManager's domain: state machine, validation, filter (pure, no I/O)."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import pytest

from dlsched.errors import InvalidArgument
from job_manager.convert import job_to_bytes
from job_manager.domain import states
from job_manager.domain.filter import parse_filter
from job_manager.domain.model import (
    Job,
    JobSpec,
    JobState,
    Observation,
    ReplicaGroup,
    ReplicaStatus,
    Resources,
    RunMode,
)
from job_manager.domain.validation import job_id_from_name, validate_submit

NOW = datetime(2024, 1, 1, tzinfo=UTC)
S = JobState


def spec(mode: RunMode = RunMode.SINGLE_PROCESS, *groups: ReplicaGroup, **kw: object) -> JobSpec:
    gs = list(groups) or [ReplicaGroup(role="main", replicas=1, command=["true"])]
    return JobSpec(run_mode=int(mode), replica_groups=gs, **kw)  # type: ignore[arg-type]


def job(state: JobState = S.RUNNING, **kw: object) -> Job:
    base: dict[str, object] = dict(id="j", spec=spec(), state=state, cluster="clusters/local",
                                   backend_job_id="b1", attempt=1)
    base.update(kw)
    return Job(**base)  # type: ignore[arg-type]


def fields(exc: pytest.ExceptionInfo[InvalidArgument]) -> set[str]:
    return {v.field for v in exc.value.violations}


# ---------------------------------------------------------------- states

def test_terminal_states() -> None:
    assert {s for s in S if s.is_terminal()} == {S.SUCCEEDED, S.FAILED, S.STOPPED}


@pytest.mark.parametrize("final", [S.SUCCEEDED, S.FAILED, S.STOPPED])
def test_terminal_state_is_final(final: JobState) -> None:
    j = job(final)
    for late in S:
        assert states.apply_observation(j, Observation("j", state=late, attempt=1), NOW) is None


def test_running_then_succeeded_sets_times_and_exit_code() -> None:
    j = states.apply_observation(job(S.PENDING, backend_job_id=""),
                                 Observation("j", "b1", state=S.RUNNING, attempt=1), NOW)
    assert j is not None and j.state == S.RUNNING and j.start_time == NOW and j.backend_job_id == "b1"
    j2 = states.apply_observation(j, Observation("j", state=S.SUCCEEDED, exit_code=0, attempt=1), NOW)
    assert j2 is not None and j2.state == S.SUCCEEDED and j2.exit_code == 0 and j2.end_time == NOW
    assert states.apply_observation(j2, Observation("j", state=S.RUNNING, attempt=1), NOW) is None


def test_an_observation_stores_only_the_planned_replicas_and_bounded_texts() -> None:
    """A driver reads replicas from files the job writes (a Ray manifest, a Slurm exits file):
    30,000 made-up labels, or 4 KiB messages on every replica, made a record etcd refused
    (1.5 MiB at most), and with it every later update of the cluster's jobs."""
    j = job(spec=spec(RunMode.MASTER_WORKER, ReplicaGroup(role="master", replicas=1, command=["x"]),
                      ReplicaGroup(role="worker", replicas=2, command=["x"])))
    forged = [ReplicaStatus(role=f"r{i:05d}" + "x" * 50, index=0, state=3) for i in range(30_000)]
    real = [ReplicaStatus(role="worker", index=1, state=4, exit_code=3, message="m" * 10_000, host="h" * 5000),
            ReplicaStatus(role="worker", index=7, state=3), ReplicaStatus(role="master", index=-1, state=3),
            ReplicaStatus(role="master", index=0, state=2), ReplicaStatus(role="master", index=0, state=3)]
    new = states.apply_observation(j, Observation("j", state=S.FAILED, attempt=1, reason="R" * 1000,
                                                  message="M" * 100_000, replicas=forged + real), NOW)
    assert new is not None
    assert [(r.role, r.index, r.state) for r in new.replicas] == [("worker", 1, 4), ("master", 0, 3)]
    assert len(new.replicas[0].message) == len(new.replicas[0].host) == states.MAX_REPLICA_TEXT
    assert len(new.message) == states.MAX_MESSAGE and len(new.reason) == states.MAX_REASON
    # one status per process: replica r's process k is index r * processes_per_replica + k
    procs = job(spec=spec(RunMode.MULTI_PROCESS, ReplicaGroup(role="worker", replicas=2, command=["x"],
                                                               processes_per_replica=3)))
    each = [ReplicaStatus(role="worker", index=i, state=3) for i in range(6)]
    each[4] = ReplicaStatus(role="worker", index=4, state=4, exit_code=4)
    ended = states.apply_observation(procs, Observation("j", state=S.FAILED, attempt=1, replicas=[
        *each, ReplicaStatus(role="worker", index=6, state=3)]), NOW)
    assert ended is not None and [(r.index, r.exit_code) for r in ended.replicas] == [
        (0, None), (1, None), (2, None), (3, None), (4, 4), (5, None)]

    # the most replicas a spec may have, each with a long message: within the budget, failed first
    many = job(spec=spec(RunMode.MULTI_PROCESS, ReplicaGroup(role="worker", replicas=10_000, command=["x"])))
    reported = [ReplicaStatus(role="worker", index=i, state=3, host="node", message="z" * 4096)
                for i in range(10_000)]
    reported[9_999] = ReplicaStatus(role="worker", index=9_999, state=4, exit_code=1, message="why")
    big = states.apply_observation(many, Observation("j", state=S.RUNNING, attempt=1, replicas=reported), NOW)
    assert big is not None
    assert len(job_to_bytes(big)) < 1024 * 1024  # etcd takes up to 1.5 MiB a request, the spec included
    assert big.replicas[-1].message == "why"  # the failure is kept, whatever came before it
    assert {r.index for r in big.replicas} == set(range(10_000))  # every replica's state kept
    huge = job(spec=spec(RunMode.MULTI_PROCESS, ReplicaGroup(role="w" * 60, replicas=10_000, command=["x"]),
                         ReplicaGroup(role="v" * 60, replicas=10_000, command=["x"])))
    all_of = [ReplicaStatus(role=g, index=i, state=3, message="z" * 4096) for g in ("w" * 60, "v" * 60)
              for i in range(10_000)]
    cut = states.apply_observation(huge, Observation("j", state=S.RUNNING, attempt=1, replicas=all_of), NOW)
    assert cut is not None and 0 < len(cut.replicas) < 20_000  # past the budget: some left out
    assert len(job_to_bytes(cut)) < 1024 * 1024


def test_unchanged_observation_writes_nothing() -> None:
    j = job(S.RUNNING, start_time=NOW)
    assert states.apply_observation(j, Observation("j", "b1", state=S.RUNNING, attempt=1), NOW) is None


def test_stopping_transitions() -> None:
    j = job(S.STOPPING)
    late = states.apply_observation(j, Observation("j", state=S.RUNNING), NOW)
    assert late is None or late.state == S.STOPPING
    for end in (S.STOPPED, S.SUCCEEDED, S.FAILED):
        new = states.apply_observation(j, Observation("j", state=end, attempt=1), NOW)
        assert new is not None and new.state == end and new.end_time is not None


def test_stale_attempt_is_ignored() -> None:
    j = job(S.RUNNING, attempt=2)
    assert states.apply_observation(j, Observation("j", state=S.FAILED, attempt=1), NOW) is None


def test_backend_restart_shows_on_the_same_attempt() -> None:
    j = job(S.RUNNING, start_time=NOW)
    requeued = states.apply_observation(j, Observation("j", "b1", state=S.QUEUED, attempt=1, backend_restarts=1), NOW)
    assert requeued is not None and requeued.backend_restarts == 1 and requeued.attempt == 1
    assert requeued.state == S.QUEUED
    running = states.apply_observation(requeued, Observation("j", "b1", state=S.RUNNING, attempt=1, backend_restarts=1),
                                       NOW)
    assert running is not None and running.backend_restarts == 1
    assert states.plan_retry(running, Observation("j", state=S.FAILED, attempt=1), NOW).backend_restarts == 0


def test_retry_plan() -> None:
    j = job(S.RUNNING, spec=spec(max_retries=1))
    obs = Observation("j", state=S.FAILED, exit_code=3, attempt=1)
    assert states.should_retry(j, obs)
    r = states.plan_retry(j, obs, NOW)
    assert r.state == S.PENDING and r.attempt == 2 and not r.launched
    r.backend_job_id = "b2"
    r.state = S.RUNNING
    assert not states.should_retry(r, Observation("j", state=S.FAILED, attempt=2))


def test_stop_request() -> None:
    assert states.request_stop(job(S.SUCCEEDED), NOW) is None
    pending = states.request_stop(job(S.PENDING, backend_job_id=""), NOW)
    assert pending is not None and pending.state == S.STOPPED
    running = states.request_stop(job(S.RUNNING), NOW)
    assert running is not None and running.state == S.STOPPING


def test_lost_only_when_launched() -> None:
    assert states.mark_lost(job(S.PENDING, backend_job_id=""), NOW) is None
    lost = states.mark_lost(job(S.RUNNING), NOW)
    assert lost is not None and lost.state == S.FAILED and lost.reason == "LostByBackend"
    # a job being stopped that the backend lost ended as asked: STOPPED, not FAILED
    stopping = states.mark_lost(job(S.STOPPING), NOW)
    assert stopping is not None and stopping.state == S.STOPPED and stopping.reason == "LostByBackend"


def test_driver_unreachable_says_so_and_keeps_the_state() -> None:
    marked = states.mark_driver_unreachable(job(S.RUNNING, reason="", message="running"), NOW, "UNAVAILABLE: x")
    assert marked is not None and marked.state == S.RUNNING and marked.reason == "DriverUnreachable"
    assert marked.message.startswith(f"driver unreachable since {NOW.isoformat(timespec='seconds')}")
    assert states.mark_driver_unreachable(marked, NOW, "again") is None  # once
    for untouched in (job(S.SUCCEEDED), job(S.STOPPING), job(S.PENDING, backend_job_id="")):
        assert states.mark_driver_unreachable(untouched, NOW, "") is None
    back = states.apply_observation(marked, Observation(job_id="j", found=True, state=S.RUNNING, reason="",
                                                        message="running", attempt=1), NOW)
    assert back is not None and back.reason == "" and back.state == S.RUNNING  # the driver's word again


def test_launch_recorded_unless_stopped_meanwhile() -> None:
    j = states.mark_launched(job(S.PENDING, backend_job_id=""), "b9", None, NOW)
    assert j is not None and j.backend_job_id == "b9"
    assert states.mark_launched(job(S.STOPPED, backend_job_id=""), "b9", None, NOW) is None


# ---------------------------------------------------------------- validation

def test_valid_specs_pass() -> None:
    validate_submit("", spec(), "", 10)
    validate_submit("a-1", spec(RunMode.MULTI_PROCESS,
                                ReplicaGroup(role="worker", replicas=2, processes_per_replica=4,
                                             command=["python"], env={"A_B": "1"})), "r-1", 10)
    validate_submit("ps", spec(RunMode.PS_WORKER,
                               ReplicaGroup(role="ps", replicas=1, command=["x"]),
                               ReplicaGroup(role="worker", replicas=2, command=["x"]),
                               ReplicaGroup(role="chief", replicas=1, command=["x"])), "", 10)
    validate_submit("m", spec(RunMode.MPI, ReplicaGroup(role="launcher", replicas=1, command=["x"]),
                              ReplicaGroup(role="worker", replicas=2, command=["x"])), "", 10)


def test_all_violations_collected() -> None:
    bad = JobSpec(run_mode=0, replica_groups=[
        ReplicaGroup(role="main", replicas=0, processes_per_replica=-1, command=[],
                     env={"DLSCHED_X": "1", "1bad": "x"}, resources=Resources(cpu=float("nan")))],
        max_retries=11)
    with pytest.raises(InvalidArgument) as ei:
        validate_submit("Bad_ID", bad, "x" * 129, 10)
    f = fields(ei)
    assert {"job_id", "request_id", "spec.run_mode", "spec.replica_groups[0].replicas",
            "spec.replica_groups[0].processes_per_replica", "spec.replica_groups[0].command",
            "spec.replica_groups[0].resources.cpu", "spec.max_retries"} <= f
    assert sum(1 for x in f if x.startswith("spec.replica_groups[0].env")) == 2


@pytest.mark.parametrize("mode,groups,field", [
    (RunMode.MULTI_PROCESS, [("chief", 1)], "spec.replica_groups[0].role"),
    (RunMode.PS_WORKER, [("worker", 2)], "spec.replica_groups"),
    (RunMode.MASTER_WORKER, [("master", 2)], "spec.replica_groups[0].replicas"),
    (RunMode.MPI, [("launcher", 1), ("worker", 1), ("worker", 1)], "spec.replica_groups[2].role"),
    (RunMode.SINGLE_PROCESS, [("main", 2)], "spec.replica_groups[0].replicas"),
    (RunMode.SINGLE_PROCESS, [("a", 1), ("b", 1)], "spec.replica_groups"),
])
def test_roles_for_mode(mode: RunMode, groups: list[tuple[str, int]], field: str) -> None:
    s = spec(mode, *[ReplicaGroup(role=r, replicas=n, command=["x"]) for r, n in groups])
    with pytest.raises(InvalidArgument) as ei:
        validate_submit("", s, "", 10)
    assert field in fields(ei)


def test_oversized_spec() -> None:
    with pytest.raises(InvalidArgument) as ei:
        validate_submit("", spec(), "", 300 * 1024)
    assert fields(ei) == {"spec"}
    big = spec(RunMode.SINGLE_PROCESS, ReplicaGroup(role="m", replicas=1, command=["x"],
                                                   args=["a"] * 1001))
    with pytest.raises(InvalidArgument) as ei:
        validate_submit("", big, "", 10)
    assert fields(ei) == {"spec.replica_groups[0].args"}  # bounds first, and alone


def test_labels() -> None:
    with pytest.raises(InvalidArgument) as ei:
        validate_submit("", spec(labels={"ok": "x" * 64}), "", 10)
    assert any(f.startswith("spec.labels") for f in fields(ei))
    # Keys as Kubernetes takes them (the driver copies them onto pods): a DNS-subdomain
    # prefix of dot-separated DNS labels (up to 63 each, 253 in all), then a name up to 63.
    for good in ("team", "example.com/team", "a-b.c/x_y.z", f"{'p' * 63}.{'q' * 63}/{'n' * 63}"):
        validate_submit("", spec(labels={good: "v"}), "", 10)
    dns253 = ".".join(["a" * 63] * 3 + ["b" * 61])
    validate_submit("", spec(labels={f"{dns253}/x": "v"}), "", 10)
    for bad in ("a..b/x", "-a/x", "a-/x", "Upper.com/x", "a_b/x", f"{'p' * 64}/x",
                f"{dns253}c/x", "x/" + "n" * 64, "/x", "a/", ".a/x"):
        with pytest.raises(InvalidArgument) as ei:
            validate_submit("", spec(labels={bad: "v"}), "", 10)
        assert all(f.startswith("spec.labels[") for f in fields(ei)), bad


def test_gpu_type_is_a_value_every_backend_takes() -> None:
    """gpu_type becomes a Kubernetes node-selector value and a Slurm GRES type, and the
    matcher quotes it: bounded and plain (a 5,000-character one passed and its refusal
    came back RESOURCE_EXHAUSTED, naming no field)."""
    def with_type(t: str) -> JobSpec:
        return spec(RunMode.SINGLE_PROCESS, ReplicaGroup(
            role="main", replicas=1, command=["x"], resources=Resources(gpus=1, gpu_type=t)))
    for good in ("", "a100", "NVIDIA-A100-SXM4-80GB", "tesla_v100.pcie", "x" * 63):
        validate_submit("", with_type(good), "", 10)
    for bad in ("x" * 64, "x" * 5000, "a100\n", "-a100", "a100 ", "a/b", "$(id)", "a\x00"):
        with pytest.raises(InvalidArgument) as ei:
            validate_submit("", with_type(bad), "", 10)
        assert fields(ei) == {"spec.replica_groups[0].resources.gpu_type"}, bad


@pytest.mark.parametrize("name", ["job/x", "jobs/", "jobs/X", "x", "jobs/a/b", ""])
def test_malformed_names(name: str) -> None:
    with pytest.raises(InvalidArgument) as ei:
        job_id_from_name(name)
    assert fields(ei) == {"name"}
    assert job_id_from_name("jobs/a-1") == "a-1"


# ---------------------------------------------------------------- filter

def test_filter() -> None:
    j = job(S.RUNNING, labels={"team": "ml"},
            spec=spec(RunMode.MULTI_PROCESS, ReplicaGroup(role="worker", replicas=1, command=["x"])))
    assert parse_filter("").matches(j)
    assert parse_filter("state=RUNNING AND labels.team=ml AND cluster=clusters/local "
                        "AND run_mode=MULTI_PROCESS").matches(j)
    assert parse_filter("state=JOB_STATE_RUNNING AND cluster=local").matches(j)
    assert not parse_filter("state!=RUNNING").matches(j)
    assert parse_filter("labels.other!=x").matches(j)
    assert not parse_filter('labels.team="dl"').matches(j)
    # Single quotes as ListClusters' filter takes them ('ml' was the literal "'ml'", matching nothing).
    assert parse_filter("labels.team='ml' AND state='RUNNING'").matches(j)


@pytest.mark.parametrize("text", ["state=BOGUS", "color=red", "state", "state=RUNNING OR x=y",
                                  "run_mode=UNSPECIFIED",
                                  # NUL: PostgreSQL's history answered UNAVAILABLE ("retry") for it
                                  "owner=a\x00b", "labels.group=g\x001",
                                  # values no job can hold (answered with nothing, as if well formed)
                                  "project=;x", "project=Team", "cluster=;x", "cluster=", "labels.a;b=1",
                                  "labels." + "k" * 300 + "=1", "labels.team=a b", "labels.team=-x"])
def test_bad_filter(text: str) -> None:
    with pytest.raises(InvalidArgument) as ei:
        parse_filter(text)
    assert ei.value.violations[0].field == "filter"


def test_a_stopped_job_has_no_exit_code_whatever_its_backend_says() -> None:
    """Slurm reports a stopped batch script's 143, the local driver nothing: a STOPPED job has
    no exit code on any backend (job.proto), a FAILED one its failing replica's."""
    j = job(S.STOPPING)
    stopped = states.apply_observation(j, Observation("j", state=S.STOPPED, attempt=1, exit_code=143), NOW)
    assert stopped is not None and stopped.state == S.STOPPED and stopped.exit_code is None
    failed = states.apply_observation(j, Observation("j", state=S.FAILED, attempt=1, exit_code=3), NOW)
    assert failed is not None and failed.exit_code == 3


def test_a_job_its_time_limit_ended_has_no_exit_code_whatever_its_backend_says() -> None:
    """Slurm reports the TIMEOUT batch script's 143, local and Ray nothing: the time limit stopped
    the job, no replica failed of itself, so it has no exit code on any backend (job.proto)."""
    j = job(S.RUNNING)
    timed = states.apply_observation(j, Observation(
        "j", state=S.FAILED, attempt=1, exit_code=143, reason=states.TIME_LIMIT_EXCEEDED), NOW)
    assert timed is not None and timed.state == S.FAILED and timed.exit_code is None
    retried = dataclasses.replace(j, spec=dataclasses.replace(j.spec, max_retries=1))
    again = states.plan_retry(retried, Observation(
        "j", state=S.FAILED, attempt=1, exit_code=143, reason=states.TIME_LIMIT_EXCEEDED), NOW)
    assert again.state == S.PENDING and again.exit_code is None  # a retry of it shows none either
