"""An OpenAPI 3.0 document built from the same routes and message descriptors.

Paths: a variable that spans segments, ``/v1/{name=jobs/*}:stop``, becomes
one parameter per ``*`` named after the collection before it,
``/v1/jobs/{jobsId}:stop`` (Google's convention), because OpenAPI parameters
cannot hold a ``/``; the operation's description says which request field the
segments form. Schemas: one per message and enum under
``components/schemas``, keyed by full name, in protobuf's JSON mapping
(lowerCamelCase, int64 as string, enums by name, well-known types in their
JSON form); recursion is by ``$ref``, so any depth is fine. A streaming RPC's
200 is ``application/x-ndjson`` (one message per line) or
``text/event-stream``. Errors are ``google.rpc.Status``. Every operation
needs a bearer token (``securitySchemes.bearerAuth``, required globally): a
missing or invalid one is a 401, a role that does not allow the call a 403.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from google.protobuf import descriptor
from google.rpc import status_pb2

from .rules import Route, Variable, is_repeated

FD = descriptor.FieldDescriptor

_SCALARS: dict[int, dict[str, Any]] = {
    FD.TYPE_DOUBLE: {"type": "number", "format": "double"},
    FD.TYPE_FLOAT: {"type": "number", "format": "float"},
    FD.TYPE_INT32: {"type": "integer", "format": "int32"},
    FD.TYPE_SINT32: {"type": "integer", "format": "int32"},
    FD.TYPE_SFIXED32: {"type": "integer", "format": "int32"},
    FD.TYPE_UINT32: {"type": "integer", "format": "int64", "minimum": 0},
    FD.TYPE_FIXED32: {"type": "integer", "format": "int64", "minimum": 0},
    FD.TYPE_INT64: {"type": "string", "format": "int64"},
    FD.TYPE_SINT64: {"type": "string", "format": "int64"},
    FD.TYPE_SFIXED64: {"type": "string", "format": "int64"},
    FD.TYPE_UINT64: {"type": "string", "format": "uint64"},
    FD.TYPE_FIXED64: {"type": "string", "format": "uint64"},
    FD.TYPE_BOOL: {"type": "boolean"},
    FD.TYPE_STRING: {"type": "string"},
    FD.TYPE_BYTES: {"type": "string", "format": "byte"},
}

_WKT: dict[str, dict[str, Any]] = {
    "google.protobuf.Timestamp": {"type": "string", "format": "date-time"},
    "google.protobuf.Duration": {"type": "string", "pattern": r"^-?[0-9]+(\.[0-9]+)?s$",
                                 "example": "90s"},
    "google.protobuf.FieldMask": {"type": "string", "description": "comma-separated field paths"},
    "google.protobuf.Struct": {"type": "object", "additionalProperties": True},
    "google.protobuf.Value": {},
    "google.protobuf.ListValue": {"type": "array", "items": {}},
    "google.protobuf.Empty": {"type": "object"},
    "google.protobuf.Any": {"type": "object", "properties": {"@type": {"type": "string"}},
                            "additionalProperties": True},
    "google.protobuf.StringValue": {"type": "string", "nullable": True},
    "google.protobuf.BytesValue": {"type": "string", "format": "byte", "nullable": True},
    "google.protobuf.BoolValue": {"type": "boolean", "nullable": True},
    "google.protobuf.Int32Value": {"type": "integer", "format": "int32", "nullable": True},
    "google.protobuf.UInt32Value": {"type": "integer", "format": "int64", "nullable": True},
    "google.protobuf.Int64Value": {"type": "string", "format": "int64", "nullable": True},
    "google.protobuf.UInt64Value": {"type": "string", "format": "uint64", "nullable": True},
    "google.protobuf.DoubleValue": {"type": "number", "format": "double", "nullable": True},
    "google.protobuf.FloatValue": {"type": "number", "format": "float", "nullable": True},
}

BEARER_AUTH = {
    "type": "http", "scheme": "bearer",
    "description": "A dlsched API token (`dls_...`, from AccessService.CreateApiToken) or an "
                   "OIDC ID token of the configured issuer, sent as `Authorization: Bearer "
                   "<token>`. The gateway forwards it to the service; roles per project "
                   "(viewer, member, admin) decide what the caller may do, and jobs of "
                   "projects the caller cannot read answer 404.",
}

_OPENAPI_METHODS = {"get", "put", "post", "delete", "patch", "head", "options", "trace"}
_QUERY_DEPTH = 3  # nested query parameters listed, e.g. a.b.c


def openapi_path(route: Route) -> tuple[str, list[dict[str, Any]]]:
    """The OpenAPI path of a route and its path parameters."""
    parts: list[str] = []
    params: list[dict[str, Any]] = []
    for seg in route.template.segments:
        if not isinstance(seg, Variable):
            parts.append(seg)
            continue
        field = ".".join(seg.field_path)
        if seg.segments == ("*",):
            parts.append("{" + field + "}")
            params.append(_path_param(field, f"The request's `{field}`."))
            continue
        inner: list[str] = []
        prev = field.split(".")[-1]
        for s in seg.segments:
            if s in ("*", "**"):
                pname = f"{prev}Id"
                inner.append("{" + pname + "}")
                params.append(_path_param(
                    pname, f"Part of the request's `{field}` "
                    f"(`{'/'.join(seg.segments)}`)."))
            else:
                inner.append(s)
                prev = s
        parts.append("/".join(inner))
    path = "/" + "/".join(parts) + (":" + route.template.verb if route.template.verb else "")
    return path, params


def _path_param(name: str, description: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "description": description,
            "schema": {"type": "string"}}


class _Schemas:
    def __init__(self) -> None:
        self.schemas: dict[str, dict[str, Any]] = {}

    def ref(self, name: str) -> dict[str, Any]:
        return {"$ref": f"#/components/schemas/{name}"}

    def message(self, desc: descriptor.Descriptor) -> dict[str, Any]:
        if desc.full_name in _WKT:
            return dict(_WKT[desc.full_name])
        if desc.full_name not in self.schemas:
            self.schemas[desc.full_name] = {}  # placeholder: recursion ends here
            props = {f.json_name: self.field(f) for f in desc.fields}
            schema: dict[str, Any] = {"type": "object", "properties": props}
            oneofs = [o for o in desc.oneofs if not _synthetic(o)]
            if oneofs:
                schema["description"] = "At most one of each group is set: " + "; ".join(
                    ", ".join(f.json_name for f in o.fields) for o in oneofs) + "."
            self.schemas[desc.full_name] = schema
        return self.ref(desc.full_name)

    def enum(self, desc: descriptor.EnumDescriptor) -> dict[str, Any]:
        if desc.full_name not in self.schemas:
            self.schemas[desc.full_name] = {"type": "string",
                                            "enum": [v.name for v in desc.values]}
        return self.ref(desc.full_name)

    def single(self, f: descriptor.FieldDescriptor) -> dict[str, Any]:
        if f.type == FD.TYPE_MESSAGE and f.message_type is not None:
            return self.message(f.message_type)
        if f.type == FD.TYPE_ENUM and f.enum_type is not None:
            return self.enum(f.enum_type)
        return dict(_SCALARS[f.type])

    def field(self, f: descriptor.FieldDescriptor) -> dict[str, Any]:
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            value = f.message_type.fields_by_name["value"]
            return {"type": "object", "additionalProperties": self.single(value)}
        if is_repeated(f):
            return {"type": "array", "items": self.single(f)}
        return self.single(f)


def _synthetic(o: descriptor.OneofDescriptor) -> bool:
    # proto3 `optional` makes a one-field oneof named _field.
    return len(o.fields) == 1 and o.name == "_" + o.fields[0].name


def _query_params(route: Route, schemas: _Schemas) -> list[dict[str, Any]]:
    if route.body == "*":
        return []
    bound = route.path_fields
    out: list[dict[str, Any]] = []

    def walk(desc: descriptor.Descriptor, prefix: str, depth: int) -> None:
        for f in desc.fields:
            name = prefix + f.name
            if name in bound or (not prefix and f.name == route.body):
                continue
            is_map = f.message_type is not None and f.message_type.GetOptions().map_entry
            if is_map:
                continue
            if f.type == FD.TYPE_MESSAGE and f.message_type is not None and f.message_type.full_name not in _WKT:
                if not is_repeated(f) and depth < _QUERY_DEPTH:
                    walk(f.message_type, name + ".", depth + 1)
                continue
            schema = schemas.field(f)
            param: dict[str, Any] = {"name": name, "in": "query", "schema": schema}
            if is_repeated(f):
                param["style"] = "form"
                param["explode"] = True
            out.append(param)

    walk(route.method.input_type, "", 1)
    return out


def build_openapi(routes: Sequence[Route], *, title: str = "dlsched HTTP/JSON API",
                  version: str = "v1") -> dict[str, Any]:
    """The OpenAPI 3.0.3 document of ``routes``."""
    schemas = _Schemas()
    status_ref = schemas.message(status_pb2.Status.DESCRIPTOR)
    paths: dict[str, dict[str, Any]] = {}
    tags: dict[str, str] = {}
    for route in routes:
        if route.http_method.lower() not in _OPENAPI_METHODS:
            continue  # a custom kind has no OpenAPI operation
        path, params = openapi_path(route)
        m = route.method
        tags[m.containing_service.name] = m.containing_service.full_name
        bound = ", ".join(f"`{f}`" for f in sorted(route.path_fields))
        desc = f"gRPC `{m.full_name}`."
        if bound:
            desc += f" The path sets {bound}."
        op: dict[str, Any] = {
            "operationId": route.operation_id,
            "summary": m.name,
            "description": desc,
            "tags": [m.containing_service.name],
            "parameters": params + _query_params(route, schemas),
        }
        if route.body:
            if route.body == "*":
                body_schema = schemas.message(m.input_type)
            else:
                body_schema = schemas.field(m.input_type.fields_by_name[route.body])
            op["requestBody"] = {"required": route.body != "*",
                                 "content": {"application/json": {"schema": body_schema}}}
        if route.response_body:
            out_schema = schemas.field(m.output_type.fields_by_name[route.response_body])
        else:
            out_schema = schemas.message(m.output_type)
        if route.server_streaming:
            ok = {"description": "A stream of messages: one JSON object per line (NDJSON), "
                                 "or server-sent events with Accept: text/event-stream. "
                                 "An error after the first message arrives as a last line "
                                 '`{"error": <google.rpc.Status>}`.',
                  "content": {"application/x-ndjson": {"schema": out_schema},
                              "text/event-stream": {"schema": {"type": "string"}}}}
        else:
            ok = {"description": "OK", "content": {"application/json": {"schema": out_schema}}}
        op["responses"] = {
            "200": ok,
            "401": {"description": "UNAUTHENTICATED: no bearer token, or one that is invalid, "
                                   "expired or revoked (reason UNAUTHENTICATED or "
                                   "TOKEN_EXPIRED).",
                    "headers": {"WWW-Authenticate": {"schema": {"type": "string"}}},
                    "content": {"application/json": {"schema": status_ref}}},
            "403": {"description": "PERMISSION_DENIED: the caller's role does not allow this "
                                   "(reason PERMISSION_DENIED).",
                    "content": {"application/json": {"schema": status_ref}}},
            "default": {"description": "An error: google.rpc.Status with an ErrorInfo reason.",
                        "content": {"application/json": {"schema": status_ref}}},
        }
        if route.server_streaming:
            op["x-server-streaming"] = True
        paths.setdefault(path, {})[route.http_method.lower()] = op
    return {
        "openapi": "3.0.3",
        "info": {"title": title, "version": version,
                 "description": "Generated at start-up from the google.api.http annotations "
                                "of protos/dlsched/v1; the same routes the gateway serves."},
        "tags": [{"name": n, "description": f"gRPC service `{full}`"}
                 for n, full in tags.items()],
        "paths": paths,
        "security": [{"bearerAuth": []}],
        "components": {"schemas": schemas.schemas,
                       "securitySchemes": {"bearerAuth": dict(BEARER_AUTH)}},
    }
