"""HTTP request → request message, response message → JSON, by protobuf's JSON mapping.

``build_request`` follows ``google/api/http.proto``: the body (the whole
request for ``body: "*"``, else the one field it names), then query
parameters for every field neither the path nor the body binds (dotted paths
into nested messages, a repeated field by repeating the parameter, proto or
JSON field names, well-known types in their JSON string form), then the path
variables, which win. Anything that does not fit raises ``InvalidArgument``
naming the parameter, so it reaches the client as a 400 with a BadRequest.
Pure protobuf; no HTTP server here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from google.protobuf import descriptor, json_format, message, message_factory

from dlsched import errors

from .rules import Route, RuleError, is_repeated, resolve_field_path

FD = descriptor.FieldDescriptor

# Well-known message types whose JSON form is a string (or a scalar), so a
# query parameter can carry them: since_time=2024-01-02T03:04:05Z.
_SCALAR_WKT = {
    "google.protobuf.Timestamp", "google.protobuf.Duration", "google.protobuf.FieldMask",
    "google.protobuf.StringValue", "google.protobuf.BytesValue", "google.protobuf.Int32Value",
    "google.protobuf.Int64Value", "google.protobuf.UInt32Value", "google.protobuf.UInt64Value",
    "google.protobuf.DoubleValue", "google.protobuf.FloatValue", "google.protobuf.BoolValue",
}
_FLOATS = {FD.TYPE_DOUBLE, FD.TYPE_FLOAT}
#: messages whose JSON is not an object
_NOT_OBJECTS = _SCALAR_WKT | {"google.protobuf.Value", "google.protobuf.ListValue"}


def message_class(desc: descriptor.Descriptor) -> type[message.Message]:
    return message_factory.GetMessageClass(desc)


def _invalid(field: str, description: str) -> errors.InvalidArgument:
    """INVALID_ARGUMENT naming ``field``; "body" for the whole body (a route whose body is the
    request), so that every violation names what to fix."""
    field = field or "body"
    return errors.InvalidArgument(f"invalid request: {field}: {description}",
                                  [errors.FieldViolation(field, description)])


def build_request(route: Route, path_values: Mapping[str, str],
                  query: Iterable[tuple[str, str]], body: bytes) -> message.Message:
    """The request message for one HTTP request on ``route``."""
    msg = message_class(route.method.input_type)()
    _apply_body(route, msg, body)
    pairs = list(query)
    if pairs:
        _apply_query(route, msg, pairs)
    for path, value in path_values.items():
        _set_path_field(msg, path, value)
    return msg


class RequestTooLarge(errors.ResourceExhausted):
    """The request body is over the gateway's limits (``--max-message-bytes``, JSON values): HTTP 413."""

    reason = "REQUEST_TOO_LARGE"


#: The most JSON values (objects, arrays, scalars) a body may hold, counted before the walk over
#: the request's fields: the largest spec the services take has about 70,000 (16 groups of
#: 1,000-entry command, args and env, and labels); a million empty objects cost seconds to walk.
MAX_JSON_VALUES = 200_000


def _count_values(data: Any, limit: int) -> int:
    """How many JSON values ``data`` holds, counting stopped once over ``limit`` (an array's or
    object's members are counted before they are looked into: the work is bounded by ``limit``)."""
    n, stack = 1, [data]
    while stack:
        v = stack.pop()
        members = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
        n += len(members)
        if n > limit:
            return n
        stack.extend(m for m in members if isinstance(m, dict | list))
    return n


