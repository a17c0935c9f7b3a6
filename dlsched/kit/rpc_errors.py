"""Map dlsched errors to google.rpc.Status, and back on the client side.

Server side: ``ErrorInterceptor`` wraps every unary and streaming handler; a
``DlschedError`` becomes its status with an ``ErrorInfo`` (plus ``BadRequest``
or ``PreconditionFailure`` details); anything else becomes INTERNAL with a
correlation id, and the traceback goes only to the log.

Client side: ``from_rpc_error`` turns a ``grpc.aio.AioRpcError`` back into the
matching ``DlschedError`` subclass (by code), keeping reason and metadata, so
a service calling another service raises errors its own callers understand.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from dlsched import errors
from dlsched.kit.handlers import (
    Undecodable,
    WrappingInterceptor,
    responses,
    rewrap,
    streaming,
    tolerant,
)

log = logging.getLogger("dlsched.rpc")

_CLASS_BY_CODE: dict[str, type[errors.DlschedError]] = {
    "INVALID_ARGUMENT": errors.InvalidArgument,
    "NOT_FOUND": errors.NotFound,
    "ALREADY_EXISTS": errors.AlreadyExists,
    "FAILED_PRECONDITION": errors.FailedPrecondition,
    "ABORTED": errors.Aborted,
    "OUT_OF_RANGE": errors.OutOfRange,
    "UNAVAILABLE": errors.Unavailable,
    "UNIMPLEMENTED": errors.Unimplemented,
    "DEADLINE_EXCEEDED": errors.DeadlineExceeded,
    "RESOURCE_EXHAUSTED": errors.ResourceExhausted,
    "INTERNAL": errors.Internal,
    "UNAUTHENTICATED": errors.Unauthenticated,
    "PERMISSION_DENIED": errors.PermissionDenied,
}


#: What one status may carry. It travels in the trailers (the message percent-encoded, and
#: again with the details base64-encoded), which gRPC clients cap at 16 KiB by default: an
#: error that echoes a client's long input, or lists a violation for each of a thousand
#: bad labels, would reach the client as RESOURCE_EXHAUSTED instead of itself.
MAX_MESSAGE_BYTES = 512
MAX_TEXT_BYTES = 160  # a field, subject, description or metadata value
MAX_VIOLATIONS = 10
MAX_METADATA = 8


def clip(text: str, limit: int = MAX_TEXT_BYTES) -> str:
    """``text`` within ``limit`` UTF-8 bytes, cut at a character boundary and marked."""
    raw = text.encode("utf-8", "surrogatepass")
    if len(raw) <= limit:
        return text
    return raw[:limit - 3].decode("utf-8", "ignore") + "..."


def _clipped(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    out = [(clip(a), clip(b)) for a, b in pairs[:MAX_VIOLATIONS]]
    if len(pairs) > MAX_VIOLATIONS:
        out.append(("...", f"and {len(pairs) - MAX_VIOLATIONS} more"))
    return out


def to_status(err: errors.DlschedError) -> status_pb2.Status:
    """The google.rpc.Status for a dlsched error, bounded in size (``MAX_*``)."""
    code = code_pb2.Code.Value(err.code)
    details: list[any_pb2.Any] = []
    info = error_details_pb2.ErrorInfo(
        reason=err.reason, domain=errors.DOMAIN,
        metadata={clip(k): clip(v) for k, v in list(err.metadata.items())[:MAX_METADATA]},
    )
    details.append(_pack(info))
    if isinstance(err, errors.InvalidArgument) and err.violations:
        br = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=f, description=d)
                for f, d in _clipped([(v.field, v.description) for v in err.violations])
            ]
        )
        details.append(_pack(br))
    if isinstance(err, errors.FailedPrecondition) and err.violations:
        pf = error_details_pb2.PreconditionFailure(
            violations=[
                error_details_pb2.PreconditionFailure.Violation(
                    type=err.reason, subject=subject, description=desc
                )
                for subject, desc in _clipped(list(err.violations))
            ]
        )
        details.append(_pack(pf))
    return status_pb2.Status(code=code, message=clip(err.message, MAX_MESSAGE_BYTES), details=details)


def _pack(msg: Any) -> any_pb2.Any:
    a = any_pb2.Any()
    a.Pack(msg)
    return a


def internal_error() -> tuple[errors.Internal, str]:
    cid = uuid.uuid4().hex[:16]
    err = errors.Internal(
        f"internal error (correlation id {cid})", metadata={"correlation_id": cid}
    )
    return err, cid


def status_for(exc: BaseException, method: str) -> status_pb2.Status:
    """The status a failure of ``method`` is reported with: a DlschedError's own;
    anything else INTERNAL with a correlation id (the exception is logged, never sent)."""
    if isinstance(exc, errors.DlschedError):
        if exc.code == "INTERNAL":
            log.error("internal error in %s: %s", method, exc.message)
        return to_status(exc)
    err, cid = internal_error()
    log.error("unhandled exception in %s (correlation id %s)", method, cid, exc_info=exc)
    return to_status(err)


async def abort_with(context: grpc.aio.ServicerContext, st: status_pb2.Status) -> None:
    await context.abort_with_status(rpc_status.to_status(st))


def refuse_undecodable(request: Any) -> None:
    if isinstance(request, Undecodable):
        raise errors.InvalidArgument(
            f"the request could not be decoded ({request.error}): not a valid protobuf "
            "message of the method's request type, or a string field is not UTF-8",
            reason="MALFORMED_REQUEST")


class ErrorInterceptor(WrappingInterceptor):
    """Maps exceptions from every handler (unary and streaming) to google.rpc.Status.
    With ``streams=False`` it leaves streaming handlers to ``StreamLayers``
    (``server.py``), which does the same for them."""

    def __init__(self, *, streams: bool = True) -> None:
        super().__init__()
        self.streams = streams

    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        if streaming(handler) and not self.streams:
            return handler
        if handler.unary_unary:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    refuse_undecodable(request)
                    budget = call_budget(context)
                    if budget is None:
                        return await inner_uu(request, context)
                    limit = asyncio.timeout(budget)
                    try:
                        async with limit:
                            return await inner_uu(request, context)
                    except TimeoutError:
                        if not limit.expired():
                            raise
                        raise timed_out() from None
                except PASSTHROUGH:
                    raise
                except BaseException as exc:  # noqa: BLE001 - mapped to a status
                    await abort_with(context, status_for(exc, method))

            return rewrap(handler, unary_unary=unary_unary,
                          request_deserializer=tolerant(handler.request_deserializer))
        if streaming(handler):
            inner_us = streaming(handler)

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                try:
                    refuse_undecodable(request)
                    async for item in responses(inner_us(request, context)):
                        yield item
                        del item  # not held while the stream waits for its next message
                except PASSTHROUGH:
                    raise
                except BaseException as exc:  # noqa: BLE001 - mapped to a status
                    await abort_with(context, status_for(exc, method))

            return rewrap(handler, unary_stream=unary_stream,
                          request_deserializer=tolerant(handler.request_deserializer))
        return handler


#: A unary call that cannot finish before its deadline is answered this long before it (a
#: tenth of its time at most): DEADLINE_EXCEEDED with an ErrorInfo (TIMED_OUT) saying why,
#: rather than the caller's own bare DEADLINE_EXCEEDED once a chain of internal waits
#: (etcd, another service, a driver) has outlasted it. 3 s, not 1: a client whose deadline
#: comes from a service config's ``timeout`` (the shipped one's, as the SDK's) times out
#: about 1-1.5 s before the deadline its call sends (gRPC core reckons the config's from a
#: cached clock), so an answer 1 s before it was lost to the client's bare DEADLINE_EXCEEDED.
DEADLINE_MARGIN_SECONDS = 3.0


def call_budget(context: grpc.aio.ServicerContext) -> float | None:
    """Seconds the handler may take, or None when the call has no deadline."""
    remaining: float | None = context.time_remaining()
    if remaining is None or remaining > 86_400:
        return None
    return max(0.001, remaining - min(DEADLINE_MARGIN_SECONDS, remaining / 10))


def timed_out() -> errors.DeadlineExceeded:
    """What a call that ran out of its budget (``call_budget``) is answered with."""
    return errors.DeadlineExceeded("not done before the call's deadline: a service it needs is slow or does "
                                   "not answer", reason="TIMED_OUT")


# Cancellation and grpc's own abort signal must pass through untouched.
PASSTHROUGH: tuple[type[BaseException], ...] = (
    asyncio.CancelledError,
    grpc.aio.AbortError,
    GeneratorExit,
    KeyboardInterrupt,
    SystemExit,
)


def _status_of_call(exc: grpc.RpcError) -> status_pb2.Status | None:
    try:
        st: status_pb2.Status | None = rpc_status.from_call(exc)
    except ValueError:  # details that contradict the call's code: not trusted
        return None
    return st


def _details(st: status_pb2.Status | None, kind: Any) -> list[Any]:
    out: list[Any] = []
    for d in st.details if st is not None else ():
        if d.Is(kind.DESCRIPTOR):
            msg = kind()
            d.Unpack(msg)
            out.append(msg)
    return out


def error_info(exc: grpc.aio.AioRpcError | grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    """The ErrorInfo of a failed call, if the server sent one."""
    infos = _details(_status_of_call(exc), error_details_pb2.ErrorInfo)
    return infos[0] if infos else None


def field_violations(exc: grpc.RpcError) -> list[error_details_pb2.BadRequest.FieldViolation]:
    """The BadRequest field violations of a failed call."""
    return [v for br in _details(_status_of_call(exc), error_details_pb2.BadRequest)
            for v in br.field_violations]


def precondition_violations(exc: grpc.RpcError) -> list[tuple[str, str]]:
    """The PreconditionFailure violations of a failed call, as (subject, description)."""
    return _preconditions(_status_of_call(exc))


def _preconditions(st: status_pb2.Status | None) -> list[tuple[str, str]]:
    return [(v.subject, v.description)
            for pf in _details(st, error_details_pb2.PreconditionFailure) for v in pf.violations]


def from_rpc_error(exc: grpc.RpcError, *, default_reason: str | None = None) -> errors.DlschedError:
    """Rebuild a DlschedError from a failed call to another dlsched service."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    name = code.name if code is not None else "UNKNOWN"
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return _rebuild(name, details, _status_of_call(exc), default_reason)


