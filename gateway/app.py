"""The aiohttp application: match a route, transcode, call gRPC, answer JSON.

One catch-all handler matches the raw path against the routes read from the
descriptors (``rules.routes_for``), builds the request message
(``transcode.build_request``), calls the upstream service over one grpc.aio
channel per address with serializers taken from the descriptors (no
generated stubs, no hand-written route table), and prints the response with
protobuf's JSON mapping.

The channels use verified TLS (``dlsched.kit.tls.channel``, presenting the
gateway's certificate, which grants nothing) unless ``--insecure``. The
gateway holds no credentials of its own: each request's ``Authorization``
header goes, unchanged, as the ``authorization`` metadata of the call made
for that request and of no other; a request without one is sent without one,
so the service answers UNAUTHENTICATED (HTTP 401, with ``WWW-Authenticate:
Bearer``) and a role it lacks PERMISSION_DENIED (403). What a caller may see
is decided by the services alone.

Server-streaming RPCs answer newline-delimited JSON, one message per line
(``application/x-ndjson``), or server-sent events when the client sends
``Accept: text/event-stream``. The gateway waits for the first message before
it sends headers, so a call that fails at once (NOT_FOUND, an expired watch
token) gets its real HTTP status; a later error arrives as a last line
``{"error": <google.rpc.Status>}`` (SSE: an ``error`` event). The response
ends when the gRPC stream ends. A client that goes away cancels the gRPC call
(``handler_cancellation``); at shutdown open streams end with an UNAVAILABLE
line so clients reconnect with their last resume token.

Heartbeats pass through like any other message, one line each: WatchJobs'
``{"type":"WATCH_EVENT_TYPE_HEARTBEAT","resumeToken":...}`` and StreamJobLogs'
``{"resumeCursor":...}`` (no entries; ``{}`` before the first line), sent by
JobManager when a stream was quiet for
``--stream-heartbeat-seconds``. They keep HTTP proxies and load balancers in
front of the gateway from closing a quiet response as idle, and the first one
sends the headers of a stream still waiting for its first message (a log
follow of a job not launched yet). Clients skip them.

Logs name the method, path (never the query), status and duration; never a
body or a header, so credentials in CreateCluster and bearer tokens pass
through without being logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import grpc
import prometheus_client
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError
from google.protobuf import message
from google.rpc import code_pb2, status_pb2

from dlsched import errors
from dlsched.kit import channel as channel_kit
from dlsched.kit import metrics, rpc_errors
from dlsched.kit import tls as tls_kit

from . import status, transcode
from .openapi import build_openapi
from .rules import BadPathValue, Route
from .transcode import RequestTooLarge

HTTP_REQUESTS = prometheus_client.Counter(
    "dlsched_http_requests", "gateway HTTP requests, by the RPC they reach and the HTTP status",
    ["rpc", "method", "code"])

log = logging.getLogger("gateway")

NDJSON = "application/x-ndjson"
SSE = "text/event-stream"
JSON = "application/json"


class RouteNotFound(errors.NotFound):
    """No route has this path."""

    reason = "ROUTE_NOT_FOUND"


def _query(request: web.Request) -> list[tuple[str, str]]:
    """The query's pairs, percent-decoded as UTF-8 or refused (``%FF`` was taken as U+FFFD)."""
    try:
        return urllib.parse.parse_qsl(request.rel_url.raw_query_string, keep_blank_values=True,
                                      errors="strict")
    except UnicodeDecodeError:
        raise errors.InvalidArgument.for_field("query", "not UTF-8 once percent-decoded") from None


class BodyTimedOut(errors.InvalidArgument):
    """The request body did not arrive within the gateway's ``rpc_timeout``: HTTP 408 (nginx's
    client_body_timeout; a client sending a few bytes of a declared length held a handler)."""

    reason = "REQUEST_TIMEOUT"

class UnsupportedEncoding(errors.InvalidArgument):
    """A request body with a ``Content-Encoding`` (HTTP 415): the API takes plain JSON bodies
    (aiohttp's own decoding met a body that did not decode with a 500 and its traceback, or no
    answer at all; an encoding it did not know was read as identity)."""

    reason = "UNSUPPORTED_CONTENT_ENCODING"



class MethodNotAllowed(errors.Unimplemented):
    """The path exists, but not with this HTTP method."""

    reason = "METHOD_NOT_ALLOWED"


