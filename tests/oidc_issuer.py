"""A tiny, real OIDC issuer for the tests: an HTTP server on a free loopback port.

It serves ``/.well-known/openid-configuration`` (``issuer``, ``jwks_uri``) and
``/jwks`` (the public halves of its signing keys) and counts how often each is
fetched, so a test can tell whether a service caches the keys. ``token`` mints
JWTs signed with the current key (RS256 for RSA keys, ES256 for EC keys);
``rotate`` adds a new key under a new key id and signs with it from then on.
Nothing here is a mock: the services fetch these documents over HTTP and
verify these signatures with PyJWT like they would a real identity provider's.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

PrivateKey = rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey


@dataclass(frozen=True)
class SigningKey:
    kid: str
    key: PrivateKey

    @property
    def alg(self) -> str:
        return "RS256" if isinstance(self.key, rsa.RSAPrivateKey) else "ES256"

    def public_jwk(self) -> dict[str, Any]:
        if isinstance(self.key, rsa.RSAPrivateKey):
            jwk = RSAAlgorithm.to_jwk(self.key.public_key(), as_dict=True)
        else:
            jwk = ECAlgorithm.to_jwk(self.key.public_key(), as_dict=True)
        return {**jwk, "kid": self.kid, "use": "sig", "alg": self.alg}


def new_key(kind: str = "rsa", kid: str | None = None) -> SigningKey:
    """A fresh signing key (``rsa`` 2048 or ``ec`` P-256)."""
    key: PrivateKey
    if kind == "rsa":
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    elif kind == "ec":
        key = ec.generate_private_key(ec.SECP256R1())
    else:
        raise ValueError(kind)
    return SigningKey(kid or f"{kind}-{uuid.uuid4().hex[:8]}", key)


class OidcIssuer:
    """An OIDC issuer on ``http://127.0.0.1:<free port>``."""

    def __init__(self, kind: str = "rsa") -> None:
        self._lock = threading.Lock()
        self._keys: list[SigningKey] = [new_key(kind)]
        self._current = self._keys[0]
        self._counts: dict[str, int] = {"discovery": 0, "jwks": 0}
        issuer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path = self.path.split("?", 1)[0]
                if path == "/.well-known/openid-configuration":
                    body = issuer._serve("discovery", {
                        "issuer": issuer.url, "jwks_uri": f"{issuer.url}/jwks",
                        "id_token_signing_alg_values_supported": ["RS256", "ES256"]})
                elif path == "/jwks":
                    body = issuer._serve("jwks", issuer.jwks())
                else:
                    self.send_error(404)
                    return
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="oidc-issuer",
                                        daemon=True)

    # ------------------------------------------------------------------ server
    def start(self) -> OidcIssuer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    @contextmanager
    def running(self) -> Iterator[OidcIssuer]:
        self.start()
        try:
            yield self
        finally:
            self.stop()

    def _serve(self, what: str, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self._counts[what] += 1
        return body

    def fetches(self, what: str = "jwks") -> int:
        """How often ``discovery`` or ``jwks`` was fetched."""
        with self._lock:
            return self._counts[what]

    def jwks(self) -> dict[str, Any]:
        with self._lock:
            return {"keys": [k.public_jwk() for k in self._keys]}

    # ------------------------------------------------------------------ keys
    @property
    def kid(self) -> str:
        return self._current.kid

    def rotate(self, kind: str = "rsa", *, drop_old: bool = False) -> SigningKey:
        """Publish a new key under a new key id and sign with it from now on."""
        k = new_key(kind)
        with self._lock:
            self._keys = [k] if drop_old else [*self._keys, k]
            self._current = k
        return k

    # ------------------------------------------------------------------ tokens
    def token(self, sub: str, aud: str = "dlsched-test", exp_in: float = 600, *,
              groups: Iterable[str] | None = None, projects: Iterable[str] | None = None,
              kid: str | None = None, sign_with: SigningKey | None = None,
              iss: str | None = None, extra: dict[str, Any] | None = None) -> str:
        """A JWT for ``sub`` expiring ``exp_in`` seconds from now (negative: in
        the past). ``sign_with`` signs with a key the issuer does not publish
        (a forged token); ``kid`` overrides the header's key id."""
        key = sign_with or self._current
        now = int(time.time())
        claims: dict[str, Any] = {"iss": iss or self.url, "sub": sub, "aud": aud,
                                  "iat": now - 5 if exp_in > 0 else int(now + exp_in - 60),
                                  "exp": int(now + exp_in), "jti": uuid.uuid4().hex}
        if groups is not None:
            claims["groups"] = list(groups)
        if projects is not None:
            claims["dlsched_projects"] = list(projects)
        claims.update(extra or {})
        return jwt.encode(claims, key.key, algorithm=key.alg,
                          headers={"kid": kid if kid is not None else key.kid})

    def service_args(self, audience: str = "dlsched-test") -> list[str]:
        """The flags a JobManager or ClusterManager trusts this issuer with."""
        return ["--oidc-issuer", self.url, "--oidc-audience", audience,
                "--oidc-groups-claim", "groups", "--oidc-projects-claim", "dlsched_projects"]
