"""The test suite runs with TLS and authentication on, like a deployment.

``install`` (called once from conftest, before any service starts) makes a
CA, one service certificate (CN job-manager; DNS SANs job-manager,
cluster-manager, localhost; IP 127.0.0.1: every service of the tests serves
and calls with it, so drivers see a control-plane identity), a user
certificate (CN alice, not a control-plane identity), an admin token and the
control plane's token, and exports them as the services' and clients'
environment defaults; child processes inherit them. ``DLSCHED_CONFIG`` points
at a file that does not exist, so a developer's own config never leaks in.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import grpc

from dlsched.auth.tokens import random_token, write_token_file
from dlsched.kit import pki
from dlsched.kit import tls as tls_kit


@dataclass(frozen=True)
class TestSecurity:
    dir: str
    ca: pki.Issued
    service: pki.Issued
    user: pki.Issued
    admin_token_file: str
    control_plane_token_file: str

    @property
    def admin_token(self) -> str:
        with open(self.admin_token_file) as f:
            return f.read().strip()

    def service_tls(self) -> tls_kit.TlsOptions:
        return tls_kit.TlsOptions(self.service.cert_file, self.service.key_file, self.ca.cert_file)


_CURRENT: TestSecurity | None = None


def install() -> TestSecurity:
    global _CURRENT
    if _CURRENT is not None:
        return _CURRENT
    d = tempfile.mkdtemp(prefix="dlsched-test-pki-")
    ca = pki.make_ca(os.path.join(d, "ca"))
    service = pki.issue(ca, d, "job-manager", dns=("cluster-manager", "localhost"))
    user = pki.issue(ca, d, "alice")
    admin = os.path.join(d, "admin.token")
    write_token_file(admin, random_token())
    cp = os.path.join(d, "control-plane.token")
    write_token_file(cp, random_token())
    os.environ.update({
        "DLSCHED_TLS_CERT_FILE": service.cert_file,
        "DLSCHED_TLS_KEY_FILE": service.key_file,
        "DLSCHED_TLS_CA_FILE": ca.cert_file,
        "DLSCHED_ADMIN_TOKEN_FILE": admin,
        "DLSCHED_CONTROL_PLANE_TOKEN_FILE": cp,
        "DLSCHED_TOKEN_FILE": admin,  # SDK and CLI clients act as the admin by default
        "DLSCHED_CONFIG": os.path.join(d, "no-config.yaml"),
    })
    if not os.environ.get("DLSCHED_ENCRYPTION_KEY_FILE"):
        from dlsched.kit.envelope import generate_key_file

        key = os.path.join(d, "encryption-key.json")
        generate_key_file(key)
        os.environ["DLSCHED_ENCRYPTION_KEY_FILE"] = key
    os.environ.pop("DLSCHED_INSECURE", None)
    os.environ.pop("DLSCHED_NO_AUTH", None)
    _CURRENT = TestSecurity(d, ca, service, user, admin, cp)
    return _CURRENT


def current() -> TestSecurity:
    return install()


def control_plane_channel(address: str) -> grpc.aio.Channel:
    """A channel as JobManager or ClusterManager would open it to a driver:
    verified TLS presenting the control plane's certificate."""
    return tls_kit.channel(address, current().service_tls(), client_cert=True)


def user_channel(address: str, token: str | None = None) -> grpc.aio.Channel:
    """A channel as a user would open it: verified TLS, no client certificate,
    and ``token`` (when given) on every call."""
    from dlsched.kit.channel import TokenSource

    opts = tls_kit.TlsOptions(ca_file=current().ca.cert_file)
    return tls_kit.channel(address, opts, token=TokenSource(token=token) if token else None)


def channel(address: str) -> grpc.aio.Channel:
    """A channel for tests that call a service directly: the control plane's
    certificate (drivers accept it) and the admin token (JobManager and
    ClusterManager accept it)."""
    from dlsched.kit.channel import TokenSource

    return tls_kit.channel(address, current().service_tls(), client_cert=True,
                           token=TokenSource(token=current().admin_token))


def sync_channel(address: str) -> grpc.Channel:
    """``channel`` for blocking code."""
    s = current()
    with open(s.ca.cert_file, "rb") as f:
        ca = f.read()
    with open(s.service.key_file, "rb") as f:
        key = f.read()
    with open(s.service.cert_file, "rb") as f:
        cert = f.read()
    creds = grpc.composite_channel_credentials(
        grpc.ssl_channel_credentials(ca, key, cert), grpc.access_token_call_credentials(s.admin_token))
    return grpc.secure_channel(address, creds)
