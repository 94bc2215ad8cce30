"""The Shaper: one process's shaping state, held by every netsim process group it creates."""

from __future__ import annotations

import os
import threading
import time
import uuid
import weakref
from typing import Any

import torch
import torch.distributed as dist

from netsim.nic import Timeline
from netsim.shaping.group import ShapedProcessGroup
from netsim.shaping.run_dir import RunDir
from netsim.topology import Topology
from netsim.trace import TraceRecorder

__all__ = ["MODES", "Shaper"]

MODES = ("off", "wall", "virtual")


class Shaper:
    """How this process shapes: topology, mode, recorder, clock, NIC timelines, its groups.

    Args:
        run_dir: folder for the node's shared NIC files (the caller creates and removes it);
            None uses NETSIM_RUN_DIR, else a folder named after the run token (see run_dir.py).
        generation: how many Shapers this process made before; each gets its own NIC files, so
            earlier virtual-time reservations never block a later run.
    """

    def __init__(
        self,
        topology: Topology,
        mode: str = "wall",
        recorder: TraceRecorder | None = None,
        shape_intra: bool = False,
        seed: int = 0,
        run_dir: str | os.PathLike | None = None,
        generation: int = 0,
    ) -> None:
        if not isinstance(topology, Topology):
            raise ValueError(f"topology {topology!r} must be a netsim.Topology.")
        if mode not in MODES:
            raise ValueError(f"shaping mode {mode!r} is not known; use one of {', '.join(MODES)}.")
        self.topology = topology
        self.mode = mode
        self.recorder = recorder
        self.shape_intra = bool(shape_intra)
        self.seed = int(seed)
        self.generation = generation
        self.run_dir = RunDir(run_dir)
        self.t0 = time.time()
        self.offset = 0.0  # virtual clock lead over the wall clock, seconds
        self.lock = threading.Lock()
        self.closed = False
        self._token: str | None = None
        self._timelines: dict[tuple, Timeline] = {}
        # Weak: the Shaper must never be what keeps a group (and the store behind it) alive.
        self._groups: weakref.WeakSet[ShapedProcessGroup] = weakref.WeakSet()
        if recorder is not None:
            recorder.clock = self.clock
            recorder.topology = recorder.topology or topology

    # -- time ---------------------------------------------------------------------------------
    def now(self) -> float:
        """Absolute time on this process's shaping time base (wall, or wall + virtual lead)."""
        return time.time() + self.offset

    def clock(self) -> float:
        """Seconds since this Shaper was made, on the wall or (mode "virtual") the virtual clock."""
        return self.now() - self.t0

    def advance_to(self, target: float) -> None:
        """Virtual mode: move the clock forward so that now() >= target."""
        with self.lock:
            lag = target - (time.time() + self.offset)
            if lag > 0:
                self.offset += lag

    # -- shared NIC state ---------------------------------------------------------------------
    def run_token(self) -> str:
        """One id per run, agreed through the default store, naming the shared NIC folder."""
        if self._token is None:
            mine = uuid.uuid4().hex
            try:
                store = dist.distributed_c10d._get_default_store()
                self._token = store.compare_set("netsim/run_token", "", mine).decode()
            except Exception:  # no default store (tests, single process): private NIC state
                self._token = mine
        return self._token

    def timeline(self, key: tuple, shared_node: int | str | None) -> Timeline:
        """The reservation timeline for `key`; file-backed when a node's processes share it (a
        str names one that several nodes' processes share, such as a site's uplink)."""
        with self.lock:
            if key not in self._timelines:
                path = None
                if shared_node is not None:
                    token = self.run_token()
                    label = (shared_node if isinstance(shared_node, str)
                             else f"node{shared_node}")
                    name = f"{token}-{self.mode}{self.generation}-{label}.nic"
                    path = self.run_dir.path(token) / name
                self._timelines[key] = Timeline(path)
            return self._timelines[key]

    # -- groups -------------------------------------------------------------------------------
    def create_backend(self, dist_opts: Any, _backend_opts: Any = None) -> ShapedProcessGroup:
        """Backend creator for torch: real gloo (and nccl) backends inside a shaping wrapper."""
        if self.closed:
            raise ValueError("this netsim Shaper was closed; call shaping.install(...) again.")
        store, rank, size = dist_opts.store, dist_opts.group_rank, dist_opts.group_size
        ranks = list(dist_opts.global_ranks_in_group) or list(range(size))
        inners: dict = {}
        gloo = torch._C._distributed_c10d.ProcessGroupGloo(
            dist.PrefixStore("gloo/", store), rank, size, dist_opts.timeout
        )
        inners["cpu"] = (dist.ProcessGroup.BackendType.GLOO, gloo)
        if torch.cuda.is_available() and dist.is_nccl_available():
            nccl_opts = torch._C._distributed_c10d.ProcessGroupNCCL.Options()
            nccl_opts._timeout = dist_opts.timeout
            nccl = torch._C._distributed_c10d.ProcessGroupNCCL(
                dist.PrefixStore("nccl/", store), rank, size, nccl_opts
            )
            inners["cuda"] = (dist.ProcessGroup.BackendType.NCCL, nccl)
        group = ShapedProcessGroup(self, inners, rank, size, ranks)
        self._groups.add(group)
        return group

    def groups(self) -> list[ShapedProcessGroup]:
        """The groups this Shaper made that are still alive and open."""
        return [g for g in self._groups if not g.closed]

    def close(self) -> None:
        """Shut down and drop every inner backend of our groups, close NIC files, remove our folder.

        Call it once no collective is in flight on our groups (after the training loop, before or
        after dist.destroy_process_group(), which shuts the same backends down: both orders are
        safe). Later collectives on these groups raise ValueError. Idempotent.
        """
        for group in list(self._groups):
            group.close()
        self._groups = weakref.WeakSet()
        with self.lock:
            for timeline in self._timelines.values():
                timeline.close()
            self._timelines.clear()
        self.run_dir.close()
        self.closed = True
