"""JobManager's side of driver log tails (``job_manager/driver_logs.py``) against
real gRPC servers in this process: a driver without MultiplexJobLogs (an older
one during an upgrade) is tailed with TailJobLogs calls, and a tail that fails
UNAVAILABLE before its first batch is opened again."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

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
