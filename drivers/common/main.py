"""``run_driver``: the ``python -m drivers.<backend>`` entry point.

Common flags: ``--listen HOST:PORT`` (port 0 picks one), ``--port-file F``,
``--log-level``. Driver flags come from the fields of the driver's frozen
config dataclass: field ``state_dir: str`` becomes ``--state-dir``, with the
field's default and ``metadata={"help": ...}``; ``bool`` fields become
``--flag/--no-flag``; an ``int`` or ``float`` must be finite and more than 0,
or at least its ``metadata["min"]``. The parsed values build that dataclass once, and
``driver_factory(config)`` builds the driver. Start-up: build the driver →
``driver.start()`` (reconcile) → serve ``dlsched.v1.DriverService`` with
health and reflection → on SIGTERM health NOT_SERVING, ``server.stop`` →
``driver.close()``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from dlsched.auth.authn import Authenticator
from dlsched.auth.interceptor import AuthInterceptor
from dlsched.kit import logs, tracing
from dlsched.kit.parse import flag_number
from dlsched.kit.server import (
    Registration,
    ServerOptions,
    add_observability_flags,
    serve_until_signal,
    start_server,
)
from dlsched.kit.tls import DEFAULT_CONTROL_PLANE, TlsOptions, add_tls_flags, tls_options_from_args
from dlsched.v1 import driver_service_pb2_grpc
from drivers.common.base import Driver
from drivers.common.servicer import DriverServicer

C = TypeVar("C")
log = logging.getLogger("dlsched.driver")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """How the driver process listens."""

    listen: str = "127.0.0.1:0"
    port_file: str | None = None
    log_level: str = "INFO"
    metrics_listen: str | None = None
    trace_export: str | None = None
    log_format: str = "text"
    tls: TlsOptions = TlsOptions(insecure=True)
    # Client-certificate names (CN or DNS SAN) that may call: the control plane only.
    allowed_clients: tuple[str, ...] = DEFAULT_CONTROL_PLANE


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _scalar(tp: Any) -> Any:
    """``str | None`` -> ``str``; other annotations as they are."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def build_parser(name: str, config_type: type[Any] | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m drivers.{name}",
                                description=f"dlsched {name} driver (dlsched.v1.DriverService)")
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to bind; port 0 picks one")
    p.add_argument("--port-file", default=None, help="write the bound HOST:PORT here")
    p.add_argument("--log-level", default="INFO")
    add_observability_flags(p)
    add_tls_flags(p)
    p.add_argument("--allowed-clients", default=",".join(DEFAULT_CONTROL_PLANE),
                   help="client-certificate names (CN or DNS SAN) allowed to call this driver "
                        "(default: job-manager,cluster-manager)")
    if config_type is not None:
        hints = typing.get_type_hints(config_type)
        for f in dataclasses.fields(config_type):
            tp = _scalar(hints[f.name])
            kw: dict[str, Any] = {"dest": f"cfg_{f.name}", "help": f.metadata.get("help", "")}
            if f.default is not dataclasses.MISSING:
                kw["default"] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                kw["default"] = f.default_factory()
            else:
                kw["required"] = True
            if tp is bool:
                p.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, **kw)
            elif tp in (int, float):  # more than 0, or at least the field's "min"
                p.add_argument(_flag(f.name), type=flag_number(tp, f.metadata.get("min", 0),
                                                               inclusive="min" in f.metadata), **kw)
            else:
                p.add_argument(_flag(f.name), type=tp, **kw)
    return p


def parse_config(name: str, argv: Sequence[str] | None,
                 config_type: type[C] | None) -> tuple[ServeConfig, C | None]:
    parser = build_parser(name, config_type)
    ns = parser.parse_args(argv)
    serve = ServeConfig(listen=ns.listen, port_file=ns.port_file, log_level=ns.log_level,
                        metrics_listen=ns.metrics_listen, trace_export=ns.trace_export,
                        log_format=ns.log_format, tls=tls_options_from_args(ns, parser),
                        allowed_clients=tuple(s.strip() for s in ns.allowed_clients.split(",")
                                              if s.strip()))
    if config_type is None:
        return serve, None
    values = {f.name: getattr(ns, f"cfg_{f.name}") for f in dataclasses.fields(config_type)}  # type: ignore[arg-type]
    return serve, config_type(**values)


async def serve_driver(driver: Driver, serve: ServeConfig, *, name: str) -> None:
    await driver.start()
    try:
        # Mutual TLS, and only the control plane's certificates may call; with
        # --insecure the mesh must do both (the warning says so).
        interceptors = [] if serve.tls.insecure else [AuthInterceptor(
            Authenticator(None, control_plane_identities=frozenset(serve.allowed_clients)).authenticate,
            control_plane_only=True)]
        running = await start_server(
            ServerOptions(listen=serve.listen, port_file=serve.port_file,
                          metrics_listen=serve.metrics_listen, tls=serve.tls,
                          require_client_cert=not serve.tls.insecure, interceptors=interceptors),
            [Registration(driver_service_pb2_grpc.add_DriverServiceServicer_to_server,
                          DriverServicer(driver), DriverServicer.FULL_NAME)],
            announce_as=f"driver-{name}",
        )
        await serve_until_signal(running)
    finally:
        await driver.close()


def run_driver(driver_factory: Callable[[Any], Driver], argv: Sequence[str] | None, name: str,
               config_type: type[Any] | None = None) -> int:
    """Parse flags, build the config and the driver, serve until SIGTERM. Returns the exit code."""
    serve, cfg = parse_config(name, argv, config_type)
    logs.setup(serve.log_level, service=f"driver-{name}", fmt=serve.log_format)
    tracing.setup(serve.trace_export, f"driver-{name}")

    async def _main() -> None:
        # Built inside the loop, so the driver may create tasks and loop objects.
        await serve_driver(driver_factory(cfg), serve, name=name)

    asyncio.run(_main())
    return 0
