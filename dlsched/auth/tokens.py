"""Bearer tokens: parsing the ``authorization`` value, dlsched API token
secrets and their hashes, and static token files.

An API token secret is ``dls_<id>_<secret>``: ``id`` names its record (so a
check is one dict look-up, not a scan) and ``secret`` is 256 random bits.
Only the SHA-256 of the whole string is stored; with 256 random bits a slow
password hash would add nothing. Comparison is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets

from dlsched.errors import Unauthenticated

MAX_TOKEN_CHARS = 8192
_BEARER_RE = re.compile(r"[Bb][Ee][Aa][Rr][Ee][Rr] +([A-Za-z0-9._~+/=-]{1,8192})")
_API_TOKEN_RE = re.compile(r"dls_([a-z0-9]{12})_[A-Za-z0-9_-]{43}")


def bearer(value: str | None) -> str:
    """The token of an ``authorization`` value ``Bearer <token>``."""
    if not value:
        raise Unauthenticated("missing bearer token (metadata 'authorization: Bearer <token>')")
    if len(value) > MAX_TOKEN_CHARS + 16:
        raise Unauthenticated("malformed bearer token")
    m = _BEARER_RE.fullmatch(value)
    if m is None:
        raise Unauthenticated("malformed bearer token")
    return m.group(1)


def sha256_hex(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def same_hash(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def new_api_token() -> tuple[str, str, str]:
    """A fresh API token: (id, secret, sha256 of the secret)."""
    token_id = "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(12))
    secret = f"dls_{token_id}_{secrets.token_urlsafe(32)}"
    return token_id, secret, sha256_hex(secret)


def api_token_id(token: str) -> str | None:
    """The record id of an API token secret, or None when ``token`` is not one."""
    m = _API_TOKEN_RE.fullmatch(token)
    return m.group(1) if m else None


def read_token_file(path: str) -> str:
    """A token kept in a file (first line, stripped)."""
    with open(path) as f:
        token = f.readline().strip()
    if len(token) < 32 or len(token) > MAX_TOKEN_CHARS:
        raise ValueError(f"{path}: a token of 32 to {MAX_TOKEN_CHARS} characters expected")
    return token


def write_token_file(path: str, token: str) -> None:
    """Write ``token`` to ``path`` readable by its owner only (atomically)."""
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.replace(tmp, path)


def random_token() -> str:
    """A fresh opaque token for a static token file (admin, control plane)."""
    return f"dlsstatic_{secrets.token_urlsafe(32)}"
