"""Processes on this host: whether one is alive (run folders and namespaces of dead owners go),
the loopback interface, and joining a process group that ends with the run."""

from __future__ import annotations

import os
import socket
from typing import Any

__all__ = ["pid_alive", "loopback_interface", "init_process_group"]


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


def init_process_group(*args: Any, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group``, after the import that keeps groups mortal.

    torch.distributed.nn.functional evaluates ``group=group.WORLD`` in its signatures at import.
    Imported after the default group exists (torch.optim and torch._dynamo import it on first
    use), its defaults hold that group for the life of the process: destroy_process_group()
    cannot free it, gloo's worker threads run on into interpreter shutdown, and one that then
    drops a tensor takes the GIL and aborts the process ("terminate called without an active
    exception", rare, at exit). Imported first, the defaults hold None.
    """
    import torch.distributed as dist
    import torch.distributed.nn.functional  # noqa: F401  (see the docstring)

    dist.init_process_group(*args, **kwargs)
