# ruff: noqa: ASYNC109  -- tests wait on real processes
"""What idle WatchJobs streams cost a real JobManager (issue 18 item 3).

Opens 1,000 idle streams, checks JobManager's RSS growth per stream, closes
them (every handler ends: the streams gauge returns to 0), then opens and
closes 1,000 more, ROUNDS times: each round must reuse what the one before
freed, so a per-stream leak (a subscription, a task, a queue kept after close)
shows as growth in every round. One round's RSS moves by +-10 KiB per stream
on a loaded machine (allocator arenas, the C core's pools), so the growth is
averaged over the rounds: a leak grows with each, noise does not.
Bounds are generous (RSS is coarse, the machine is shared); the benchmark
(``bench/bench_scale.py --streams``) prints the figures next to bare grpc.aio.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import grpc
import pytest

from dlsched.v1 import job_manager_service_pb2 as pb
from dlsched.v1 import job_manager_service_pb2_grpc as pb_grpc
from dlsched.v1 import job_pb2
from tests import security
from tests.harness import EtcdServer, Stack, metrics_samples

N = 1000
PER_STREAM_KIB = 64  # target 30 (benchmark); bare grpc.aio ~24
LEAK_KIB = 5  # growth per stream allowed, averaged over ROUNDS rounds after the first closed
ROUNDS = 8


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


@pytest.fixture
def stack(etcd: EtcdServer) -> Iterator[Stack]:
    s = Stack(etcd, f"/dlsched-mem-{uuid.uuid4().hex[:8]}/",
              jm_args=["--metrics-listen", "127.0.0.1:0"])
    with s.running():
        yield s


def open_streams(svc, method: str = "WatchJobs") -> float:  # type: ignore[no-untyped-def]
    total = 0.0
    for key, v in metrics_samples(svc).items():
        if key.startswith("dlsched_rpc_streams_active{") and f'method="{method}"' in key:
            total += v
    return total


async def _open(stub: pb_grpc.JobManagerServiceStub, n: int) -> list[grpc.aio.UnaryStreamCall]:
    calls = []
    for start in range(0, n, 100):
        batch = [stub.WatchJobs(pb.WatchJobsRequest()) for _ in range(min(100, n - start))]
        firsts = await asyncio.gather(*(c.read() for c in batch))
        assert all(f.type == job_pb2.WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE for f in firsts)
        calls += batch
    return calls


async def _closed(stack: Stack, within: float = 60) -> None:
    assert stack.jm is not None
    deadline = time.monotonic() + within
    while open_streams(stack.jm) > 0:
        assert time.monotonic() < deadline, "stream handlers did not end"
        await asyncio.sleep(0.2)


async def test_idle_watch_streams_cost_little_and_are_given_back(stack: Stack) -> None:
    assert stack.jm is not None and stack.jm.proc is not None
    pid = stack.jm.proc.pid
    async with security.channel(stack.jm.address) as ch:
        stub = pb_grpc.JobManagerServiceStub(ch)
        for c in await _open(stub, 200):  # warm-up: code paths, pools
            c.cancel()
        await _closed(stack)
        await asyncio.sleep(1)

        before = rss_kib(pid)
        calls = await _open(stub, N)
        await asyncio.sleep(1)
        assert open_streams(stack.jm) == N
        grown = rss_kib(pid) - before
        assert grown / N <= PER_STREAM_KIB, f"{grown / N:.1f} KiB per idle WatchJobs stream"
        for c in calls:
            c.cancel()
        await _closed(stack)
        await asyncio.sleep(1)

        freed = rss_kib(pid)
        for _ in range(ROUNDS):
            for c in await _open(stub, N):
                c.cancel()
            await _closed(stack)
            await asyncio.sleep(1)
        again = (rss_kib(pid) - freed) / (ROUNDS * N)
        assert again <= LEAK_KIB, f"{again:.1f} KiB per stream kept after close"
