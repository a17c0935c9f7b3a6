"""Authentication: a bearer token (or a control-plane certificate) → ``Principal``.

Accepted, in this order:
1. a verified client certificate whose CN or DNS SAN is a control-plane
   identity (only drivers ask for client certificates, see ``kit.tls``);
2. a static token from a file: the bootstrap admin token
   (``--admin-token-file``) and the control plane's token
   (``--control-plane-token-file``);
3. a dlsched API token ``dls_<id>_<secret>`` (``AccessStore``);
4. an OIDC JWT (``OidcVerifier``), when an issuer is configured.
Anything else is UNAUTHENTICATED, with no hint beyond the reason.
Roles come from role bindings of the principal's names (itself and its
OIDC groups) plus what an OIDC token's projects claim grants.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from dlsched.auth.model import ALL_PROJECTS, ApiToken, Principal, Role, roles_of
from dlsched.auth.oidc import OidcOptions, OidcVerifier, TokenExpired
from dlsched.auth.store import AccessStore
from dlsched.auth.tokens import api_token_id, bearer, read_token_file, same_hash, sha256_hex
from dlsched.errors import DlschedError, Unauthenticated
from dlsched.kit.tls import DEFAULT_CONTROL_PLANE

log = logging.getLogger("dlsched.auth")


@dataclass(frozen=True)
class AuthOptions:
    """How a service authenticates its callers (JobManager, ClusterManager)."""

    admin_token_file: str | None = None
    control_plane_token_file: str | None = None
    oidc: OidcOptions | None = None
    disabled: bool = False  # --no-auth: everyone is an admin (development only)
    control_plane_identities: tuple[str, ...] = DEFAULT_CONTROL_PLANE


def add_auth_flags(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    p.add_argument("--admin-token-file", default=env("DLSCHED_ADMIN_TOKEN_FILE"),
                   help="a bootstrap admin token (principal 'admin') (env DLSCHED_ADMIN_TOKEN_FILE)")
    p.add_argument("--control-plane-token-file", default=env("DLSCHED_CONTROL_PLANE_TOKEN_FILE"),
                   help="the token JobManager and ClusterManager call each other with "
                        "(env DLSCHED_CONTROL_PLANE_TOKEN_FILE)")
    p.add_argument("--oidc-issuer", default=env("DLSCHED_OIDC_ISSUER"),
                   help="accept OIDC JWTs from this issuer (env DLSCHED_OIDC_ISSUER)")
    p.add_argument("--oidc-audience", default=env("DLSCHED_OIDC_AUDIENCE"),
                   help="the audience tokens must name (env DLSCHED_OIDC_AUDIENCE)")
    p.add_argument("--oidc-jwks-url", default=env("DLSCHED_OIDC_JWKS_URL", ""),
                   help="the issuer's JWKS (default: from its discovery document)")
    p.add_argument("--oidc-user-claim", default=env("DLSCHED_OIDC_USER_CLAIM", "sub"),
                   help="claim that names the user: principal 'user:<value>' (default sub)")
    p.add_argument("--oidc-groups-claim", default=env("DLSCHED_OIDC_GROUPS_CLAIM", ""),
                   help="claim listing the user's groups: principals 'group:<value>'")
    p.add_argument("--oidc-projects-claim", default=env("DLSCHED_OIDC_PROJECTS_CLAIM", ""),
                   help="claim listing 'project' or 'project:viewer|member' grants")
    p.add_argument("--oidc-ca-file", default=env("DLSCHED_OIDC_CA_FILE"),
                   help="CA bundle for the issuer's HTTPS endpoints")
    p.add_argument("--oidc-leeway", type=float, default=60.0,
                   help="clock skew allowed on exp/nbf/iat, seconds (default 60)")
    p.add_argument("--no-auth", action="store_true",
                   default=env("DLSCHED_NO_AUTH", "").lower() in ("1", "true", "yes"),
                   help="accept every call as an admin: development only, logs a warning")
    p.add_argument("--control-plane-identities", default=",".join(DEFAULT_CONTROL_PLANE),
                   help="client-certificate names (CN or DNS SAN) of the control plane")


def auth_options_from_args(a: argparse.Namespace, p: argparse.ArgumentParser) -> AuthOptions:
    oidc = None
    if a.oidc_issuer:
        if not a.oidc_audience:
            p.error("--oidc-issuer needs --oidc-audience")
        oidc = OidcOptions(issuer=a.oidc_issuer, audience=a.oidc_audience,
                           jwks_url=a.oidc_jwks_url or "", user_claim=a.oidc_user_claim,
                           groups_claim=a.oidc_groups_claim or "",
                           projects_claim=a.oidc_projects_claim or "",
                           leeway_seconds=a.oidc_leeway, ca_file=a.oidc_ca_file or None)
    for f in (a.admin_token_file, a.control_plane_token_file):
        if f and not os.access(f, os.R_OK):
            p.error(f"cannot read {f}")
    ids = tuple(s.strip() for s in a.control_plane_identities.split(",") if s.strip())
    return AuthOptions(a.admin_token_file or None, a.control_plane_token_file or None, oidc,
                       bool(a.no_auth), ids)


@dataclass
class _Static:
    sha256: str
    principal: Principal


@dataclass
class Authenticator:
    """Turns a call's credentials into a ``Principal``."""

    store: AccessStore | None
    oidc: OidcVerifier | None = None
    static: list[_Static] = field(default_factory=list)
    control_plane_identities: frozenset[str] = frozenset(DEFAULT_CONTROL_PLANE)
    disabled: bool = False

    @classmethod
    def from_options(cls, opts: AuthOptions, store: AccessStore | None) -> Authenticator:
        static: list[_Static] = []
        if opts.admin_token_file:
            static.append(_Static(sha256_hex(read_token_file(opts.admin_token_file)),
                                  Principal("admin", {ALL_PROJECTS: Role.ADMIN})))
        if opts.control_plane_token_file:
            static.append(_Static(sha256_hex(read_token_file(opts.control_plane_token_file)),
                                  Principal("service:control-plane", control_plane=True)))
        if opts.disabled:
            log.warning("authentication is OFF (--no-auth): every caller is an admin")
        return cls(store, OidcVerifier(opts.oidc) if opts.oidc else None, static,
                   frozenset(opts.control_plane_identities), opts.disabled)

    async def authenticate(self, authorization: str | None, peer: Sequence[str] = ()) -> Principal:
        for name in peer:
            if name in self.control_plane_identities:
                return Principal(f"service:{name}", control_plane=True)
        if self.disabled:
            return Principal("anonymous", {ALL_PROJECTS: Role.ADMIN})
        token = bearer(authorization)
        digest = sha256_hex(token)
        for s in self.static:
            if same_hash(s.sha256, digest):
                return s.principal
        tid = api_token_id(token)
        if tid is not None:
            return self._api_token(tid, digest)
        if self.oidc is not None and token.count(".") == 2:
            try:
                ident = await self.oidc.verify(token)
            except DlschedError:
                raise
            except Exception as e:  # a token no check foresaw is refused, never an INTERNAL
                log.warning("OIDC token refused: %s", type(e).__name__)
                raise Unauthenticated("token not valid for this server") from e
            names = [ident.name, *(f"group:{g}" for g in ident.groups)]
            leeway = self.oidc.opts.leeway_seconds

            def revalidate_jwt(p: Principal) -> Principal:
                if time.time() >= ident.expires + leeway:
                    raise TokenExpired("token expired")
                return replace(p, roles=self._roles(names, ident.roles))

            return Principal(ident.name, self._roles(names, ident.roles), ident.groups,
                             revalidate=revalidate_jwt)
        raise Unauthenticated("invalid token")

    def _api_token(self, tid: str, digest: str) -> Principal:
        rec = self._live_token(tid, digest)

        def revalidate_token(p: Principal) -> Principal:
            cur = self._live_token(tid, digest)
            return replace(p, roles=self._roles([cur.principal], {}))

        return Principal(rec.principal, self._roles([rec.principal], {}),
                         revalidate=revalidate_token)

    def _live_token(self, tid: str, digest: str) -> ApiToken:
        rec = self.store.tokens.get(tid) if self.store is not None else None
        if rec is None or not same_hash(rec.sha256, digest):
            raise Unauthenticated("invalid or revoked token")
        if rec.expire_time is not None and rec.expire_time <= datetime.now(UTC):
            raise TokenExpired("token expired")
        return rec

    def _roles(self, names: list[str], extra: dict[str, Role]) -> dict[str, Role]:
        if self.store is None:
            return dict(extra)
        return roles_of(names, self.store.bindings_for(names), extra)
