"""Shaping real torch.distributed collectives: a "netsim" process-group backend over gloo/nccl.

Groups made with `dist.new_group(ranks, backend=shaping.BACKEND)` behave like the wrapped backend,
record every collective to the installed TraceRecorder and, for inter-node groups, finish no earlier
than the alpha-beta model allows:

- "wall": `wait()` runs the real op, then sleeps until the modeled completion time.
- "virtual": nothing sleeps; a per-process virtual clock jumps forward to the modeled completion.
- "off": count and trace only.

The modeled start of a collective is the latest arrival among its ranks (exchanged by a tiny MAX
all-reduce on the wrapped group), so a late peer delays everybody as on a real network. Bytes go
through a reservation timeline per node NIC (shared by the node's processes through a locked file
in the run folder, see run_dir.py) or per accelerator, so concurrent transfers share bandwidth.
Point-to-point messages (send/recv, e.g. gossip's batch_isend_irecv) meet only their peer: a
message starts when both ends are there, and a rank's messages in flight together share its NIC
fairly each way (group.py).

Where things live: `shaper.Shaper` holds one process's state and makes the groups;
`group.ShapedProcessGroup` funnels every collective through one path; `work.ShapedWork` holds
completion to the model; `run_dir` owns the shared folder; `state.ShaperState` is what groups and
works read of their Shaper (a Protocol, so neither imports the Shaper that makes them). The
functions here are the process-level conveniences: `install` makes the current Shaper,
`uninstall` closes every Shaper.

Teardown, in this order: `dist.destroy_process_group()`, then `shaping.uninstall()` (shuts down
and drops every wrapped backend netsim made, closes NIC files, removes the run folder netsim
made), then drop the objects that still hold groups (model, optimizer, mesh) and `gc.collect()`;
`teardown()` does all of it.
"""

from __future__ import annotations

import gc
import os

import torch.distributed as dist

from netsim.shaping.group import BACKEND, ShapedProcessGroup
from netsim.shaping.run_dir import ENV_VAR, clean_stale_run_dirs
from netsim.shaping.shaper import MODES, Shaper
from netsim.topology import Topology
from netsim.trace import TraceRecorder

__all__ = [
    "BACKEND",
    "ENV_VAR",
    "MODES",
    "Shaper",
    "ShapedProcessGroup",
    "install",
    "uninstall",
    "teardown",
    "clock",
    "clean_stale_run_dirs",
]

_CURRENT: Shaper | None = None  # the Shaper that new netsim groups are made by
_OPEN: list[Shaper] = []  # every Shaper installed and not yet closed, for uninstall()
_INSTALLS = 0


def install(
    topology: Topology,
    mode: str = "wall",
    recorder: TraceRecorder | None = None,
    shape_intra: bool = False,
    seed: int = 0,
    run_dir: str | os.PathLike | None = None,
) -> Shaper:
    """Make the current Shaper and register the BACKEND process-group backend (before new_group).

    Args:
        run_dir: folder for the node's shared NIC files, the same on all ranks of a node; the
            caller creates and removes it. None: $NETSIM_RUN_DIR, else a folder named after the
            run token in the temp dir, removed at close by the rank that made it.
    """
    global _CURRENT, _INSTALLS
    shaper = Shaper(topology, mode, recorder, shape_intra, seed, run_dir, generation=_INSTALLS)
    _INSTALLS += 1
    _CURRENT = shaper
    _OPEN.append(shaper)
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    return shaper


def _create(dist_opts, backend_opts):
    """Backend creator handed to torch: the current Shaper builds the group."""
    if _CURRENT is None:
        raise ValueError(
            "the netsim backend needs shaping.install(topology, mode) before new_group."
        )
    return _CURRENT.create_backend(dist_opts, backend_opts)


def uninstall() -> None:
    """Close every Shaper installed in this process (their groups stop working) and forget them."""
    global _CURRENT
    while _OPEN:
        _OPEN.pop().close()
    _CURRENT = None


def teardown() -> None:
    """Destroy every process group, uninstall, and free the groups now, not at interpreter exit.

    A group freed during interpreter shutdown races gloo's own threads: one that drops a tensor
    then takes the GIL and aborts the process ("terminate called without an active exception",
    rare, at exit). gloo's threads end only when the last reference to a group goes: the finished
    run's model, mesh and optimizer form cycles that hold some, and DTensor's sharding
    propagation caches its outputs, whose specs hold the mesh (and through it the groups).
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    uninstall()  # shuts down and drops netsim's wrapped gloo/nccl backends
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # a torch without DTensor's cache keeps no mesh in it
        pass
    else:
        _clear_sharding_prop_cache()
    gc.collect()


def clock() -> float:
    """Seconds since install(): the wall clock, or in "virtual" mode the virtual clock."""
    if _CURRENT is None:
        raise ValueError("shaping.clock() needs shaping.install(...) to have been called first.")
    return _CURRENT.clock()
