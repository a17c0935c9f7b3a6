"""The run-mode planner (``drivers.common.planner``): a pure function, tested per mode
with placements of several shapes (one host, many hosts, names not yet resolved),
plus a golden record of the environment it produces."""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import subprocess
import sys

import pytest

from dlsched.errors import InvalidArgument
from drivers.common import planner
from drivers.common.base import JobSpec, ReplicaGroup, Resources, RunMode
from drivers.common.planner import Placement

GOLDEN = pathlib.Path(__file__).parent / "golden" / "planner"


def grp(role: str, replicas: int = 1, ppr: int = 0, cmd: tuple[str, ...] = ("train",), **kw: object) -> ReplicaGroup:
    return ReplicaGroup(role=role, replicas=replicas, processes_per_replica=ppr, command=cmd, **kw)  # type: ignore[arg-type]


def spec(mode: RunMode, *groups: ReplicaGroup) -> JobSpec:
    return JobSpec(run_mode=mode, replica_groups=groups)


def one_host(s: JobSpec, host: str = "127.0.0.1", ports: dict[tuple[str, int], int] | None = None) -> list[Placement]:
    ports = ports or {}
    return [Placement(g.role, r, host, 0, port=ports.get((g.role, r), 0))
            for g in s.replica_groups for r in range(g.replicas)]


def many_hosts(s: JobSpec, fmt: str = "{role}-{index}.job.svc") -> list[Placement]:
    """One node per replica, named by a name that resolves later (headless service)."""
    out, node = [], 0
    for g in planner.groups_in_order(s):
        for r in range(g[1].replicas):
            out.append(Placement(g[1].role, r, fmt.format(role=g[1].role, index=r), node))
            node += 1
    return out


def envs(plan: planner.JobPlan) -> list[dict[str, str]]:
    return [dict(p.env) for p in plan.processes]


COMMON = {"DLSCHED_JOB_ID", "DLSCHED_JOB_NAME", "DLSCHED_ROLE", "DLSCHED_REPLICA_INDEX", "DLSCHED_NUM_REPLICAS"}
TORCH = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK"}


# --------------------------------------------------------------------------- every mode


@pytest.mark.parametrize("s", [
    spec(RunMode.SINGLE_PROCESS, grp("main")),
    spec(RunMode.MULTI_PROCESS, grp("worker", 2, 2)),
    spec(RunMode.MASTER_WORKER, grp("worker", 2), grp("master")),
    spec(RunMode.PS_WORKER, grp("ps", 2), grp("worker", 3)),
    spec(RunMode.MPI, grp("launcher"), grp("worker", 2, 2)),
], ids=lambda s: s.run_mode.name)
def test_every_process_gets_the_common_variables(s):
    plan = planner.plan_job("j1", s, one_host(s))
    for p in plan.processes:
        assert COMMON <= set(p.env)
        assert p.env["DLSCHED_JOB_ID"] == "j1" and p.env["DLSCHED_JOB_NAME"] == "jobs/j1"
        assert p.env["DLSCHED_ROLE"] == p.role
        assert p.env["DLSCHED_REPLICA_INDEX"] == str(p.replica_index)
        g = next(g for g in s.replica_groups if g.role == p.role)
        assert p.env["DLSCHED_NUM_REPLICAS"] == str(g.replicas)
        assert ("CUDA_VISIBLE_DEVICES" in p.env) is False
    assert len(plan.processes) == sum(g.replicas * g.processes for g in s.replica_groups)
    assert [p.rank for p in plan.processes] == list(range(len(plan.processes)))


def test_user_env_comes_last_and_planner_is_pure():
    s = spec(RunMode.MULTI_PROCESS, grp("worker", 2, env={"MASTER_PORT": "1", "FOO": "bar"}))
    a = planner.plan_job("j", s, one_host(s), master_port=4000)
    b = planner.plan_job("j", s, one_host(s), master_port=4000)
    assert a == b
    assert all(p.env["MASTER_PORT"] == "1" and p.env["FOO"] == "bar" for p in a.processes)


# --------------------------------------------------------------------------- torch modes


