"""Unit tests of ClusterManager's pure domain: the matcher, validation, the
list filter, page and resume tokens."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

import pytest

from cluster_manager.domain import filter as flt
from cluster_manager.domain import validation as v
from cluster_manager.domain.errors import NoMatchingCluster, UnknownCluster
from cluster_manager.domain.matching import rank
from cluster_manager.domain.models import (
    Capacity,
    Cluster,
    ClusterState,
    ClusterType,
    Credentials,
    CredentialsKind,
    GpuInventory,
    JobRequirements,
    Observation,
    ReplicaGroup,
    Resources,
    RunMode,
    Selector,
    observation_changed,
)
from cluster_manager.hub import ResumeToken
from dlsched.errors import InvalidArgument
from dlsched.kit import tokens

GIB = 1024**3
MODES = (RunMode.SINGLE_PROCESS, RunMode.MULTI_PROCESS)


def cap(cpus: float = 16, free_cpus: float | None = None, mem: int = 64 * GIB,
        gpus: int = 0, free_gpus: int | None = None, gpu_type: str = "a100",
        nodes: int = 1) -> Capacity:
    return Capacity(
        nodes_total=nodes, nodes_free=nodes, cpus_total=cpus,
        cpus_free=cpus if free_cpus is None else free_cpus,
        memory_bytes_total=mem, memory_bytes_free=mem, gpus_total=gpus,
        gpus_free=gpus if free_gpus is None else free_gpus,
        gpus=(GpuInventory(gpu_type, gpus, gpus if free_gpus is None else free_gpus),)
        if gpus else (),
        max_cpus_per_node=cpus / nodes, max_memory_bytes_per_node=mem // nodes,
        max_gpus_per_node=gpus // nodes,
    )


def cluster(cid: str, capacity: Capacity | None = None, *, state: ClusterState = ClusterState.READY,
            ctype: ClusterType = ClusterType.LOCAL, modes: tuple[RunMode, ...] = MODES,
            **labels: str) -> Cluster:
    return Cluster(cluster_id=cid, type=ctype, driver_address="127.0.0.1:1", labels=labels,
                   state=state, capacity=capacity or cap(), supported_run_modes=modes)


def job(cpu: float = 1, gpus: int = 0, replicas: int = 1, mode: RunMode = RunMode.SINGLE_PROCESS,
        gpu_type: str = "", mem: int = GIB, **sel: object) -> JobRequirements:
    return JobRequirements(
        run_mode=mode,
        replica_groups=(ReplicaGroup("main", replicas, 1,
                                     Resources(cpu=cpu, memory_bytes=mem, gpus=gpus,
                                               gpu_type=gpu_type)),),
        selector=Selector(**sel),  # type: ignore[arg-type]
    )


# --- matcher ----------------------------------------------------------------


def test_the_matcher_counts_cpus_as_each_backend_asks_for_them() -> None:
    """cpu 0.5 per replica of 3 processes: Slurm asks --cpus-per-task=1 for each of the 3 tasks
    (dlsched.resources, what its renderer writes), so a 2-CPU node cannot hold it and the job is
    refused at submit with the reason; Kubernetes and Ray ask for 0.5 and take it."""
    three = JobRequirements(run_mode=RunMode.MULTI_PROCESS, replica_groups=(
        ReplicaGroup("worker", 1, 3, Resources(cpu=0.5, memory_bytes=GIB)),))
    two_cpus = cap(cpus=2)
    with pytest.raises(NoMatchingCluster) as ei:
        rank(three, [cluster("slurm", two_cpus, ctype=ClusterType.SLURM)])
    assert "needs 3 CPUs (3 processes, as SLURM asks)" in str(ei.value.violations)
    for ctype in (ClusterType.KUBERNETES, ClusterType.RAY):
        assert rank(three, [cluster("c", two_cpus, ctype=ctype)])[0].eligible
    fits = rank(three, [cluster("slurm", cap(cpus=4), ctype=ClusterType.SLURM)])[0]
    assert fits.eligible


def test_slurm_asks_what_the_matcher_counted() -> None:
    """The renderer's --cpus-per-task is the resource model's, for the same groups."""
    from dlsched import resources
    from drivers.common.base import JobSpec as DSpec
    from drivers.common.base import ReplicaGroup as DGroup
    from drivers.common.base import Resources as DRes
    from drivers.common.base import RunMode as DMode
    from drivers.slurm import render as slurm_render

    spec = DSpec(DMode.MASTER_WORKER, (DGroup("master", 1, ("python",), processes_per_replica=2,
                                              resources=DRes(cpu=3)),
                                       DGroup("worker", 2, ("python",), processes_per_replica=4,
                                              resources=DRes(cpu=0.5))))
    script = slurm_render.render_job("j", spec, 1, {})
    assert f"--cpus-per-task={resources.cpus_per_task(spec.replica_groups)}" in script.native_spec().content
    assert resources.cpus_per_task(spec.replica_groups) == 2


def test_ranks_free_capacity_first_then_headroom() -> None:
    busy = cluster("busy", cap(cpus=16, free_cpus=0.5))
    small = cluster("small", cap(cpus=4))
    big = cluster("big", cap(cpus=64))
    cands = rank(job(cpu=2), [busy, small, big])
    assert [c.cluster for c in cands] == ["clusters/big", "clusters/small", "clusters/busy"]
    assert all(c.eligible for c in cands)
    assert cands[0].score > cands[1].score > cands[2].score
    assert any("free capacity now" in r for r in cands[0].reasons)
    assert any("queue" in r for r in cands[2].reasons)


def test_down_clusters_follow_those_up_and_refused_ones_follow_with_reasons() -> None:
    now = datetime(2026, 6, 1, tzinfo=UTC)
    cands = rank(job(cpu=2), [
        replace(cluster("down", state=ClusterState.DRIVER_UNAVAILABLE), last_heartbeat_time=now),
        cluster("ok", cap(free_cpus=2)),
        cluster("slurm", ctype=ClusterType.SLURM, modes=(RunMode.MPI,)),
        replace(cluster("small-down", cap(cpus=1), state=ClusterState.DRIVER_UNAVAILABLE),
                last_heartbeat_time=now),
    ], now)
    assert [(c.cluster, c.eligible) for c in cands] == [
        ("clusters/ok", True), ("clusters/down", True), ("clusters/slurm", False),
        ("clusters/small-down", False)]
    assert any("DRIVER_UNAVAILABLE" in r and "waits for it" in r for r in cands[1].reasons)
    assert any("SINGLE_PROCESS" in r for r in cands[2].reasons)
    assert any("needs 2 CPUs" in r for r in cands[3].reasons)  # down, and could not run it anyway


def test_only_down_clusters_match_the_best_of_them() -> None:
    now = datetime(2026, 6, 1, tzinfo=UTC)
    cands = rank(job(cpu=2), [
        replace(cluster("a", cap(free_cpus=0), state=ClusterState.DRIVER_UNAVAILABLE), last_heartbeat_time=now),
        replace(cluster("b", state=ClusterState.DRIVER_UNAVAILABLE), last_heartbeat_time=now)], now)
    assert [(c.cluster, c.eligible) for c in cands] == [("clusters/b", True), ("clusters/a", True)]


@pytest.mark.parametrize("j, why", [
    (job(gpus=4), "GPUs"),
    (job(cpu=32), "CPUs"),
    (job(mem=128 * GIB), "memory"),
    (job(cpu=10, replicas=3), "CPUs in all"),
    (job(mode=RunMode.MPI), "run mode"),
])
def test_impossible_jobs_fail_with_no_matching_cluster(j: JobRequirements, why: str) -> None:
    with pytest.raises(NoMatchingCluster) as ei:
        rank(j, [cluster("a", cap(cpus=16, gpus=2)), cluster("b", cap(cpus=16))])
    err = ei.value
    assert err.code == "FAILED_PRECONDITION" and err.reason == "NO_MATCHING_CLUSTER"
    assert [s for s, _ in err.violations] == ["clusters/a", "clusters/b"]
    assert all(why in d for _, d in err.violations), err.violations


def test_replicas_must_fit_one_node_not_just_the_sum() -> None:
    four_nodes = cap(cpus=32, nodes=4, gpus=8)  # 8 CPUs, 2 GPUs per node
    assert rank(job(cpu=8, gpus=2, replicas=4), [cluster("c", four_nodes)])[0].eligible
    with pytest.raises(NoMatchingCluster):
        rank(job(cpu=9, replicas=1), [cluster("c", four_nodes)])
    with pytest.raises(NoMatchingCluster):
        rank(job(gpus=3, replicas=1), [cluster("c", four_nodes)])


def test_gpu_type_must_be_in_inventory() -> None:
    c = cluster("g", cap(gpus=4, gpu_type="a100"))
    assert rank(job(gpus=1, gpu_type="A100"), [c])[0].eligible
    with pytest.raises(NoMatchingCluster) as ei:
        rank(job(gpus=1, gpu_type="h100"), [c])
    assert "h100" in ei.value.violations[0][1]


def test_a_job_naming_an_image_matches_only_backends_that_take_images() -> None:
    """Slurm and Ray run a job's processes on their hosts as they are: a job naming a container
    image would not get the software it named. Kubernetes runs the image; the local development
    backend ignores it, as JobSpec documents."""
    from dataclasses import replace
    cs = [cluster("l"), cluster("s", ctype=ClusterType.SLURM), cluster("r", ctype=ClusterType.RAY),
          cluster("k", ctype=ClusterType.KUBERNETES)]
    got = rank(replace(job(), image=True), cs)
    assert sorted(c.cluster for c in got if c.eligible) == ["clusters/k", "clusters/l"]
    for c in got:
        if not c.eligible:
            assert any("container image" in r for r in c.reasons), c
    with pytest.raises(NoMatchingCluster) as ei:
        rank(replace(job(), image=True), cs[1:3])
    assert all("container image" in why for _, why in ei.value.violations)
    assert len([c for c in rank(job(), cs) if c.eligible]) == 4  # no image: any of them


def test_selector_name_type_and_labels() -> None:
    cs = [cluster("a", team="ml"), cluster("b", team="web"),
          cluster("s", ctype=ClusterType.SLURM, team="ml")]
    assert [c.cluster for c in rank(job(cluster="clusters/b"), cs)] == ["clusters/b"]
    assert [c.cluster for c in rank(job(cluster="b"), cs)] == ["clusters/b"]
    got = rank(job(labels={"team": "ml"}), cs)
    assert [(c.cluster, c.eligible) for c in got] == [
        ("clusters/a", True), ("clusters/s", True), ("clusters/b", False)]
    got = rank(job(cluster_type=ClusterType.LOCAL, labels={"team": "ml"}), cs)
    assert [c.cluster for c in got if c.eligible] == ["clusters/a"]
    with pytest.raises(UnknownCluster) as ei:
        rank(job(cluster="clusters/zzz"), cs)
    assert ei.value.code == "INVALID_ARGUMENT" and ei.value.reason == "UNKNOWN_CLUSTER"
    assert ei.value.violations[0].field == "spec.cluster_selector.cluster"
    with pytest.raises(NoMatchingCluster):
        rank(job(), [])


def test_a_cluster_kept_for_projects_matches_only_their_jobs() -> None:
    """allowed_projects: a job of another project, or a request naming none (MatchClusters
    without a project), is refused with the reason; a listed project's job matches."""
    from dataclasses import replace

    cs = [replace(cluster("kept"), allowed_projects=("team-a",)), cluster("open")]
    for project, want in (("team-a", ["clusters/kept", "clusters/open"]), ("team-b", ["clusters/open"]),
                          ("", ["clusters/open"])):
        got = rank(replace(job(), project=project), cs)
        assert sorted(c.cluster for c in got if c.eligible) == want, project
    refused = next(c for c in rank(job(), cs) if c.cluster == "clusters/kept")
    assert not refused.eligible and "name a project" in refused.reasons[0]