def _apply_body(route: Route, msg: message.Message, body: bytes) -> None:
    if not route.body:
        return
    if not body.strip():
        return  # an empty body is an empty message: POST jobs/x:stop needs none
    try:
        data = json.loads(body, object_pairs_hook=_unique_keys)
    except DuplicateKey as e:
        raise _invalid(_body_field(route), str(e)) from e
    except RecursionError as e:  # nested deeper than the interpreter recurses
        raise _invalid(_body_field(route), "not JSON this gateway takes: nested too deeply") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise _invalid(_body_field(route), f"not JSON: {e}") from e
    if _count_values(data, MAX_JSON_VALUES) > MAX_JSON_VALUES:
        raise RequestTooLarge(f"request body of more than {MAX_JSON_VALUES} JSON values",
                              metadata={"limit_values": str(MAX_JSON_VALUES)})
    if route.body != "*":
        field = route.method.input_type.fields_by_name.get(route.body)
        if (field is not None and field.type == FD.TYPE_MESSAGE and not is_repeated(field)
                and _message_type(field).full_name not in _NOT_OBJECTS
                and not isinstance(data, dict | None)):
            raise _invalid(route.body, "the body must be a JSON object")  # [] was taken as {}
        data = {route.body: data}
    elif not isinstance(data, dict):
        raise _invalid("", "the body must be a JSON object")
    try:
        _one_name_per_field(route.method.input_type, data, [])
    except RecursionError as e:
        raise _invalid(_body_field(route), "nested too deeply") from e
    try:
        json_format.ParseDict(data, msg)
    except json_format.ParseError as e:
        try:
            at = ".".join(_locate(route.method.input_type, data, []))
        except RecursionError:
            at = ""
        raise _invalid(at or _parse_error_field(str(e), route), str(e)) from e
    except RecursionError as e:  # a google.protobuf.Value/Struct nested too deeply
        raise _invalid(_body_field(route), "nested too deeply") from e


def _one_name_per_field(desc: descriptor.Descriptor, data: dict[str, Any], path: list[str]) -> None:
    """A field given under both its names (``jobId`` and ``job_id``) is given twice, as a key
    given twice is (protobuf's ParseDict takes the last); checked in every nested message."""
    seen: dict[str, str] = {}
    by_json = {f.json_name: f for f in desc.fields}
    for key, value in data.items():
        field = desc.fields_by_name.get(key) or by_json.get(key)
        if field is None:
            continue  # ParseDict names it
        if field.name in seen:
            raise _invalid(".".join([*path, field.name]), f"given as {seen[field.name]!r} and as {key!r}: "
                                                          "given more than once")
        seen[field.name] = key
        _strict_values(field, value, [*path, field.name])
        sub = field.message_type if field.type == FD.TYPE_MESSAGE else None
        if sub is None or sub.GetOptions().map_entry or sub.full_name.startswith("google.protobuf."):
            continue
        items = value if is_repeated(field) and isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, dict):
                name = f"{field.name}[{i}]" if is_repeated(field) else field.name
                _one_name_per_field(sub, item, [*path, name])


_INTS = frozenset({FD.TYPE_INT32, FD.TYPE_INT64, FD.TYPE_UINT32, FD.TYPE_UINT64, FD.TYPE_SINT32,
                   FD.TYPE_SINT64, FD.TYPE_FIXED32, FD.TYPE_FIXED64, FD.TYPE_SFIXED32, FD.TYPE_SFIXED64})
_INT_TEXT = re.compile(r"-?[0-9]{1,20}\Z")  # ASCII digits: "１" or "١" is no number here
_FLOAT_TEXT = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?\Z|NaN\Z|-?Infinity\Z")
#: proto3 JSON's Duration: seconds with at most 9 fraction digits (more was cut silently)
_DURATION_TEXT = re.compile(r"-?[0-9]{1,12}(?:\.[0-9]{1,9})?s\Z")
_WRAPPERS = frozenset({"google.protobuf.Int32Value", "google.protobuf.Int64Value", "google.protobuf.UInt32Value",
                       "google.protobuf.UInt64Value", "google.protobuf.FloatValue", "google.protobuf.DoubleValue"})


def _strict_values(field: descriptor.FieldDescriptor, value: Any, path: list[str]) -> None:
    """What protobuf's ParseDict takes too loosely for ``field``: a JSON true as the number 1,
    digits of other scripts ("１") as a number, a Duration with more than 9 fraction digits."""
    if value is None:
        return
    sub = field.message_type if field.type == FD.TYPE_MESSAGE else None
    if sub is not None and sub.GetOptions().map_entry:
        if isinstance(value, dict):
            for k, v in value.items():
                _strict_values(sub.fields_by_name["value"], v, [*path[:-1], f"{path[-1]}[{str(k)[:40]!r}]"])
        return
    if is_repeated(field) and isinstance(value, list):
        for i, v in enumerate(value):
            _strict_item(field, sub, v, [*path[:-1], f"{path[-1]}[{i}]"])
        return
    _strict_item(field, sub, value, path)


