"""One request costs memory in proportion to its own size (issue 16 item 4).

The local stack runs as real processes (etcd, ClusterManager, the local
driver, JobManager). Twenty SubmitJob requests of ~7 MB each are refused
RESOURCE_EXHAUSTED by gRPC itself (servers take requests up to 1 MiB:
``ServerOptions.max_request_bytes``; a bare grpc.aio server taking 7 MB
messages grows by ~150 MiB over twenty of them, whatever its handler does);
twenty of ~900 KB, under that bound, reach the handler and are refused
INVALID_ARGUMENT naming ``spec`` before the spec is converted; a dry-run of
the largest job the validator lets through (10,000 replicas x 10 processes,
the 100,000-process bound) is refused by the local driver before it plans a
process. JobManager's and the driver's resident memory stay within +50 MiB
of where they were (they grew by ~1.3 GiB and ~0.9 GiB before the bounds).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import grpc
import pytest

from dlsched.client import JobManagerClient
from dlsched.errors import InvalidArgument
from dlsched.kit.rpc_errors import error_info, field_violations
from dlsched.spec_rules import MAX_EXPANDED_BYTES, MAX_SPEC_BYTES, check_bounds
from dlsched.v1 import job_manager_service_pb2 as pb
from dlsched.v1 import job_manager_service_pb2_grpc as pb_grpc
from dlsched.v1 import job_pb2
from tests.harness import EtcdServer, ServiceProcess, Stack

MIB = 1024 * 1024
ALLOWED_GROWTH = 50 * MIB


def rss(svc: ServiceProcess) -> int:
    assert svc.proc is not None
    with open(f"/proc/{svc.proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def stack(etcd: EtcdServer) -> Iterator[Stack]:
    s = Stack(etcd, f"/dlsched-mem-{uuid.uuid4().hex[:8]}/")
    with s.running():
        asyncio.run(s.register_local())
        yield s


def _group(**kw: object) -> job_pb2.ReplicaGroup:
    return job_pb2.ReplicaGroup(role="main", replicas=1, command=["true"], **kw)  # type: ignore[arg-type]


def huge_spec(size: int) -> job_pb2.JobSpec:
    """A spec of about ``size`` serialized bytes: many env values, each within the string bound."""
    value = "v" * 60_000
    env = {f"E{i}": value for i in range(size // 60_000 + 1)}
    return job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS,
                           replica_groups=[_group(env=env)])


def largest_spec(env_bytes: int = 10) -> job_pb2.JobSpec:
    """A job at the 100,000-process bound, each process with ``env_bytes`` of env."""
    return job_pb2.JobSpec(
        run_mode=job_pb2.RUN_MODE_MULTI_PROCESS,
        cluster_selector=job_pb2.ClusterSelector(cluster_type=job_pb2.CLUSTER_TYPE_LOCAL),
        replica_groups=[job_pb2.ReplicaGroup(role="worker", replicas=10_000, processes_per_replica=10,
                                             command=["true"], env={"E": "x" * env_bytes})])


def heaviest_valid(per_process: int, image: str = "") -> job_pb2.JobSpec:
    """A valid job just under MAX_EXPANDED_BYTES: replicas whose env is ``per_process`` bytes."""
    replicas = MAX_EXPANDED_BYTES // (per_process + 64)
    return job_pb2.JobSpec(
        run_mode=job_pb2.RUN_MODE_MULTI_PROCESS,
        replica_groups=[job_pb2.ReplicaGroup(role="worker", replicas=replicas, command=["true"],
                                             image=image, env={"E": "x" * per_process})])


async def _probe(stack: Stack) -> None:
    assert stack.jm is not None
    async with JobManagerClient(stack.jm.address) as client:
        stub = pb_grpc.JobManagerServiceStub(client.channel)
        big = huge_spec(7 * 1000 * 1000)
        assert big.ByteSize() > 7_000_000
        over = huge_spec(900 * 1000)
        assert 4 * MAX_SPEC_BYTES > over.ByteSize() > 3 * MAX_SPEC_BYTES

        async def refuse_big() -> None:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await stub.SubmitJob(pb.SubmitJobRequest(spec=big, request_id=uuid.uuid4().hex),
                                     timeout=60)
            assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, ei.value.details()
            assert "larger than max" in (ei.value.details() or "")

        async def refuse_over() -> None:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await stub.SubmitJob(pb.SubmitJobRequest(spec=over, request_id=uuid.uuid4().hex),
                                     timeout=60)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value.details()
            assert [v.field for v in field_violations(ei.value)] == ["spec"]

        async def refuse_dry_runs() -> None:
            # 100,000 processes x 60 KB of env: refused before anything expands it.
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await stub.SubmitJob(pb.SubmitJobRequest(spec=largest_spec(60_000),
                                                         request_id=uuid.uuid4().hex, dry_run=True),
                                     timeout=120)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value.details()
            assert [v.field for v in field_violations(ei.value)] == ["spec.replica_groups"]
            # The largest valid one: the local driver refuses it before it plans a process.
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await stub.SubmitJob(pb.SubmitJobRequest(spec=largest_spec(), request_id=uuid.uuid4().hex,
                                                         dry_run=True), timeout=120)
            assert ei.value.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                       grpc.StatusCode.FAILED_PRECONDITION), ei.value.details()
            assert error_info(ei.value) is not None

        # One of each first: the baseline is not any code path's first call (the growth the
        # bounds prevent is per request: ~4 MiB for each 7 MB request before them).
        ok = await stub.SubmitJob(pb.SubmitJobRequest(
            spec=job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS,
                                 replica_groups=[_group()]),
            request_id=uuid.uuid4().hex, dry_run=True), timeout=60)
        assert ok.dry_run.native_spec
        # A round first: what the allocator keeps after the first of these bursts is the baseline
        # (one round's growth was 15-50 MiB from run to run, 50.3 once in CI, with the bounds
        # holding); the growth the bounds prevent goes on with every round.
        async def round_() -> None:
            for _ in range(20):
                await refuse_big()
            for _ in range(20):
                await refuse_over()
            for _ in range(3):
                await refuse_dry_runs()
        await round_()
        before = (rss(stack.jm), rss(stack.driver))
        await round_()
        after = (rss(stack.jm), rss(stack.driver))

    for name, b, a in zip(("JobManager", "local driver"), before, after, strict=True):
        assert a - b <= ALLOWED_GROWTH, f"{name} grew {(a - b) / MIB:.1f} MiB ({b / MIB:.0f} -> {a / MIB:.0f})"


def test_oversized_and_largest_requests_cost_bounded_memory(stack: Stack) -> None:
    asyncio.run(_probe(stack))


def test_expansion_is_bounded_before_anything_expands() -> None:
    """replicas x processes x (command, args, env, working dir) over the bound is refused."""
    assert check_bounds(largest_spec()) == []
    over = check_bounds(largest_spec(60_000))
    assert [v.field for v in over] == ["spec.replica_groups"]
    assert str(MAX_EXPANDED_BYTES) in over[0].description
    assert check_bounds(heaviest_valid(60_000)) == []


@pytest.mark.parametrize("backend", ["slurm", "kubernetes"])
def test_renderers_of_the_heaviest_valid_job_stay_bounded(backend: str) -> None:
    """The renderers that copy env per process or per pod, at the bound: memory a small
    multiple of the bound (a 10-replica job of 200 KB env took Kubernetes' YAML 165 s
    and the Slurm script of 200 replicas 1.3 GiB before it)."""
    import tracemalloc

    from drivers.common import convert

    spec = convert.job_spec(heaviest_valid(60_000, "" if backend == "slurm" else "busybox"), True)
    tracemalloc.start()
    try:
        if backend == "slurm":
            from drivers.slurm import render as slurm_render
            # (a script this large is over Slurm's default max_script_size: refused unless the
            # cluster says its Slurm takes more, as here, to bound the renderer at the limit)
            with pytest.raises(InvalidArgument):
                slurm_render.render_job("heavy", spec, 1, {"partition": "debug"})
            tracemalloc.reset_peak()
            out = slurm_render.render_job("heavy", spec, 1, {
                "partition": "debug", "max_script_bytes": str(64 * MIB)}).native_spec()
        else:
            from drivers.kubernetes import render as k8s_render
            out = k8s_render.render_job("heavy", spec, 1, {"namespace": "default"}).native_spec()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(out.content) >= MAX_EXPANDED_BYTES // 2
    assert peak <= 12 * MAX_EXPANDED_BYTES, f"{peak / MIB:.0f} MiB"
