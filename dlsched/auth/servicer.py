"""dlsched.v1.AccessService: transport only, over ``AccessStore``.

Served next to JobManagerService. Every method but GetCaller is for admins.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import TypeVar

import grpc

from dlsched.auth.interceptor import caller
from dlsched.auth.model import (
    ALL_PROJECTS,
    PROJECT_RE,
    ApiToken,
    Role,
    RoleBinding,
    check_principal,
    check_project,
)
from dlsched.auth.store import AccessStore, ApiTokenNotFound, RoleBindingNotFound
from dlsched.auth.tokens import new_api_token
from dlsched.errors import InvalidArgument
from dlsched.kit import tokens
from dlsched.kit.timeutil import check_timestamp, to_timestamp
from dlsched.v1 import access_pb2, access_service_pb2_grpc
from dlsched.v1 import access_service_pb2 as pb

_ROLE_TO_PB = {Role.VIEWER: access_pb2.ROLE_VIEWER, Role.MEMBER: access_pb2.ROLE_MEMBER,
               Role.ADMIN: access_pb2.ROLE_ADMIN}
_ROLE_FROM_PB = {v: k for k, v in _ROLE_TO_PB.items()}


def _binding_to_proto(b: RoleBinding) -> access_pb2.RoleBinding:
    p = access_pb2.RoleBinding(name=f"roleBindings/{b.id}", uid=b.id, principal=b.principal,
                               project=b.project, role=_ROLE_TO_PB[b.role], creator=b.creator)
    if b.create_time:
        p.create_time.CopyFrom(to_timestamp(b.create_time))
    return p


def _token_to_proto(t: ApiToken) -> access_pb2.ApiToken:
    p = access_pb2.ApiToken(name=f"apiTokens/{t.id}", uid=t.id, service_account=t.service_account,
                            description=t.description, creator=t.creator)
    if t.create_time:
        p.create_time.CopyFrom(to_timestamp(t.create_time))
    if t.expire_time:
        p.expire_time.CopyFrom(to_timestamp(t.expire_time))
    return p


T = TypeVar("T")
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
_PAGE_PREFIX = "a1:"
_MAX_TOKEN_CHARS = 4096


def _page(items: Iterable[T], key: Callable[[T], tuple[str, ...]], page_size: int, page_token: str,
          scope: Sequence[str], method: str) -> tuple[list[T], str]:
    """One page of ``items`` in ``key`` order (keyset: after the key the token names) and the
    next page's token. A token is only good for the same filters (``scope``) it was issued for."""
    if page_size < 0:
        raise InvalidArgument.for_field("page_size", "must not be negative (0 means 100; more than 1000 means 1000)")
    size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
    after: tuple[str, ...] | None = None
    if page_token:
        after = _decode_page(page_token, list(scope), method)
    hits = sorted((i for i in items if after is None or key(i) > after), key=key)
    page = hits[:size]
    token = ""
    if len(hits) > size:
        token = tokens.encode(_PAGE_PREFIX + json.dumps([list(scope), list(key(page[-1]))]))
    return page, token


def _decode_page(token: str, scope: list[str], method: str) -> tuple[str, ...]:
    raw = tokens.decode(token) if len(token) <= _MAX_TOKEN_CHARS else None
    try:
        doc = json.loads(raw[len(_PAGE_PREFIX):]) if raw and raw.startswith(_PAGE_PREFIX) else None
    except ValueError:
        doc = None
    if (not isinstance(doc, list) or len(doc) != 2 or not isinstance(doc[1], list)
            or not all(isinstance(k, str) for k in doc[1])):
        raise InvalidArgument.for_field("page_token", f"not a next_page_token of {method}")
    if doc[0] != scope:
        raise InvalidArgument.for_field("page_token", f"issued for a {method} call with other filters")
    return tuple(doc[1])


def _id_from_name(name: str, collection: str, field: str) -> str:
    prefix = f"{collection}/"
    rid = name[len(prefix):] if name.startswith(prefix) else ""
    if not rid or not rid.isascii() or not rid.isalnum() or len(rid) > 64:
        raise InvalidArgument.for_field(field, f"want '{collection}/<id>'")
    return rid