#: A larger body is parsed in a worker thread (``PARSE_THREADS`` at a time): a 4 MiB body of a
#: million JSON values held the event loop (every other request, health probes included) for 20 s.
INLINE_BODY_BYTES = 16 * 1024
PARSE_THREADS = 2

# Retried by the shipped service config because they deduplicate on their
# request_id, which the SDK always sets and a REST client may leave out.
_RETRIED_WITH_REQUEST_ID = frozenset({"SubmitJob", "CreateCluster"})


def service_config() -> str:
    """The shipped service config (deadlines, retries of reads on
    UNAVAILABLE), round robin over the replicas, and no retries for the
    groups of methods that are only safe to retry with a request id."""
    cfg = json.loads(channel_kit.service_config())
    cfg["loadBalancingConfig"] = [{"round_robin": {}}]
    for mc in cfg.get("methodConfig", []):
        if any(n.get("method") in _RETRIED_WITH_REQUEST_ID for n in mc.get("name", [])):
            mc.pop("retryPolicy", None)
    return json.dumps(cfg)


class Upstreams:
    """One channel per upstream address. The TLS files are read when the
    channels are made: at start and on ``renew`` (the files changed and
    load), so new calls use new channels while calls in flight finish on the
    old ones, which are closed with the rest."""

    def __init__(self, targets: Sequence[str], tls: tls_kit.TlsOptions,
                 max_message_bytes: int) -> None:
        self._targets = sorted(set(targets))
        self._tls = tls
        self._options = [("grpc.max_receive_message_length", max_message_bytes),
                         ("grpc.max_send_message_length", max_message_bytes),
                         ("grpc.service_config", service_config())]
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._retired: list[grpc.aio.Channel] = []
        self._make()

    def _make(self) -> None:
        # Several replicas behind one name (a headless Service's
        # dns:///job-manager:50051) share the calls (round robin); a dead one
        # is skipped. extra_options take precedence over the kit's defaults.
        self._channels = {t: tls_kit.channel(t, self._tls, client_cert=True, round_robin=True,
                                             extra_options=self._options)
                          for t in self._targets}

    def get(self, target: str) -> grpc.aio.Channel:
        return self._channels[target]

    def renew(self) -> None:
        self._retired.extend(self._channels.values())
        self._make()

    async def close(self) -> None:
        for ch in [*self._channels.values(), *self._retired]:
            await ch.close()
        self._channels.clear()
        self._retired.clear()