def test_single_process_has_no_rendezvous_variables():
    s = spec(RunMode.SINGLE_PROCESS, grp("main", cmd=("python", "x.py"), args=("--a",)))
    plan = planner.plan_job("j", s, one_host(s))
    (p,) = plan.processes
    assert not TORCH & set(p.env) and "TF_CONFIG" not in p.env
    assert p.argv == ("python", "x.py", "--a")
    assert plan.success.decisive_roles == {"main"} and not plan.success.stopped_after_success


@pytest.mark.parametrize("placement", ["one_host", "many_hosts"])
def test_master_worker_master_is_rank_zero_and_ranks_are_dense(placement):
    s = spec(RunMode.MASTER_WORKER, grp("worker", 2, 2), grp("master", 1, 2))  # master listed last
    places = one_host(s) if placement == "one_host" else many_hosts(s)
    plan = planner.plan_job("j", s, places, master_port=29999)
    e = envs(plan)
    assert [x["RANK"] for x in e] == [str(i) for i in range(6)]
    assert [x["DLSCHED_ROLE"] for x in e] == ["master"] * 2 + ["worker"] * 4
    assert {x["WORLD_SIZE"] for x in e} == {"6"}
    assert {x["MASTER_PORT"] for x in e} == {"29999"}
    master_host = plan.processes[0].host
    assert {x["MASTER_ADDR"] for x in e} == {master_host}
    if placement == "one_host":
        assert master_host == "127.0.0.1"
        assert [x["LOCAL_RANK"] for x in e] == [str(i) for i in range(6)]
        assert {x["LOCAL_WORLD_SIZE"] for x in e} == {"6"} and {x["NODE_RANK"] for x in e} == {"0"}
    else:
        assert master_host == "master-0.job.svc"  # a name that resolves later, passed verbatim
        assert [x["NODE_RANK"] for x in e] == ["0", "0", "1", "1", "2", "2"]
        assert [x["LOCAL_RANK"] for x in e] == ["0", "1"] * 3
        assert {x["LOCAL_WORLD_SIZE"] for x in e} == {"2"}
    assert [p.slot_index for p in plan.processes] == [0, 1, 0, 1, 2, 3]
    assert plan.success.decisive_roles == {"master", "worker"}


def test_master_worker_without_workers_is_fine():
    s = spec(RunMode.MASTER_WORKER, grp("master"))
    (p,) = planner.plan_job("j", s, one_host(s)).processes
    assert p.env["RANK"] == "0" and p.env["WORLD_SIZE"] == "1"


def test_multi_process_across_nodes():
    s = spec(RunMode.MULTI_PROCESS, grp("worker", 2, 3))
    places = [Placement("worker", 0, "10.0.0.1", 0), Placement("worker", 1, "10.0.0.2", 1)]
    e = envs(planner.plan_job("j", s, places, master_port=1234))
    assert [(x["RANK"], x["LOCAL_RANK"], x["NODE_RANK"]) for x in e] == [
        ("0", "0", "0"), ("1", "1", "0"), ("2", "2", "0"), ("3", "0", "1"), ("4", "1", "1"), ("5", "2", "1")]
    assert {x["MASTER_ADDR"] for x in e} == {"10.0.0.1"}


# --------------------------------------------------------------------------- PS-Worker


