"""JobManager and every driver judge a spec alike (``dlsched.spec_rules``).

A generated corpus of specs, valid and hostile (trailing newlines, NUL bytes,
the reserved ``DLSCHED_`` prefix in any case, replica and process counts at
and past their bounds, non-finite resources, out-of-range times and retries,
every run mode with wrong roles), goes through JobManager's SubmitJob checks
and through a driver's LaunchJob checks (``drivers.common.convert`` and the
planner's run-mode rules). A spec one accepts and the other refuses is the
defect this pins: JobManager stored it and the launch failed LaunchRejected.
"""

from __future__ import annotations

import random

from google.protobuf import duration_pb2

from dlsched.errors import InvalidArgument
from dlsched.v1 import job_pb2
from drivers.common import convert as driver_convert
from drivers.common import planner
from job_manager import convert as jm_convert
from job_manager.domain.validation import validate_submit

ROLES = ["main", "worker", "master", "ps", "chief", "evaluator", "launcher", "main\n", "Worker", "", "a" * 64,
         "x-1", "-x"]
ENV_NAMES = ["OK", "_ok", "dlsched_x", "DLSCHED_Y", "Dlsched_z", "A\n", "1BAD", "", "WITH SPACE"]
ENV_VALUES = ["v", "", "with\x00nul", "line\nbreak"]
COMMANDS = [["python"], [], [""], ["x\x00y"], ["/bin/sh", "-c", "echo hi"], ["a"] * 3]
COUNTS = [-1, 0, 1, 2, 3, 10_000, 10_001]
PROCESSES = [-1, 0, 1, 2, 1024, 1025]
CPUS = [0.0, 0.5, 4.0, -1.0, float("nan"), float("inf"), 1e6]
TIME_LIMITS = [None, 0, -5, 60, 10**9]
LABELS = [{}, {"team": "ml"}, {"team\n": "ml"}, {"team": "ml\n"}, {"a/b": "c"}, {"": "x"}]


TEMPLATES = {
    job_pb2.RUN_MODE_SINGLE_PROCESS: [("main", 1, 0)],
    job_pb2.RUN_MODE_MULTI_PROCESS: [("worker", 2, 2)],
    job_pb2.RUN_MODE_PS_WORKER: [("ps", 1, 0), ("worker", 2, 1), ("chief", 1, 0)],
    job_pb2.RUN_MODE_MASTER_WORKER: [("master", 1, 2), ("worker", 2, 2)],
    job_pb2.RUN_MODE_MPI: [("launcher", 1, 1), ("worker", 2, 4)],
}


def _mutate(rnd: random.Random, spec: job_pb2.JobSpec) -> None:
    g = rnd.choice(spec.replica_groups) if spec.replica_groups else None
    what = rnd.randrange(14)
    if what == 0:
        spec.run_mode = rnd.choice([0, 1, 2, 3, 4, 5, 6])
    elif what == 1 and g is not None:
        g.role = rnd.choice(ROLES)
    elif what == 2 and g is not None:
        g.replicas = rnd.choice(COUNTS)
    elif what == 3 and g is not None:
        g.processes_per_replica = rnd.choice(PROCESSES)
    elif what == 4 and g is not None:
        del g.command[:]
        g.command.extend(rnd.choice(COMMANDS))
    elif what == 5 and g is not None:
        g.env[rnd.choice(ENV_NAMES)] = rnd.choice(ENV_VALUES)
    elif what == 6 and g is not None:
        g.working_dir = rnd.choice(["/tmp", "bad\x00dir"])
    elif what == 7 and g is not None:
        g.resources.cpu = rnd.choice(CPUS)
    elif what == 8 and g is not None:
        g.resources.memory_bytes = rnd.choice([0, 1 << 30, -1])
        g.resources.gpus = rnd.choice([0, 1, -1, 10_001])
    elif what == 9:
        spec.max_retries = rnd.choice([0, 1, 10, 11, -1])
    elif what == 10:
        limit = rnd.choice(TIME_LIMITS)
        if limit is not None:
            spec.time_limit.CopyFrom(duration_pb2.Duration(seconds=limit))
    elif what == 11:
        for k, v in rnd.choice(LABELS).items():
            spec.labels[k] = v
    elif what == 12:
        spec.replica_groups.add(role=rnd.choice(ROLES), replicas=1, command=["x"])
    elif what == 13 and len(spec.replica_groups) > 0:
        del spec.replica_groups[rnd.randrange(len(spec.replica_groups))]


def _spec(rnd: random.Random) -> job_pb2.JobSpec:
    mode = rnd.choice(list(TEMPLATES))
    spec = job_pb2.JobSpec(run_mode=mode, replica_groups=[
        job_pb2.ReplicaGroup(role=r, replicas=n, processes_per_replica=p, command=["python", "train.py"])
        for r, n, p in TEMPLATES[mode]])
    for _ in range(rnd.choice([0, 1, 1, 2, 3])):
        _mutate(rnd, spec)
    return spec


def _job_manager_accepts(pb: job_pb2.JobSpec) -> bool:
    try:
        validate_submit("", jm_convert.spec_from_proto(pb), "", pb.ByteSize())
    except InvalidArgument:
        return False
    return True


