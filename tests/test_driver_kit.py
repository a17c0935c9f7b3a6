"""The driver kit in-process: the observation hub, the planner, the servicer's
error mapping for optional capabilities, and recorded nvidia-smi output."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc
import pytest

from dlsched.errors import InvalidArgument, Unavailable
from dlsched.kit.rpc_errors import error_info
from dlsched.kit.server import Registration, ServerOptions, start_server
from dlsched.v1 import driver_service_pb2 as dpb
from dlsched.v1 import driver_service_pb2_grpc
from drivers.common import base, env
from drivers.common.hub import ObservationHub
from drivers.common.servicer import DriverServicer
from drivers.local import procfs
from tests import security


def obs(job_id: str, state: base.JobState = base.JobState.RUNNING) -> base.JobObservation:
    return base.JobObservation(job_id=job_id, found=True, state=state)


async def test_hub_sends_snapshot_marker_then_changes_without_a_gap():
    hub = ObservationHub()
    current = [obs("a")]
    it = hub.subscribe("clusters/c", lambda: list(current))
    first = await it.__anext__()
    hub.publish("clusters/c", obs("b"))  # published while the snapshot is being sent
    hub.publish("clusters/other", obs("x"))
    marker = await it.__anext__()
    change = await asyncio.wait_for(it.__anext__(), 1)
    assert first.observation.job_id == "a"
    assert marker.snapshot_complete and marker.observation is None
    assert change.observation.job_id == "b"
    await it.aclose()
    assert hub.subscriber_count("clusters/c") == 0


async def test_hub_ends_a_slow_subscriber_with_unavailable():
    hub = ObservationHub(max_pending=3)
    it = hub.subscribe("clusters/c", list)
    await it.__anext__()  # marker
    for i in range(5):
        hub.publish("clusters/c", obs(f"j{i}"))
    with pytest.raises(Unavailable) as ei:
        while True:
            await asyncio.wait_for(it.__anext__(), 1)
    assert ei.value.reason == "WATCH_OVERFLOW"


def test_planner_ranks_across_nodes():
    g = base.ReplicaGroup(role="worker", replicas=2, processes_per_replica=2, command=("train",))
    spec = base.JobSpec(run_mode=base.RunMode.MULTI_PROCESS, replica_groups=(g,))
    places = [env.Placement("worker", 0, "n0", 0), env.Placement("worker", 1, "n1", 1)]
    plan = env.plan_processes("j", spec, places, master_port=1234)
    got = [(p.env["RANK"], p.env["LOCAL_RANK"], p.env["NODE_RANK"], p.env["LOCAL_WORLD_SIZE"],
            p.env["DLSCHED_REPLICA_INDEX"], p.env["MASTER_ADDR"]) for p in plan]
    assert got == [("0", "0", "0", "2", "0", "n0"), ("1", "1", "0", "2", "0", "n0"),
                   ("2", "0", "1", "2", "1", "n0"), ("3", "1", "1", "2", "1", "n0")]
    assert {p.env["WORLD_SIZE"] for p in plan} == {"4"}


def test_planner_checks_run_mode_structure():
    g = base.ReplicaGroup(role="main", replicas=1, command=("x",))
    with pytest.raises(InvalidArgument) as ei:
        env.check_run_mode(base.JobSpec(run_mode=base.RunMode.MULTI_PROCESS, replica_groups=(g,)))
    assert ei.value.violations[0].field == "spec.replica_groups[0].role"
    with pytest.raises(InvalidArgument) as ei:
        env.check_run_mode(base.JobSpec(run_mode=base.RunMode.PS_WORKER, replica_groups=(g,)))
    assert ei.value.violations[0].field == "spec.replica_groups[0].role"


class _MinimalDriver(base.Driver):
    """Only the required operations: tail_logs and usage stay unsupported."""

    name = "minimal"

    async def configure_cluster(self, config: base.ClusterConfig) -> base.ClusterInfo:
        return base.ClusterInfo(state=base.ClusterState.READY)

    async def remove_cluster(self, cluster: str, *, if_idle: bool = False) -> None:
        pass

    async def cluster_info(self, cluster: str) -> base.ClusterInfo:
        raise base.ClusterNotConfigured(cluster)

    async def render(self, cluster: str, job_id: str, spec: base.JobSpec) -> base.NativeSpec:
        return base.NativeSpec("text/plain", job_id)

    async def launch(self, cluster: str, job_id: str, spec: base.JobSpec, attempt: int,
                     uid: str = "") -> base.LaunchResult:
        raise NotImplementedError

    async def observe(self, cluster: str, refs: Sequence[base.JobRef]) -> list[base.JobObservation]:
        return [base.JobObservation.not_found(r) for r in refs]

    async def _watch(self) -> AsyncIterator[base.WatchEvent]:
        yield base.WatchEvent(snapshot_complete=True)

    def watch(self, cluster: str) -> AsyncIterator[base.WatchEvent]:
        return self._watch()

    async def terminate(self, cluster: str, ref: base.JobRef, grace_seconds: float | None) -> base.JobObservation:
        return base.JobObservation.not_found(ref)

    async def cleanup(self, cluster: str, ref: base.JobRef) -> None:
        pass


async def test_servicer_maps_optional_capabilities_to_unimplemented_unsupported():
    running = await start_server(ServerOptions(tls=security.current().service_tls()), [Registration(
        driver_service_pb2_grpc.add_DriverServiceServicer_to_server, DriverServicer(_MinimalDriver()),
        DriverServicer.FULL_NAME)], announce_as="test-driver")
    try:
        async with security.channel(running.address) as ch:
            stub = driver_service_pb2_grpc.DriverServiceStub(ch)
            ref = dpb.JobRef(job_id="j")
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await stub.MeasureJobUsage(dpb.MeasureJobUsageRequest(cluster="c", job=ref), timeout=5)
            assert ei.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert error_info(ei.value).reason == "UNSUPPORTED"
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                async for _ in stub.TailJobLogs(dpb.TailJobLogsRequest(cluster="c", job=ref), timeout=5):
                    pass
            assert ei.value.code() == grpc.StatusCode.UNIMPLEMENTED
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await stub.GetClusterInfo(dpb.GetClusterInfoRequest(cluster="c"), timeout=5)
            assert error_info(ei.value).reason == "CLUSTER_NOT_CONFIGURED"
            assert error_info(ei.value).metadata["cluster"] == "clusters/c"
            resp = await stub.BatchGetJobObservations(
                dpb.BatchGetJobObservationsRequest(cluster="c", jobs=[ref]), timeout=5)
            assert [o.found for o in resp.observations] == [False]
    finally:
        await running.stop()


def test_nvidia_smi_output_parses_to_gpu_types():
    recorded = "NVIDIA H200, 143771\nNVIDIA A100-SXM4-80GB, 81920\nNVIDIA GeForce RTX 4090, 24564\n"
    assert procfs.parse_nvidia_smi(recorded) == [
        ("h200", 143771 << 20), ("a100", 81920 << 20), ("rtx-4090", 24564 << 20)]
    assert procfs.parse_nvidia_smi("") == []


async def test_the_registry_knows_since_when_a_cluster_is_watched_past_its_snapshot() -> None:
    """``observed_since``: when the newest watch open got through its snapshot, gone when
    the last closes (the Slurm driver's stray rule waits on it for JobManager to have
    claimed its jobs)."""
    import contextlib

    from drivers.common.registry import ClusterRegistry

    reg: ClusterRegistry[object] = ClusterRegistry(ObservationHub())
    await reg.configure("clusters/a", lambda old: object())
    assert reg.observed_since("clusters/a") is None
    first = reg.watch("clusters/a", lambda c: [])
    ev = await first.__anext__()
    assert ev.snapshot_complete and reg.observed_since("clusters/a") is None  # the marker not yet taken
    pending = asyncio.ensure_future(first.__anext__())
    await asyncio.sleep(0)
    since = reg.observed_since("clusters/a")
    assert since is not None
    await asyncio.sleep(0.01)
    second = reg.watch("clusters/a", lambda c: [])
    await second.__anext__()
    later = asyncio.ensure_future(second.__anext__())
    await asyncio.sleep(0)
    newest = reg.observed_since("clusters/a")
    assert newest is not None and newest > since  # the newest watch's (a new owner's beside a dead one)
    pending.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await pending
    await first.aclose()
    assert reg.observed_since("clusters/a") == newest  # the second watch is still open
    later.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await later
    await second.aclose()
    assert reg.observed_since("clusters/a") is None


def test_numeric_service_flags_are_finite_and_in_range(capsys: pytest.CaptureFixture[str]) -> None:
    """An interval of 0 spins, a channel count of 0 waits forever, and NaN passes every
    range check: each flag is refused at start, naming it (every driver's config, as the
    kit builds its flags, and JobManager's and ClusterManager's own)."""
    from cluster_manager.__main__ import parse_args as cm_args
    from drivers.common.main import parse_config
    from drivers.kubernetes.driver import KubernetesConfig
    from drivers.local.driver import LocalConfig
    from drivers.ray.driver import RayConfig
    from drivers.slurm.config import SlurmConfig
    from job_manager.__main__ import parse_args as jm_args

    _, k = parse_config("kubernetes", ["--qps", "2.5", "--grace-seconds", "0", "--max-log-readers", "2"],
                        KubernetesConfig)
    assert k is not None and (k.qps, k.grace_seconds, k.max_log_readers) == (2.5, 0.0, 2)
    _, s = parse_config("slurm", ["--max-log-streams", "0"], SlurmConfig)
    assert s is not None and s.max_log_streams == 0
    jm = ["--etcd", "127.0.0.1:1", "--cluster-manager", "127.0.0.1:2", "--no-auth"]
    cm = ["--etcd", "127.0.0.1:1", "--no-auth"]
    refused = [
        (lambda a: parse_config("kubernetes", a, KubernetesConfig), ["--qps", "0"], "--qps"),
        (lambda a: parse_config("kubernetes", a, KubernetesConfig), ["--request-timeout", "nan"], "--request-timeout"),
        (lambda a: parse_config("kubernetes", a, KubernetesConfig), ["--max-log-readers", "1"], "--max-log-readers"),
        (lambda a: parse_config("kubernetes", a, KubernetesConfig), ["--burst", "1.5"], "--burst"),
        (lambda a: parse_config("slurm", a, SlurmConfig), ["--max-channels", "0"], "--max-channels"),
        (lambda a: parse_config("slurm", a, SlurmConfig), ["--poll-interval", "-2"], "--poll-interval"),
        (lambda a: parse_config("ray", a, RayConfig), ["--poll-interval", "inf"], "--poll-interval"),
        (lambda a: parse_config("local", a, LocalConfig), ["--grace-seconds", "-1"], "--grace-seconds"),
        (lambda a: jm_args([*jm, *a]), ["--stop-grace-seconds", "nan"], "--stop-grace-seconds"),
        (lambda a: jm_args([*jm, *a]), ["--keepalive-seconds", "0"], "--keepalive-seconds"),
        (lambda a: jm_args([*jm, *a]), ["--owner-ttl", "1"], "--owner-ttl"),
        (lambda a: cm_args([*cm, *a]), ["--monitor-interval", "nan"], "--monitor-interval"),
        (lambda a: cm_args([*cm, *a]), ["--driver-timeout", "0"], "--driver-timeout"),
    ]
    for parse, argv, flag in refused:
        capsys.readouterr()
        with pytest.raises(SystemExit):
            parse(argv)
        assert f"argument {flag}:" in capsys.readouterr().err, argv


async def test_concurrent_configurations_of_a_cluster_replace_and_drop_each_record_once() -> None:
    """Two ConfigureCluster calls of one cluster overlap (an old ClusterManager leader resumed
    from SIGSTOP configures beside the new one): each record that was installed and replaced is
    dropped exactly once, and the one installed at the end is not dropped. Without the kit's
    per-cluster lock both read no old record, both installed theirs, and the first one, already
    activated, was replaced without being dropped (its connections and poller leaked)."""
    from drivers.common.skeleton import BackendDriver

    gate = asyncio.Event()

    class Record:
        def __init__(self, address: str) -> None:
            self.address = address

    class Probe(BackendDriver[Record, None]):  # type: ignore[type-var]
        name = "probe"

        def __init__(self) -> None:
            super().__init__()
            self.built: list[Record] = []
            self.dropped: list[Record] = []
            self.active: list[Record] = []

        async def _connect(self, config: base.ClusterConfig, old: Record | None) -> Record:
            r = Record(config.address)
            self.built.append(r)
            await gate.wait()  # both calls are building at once
            return r

        async def _disconnect(self, c: Record) -> None:
            self.dropped.append(c)

        async def _activate(self, name: str, c: Record) -> None:
            self.active.append(c)

        async def _info(self, c: Record) -> base.ClusterInfo:
            return base.ClusterInfo(state=base.ClusterState.READY)

    for method in ("_prepare", "_known", "_submit", "_snapshot", "_observe", "_lookup", "_terminate", "_cleanup"):
        setattr(Probe, method, None)
    Probe.__abstractmethods__ = frozenset()
    d = Probe()
    calls = [asyncio.ensure_future(d.configure_cluster(base.ClusterConfig(name="clusters/p", address=a)))
             for a in ("http://a", "http://b")]
    await asyncio.sleep(0.1)
    gate.set()
    await asyncio.gather(*calls)
    current = d.clusters.get("clusters/p")
    assert current is not None and current not in d.dropped
    assert sorted(id(r) for r in d.dropped) == sorted(id(r) for r in d.built if r is not current)
    assert len(d.active) == 2 and len(d.dropped) == 1


async def test_cluster_info_of_a_backend_that_does_not_answer_is_bounded_by_the_kit() -> None:
    """The kit bounds every backend's ``_info`` (GetClusterInfo, ConfigureCluster's answer)
    below ClusterManager's deadline: a backend that never answers is UNREACHABLE, one that
    answered READY before is DEGRADED with that capacity and run modes (jobs wait for it), and
    a new record (reconfigured) does not inherit the old one's answer."""
    from drivers.common.skeleton import BackendDriver

    class Record:
        def __init__(self, address: str) -> None:
            self.address = address

    class Probe(BackendDriver[Record, None]):  # type: ignore[type-var]
        name = "probe"
        backend_noun = "the probe's head"
        info_budget = 0.3

        def __init__(self) -> None:
            super().__init__()
            self.frozen = True

        async def _connect(self, config: base.ClusterConfig, old: Record | None) -> Record:
            return Record(config.address)

        def _modes(self, c: Record) -> tuple[base.RunMode, ...]:
            return (base.RunMode.SINGLE_PROCESS,)

        async def _info(self, c: Record) -> base.ClusterInfo:
            if self.frozen:
                await asyncio.Event().wait()  # never answers
            return base.ClusterInfo(state=base.ClusterState.READY, capacity=base.ClusterCapacity(cpus_total=8),
                                    supported_run_modes=(base.RunMode.SINGLE_PROCESS,), driver_version="probe/1")

    for method in ("_prepare", "_known", "_submit", "_snapshot", "_observe", "_lookup", "_terminate", "_cleanup"):
        setattr(Probe, method, None)
    Probe.__abstractmethods__ = frozenset()
    d = Probe()
    name = "clusters/p"
    first = await d.configure_cluster(base.ClusterConfig(name=name, address="http://a"))
    assert first.state is base.ClusterState.UNREACHABLE, first
    assert first.message == "the probe's head did not answer in 0.3s" and first.driver_version.startswith("probe/")
    assert first.supported_run_modes == (base.RunMode.SINGLE_PROCESS,)  # (ClusterManager keeps what it says)
    d.frozen = False
    ready = await d.cluster_info(name)
    assert ready.state is base.ClusterState.READY and ready.capacity.cpus_total == 8
    d.frozen = True
    slow = await d.cluster_info(name)
    assert slow.state is base.ClusterState.DEGRADED, slow
    assert (slow.capacity.cpus_total, slow.supported_run_modes) == (8, (base.RunMode.SINGLE_PROCESS,))
    assert "did not answer" in slow.message
    again = await d.configure_cluster(base.ClusterConfig(name=name, address="http://b"))  # a new record
    assert again.state is base.ClusterState.UNREACHABLE, again
    d.frozen = False
    assert (await d.cluster_info(name)).state is base.ClusterState.READY
    await d.remove_cluster(name)
    assert name not in d._last_ready


