"""Server bootstrap shared by every dlsched service.

``run_server`` builds a grpc.aio server with the error interceptor, health
checking (grpc.health.v1) and reflection, binds the configured address (port 0
picks a free port), announces the bound address, serves until SIGTERM/SIGINT,
then drains (``Drain``): health NOT_SERVING, new calls refused with
UNAVAILABLE, every open stream ended at once with UNAVAILABLE / SHUTTING_DOWN
(its last message carries the resume point), unary calls in flight given the
grace period and those still running at its end failed with UNAVAILABLE too,
never CANCELLED: clients retry UNAVAILABLE, on this replica once restarted or
on another. With ``metrics_listen`` it also serves Prometheus ``/metrics``
(``kit.metrics``).

Keepalive: the server pings every connection after ``keepalive_seconds``
without activity and closes it when the PING is not answered within
``keepalive_timeout_seconds``, releasing its streams (a frozen or vanished
client). gRPC core waits ``grpc.http2.ping_timeout_ms`` (default 60 s) for
that answer, not ``grpc.keepalive_timeout_ms``; both are set.

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
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from dlsched import errors
from dlsched.kit import reflection
from dlsched.kit import tls as tls_kit
from dlsched.kit.handlers import (
    WrappingInterceptor,
    WrappingRegistrar,
    responses,
    rewrap,
    streaming,
    tolerant,
)
from dlsched.kit.memory import Trimmer
from dlsched.kit.metrics import MetricsEndpoint, MetricsInterceptor, serve_metrics
from dlsched.kit.parse import flag_number
from dlsched.kit.rpc_errors import (
    PASSTHROUGH,
    ErrorInterceptor,
    abort_with,
    call_budget,
    refuse_undecodable,
    status_for,
    timed_out,
    to_status,
)

log = logging.getLogger("dlsched.server")


def add_observability_flags(p: argparse.ArgumentParser) -> None:
    """``--log-format``, ``--metrics-listen`` and ``--trace-export``, the same on every service."""
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="json: one object per line with the job id (default text)")
    p.add_argument("--metrics-listen", metavar="HOST:PORT",
                   help="serve Prometheus /metrics here (port 0 picks one)")
    p.add_argument("--trace-export", metavar="otlp|console|file:PATH",
                   help="OpenTelemetry tracing (default: env DLSCHED_TRACE_EXPORT, else off)")


def add_keepalive_flags(p: argparse.ArgumentParser) -> None:
    """``--keepalive-seconds`` and ``--keepalive-timeout-seconds``."""
    p.add_argument("--keepalive-seconds", type=flag_number(float, 0, inclusive=False), default=30.0,
                   help="ping a connection after this long without activity (default 30)")
    p.add_argument("--keepalive-timeout-seconds", type=flag_number(float, 0, inclusive=False), default=10.0,
                   help="close a connection whose ping is not answered in this long, ending "
                        "its calls (default 10)")


@dataclass(frozen=True)
class ServerOptions:
    """How a service listens and stops."""

    listen: str = "127.0.0.1:0"
    port_file: str | None = None
    grace_seconds: float = 10.0
    # Ping idle connections after keepalive_seconds; close one whose ping is
    # not answered in keepalive_timeout_seconds (a dead or frozen peer).
    keepalive_seconds: float = 30.0
    keepalive_timeout_seconds: float = 10.0
    max_message_bytes: int = 8 * 1024 * 1024
    # The largest request a client may send. Far below max_message_bytes: gRPC reads a
    # message whole before any handler runs, and a 7 MB request left ~5 MB behind in the
    # process each time (20 of them: +150 MiB in a bare grpc.aio server), whatever the
    # handler did. The largest valid request (a SubmitJob spec of 256 KiB) fits 4 times.
    max_request_bytes: int = 1024 * 1024
    metrics_listen: str | None = None  # HOST:PORT for /metrics; None serves none
    extra_options: Sequence[tuple[str, Any]] = field(default_factory=tuple)
    # TLS (the default None is plaintext: tests of the kit itself only).
    tls: tls_kit.TlsOptions | None = None
    require_client_cert: bool = False  # mutual TLS (drivers)
    # Authentication of every call but health and reflection (dlsched.auth); each
    # wraps the handlers at registration (dlsched.kit.handlers.WrappingRegistrar).
    interceptors: Sequence[WrappingInterceptor] = field(default_factory=tuple)


@dataclass
class Registration:
    """One servicer to register: the generated ``add_*_to_server`` and the servicer."""

    add_to_server: Callable[[Any, Any], None]  # (servicer, a grpc.aio.Server or WrappingRegistrar)
    servicer: Any
    full_name: str  # e.g. "dlsched.v1.JobManagerService"


_HEALTH_CHECK = "/grpc.health.v1.Health/Check"


async def _shutting_down(context: grpc.aio.ServicerContext) -> None:
    st = to_status(errors.Unavailable("the server is shutting down; call again (any replica)",
                                      reason="SHUTTING_DOWN"))
    await context.abort_with_status(rpc_status.to_status(st))


class Drain(WrappingInterceptor):
    """Ends calls for a graceful stop with UNAVAILABLE, which clients retry,
    before ``grpc.aio.Server.stop`` would cancel them (CANCELLED, which they
    do not).

    ``begin()``: calls that arrive from now on are refused (health checks
    excepted: they answer NOT_SERVING) and every open stream ends now; the
    handler's generator is closed first, so its ``finally`` runs. ``expire()``:
    the unary calls still running are cancelled and fail. Both cancel the
    call's task where it waits inside the handler and turn that cancellation,
    caught here, into UNAVAILABLE (as ``asyncio.timeout`` turns its own into
    TimeoutError), with no task or event of their own per call; a cancellation
    that is not theirs (the client left) passes on to grpc."""

    #: ``settle`` waits for this many turns of ``QUIET_TURN_SECONDS`` without a new call.
    QUIET_TURNS = 6
    QUIET_TURN_SECONDS = 0.05

    def __init__(self, *, streams: bool = True) -> None:
        super().__init__()
        self.streams = streams  # False: ``StreamLayers`` drains the streaming handlers
        self.draining = False
        self._arrivals = 0  # calls that arrived while draining
        self._waiting: set[asyncio.Task[Any]] = set()  # streams waiting for their next item
        self._drained: set[asyncio.Task[Any]] = set()  # ... that begin() cancelled
        self._running: set[asyncio.Task[Any]] = set()  # unary calls in their handler
        self._expired: set[asyncio.Task[Any]] = set()  # ... that expire() cancelled
        self._unary = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.trimmer = Trimmer()  # closed streams' memory back to the system (``memory``)

    def begin(self) -> None:
        self.draining = True
        for task in list(self._waiting):
            self._drained.add(task)
            task.cancel()

    def expire(self) -> None:
        for task in list(self._running):
            self._expired.add(task)
            task.cancel()

    async def settle(self, timeout: float) -> bool:  # noqa: ASYNC109
        """Waits (at most ``timeout``) until no unary call is running and no
        call has arrived for a while (``QUIET_TURNS``); whether that happened.

        Only then may ``grpc.aio.Server.stop`` run: it refuses what comes
        later on the wire (clients retry that transparently) but cancels
        (CANCELLED) every call gRPC core has received and not yet handed to
        a handler, a backlog that exists while calls keep arriving."""
        # Quiet is counted in turns of the event loop, not in time alone: a
        # process that did not run for a while (a busy host) has not yet
        # taken in the calls that arrived meanwhile.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        quiet, seen = 0, -1
        while True:
            if self._unary == 0 and self._arrivals == seen:
                quiet += 1
                if quiet >= self.QUIET_TURNS:
                    return True
            else:
                quiet, seen = 0, self._arrivals
            left = deadline - loop.time()
            if left <= 0:
                return False
            await asyncio.sleep(min(self.QUIET_TURN_SECONDS, left))

    def _arrived(self) -> bool:
        """A call arrives: whether to refuse it (draining)."""
        if not self.draining:
            return False
        self._arrivals += 1
        return True

    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        if streaming(handler) and not self.streams:
            return handler
        refuse = method != _HEALTH_CHECK
        if handler.unary_unary:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if self._arrived() and refuse:
                    await _shutting_down(context)
                task = asyncio.current_task()
                assert task is not None
                self._unary += 1
                self._idle.clear()
                self._running.add(task)
                try:
                    return await inner_uu(request, context)
                except asyncio.CancelledError:
                    if task not in self._expired:
                        raise  # grpc's: the client left
                    task.uncancel()
                finally:
                    self._running.discard(task)
                    self._expired.discard(task)
                    self._unary -= 1
                    if self._unary == 0:
                        self._idle.set()
                await _shutting_down(context)  # expired: failed UNAVAILABLE

            return rewrap(handler, unary_unary=unary_unary)
        if streaming(handler):
            inner_us = streaming(handler)

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext,
                                   ) -> AsyncIterator[Any]:
                if self._arrived() and refuse:
                    await _shutting_down(context)
                # No task or event of its own per stream (thousands idle at
                # once): ``begin`` cancels this task where it waits for the
                # handler's next item, and the cancellation, caught here,
                # becomes UNAVAILABLE. Cancelled while gRPC sends an item,
                # the task is grpc's to report; so only waiting ones are.
                task = asyncio.current_task()
                assert task is not None
                source = cast(AsyncGenerator[Any, None], responses(inner_us(request, context)))
                try:
                    while not self.draining:
                        self._waiting.add(task)
                        try:
                            item = await source.__anext__()
                        except StopAsyncIteration:
                            return
                        except asyncio.CancelledError:
                            if task not in self._drained:
                                raise  # grpc's: the client left
                            task.uncancel()
                            break
                        finally:
                            self._waiting.discard(task)
                        yield item
                        del item  # not held while the stream waits for its next message
                finally:
                    self._drained.discard(task)
                    self.trimmer.ended()
                    aclose = getattr(source, "aclose", None)  # an async generator's (not any iterator's)
                    if aclose is not None:
                        await aclose()  # the handler's own finally runs here (if not yet)
                await _shutting_down(context)

            return rewrap(handler, unary_stream=unary_stream)
        return handler


class StreamLayers(WrappingInterceptor):
    """The kit's metrics, drain and error layers of a server- or bidi-streaming
    call in one generator, nested in that order as the three layers nest
    (unary calls get the layers themselves, built with ``streams=False``).
    Every generator between gRPC and the handler stays for the stream's life:
    an idle log follower cost JobManager 33.0 KiB with the three nested and
    29.4 KiB without them (bench_scale, 1,000 followers)."""

    def __init__(self, metrics: MetricsInterceptor, drain: Drain) -> None:
        super().__init__()
        self._metrics, self._drain = metrics, drain

    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        inner = streaming(handler)
        if inner is None:
            return handler
        active, done = self._metrics.stream_hooks(method)
        drain = self._drain
        refuse = method != _HEALTH_CHECK

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            start, err = time.perf_counter(), None
            active.inc()  # metrics: outermost, they count what the client sees
            try:
                if drain._arrived() and refuse:  # noqa: SLF001 - the drain layer's part
                    await _shutting_down(context)
                # Drain as in ``Drain.wrap``: ``begin`` cancels this task where it
                # waits for the next item, and that cancellation becomes UNAVAILABLE.
                task = asyncio.current_task()
                assert task is not None
                source: AsyncGenerator[Any, None] | None = None
                # The call's deadline, as for unary calls: a stream whose next message a slow
                # service holds past it ends DEADLINE_EXCEEDED TIMED_OUT just before it (a log
                # read behind a frozen backend ran to the client's bare DEADLINE_EXCEEDED)
                budget = call_budget(context)
                deadline = None if budget is None else asyncio.get_running_loop().time() + budget
                try:
                    try:
                        refuse_undecodable(request)  # the error layer's part, inside the drain's
                        source = cast(AsyncGenerator[Any, None], responses(inner(request, context)))
                        while not drain.draining:
                            drain._waiting.add(task)  # noqa: SLF001
                            try:
                                if deadline is None:
                                    item = await source.__anext__()
                                else:
                                    limit = asyncio.timeout_at(deadline)
                                    try:
                                        async with limit:
                                            item = await source.__anext__()
                                    except TimeoutError:
                                        if not limit.expired():
                                            raise
                                        raise timed_out() from None
                            except StopAsyncIteration:
                                return
                            except asyncio.CancelledError:
                                if task not in drain._drained:  # noqa: SLF001
                                    raise  # grpc's: the client left
                                task.uncancel()
                                break
                            finally:
                                drain._waiting.discard(task)  # noqa: SLF001
                            yield item
                            del item  # not held while the stream waits for its next message
                    finally:
                        drain._drained.discard(task)  # noqa: SLF001
                        drain.trimmer.ended()
                        aclose = getattr(source, "aclose", None)  # an async generator's (not any iterator's)
                        if aclose is not None:
                            await aclose()  # the handler's own finally runs here (if not yet)
                except PASSTHROUGH:
                    raise
                except BaseException as exc:  # noqa: BLE001 - mapped to a status
                    await abort_with(context, status_for(exc, method))
                await _shutting_down(context)  # drained: UNAVAILABLE
            except BaseException as exc:
                err = exc
                raise
            finally:
                active.dec()
                done(context, start, err)

        return rewrap(handler, unary_stream=stream,
                      request_deserializer=tolerant(handler.request_deserializer))


class RunningServer:
    """A started server: its bound address, and a way to stop it."""

    def __init__(self, server: grpc.aio.Server, health_servicer: health.aio.HealthServicer,
                 address: str, names: list[str], grace: float,
                 metrics: MetricsEndpoint | None = None, drain: Drain | None = None) -> None:
        self.server = server
        self.health = health_servicer
        self.address = address
        self.names = names
        self.grace = grace
        self.metrics = metrics
        self.drain = drain or Drain()
        self._stopped = False
        self._trimming = asyncio.create_task(self.drain.trimmer.run(), name="malloc-trim")

    async def stop(self, before_stop: Callable[[], Awaitable[None]] | None = None) -> None:
        """Health NOT_SERVING; new calls refused and open streams ended with
        UNAVAILABLE; ``before_stop`` (a service's own stream endings); unary
        calls in flight get the grace period, then those still running fail
        UNAVAILABLE; once no call has come for a moment (or at the grace's
        end), ``server.stop``: GOAWAY, no new connections."""
        if self._stopped:
            return
        self._stopped = True
        self._trimming.cancel()
        for name in [*self.names, ""]:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.drain.begin()
        if before_stop is not None:
            try:
                await before_stop()
            except Exception:  # noqa: BLE001 - shutdown goes on
                log.exception("before_stop hook failed")
        if not await self.drain.settle(self.grace):
            log.warning("calls still running or arriving after the %.1fs grace: failing "
                        "those running UNAVAILABLE", self.grace)
            self.drain.expire()
        # What still runs now was failed UNAVAILABLE a moment ago; grpc
        # cancels only what is left after this grace.
        await self.server.stop(2.0)
        if self.metrics is not None:
            await asyncio.to_thread(self.metrics.close)


async def start_server(opts: ServerOptions, registrations: Sequence[Registration],
                       *, announce_as: str = "dlsched") -> RunningServer:
    """Build, bind and start a server; health reports SERVING for each service."""
    # gRPC keeps the first of duplicate keys: the caller's options go first.
    options = [
        *opts.extra_options,
        ("grpc.max_receive_message_length", opts.max_request_bytes),
        ("grpc.max_send_message_length", opts.max_message_bytes),
        # Request metadata: gRPC refuses metadata over its 8 KiB soft limit at random (more
        # often the nearer it is to the 16 KiB hard one), and a bearer token alone may be up to
        # 8 KiB (tokens.MAX_TOKEN_CHARS: a large OIDC token): 32 KiB, refused above 64 KiB.
        ("grpc.max_metadata_size", 32 * 1024),
        ("grpc.absolute_max_metadata_size", 64 * 1024),
        ("grpc.so_reuseport", 0),
        # Ping idle connections every 30 s, so a watch or log stream that is
        # quiet for minutes is not cut by a load balancer's idle timeout, and
        # a dead or frozen peer is noticed within 40 s (its calls end and
        # their handlers' finally runs); clients may ping every 10 s. gRPC
        # core applies ping_timeout (default 60 s), not keepalive_timeout, to
        # the keepalive PING's answer: both are set. With no limit on pings
        # without data, the server keeps pinging a client that only listens.
        ("grpc.keepalive_time_ms", int(opts.keepalive_seconds * 1000)),
        ("grpc.keepalive_timeout_ms", int(opts.keepalive_timeout_seconds * 1000)),
        ("grpc.http2.ping_timeout_ms", int(opts.keepalive_timeout_seconds * 1000)),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ]
    # Metrics outside the error mapping and the drain, so they count the
    # code the client sees.
    drain = Drain(streams=False)
    server = grpc.aio.server(options=options)
    # Every handler is registered already wrapped by these layers (as gRPC's
    # interceptors would wrap it, without their cost on every call).
    counting = MetricsInterceptor(streams=False)
    registrar = WrappingRegistrar(server, [StreamLayers(counting, drain), counting, drain,
                                           ErrorInterceptor(streams=False), *opts.interceptors])
    names = []
    for r in registrations:
        r.add_to_server(r.servicer, registrar)
        names.append(r.full_name)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, registrar)
    reflection.enable([*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name],
                      registrar)
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
    return RunningServer(server, health_servicer, address, names, opts.grace_seconds, metrics,
                         drain)


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