def _strict_item(field: descriptor.FieldDescriptor, sub: descriptor.Descriptor | None, value: Any,
                 path: list[str]) -> None:
    kind = field.type
    if sub is not None:
        if sub.full_name == "google.protobuf.Duration":
            if not (isinstance(value, str) and _DURATION_TEXT.match(value)):
                raise _invalid(".".join(path), "a duration is a string of seconds with at most 9 fraction "
                                               "digits and an 's' (\"1.5s\")")
            return
        if sub.full_name not in _WRAPPERS:
            return
        kind = sub.fields_by_name["value"].type
    if kind in _INTS:
        if isinstance(value, bool) or not (isinstance(value, int | float) or
                                           (isinstance(value, str) and _INT_TEXT.match(value))):
            raise _invalid(".".join(path), "an integer is a JSON number or a string of ASCII digits")
    elif kind in _FLOATS:
        if isinstance(value, bool) or not (isinstance(value, int | float) or
                                           (isinstance(value, str) and _FLOAT_TEXT.match(value))):
            raise _invalid(".".join(path), "a number is a JSON number or its decimal string")


class DuplicateKey(ValueError):
    """A JSON object names a key twice (protobuf's ``json_format.Parse`` refuses it too)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKey(f"duplicate key {k[:80]!r} in a JSON object")
        out[k] = v
    return out


def _body_field(route: Route) -> str:
    return "" if route.body == "*" else route.body


# json_format names the place of the error: ... has no field named "x" at
# "SubmitJobRequest.spec", or: Failed to parse spec field: ...
_NO_FIELD = re.compile(r'no field named "([^"]+)" at "([^"]+)"')
_BAD_FIELD = re.compile(r"Failed to parse (\w+) field")
# ... and, newer, where: "... at SubmitJobRequest.spec.replicaGroups[0].resources.cpu.."
_AT_FIELD = re.compile(r" at \w+\.((?:\w+(?:\[\d{1,9}\])?\.)*\w+(?:\[\d{1,9}\])?)\.*\Z")


def _parse_error_field(text: str, route: Route) -> str:
    """The request field a json_format error is about, as a path of proto field names with
    indexes (``spec.replica_groups[0].resources.cpu``, as the services name fields); else the
    body field (or "" for a whole-request body). The chain of fields json_format names starts
    at the request: the body's own field included."""
    inp = route.method.input_type
    m = _NO_FIELD.search(text)
    if m:
        at = m.group(2).split(".")[1:]  # drop the root message's name
        return ".".join([*_proto_names(inp, at), m.group(1)])
    if (m := _AT_FIELD.search(text)) is not None:
        return ".".join(_proto_names(inp, m.group(1).split(".")))
    chain = _BAD_FIELD.findall(text)  # outermost first: spec, then maxRetries
    if chain:
        return ".".join(_proto_names(inp, chain))
    return _body_field(route)


def _locate(desc: descriptor.Descriptor, data: dict[str, Any], path: list[str]) -> list[str]:
    """Where in ``data`` (a JSON object ``desc`` failed to parse) the first value that does
    not parse is, as proto field names with list indexes (``spec.replica_groups[1].env``;
    json_format's own message names no index for most values); [] when no single field is.
    Each level parses its fields' values again, alone: an error's cost, bounded by the body's."""
    cls = message_factory.GetMessageClass(desc)
    by_json = {f.json_name: f for f in desc.fields}
    for key, value in data.items():
        f = desc.fields_by_name.get(key) or by_json.get(key)
        if f is None:
            return [*path, key]
        try:
            json_format.ParseDict({key: value}, cls())
            continue
        except json_format.ParseError:
            pass
        sub = f.message_type if f.type == FD.TYPE_MESSAGE else None
        nested = sub is not None and not sub.GetOptions().map_entry and sub.full_name not in _NOT_OBJECTS \
            and sub.full_name != "google.protobuf.Struct"
        if is_repeated(f) and not (sub is not None and sub.GetOptions().map_entry) and isinstance(value, list):
            for i, item in enumerate(value):
                try:
                    json_format.ParseDict({key: [item]}, cls())
                except json_format.ParseError:
                    if nested and sub is not None and isinstance(item, dict):
                        return _locate(sub, item, [*path, f"{f.name}[{i}]"])
                    return [*path, f"{f.name}[{i}]"]
        elif nested and sub is not None and isinstance(value, dict):
            return _locate(sub, value, [*path, f.name])
        return [*path, f.name]
    return []


