"""The server interceptor that authenticates every call before its handler runs.

It sits inside the error interceptor (so its errors become google.rpc.Status)
and wraps each unary and server-streaming handler: the ``authorization``
metadata (and, on drivers, the client certificate) become a ``Principal`` in
``caller()`` for the handler's task, or the call ends UNAUTHENTICATED /
PERMISSION_DENIED before the handler is entered — no side effect can happen.
Health checking and reflection stay open: probes (kubelet, load balancers)
send no tokens, and the schema is public in protos/ anyway.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc

from dlsched.auth.audit import AuditLog, is_mutating, object_of
from dlsched.auth.model import Principal
from dlsched.errors import DlschedError, Internal, PermissionDenied, Unauthenticated
from dlsched.kit import rpc_errors
from dlsched.kit.handlers import WrappingInterceptor, responses, rewrap, streaming
from dlsched.kit.tls import peer_identities

PUBLIC_SERVICES = frozenset({
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
})

_CALLER: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("dlsched_caller", default=None)

Authenticate = Callable[[str | None, Sequence[str]], Awaitable[Principal]]


def caller() -> Principal:
    """The authenticated caller of the current call."""
    p = _CALLER.get()
    if p is None:
        raise Internal("no authenticated caller in this context")
    return p


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    """The call's one ``authorization`` value. Several are UNAUTHENTICATED: which one counts
    is ambiguous (the first here, maybe the last behind a proxy that keeps one)."""
    values = [v for k, v in context.invocation_metadata() or () if k == "authorization"]
    if len(values) > 1:
        raise Unauthenticated("more than one authorization value: send one bearer token")
    return values[0] if values and isinstance(values[0], str) else None


class AuthInterceptor(WrappingInterceptor):
    """Authenticates every non-public call with ``authenticate``; with
    ``control_plane_only`` (drivers) only control-plane principals pass."""

    def __init__(self, authenticate: Authenticate, *, control_plane_only: bool = False,
                 audit: AuditLog | None = None) -> None:
        super().__init__()
        self._authenticate = authenticate
        # Only drivers ask for client certificates; elsewhere there is none to read.
        self._control_plane_only = control_plane_only
        self._audit = audit

    async def _principal(self, context: grpc.aio.ServicerContext) -> Principal:
        peer = peer_identities(context) if self._control_plane_only else []
        try:
            p = await self._authenticate(_authorization(context), peer)
        except Unauthenticated:
            if self._control_plane_only and peer:
                # Drivers: a verified client certificate names who calls; one
                # that is not the control plane's is known, just not allowed.
                raise PermissionDenied("only the dlsched control plane may call a driver",
                                       metadata={"principal": peer[0]}) from None
            raise
        if self._control_plane_only and not p.control_plane:
            raise PermissionDenied("only the dlsched control plane may call a driver",
                                   metadata={"principal": p.name})
        return p

    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        service = method.lstrip("/").split("/", 1)[0]
        if service in PUBLIC_SERVICES:
            return handler

        audit = self._audit if is_mutating(method) else None
        if handler.unary_unary:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                principal = "unauthenticated"
                result, response = "UNKNOWN", None
                try:
                    p = await self._principal(context)
                    principal = p.name
                    token = _CALLER.set(p)
                    try:
                        response = await inner_uu(request, context)
                    finally:
                        _CALLER.reset(token)
                    result = "OK"
                    return response
                except DlschedError as e:
                    result = e.code
                    raise
                except asyncio.CancelledError:  # the caller left, or its deadline came: no fault here
                    remaining = context.time_remaining()
                    # (rpc_errors answers a call DEADLINE_MARGIN_SECONDS before its deadline)
                    near = remaining is not None and remaining <= rpc_errors.DEADLINE_MARGIN_SECONDS + 0.5
                    result = "DEADLINE_EXCEEDED" if near else "CANCELLED"
                    raise
                except BaseException:
                    result = "INTERNAL"
                    raise
                finally:
                    if audit is not None:
                        audit.write(principal=principal, method=method,
                                    obj=object_of(request, response), result=result)

            return rewrap(handler, unary_unary=unary_unary)
        if streaming(handler):
            inner_us = streaming(handler)

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                _CALLER.set(await self._principal(context))  # this call's own task
                async for item in responses(inner_us(request, context)):
                    yield item
                    del item  # not held while the stream waits for its next message

            return rewrap(handler, unary_stream=unary_stream)
        return _refuse_other(handler)


def _refuse_other(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """dlsched has no client-streaming RPCs (bidi ones are wrapped like server
    streams); refuse any that appear rather than serve them unauthenticated."""
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not served")

    return grpc.unary_unary_rpc_method_handler(refuse)
