"""The driver kit's MultiplexJobLogs (``drivers/common/logmux.py``) in-process:
its bounds. (The contract suite runs it on every backend over real gRPC.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from dlsched.v1 import driver_service_pb2 as dpb
from dlsched.v1 import job_pb2
from drivers.common import logmux


def _open(tail_id: int, credit: int) -> dpb.MultiplexJobLogsRequest:
    return dpb.MultiplexJobLogsRequest(tail_id=tail_id, open=dpb.OpenTail(
        request=dpb.TailJobLogsRequest(cluster="clusters/c", job=dpb.JobRef(job_id=f"j{tail_id}")), credit=credit))


async def _requests(msgs: list[dpb.MultiplexJobLogsRequest], hold: asyncio.Event) -> AsyncIterator[object]:
    for m in msgs:
        yield m
    await hold.wait()  # the client keeps the stream open


async def test_a_stream_whose_reader_stops_stops_every_tail_at_the_queue_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logmux, "MAX_QUEUED", 10)
    made = 0

    async def endless(req: dpb.TailJobLogsRequest) -> AsyncIterator[dpb.TailJobLogsResponse]:
        nonlocal made
        while True:
            made += 1
            yield dpb.TailJobLogsResponse(entries=[job_pb2.LogEntry(text=str(made))])

    hold = asyncio.Event()
    run = logmux.LogMux(endless).run(_requests([_open(i, 1024) for i in (1, 2, 3)], hold))
    try:
        first = await run.__anext__()
        assert first.HasField("batch")
        for _ in range(50):  # let the tails run as far as they can
            await asyncio.sleep(0)
        assert made <= 10 + 1 + 3, made  # queued, taken, and one in each tail's hand
        got = [await run.__anext__() for _ in range(30)]  # reading again lets them go on
        assert all(g.HasField("batch") for g in got) and made >= 30
    finally:
        hold.set()
        await run.aclose()


async def test_a_tail_past_the_limit_ends_resource_exhausted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logmux, "MAX_TAILS", 2)

    async def quiet(req: dpb.TailJobLogsRequest) -> AsyncIterator[dpb.TailJobLogsResponse]:
        await asyncio.Event().wait()
        yield dpb.TailJobLogsResponse()  # pragma: no cover

    hold = asyncio.Event()
    run = logmux.LogMux(quiet).run(_requests([_open(1, 1), _open(2, 1), _open(3, 1)], hold))
    try:
        end = await asyncio.wait_for(run.__anext__(), 30)
        assert end.tail_id == 3 and end.end.code == 8  # RESOURCE_EXHAUSTED
    finally:
        hold.set()
        await run.aclose()
