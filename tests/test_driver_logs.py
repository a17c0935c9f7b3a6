"""JobManager's side of driver log tails (``job_manager/driver_logs.py``) against
real gRPC servers in this process: a driver without MultiplexJobLogs (an older
one during an upgrade) is tailed with TailJobLogs calls, and a tail that fails
UNAVAILABLE before its first batch is opened again."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.rpc import status_pb2

from dlsched import errors
from dlsched.v1 import driver_service_pb2 as dpb
from dlsched.v1 import driver_service_pb2_grpc, job_pb2
from dlsched.v1 import job_manager_service_pb2 as jm_pb2
from drivers.common.logmux import LogMux
from job_manager.clients import DriverClient


def _batch(*texts: str) -> dpb.TailJobLogsResponse:
    return dpb.TailJobLogsResponse(entries=[job_pb2.LogEntry(role="main", text=t) for t in texts])


class OldDriver(driver_service_pb2_grpc.DriverServiceServicer):
    """TailJobLogs only: MultiplexJobLogs is the generated UNIMPLEMENTED."""

    def __init__(self) -> None:
        self.tails = 0

    async def TailJobLogs(self, request: Any, context: Any) -> AsyncIterator[dpb.TailJobLogsResponse]:  # noqa: N802
        self.tails += 1
        yield _batch("a", request.job.job_id)


class FlakyDriver(driver_service_pb2_grpc.DriverServiceServicer):
    """MultiplexJobLogs whose first two streams fail UNAVAILABLE before any batch."""

    def __init__(self) -> None:
        self.streams = 0

    async def MultiplexJobLogs(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        self.streams += 1
        if self.streams <= 2:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")

        async def tail(req: dpb.TailJobLogsRequest) -> AsyncIterator[dpb.TailJobLogsResponse]:
            yield _batch("b", req.job.job_id)

        async with contextlib.aclosing(LogMux(tail).run(request_iterator)) as responses:
            async for resp in responses:
                yield resp


async def _serve(servicer: Any) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    driver_service_pb2_grpc.add_DriverServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _texts(client: DriverClient, job_id: str) -> list[str]:
    return [e.text async for batch in client.tail_logs("clusters/c", job_id, "", jm_pb2.StreamJobLogsRequest())
            for e in batch]


async def test_a_driver_without_multiplex_is_tailed_with_tail_calls() -> None:
    old = OldDriver()
    server, address = await _serve(old)
    client = DriverClient(address)
    try:
        assert await _texts(client, "j1") == ["a", "j1"]
        assert await _texts(client, "j2") == ["a", "j2"]  # straight to TailJobLogs now
        assert old.tails == 2 and client._logs.unsupported  # noqa: SLF001
    finally:
        await client.close()
        await server.stop(None)


async def test_a_tail_that_failed_unavailable_before_any_batch_is_opened_again() -> None:
    flaky = FlakyDriver()
    server, address = await _serve(flaky)
    client = DriverClient(address)
    try:
        assert await _texts(client, "j1") == ["b", "j1"]
        assert flaky.streams == 3
        assert await _texts(client, "j2") == ["b", "j2"]  # the same stream
        assert flaky.streams == 3
    finally:
        await client.close()
        await server.stop(None)


class SlowBackendDriver(driver_service_pb2_grpc.DriverServiceServicer):
    """MultiplexJobLogs whose every tail ends with the backend's own UNAVAILABLE."""

    def __init__(self) -> None:
        self.tails = 0

    async def MultiplexJobLogs(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        async def tail(req: dpb.TailJobLogsRequest) -> AsyncIterator[dpb.TailJobLogsResponse]:
            self.tails += 1
            raise errors.Unavailable("the Ray dashboard agent did not answer in 10 s", reason="BACKEND_UNAVAILABLE")
            yield _batch()  # (a generator)

        async with contextlib.aclosing(LogMux(tail).run(request_iterator)) as responses:
            async for resp in responses:
                yield resp


async def test_a_tail_the_backend_could_not_serve_is_not_opened_again() -> None:
    """The driver's own BACKEND_UNAVAILABLE came after its timeout (10 s for a frozen Ray agent):
    opened 4 more times, a log read took ~1 minute and the client's deadline ran out first."""
    slow = SlowBackendDriver()
    server, address = await _serve(slow)
    client = DriverClient(address)
    try:
        with pytest.raises(errors.Unavailable) as ei:
            await _texts(client, "j1")
        assert ei.value.reason == "BACKEND_UNAVAILABLE" and slow.tails == 1, (ei.value, slow.tails)
    finally:
        await client.close()
        await server.stop(None)


class ScriptedDriver(driver_service_pb2_grpc.DriverServiceServicer):
    """MultiplexJobLogs that answers each open with ``script(tail_id)`` (ignoring
    credit) and records what the client sent; ``abort_after`` opens: UNAVAILABLE."""

    def __init__(self, script: Any, abort_after: int = 0) -> None:
        self.script = script
        self.abort_after = abort_after
        self.streams = 0
        self.received: list[dpb.MultiplexJobLogsRequest] = []
        self.ended = 0  # streams that ended (the client closed or cancelled them)

    async def MultiplexJobLogs(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        self.streams += 1
        opens = 0
        try:
            async for msg in request_iterator:
                self.received.append(msg)
                if msg.WhichOneof("action") != "open":
                    continue
                opens += 1
                for resp in self.script(msg.tail_id):
                    yield resp
                if self.abort_after and opens >= self.abort_after:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "driver restarting")
        finally:
            self.ended += 1


async def test_a_driver_that_breaks_the_protocol_ends_the_tail_not_jobmanagers_memory() -> None:
    """Batches past the credit end the tail (UNAVAILABLE LOG_STREAM_PROTOCOL)
    and close it, holding at most CREDIT; a message with neither batch nor end
    (a newer driver's) is skipped, not taken for the tail's end."""
    from job_manager import driver_logs

    def greedy(tid: int) -> list[dpb.MultiplexJobLogsResponse]:
        if tid == 1:  # 100 batches on a credit of 8
            return [dpb.MultiplexJobLogsResponse(tail_id=tid, batch=_batch(str(i))) for i in range(100)]
        return [dpb.MultiplexJobLogsResponse(tail_id=tid),
                dpb.MultiplexJobLogsResponse(tail_id=tid, batch=_batch("x")),
                dpb.MultiplexJobLogsResponse(tail_id=tid, end=status_pb2.Status(code=0))]

    drv = ScriptedDriver(greedy)
    server, address = await _serve(drv)
    mux = driver_logs.LogMux(driver_service_pb2_grpc.DriverServiceStub(grpc.aio.insecure_channel(address)))
    try:
        tail = mux.open(dpb.TailJobLogsRequest(job=dpb.JobRef(job_id="j1")))
        deadline = asyncio.get_running_loop().time() + 30
        while not tail._end and asyncio.get_running_loop().time() < deadline:  # noqa: SLF001
            assert len(tail._batches) <= driver_logs.CREDIT  # noqa: SLF001
            await asyncio.sleep(0.01)
        with pytest.raises(errors.Unavailable) as e:
            while await tail.next() is not None:
                pass
        assert e.value.reason == "LOG_STREAM_PROTOCOL"
        assert any(m.tail_id == 1 and m.close for m in drv.received) or await _until(
            lambda: any(m.tail_id == 1 and m.close for m in drv.received))

        other = mux.open(dpb.TailJobLogsRequest(job=dpb.JobRef(job_id="j2")))
        got = []
        while (b := await asyncio.wait_for(other.next(), 30)) is not None:
            got += [x.text for x in b.entries]
        assert got == ["x"]
    finally:
        await mux.close()
        await server.stop(None)


async def _until(pred: Any, within: float = 30) -> bool:
    deadline = asyncio.get_running_loop().time() + within
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "not reached"
        await asyncio.sleep(0.02)
    return True


async def test_tails_spread_over_streams_and_each_ends_with_its_own_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Past TAILS_PER_STREAM another stream opens (a driver takes 20,000 per
    stream); an extra stream ends once its tails have, and every tail of a
    failed stream raises an exception of its own (one shared by all would
    hold every follower's frames)."""
    from job_manager import driver_logs

    monkeypatch.setattr(driver_logs, "TAILS_PER_STREAM", 2)
    drv = ScriptedDriver(lambda tid: [dpb.MultiplexJobLogsResponse(tail_id=tid, batch=_batch(str(tid)))])
    server, address = await _serve(drv)
    mux = driver_logs.LogMux(driver_service_pb2_grpc.DriverServiceStub(grpc.aio.insecure_channel(address)))
    try:
        tails = [mux.open(dpb.TailJobLogsRequest(job=dpb.JobRef(job_id=f"j{i}"))) for i in range(5)]
        for t in tails:
            assert (await asyncio.wait_for(t.next(), 30)) is not None
        assert drv.streams == 3
        for t in tails[2:]:  # the second and third streams' tails
            t.close()
        await _until(lambda: drv.ended == 2)  # the extra streams ended; the first stays
        tails[0].close()
        assert drv.ended == 2
        # tails the driver ends (the usual end: a job's lines all sent) end extra streams too
        drv.script = lambda tid: [dpb.MultiplexJobLogsResponse(tail_id=tid, batch=_batch(str(tid))),
                                  dpb.MultiplexJobLogsResponse(tail_id=tid, end=status_pb2.Status())]
        ended = [mux.open(dpb.TailJobLogsRequest(job=dpb.JobRef(job_id=f"e{i}"))) for i in range(4)]
        for t in ended:
            while await asyncio.wait_for(t.next(), 30) is not None:
                pass
        assert drv.streams == 5  # e0 beside tails[1] on the first stream, the rest on two new ones
        await _until(lambda: drv.ended == 4)

        # a stream that fails: each of its tails raises its own exception
        flaky = ScriptedDriver(lambda tid: [], abort_after=3)
        server2, address2 = await _serve(flaky)
        mux2 = driver_logs.LogMux(driver_service_pb2_grpc.DriverServiceStub(grpc.aio.insecure_channel(address2)))
        try:
            monkeypatch.setattr(driver_logs, "TAILS_PER_STREAM", 10)
            failing = [mux2.open(dpb.TailJobLogsRequest(job=dpb.JobRef(job_id=f"f{i}"))) for i in range(3)]
            raised = []
            for t in failing:
                with pytest.raises(errors.Unavailable) as e:
                    await asyncio.wait_for(t.next(), 30)
                raised.append(e.value)
            assert len({id(x) for x in raised}) == 3
        finally:
            await mux2.close()
            await server2.stop(None)
    finally:
        await mux.close()
        await server.stop(None)


async def test_a_driver_found_without_multiplex_is_asked_again_later_and_a_closed_mux_opens_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from job_manager import driver_logs

    class CountingOld(OldDriver):
        multiplex = 0

        def MultiplexJobLogs(self, request_iterator: Any, context: Any) -> Any:  # noqa: N802
            CountingOld.multiplex += 1
            return super().MultiplexJobLogs(request_iterator, context)  # the generated UNIMPLEMENTED

    monkeypatch.setattr(driver_logs, "UNSUPPORTED_SECONDS", 0.0)
    old = CountingOld()
    server, address = await _serve(old)
    client = DriverClient(address)
    try:
        assert await _texts(client, "j1") == ["a", "j1"]
        assert await _texts(client, "j2") == ["a", "j2"]
        assert CountingOld.multiplex == 2 and old.tails == 2  # asked again (the window was 0 s)
    finally:
        await client.close()
        await server.stop(None)
    with pytest.raises(errors.Unavailable) as e:
        client._logs.open(dpb.TailJobLogsRequest())  # noqa: SLF001
    assert e.value.reason == "SHUTTING_DOWN"
