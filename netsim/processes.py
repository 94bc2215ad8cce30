"""Processes on this host: whether one is alive (run folders and namespaces of dead owners go)."""

from __future__ import annotations

import os
import socket

__all__ = ["pid_alive", "loopback_interface"]


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (a live process of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def loopback_interface() -> str:
    """The loopback interface name (lo on Linux, lo0 on macOS), for GLOO_SOCKET_IFNAME."""
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    return names[0] if names else "lo"