class Gateway:
    """Routes, upstream channels and the open streams of one gateway process."""

    def __init__(self, routes: Sequence[Route], upstreams: Mapping[str, str], *,
                 tls: tls_kit.TlsOptions, rpc_timeout: float = 30.0,
                 max_message_bytes: int = 8 * 1024 * 1024,
                 max_request_bytes: int = 1024 * 1024) -> None:
        missing = {r.service for r in routes} - set(upstreams)
        if missing:
            raise ValueError(f"no upstream address for {sorted(missing)}")
        # A custom verb's routes first: a path ending in ``:stop`` is the verb's, whatever the method.
        self.routes = sorted(routes, key=lambda r: not r.template.verb)
        self.rpc_timeout = rpc_timeout
        self.max_message_bytes = max_message_bytes
        #: the largest request message the services take (their --max-request-bytes): a larger
        #: one is this gateway's 413, not the services' RESOURCE_EXHAUSTED (HTTP 429: "retry")
        self.max_request_bytes = max_request_bytes
        #: the largest body read: JSON of a request the services could take is rarely over 4x
        #: its protobuf; a larger one is refused before it is read and parsed (it cost the event
        #: loop seconds per anonymous 8 MiB POST, and no other request was answered meanwhile)
        self.max_body_bytes = min(max_message_bytes, 4 * max_request_bytes)
        self.channels = Upstreams(list(upstreams.values()), tls, max_message_bytes)
        self._upstream = dict(upstreams)
        # grpc path -> (the channel it was made on, the multicallable)
        self._callables: dict[str, tuple[grpc.aio.Channel, Any]] = {}
        self._streams: set[grpc.aio.Call] = set()
        self._parsing = asyncio.Semaphore(PARSE_THREADS)
        self.draining = False
        self.openapi = build_openapi(list(routes))

    # ---------------------------------------------------------------- app

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes,
                              middlewares=[self._access_log],
                              # bodies as sent: a Content-Encoding is refused (``_body``), not decoded
                              handler_args={"auto_decompress": False})
        app.router.add_get("/openapi.json", self._openapi)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/{tail:[\\s\\S]*}", self.handle)  # (any path: a decoded newline too)
        return app

    @web.middleware
    async def _access_log(self, request: web.Request,
                          handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                          ) -> web.StreamResponse:
        start = time.monotonic()
        code = 500
        try:
            resp = await handler(request)
            code = resp.status
            return resp
        except web.HTTPException as e:  # aiohttp's own answers (a request no route takes: OPTIONS *)
            if e.status < 400:
                code = e.status
                raise
            err = RouteNotFound(f"no route for {request.path!r}") if e.status == 404 else \
                errors.InvalidArgument(f"{e.status} {e.reason}")
            resp = _error(status.from_error(err), request)
            code = resp.status
            return resp
        except asyncio.CancelledError:
            code = 499
            raise
        finally:
            # Labelled by the RPC a route reaches, never by the path (ids are unbounded).
            HTTP_REQUESTS.labels(request.get("rpc", "none"), request.method if request.get("rpc") else "-",
                                 str(code)).inc()
            # The path only: query strings and bodies are never logged.
            log.info("%s %s -> %d (%.0f ms)", request.method, request.path, code,
                     (time.monotonic() - start) * 1000)

    async def _openapi(self, request: web.Request) -> web.Response:
        return web.json_response(self.openapi)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=prometheus_client.generate_latest(metrics.REGISTRY),
                            headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})

    async def _healthz(self, request: web.Request) -> web.Response:
        if self.draining:
            return web.json_response({"status": "NOT_SERVING"}, status=503)
        return web.json_response({"status": "SERVING"})

    async def close(self) -> None:
        await self.channels.close()

    async def end_streams(self) -> None:
        """Shutdown: cancel every open upstream stream; each handler then
        writes an UNAVAILABLE line, so its client reconnects elsewhere."""
        self.draining = True
        for call in list(self._streams):
            call.cancel()

    # ---------------------------------------------------------------- dispatch

    def match(self, method: str, raw_path: str) -> tuple[Route, dict[str, str]]:
        """The route and path values of a request; HEAD is a unary GET's (RFC 9110 9.3.2:
        aiohttp sends its headers, no body)."""
        allowed: list[str] = []
        verb_matched = False
        for route in self.routes:
            try:
                values = route.template.match(raw_path)
            except BadPathValue as e:
                raise errors.InvalidArgument.for_field(str(e), "not UTF-8 once percent-decoded") from None
            if values is None:
                continue
            if route.template.verb:
                verb_matched = True
            elif verb_matched:  # GET /v1/jobs/x:stop: 405 for the verb, not a job named "x:stop"
                break
            if route.http_method == method or (method == "HEAD" and route.http_method == "GET"
                                               and not route.server_streaming):
                return route, values
            allowed.append(route.http_method)
            if route.http_method == "GET" and not route.server_streaming:
                allowed.append("HEAD")
        if allowed:
            raise MethodNotAllowed(f"{method} is not allowed here; use {', '.join(allowed)}",
                                   metadata={"allow": ",".join(sorted(set(allowed)))})
        raise RouteNotFound(f"no route for {raw_path}")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            route, values = self.match(request.method, request.rel_url.raw_path)
            request["rpc"] = route.grpc_path
            body = await self._body(request) if route.body else b""
            if len(body) > INLINE_BODY_BYTES:  # parsed off the event loop: the other requests go on
                query = _query(request)
                async with self._parsing:  # a few at a time: each may hold ~100 MB of JSON objects
                    msg = await asyncio.to_thread(transcode.build_request, route, values, query, body)
            else:
                msg = transcode.build_request(route, values, _query(request), body)
            if (size := msg.ByteSize()) > self.max_request_bytes:
                raise RequestTooLarge(f"request of {size} bytes (as protobuf) over the services' "
                                      f"{self.max_request_bytes}", metadata={"limit_bytes": str(self.max_request_bytes)})
            md = _forwarded_metadata(request)
            if route.server_streaming:
                return await self._stream(request, route, msg, md)
            resp = await self._unary(route)(msg, timeout=self.rpc_timeout, metadata=md)
            return _json(200, transcode.response_json(route, resp))
        except grpc.aio.AioRpcError as e:
            return _error(status.from_rpc_error(e), request)
        except errors.DlschedError as e:
            out = _error(status.from_error(e), request)
            if isinstance(e, MethodNotAllowed):
                out.set_status(405)
                out.headers["Allow"] = e.metadata["allow"]
            elif isinstance(e, RequestTooLarge):
                out.set_status(413)
            elif isinstance(e, BodyTimedOut):
                out.set_status(408)
            elif isinstance(e, UnsupportedEncoding):
                out.set_status(415)
            return out
        except web.HTTPException:
            raise
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - never a traceback to the client
            err, cid = rpc_errors.internal_error()
            log.exception("unhandled error on %s %s (correlation id %s)",
                          request.method, request.path, cid)
            return _error(status.from_error(err))

    async def _body(self, request: web.Request) -> bytes:
        """The request body, at most ``max_body_bytes``: a larger declared length is refused
        unread, and aiohttp's own refusal (a text/plain 413) becomes ``RequestTooLarge``,
        answered as JSON like every other error."""
        if (request.content_length or 0) > self.max_body_bytes:
            raise RequestTooLarge(f"request body of {request.content_length} bytes, over {self.max_body_bytes}",
                                  metadata={"limit_bytes": str(self.max_body_bytes)})
        coding = request.headers.get("Content-Encoding", "").strip().lower()
        if coding not in ("", "identity"):
            raise UnsupportedEncoding.for_field("body", f"Content-Encoding {coding[:64]!r}: send the JSON as it is")
        try:
            async with asyncio.timeout(self.rpc_timeout):
                return await request.read()
        except web.HTTPRequestEntityTooLarge as e:
            raise RequestTooLarge(f"request body over {self.max_body_bytes} bytes",
                                  metadata={"limit_bytes": str(self.max_body_bytes)}) from e
        except TimeoutError as e:
            raise BodyTimedOut.for_field("body", f"not received within {self.rpc_timeout:g} s") from e
        except (RequestPayloadError, HttpProcessingError) as e:  # a body cut short, a bad chunk
            raise errors.InvalidArgument.for_field("body", "cannot be read") from e

    def renew_channels(self) -> None:
        """The TLS files changed: new calls go over new channels."""
        self.channels.renew()

    def _callable(self, route: Route) -> Any:
        ch = self.channels.get(self._upstream[route.service])
        cached = self._callables.get(route.grpc_path)
        if cached is not None and cached[0] is ch:
            return cached[1]
        out_cls = transcode.message_class(route.method.output_type)
        kind = ch.unary_stream if route.server_streaming else ch.unary_unary
        fn = kind(route.grpc_path, request_serializer=_serialize,
                  response_deserializer=out_cls.FromString)
        self._callables[route.grpc_path] = (ch, fn)
        return fn

    def _unary(self, route: Route) -> Any:
        return self._callable(route)

    def _server_stream(self, route: Route) -> Any:
        return self._callable(route)

    # ---------------------------------------------------------------- streams

    async def _stream(self, request: web.Request, route: Route, msg: message.Message,
                      md: tuple[tuple[str, str], ...]) -> web.StreamResponse:
        sse = SSE in request.headers.get("Accept", "")
        call = self._server_stream(route)(msg, metadata=md)
        self._streams.add(call)
        resp: web.StreamResponse | None = None
        try:
            it = call.__aiter__()
            try:
                first: message.Message | None = await it.__anext__()
            except StopAsyncIteration:
                first = None
            resp = web.StreamResponse(status=200, headers={
                "Content-Type": SSE if sse else NDJSON, "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no"})
            await resp.prepare(request)
            if first is not None:
                await resp.write(_frame(transcode.response_json(route, first), sse))
                async for item in it:
                    await resp.write(_frame(transcode.response_json(route, item), sse))
            await resp.write_eof()
            return resp
        except grpc.aio.AioRpcError as e:
            st = status.from_rpc_error(e)
            if resp is None:
                return _error(st, request)
            await _end_with_error(resp, st, sse)
            return resp
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.draining and task is not None and not task.cancelling():
                # Our shutdown cancelled the call, not the client: say so.
                st = status_pb2.Status(code=code_pb2.UNAVAILABLE,
                                       message="gateway shutting down; reconnect")
                if resp is None:
                    return _error(st)
                await _end_with_error(resp, st, sse)
                return resp
            log.info("%s %s: client went away; cancelling %s", request.method, request.path,
                     route.grpc_path)
            raise
        except ConnectionError as e:
            # Writing to a closed connection: the client has gone.
            log.info("%s %s: client went away (%s); cancelling %s", request.method,
                     request.path, type(e).__name__, route.grpc_path)
            return resp if resp is not None else web.Response(status=499)
        except Exception:
            if resp is None:
                raise  # handle() answers a plain error
            err, cid = rpc_errors.internal_error()
            log.exception("stream %s failed (correlation id %s)", route.grpc_path, cid)
            await _end_with_error(resp, status.from_error(err), sse)
            return resp
        finally:
            call.cancel()
            self._streams.discard(call)


