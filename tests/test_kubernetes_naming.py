"""The Kubernetes metadata codec: what ``render`` writes on a pod, ``naming.decode`` reads back."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from drivers.common.planner import SuccessRule
from drivers.kubernetes import naming, render
from tests.test_kubernetes_render import OPTS, SPECS


def pods(rendered: render.Rendered) -> list[dict[str, Any]]:
    return [m for m in rendered.manifests if m["kind"] == "Pod"]


@pytest.mark.parametrize("mode", sorted(SPECS))
def test_every_rendered_pod_decodes_to_its_job(mode: str) -> None:
    job = "odd--id"  # the label differs from the id
    out = render.render_job(job, SPECS[mode], 4, OPTS)
    for pod in pods(out):
        meta = naming.decode(pod)
        assert meta is not None
        assert (meta.job_id, meta.attempt, meta.others) == (job, 4, out.others)
        assert meta.success.decisive_roles == out.success.decisive_roles
        assert meta.success.stopped_after_success == out.success.stopped_after_success
        assert sorted(meta.pods()) == sorted((p.role, p.index, p.name) for p in out.pods)
        ann = pod["metadata"]["annotations"]
        assert {k: v for k, v in ann.items() if k != naming.ANN_LABELS} == naming.encode(meta)  # round trip


def test_a_pod_from_before_the_job_id_annotation_decodes_by_its_label() -> None:
    (pod,) = pods(render.render_job("plain", SPECS["single_process"], 2, OPTS))
    del pod["metadata"]["annotations"][naming.ANN_JOB]
    meta = naming.decode(pod)
    assert meta is not None and (meta.job_id, meta.attempt, meta.replicas) == ("plain", 2, (("main", 1),))


def test_an_empty_success_rule_means_every_role_decides() -> None:
    pod = pods(render.render_job("ps", SPECS["ps_worker"], 1, OPTS))[0]
    pod["metadata"]["annotations"][naming.ANN_DECISIVE] = ""
    meta = naming.decode(pod)
    assert meta is not None and meta.success == SuccessRule(frozenset({"chief", "ps", "worker"}),
                                                            frozenset({"ps", "worker"}))


@pytest.mark.parametrize("change", [
    {"labels": {naming.LABEL_ATTEMPT: "0"}},  # no attempt
    {"labels": {naming.LABEL_ATTEMPT: "x"}},
    {"annotations": {naming.ANN_JOB: "another-job"}},  # the id's label is not the pod's label
    {"annotations": {naming.ANN_REPLICAS: ""}},  # no replicas
    {"annotations": {naming.ANN_REPLICAS: "main=0,main=x"}},
])
def test_a_pod_that_describes_no_job_decodes_to_none(change: dict[str, dict[str, str]]) -> None:
    (pod,) = pods(render.render_job("j", SPECS["single_process"], 1, OPTS))
    pod = copy.deepcopy(pod)
    for part, values in change.items():
        pod["metadata"][part].update(values)
    assert naming.decode(pod) is None


def test_only_the_kinds_an_attempt_owns_are_read_from_the_objects_annotation() -> None:
    pod = pods(render.render_job("m", SPECS["mpi"], 1, OPTS))[0]
    ann = pod["metadata"]["annotations"]
    ann[naming.ANN_OBJECTS] += ",Deployment/evil,Secret/,ConfigMap"
    meta = naming.decode(pod)
    assert meta is not None and meta.others == (("ConfigMap", "m-1-mpi"), ("Secret", "m-1-ssh"))


def test_two_jobs_never_name_the_same_pod_and_older_pods_keep_their_names() -> None:
    """Job ids and roles both take '-': job "x" role "w-1-ps" and job "x-1-w" role "ps" named
    the same pod, so one user's launch took another's pod for an earlier try of its own, and its
    clean-up deleted it. A role with a '-' now adds a hash of the four parts; a pod made before
    (no names annotation) keeps its name, so a restarted driver still finds it."""
    import dataclasses

    from tests.test_kubernetes_render import g

    def rendered(job: str, role: str) -> render.Rendered:
        return render.render_job(job, dataclasses.replace(SPECS["single_process"], replica_groups=(g(role),)), 1, OPTS)

    a, b = rendered("x", "w-1-ps"), rendered("x-1-w", "ps")
    assert {p.name for p in a.pods}.isdisjoint(p.name for p in b.pods)
    assert [p.name for p in b.pods] == ["x-1-w-1-ps-0"]  # a role without '-': the name as before
    (pod,) = pods(a)
    meta = naming.decode(pod)
    assert meta is not None and meta.pods() == [(p.role, p.index, p.name) for p in a.pods]
    del pod["metadata"]["annotations"][naming.ANN_NAMES]  # a pod of a driver from before
    old = naming.decode(pod)
    assert old is not None and old.pods() == [("w-1-ps", 0, "x-1-w-1-ps-0")]
    for name in (p.name for p in a.pods):
        assert naming.is_dns_label(name)
    long = naming.pod_name("a" * 63, 12, "b" * 60 + "-c", 999)
    assert naming.is_dns_label(long) and long != naming.pod_name("a" * 63, 12, "b" * 60 + "-d", 999)
