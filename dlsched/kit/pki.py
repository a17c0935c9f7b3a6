"""A small private CA for ``dlsched up`` and the tests (``cryptography``).

``make_ca`` writes ``ca.pem``/``ca.key``; ``issue`` writes a certificate and
key for one identity (CN = the identity, DNS SANs = the identity plus the
extra names, IP SANs), usable for both server and client authentication.
Keys are ECDSA P-256, files 0600 (the CA certificate 0644). Production
deployments use their own CA (cert-manager, a corporate PKI) instead.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Issued:
    cert_file: str
    key_file: str


def _write(path: str, data: bytes, mode: int) -> None:
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_ca(directory: str, *, name: str = "dlsched local CA", days: int = 3650) -> Issued:
    os.makedirs(directory, mode=0o700, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    out = Issued(os.path.join(directory, "ca.pem"), os.path.join(directory, "ca.key"))
    _write(out.key_file, _key_pem(key), 0o600)
    _write(out.cert_file, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return out


def issue(ca: Issued, directory: str, identity: str, *, dns: Sequence[str] = ("localhost",),
          ips: Sequence[str] = ("127.0.0.1",), days: int = 365, basename: str | None = None) -> Issued:
    """A certificate for ``identity`` signed by ``ca``, written as
    ``<basename>.pem``/``<basename>.key`` (basename defaults to the identity)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    with open(ca.key_file, "rb") as f:
        ca_key = serialization.load_pem_private_key(f.read(), password=None)
    with open(ca.cert_file, "rb") as f:
        ca_cert = x509.load_pem_x509_certificate(f.read())
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    names: list[x509.GeneralName] = [x509.DNSName(n) for n in dict.fromkeys([identity, *dns])]
    names += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    base = os.path.join(directory, basename or identity)
    out = Issued(f"{base}.pem", f"{base}.key")
    _write(out.key_file, _key_pem(key), 0o600)
    _write(out.cert_file, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return out
