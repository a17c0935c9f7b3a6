"""The pod log API over asyncio: one HTTP response per container log, no thread.

The Kubernetes client reads a response in a thread that blocks until the
next byte: a follow, which may stay silent for days, held a thread for its
whole life, so a driver followed as many containers as it had threads.
``PodLogClient`` opens the same request (``GET
/api/v1/namespaces/{ns}/pods/{pod}/log``) with aiohttp on the event loop,
with what the client's ``Configuration`` says: the host, the CA bundle or
no verification, a client certificate, the TLS server name, a proxy, and the
``authorization`` header (a kubeconfig's refreshing token is asked for
anew, in a thread, each time: its hook may run an exec plugin). A response
costs a socket and its buffers; idle, nothing else.

A refusal (non-2xx) raises ``HttpError`` with the status and the body (the
API's Status object), which ``api.api_error`` maps as it maps the client's
``ApiException``; a connection failure raises aiohttp's error, which has no
status: unreachable.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from typing import Any
from urllib.parse import quote

import aiohttp
from kubernetes.client.rest import should_bypass_proxies

from dlsched.errors import Unavailable

#: the most bytes of a refusal's body kept (the API's Status object is small)
_ERROR_BODY_BYTES = 64 << 10


class HttpError(Exception):
    """A non-2xx answer of the pod log API (``status``, ``body``: as ``ApiException``)."""

    def __init__(self, status: int, reason: str, body: str) -> None:
        super().__init__(f"HTTP {status} {reason}")
        self.status = status
        self.reason = reason
        self.body = body


def _keepalive_socket(addr: Any) -> socket.socket:
    """A socket for aiohttp with TCP keepalive: probes after 30 s idle, every 10 s, 3 lost
    ones end it."""
    family, kind, proto = addr[0], addr[1], addr[2]
    sock = socket.socket(family=family, type=kind, proto=proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
    return sock


def _ssl_context(cfg: Any) -> ssl.SSLContext | bool:
    if not str(cfg.host).startswith("https"):
        return False
    if not cfg.verify_ssl:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    else:
        ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert or None)
        if cfg.assert_hostname is False:
            ctx.check_hostname = False
    if cfg.cert_file:
        ctx.load_cert_chain(cfg.cert_file, cfg.key_file or None)
    return ctx


class PodLogClient:
    """One cluster's pod log requests, on the event loop (``open``), sharing a session."""

    def __init__(self, cfg: Any, request_timeout: float) -> None:
        self._cfg = cfg
        self._host = str(cfg.host).rstrip("/")
        self._ssl = _ssl_context(cfg)  # reads the CA and certificate files now, not per request
        self._timeout = request_timeout
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def _client(self) -> aiohttp.ClientSession:
        if self._closed:  # the cluster was reconfigured or removed: nothing opens on this record
            raise Unavailable("the cluster's configuration changed while the log was opened; retry")
        if self._session is None or self._session.closed:
            # No connection limit of its own: --max-log-readers bounds the streams open at once.
            # TCP keepalive: a follow on a connection that died silently (a node or load balancer
            # gone) ends within about a minute, not at the 24 h read timeout.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self._ssl, limit=0, socket_factory=_keepalive_socket),
                auto_decompress=True, trust_env=False)
        return self._session

    def _bearer(self) -> str | None:
        """The header the client sends: a kubeconfig's token is under ``BearerToken``, a
        bearer-token credential's under ``authorization`` (``auth_settings`` reads both)."""
        auth = self._cfg.auth_settings().get("BearerToken")
        return str(auth["value"]) if auth and auth.get("value") else None

    async def _authorization(self) -> str | None:
        if self._cfg.refresh_api_key_hook is not None:  # may run an exec plugin: not on the loop
            return await asyncio.to_thread(self._bearer)
        return self._bearer()

    async def open(self, namespace: str, pod: str, params: dict[str, str], *,
                   read_timeout: float) -> aiohttp.ClientResponse:
        """The log response of ``pod`` (2xx; the caller reads and releases it); ``read_timeout``:
        the most seconds between two chunks (a follow may stay silent for long)."""
        headers = {"Accept": "*/*"}
        if auth := await self._authorization():
            headers["Authorization"] = auth
        extra: dict[str, Any] = {}
        if self._cfg.proxy and not should_bypass_proxies(self._host, self._cfg.no_proxy or ""):  # as the client
            extra["proxy"] = self._cfg.proxy
            if self._cfg.proxy_headers:
                extra["proxy_headers"] = self._cfg.proxy_headers
        if self._cfg.tls_server_name:
            extra["server_hostname"] = self._cfg.tls_server_name
        url = f"{self._host}/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(pod, safe='')}/log"
        resp = await self._client().get(
            url, params=params, headers=headers, allow_redirects=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._timeout, sock_read=read_timeout),
            **extra)
        if not 200 <= resp.status <= 299:
            try:
                body = (await asyncio.wait_for(resp.content.read(_ERROR_BODY_BYTES), self._timeout)
                        ).decode("utf-8", "replace")
            except (TimeoutError, aiohttp.ClientError):
                body = ""
            finally:
                resp.release()
            raise HttpError(resp.status, resp.reason or "", body)
        return resp

    async def close(self) -> None:
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None
