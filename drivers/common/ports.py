"""Free TCP ports for a job's rendezvous, distinct within one call.

Every port is bound at the same time before any is released, so one call never
answers the same port twice (binding and releasing one port at a time can: the
kernel may hand the port it just freed to the next ``bind(0)``). The ports are
free when the call returns; the job's processes bind them moments later.
Imported inside Ray clusters by the launcher: standard library only.
"""

from __future__ import annotations

import socket


def free_ports(n: int, host: str = "") -> list[int]:
    """``n`` distinct free ports on ``host`` (all interfaces when empty)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()