def test_ps_worker_tf_config_is_one_cluster_and_each_task_its_own_index():
    s = spec(RunMode.PS_WORKER, grp("worker", 3), grp("ps", 2))
    ports = {("ps", 0): 5000, ("ps", 1): 5001, ("worker", 0): 6000, ("worker", 1): 6001, ("worker", 2): 6002}
    plan = planner.plan_job("j", s, one_host(s, ports=ports))
    configs = [json.loads(p.env["TF_CONFIG"]) for p in plan.processes]
    clusters = {json.dumps(c["cluster"], sort_keys=True) for c in configs}
    assert len(clusters) == 1
    assert configs[0]["cluster"] == {"ps": ["127.0.0.1:5000", "127.0.0.1:5001"],
                                     "worker": ["127.0.0.1:6000", "127.0.0.1:6001", "127.0.0.1:6002"]}
    assert [(c["task"]["type"], c["task"]["index"]) for c in configs] == [
        ("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1), ("worker", 2)]
    for p, c in zip(plan.processes, configs, strict=True):
        assert c["cluster"][p.role][p.replica_index] == f"127.0.0.1:{ports[(p.role, p.replica_index)]}"
        assert not TORCH & set(p.env)
    assert plan.success.decisive_roles == {"worker"}
    assert plan.success.stopped_after_success == {"ps"}


def test_ps_worker_with_chief_and_evaluator_on_late_names():
    s = spec(RunMode.PS_WORKER, grp("ps"), grp("worker", 2), grp("chief"), grp("evaluator"))
    plan = planner.plan_job("j", s, many_hosts(s))
    configs = {(p.role, p.replica_index): json.loads(p.env["TF_CONFIG"]) for p in plan.processes}
    cluster = configs[("chief", 0)]["cluster"]
    assert cluster == {"chief": ["chief-0.job.svc:2222"], "ps": ["ps-0.job.svc:2222"],
                       "worker": ["worker-0.job.svc:2222", "worker-1.job.svc:2222"]}  # no evaluator
    assert all(c["cluster"] == cluster for c in configs.values())
    assert configs[("evaluator", 0)]["task"] == {"type": "evaluator", "index": 0}
    assert plan.success.decisive_roles == {"chief"}
    assert plan.success.stopped_after_success == {"ps", "worker", "evaluator"}


# --------------------------------------------------------------------------- MPI


def test_mpi_launcher_runs_mpirun_over_the_hostfile():
    s = spec(RunMode.MPI, grp("worker", 2, 4, cmd=("sleep",)),
             grp("launcher", cmd=("python", "allreduce.py"), env={"OMP_NUM_THREADS": "2", "A_FIRST": "x"}))
    places = [Placement("launcher", 0, "launcher-0", gpus=("1",)), Placement("worker", 0, "node-a", 1),
              Placement("worker", 1, "node-b", 2)]
    plan = planner.plan_job("j", s, places, hostfile_path="/tmp/j/hostfile", mpirun="/usr/bin/mpirun",
                            mpirun_args=("--oversubscribe",))
    launcher, *workers = plan.processes
    assert launcher.role == "launcher" and launcher.rank == 0 and not launcher.placeholder
    exported = ["DLSCHED_JOB_ID", "DLSCHED_JOB_NAME", "DLSCHED_ROLE", "DLSCHED_REPLICA_INDEX", "DLSCHED_NUM_REPLICAS",
                "DLSCHED_MPI_HOSTFILE", "DLSCHED_MPI_ARGV", "A_FIRST", "OMP_NUM_THREADS"]  # not the launcher's GPUs
    assert launcher.argv == ("/usr/bin/mpirun", "-np", "8", "--hostfile", "/tmp/j/hostfile", "--oversubscribe",
                             *(t for k in exported for t in ("-x", k)), "/bin/sh", "-c", planner.MPI_RANK_SCRIPT)
    assert launcher.env["DLSCHED_MPI_ARGV"] == "python allreduce.py"
    assert plan.files == {"hostfile": "node-a slots=4\nnode-b slots=4\n"}
    assert len(workers) == 8 and all(w.placeholder and w.role == "worker" for w in workers)
    assert all(p.env["DLSCHED_MPI_HOSTFILE"] == "/tmp/j/hostfile" for p in plan.processes)
    assert not any("DLSCHED_MPI_ARGV" in w.env for w in workers)
    assert plan.success.decisive_roles == {"launcher"} and plan.success.stopped_after_success == {"worker"}


HOSTILE_ARGV = ("prog", ":", "touch", "/tmp/canary", "-np", "1", "--version", "--host", "x", "-x", "PATH", "--",
                "a b", "it's", 'say "hi"', "$HOME", "`id`", "$(id)", "*", "x\ny", "é", "", "-", ";", "|", "&")


def test_mpi_user_argv_never_reaches_mpirun():
    s = spec(RunMode.MPI, grp("launcher", cmd=HOSTILE_ARGV[:2], args=HOSTILE_ARGV[2:]), grp("worker", 2, 2))
    launcher = planner.plan_job("j", s, one_host(s)).processes[0]
    fixed = launcher.argv[launcher.argv.index("/bin/sh"):]
    assert fixed == planner.MPI_RANK_PROGRAM  # the last tokens mpirun sees are ours
    assert launcher.argv[:5] == ("mpirun", "-np", "4", "--hostfile", "hostfile")
    exports = launcher.argv[5:-len(planner.MPI_RANK_PROGRAM)]  # nothing between but -x NAME pairs
    assert set(exports[0::2]) == {"-x"} and set(exports[1::2]) <= set(launcher.env)
    assert shlex.split(launcher.env["DLSCHED_MPI_ARGV"]) == list(HOSTILE_ARGV)


@pytest.mark.parametrize("argv", [HOSTILE_ARGV, ("--version",), ("-np", "1"), ("-c", "echo hi")])
def test_mpi_rank_script_execs_the_argv_verbatim(tmp_path, argv):
    """The rank program, run by the real /bin/sh: the argv arrives byte for byte (or fails, never a silent 0)."""
    probe = (sys.executable, "-c", "import json, sys; print(json.dumps(sys.argv[1:]))")
    for full in ((*probe, *argv), argv):
        r = subprocess.run(planner.MPI_RANK_PROGRAM, env={"PATH": os.environ.get("PATH", os.defpath),
                                                          planner.MPI_ARGV_ENV: shlex.join(full)},
                           capture_output=True, text=True, timeout=30)
        if full[0] == sys.executable:
            assert r.returncode == 0, r.stderr
            assert json.loads(r.stdout) == list(argv)
        else:  # no such program: it fails, like a non-MPI job's would
            assert r.returncode == 127, (r.returncode, r.stdout, r.stderr)
    r = subprocess.run(planner.MPI_RANK_PROGRAM, env={}, capture_output=True, text=True, timeout=30)
    assert r.returncode == 127 and "DLSCHED_MPI_ARGV" in r.stderr  # not exported: never a silent success


def test_mpi_argv_too_long_for_the_environment_names_the_field():
    s = spec(RunMode.MPI, grp("worker"), grp("launcher", cmd=("prog",), args=("x" * 60_000, "'" * 30_000)))
    with pytest.raises(InvalidArgument) as ei:
        planner.plan_job("j", s, one_host(s))
    assert [v.field for v in ei.value.violations] == ["spec.replica_groups[1].args"]


def test_mpi_on_one_host_merges_slots():
    s = spec(RunMode.MPI, grp("launcher"), grp("worker", 2, 2))
    plan = planner.plan_job("j", s, one_host(s))
    assert plan.files["hostfile"] == "127.0.0.1 slots=4\n"
    assert plan.processes[0].argv[:3] == ("mpirun", "-np", "4")


# --------------------------------------------------------------------------- GPUs


def test_gpus_become_cuda_visible_devices_per_replica():
    s = spec(RunMode.MULTI_PROCESS, grp("worker", 2, 2, resources=Resources(gpus=2)))
    gpus = planner.assign_gpus(["0", "1", "2", "3", "4"], ["1"], [("worker", 0, 2), ("worker", 1, 2)])
    assert gpus == {("worker", 0): ("0", "2"), ("worker", 1): ("3", "4")}
    places = [Placement("worker", r, "h", 0, gpus=gpus[("worker", r)]) for r in range(2)]
    e = envs(planner.plan_job("j", s, places))
    assert [x["CUDA_VISIBLE_DEVICES"] for x in e] == ["0,2", "0,2", "3,4", "3,4"]


def test_gpu_assignment_skips_replicas_without_gpus_and_fails_when_short():
    assert planner.assign_gpus(["0"], [], [("ps", 0, 0), ("worker", 0, 1)]) == {("worker", 0): ("0",)}
    assert planner.assign_gpus([], [], [("main", 0, 0)]) == {}
    with pytest.raises(planner.GpusUnavailable) as ei:
        planner.assign_gpus(["0", "1"], ["0"], [("worker", 0, 1), ("worker", 1, 1)])
    assert ei.value.reason == "GPUS_UNAVAILABLE" and ei.value.code == "FAILED_PRECONDITION"


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(("s", "field"), [
    (spec(RunMode.SINGLE_PROCESS, grp("main", 2)), "spec.replica_groups[0].replicas"),
    (spec(RunMode.SINGLE_PROCESS, grp("main", 1, 2)), "spec.replica_groups[0].processes_per_replica"),
    (spec(RunMode.SINGLE_PROCESS, grp("a"), grp("b")), "spec.replica_groups"),
    (spec(RunMode.MULTI_PROCESS, grp("main")), "spec.replica_groups[0].role"),
    (spec(RunMode.MASTER_WORKER, grp("worker")), "spec.replica_groups"),
    (spec(RunMode.MASTER_WORKER, grp("master", 2)), "spec.replica_groups[0].replicas"),
    (spec(RunMode.MASTER_WORKER, grp("master"), grp("ps")), "spec.replica_groups[1].role"),
    (spec(RunMode.PS_WORKER, grp("worker")), "spec.replica_groups"),
    (spec(RunMode.PS_WORKER, grp("ps")), "spec.replica_groups"),
    (spec(RunMode.PS_WORKER, grp("ps"), grp("worker", 1, 2)), "spec.replica_groups[1].processes_per_replica"),
    (spec(RunMode.PS_WORKER, grp("ps"), grp("worker"), grp("chief", 2)), "spec.replica_groups[2].replicas"),
    (spec(RunMode.MPI, grp("launcher")), "spec.replica_groups"),
    (spec(RunMode.MPI, grp("launcher", 2), grp("worker")), "spec.replica_groups[0].replicas"),
    (spec(RunMode.MPI, grp("launcher", 1, 2), grp("worker")), "spec.replica_groups[0].processes_per_replica"),
    (spec(RunMode.UNSPECIFIED, grp("main")), "spec.run_mode"),
])
def test_structure_violations_name_the_field(s, field):
    with pytest.raises(InvalidArgument) as ei:
        planner.plan_job("j", s, one_host(s))
    assert field in [v.field for v in ei.value.violations]


def test_missing_placement_is_a_driver_bug():
    s = spec(RunMode.MULTI_PROCESS, grp("worker", 2))
    with pytest.raises(ValueError, match="worker"):
        planner.plan_job("j", s, one_host(s)[:1])


# --------------------------------------------------------------------------- golden record


GOLDEN_CASES = {
    "single_process": spec(RunMode.SINGLE_PROCESS, grp("main", env={"SEED": "1"})),
    "multi_process": spec(RunMode.MULTI_PROCESS, grp("worker", 2, 2)),
    "master_worker": spec(RunMode.MASTER_WORKER, grp("master"), grp("worker", 2, env={"GLOO_SOCKET_IFNAME": "lo"})),
    "ps_worker": spec(RunMode.PS_WORKER, grp("chief"), grp("ps", 2), grp("worker", 2)),
    "mpi": spec(RunMode.MPI, grp("launcher", cmd=("python", "mpi.py")), grp("worker", 2, 2)),
}


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_environment_matches_golden_record(name):
    s = GOLDEN_CASES[name]
    plan = planner.plan_job("golden-1", s, many_hosts(s), master_port=29500, hostfile_path="/etc/dlsched/hostfile")
    doc = {
        "processes": [{"role": p.role, "replica_index": p.replica_index, "process_index": p.process_index,
                       "rank": p.rank, "host": p.host, "argv": list(p.argv), "env": dict(p.env),
                       "placeholder": p.placeholder} for p in plan.processes],
        "success": {"decisive_roles": sorted(plan.success.decisive_roles),
                    "stopped_after_success": sorted(plan.success.stopped_after_success)},
        "files": dict(plan.files),
    }
    got = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    path = GOLDEN / f"{name}.json"
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(got)
    assert got == path.read_text()


def test_free_ports_never_answer_one_port_twice() -> None:
    """A job's rendezvous ports come from one call: binding and releasing one port at a time lets the
    kernel hand a port just freed to the next bind (a Ray PS job once got two tasks on one port)."""
    from drivers.common.ports import free_ports

    got = free_ports(2000, "127.0.0.1")
    assert len(set(got)) == 2000 and all(0 < p < 65536 for p in got)