def _driver_accepts(pb: job_pb2.JobSpec) -> bool:
    try:
        planner.check_run_mode(driver_convert.job_spec(pb, True))
    except InvalidArgument:
        return False
    return True


def test_job_manager_and_drivers_agree_on_every_generated_spec() -> None:
    rnd = random.Random(20261203)
    accepted = disagreements = 0
    examples = []
    for _ in range(5000):
        pb = _spec(rnd)
        jm, drv = _job_manager_accepts(pb), _driver_accepts(pb)
        accepted += jm
        if jm != drv:
            disagreements += 1
            if len(examples) < 3:
                examples.append((jm, drv, pb))
    assert disagreements == 0, examples
    assert accepted > 100  # the corpus reaches valid specs too, not only refusals


def test_over_the_bounds_is_refused_before_anything_walks_the_spec() -> None:
    g = job_pb2.ReplicaGroup(role="worker", replicas=10_000, processes_per_replica=1024, command=["x"])
    pb = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_MULTI_PROCESS, replica_groups=[g])
    for accepts in (_job_manager_accepts, _driver_accepts):
        assert not accepts(pb)  # 10,240,000 processes: refused without planning one


def _refusal(pb: job_pb2.JobSpec) -> list[str]:
    """The fields JobManager's SubmitJob checks name for ``pb`` ([] when it accepts it)."""
    try:
        validate_submit("", jm_convert.spec_from_proto(pb), "", pb.ByteSize())
    except InvalidArgument as e:
        return [v.field for v in e.violations]
    return []


def _one(*, queue: str = "", env: dict[str, str] | None = None, args: list[str] | None = None,
         mode: int = job_pb2.RUN_MODE_SINGLE_PROCESS) -> job_pb2.JobSpec:
    if mode == job_pb2.RUN_MODE_MPI:
        groups = [job_pb2.ReplicaGroup(role="launcher", replicas=1, command=["./hello"], args=args or [], env=env),
                  job_pb2.ReplicaGroup(role="worker", replicas=1, processes_per_replica=2, command=["./hello"])]
    else:
        groups = [job_pb2.ReplicaGroup(role="main", replicas=1, command=["./hello"], args=args or [], env=env)]
    return job_pb2.JobSpec(run_mode=mode, replica_groups=groups, queue=queue)


def test_what_a_driver_would_refuse_for_its_shape_jobmanager_refuses_first() -> None:
    """A hostile-spec corpus found specs SubmitJob stored and every launch then refused
    (FAILED LaunchRejected) or ran wrong: a queue Slurm takes as options or script lines, an MPI
    launcher command line too long for the environment string the ranks get it in, and the
    names the launch scripts' shells own (OPTIND=x failed the job, IFS never reached it, UID is
    read-only in bash)."""
    from drivers.slurm import render as slurm_render

    for queue in ("a b", "--wrap=touch /tmp/x", "debug\n#SBATCH --uid=0", "x" * 65, "a,,b"):
        assert _refusal(_one(queue=queue)) == ["spec.queue"], queue
        assert not slurm_render.PARTITION_RE.match(queue)
    for queue in ("debug", "gpu.a100_x-1", "debug,gpu"):
        assert _refusal(_one(queue=queue)) == [], queue
        assert slurm_render.PARTITION_RE.match(queue)
    for name in ("IFS", "OPTIND", "UID", "EUID", "PPID", "SHELLOPTS", "BASH_ENV", "POSIXLY_CORRECT", "SHLVL", "CDPATH"):
        assert _refusal(_one(env={name: "x"})) == [f"spec.replica_groups[0].env[{name!r}]"], name
    assert _refusal(_one(env={"ifs": "x", "OPTIONS": "y", "PATH": "/bin"})) == []
    long = ["'" * 40_000, "b" * 40_000]  # each quote becomes 5 characters once shell-quoted
    assert _refusal(_one(args=long, mode=job_pb2.RUN_MODE_MPI)) == ["spec.replica_groups[0].args"]
    assert not _driver_accepts(_one(args=long, mode=job_pb2.RUN_MODE_MPI))
    assert _refusal(_one(args=long)) == []  # a long command line is only MPI's problem
    assert _refusal(_one(args=["b" * 60_000], mode=job_pb2.RUN_MODE_MPI)) == []
    # names only an interactive shell reads reach the job: allowed
    assert _refusal(_one(env={"ENV": "production", "PS1": "$ ", "TMOUT": "5", "OSTYPE": "x"})) == []
    # a driver's own check takes a spec stored before these rules (it still launches)
    assert _driver_accepts(_one(env={"OPTIND": "x"}, queue="a b"))


def test_a_time_limit_past_366_days_by_a_nanosecond_is_refused() -> None:
    """366 days and 1 ns was a float equal to 366 days: stored as 366 days, past the bound."""
    from dlsched import spec_rules

    assert spec_rules.time_limit_over(366 * 86400, 1) and not spec_rules.time_limit_over(366 * 86400, 0)
    pb = _one()
    pb.time_limit.CopyFrom(duration_pb2.Duration(seconds=366 * 86400, nanos=1))
    try:
        driver_convert.job_spec(pb, True)
    except InvalidArgument as e:
        assert [v.field for v in e.violations] == ["spec.time_limit"]
    else:
        raise AssertionError("a driver took a time limit past 366 days")