def from_status(st: status_pb2.Status) -> errors.DlschedError:
    """Rebuild a DlschedError from a ``google.rpc.Status`` another dlsched
    service sent in a message (a non-OK code; OK is not an error)."""
    try:
        name = code_pb2.Code.Name(st.code)
    except ValueError:
        name = "UNKNOWN"
    return _rebuild(name, st.message, st, None)


def _rebuild(name: str, details: str, st: status_pb2.Status | None,
             default_reason: str | None) -> errors.DlschedError:
    cls = _CLASS_BY_CODE.get(name)
    infos = _details(st, error_details_pb2.ErrorInfo)
    info = infos[0] if infos else None
    reason = info.reason if info is not None else (default_reason or name)
    md = dict(info.metadata) if info is not None else {}
    if name in ("UNKNOWN", "CANCELLED"):
        cls = errors.Unavailable
    if cls is None:
        cls = errors.Internal
    if cls is errors.InvalidArgument:
        vs = [errors.FieldViolation(v.field, v.description)
              for br in _details(st, error_details_pb2.BadRequest) for v in br.field_violations]
        return errors.InvalidArgument(details or name, vs, reason=reason, metadata=md)
    if cls is errors.FailedPrecondition:
        return errors.FailedPrecondition(details or name, _preconditions(st), reason=reason, metadata=md)
    return cls(details or name, reason=reason, metadata=md)
