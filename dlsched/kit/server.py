"""Server bootstrap shared by every dlsched service.

``run_server`` builds a grpc.aio server with the error interceptor, health
checking (grpc.health.v1) and reflection, binds the configured address (port 0
picks a free port), announces the bound address, serves until SIGTERM/SIGINT,
then flips health to NOT_SERVING and stops with a grace period. With
``metrics_listen`` it also serves Prometheus ``/metrics`` (``kit.metrics``).

The bound address is announced two ways so tests and supervisors never need a
fixed port: a line ``DLSCHED_LISTENING <service> <host:port>`` on stdout, and,
when ``port_file`` is set, the ``host:port`` written atomically to that file.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dlsched.kit import reflection
from dlsched.kit import tls as tls_kit
from dlsched.kit.metrics import MetricsEndpoint, MetricsInterceptor, serve_metrics
from dlsched.kit.rpc_errors import ErrorInterceptor

log = logging.getLogger("dlsched.server")


def add_observability_flags(p: argparse.ArgumentParser) -> None:
    """``--log-format``, ``--metrics-listen`` and ``--trace-export``, the same on every service."""
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="json: one object per line with the job id (default text)")
    p.add_argument("--metrics-listen", metavar="HOST:PORT",
                   help="serve Prometheus /metrics here (port 0 picks one)")
    p.add_argument("--trace-export", metavar="otlp|console|file:PATH",
                   help="OpenTelemetry tracing (default: env DLSCHED_TRACE_EXPORT, else off)")


@dataclass(frozen=True)
class ServerOptions:
    """How a service listens and stops."""

    listen: str = "127.0.0.1:0"
    port_file: str | None = None
    grace_seconds: float = 10.0
    max_message_bytes: int = 8 * 1024 * 1024
    metrics_listen: str | None = None  # HOST:PORT for /metrics; None serves none
    extra_options: Sequence[tuple[str, Any]] = field(default_factory=tuple)
    # TLS (the default None is plaintext: tests of the kit itself only).
    tls: tls_kit.TlsOptions | None = None
    require_client_cert: bool = False  # mutual TLS (drivers)
    # Authentication of every call but health and reflection (dlsched.auth).
    interceptors: Sequence[grpc.aio.ServerInterceptor] = field(default_factory=tuple)


@dataclass
class Registration:
    """One servicer to register: the generated ``add_*_to_server`` and the servicer."""

    add_to_server: Callable[[Any, grpc.aio.Server], None]
    servicer: Any
    full_name: str  # e.g. "dlsched.v1.JobManagerService"


class RunningServer:
    """A started server: its bound address, and a way to stop it."""

    def __init__(self, server: grpc.aio.Server, health_servicer: health.aio.HealthServicer,
                 address: str, names: list[str], grace: float,
                 metrics: MetricsEndpoint | None = None) -> None:
        self.server = server
        self.health = health_servicer
        self.address = address
        self.names = names
        self.grace = grace
        self.metrics = metrics
        self._stopped = False

    async def stop(self, before_stop: Callable[[], Awaitable[None]] | None = None) -> None:
        """Health NOT_SERVING, then ``before_stop`` (e.g. end open streams), then
        ``server.stop(grace)``: in-flight unary calls get the grace period."""
        if self._stopped:
            return
        self._stopped = True
        for name in [*self.names, ""]:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if before_stop is not None:
            try:
                await before_stop()
            except Exception:  # noqa: BLE001 - shutdown goes on
                log.exception("before_stop hook failed")
        await self.server.stop(self.grace)
        if self.metrics is not None:
            await asyncio.to_thread(self.metrics.close)


async def start_server(opts: ServerOptions, registrations: Sequence[Registration],
                       *, announce_as: str = "dlsched") -> RunningServer:
    """Build, bind and start a server; health reports SERVING for each service."""
    # gRPC keeps the first of duplicate keys: the caller's options go first.
    options = [
        *opts.extra_options,
        ("grpc.max_receive_message_length", opts.max_message_bytes),
        ("grpc.max_send_message_length", opts.max_message_bytes),
        ("grpc.so_reuseport", 0),
        # Ping idle connections every 30 s, so a watch or log stream that is
        # quiet for minutes is not cut by a load balancer's idle timeout, and
        # a dead peer is noticed within 40 s; clients may ping every 10 s.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ]
    # Metrics outside the error mapping, so they count the code the client sees.
    server = grpc.aio.server(
        interceptors=[MetricsInterceptor(), ErrorInterceptor(), *opts.interceptors], options=options)
    names = []
    for r in registrations:
        r.add_to_server(r.servicer, server)
        names.append(r.full_name)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable([*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name], server)
    host, _, port = opts.listen.rpartition(":")
    bound = tls_kit.bind(server, opts.listen, opts.tls or tls_kit.TlsOptions(insecure=True),
                     require_client_cert=opts.require_client_cert, service=announce_as)
    if bound == 0:
        raise OSError(f"cannot bind {opts.listen}")
    await server.start()
    address = f"{host or '127.0.0.1'}:{bound}"
    for name in [*names, ""]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    metrics = None
    if opts.metrics_listen:
        metrics = serve_metrics(opts.metrics_listen, announce_as, opts.port_file)
    _announce(announce_as, address, opts.port_file)
    log.info("%s listening on %s", announce_as, address)
    return RunningServer(server, health_servicer, address, names, opts.grace_seconds, metrics)


def _announce(service: str, address: str, port_file: str | None) -> None:
    print(f"DLSCHED_LISTENING {service} {address}", flush=True)
    if port_file:
        tmp = f"{port_file}.tmp"
        with open(tmp, "w") as f:
            f.write(address)
        os.replace(tmp, port_file)


async def serve_until_signal(
    running: RunningServer,
    *,
    before_stop: Callable[[], Awaitable[None]] | None = None,
    on_stop: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT, then shut down gracefully.

    ``before_stop`` runs once health is NOT_SERVING and before the grace
    period (a service ends its long-lived streams there, so clients reconnect
    at once); ``on_stop`` runs after the server has stopped (close clients).
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.ensure_future(running.server.wait_for_termination())
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    log.info("shutting down (grace %.1fs)", running.grace)
    try:
        await running.stop(before_stop)
    finally:
        if on_stop is not None:
            await on_stop()
        stopper.cancel()
        waiter.cancel()