async def test_a_large_job_renders_off_the_event_loop() -> None:
    """A driver renders a job of many processes in a worker thread (``render_off_loop``): its
    native spec can be megabytes, and rendered in the loop it held every cluster's calls (a
    PS_WORKER job of 2 x 1,000 tasks held the Slurm driver for 27 s). A small one renders
    in place."""
    import threading

    from drivers.common.skeleton import RENDER_INLINE_PROCESSES, render_off_loop

    def spec_of(replicas: int) -> base.JobSpec:
        return base.JobSpec(run_mode=base.RunMode.MULTI_PROCESS, replica_groups=(
            base.ReplicaGroup(role="worker", replicas=replicas, command=("x",)),))

    def where(tag: str) -> tuple[str, int]:
        return tag, threading.get_ident()

    main = threading.get_ident()
    assert await render_off_loop(spec_of(2), where, "small") == ("small", main)
    tag, ident = await render_off_loop(spec_of(RENDER_INLINE_PROCESSES + 1), where, "large")
    assert tag == "large" and ident != main


def test_ps_worker_tf_config_counts_in_the_expanded_bound() -> None:
    """Each PS_WORKER task's TF_CONFIG names every task: bytes square in the tasks. A 49-byte
    spec of 1,000 ps and 1,000 workers rendered 187 MB; the bound now counts it."""
    from dlsched import spec_rules
    from dlsched.v1 import job_pb2

    def ps(n: int) -> job_pb2.JobSpec:
        return job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_PS_WORKER, replica_groups=[
            job_pb2.ReplicaGroup(role="ps", replicas=n, command=["true"]),
            job_pb2.ReplicaGroup(role="worker", replicas=n, command=["true"])])
    assert spec_rules.check_bounds(ps(200)) == []
    for n in (400, 1000, 10_000):
        vs = spec_rules.check_bounds(ps(n))
        assert [v.field for v in vs] == ["spec.replica_groups"] and "TF_CONFIG" in vs[0].description, n


async def test_a_slow_nvidia_smi_cut_off_by_a_caller_still_fills_the_gpu_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """The local driver's GPU inventory under GetClusterInfo's bound: a cold nvidia-smi slower
    than the bound was cancelled with its caller, asked again and cut off again on every call
    (the host never READY). The question now outlives a caller cut off, is asked once, and
    the next caller gets its answer."""
    from drivers.local import procfs, usage

    asked = 0
    release = asyncio.Event()

    async def slow_smi(limit_s: float = 5.0) -> list[tuple[str, int]]:
        nonlocal asked
        asked += 1
        await release.wait()
        return [("a100", 80 * 2**30)]

    monkeypatch.setattr(procfs, "nvidia_gpus", slow_smi)
    gpus = usage.Gpus()
    for _ in range(3):
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(gpus.get(), 0.05)  # cut off, as the kit's bound does
    release.set()
    assert await gpus.get() == [("a100", 80 * 2**30)]
    assert await gpus.get() == [("a100", 80 * 2**30)] and asked == 1
