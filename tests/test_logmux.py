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


async def test_a_client_that_stops_reading_opens_nothing_more_and_each_message_wakes_one_tail(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Opens wait for room like batches (each refused or quickly ended tail
    queued its end past the bound: 1,950 of 2,000 here), and a message taken
    off the queue wakes one waiting tail, not every one (each woken tail costs
    the driver's loop a task step)."""
    monkeypatch.setattr(logmux, "MAX_QUEUED", 10)
    monkeypatch.setattr(logmux, "MAX_TAILS", 50)
    opened = 0

    async def short(req: dpb.TailJobLogsRequest) -> AsyncIterator[dpb.TailJobLogsResponse]:
        nonlocal opened
        opened += 1
        yield dpb.TailJobLogsResponse(entries=[job_pb2.LogEntry(text=req.job.job_id)])

    hold = asyncio.Event()
    mux = logmux.LogMux(short)
    run = mux.run(_requests([_open(i, 1) for i in range(1, 2001)], hold))
    try:
        msgs = [await run.__anext__()]
        for _ in range(200):
            await asyncio.sleep(0)
        assert mux._out.qsize() <= 10 + 50, mux._out.qsize()  # noqa: SLF001 - the bound and an end per tail
        assert opened <= 50, opened
        waiting = len([w for w in mux._waiters if not w.done()])  # noqa: SLF001
        assert waiting >= 2, waiting
        msgs.append(await run.__anext__())
        woken = waiting - len([w for w in mux._waiters if not w.done()])  # noqa: SLF001
        assert woken == 1, woken
        # Reading on, every tail is answered once: its line and end, or refused.
        ends: dict[int, int] = {}

        def note(msg: dpb.MultiplexJobLogsResponse) -> None:
            if msg.HasField("end"):
                assert msg.tail_id not in ends
                ends[msg.tail_id] = msg.end.code

        for msg in msgs:
            note(msg)
        while len(ends) < 2000:
            note(await asyncio.wait_for(run.__anext__(), 30))
        assert set(ends) == set(range(1, 2001)) and set(ends.values()) <= {0, 8}
        assert opened == list(ends.values()).count(0) >= 50
    finally:
        hold.set()
        await run.aclose()


def test_batches_are_split_by_bytes_and_long_lines_into_pieces() -> None:
    from drivers.common import base, convert

    line = "x" * (convert.MAX_LINE_CHARS * 2 + 5)
    wide = "é" * 300_000  # 600,000 bytes in UTF-8
    entries = [base.LogEntry("main", 0, base.LogStream.STDOUT, t) for t in
               ["a", line, *[wide] * 4, "z"]]
    msgs = list(convert.log_batches_pb(entries))
    assert all(m.ByteSize() <= convert.BATCH_BYTES + 1024 for m in msgs), [m.ByteSize() for m in msgs]
    texts = [e.text for m in msgs for e in m.entries]
    # in order, the long line in pieces of MAX_LINE_CHARS, nothing lost
    assert "".join(texts) == "".join(e.text for e in entries)
    assert texts[1:4] == [line[:convert.MAX_LINE_CHARS], line[convert.MAX_LINE_CHARS:2 * convert.MAX_LINE_CHARS],
                          "xxxxx"]
    assert [len(t) for t in texts[4:8]] == [convert.MAX_LINE_CHARS] * 4
    # the same pieces each time (a resumed follower counts lines)
    assert [e.text for m in convert.log_batches_pb(entries) for e in m.entries] == texts
    assert list(convert.log_batches_pb([])) == []
    small = [base.LogEntry("main", 0, base.LogStream.STDOUT, "hello")] * 3
    assert len(list(convert.log_batches_pb(small))) == 1
