"""The Ray submission: golden files per run mode, quoting, MPI refusal and the state table."""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import subprocess
import sys

import pytest

from dlsched.errors import FailedPrecondition, InvalidArgument
from drivers.common.base import JobSpec, JobState, ReplicaGroup, Resources, RunMode
from drivers.ray import render, states

GOLDEN = pathlib.Path(__file__).parent / "golden" / "ray"
UPDATE = os.environ.get("DLSCHED_UPDATE_GOLDEN") == "1"
PY = sys.executable


def g(role: str, replicas: int = 1, ppr: int = 0, **res: object) -> ReplicaGroup:
    return ReplicaGroup(role=role, replicas=replicas, processes_per_replica=ppr,
                        command=("python3", "train.py"), args=("--epochs", "2"),
                        env={"USER_VAR": "x y"}, resources=Resources(**res))  # type: ignore[arg-type]


SPECS = {
    "single_process": JobSpec(RunMode.SINGLE_PROCESS, (ReplicaGroup(
        role="main", replicas=1, command=("python3", "train.py"), args=("--lr", "0.1"),
        env={"USER_VAR": "x y"}, working_dir="/data/project",
        resources=Resources(cpu=1.5, memory_bytes=1 << 30, gpus=1)),), time_limit_seconds=3600),
    "multi_process": JobSpec(RunMode.MULTI_PROCESS, (g("worker", replicas=2, ppr=2, cpu=1),)),
    "master_worker": JobSpec(RunMode.MASTER_WORKER, (g("master", cpu=1), g("worker", replicas=2, cpu=0.5))),
    "ps_worker": JobSpec(RunMode.PS_WORKER, (g("ps"), g("worker", replicas=2), g("chief"))),
}
OPTIONS = {"master_worker": {"placement_strategy": "SPREAD"}, "ps_worker": {"python": "/opt/py/bin/python"}}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_golden(name):
    body = render.render_submission("golden-1", SPECS[name], 2, OPTIONS.get(name, {}))
    out = render.to_native_spec(body)
    path = GOLDEN / f"{name}.json"
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(out.content)
    assert out.media_type == "application/json"
    assert out.content == path.read_text(), f"update with DLSCHED_UPDATE_GOLDEN=1 ({path})"
    assert body["submission_id"] == "dlsched-golden-1-2"
    assert body["metadata"]["dlsched_job_id"] == "golden-1" and body["metadata"]["dlsched_attempt"] == "2"


def test_single_process_carries_planner_env_and_resources():
    body = render.render_submission("j", SPECS["single_process"], 1)
    env = body["runtime_env"]["env_vars"]
    assert env["DLSCHED_JOB_ID"] == "j" and env["DLSCHED_ROLE"] == "main" and env["USER_VAR"] == "x y"
    assert "working_dir" not in body["runtime_env"]  # a path on the nodes, not a URI
    assert body["entrypoint"] == "cd -- /data/project && exec python3 train.py --lr 0.1"
    assert (body["entrypoint_num_cpus"], body["entrypoint_num_gpus"], body["entrypoint_memory"]) == (1.5, 1, 1 << 30)


def test_launcher_job_round_trips_the_spec():
    body = render.render_submission("j", SPECS["master_worker"], 1)
    job = json.loads(body["runtime_env"]["env_vars"][render.JOB_ENV])
    assert job["mode"] == "placement-group" and job["job_id"] == "j"
    assert render.spec_from_json(job["spec"]) == SPECS["master_worker"]
    assert "entrypoint_num_cpus" not in body  # the bundles hold the replicas' resources


def test_uri_working_dir_goes_to_runtime_env():
    spec = JobSpec(RunMode.SINGLE_PROCESS, (ReplicaGroup(role="main", replicas=1, command=("ls",),
                                                         working_dir="s3://bucket/code.zip"),))
    body = render.render_submission("j", spec, 1)
    assert body["runtime_env"]["working_dir"] == "s3://bucket/code.zip" and body["entrypoint"] == "ls"


def test_mpi_is_refused_with_a_reason():
    spec = JobSpec(RunMode.MPI, (g("launcher"), g("worker", replicas=2)))
    with pytest.raises(FailedPrecondition) as e:
        render.render_submission("j", spec, 1)
    assert e.value.reason == "MPI_NOT_SUPPORTED" and "not supported" in e.value.message


@pytest.mark.parametrize(("options", "field"), [
    ({"placement_strategy": "ANYWHERE"}, "cluster.options[placement_strategy]"),
    ({"python": ""}, "cluster.options[python]"),
])
def test_bad_options_are_invalid_argument(options, field):
    with pytest.raises(InvalidArgument) as e:
        render.render_submission("j", SPECS["master_worker"], 1, options)
    assert [v.field for v in e.value.violations] == [field]


def test_invalid_run_mode_structure_is_invalid_argument():
    with pytest.raises(InvalidArgument):
        render.render_submission("j", JobSpec(RunMode.MASTER_WORKER, (g("worker"),)), 1)


HOSTILE = ["$(touch CANARY)", "`touch CANARY`", "'; touch CANARY; '", '"; touch CANARY; "',
           "a\ntouch CANARY", "-rf", "--", "$HOME ${PATH}", "ünï©ødé ✓", "", "|| touch CANARY &",
           "> CANARY", "a' \"b", "back\\slash", "*", "~"]


def test_hostile_argv_and_working_dir_reach_the_program_byte_for_byte(tmp_path):
    wd = tmp_path / "dir 'q' $(touch CANARY)\nnl"
    wd.mkdir()
    code = "import json, os, sys; json.dump({'argv': sys.argv[1:], 'cwd': os.getcwd()}, sys.stdout)"
    spec = JobSpec(RunMode.SINGLE_PROCESS, (ReplicaGroup(role="main", replicas=1, command=(PY, "-c", code),
                                                         args=tuple(HOSTILE), working_dir=str(wd)),))
    body = render.render_submission("j", spec, 1)
    res = subprocess.run(["/bin/sh", "-c", body["entrypoint"]], cwd=tmp_path, capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == {"argv": HOSTILE, "cwd": str(wd)}
    assert not list(tmp_path.rglob("CANARY"))
    assert shlex.split(body["entrypoint"])[:2] == ["cd", "--"]


@pytest.mark.parametrize(("status", "error_type", "want"), [
    ("PENDING", None, (JobState.PENDING, "Pending")),
    ("RUNNING", None, (JobState.RUNNING, "Running")),
    ("STOPPED", None, (JobState.STOPPED, "Stopped")),
    ("SUCCEEDED", None, (JobState.SUCCEEDED, "Completed")),
    ("FAILED", "JOB_ENTRYPOINT_COMMAND_ERROR", (JobState.FAILED, "JobEntrypointCommandError")),
    ("FAILED", None, (JobState.FAILED, "Failed")),
    ("SOMETHING_NEW", None, (JobState.PENDING, "Unknown")),
    (None, None, (JobState.PENDING, "Unknown")),
])
def test_state_table(status, error_type, want):
    assert states.map_status(status, error_type) == want