def test_capacity_noise_is_not_a_change() -> None:
    a = cap(cpus=16)
    noisy = Capacity(**{**a.__dict__, "memory_bytes_free": a.memory_bytes_free - GIB // 2})
    assert not a.materially_differs(noisy)
    assert a.materially_differs(Capacity(**{**a.__dict__, "gpus_free": 1}))
    assert a.materially_differs(Capacity(**{**a.__dict__, "cpus_free": 2.0}))
    o = Observation(ClusterState.READY, "", a, MODES)
    assert not observation_changed(o, Observation(ClusterState.READY, "", noisy, MODES))
    assert observation_changed(o, Observation(ClusterState.DRIVER_UNAVAILABLE, "x", None, ()))


# --- validation -------------------------------------------------------------


def _fields(c: Cluster, creds: Credentials | None = None, cid: str = "ok") -> list[str]:
    return [x.field for x in v.check_new_cluster(cid, c, creds)]


def base(ctype: ClusterType, address: str = "") -> Cluster:
    return Cluster(cluster_id="ok", type=ctype, driver_address="127.0.0.1:9", address=address)


@pytest.mark.parametrize("ctype, addr, ok", [
    (ClusterType.LOCAL, "", True),
    (ClusterType.SLURM, "login", True),
    (ClusterType.SLURM, "login.example.org:2222", True),
    (ClusterType.SLURM, "[::1]:22", True),
    (ClusterType.SLURM, "", False),
    (ClusterType.SLURM, "user@login", False),
    (ClusterType.SLURM, "login`id`", False),
    (ClusterType.SLURM, "login:0", False),
    (ClusterType.SLURM, "-oProxyCommand=x", False),
    (ClusterType.KUBERNETES, "https://10.0.0.1:6443", True),
    (ClusterType.KUBERNETES, "10.0.0.1:6443", False),
    (ClusterType.RAY, "http://ray-head:8265", True),
    (ClusterType.RAY, "http://ray head:8265", False),
    (ClusterType.RAY, "", False),
])
def test_address_rules_per_type(ctype: ClusterType, addr: str, ok: bool) -> None:
    assert ("cluster.address" not in _fields(base(ctype, addr))) is ok


def test_credentials_must_fit_the_type() -> None:
    ssh = Credentials(CredentialsKind.SSH, username="u", private_key="k")
    tok = Credentials(CredentialsKind.TOKEN, token="t")
    kube = Credentials(CredentialsKind.KUBERNETES, token="t")
    assert not _fields(base(ClusterType.SLURM, "login"), ssh)
    assert not _fields(base(ClusterType.RAY, "http://r:1"), tok)
    assert not _fields(base(ClusterType.KUBERNETES, "https://k:1"), kube)
    assert _fields(base(ClusterType.LOCAL), tok) == ["cluster.credentials"]
    assert _fields(base(ClusterType.RAY, "http://r:1"), ssh) == ["cluster.credentials"]
    assert _fields(base(ClusterType.SLURM, "login"), kube) == ["cluster.credentials"]
    assert _fields(base(ClusterType.SLURM, "login"),
                   Credentials(CredentialsKind.SSH, username="u")) == [
        "cluster.credentials.ssh.private_key"]
    assert "k" not in repr(ssh).replace("kind", "")  # secrets are kept out of repr
    assert "private_key" not in repr(ssh)


def test_credentials_are_bounded_naming_the_field() -> None:
    """Each secret, the host keys and all of them together are bounded before anything reads
    them: a 2 MB kubeconfig reached etcd, whose refusal (a request past 1.5 MiB) came back as
    UNAVAILABLE, and clients retried it."""
    slurm, kube = base(ClusterType.SLURM, "login"), base(ClusterType.KUBERNETES, "https://k:1")
    big = "x" * (2 << 20)
    assert _fields(kube, Credentials(CredentialsKind.KUBERNETES, kubeconfig=big)) == [
        "cluster.credentials.kubernetes.kubeconfig"]
    assert _fields(slurm, Credentials(CredentialsKind.SSH, username="u", private_key=big)) == [
        "cluster.credentials.ssh.private_key"]
    assert _fields(slurm, Credentials(CredentialsKind.SSH, username="u", private_key="k",
                                      known_host_keys=("ssh-ed25519 AAAA",) * 65)) == [
        "cluster.credentials.ssh.known_host_keys"]
    near = "x" * (510 << 10)
    assert _fields(kube, Credentials(CredentialsKind.KUBERNETES, kubeconfig=near, ca_cert=near,
                                     token="t" * (60 << 10))) == [
        "cluster.credentials.kubernetes"]
    assert not _fields(kube, Credentials(CredentialsKind.KUBERNETES, kubeconfig="x" * (100 << 10)))


def test_ids_labels_options_driver_address() -> None:
    assert v.check_cluster_id("a-1") == []
    for bad in ("", "A", "1a", "a_b", "a" * 64):
        assert [x.field for x in v.check_cluster_id(bad)] == ["cluster_id"]
    assert not v.check_labels({"team": "ml", "example.com/tier": "gold", "e": ""}, "l")
    for labels in ({"": "x"}, {"-x": "y"}, {"k": "v" * 64}, {"k" * 64: "v"}, {"a b": "c"}):
        assert v.check_labels(labels, "cluster.labels"), labels
    assert not v.check_options({"SLURM_CONF": "/etc/slurm.conf", "namespace": "x"}, "o")
    assert v.check_options({"bad key": "x"}, "o")
    for addr in ("h:1", "127.0.0.1:65535", "[::1]:80"):
        assert not v.check_driver_address(addr, "d"), addr
    for addr in ("", "h", "h:0", "h:x", ":80", "h h:1"):
        assert v.check_driver_address(addr, "d"), addr
    with pytest.raises(InvalidArgument):
        v.check_update_mask([])
    with pytest.raises(InvalidArgument):
        v.check_update_mask(["type"])
    assert v.check_update_mask(["labels", "credentials"]) == ["labels", "credentials"]


# --- filter and tokens ------------------------------------------------------


def test_filter_grammar() -> None:
    s = cluster("s", ctype=ClusterType.SLURM, team="ml")
    loc = cluster("l", state=ClusterState.PENDING, team="web")
    f = flt.parse_filter("type=SLURM AND labels.team=ml AND state=READY")
    assert f.matches(s) and not f.matches(loc)
    assert flt.parse_filter("type = CLUSTER_TYPE_SLURM and state=cluster_state_ready").matches(s)
    assert flt.parse_filter("state!=READY").matches(loc)
    assert flt.parse_filter("labels.team!='ml'").matches(loc)
    assert flt.parse_filter("").matches(loc)
    for bad in ("type=FOO", "name=x", "type", "type=SLURM OR state=READY", "labels.=x",
                "state=READY AND"):
        with pytest.raises(InvalidArgument) as ei:
            flt.parse_filter(bad)
        assert ei.value.violations[0].field == "filter", bad


def test_page_and_resume_tokens_round_trip_and_reject_garbage() -> None:
    assert flt.decode_page_token(flt.encode_page_token("abc")) == "abc"
    assert flt.decode_page_token(flt.encode_page_token("abc", "type=SLURM"), "type=SLURM") == "abc"
    with pytest.raises(InvalidArgument) as other:  # AIP-158: the same filter, or no token
        flt.decode_page_token(flt.encode_page_token("abc", "type=SLURM"), "type=RAY")
    assert "another filter" in str(other.value)
    for bad in ("", "zzz", "cDE6QUJD"):  # the last is "p1:ABC"
        with pytest.raises(InvalidArgument):
            flt.decode_page_token(bad)
    # an older server's p1 named no filter: one made up from a p2 token would page any filter
    legacy = tokens.encode("p1:abc")
    for text in ("", "type=RAY"):
        with pytest.raises(InvalidArgument):
            flt.decode_page_token(legacy, text)
    assert flt.page_size(0) == 100 and flt.page_size(5000) == 1000
    t = ResumeToken(42)
    assert ResumeToken.decode(t.encode()) == t
    assert ResumeToken.decode(ResumeToken(7, in_snapshot=True).encode()).in_snapshot
    for bad in ("", "!!", "Yzk6eA"):
        with pytest.raises(InvalidArgument) as ei2:
            ResumeToken.decode(bad)
        assert ei2.value.violations[0].field == "resume_token"
