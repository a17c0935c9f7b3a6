"""Where a client connects and with which credentials: the CLI's and SDK's
``Profile``, from flags, the environment and a kubeconfig-style file.

The file (``$DLSCHED_CONFIG``, else ``~/.config/dlsched/config.yaml``)::

    current-context: local
    contexts:
      local:
        server: 127.0.0.1:50051          # JobManager (and AccessService)
        cluster-manager: 127.0.0.1:50052
        ca-file: /home/me/.dlsched/tls/ca.pem
        token-file: /home/me/.dlsched/admin.token   # or token-command: "idp print-token"
      prod:
        server: dlsched.example.com:443
        cluster-manager: dlsched-cm.example.com:443
        token-command: "oidc-cli token --audience dlsched"

Precedence, highest first: explicit arguments (CLI flags), environment
(``DLSCHED_SERVER``, ``DLSCHED_CLUSTER_MANAGER``, ``DLSCHED_TOKEN``,
``DLSCHED_TOKEN_FILE``, ``DLSCHED_CA_FILE`` or ``DLSCHED_TLS_CA_FILE``,
``DLSCHED_INSECURE``, ``DLSCHED_CONTEXT``), the chosen context, defaults
(127.0.0.1:50051 / :50052, TLS). The token comes from exactly one source, the
first of ``--token-file``, ``DLSCHED_TOKEN``, ``DLSCHED_TOKEN_FILE``, the
context's ``token-file``, its ``token-command``. ``dlsched up`` adds a context ``local`` and
makes it current when the file has none, so the CLI on the same machine needs
no flags. Read once per client, never deep in the code.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dlsched.errors import InvalidArgument
from dlsched.kit.channel import TokenSource
from dlsched.kit.tls import TlsOptions

DEFAULT_SERVER = "127.0.0.1:50051"
DEFAULT_CLUSTER_MANAGER = "127.0.0.1:50052"
_KEYS = ("server", "cluster-manager", "ca-file", "cert-file", "key-file", "token-file",
         "token-command", "insecure")


@dataclass(frozen=True)
class Profile:
    server: str = DEFAULT_SERVER
    cluster_manager: str = DEFAULT_CLUSTER_MANAGER
    tls: TlsOptions = TlsOptions()
    token: str | None = None
    token_file: str | None = None
    token_command: str | None = None

    def token_source(self) -> TokenSource:
        return TokenSource(token=self.token, file=self.token_file, command=self.token_command)


def config_path(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get("DLSCHED_CONFIG"):
        return Path(env["DLSCHED_CONFIG"])
    base = env.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "dlsched" / "config.yaml"


def load_config(path: Path) -> dict[str, Any]:
    try:
        with open(path) as f:
            doc = yaml.safe_load(f) or {}
    except FileNotFoundError:
        return {}
    except (OSError, yaml.YAMLError) as e:
        raise InvalidArgument.for_field("config", f"{path}: {e}") from e
    if not isinstance(doc, dict):
        raise InvalidArgument.for_field("config", f"{path}: not a mapping")
    return doc


def _truthy(v: object) -> bool:
    return str(v).strip().lower() in ("1", "true", "yes", "on")


def resolve(*, server: str | None = None, cluster_manager: str | None = None,
            token_file: str | None = None, ca_file: str | None = None,
            insecure: bool | None = None, context: str | None = None,
            env: Mapping[str, str] | None = None) -> Profile:
    """The profile from arguments, then environment, then the config file."""
    env = os.environ if env is None else env
    path = config_path(env)
    doc = load_config(path)
    name = context or env.get("DLSCHED_CONTEXT") or doc.get("current-context")
    ctx: dict[str, Any] = {}
    if name:
        contexts = doc.get("contexts") or {}
        if name not in contexts:
            if context or env.get("DLSCHED_CONTEXT"):
                raise InvalidArgument.for_field("context", f"no context {name!r} in {path}")
        else:
            ctx = dict(contexts[name] or {})
    unknown = set(ctx) - set(_KEYS)
    if unknown:
        raise InvalidArgument.for_field("context", f"{path}: unknown keys {sorted(unknown)}")

    def pick(arg: str | None, env_name: str, key: str, default: str | None = None) -> str | None:
        if arg:
            return arg
        if env.get(env_name):
            return env[env_name]
        v = ctx.get(key)
        return str(v) if v not in (None, "") else default

    # One token source, the first of: --token-file, DLSCHED_TOKEN, DLSCHED_TOKEN_FILE,
    # the context's token-file, the context's token-command.
    token = None if token_file else env.get("DLSCHED_TOKEN") or None
    tfile = None if token else pick(token_file, "DLSCHED_TOKEN_FILE", "token-file")
    tcmd = None if (token or tfile) else ctx.get("token-command")
    if insecure is None:
        insecure = _truthy(env["DLSCHED_INSECURE"]) if env.get("DLSCHED_INSECURE") else _truthy(
            ctx.get("insecure", False))
    ca = ca_file or env.get("DLSCHED_CA_FILE") or env.get("DLSCHED_TLS_CA_FILE") or ctx.get("ca-file")
    tls = TlsOptions(cert_file=ctx.get("cert-file"), key_file=ctx.get("key-file"),
                     ca_file=str(ca) if ca else None, insecure=bool(insecure))
    return Profile(
        server=pick(server, "DLSCHED_SERVER", "server", DEFAULT_SERVER) or DEFAULT_SERVER,
        cluster_manager=pick(cluster_manager, "DLSCHED_CLUSTER_MANAGER", "cluster-manager",
                             DEFAULT_CLUSTER_MANAGER) or DEFAULT_CLUSTER_MANAGER,
        tls=tls, token=token, token_file=tfile, token_command=str(tcmd) if tcmd else None)


def _write_config(path: Path, doc: Mapping[str, Any]) -> None:
    """Write the config file atomically, readable by its owner only (it may
    name token files and hold token commands)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(dict(doc), f, sort_keys=False)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def save_context(name: str, values: Mapping[str, Any], *, path: Path | None = None,
                 make_current: bool = False) -> Path:
    """Add or replace context ``name``; current when asked or when none is."""
    path = path or config_path()
    doc = load_config(path)
    contexts = doc.setdefault("contexts", {}) or {}
    doc["contexts"] = contexts
    contexts[name] = {k: v for k, v in values.items() if k in _KEYS and v is not None}
    if make_current or not doc.get("current-context"):
        doc["current-context"] = name
    _write_config(path, doc)
    return path


def get_contexts(path: Path | None = None) -> tuple[str | None, dict[str, dict[str, Any]]]:
    """The current context's name (None when unset) and every context."""
    doc = load_config(path or config_path())
    contexts = doc.get("contexts") or {}
    if not isinstance(contexts, dict):
        raise InvalidArgument.for_field("config", f"{path or config_path()}: contexts is not a mapping")
    current = doc.get("current-context")
    return (str(current) if current else None,
            {str(k): dict(v or {}) for k, v in contexts.items()})


def use_context(name: str, *, path: Path | None = None) -> Path:
    """Make context ``name`` the current one."""
    path = path or config_path()
    doc = load_config(path)
    if name not in (doc.get("contexts") or {}):
        raise InvalidArgument.for_field("context", f"no context {name!r} in {path}")
    doc["current-context"] = name
    _write_config(path, doc)
    return path
