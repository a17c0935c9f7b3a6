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
