"""Prometheus metrics shared by every dlsched service (prometheus-client).

Every service serves ``/metrics`` over HTTP when started with
``--metrics-listen HOST:PORT`` (port 0 picks a free port; the bound address is
announced as ``DLSCHED_METRICS <service> <host:port>`` and written to
``<port-file>.metrics``). What each one counts:

- every service: ``dlsched_rpc_requests_total{service,method,code}``,
  ``dlsched_rpc_duration_seconds{service,method}`` (for a stream, its whole
  life) and ``dlsched_rpc_streams_active{service,method}``, recorded by
  ``MetricsInterceptor`` around the error interceptor, so the code is the one
  the client sees;
- JobManager: ``dlsched_jobs{state}`` (jobs in etcd by state);
- ClusterManager: ``dlsched_clusters{type,state}``;
- drivers: ``dlsched_backend_calls_total{backend,call,outcome}`` (every
  command, API or HTTP call a driver makes to its backend) and
  ``dlsched_driver_poll_duration_seconds{backend}`` (one status round).

Labels never carry a credential, a job id or anything else unbounded that a
client sends: the method label is the gRPC method name the server has
registered (unknown methods are ``unknown``), never user text.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import prometheus_client
from prometheus_client import Counter, Gauge, Histogram

from dlsched.kit.handlers import WrappingInterceptor, responses, rewrap, streaming

log = logging.getLogger("dlsched.metrics")

REGISTRY = prometheus_client.REGISTRY

RPC_REQUESTS = Counter(
    "dlsched_rpc_requests", "gRPC calls handled, by final status code", ["service", "method", "code"])
RPC_DURATION = Histogram(
    "dlsched_rpc_duration_seconds", "gRPC handling time (a stream: from open to end)", ["service", "method"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
RPC_STREAMS = Gauge(
    "dlsched_rpc_streams_active", "server streams open now", ["service", "method"])
JOBS = Gauge("dlsched_jobs", "jobs stored, by state", ["state"])
CLUSTERS = Gauge("dlsched_clusters", "clusters registered, by type and observed state", ["type", "state"])
BACKEND_CALLS = Counter(
    "dlsched_backend_calls", "commands, API or HTTP calls a driver made to its backend",
    ["backend", "call", "outcome"])
BACKEND_BYTES = Counter(
    "dlsched_backend_bytes_fetched", "bytes a driver read from its backend (log and usage files)",
    ["backend", "call"])
POLL_DURATION = Histogram(
    "dlsched_driver_poll_duration_seconds", "one status round of a driver's poller or watch", ["backend"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))


def backend_call(backend: str, call: str, ok: bool = True) -> None:
    """Count one call a driver made to its backend (``call`` is a fixed name, e.g. ``squeue``)."""
    BACKEND_CALLS.labels(backend, call, "ok" if ok else "error").inc()


def _split(method: str) -> tuple[str, str]:
    """``/dlsched.v1.JobManagerService/GetJob`` -> (``dlsched.v1.JobManagerService``, ``GetJob``)."""
    _, _, rest = method.partition("/")
    service, _, name = rest.partition("/")
    return service or "unknown", name or "unknown"


def _code(context: grpc.aio.ServicerContext, exc: BaseException | None) -> str:
    if isinstance(exc, asyncio.CancelledError):
        return "CANCELLED"
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return str(code.name)
    if isinstance(code, int):  # the aio context may hold the raw integer
        for c in grpc.StatusCode:
            if c.value[0] == code:
                return str(c.name)
    return "OK" if exc is None else "UNKNOWN"


class MetricsInterceptor(WrappingInterceptor):
    """Counts and times every unary and server-streaming call, by final code.
    With ``streams=False`` it leaves streaming handlers to ``StreamLayers``
    (``server.py``), which records them through ``stream_hooks``."""

    def __init__(self, *, streams: bool = True) -> None:
        super().__init__()
        self.streams = streams

    @staticmethod
    def _done(service: str, method: str) -> Callable[[grpc.aio.ServicerContext, float, BaseException | None], None]:
        # This method's children, looked up once (``labels`` takes a lock and builds a key per call).
        duration = RPC_DURATION.labels(service, method)
        requests: dict[str, Any] = {}

        def done(context: grpc.aio.ServicerContext, start: float, exc: BaseException | None) -> None:
            code = _code(context, exc)
            counter = requests.get(code)
            if counter is None:
                counter = requests[code] = RPC_REQUESTS.labels(service, method, code)
            counter.inc()
            duration.observe(time.perf_counter() - start)

        return done

    def stream_hooks(self, full_method: str) -> tuple[Any, Callable[[grpc.aio.ServicerContext, float,
                                                                     BaseException | None], None]]:
        """A streaming method's open-streams gauge and its end recorder ``done(context, start, exc)``."""
        service, method = _split(full_method)
        return RPC_STREAMS.labels(service, method), self._done(service, method)

    def wrap(self, handler: grpc.RpcMethodHandler, full_method: str) -> grpc.RpcMethodHandler:
        if streaming(handler) and not self.streams:
            return handler
        service, method = _split(full_method)
        done = self._done(service, method)

        if handler.unary_unary:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                start, err = time.perf_counter(), None
                try:
                    return await inner_uu(request, context)
                except BaseException as exc:
                    err = exc
                    raise
                finally:
                    done(context, start, err)

            return rewrap(handler, unary_unary=unary_unary)
        if streaming(handler):
            inner_us = streaming(handler)

            active = RPC_STREAMS.labels(service, method)

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                start, err = time.perf_counter(), None
                active.inc()
                try:
                    async for item in responses(inner_us(request, context)):
                        yield item
                        del item  # not held while the stream waits for its next message
                except BaseException as exc:
                    err = exc
                    raise
                finally:
                    active.dec()
                    done(context, start, err)

            return rewrap(handler, unary_stream=unary_stream)
        return handler


class MetricsEndpoint:
    """The ``/metrics`` HTTP server of one process (prometheus-client's own, on a thread)."""

    def __init__(self, httpd: Any, thread: Any) -> None:
        self._httpd, self._thread = httpd, thread
        host, port = httpd.server_address[:2]
        self.address = f"{host}:{port}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def serve_metrics(listen: str, service: str, port_file: str | None = None) -> MetricsEndpoint:
    """Serve ``/metrics`` on ``listen`` (HOST:PORT; port 0 picks one) and announce the address."""
    host, _, port = listen.rpartition(":")
    httpd, thread = prometheus_client.start_http_server(int(port), addr=host or "127.0.0.1",
                                                        registry=REGISTRY)
    endpoint = MetricsEndpoint(httpd, thread)
    print(f"DLSCHED_METRICS {service} {endpoint.address}", flush=True)
    if port_file:
        tmp = f"{port_file}.metrics.tmp"
        with open(tmp, "w") as f:
            f.write(endpoint.address)
        os.replace(tmp, f"{port_file}.metrics")
    log.info("%s metrics on http://%s/metrics", service, endpoint.address)
    return endpoint
