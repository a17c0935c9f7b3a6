"""The local driver's render: the plan against golden files, and RenderJob over gRPC."""

from __future__ import annotations

import json
import os

import pytest

from dlsched.v1 import driver_service_pb2 as dpb
from drivers.common import base
from drivers.local import render
from tests.local_peer import (
    CLUSTER,
    GOLDEN,
    driver_fixtures,
    multi,
    observe,
)

state_dir, driver, stub = driver_fixtures()


def _golden_spec(mode: str) -> base.JobSpec:
    if mode == "single":
        g = base.ReplicaGroup(role="main", replicas=1, command=("python", "train.py"), args=("--lr", "0.1"),
                              env={"FOO": "bar"}, working_dir="/work/project")
        return base.JobSpec(run_mode=base.RunMode.SINGLE_PROCESS, replica_groups=(g,))
    g = base.ReplicaGroup(role="worker", replicas=2, processes_per_replica=2, command=("python", "-m", "ddp"),
                          env={"NCCL_DEBUG": "INFO"}, resources=base.Resources(cpu=2, gpus=1))
    return base.JobSpec(run_mode=base.RunMode.MULTI_PROCESS, replica_groups=(g,), time_limit_seconds=3600)


@pytest.mark.parametrize("mode", ["single", "multi"])
def test_render_matches_golden_file(mode):
    plan = render.plan_job("train-1", _golden_spec(mode), attempt=1, state_dir="/var/lib/dlsched/local")
    got = render.to_native_spec(plan)
    assert got.media_type == "application/json"
    path = GOLDEN / f"{mode}_process.json"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(got.content)
    assert got.content == path.read_text()


async def test_render_job_over_grpc_is_the_launch_plan(stub, state_dir):
    spec = multi("pass", replicas=2)
    resp = await stub.RenderJob(dpb.RenderJobRequest(cluster=CLUSTER, job_id="render-me", spec=spec), timeout=10)
    assert resp.native_spec.media_type == "application/json"
    doc = json.loads(resp.native_spec.content)
    assert [p["env"]["RANK"] for p in doc["processes"]] == ["0", "1"]
    assert doc["processes"][1]["stdout"] == os.path.join(state_dir, "jobs", "render-me", "attempt-1", "worker-1.stdout")
    assert "PATH" not in doc["processes"][0]["env"]  # the driver's own environment is not shown
    assert not (await observe(stub, "render-me")).found  # rendering runs nothing

