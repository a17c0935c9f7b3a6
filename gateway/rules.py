"""HTTP routes read from the ``google.api.http`` options of the service descriptors.

The protos are the route table: ``routes_for`` turns every annotated method
(and its ``additional_bindings``) into a ``Route`` with a compiled path
template, and checks at start-up that each path variable and body field names
a field of the request message, so a bad annotation stops the gateway instead
of serving a broken route. Pure protobuf; no HTTP server here.

Path templates follow ``google/api/http.proto``::

    Template = "/" Segments [ Verb ] ;
    Segment  = "*" | "**" | LITERAL | Variable ;
    Variable = "{" FieldPath [ "=" Segments ] "}" ;
    Verb     = ":" LITERAL ;
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from google.api import annotations_pb2, http_pb2
from google.protobuf import descriptor

FD = descriptor.FieldDescriptor

_SCALAR_PATH_TYPES = {
    FD.TYPE_STRING, FD.TYPE_INT32, FD.TYPE_INT64, FD.TYPE_UINT32, FD.TYPE_UINT64,
    FD.TYPE_SINT32, FD.TYPE_SINT64, FD.TYPE_FIXED32, FD.TYPE_FIXED64, FD.TYPE_SFIXED32,
    FD.TYPE_SFIXED64, FD.TYPE_BOOL, FD.TYPE_ENUM, FD.TYPE_DOUBLE, FD.TYPE_FLOAT,
}


class RuleError(ValueError):
    """An http annotation that cannot be served (bad template, unknown field)."""


@dataclass(frozen=True)
class Variable:
    """A ``{field.path=segments}`` of a template: its regex group and field path."""

    group: str
    field_path: tuple[str, ...]
    segments: tuple[str, ...]  # the inner template, e.g. ("jobs", "*")

    @property
    def multi_segment(self) -> bool:
        return len(self.segments) > 1 or "**" in self.segments


class BadPathValue(ValueError):
    """A path variable that is not UTF-8 once percent-decoded (``%FF``): its field path."""


@dataclass(frozen=True)
class PathTemplate:
    """A parsed path template, compiled to an anchored regex over the raw path."""

    text: str
    segments: tuple[str | Variable, ...]
    verb: str
    regex: re.Pattern[str]

    @property
    def variables(self) -> list[Variable]:
        return [s for s in self.segments if isinstance(s, Variable)]

    def match(self, raw_path: str) -> dict[str, str] | None:
        """Field path (dotted) → decoded value, or None when the path does not match."""
        m = self.regex.match(raw_path)
        if m is None:
            return None
        out = {}
        for v in self.variables:
            field = ".".join(v.field_path)
            try:
                out[field] = _decode(m.group(v.group), v.multi_segment)
            except UnicodeDecodeError as e:
                raise BadPathValue(field) from e
        return out


def _decode(raw: str, multi_segment: bool) -> str:
    # http.proto: a single-segment variable is fully percent-decoded; a
    # multi-segment one keeps %2F, so a decoded "/" never forges a segment.
    if not multi_segment:
        return urllib.parse.unquote(raw, errors="strict")
    return "%2F".join(urllib.parse.unquote(p, errors="strict") for p in re.split("%2[fF]", raw))


def _split_top(text: str, sep: str) -> list[str]:
    """Split on ``sep`` outside braces."""
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth < 0:
                raise RuleError(f"unbalanced braces in {text!r}")
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise RuleError(f"unbalanced braces in {text!r}")
    parts.append("".join(cur))
    return parts


_LITERAL = re.compile(r"^[A-Za-z0-9._~!$&'()+,;=@-]+\Z")
_FIELD_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")


def _segment_regex(seg: str, last: bool) -> str:
    if seg == "*":
        return "[^/]+"
    if seg == "**":
        if not last:
            raise RuleError("'**' must be the last segment")
        return ".*"
    if not _LITERAL.match(seg):
        raise RuleError(f"bad literal segment {seg!r}")
    return re.escape(seg)


def parse_template(text: str) -> PathTemplate:
    """Parse and compile one ``google.api.http`` path template."""
    if not text.startswith("/"):
        raise RuleError(f"template {text!r} must start with '/'")
    body = text[1:]
    verb = ""
    pieces = _split_top(body, ":")
    if len(pieces) > 2:
        raise RuleError(f"template {text!r} has more than one verb")
    if len(pieces) == 2:
        body, verb = pieces
        if "/" in verb or not _LITERAL.match(verb):
            raise RuleError(f"bad verb {verb!r} in {text!r}")
    raw_segments = _split_top(body, "/")
    segments: list[str | Variable] = []
    regex_parts: list[str] = []
    for i, seg in enumerate(raw_segments):
        last = i == len(raw_segments) - 1
        if seg.startswith("{") and seg.endswith("}"):
            inner = seg[1:-1]
            path, _, sub = inner.partition("=")
            if not _FIELD_PATH.match(path):
                raise RuleError(f"bad field path {path!r} in {text!r}")
            subs = tuple(sub.split("/")) if sub else ("*",)
            group = f"v{len([s for s in segments if isinstance(s, Variable)])}"
            inner_rx = "/".join(_segment_regex(s, last and j == len(subs) - 1)
                                for j, s in enumerate(subs))
            var = Variable(group, tuple(path.split(".")), subs)
            segments.append(var)
            regex_parts.append(f"(?P<{group}>{inner_rx})")
        else:
            segments.append(seg)
            regex_parts.append(_segment_regex(seg, last))
    rx = "^/" + "/".join(regex_parts) + (":" + re.escape(verb) if verb else "") + "$"
    return PathTemplate(text, tuple(segments), verb, re.compile(rx))


@dataclass(frozen=True)
class Route:
    """One HTTP binding of one RPC."""

    http_method: str  # GET, POST, PUT, PATCH, DELETE or a custom kind
    template: PathTemplate
    body: str  # "" (none), "*" (the whole request) or a top-level request field
    response_body: str  # "" (the whole response) or a top-level response field
    method: descriptor.MethodDescriptor

    @property
    def service(self) -> str:
        return self.method.containing_service.full_name

    @property
    def grpc_path(self) -> str:
        return f"/{self.service}/{self.method.name}"

    @property
    def server_streaming(self) -> bool:
        return bool(self.method.server_streaming)

    @property
    def path_fields(self) -> set[str]:
        return {".".join(v.field_path) for v in self.template.variables}

    @property
    def operation_id(self) -> str:
        return f"{self.method.containing_service.name}_{self.method.name}"


def resolve_field_path(message: descriptor.Descriptor,
                       path: Sequence[str]) -> list[descriptor.FieldDescriptor]:
    """The field descriptors along a dotted path; names may be proto or JSON names."""
    out: list[descriptor.FieldDescriptor] = []
    current: descriptor.Descriptor | None = message
    for i, name in enumerate(path):
        if current is None:
            raise RuleError(f"{'.'.join(path[:i])} is not a message")
        f = current.fields_by_name.get(name) or _by_json_name(current, name)
        if f is None:
            raise RuleError(f"{current.full_name} has no field {name!r}")
        out.append(f)
        is_message = f.type == FD.TYPE_MESSAGE and not is_repeated(f)
        current = f.message_type if is_message else None
    return out


def _by_json_name(message: descriptor.Descriptor, name: str) -> descriptor.FieldDescriptor | None:
    for f in message.fields:
        if f.json_name == name:
            return f
    return None


def is_repeated(f: descriptor.FieldDescriptor) -> bool:
    """Whether a field is repeated (or a map), across protobuf versions:
    ``is_repeated`` replaced ``label`` in protobuf 6."""
    rep = getattr(f, "is_repeated", None)
    if rep is not None:
        return bool(rep)
    return bool(f.label == FD.LABEL_REPEATED)  # type: ignore[attr-defined,unused-ignore]


def _routes_of_rule(rule: http_pb2.HttpRule, method: descriptor.MethodDescriptor) -> list[Route]:
    kind = rule.WhichOneof("pattern")
    if kind is None:
        raise RuleError(f"{method.full_name}: http rule without a pattern")
    if kind == "custom":
        verb, text = rule.custom.kind.upper(), rule.custom.path
    else:
        verb, text = kind.upper(), getattr(rule, kind)
    template = parse_template(text)
    inp, out = method.input_type, method.output_type
    for var in template.variables:
        fields = resolve_field_path(inp, var.field_path)
        leaf = fields[-1]
        if is_repeated(leaf) or leaf.type not in _SCALAR_PATH_TYPES:
            raise RuleError(f"{method.full_name}: path variable {'.'.join(var.field_path)} "
                            "must be a singular scalar field")
    if rule.body not in ("", "*") and rule.body not in inp.fields_by_name:
        raise RuleError(f"{method.full_name}: body {rule.body!r} is not a field of {inp.full_name}")
    if rule.response_body and rule.response_body not in out.fields_by_name:
        raise RuleError(f"{method.full_name}: response_body {rule.response_body!r} "
                        f"is not a field of {out.full_name}")
    if method.client_streaming:
        raise RuleError(f"{method.full_name}: client streaming cannot be transcoded")
    routes = [Route(verb, template, rule.body, rule.response_body, method)]
    for extra in rule.additional_bindings:
        routes.extend(_routes_of_rule(extra, method))
    return routes


def routes_for(services: Iterable[descriptor.ServiceDescriptor]) -> list[Route]:
    """Every HTTP route the services' annotations declare, most specific first.

    A route with a verb (``:stop``) comes before a verb-less route whose
    variable could swallow the verb (``{name=jobs/*}`` matches ``jobs/a:stop``).
    """
    routes: list[Route] = []
    for service in services:
        for method in service.methods:
            opts = method.GetOptions()
            if not opts.HasExtension(annotations_pb2.http):
                continue
            routes.extend(_routes_of_rule(opts.Extensions[annotations_pb2.http], method))
    seen: dict[tuple[str, str], str] = {}
    for r in routes:
        key = (r.http_method, r.template.text)
        if key in seen:
            raise RuleError(f"{r.http_method} {r.template.text} is bound twice "
                            f"({seen[key]} and {r.method.full_name})")
        seen[key] = r.method.full_name
    routes.sort(key=lambda r: (r.template.verb == "",
                               -sum(len(s) for s in r.template.segments if isinstance(s, str))))
    return routes