def _serialize(msg: message.Message) -> bytes:
    return msg.SerializeToString()


class MalformedAuthorization(errors.Unauthenticated):
    """An Authorization header gRPC metadata cannot carry."""


def _forwarded_metadata(request: web.Request) -> tuple[tuple[str, str], ...]:
    """This request's ``Authorization`` header as the call's ``authorization``
    metadata, as sent (the service parses it); none when the request has none."""
    values = request.headers.getall("Authorization", [])
    if not values:
        return ()
    if len(values) > 1:  # which one counts is ambiguous: the service refuses several too
        raise MalformedAuthorization("more than one Authorization header: send one bearer token")
    value = values[0]
    # gRPC metadata values are printable ASCII; anything else could not be a
    # valid credential, and would fail inside grpc as an internal error.
    if not value or not all(" " <= c <= "~" for c in value):
        raise MalformedAuthorization("malformed Authorization header")
    return (("authorization", value),)


def _json(code: int, data: Any) -> web.Response:
    return web.Response(status=code, body=transcode.dumps(data), content_type=JSON)


def _error(st: status_pb2.Status, request: web.Request | None = None) -> web.Response:
    out = _json(status.http_status(st.code), status.to_json(st))
    if st.code == code_pb2.UNAUTHENTICATED:
        # RFC 9110 §11.6.1: a 401 names its scheme; RFC 6750 §3.1 says which
        # failure when a token was sent.
        sent = request is not None and "Authorization" in request.headers
        out.headers["WWW-Authenticate"] = ('Bearer realm="dlsched", error="invalid_token"'
                                           if sent else 'Bearer realm="dlsched"')
    return out


