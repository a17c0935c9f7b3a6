"""Opaque tokens (page tokens, watch resume tokens): unpadded base64url of a
short versioned text such as ``j1:1234``.

Each service keeps its own prefix and parsing; this only owns the encoding, so
every token a dlsched server issues looks and decodes the same way.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re

from dlsched.errors import InvalidArgument

#: an etag (an etcd revision) as dlsched writes it: digits, no leading zero, below 2**63
ETAG_RE = re.compile(r"[1-9][0-9]{0,17}")


def encode(text: str) -> str:
    """The opaque token for ``text``."""
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def decode(token: str) -> str | None:
    """The text inside ``token``, or None when it is not a token we could have issued."""
    try:
        return base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None


def filter_hash(filter_text: str) -> str:
    """What ties a page token to the filter it was issued for (AIP-158): a short digest."""
    return hashlib.sha256(filter_text.encode("utf-8", "surrogatepass")).hexdigest()[:12]


def parse_etag(etag: str, field: str) -> int:
    """The revision of an etag a dlsched server returned; InvalidArgument naming
    ``field`` for anything else (a garbage etag is the caller's error, not a conflict)."""
    if not ETAG_RE.fullmatch(etag):
        raise InvalidArgument.for_field(field, "not an etag this service returned")
    return int(etag)
