"""Kubernetes manifests: golden files per run mode, names, validation, and the client's models."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import yaml

from dlsched.errors import FailedPrecondition, InvalidArgument
from drivers.common.base import JobSpec, ReplicaGroup, Resources, RunMode
from drivers.kubernetes import render

GOLDEN = pathlib.Path(__file__).parent / "golden" / "kubernetes"
UPDATE = os.environ.get("DLSCHED_UPDATE_GOLDEN") == "1"
OPTS = {"namespace": "ml", "default_image": "python:3.11-slim", "image_pull_secrets": "regcred, other"}


def g(role: str, replicas: int = 1, ppr: int = 0, *, command: tuple[str, ...] = ("python", "train.py"),
      args: tuple[str, ...] = (), env: dict[str, str] | None = None, image: str = "",
      **res: object) -> ReplicaGroup:
    return ReplicaGroup(role=role, replicas=replicas, processes_per_replica=ppr, command=command,
                        args=args, env=env or {}, image=image, resources=Resources(**res))  # type: ignore[arg-type]


SPECS: dict[str, JobSpec] = {
    "single_process": JobSpec(RunMode.SINGLE_PROCESS, (g("main", args=("--lr", "0.1"), env={"A": "1"},
                                                         cpu=0.5, memory_bytes=6 << 30),),
                              time_limit_seconds=90.5),
    "multi_process": JobSpec(RunMode.MULTI_PROCESS, (g("worker", 2, 2, cpu=8, memory_bytes=16 << 30,
                                                       gpus=2, gpu_type="NVIDIA-A100-SXM4-80GB",
                                                       image="pytorch/pytorch:2.4.0"),)),
    "master_worker": JobSpec(RunMode.MASTER_WORKER, (g("worker", 2), g("master"))),
    "ps_worker": JobSpec(RunMode.PS_WORKER, (g("chief"), g("ps", 2), g("worker", 2))),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_golden(name: str) -> None:
    out = render.render_job("golden", SPECS[name], 3, OPTS)
    native = out.native_spec()
    path = GOLDEN / f"{name}.yaml"
    if UPDATE:
        path.write_text(native.content)
    assert native.content == path.read_text(), f"update with DLSCHED_UPDATE_GOLDEN=1 ({path})"
    assert native.media_type == "application/yaml"
    docs = list(yaml.safe_load_all(native.content))
    assert [d["kind"] for d in docs] == ["Service"] + ["Pod"] * len(out.pods)
    svc = docs[0]
    assert svc["spec"]["clusterIP"] == "None" and svc["metadata"]["name"] == "golden-3"
    for pod in docs[1:]:
        labels = pod["metadata"]["labels"]
        assert labels[render.LABEL_JOB] == "golden" and labels[render.LABEL_ATTEMPT] == "3"
        assert pod["spec"]["subdomain"] == "golden-3" and pod["spec"]["restartPolicy"] == "Never"
        assert pod["metadata"]["ownerReferences"][0]["name"] == "golden-3"
        assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}, {"name": "other"}]
        for c in pod["spec"]["containers"]:
            assert "sh" not in c["command"][0]


def test_rendezvous_names_the_headless_service() -> None:
    out = render.render_job("golden", SPECS["master_worker"], 3, OPTS)
    pods = {p["metadata"]["name"]: p for p in out.manifests[1:]}
    env = {e["name"]: e["value"] for e in pods["golden-3-worker-1"]["spec"]["containers"][0]["env"]}
    assert env["MASTER_ADDR"] == "master-0.golden-3.ml.svc"
    assert env["WORLD_SIZE"] == "3" and env["RANK"] == "2"
    ps = render.render_job("golden", SPECS["ps_worker"], 3, OPTS)
    env = {e["name"]: e["value"] for e in ps.manifests[1]["spec"]["containers"][0]["env"]}
    tf = json.loads(env["TF_CONFIG"])
    assert tf["cluster"]["ps"] == ["ps-0.golden-3.ml.svc:2222", "ps-1.golden-3.ml.svc:2222"]
    assert ps.success.decisive_roles == {"chief"}


def test_gpus_split_over_the_containers_of_a_replica() -> None:
    out = render.render_job("golden", SPECS["multi_process"], 1, OPTS)
    pod = out.manifests[1]
    assert [c["name"] for c in pod["spec"]["containers"]] == ["proc-0", "proc-1"]
    lim = pod["spec"]["containers"][0]["resources"]["limits"]
    assert lim == {"cpu": "4", "memory": str(8 << 30), "nvidia.com/gpu": "1"}
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}


@pytest.mark.parametrize("text", [
    "My.Job.NAME-" + "é" * 30 + "x" * 200, "UPPER", "a..b", "-lead", "9starts-digit", "日本語", "",
    "a" * 63, "a" * 64,
])
def test_dns_labels_from_any_text(text: str) -> None:
    name = render.dns_label(text)
    assert render.is_dns_label(name) and name[0].isalpha(), name
    assert render.dns_label(text) == name
    if render.is_dns_label(text) and text[:1].isalpha():
        assert name == text


def test_distinct_texts_give_distinct_labels() -> None:
    texts = ["Job.A", "job-a", "job_a", "JOB-A", "x" * 200, "x" * 201]
    assert len({render.dns_label(t) for t in texts}) == len(texts)


def test_long_job_ids_still_give_valid_names() -> None:
    job = "j" + "a-" * 31
    out = render.render_job(job, SPECS["ps_worker"], 12, OPTS)
    for m in out.manifests:
        assert render.is_dns_label(m["metadata"]["name"])
        if m["kind"] == "Pod":
            assert render.is_dns_label(m["spec"]["hostname"])
            assert render.is_dns_label(m["spec"]["subdomain"])
    assert len({m["metadata"]["name"] for m in out.manifests}) == len(out.manifests)


def test_missing_image_and_bad_options_are_invalid_argument() -> None:
    with pytest.raises(InvalidArgument) as e:
        render.render_job("j", SPECS["single_process"], 1, {"image_pull_secrets": "Bad Name"})
    fields = {v.field for v in e.value.violations}
    assert fields == {"spec.replica_groups[0].image", "cluster.options[image_pull_secrets]"}
    with pytest.raises(InvalidArgument):
        render.render_job("j", SPECS["single_process"], 1, {**OPTS, "namespace": "Not_OK"})


def test_mpi_is_refused_as_failed_precondition() -> None:
    spec = JobSpec(RunMode.MPI, (g("launcher"), g("worker", 2)))
    with pytest.raises(FailedPrecondition) as e:
        render.render_job("j", spec, 1, OPTS)
    assert e.value.reason == "MPI_NOT_AVAILABLE"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_manifests_round_trip_through_the_client_models(name: str) -> None:
    k8s = pytest.importorskip("kubernetes")
    client = k8s.client.ApiClient()

    for m in render.render_job("golden", SPECS[name], 1, OPTS).manifests:
        model = client.deserialize(json.dumps(m), f"V1{m['kind']}", "application/json")
        assert client.sanitize_for_serialization(model) == m
