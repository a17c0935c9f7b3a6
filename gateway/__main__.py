"""``python -m gateway``: read the routes from the descriptors, bind, serve.

    python -m gateway --listen HOST:PORT --port-file F \\
        --job-manager HOST:PORT --cluster-manager HOST:PORT \\
        --tls-cert-file F --tls-key-file F --tls-ca-file F [--tls-reload-seconds S]

HTTPS from ``--tls-cert-file``/``--tls-key-file`` (reloaded when the files
change, ``https.py``); JobManager (JobManagerService and AccessService) and
ClusterManager are called over TLS verified against ``--tls-ca-file``,
presenting the same certificate. The flags default from ``DLSCHED_TLS_*``
like every service's; without them the gateway refuses to start. Plaintext
HTTP and gRPC only with ``--insecure`` (``DLSCHED_INSECURE=1``), inside a mesh
that encrypts itself, and then it logs a warning. Each request's
``Authorization`` header is forwarded to the service it reaches.

Port 0 picks a free port, announced as ``DLSCHED_LISTENING gateway
<host:port>`` on stdout and written to ``--port-file``, like every dlsched
service. SIGTERM or SIGINT: /healthz turns 503, open streams end with an
UNAVAILABLE line, in-flight calls get ``--grace`` seconds, then it exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from aiohttp import web

from dlsched.kit import logs
from dlsched.kit.tls import TlsOptions, add_tls_flags, tls_options_from_args
from dlsched.v1 import access_service_pb2, cluster_manager_service_pb2, job_manager_service_pb2

from . import https
from .app import Gateway, answer_parse_errors
from .rules import routes_for

log = logging.getLogger("gateway")
#: the longest request line (path and query) and header a request may have
MAX_LINE_BYTES = 64 * 1024


class _QuietParserErrors(logging.Filter):
    """aiohttp logs a request its HTTP parser refused with a traceback that quotes the request's
    bytes (a query, an Authorization header): that record becomes one line naming the error."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.msg, record.args = "refused a malformed HTTP request: %s (HTTP %s)", (type(exc).__name__, exc.code)
            record.exc_info, record.exc_text, record.levelno, record.levelname = None, None, logging.INFO, "INFO"
        return True

JOB_MANAGER = job_manager_service_pb2.DESCRIPTOR.services_by_name["JobManagerService"]
CLUSTER_MANAGER = cluster_manager_service_pb2.DESCRIPTOR.services_by_name["ClusterManagerService"]
# Served by JobManager, next to JobManagerService.
ACCESS = access_service_pb2.DESCRIPTOR.services_by_name["AccessService"]


@dataclass(frozen=True)
class Config:
    listen: str
    port_file: str | None
    job_manager: str
    cluster_manager: str
    rpc_timeout: float = 30.0
    grace_seconds: float = 5.0
    max_message_bytes: int = 8 * 1024 * 1024
    max_request_bytes: int = 1024 * 1024
    log_level: str = "INFO"
    log_format: str = "text"
    tls: TlsOptions = TlsOptions(insecure=True)
    tls_reload_seconds: float = 5.0


def parse_args(argv: Sequence[str] | None = None) -> Config:
    p = argparse.ArgumentParser(prog="python -m gateway",
                                description="dlsched HTTP/JSON gateway")
    p.add_argument("--listen", default="127.0.0.1:0", help="host:port; port 0 picks one")
    p.add_argument("--port-file", default=None, help="write the bound host:port here")
    p.add_argument("--job-manager", required=True, help="JobManager host:port")
    p.add_argument("--cluster-manager", required=True, help="ClusterManager host:port")
    p.add_argument("--rpc-timeout", type=float, default=30.0,
                   help="deadline of each unary call, seconds (streams have none)")
    p.add_argument("--grace", type=float, default=5.0, help="shutdown grace, seconds")
    p.add_argument("--max-message-bytes", type=int, default=8 * 1024 * 1024,
                   help="largest request body and gRPC message")
    p.add_argument("--max-request-bytes", type=int, default=1024 * 1024,
                   help="largest request message the services take (their --max-request-bytes, "
                        "default 1 MiB): a larger one is HTTP 413 here")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="json: one object per line (default text)")
    add_tls_flags(p)
    p.add_argument("--tls-reload-seconds", type=float, default=5.0,
                   help="how often to look for renewed TLS files (default 5)")
    a = p.parse_args(argv)
    if a.rpc_timeout <= 0 or a.grace < 0:
        p.error("--rpc-timeout must be positive and --grace not negative")
    if a.tls_reload_seconds <= 0:
        p.error("--tls-reload-seconds must be positive")
    tls = tls_options_from_args(a, p)
    return Config(a.listen, a.port_file, a.job_manager, a.cluster_manager, a.rpc_timeout,
                  a.grace, a.max_message_bytes, a.max_request_bytes, a.log_level, a.log_format, tls,
                  a.tls_reload_seconds)


