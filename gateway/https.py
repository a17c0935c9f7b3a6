"""HTTPS for the gateway, and the TLS files it follows.

The gateway serves HTTPS from ``--tls-cert-file``/``--tls-key-file`` (the
kit's flags, ``dlsched.kit.tls``) and calls JobManager and ClusterManager over
verified TLS against ``--tls-ca-file``, presenting the same certificate. That
certificate names the gateway, not the control plane: JobManager and
ClusterManager ask for no client certificate, so it grants nothing; every
call is authorized by the bearer token the HTTP client sent.

Renewed files are picked up without a restart: ``follow_files`` compares the
files' stat stamps every ``--tls-reload-seconds`` and, on a change, first
checks that the new files load (certificate and key match, the CA parses);
a half-written renewal is logged once and tried again when the files next
change, while the old certificate keeps being served. ``ServerTls`` then
builds a fresh ``SSLContext`` and hands it to each new handshake from the
listening context's ``sni_callback`` (OpenSSL calls it on every ClientHello, with or
without SNI), so a reload is atomic: a handshake gets the old pair or the new
one, never a mix. Connections already open keep their certificate. The
upstream channels are rebuilt (``app.Upstreams.renew``); calls in flight
finish on the old ones.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Callable, Sequence

from dlsched.kit.tls import TlsOptions

log = logging.getLogger("gateway.tls")

_Stamp = tuple[tuple[int, int, int], ...]


def stamp(paths: Sequence[str]) -> _Stamp:
    """What changes when a file is rewritten or replaced (a renamed-over
    file, a Kubernetes secret's symlink swap): mtime, inode and size."""
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((st.st_mtime_ns, st.st_ino, st.st_size))
        except OSError:
            out.append((-1, -1, -1))
    return tuple(out)


def server_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """A server context for HTTP/1.1 over TLS 1.2+; clients are not asked
    for certificates (they authenticate with bearer tokens)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert_file, key_file)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def check_files(opts: TlsOptions) -> None:
    """Raise unless the files load: the key matches the certificate and the
    CA bundle parses."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if opts.cert_file and opts.key_file:
        ctx.load_cert_chain(opts.cert_file, opts.key_file)
    if opts.ca_file:
        ctx.load_verify_locations(cafile=opts.ca_file)


class ServerTls:
    """The listening ``SSLContext`` (``context``, given to aiohttp) and the
    newest loaded one, which every new handshake switches to."""

    def __init__(self, opts: TlsOptions) -> None:
        assert opts.cert_file and opts.key_file
        self._cert, self._key = opts.cert_file, opts.key_file
        self.context = server_context(self._cert, self._key)
        self._current = self.context
        self.context.sni_callback = self._pick

    def _pick(self, obj: ssl.SSLObject | ssl.SSLSocket, server_name: str | None,
              ctx: ssl.SSLContext) -> None:
        current = self._current
        if current is not ctx:
            obj.context = current

    def reload(self) -> None:
        self._current = server_context(self._cert, self._key)


async def follow_files(opts: TlsOptions, interval: float,
                       on_change: Sequence[Callable[[], None]]) -> None:
    """Every ``interval`` seconds: when the TLS files changed and load, call
    each of ``on_change``; when they do not load yet, keep everything as is
    and look again next time."""
    files = opts.files()
    seen = stamp(files)
    failed: _Stamp | None = None  # files that did not load: tried again once they change
    while True:
        await asyncio.sleep(interval)
        now = stamp(files)
        if now in (seen, failed):
            continue
        try:
            check_files(opts)
            for fn in on_change:
                fn()
        except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
            failed = now
            log.warning("TLS files changed but do not load (%s); keeping the old ones "
                        "until they change again", e)
            continue
        seen, failed = now, None
        log.info("TLS certificate reloaded")
