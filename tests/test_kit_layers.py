"""The kit's server layers (metrics, drain, error mapping, authentication) wrap
every handler once, at registration, in the order gRPC's interceptors would
have: metrics outermost (they count the code the client sees), a service's own
layers innermost (they see the handler's exception before it is mapped).
A real grpc.aio server on loopback, called through a real channel."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dlsched.errors import NotFound
from dlsched.kit.handlers import WrappingInterceptor, rewrap
from dlsched.kit.metrics import RPC_REQUESTS
from dlsched.kit.server import Registration, ServerOptions, start_server
from dlsched.v1 import job_manager_service_pb2, job_pb2
from dlsched.v1 import job_manager_service_pb2_grpc as jm_grpc
from tests import security


class Recording(WrappingInterceptor):
    """A service's own layer: counts how often it wraps and what each call raised."""

    def __init__(self) -> None:
        super().__init__()
        self.wrapped: list[str] = []
        self.calls = 0
        self.raised: list[type[BaseException]] = []

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        raise AssertionError("the kit must not run a layer as a per-call interceptor")

    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        self.wrapped.append(method)
        if not handler.unary_unary:
            return handler
        inner = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            self.calls += 1
            try:
                return await inner(request, context)
            except BaseException as e:
                self.raised.append(type(e))
                raise

        return rewrap(handler, unary_unary=unary_unary)


class Servicer(jm_grpc.JobManagerServiceServicer):
    async def GetJob(self, request, context):  # noqa: N802
        if request.name == "jobs/missing":
            raise NotFound("job jobs/missing not found", metadata={"name": request.name})
        if request.name == "jobs/slow":  # waits on something that does not answer
            await asyncio.sleep(60)
        return job_manager_service_pb2.GetJobResponse(job=job_pb2.Job(name=request.name))

    async def StreamJobLogs(self, request, context):  # noqa: N802
        yield job_manager_service_pb2.StreamJobLogsResponse(resume_cursor="first")
        if request.name == "jobs/slow":  # the next batch waits on something that does not answer
            await asyncio.sleep(60)
        yield job_manager_service_pb2.StreamJobLogsResponse(resume_cursor="last")


def requests(code: str) -> float:
    return RPC_REQUESTS.labels("dlsched.v1.JobManagerService", "GetJob", code)._value.get()  # type: ignore[no-any-return]


@pytest.fixture
async def served() -> Any:
    layer = Recording()
    running = await start_server(
        ServerOptions(listen="127.0.0.1:0", tls=security.current().service_tls(), interceptors=[layer]),
        [Registration(jm_grpc.add_JobManagerServiceServicer_to_server, Servicer(),
                      "dlsched.v1.JobManagerService")], announce_as="layers")
    try:
        yield layer, running.address
    finally:
        await running.stop()