def _bind(listen: str) -> socket.socket:
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, int(port)))
    return sock


def _announce(address: str, port_file: str | None) -> None:
    # The same announcement as dlsched.kit.server's, so supervisors and tests
    # treat the gateway like every other service.
    print(f"DLSCHED_LISTENING gateway {address}", flush=True)
    if port_file:
        tmp = f"{port_file}.tmp"
        with open(tmp, "w") as f:
            f.write(address)
        os.replace(tmp, port_file)


async def amain(cfg: Config) -> None:
    routes = routes_for([JOB_MANAGER, ACCESS, CLUSTER_MANAGER])
    gateway = Gateway(routes, {JOB_MANAGER.full_name: cfg.job_manager,
                               ACCESS.full_name: cfg.job_manager,
                               CLUSTER_MANAGER.full_name: cfg.cluster_manager},
                      tls=cfg.tls, rpc_timeout=cfg.rpc_timeout,
                      max_message_bytes=cfg.max_message_bytes, max_request_bytes=cfg.max_request_bytes)
    server_tls = None if cfg.tls.insecure else https.ServerTls(cfg.tls)
    # handler_cancellation: a client that disconnects cancels its handler,
    # and with it the upstream gRPC stream.
    # A request line or header up to 64 KiB (aiohttp's 8190 bytes fell short of a documented
    # 8192-character filter once percent-encoded, and of a large OIDC token); what aiohttp's
    # parser refuses is logged without the request's bytes (``_QuietParserErrors``).
    logging.getLogger("aiohttp.server").addFilter(_QuietParserErrors())
    answer_parse_errors()  # ... and answered with a google.rpc.Status that quotes none of them
    runner = web.AppRunner(gateway.app(), access_log=None, handler_cancellation=True,
                           shutdown_timeout=cfg.grace_seconds, max_line_size=MAX_LINE_BYTES,
                           max_field_size=MAX_LINE_BYTES)
    await runner.setup()
    sock = _bind(cfg.listen)
    await web.SockSite(runner, sock,
                       ssl_context=server_tls.context if server_tls else None).start()
    host, port = sock.getsockname()[:2]
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    follow: asyncio.Task[None] | None = None
    if server_tls is None:
        log.warning("gateway serves PLAINTEXT HTTP on %s and calls job-manager and "
                    "cluster-manager in plaintext (--insecure): bearer tokens cross the "
                    "network in the clear unless a mesh encrypts every connection", address)
    else:
        follow = asyncio.create_task(https.follow_files(
            cfg.tls, cfg.tls_reload_seconds, [server_tls.reload, gateway.renew_channels]))
    log.info("gateway listening on %s://%s: %d routes, job-manager %s, cluster-manager %s",
             "http" if server_tls is None else "https", address, len(routes),
             cfg.job_manager, cfg.cluster_manager)
    _announce(address, cfg.port_file)

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down (grace %.1fs)", cfg.grace_seconds)
    if follow is not None:
        follow.cancel()
    await gateway.end_streams()
    try:
        await runner.cleanup()
    finally:
        await gateway.close()


def main(argv: Sequence[str] | None = None) -> None:
    cfg = parse_args(argv)
    logs.setup(cfg.log_level, "gateway", cfg.log_format)
    asyncio.run(amain(cfg))


if __name__ == "__main__":
    main()
