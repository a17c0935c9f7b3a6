"""gRPC status → HTTP status and a JSON ``google.rpc.Status`` body.

The body is the ``google.rpc.Status`` the service sent in its
``grpc-status-details-bin`` trailer, printed by protobuf's JSON mapping:
``{"code": 5, "message": "...", "details": [{"@type":
"type.googleapis.com/google.rpc.ErrorInfo", "reason": "JOB_NOT_FOUND", ...}]}``
— the same shape Envoy's transcoder prints with ``convert_grpc_status``, so a
client reads errors the same way behind either. The HTTP status is the
standard mapping of ``google/rpc/code.proto``.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc
from google.protobuf import json_format
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from dlsched import errors
from dlsched.kit import rpc_errors

log = logging.getLogger("gateway.status")

# Importing error_details_pb2 registers ErrorInfo, BadRequest, ... in the
# default pool, so the Any details print as JSON objects.
_DETAIL_TYPES = error_details_pb2

HTTP_STATUS: dict[int, int] = {
    code_pb2.OK: 200,
    code_pb2.CANCELLED: 499,
    code_pb2.UNKNOWN: 500,
    code_pb2.INVALID_ARGUMENT: 400,
    code_pb2.DEADLINE_EXCEEDED: 504,
    code_pb2.NOT_FOUND: 404,
    code_pb2.ALREADY_EXISTS: 409,
    code_pb2.PERMISSION_DENIED: 403,
    code_pb2.UNAUTHENTICATED: 401,
    code_pb2.RESOURCE_EXHAUSTED: 429,
    code_pb2.FAILED_PRECONDITION: 400,
    code_pb2.ABORTED: 409,
    code_pb2.OUT_OF_RANGE: 400,
    code_pb2.UNIMPLEMENTED: 501,
    code_pb2.INTERNAL: 500,
    code_pb2.UNAVAILABLE: 503,
    code_pb2.DATA_LOSS: 500,
}


def http_status(code: int) -> int:
    return HTTP_STATUS.get(code, 500)


def from_rpc_error(exc: grpc.aio.AioRpcError) -> status_pb2.Status:
    """The service's rich status, or one built from the call's code and message."""
    try:
        st = rpc_status.from_call(exc)
    except ValueError:  # trailer and call disagree on the code
        st = None
    if st is not None:
        return st
    code = exc.code()
    number = code.value[0] if code is not None else code_pb2.UNKNOWN
    # gRPC's own end of the call (a deadline, a lost connection), not the service's: an
    # ErrorInfo all the same, so REST clients branch on a reason as they do for the rest.
    reason = _UPSTREAM_REASONS.get(number, code_pb2.Code.Name(number))
    info = error_details_pb2.ErrorInfo(reason=reason, domain=errors.DOMAIN, metadata={"source": "grpc"})
    st = status_pb2.Status(code=number, message=rpc_errors.clip(exc.details() or code_pb2.Code.Name(number),
                                                                       rpc_errors.MAX_MESSAGE_BYTES))
    st.details.add().Pack(info)
    return st


#: reasons of the statuses gRPC makes itself, by code
_UPSTREAM_REASONS = {code_pb2.DEADLINE_EXCEEDED: "TIMED_OUT", code_pb2.UNAVAILABLE: "UPSTREAM_UNAVAILABLE",
                     code_pb2.CANCELLED: "CANCELLED", code_pb2.RESOURCE_EXHAUSTED: "RESOURCE_EXHAUSTED"}


def from_error(err: errors.DlschedError) -> status_pb2.Status:
    """The status for an error the gateway itself raises (bad JSON, unknown route)."""
    return rpc_errors.to_status(err)


def to_json(st: status_pb2.Status) -> dict[str, Any]:
    """``google.rpc.Status`` as JSON; a detail of a type this process does not
    know is left out rather than failing the whole answer."""
    out: dict[str, Any] = {"code": st.code}
    if st.message:
        out["message"] = st.message
    details = []
    for d in st.details:
        try:
            details.append(json_format.MessageToDict(d))
        except (TypeError, KeyError, json_format.Error):
            log.debug("status detail of unknown type %s left out", d.type_url)
    if details:
        out["details"] = details
    return out