def _frame(data: Any, sse: bool, event: str | None = None) -> bytes:
    payload = transcode.dumps(data)
    if not sse:
        return payload + b"\n"
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + payload + b"\n\n"


async def _end_with_error(resp: web.StreamResponse, st: status_pb2.Status, sse: bool) -> None:
    body = status.to_json(st)
    try:
        if sse:
            await resp.write(_frame(body, True, event="error"))
        else:
            await resp.write(_frame({"error": body}, False))
        await resp.write_eof()
    except ConnectionError:
        pass  # the client has gone; nothing left to tell it


class MalformedHttp(errors.InvalidArgument):
    """A request aiohttp's HTTP parser refused (a line or header past the limit, a folded
    header, a body framed twice): HTTP 400 with a google.rpc.Status, as every other error."""

    reason = "MALFORMED_HTTP_REQUEST"


def answer_parse_errors() -> None:
    """Make aiohttp's answer to a request its parser refused a google.rpc.Status in JSON,
    naming the error's kind only: its own text/plain answer quoted the request's bytes back
    (an Authorization header's token, in a folded header's case). aiohttp has no hook for
    that answer, so its handler's method is wrapped, in the gateway's process only."""
    from aiohttp import web_protocol
    from aiohttp.http_exceptions import HttpProcessingError

    original = web_protocol.RequestHandler.handle_error
    if getattr(original, "_dlsched", False):
        return

    def handle_error(self: web_protocol.RequestHandler, request: Any, status: int = 500,
                     exc: BaseException | None = None, message: str | None = None) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError) or status >= 500:
            return original(self, request, status, exc, message)
        if request.writer.output_size > 0:
            raise ConnectionError("the response has begun: no error can follow")
        log.info("refused a malformed HTTP request: %s (HTTP %s)", type(exc).__name__, status)
        err = MalformedHttp(f"the HTTP request could not be parsed ({type(exc).__name__}, HTTP {status})")
        resp = _json(status, rpc_errors_json(err))
        resp.force_close()
        return resp

    handle_error._dlsched = True  # type: ignore[attr-defined]
    web_protocol.RequestHandler.handle_error = handle_error  # type: ignore[method-assign]


def rpc_errors_json(err: errors.DlschedError) -> Any:
    return status.to_json(rpc_errors.to_status(err))