def _proto_names(desc: descriptor.Descriptor, path: list[str]) -> list[str]:
    """``path``'s JSON field names (each maybe with an ``[i]``) as proto names, from ``desc``;
    what does not resolve stays as it is."""
    out: list[str] = []
    cur: descriptor.Descriptor | None = desc
    for part in path:
        name, bracket, index = part.partition("[")
        by_json = {f.json_name: f for f in cur.fields} if cur is not None else {}
        field = None if cur is None else cur.fields_by_name.get(name) or by_json.get(name)
        if field is None:
            out.append(part)
            cur = None
            continue
        out.append(field.name + (bracket + index if bracket else ""))
        sub = field.message_type if field.type == FD.TYPE_MESSAGE else None
        cur = sub if sub is not None and not sub.GetOptions().map_entry else None
    return out


def _apply_query(route: Route, msg: message.Message, pairs: list[tuple[str, str]]) -> None:
    if route.body == "*":
        raise _invalid(pairs[0][0], "query parameters are not accepted here: "
                                    "the JSON body holds the whole request")
    inp = route.method.input_type
    bound = route.path_fields
    # By the field a key names: ``tail_lines`` and ``tailLines`` are one field, given twice.
    grouped: dict[str, tuple[str, list[descriptor.FieldDescriptor], list[str]]] = {}
    for key, value in pairs:
        try:
            fields = resolve_field_path(inp, key.split("."))
        except RuleError as e:
            if not key:
                raise _invalid("query", "a query parameter with no name") from e
            raise _invalid(key, f"unknown query parameter ({e})") from e
        proto_path = ".".join(f.name for f in fields)
        first = grouped.setdefault(proto_path, (key, fields, []))
        if first[0] != key:
            raise _invalid(proto_path, f"given as {first[0]!r} and as {key!r}: given more than once")
        first[2].append(value)
    for proto_path, (_, fields, values) in grouped.items():
        key = proto_path  # errors name the field by its proto path, whatever name the query used
        if proto_path in bound or any(p.startswith(proto_path + ".") for p in bound):
            raise _invalid(key, "set by the URL path, not the query")
        if route.body and fields[0].name == route.body:
            raise _invalid(key, "set by the request body, not the query")
        for f in fields[:-1]:
            if f.type != FD.TYPE_MESSAGE or is_repeated(f):
                raise _invalid(key, f"{f.name} is not a singular message")
        leaf = fields[-1]
        if leaf.message_type is not None and leaf.message_type.GetOptions().map_entry:
            raise _invalid(key, "map fields cannot be set from the query; use the body")
        if leaf.type == FD.TYPE_MESSAGE and _message_type(leaf).full_name not in _SCALAR_WKT:
            raise _invalid(key, "a message field cannot be set from the query; "
                                "name one of its fields (a.b=…)")
        repeated = is_repeated(leaf)
        if not repeated and len(values) > 1:
            raise _invalid(key, "given more than once")
        try:
            converted = [_query_value(leaf, v) for v in values]
        except ValueError as e:
            raise _invalid(key, str(e)) from e
        tree: dict[str, Any] = {}
        node = tree
        for f in fields[:-1]:
            node = node.setdefault(f.name, {})
        node[leaf.name] = converted if repeated else converted[0]
        try:  # each parameter alone, so an error names its own
            parsed = message_class(inp)()
            json_format.ParseDict(tree, parsed)
        except json_format.ParseError as e:
            raise _invalid(key, str(e)) from e
        msg.MergeFrom(parsed)