class AccessServicer(access_service_pb2_grpc.AccessServiceServicer):
    def __init__(self, store: AccessStore) -> None:
        self.store = store

    async def GetCaller(self, request: pb.GetCallerRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> pb.GetCallerResponse:
        p = caller()
        return pb.GetCallerResponse(
            principal=p.name, admin=p.admin,
            roles=[access_pb2.ProjectRole(project=proj, role=_ROLE_TO_PB[r])
                   for proj, r in sorted(p.roles.items()) if r in _ROLE_TO_PB])

    async def CreateRoleBinding(self, request: pb.CreateRoleBindingRequest,  # noqa: N802
                                context: grpc.aio.ServicerContext) -> pb.CreateRoleBindingResponse:
        p = caller()
        p.require_admin("managing role bindings")
        rb = request.role_binding
        check_principal(rb.principal, "role_binding.principal")
        check_project(rb.project, "role_binding.project", allow_all=True)
        role = _ROLE_FROM_PB.get(rb.role)
        if role is None:
            raise InvalidArgument.for_field("role_binding.role", "ROLE_VIEWER, ROLE_MEMBER or ROLE_ADMIN")
        if role == Role.ADMIN and rb.project != ALL_PROJECTS:
            raise InvalidArgument.for_field("role_binding.role", "ROLE_ADMIN is bound to project '*' only")
        b = await self.store.put_binding(RoleBinding(
            secrets.token_hex(8), rb.principal, rb.project, role,
            datetime.now(UTC), p.name))
        return pb.CreateRoleBindingResponse(role_binding=_binding_to_proto(b))

    async def ListRoleBindings(self, request: pb.ListRoleBindingsRequest,  # noqa: N802
                               context: grpc.aio.ServicerContext) -> pb.ListRoleBindingsResponse:
        caller().require_admin("listing role bindings")
        if request.principal:  # filters of values no binding can hold are refused, not answered empty
            check_principal(request.principal, "principal")
        if request.project:
            check_project(request.project, "project", allow_all=True)
        matching = (b for b in self.store.bindings.values()
                    if (not request.principal or b.principal == request.principal)
                    and (not request.project or b.project == request.project))
        page, token = _page(matching, lambda b: (b.principal, b.project, b.id), request.page_size,
                            request.page_token, (request.principal, request.project), "ListRoleBindings")
        return pb.ListRoleBindingsResponse(role_bindings=[_binding_to_proto(b) for b in page],
                                           next_page_token=token)

    async def DeleteRoleBinding(self, request: pb.DeleteRoleBindingRequest,  # noqa: N802
                                context: grpc.aio.ServicerContext) -> pb.DeleteRoleBindingResponse:
        caller().require_admin("managing role bindings")
        bid = _id_from_name(request.name, "roleBindings", "name")
        if bid not in self.store.bindings:
            raise RoleBindingNotFound(f"{request.name} not found", metadata={"name": request.name})
        await self.store.delete_binding(bid)
        return pb.DeleteRoleBindingResponse()

    async def CreateApiToken(self, request: pb.CreateApiTokenRequest,  # noqa: N802
                             context: grpc.aio.ServicerContext) -> pb.CreateApiTokenResponse:
        p = caller()
        p.require_admin("managing API tokens")
        t = request.api_token
        if not PROJECT_RE.fullmatch(t.service_account):  # the DNS label of 'sa:<label>'
            raise InvalidArgument.for_field("api_token.service_account",
                                            "a DNS label: lowercase letters, digits and '-', at most 63")
        if len(t.description) > 256:
            raise InvalidArgument.for_field("api_token.description", "at most 256 characters")
        expire = None
        if t.HasField("expire_time"):
            check_timestamp(t.expire_time, "api_token.expire_time")
            expire = t.expire_time.ToDatetime(tzinfo=UTC)
            if expire <= datetime.now(UTC):
                raise InvalidArgument.for_field("api_token.expire_time", "must be in the future")
        tid, secret, digest = new_api_token()
        rec = ApiToken(tid, t.service_account, digest, t.description, expire, datetime.now(UTC), p.name)
        await self.store.put_token(rec)
        return pb.CreateApiTokenResponse(api_token=_token_to_proto(rec), secret=secret)

    async def ListApiTokens(self, request: pb.ListApiTokensRequest,  # noqa: N802
                            context: grpc.aio.ServicerContext) -> pb.ListApiTokensResponse:
        caller().require_admin("listing API tokens")
        if request.service_account and not PROJECT_RE.fullmatch(request.service_account):
            raise InvalidArgument.for_field("service_account", "a service account's name: a DNS label")
        matching = (t for t in self.store.tokens.values()
                    if not request.service_account or t.service_account == request.service_account)
        page, token = _page(matching, lambda t: (t.service_account, t.id), request.page_size,
                            request.page_token, (request.service_account,), "ListApiTokens")
        return pb.ListApiTokensResponse(api_tokens=[_token_to_proto(t) for t in page], next_page_token=token)

    async def DeleteApiToken(self, request: pb.DeleteApiTokenRequest,  # noqa: N802
                             context: grpc.aio.ServicerContext) -> pb.DeleteApiTokenResponse:
        caller().require_admin("managing API tokens")
        tid = _id_from_name(request.name, "apiTokens", "name")
        if tid not in self.store.tokens:
            raise ApiTokenNotFound(f"{request.name} not found", metadata={"name": request.name})
        await self.store.delete_token(tid)
        return pb.DeleteApiTokenResponse()
