"""How the benchmarks' ranks meet: a gloo world through a file, sockets on loopback only.

No TCPStore: torch 2.13's listens on every interface whatever MASTER_ADDR says. Runs and
tests/dist_utils.py meet the same way.
"""

from __future__ import annotations

import os

import torch

from netsim.processes import init_process_group, loopback_interface


def join_gloo(rank: int, world: int, store: str) -> None:
    """Join a gloo world of `world` ranks through the file `store`, one torch thread a rank."""
    os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
    torch.set_num_threads(1)
    init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
