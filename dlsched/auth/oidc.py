"""OIDC tokens (JWT) verified with PyJWT against the issuer's JWKS.

The signing keys come from the issuer's discovery document
(``{issuer}/.well-known/openid-configuration`` → ``jwks_uri``) or a given JWKS
URL, fetched off the event loop, cached, and fetched again only when a token
names a key id the cache lacks (at most once per ``refresh_floor`` seconds)
or after ``max_age``. A verified token is cached by its hash until it
expires, so a busy client costs one signature check per token, not per call.

Checked: signature (asymmetric algorithms only; ``none`` and HMAC are
refused), ``iss``, ``aud``, ``exp`` (required), ``nbf``/``iat`` when present,
with ``leeway`` seconds of clock skew.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import jwt

from dlsched.auth.model import PROJECT_RE, Role
from dlsched.auth.tokens import sha256_hex
from dlsched.errors import Unauthenticated

#: The longest user name a token may give (an OIDC ``sub`` is at most 255 characters; an
#: e-mail address at most 254): it becomes job owners, audit records and history rows.
MAX_SUBJECT = 255

log = logging.getLogger("dlsched.auth.oidc")

ALGORITHMS = ["RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"]
_ROLE_NAMES = {"viewer": Role.VIEWER, "member": Role.MEMBER, "admin": Role.ADMIN}


@dataclass(frozen=True)
class OidcOptions:
    issuer: str
    audience: str
    jwks_url: str = ""  # empty: from the issuer's discovery document
    user_claim: str = "sub"
    groups_claim: str = ""  # e.g. "groups": each value is principal "group:<value>"
    projects_claim: str = ""  # e.g. "dlsched_projects": ["vision:member", "nlp"]
    leeway_seconds: float = 60.0
    ca_file: str | None = None  # to verify the issuer's HTTPS certificate


@dataclass(frozen=True)
class Identity:
    """What a verified token says: the subject, groups and claimed roles."""

    name: str
    groups: tuple[str, ...] = ()
    roles: dict[str, Role] = field(default_factory=dict)
    expires: float = 0.0


class TokenExpired(Unauthenticated):
    reason = "TOKEN_EXPIRED"


class OidcVerifier:
    def __init__(self, opts: OidcOptions, *, max_age: float = 3600.0, refresh_floor: float = 5.0,
                 cache_size: int = 10_000, clock: Any = time.time) -> None:
        self.opts = opts
        self._keys: dict[str, jwt.PyJWK] = {}
        self._fetched = 0.0
        self._attempted = 0.0
        self._max_age = max_age
        self._refresh_floor = refresh_floor
        self._lock = asyncio.Lock()
        self._cache: OrderedDict[str, Identity] = OrderedDict()
        self._cache_size = cache_size
        self._clock = clock

    async def verify(self, token: str) -> Identity:
        key_hash = sha256_hex(token)
        now = self._clock()
        hit = self._cache.get(key_hash)
        if hit is not None:
            if hit.expires + self.opts.leeway_seconds > now:
                return hit
            del self._cache[key_hash]
            raise TokenExpired("token expired")
        ident = await self._verify_uncached(token)
        self._cache[key_hash] = ident
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return ident

    async def _verify_uncached(self, token: str) -> Identity:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError as e:
            raise Unauthenticated("malformed token") from e
        alg = header.get("alg")
        if alg not in ALGORITHMS:
            raise Unauthenticated("token algorithm not accepted")
        key = await self._key(str(header.get("kid", "")))
        try:
            claims = jwt.decode(
                token, key, algorithms=[alg], audience=self.opts.audience, issuer=self.opts.issuer,
                leeway=self.opts.leeway_seconds,
                options={"require": ["exp", "iss", "aud"]})
        except jwt.ExpiredSignatureError as e:
            raise TokenExpired("token expired") from e
        except jwt.PyJWTError as e:
            raise Unauthenticated("token not valid for this server") from e
        return self._identity(claims)

    def _identity(self, claims: dict[str, Any]) -> Identity:
        subject = claims.get(self.opts.user_claim)
        if not isinstance(subject, str) or not subject or not subject.isprintable() or " " in subject:
            raise Unauthenticated(f"token has no usable '{self.opts.user_claim}' claim")
        if len(subject) > MAX_SUBJECT:  # OpenID Connect Core 2: sub "MUST NOT exceed 255 ASCII characters"
            raise Unauthenticated(f"token's '{self.opts.user_claim}' claim is over {MAX_SUBJECT} characters")
        if self.opts.user_claim == "email" and claims.get("email_verified") is not True:
            # Many issuers let a user set an address nobody verified: naming the user by it
            # would let anyone claim another's ("nOAuth"). OpenID Connect Core 5.1.
            raise Unauthenticated("token's email is not verified (email_verified is not true)")
        groups: tuple[str, ...] = ()
        if self.opts.groups_claim:
            raw = claims.get(self.opts.groups_claim, [])
            if isinstance(raw, list):
                groups = tuple(g for g in raw if isinstance(g, str) and g.isprintable() and " " not in g)
        roles: dict[str, Role] = {}
        if self.opts.projects_claim:
            raw = claims.get(self.opts.projects_claim, [])
            for item in raw if isinstance(raw, list) else []:
                if not isinstance(item, str):
                    continue
                project, _, role_name = item.partition(":")
                role = _ROLE_NAMES.get(role_name or "member")
                # Claims grant project roles only; admin comes from a role binding.
                if role is None or role == Role.ADMIN or not PROJECT_RE.fullmatch(project):
                    continue
                if role > roles.get(project, Role.UNSPECIFIED):
                    roles[project] = role
        return Identity(f"user:{subject}", groups, roles, _expiry(claims["exp"]))

    async def _key(self, kid: str) -> jwt.PyJWK:
        now = time.monotonic()
        key = self._keys.get(kid) if kid else (next(iter(self._keys.values())) if len(self._keys) == 1 else None)
        if key is not None and now - self._fetched < self._max_age:
            return key
        async with self._lock:
            key = self._keys.get(kid) if kid else None
            stale = now - self._fetched >= self._max_age
            # One fetch at a time, and at most one attempt per refresh floor,
            # successful or not: an issuer that is down is not hammered, and
            # the keys we have stay in use meanwhile.
            due = not self._attempted or now - self._attempted >= self._refresh_floor
            if (key is None or stale) and due:
                self._attempted = now
                try:
                    self._keys = await asyncio.to_thread(self._fetch_keys)
                    self._fetched = time.monotonic()
                except Exception as e:  # noqa: BLE001 - keep the old keys; say why
                    log.warning("fetching the issuer's keys failed: %s", e)
            if not self._keys:
                raise Unauthenticated("cannot verify tokens now (issuer keys unavailable)")
            key = self._keys.get(kid) if kid else (
                next(iter(self._keys.values())) if len(self._keys) == 1 else None)
        if key is None:
            raise Unauthenticated("token signed by an unknown key")
        return key

    def _fetch_keys(self) -> dict[str, jwt.PyJWK]:
        url = self.opts.jwks_url
        if not url:
            doc = self._get_json(self.opts.issuer.rstrip("/") + "/.well-known/openid-configuration")
            url = str(doc["jwks_uri"])
        keys: dict[str, jwt.PyJWK] = {}
        for k in self._get_json(url).get("keys", []):
            if k.get("use", "sig") != "sig":
                continue
            try:
                keys[str(k.get("kid", ""))] = jwt.PyJWK(k)
            except jwt.PyJWTError:
                continue  # a key type this library can't use
        return keys

    def _get_json(self, url: str) -> dict[str, Any]:
        import ssl

        ctx = ssl.create_default_context(cafile=self.opts.ca_file) if self.opts.ca_file else None
        with urllib.request.urlopen(url, timeout=10, context=ctx) as r:  # noqa: S310 - operator's URL
            data = r.read(1 << 20)
        doc = json.loads(data)
        if not isinstance(doc, dict):
            raise ValueError(f"{url}: not a JSON object")
        return doc


def _expiry(exp: Any) -> float:
    """``exp`` as seconds (PyJWT has checked it is an integer not in the past): one no float holds
    (10**400, signed by the issuer all the same) is no expiry this server can keep."""
    try:
        expires = float(exp)
    except (OverflowError, TypeError, ValueError) as e:
        raise Unauthenticated("token's 'exp' claim is not a usable time") from e
    if not math.isfinite(expires):
        raise Unauthenticated("token's 'exp' claim is not a usable time")
    return expires
