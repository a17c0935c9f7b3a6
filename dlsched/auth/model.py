"""Who is calling and what they may do: plain Python, no grpc, no etcd.

A ``Principal`` is what authentication yields: a name (``user:alice``,
``sa:ci-bot``, ``service:job-manager``), the groups an OIDC token gave it and
its roles per project, resolved from role bindings (and token claims) at the
moment of the call. Services ask it questions (``role_in``, ``may_read``,
``may_write``, ``require_admin``) instead of reading roles themselves, so the
rules live here once.

Roles are ordered: viewer < member < admin. A binding to project ``*`` holds
in every project; ``admin`` is only ever bound to ``*``.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from dlsched.errors import InvalidArgument, PermissionDenied

ALL_PROJECTS = "*"
DEFAULT_PROJECT = "default"
# A project is a lowercase DNS label (RFC 1123), like a Kubernetes namespace.
PROJECT_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
# user:/group: subjects come from an identity provider: printable, no spaces.
_PRINCIPAL_RE = re.compile(r"(user|group):[\x21-\x7e]{1,256}|sa:[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class Role(enum.IntEnum):
    """A role in a project; higher values include the lower ones."""

    UNSPECIFIED = 0
    VIEWER = 1
    MEMBER = 2
    ADMIN = 3


@dataclass(frozen=True)
class RoleBinding:
    """A principal's role in a project (``*``: every project)."""

    id: str
    principal: str
    project: str
    role: Role
    create_time: datetime | None = None
    creator: str = ""


@dataclass(frozen=True)
class ApiToken:
    """A service account's API token, without its secret."""

    id: str
    service_account: str
    sha256: str  # hex digest of the whole secret
    description: str = ""
    expire_time: datetime | None = None
    create_time: datetime | None = None
    creator: str = ""

    @property
    def principal(self) -> str:
        return f"sa:{self.service_account}"


@dataclass(frozen=True)
class Principal:
    """An authenticated caller and its roles at the time of the call."""

    name: str
    roles: Mapping[str, Role] = field(default_factory=dict)  # project (or "*") -> role
    groups: tuple[str, ...] = ()
    control_plane: bool = False  # a dlsched service, by its certificate or token
    # How a long call (a stream) re-checks its caller: the principal with its
    # roles as of now, or Unauthenticated once its token expired or was revoked.
    revalidate: Callable[[Principal], Principal] | None = field(
        default=None, compare=False, repr=False)

    def current(self) -> Principal:
        """This caller as of now (streams call it per event)."""
        return self.revalidate(self) if self.revalidate is not None else self

    def has_any_role(self) -> bool:
        return self.control_plane or any(r >= Role.VIEWER for r in self.roles.values())

    @property
    def admin(self) -> bool:
        return self.control_plane or self.roles.get(ALL_PROJECTS, Role.UNSPECIFIED) >= Role.ADMIN

    def role_in(self, project: str) -> Role:
        if self.control_plane:
            return Role.ADMIN
        return max(self.roles.get(project, Role.UNSPECIFIED),
                   self.roles.get(ALL_PROJECTS, Role.UNSPECIFIED))

    def may_read(self, project: str) -> bool:
        return self.role_in(project) >= Role.VIEWER

    def may_write(self, project: str) -> bool:
        return self.role_in(project) >= Role.MEMBER

    def reads_everything(self) -> bool:
        """Whether every project is visible (so a listing needs no project filter)."""
        return self.role_in(ALL_PROJECTS) >= Role.VIEWER

    def readable_projects(self) -> frozenset[str]:
        """The projects named in the caller's roles (``*`` aside)."""
        return frozenset(p for p, r in self.roles.items() if p != ALL_PROJECTS and r >= Role.VIEWER)

    def writable_projects(self) -> frozenset[str]:
        return frozenset(p for p, r in self.roles.items() if p != ALL_PROJECTS and r >= Role.MEMBER)

    def require_any_role(self, what: str) -> None:
        """Reading shared objects (clusters) takes a role somewhere: an
        identity the provider knows but nobody granted anything reads nothing."""
        if not self.has_any_role():
            raise PermissionDenied(f"{what} takes a role in some project",
                                   metadata={"principal": self.name, "required_role": "viewer"})

    def require_admin(self, what: str) -> None:
        if not self.admin:
            raise PermissionDenied(f"{what} is for admins",
                                   metadata={"principal": self.name, "required_role": "admin"})

    def resolve_project(self, requested: str, field_name: str = "spec.project") -> str:
        """The project a new job goes to. ``requested`` when the caller may
        submit there; else the one project the caller may submit to; an admin
        bound to none gets ``default``; several → the caller must say which."""
        if requested:
            check_project(requested, field_name)
            if not self.may_write(requested):
                raise PermissionDenied(
                    f"{self.name} may not submit jobs to project {requested}",
                    metadata={"principal": self.name, "project": requested,
                              "required_role": "member"})
            return requested
        own = sorted(self.writable_projects())
        if len(own) == 1:
            return own[0]
        if not own and self.role_in(ALL_PROJECTS) >= Role.MEMBER:
            return DEFAULT_PROJECT
        if not own:
            raise PermissionDenied(f"{self.name} may not submit jobs to any project",
                                   metadata={"principal": self.name, "required_role": "member"})
        raise InvalidArgument.for_field(
            field_name, f"required: the caller may submit to several projects ({', '.join(own)})")


def check_project(project: str, field_name: str, *, allow_all: bool = False) -> None:
    if allow_all and project == ALL_PROJECTS:
        return
    if not PROJECT_RE.fullmatch(project):
        raise InvalidArgument.for_field(field_name, "a lowercase DNS label (a-z, 0-9, '-', up to 63)")


def check_principal(name: str, field_name: str) -> None:
    if not _PRINCIPAL_RE.fullmatch(name):
        raise InvalidArgument.for_field(
            field_name, "'user:<subject>', 'group:<group>' or 'sa:<dns-label>'")


def roles_of(names: Iterable[str], bindings: Iterable[RoleBinding],
             extra: Mapping[str, Role] | None = None) -> dict[str, Role]:
    """The roles per project that ``bindings`` (plus ``extra``) give any of ``names``."""
    wanted = set(names)
    out: dict[str, Role] = dict(extra or {})
    for b in bindings:
        if b.principal in wanted and b.role > out.get(b.project, Role.UNSPECIFIED):
            out[b.project] = b.role
    return out
