"""gRPC client conventions shared by every dlsched client (the SDK, the CLI,
JobManager, ClusterManager and the gateway).

- The service config shipped with the protos (``protos/dlsched/v1/
  service_config.json``, copied next to the stubs as
  ``dlsched/v1/service_config.json``): reads retry on UNAVAILABLE with
  backoff; mutations retry only where a retry cannot act twice (SubmitJob and
  CreateCluster deduplicate on their ``request_id``, which the SDK always
  sets; StopJob and the driver calls are idempotent); deletes and updates
  never retry; unary calls have deadlines; streams retry only until their
  first message arrives (gRPC's rule) and have no deadline.
- Keepalive pings every 30 s, so an idle watch or log stream is not cut by a
  load balancer's idle timeout (servers permit pings every 10 s).
- Messages up to ``MAX_MESSAGE_BYTES`` (8 MiB) each way, the servers' limit.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from typing import Any

import grpc

from dlsched import errors

MAX_MESSAGE_BYTES = 8 * 1024 * 1024


def service_config() -> str:
    """The shipped service config, as the JSON text gRPC takes."""
    text = resources.files("dlsched.v1").joinpath("service_config.json").read_text()
    json.loads(text)  # fail loudly on a broken file rather than run without retries
    return text


def options(*, round_robin: bool = False) -> list[tuple[str, Any]]:
    """Channel options for a dlsched client; ``round_robin`` spreads calls
    over every address a target resolves to (several replicas)."""
    cfg = json.loads(service_config())
    if round_robin:
        cfg["loadBalancingConfig"] = [{"round_robin": {}}]
    return [
        ("grpc.service_config", json.dumps(cfg)),
        ("grpc.enable_retries", 1),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        # gRPC core waits this long for a ping's answer (default 60 s): a frozen server is
        # noticed after 30 + 10 s, not 90 s.
        ("grpc.http2.ping_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]




class TokenSource:
    """Where a client's bearer token comes from: a literal, a file (re-read
    when it changes, checked at most every 5 s) or a command whose output is
    kept for 5 minutes (e.g. an identity provider's CLI)."""

    def __init__(self, *, token: str | None = None, file: str | None = None,
                 command: str | None = None) -> None:
        import time

        self._token = token
        self._file = file
        self._command = command
        self._clock = time.monotonic
        self._checked = -1e9
        self._stamp: tuple[int, int] | None = None
        self._ttl = 5.0 if file else 300.0

    def __bool__(self) -> bool:
        return bool(self._token or self._file or self._command)

    def get(self) -> str | None:
        if self._token is not None and not (self._file or self._command):
            return self._checked_token()
        now = self._clock()
        if now - self._checked < self._ttl and self._token is not None:
            return self._token
        self._checked = now
        if self._file:
            import os

            st = os.stat(self._file)
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp != self._stamp or self._token is None:
                with open(self._file, encoding="utf-8", errors="replace") as f:  # (refused below)
                    self._token = f.readline(16384).strip()
                self._stamp = stamp
        elif self._command:
            import shlex
            import subprocess

            out = subprocess.run(shlex.split(self._command), capture_output=True, text=True,
                                 encoding="utf-8", errors="replace", timeout=30, check=True).stdout
            self._token = out.strip().splitlines()[0] if out.strip() else None
        return self._checked_token()

    def _checked_token(self) -> str | None:
        if self._token and not _TOKEN_RE.fullmatch(self._token):
            where = "--token-file" if self._file else "--token-command" if self._command else "the token given, or DLSCHED_TOKEN"
            raise MalformedToken(f"the bearer token ({where}) holds characters no token has "
                                 "(tokens are A-Z a-z 0-9 . _ ~ + / = -, at most 8192)")
        return self._token


#: What a bearer token is made of (RFC 6750's b64token, as the services read it): anything else
#: could not be sent as gRPC metadata (gRPC's C core refuses it with a log line of its own).
_TOKEN_RE = re.compile(r"[A-Za-z0-9._~+/=-]{1,8192}")


class MalformedToken(errors.Unauthenticated):
    """The client's own token cannot be sent."""

    reason = "MALFORMED_TOKEN"


class _Bearer:
    def __init__(self, source: TokenSource) -> None:
        self._source = source

    def _details(self, d: Any) -> Any:
        token = self._source.get()
        if not token:
            return d
        md = list(d.metadata or ())
        md.append(("authorization", f"Bearer {token}"))
        return grpc.aio.ClientCallDetails(d.method, d.timeout, md, d.credentials, d.wait_for_ready)


class _BearerUnary(_Bearer, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any,
                                    request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


class _BearerStream(_Bearer, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any,
                                     request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


class _BearerStreamUnary(_Bearer, grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_unary(self, continuation: Any, client_call_details: Any,
                                     request_iterator: Any) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


class _BearerStreamStream(_Bearer, grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_stream(self, continuation: Any, client_call_details: Any,
                                      request_iterator: Any) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


def bearer_interceptors(source: TokenSource) -> list[Any]:
    """Interceptors that add ``authorization: Bearer <token>`` to every call of
    a channel, whatever its kind (grpc.aio files an interceptor under its
    first kind only, hence one per kind)."""
    return [_BearerUnary(source), _BearerStream(source), _BearerStreamUnary(source),
            _BearerStreamStream(source)]