async def test_layers_wrap_once_per_method_in_interceptor_order(served: Any) -> None:
    layer, address = served
    # Every method of the service, health and reflection were wrapped once when registered.
    assert layer.wrapped.count("/dlsched.v1.JobManagerService/GetJob") >= 1
    wrapped_at_start = len(layer.wrapped)
    ok0, missing0 = requests("OK"), requests("NOT_FOUND")
    async with security.channel(address) as ch:
        stub = jm_grpc.JobManagerServiceStub(ch)
        for _ in range(5):
            got = await stub.GetJob(job_manager_service_pb2.GetJobRequest(name="jobs/a"), timeout=10)
            assert got.job.name == "jobs/a"
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.GetJob(job_manager_service_pb2.GetJobRequest(name="jobs/missing"), timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        # Health is registered through the same layers and still answers.
        health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert len(layer.wrapped) == wrapped_at_start  # nothing wrapped per call
    assert layer.calls == 7  # six GetJobs and the health check
    # The service's layer is inside the error mapping: it saw the handler's own exception ...
    assert layer.raised == [NotFound]
    # ... and the metrics are outside it: they counted the code the client got.
    assert (requests("OK") - ok0, requests("NOT_FOUND") - missing0) == (5, 1)


async def test_a_channel_with_a_token_sends_it_on_calls_of_every_kind() -> None:
    """The kit's client channel (``tls.channel(token=...)``) adds the bearer
    token to unary, server-, client- and bidi-streaming calls alike (grpc.aio
    files an interceptor under one kind; one missing kind went unauthenticated)."""
    from dlsched.kit import tls as tls_kit
    from dlsched.kit.channel import TokenSource

    seen: list[tuple[str, str]] = []

    def authz(context: grpc.aio.ServicerContext) -> str:
        return dict(context.invocation_metadata() or ()).get("authorization", "")

    async def uu(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        seen.append(("unary_unary", authz(context)))
        return request

    async def us(request: bytes, context: grpc.aio.ServicerContext) -> Any:
        seen.append(("unary_stream", authz(context)))
        yield request

    async def su(requests: Any, context: grpc.aio.ServicerContext) -> bytes:
        seen.append(("stream_unary", authz(context)))
        return b"".join([r async for r in requests])

    async def ss(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        seen.append(("stream_stream", authz(context)))
        async for r in requests:
            yield r

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.T", {
        "UU": grpc.unary_unary_rpc_method_handler(uu),
        "US": grpc.unary_stream_rpc_method_handler(us),
        "SU": grpc.stream_unary_rpc_method_handler(su),
        "SS": grpc.stream_stream_rpc_method_handler(ss),
    })])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async def two() -> Any:
            yield b"a"
            yield b"b"

        opts = tls_kit.TlsOptions(insecure=True)
        async with tls_kit.channel(f"127.0.0.1:{port}", opts, token=TokenSource(token="s3cret")) as ch:
            assert await ch.unary_unary("/t.T/UU")(b"x", timeout=30) == b"x"
            assert [r async for r in ch.unary_stream("/t.T/US")(b"y", timeout=30)] == [b"y"]
            assert await ch.stream_unary("/t.T/SU")(two(), timeout=30) == b"ab"
            assert [r async for r in ch.stream_stream("/t.T/SS")(two(), timeout=30)] == [b"a", b"b"]
    finally:
        await server.stop(None)
    assert sorted(seen) == sorted((kind, "Bearer s3cret") for kind in
                                  ("unary_unary", "unary_stream", "stream_unary", "stream_stream"))


async def test_a_call_its_server_cannot_finish_in_time_is_answered_before_its_deadline(
        served: Any) -> None:
    """A unary handler that would outlast its caller's deadline (a chain of waits on a frozen
    etcd or driver) is answered just before it: DEADLINE_EXCEEDED with an ErrorInfo
    (TIMED_OUT) saying why, not the caller's own DEADLINE_EXCEEDED with nothing in it."""
    from dlsched.kit.rpc_errors import error_info
    _, address = served
    async with security.channel(address) as ch:
        stub = jm_grpc.JobManagerServiceStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.GetJob(job_manager_service_pb2.GetJobRequest(name="jobs/slow"), timeout=4)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e.value
        info = error_info(e.value)
        assert info is not None and info.reason == "TIMED_OUT"
        # No deadline: the handler is not limited (a fast one answers as ever).
        got = await stub.GetJob(job_manager_service_pb2.GetJobRequest(name="jobs/a"))
        assert got.job.name == "jobs/a"
        # A stream too: what it sent arrives, then TIMED_OUT before the deadline (a log read
        # behind a frozen backend ran to the caller's bare DEADLINE_EXCEEDED)
        got_streamed: list[str] = []
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for r in stub.StreamJobLogs(job_manager_service_pb2.StreamJobLogsRequest(name="jobs/slow"),
                                              timeout=4):
                got_streamed.append(r.resume_cursor)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and got_streamed == ["first"], e.value
        info = error_info(e.value)
        assert info is not None and info.reason == "TIMED_OUT"
        fast = [r.resume_cursor async for r in stub.StreamJobLogs(
            job_manager_service_pb2.StreamJobLogsRequest(name="jobs/a"), timeout=30)]
        assert fast == ["first", "last"]
