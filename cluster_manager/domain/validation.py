"""Validation of cluster input. Every problem is a FieldViolation naming the
field (``cluster.address``, ``cluster_id``, ``cluster.credentials``, ...);
descriptions never quote a credential."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

from dlsched.errors import FieldViolation, InvalidArgument
from dlsched.kit.parse import decimal

from .models import (
    BACKENDS,
    CREDENTIALS_FOR_TYPE,
    AddressKind,
    Cluster,
    ClusterType,
    Credentials,
    CredentialsKind,
)

CLUSTER_ID_RE = re.compile(r"^[a-z][a-z0-9-]{0,62}\Z")
_LABEL_NAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?\Z")
_DNS_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*\Z")
_HOSTNAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?\Z")
_IPV6_RE = re.compile(r"^\[[0-9A-Fa-f:.]+\]\Z")
_OPTION_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,127}\Z")
_REQUEST_ID_RE = re.compile(r"^[\x21-\x7e]{1,128}\Z")
MAX_LABELS = 64
MAX_OPTIONS = 64
MAX_OPTION_VALUE = 4096
MAX_ADDRESS = 512

# Fields UpdateCluster may change (update_mask paths).
UPDATABLE_FIELDS = ("address", "credentials", "labels", "driver_address", "options",
                    "allowed_projects")
_PROJECT_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def check_allowed_projects(projects: Iterable[str], field: str) -> list[FieldViolation]:
    out: list[FieldViolation] = []
    ps = list(projects)
    if len(ps) > 1000:
        out.append(FieldViolation(field, "at most 1000 projects"))
        return out
    for i, p in enumerate(ps):
        if not _PROJECT_RE.fullmatch(p):
            out.append(FieldViolation(f"{field}[{i}]", "a lowercase DNS label"))
    return out


def raise_if(violations: list[FieldViolation], what: str = "invalid cluster") -> None:
    if violations:
        summary = "; ".join(f"{v.field}: {v.description}" for v in violations)
        raise InvalidArgument(f"{what}: {summary}", violations)


def parse_cluster_name(name: str, field: str = "name") -> str:
    """``clusters/{id}`` -> id; InvalidArgument naming ``field`` otherwise."""
    prefix = "clusters/"
    if not name.startswith(prefix) or not CLUSTER_ID_RE.match(name[len(prefix):]):
        raise InvalidArgument.for_field(field, "want clusters/{cluster_id}")
    return name[len(prefix):]


def check_cluster_id(cluster_id: str, field: str = "cluster_id") -> list[FieldViolation]:
    if not CLUSTER_ID_RE.match(cluster_id):
        return [FieldViolation(field, "1 to 63 characters: lower case letters, digits and '-', "
                                      "starting with a letter")]
    return []


def check_request_id(request_id: str, field: str = "request_id") -> list[FieldViolation]:
    if request_id and not _REQUEST_ID_RE.match(request_id):
        return [FieldViolation(field, "up to 128 printable ASCII characters, no spaces")]
    return []


def check_driver_address(addr: str, field: str) -> list[FieldViolation]:
    if not addr:
        return [FieldViolation(field, "required: host:port of the cluster's driver service")]
    host, sep, port = addr.rpartition(":")
    if not sep or not _valid_host(host) or not _valid_port(port):
        return [FieldViolation(field, "want host:port")]
    return []


def _valid_host(host: str) -> bool:
    return bool(host) and len(host) <= 253 and bool(_HOSTNAME_RE.match(host) or _IPV6_RE.match(host))


def _valid_port(port: str) -> bool:
    return decimal(port) and 0 < int(port) < 65536


def check_address(ctype: ClusterType, addr: str, field: str) -> list[FieldViolation]:
    if len(addr) > MAX_ADDRESS:
        return [FieldViolation(field, f"at most {MAX_ADDRESS} characters")]
    backend = BACKENDS.get(ctype)
    if backend is None:
        return []  # the type itself is refused elsewhere
    if backend.address is AddressKind.OPTIONAL:
        if addr and (any(c.isspace() or ord(c) < 32 for c in addr)):
            return [FieldViolation(field, "must not contain whitespace or control characters")]
        return []
    if not addr:
        return [FieldViolation(field, f"required for {ctype.value}: {backend.address_help}")]
    if backend.address is AddressKind.HOST_PORT:
        return _check_host_port(addr, field)
    return _check_url(addr, field, backend.address_help)


def _check_host_port(addr: str, field: str) -> list[FieldViolation]:
    host, port = addr, ""
    if addr.startswith("["):
        end = addr.find("]")
        host, rest = addr[: end + 1], addr[end + 1:]
        if rest:
            if not rest.startswith(":"):
                return [FieldViolation(field, "want host[:port]")]
            port = rest[1:]
            if not _valid_port(port):
                return [FieldViolation(field, "want host[:port] with port 1-65535")]
    elif ":" in addr:
        host, _, port = addr.rpartition(":")
        if not _valid_port(port):
            return [FieldViolation(field, "want host[:port] with port 1-65535")]
    if not _valid_host(host):
        return [FieldViolation(field, "want host[:port]: letters, digits, '.' and '-' only "
                                      "(no whitespace, user@ or shell characters)")]
    return []


def _check_url(addr: str, field: str, what: str) -> list[FieldViolation]:
    if any(c.isspace() or ord(c) < 32 for c in addr):
        return [FieldViolation(field, "must not contain whitespace or control characters")]
    try:
        u = urlsplit(addr)
        port_ok = u.port is None or 0 < u.port < 65536
    except ValueError:
        return [FieldViolation(field, f"want an http(s) URL ({what})")]
    if u.scheme not in ("http", "https") or not u.hostname or not port_ok:
        return [FieldViolation(field, f"want an http(s) URL ({what})")]
    if u.username is not None or u.password is not None:
        # Every reader of the cluster sees its address: secrets go in `credentials`,
        # which is write-only and encrypted at rest.
        return [FieldViolation(field, "must not carry a user or password; set credentials instead")]
    return []


def check_labels(labels: Mapping[str, str], field: str) -> list[FieldViolation]:
    out: list[FieldViolation] = []
    if len(labels) > MAX_LABELS:
        out.append(FieldViolation(field, f"at most {MAX_LABELS} labels"))
    for k, v in labels.items():
        if not _valid_label_key(k):
            out.append(FieldViolation(
                f"{field}[{k[:40]!r}]", f"key {k[:70]!r}: label keys are [prefix/]name, at most 63 characters; "
                "name: letters, digits, '-', '_', '.', starting and ending with a letter or digit"))
        if len(v) > 63 or (v and not _LABEL_NAME_RE.match(v)):
            out.append(FieldViolation(
                f"{field}[{k[:40]!r}]", f"value of {k[:70]!r}: label values are at most 63 characters: letters, "
                "digits, '-', '_', '.', starting and ending with a letter or digit"))
    return out


def _valid_label_key(k: str) -> bool:
    if not k or len(k) > 63:
        return False
    prefix, sep, name = k.rpartition("/")
    if sep and not _DNS_SUBDOMAIN_RE.match(prefix):
        return False
    return bool(_LABEL_NAME_RE.match(name))


def check_options(options: Mapping[str, str], field: str) -> list[FieldViolation]:
    out: list[FieldViolation] = []
    if len(options) > MAX_OPTIONS:
        out.append(FieldViolation(field, f"at most {MAX_OPTIONS} options"))
    for k, v in options.items():
        if not _OPTION_KEY_RE.match(k):
            out.append(FieldViolation(f"{field}[{k[:40]!r}]", f"key {k[:130]!r}: option keys are 1-128 "
                                             "characters: letters, digits, '_', '.', '-', "
                                             "starting with a letter or '_'"))
        elif len(v) > MAX_OPTION_VALUE or "\x00" in v:
            out.append(FieldViolation(f"{field}[{k[:40]!r}]", f"value of {k!r}: at most {MAX_OPTION_VALUE} "
                                             "characters, no NUL"))
    return out


#: the most characters a credential field may hold: a kubeconfig or CA bundle with its
#: certificates inline stays far below; all of them together at most MAX_CREDENTIALS_CHARS
MAX_SECRET_CHARS = {"username": 256, "private_key": 64 << 10, "kubeconfig": 512 << 10,
                    "token": 64 << 10, "ca_cert": 512 << 10}
MAX_HOST_KEYS, MAX_HOST_KEY_CHARS = 64, 16 << 10
MAX_CREDENTIALS_CHARS = 1 << 20
_CREDENTIAL_FIELDS = {CredentialsKind.SSH: "ssh", CredentialsKind.KUBERNETES: "kubernetes",
                      CredentialsKind.TOKEN: "token"}


def _credential_sizes(creds: Credentials, field: str) -> list[FieldViolation]:
    at = f"{field}.{_CREDENTIAL_FIELDS.get(creds.kind, creds.kind.value)}"
    out = [FieldViolation(f"{at}.{name}", f"at most {limit} characters")
           for name, limit in MAX_SECRET_CHARS.items() if len(getattr(creds, name)) > limit]
    if len(creds.known_host_keys) > MAX_HOST_KEYS:
        out.append(FieldViolation(f"{at}.known_host_keys", f"at most {MAX_HOST_KEYS} keys"))
    elif any(len(k) > MAX_HOST_KEY_CHARS for k in creds.known_host_keys):
        out.append(FieldViolation(f"{at}.known_host_keys", f"at most {MAX_HOST_KEY_CHARS} characters a key"))
    total = sum(len(getattr(creds, name)) for name in MAX_SECRET_CHARS) + sum(map(len, creds.known_host_keys))
    if not out and total > MAX_CREDENTIALS_CHARS:
        out.append(FieldViolation(at, f"at most {MAX_CREDENTIALS_CHARS} characters in all"))
    return out


def check_credentials(ctype: ClusterType, creds: Credentials | None,
                      field: str) -> list[FieldViolation]:
    if creds is None:
        return []
    want = CREDENTIALS_FOR_TYPE.get(ctype)
    if want is None:
        return [FieldViolation(field, f"{ctype.value} clusters take no credentials")]
    if creds.kind is not want:
        return [FieldViolation(field, f"{ctype.value} clusters take {want.value} credentials, "
                                      f"not {creds.kind.value}")]
    out = _credential_sizes(creds, field)
    if out:  # bounded before anything else reads them (etcd refuses requests past 1.5 MiB)
        return out
    if creds.kind is CredentialsKind.SSH:
        if not creds.username:
            out.append(FieldViolation(f"{field}.ssh.username", "required"))
        if not creds.private_key:
            out.append(FieldViolation(f"{field}.ssh.private_key", "required"))
    elif creds.kind is CredentialsKind.KUBERNETES:
        if not creds.kubeconfig and not creds.token:
            out.append(FieldViolation(f"{field}.kubernetes", "kubeconfig or token required"))
    elif creds.kind is CredentialsKind.TOKEN and not creds.token:
        out.append(FieldViolation(f"{field}.token.token", "required"))
    return out


def check_new_cluster(cluster_id: str, cluster: Cluster, creds: Credentials | None,
                      request_id: str = "") -> list[FieldViolation]:
    """Every violation of a CreateCluster request."""
    out = check_cluster_id(cluster_id)
    out += check_request_id(request_id)
    if cluster.type is ClusterType.UNSPECIFIED:
        out.append(FieldViolation("cluster.type", "required"))
    else:
        out += check_address(cluster.type, cluster.address, "cluster.address")
        out += check_credentials(cluster.type, creds, "cluster.credentials")
    out += check_driver_address(cluster.driver_address, "cluster.driver_address")
    out += check_labels(cluster.labels, "cluster.labels")
    out += check_options(cluster.options, "cluster.options")
    out += check_allowed_projects(cluster.allowed_projects, "cluster.allowed_projects")
    return out


def check_update_mask(paths: Iterable[str]) -> list[str]:
    """The mask's paths, checked: required, each one of UPDATABLE_FIELDS, or ``*`` alone
    (AIP-134's full replacement: every updatable field, an unset one cleared)."""
    ps = list(paths)
    if "*" in ps:
        if len(ps) > 1:
            raise InvalidArgument.for_field("update_mask", "'*' stands alone")
        return list(UPDATABLE_FIELDS)
    if not ps:
        raise InvalidArgument.for_field(
            "update_mask", f"required; fields: {', '.join(UPDATABLE_FIELDS)}")
    for p in ps:
        if p not in UPDATABLE_FIELDS:
            if p == "type":
                raise InvalidArgument.for_field("update_mask", "type is immutable")
            raise InvalidArgument.for_field(
                "update_mask", f"cannot update {p!r}; fields: {', '.join(UPDATABLE_FIELDS)}")
    return ps


def check_updated_cluster(updated: Cluster, creds: Credentials | None,
                          paths: Iterable[str]) -> list[FieldViolation]:
    """Violations of the masked fields of an updated cluster."""
    out: list[FieldViolation] = []
    ps = set(paths)
    if "address" in ps:
        out += check_address(updated.type, updated.address, "cluster.address")
    if "driver_address" in ps:
        out += check_driver_address(updated.driver_address, "cluster.driver_address")
    if "labels" in ps:
        out += check_labels(updated.labels, "cluster.labels")
    if "options" in ps:
        out += check_options(updated.options, "cluster.options")
    if "credentials" in ps:
        out += check_credentials(updated.type, creds, "cluster.credentials")
    if "allowed_projects" in ps:
        out += check_allowed_projects(updated.allowed_projects, "cluster.allowed_projects")
    return out