def _message_type(f: descriptor.FieldDescriptor) -> descriptor.Descriptor:
    """The message type of a TYPE_MESSAGE field (never None for one)."""
    assert f.message_type is not None, f.full_name
    return f.message_type


def _query_value(f: descriptor.FieldDescriptor, text: str) -> Any:
    """A query string value as the JSON value json_format expects for ``f``."""
    kind = f.type
    if kind == FD.TYPE_MESSAGE:  # a scalar well-known type
        if _message_type(f).full_name == "google.protobuf.FieldMask":
            # paths by field name (``state_message``, as grpc-gateway passes them) or JSON name
            return ",".join(_json_path(p) for p in text.split(","))
        inner = _message_type(f).fields_by_name.get("value")
        if _message_type(f).full_name == "google.protobuf.BoolValue" or (
                inner is not None and inner.type == FD.TYPE_BOOL):
            return _bool(text)
        if inner is not None and inner.type in _FLOATS:
            if not _FLOAT_TEXT.match(text):
                raise ValueError(f"not a number: {text[:40]!r}")
            return float(text)
        if inner is not None and inner.type in _INTS and not _INT_TEXT.match(text):
            raise ValueError(f"not an integer (ASCII digits): {text[:40]!r}")
        if _message_type(f).full_name == "google.protobuf.Duration" and not _DURATION_TEXT.match(text):
            raise ValueError("a duration is seconds with at most 9 fraction digits and an 's' (\"1.5s\")")
        return text
    if kind == FD.TYPE_BOOL:
        return _bool(text)
    if kind in _FLOATS:
        if not _FLOAT_TEXT.match(text):
            raise ValueError(f"not a number: {text[:40]!r}")
        return float(text)
    if kind in _INTS and not _INT_TEXT.match(text):
        raise ValueError(f"not an integer (ASCII digits): {text[:40]!r}")
    return text  # ints (json_format takes strings), strings, enums (name or number), bytes


def _json_path(path: str) -> str:
    """``a_b.c_d`` -> ``aB.cD`` (a FieldMask path's JSON form; one in that form stays)."""
    return ".".join(re.sub(r"_([a-z0-9])", lambda m: m.group(1).upper(), seg) for seg in path.split("."))


def _bool(text: str) -> bool:
    low = text.lower()
    if low in ("true", "1"):
        return True
    if low in ("false", "0"):
        return False
    raise ValueError("expected true or false")


def _set_path_field(msg: message.Message, path: str, value: str) -> None:
    fields = resolve_field_path(msg.DESCRIPTOR, path.split("."))  # type: ignore[arg-type]  # upb's Descriptor
    target = msg
    for f in fields[:-1]:
        target = getattr(target, f.name)
    leaf = fields[-1]
    try:
        if leaf.type == FD.TYPE_STRING:
            converted: Any = value
        elif leaf.type == FD.TYPE_BOOL:
            converted = _bool(value)
        elif leaf.type in _FLOATS:
            converted = float(value)
        elif leaf.type == FD.TYPE_ENUM:
            ev = leaf.enum_type.values_by_name.get(value) if leaf.enum_type is not None else None
            converted = ev.number if ev is not None else int(value)
        else:
            converted = int(value)
        setattr(target, leaf.name, converted)
    except (ValueError, TypeError) as e:
        raise _invalid(path, f"bad path value: {e}") from e


def to_json_dict(msg: message.Message) -> dict[str, Any]:
    """Protobuf's canonical JSON mapping (lowerCamelCase names, defaults omitted),
    the same as Envoy's transcoder prints."""
    out: dict[str, Any] = json_format.MessageToDict(msg)
    return out


def response_json(route: Route, msg: message.Message) -> Any:
    """The JSON body for a response: the whole message or its ``response_body`` field."""
    if not route.response_body:
        return to_json_dict(msg)
    wrapper = to_json_dict(msg)
    f = msg.DESCRIPTOR.fields_by_name[route.response_body]
    return wrapper.get(f.json_name)


def dumps(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()
