"""Transport security shared by every server and client of dlsched.

Every service serves TLS from ``--tls-cert-file``/``--tls-key-file`` and
verifies its peers against ``--tls-ca-file``; plaintext only with
``--insecure`` (e.g. inside a mesh that does mTLS itself), and then the
service logs a warning. Flags default from ``DLSCHED_TLS_*`` environment
variables, read once in ``tls_options_from_args``.

- Servers: ``server_credentials`` re-reads the certificate and key when their
  files change (checked at each new connection: one ``stat`` each), so a
  renewed certificate (cert-manager, ``dlsched up``) is served without a
  restart. Drivers require a client certificate (mutual TLS) and accept only
  the control plane's identities (``peer_identities`` + an allow-list).
- Clients: ``channel`` builds a verified channel; with ``client_cert`` it
  also presents this process's certificate (service to service).
  ``FilesWatch`` tells a client's channel pool when to rebuild its channels
  (a renewed client certificate).

gRPC's Python API can only *require* a client certificate or not ask for one,
so JobManager and ClusterManager, which people call too, do not ask: between
them the control plane authenticates with a bearer token
(``--control-plane-token-file``) over verified TLS; drivers, which nobody but
the control plane may call, require mutual TLS.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from dlsched.kit import channel as channel_kit

log = logging.getLogger("dlsched.tls")

DEFAULT_CONTROL_PLANE = ("job-manager", "cluster-manager")


@dataclass(frozen=True)
class TlsOptions:
    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    insecure: bool = False  # plaintext, asked for explicitly

    @property
    def enabled(self) -> bool:
        return not self.insecure

    def files(self) -> tuple[str, ...]:
        return tuple(f for f in (self.cert_file, self.key_file, self.ca_file) if f)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def add_tls_flags(p: argparse.ArgumentParser, *, server: bool = True) -> None:
    """``--tls-cert-file``, ``--tls-key-file``, ``--tls-ca-file``, ``--insecure``."""
    what = "this service's" if server else "the client"
    p.add_argument("--tls-cert-file", default=os.environ.get("DLSCHED_TLS_CERT_FILE"),
                   help=f"{what} certificate chain, PEM (env DLSCHED_TLS_CERT_FILE)")
    p.add_argument("--tls-key-file", default=os.environ.get("DLSCHED_TLS_KEY_FILE"),
                   help=f"{what} private key, PEM (env DLSCHED_TLS_KEY_FILE)")
    p.add_argument("--tls-ca-file", default=os.environ.get("DLSCHED_TLS_CA_FILE"),
                   help="CA bundle that peers are verified against (env DLSCHED_TLS_CA_FILE)")
    p.add_argument("--insecure", action="store_true", default=_env_flag("DLSCHED_INSECURE"),
                   help="plaintext gRPC: only inside a mesh that encrypts and authenticates "
                        "itself (env DLSCHED_INSECURE=1)")


def tls_options_from_args(a: argparse.Namespace, p: argparse.ArgumentParser, *,
                          server: bool = True) -> TlsOptions:
    opts = TlsOptions(a.tls_cert_file or None, a.tls_key_file or None, a.tls_ca_file or None,
                      bool(a.insecure))
    if opts.insecure:
        return opts
    if server and not (opts.cert_file and opts.key_file):
        p.error("TLS needs --tls-cert-file and --tls-key-file "
                "(or --insecure to serve plaintext inside a mesh)")
    if not opts.ca_file:
        p.error("TLS needs --tls-ca-file to verify peers (or --insecure)")
    if bool(opts.cert_file) != bool(opts.key_file):
        p.error("--tls-cert-file and --tls-key-file go together")
    for f in opts.files():
        if not os.access(f, os.R_OK):
            p.error(f"cannot read {f}")
    return opts


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _mtimes(paths: Sequence[str]) -> tuple[float, ...]:
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append(st.st_mtime_ns + st.st_ino + st.st_size)
        except OSError:
            out.append(-1)
    return tuple(out)


def server_credentials(opts: TlsOptions, *, require_client_cert: bool) -> grpc.ServerCredentials:
    """TLS credentials that follow the files: a renewed certificate is served
    from the next handshake on."""
    assert opts.cert_file and opts.key_file and opts.ca_file
    files = [opts.cert_file, opts.key_file, opts.ca_file]

    def load() -> Any:
        return grpc.ssl_server_certificate_configuration(
            [(_read(opts.key_file), _read(opts.cert_file))],  # type: ignore[arg-type]
            root_certificates=_read(opts.ca_file))  # type: ignore[arg-type]

    state = {"seen": _mtimes(files)}

    def fetch() -> Any:
        now = _mtimes(files)
        if now == state["seen"]:
            return None
        try:
            cfg = load()
        except Exception as e:  # noqa: BLE001 - keep serving the old certificate
            log.warning("TLS files changed but could not be loaded (%s); keeping the old ones", e)
            return None
        state["seen"] = now
        log.info("TLS certificate reloaded")
        return cfg

    return grpc.dynamic_ssl_server_credentials(
        load(), fetch, require_client_authentication=require_client_cert)


def bind(server: grpc.aio.Server, listen: str, opts: TlsOptions, *, require_client_cert: bool,
         service: str) -> int:
    """Bind ``listen`` with TLS, or plaintext when the operator asked for it."""
    if opts.insecure:
        log.warning("%s serves PLAINTEXT gRPC on %s (--insecure): only safe inside a mesh "
                    "that encrypts and authenticates every connection", service, listen)
        return int(server.add_insecure_port(listen))
    return int(server.add_secure_port(
        listen, server_credentials(opts, require_client_cert=require_client_cert)))


def client_credentials(opts: TlsOptions, *, client_cert: bool) -> grpc.ChannelCredentials:
    root = _read(opts.ca_file) if opts.ca_file else None
    if client_cert and opts.cert_file and opts.key_file:
        return grpc.ssl_channel_credentials(root, _read(opts.key_file), _read(opts.cert_file))
    return grpc.ssl_channel_credentials(root)


def name_options(target: str) -> list[tuple[str, Any]]:
    """A target listing several addresses (``ipv4:a:1,b:2``, for replicas
    without a DNS name) is verified against its first host: every replica
    must present a certificate valid for it."""
    for scheme in ("ipv4:", "ipv6:"):
        if target.startswith(scheme):
            first = target[len(scheme):].split(",", 1)[0]
            host = first.rsplit(":", 1)[0].strip("[]") if ":" in first else first
            return [("grpc.ssl_target_name_override", host)]
    return []


def channel(target: str, opts: TlsOptions, *, client_cert: bool = False,
            token: channel_kit.TokenSource | None = None, round_robin: bool = False,
            extra_options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """A client channel with the kit's options: verified TLS, or plaintext
    when ``opts.insecure``; with ``token``, every call carries it."""
    # extra_options first: of two options with one key, gRPC keeps the first.
    options = [*extra_options, *channel_kit.options(round_robin=round_robin)]
    interceptors = channel_kit.bearer_interceptors(token) if token else None
    if opts.insecure:
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(target, client_credentials(opts, client_cert=client_cert),
                                   options=[*options, *name_options(target)],
                                   interceptors=interceptors)


class FilesWatch:
    """Whether TLS files changed since the last look (looks at most every
    ``every`` seconds): a client rebuilds its channels then, so a renewed
    client certificate is presented from the next connection on."""

    def __init__(self, opts: TlsOptions, every: float = 10.0) -> None:
        import time

        self._files = opts.files() if not opts.insecure else ()
        self._seen = _mtimes(self._files)
        self._clock = time.monotonic
        self._every = every
        self._next = self._clock() + every

    def changed(self) -> bool:
        if not self._files or self._clock() < self._next:
            return False
        self._next = self._clock() + self._every
        now = _mtimes(self._files)
        if now == self._seen:
            return False
        self._seen = now
        log.info("TLS files changed; new connections use them")
        return True


def peer_identities(context: grpc.aio.ServicerContext) -> list[str]:
    """The verified client certificate's DNS SANs; its common name only when
    it has no SAN at all (RFC 6125). E-mail, URI and IP SANs never count, so a
    certificate cannot pass as ``job-manager`` through an e-mail SAN of that
    text. Empty without a client certificate."""
    try:
        ac = context.auth_context()
    except Exception:  # noqa: BLE001 - no transport security
        return []

    def texts(key: str) -> list[str]:
        out = []
        for v in ac.get(key, ()):
            try:
                out.append(v.decode() if isinstance(v, bytes) else str(v))
            except UnicodeDecodeError:
                continue
        return out

    if ac.get("x509_subject_alternative_name"):
        return texts("peer_dns")
    return texts("x509_common_name")
