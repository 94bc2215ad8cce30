"""ShapedProcessGroup: a group over real gloo/nccl backends; every op goes through one funnel.

Each collective method below only says which trace op it is, which tensors it counts and how the
wrapped backend runs it; `_funnel` does the rest once for all of them: pick the wrapped backend by
device, compute the wire volume, exchange arrival times, launch, record, and hand back a
ShapedWork that holds completion to the modeled time.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllreduceOptions, ReduceOp

from netsim.costs import CollectiveVolume, collective_volume, default_algorithm
from netsim.nic import Timeline
from netsim.shaping.work import ShapedWork
from netsim.topology import Link, ring_nic_share

if TYPE_CHECKING:
    from netsim.shaping.shaper import Shaper

__all__ = ["BACKEND", "ShapedProcessGroup"]

BACKEND = "netsim"

Launch = Callable[[Any], Any]  # runs the op on a wrapped backend; returns a Work or a list


def _nbytes(tensors: Any) -> int:
    """Payload bytes of a tensor or a (nested) list of tensors."""
    if tensors is None:
        return 0
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _first_tensor(tensors: Any) -> torch.Tensor | None:
    if isinstance(tensors, torch.Tensor):
        return tensors
    for t in tensors or ():
        found = _first_tensor(t)
        if found is not None:
            return found
    return None


def _a(opts: Any) -> tuple:
    """Pass options through only when the caller gave them (the backends have defaults)."""
    return () if opts is None else (opts,)


def _max_options() -> AllreduceOptions:
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.MAX
    return opts


def _pairs(method: str, outputs: list, inputs: list, opts: Any) -> Launch:
    """Launch of a coalesced op as one `method` call per (output, input) pair."""
    return lambda g: [
        getattr(g, method)(o, i, *_a(opts)) for o, i in zip(outputs, inputs, strict=True)
    ]


class ShapedProcessGroup(dist.ProcessGroup):
    """A process group that delegates to real gloo/nccl backends, recording and shaping each op."""

    def __init__(
        self, shaper: Shaper, inners: dict, group_rank: int, group_size: int, ranks: list[int]
    ) -> None:
        super().__init__(group_rank, group_size)
        self._shaper = shaper
        self._inners = inners
        # Registered so that dist.destroy_process_group() shuts them down with this group and
        # FSDP can ask for the device backend.
        for device, (backend_type, inner) in inners.items():
            self._register_backend(torch.device(device), backend_type, inner)
        self._ranks = list(ranks)
        topo = shaper.topology
        if max(self._ranks) >= topo.world_size:
            raise ValueError(
                f"group ranks {self._ranks} do not fit the installed topology of "
                f"{topo.world_size} ranks; install the topology the run really has."
            )
        self._global_rank = self._ranks[group_rank]
        self._inter = topo.crosses_nodes(self._ranks)
        # With per-node links, the group's link is its slowest member's rate and largest latency:
        # a ring moves in lock-step, so every member's NIC is held at that pace (booked below on
        # this node's own NIC timeline), which is exact when members carry alike loads.
        self._link: Link = topo.link_for(self._ranks)
        self._shaped = shaper.mode != "off" and (self._inter or shaper.shape_intra)
        self._nic_share = ring_nic_share(self._ranks, topo) if self._inter else 1.0
        self._rng = random.Random(f"{shaper.seed}:{self._global_rank}:{self._ranks}")
        self.closed = False

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """The registered backend name, "netsim"."""
        return BACKEND

    def close(self) -> None:
        """Shut down the wrapped backends and drop them; later ops raise ValueError."""
        for _backend_type, inner in self._inners.values():
            inner.shutdown()  # a no-op when destroy_process_group() already did it
        self._inners = {}
        self.closed = True

    # -- modeling ------------------------------------------------------------------------------
    def _timeline(self) -> Timeline:
        topo, shaper = self._shaper.topology, self._shaper
        if not self._inter:
            return shaper.timeline(("intra", self._global_rank), None)
        if topo.nic == "per-accelerator":
            return shaper.timeline(("nic", self._global_rank), None)
        node = topo.node_of(self._global_rank)
        return shaper.timeline(("nic", node), node)

    def _model_finish(self, begin: float, volume: CollectiveVolume) -> float:
        """Modeled completion time of a collective that starts at `begin`."""
        link = self._link
        latency = volume.latency_steps * link.latency
        if link.jitter > 0 and volume.latency_steps:
            latency += sum(
                self._rng.uniform(-link.jitter, link.jitter) for _ in range(volume.latency_steps)
            )
            latency = max(0.0, latency)
        share = self._nic_share
        through = self._timeline().reserve(
            begin,
            volume.bytes_sent * share,
            volume.bytes_received * share,
            link.effective_bandwidth,
        )
        return through + latency

    # -- the funnel ----------------------------------------------------------------------------
    def _inner_for(self, tensors: Any) -> tuple[str, Any]:
        if self.closed:
            raise ValueError("this netsim process group was closed (Shaper.close or uninstall).")
        first = _first_tensor(tensors)
        device = first.device.type if first is not None else next(iter(self._inners))
        if device not in self._inners:
            raise ValueError(f"netsim groups handle cpu and cuda tensors, not {device!r} tensors.")
        return device, self._inners[device][1]

    def _funnel(
        self, op: str, tensors: Any, launch: Launch, root: int | None = None, exchange: bool = True
    ) -> ShapedWork:
        """Every op's one path: count `tensors`, launch on the wrapped backend, record, shape.

        Args:
            root: group rank of a rooted op's root (its volume differs from the others').
            exchange: whether ranks swap arrival times first (not for point-to-point ops).
        """
        shaper = self._shaper
        device, inner = self._inner_for(tensors)
        nbytes = _nbytes(tensors)
        algorithm = default_algorithm(op, "gloo" if device == "cpu" else "nccl")
        volume = collective_volume(op, self.size(), nbytes, algorithm, is_root=self.rank() == root)
        issued = shaper.now()
        row = None
        if shaper.recorder is not None:
            row = shaper.recorder.record_collective(
                op, self._ranks, self._inter, algorithm, nbytes, volume.bytes_sent,
                volume.bytes_received, issued - shaper.t0,
            )  # fmt: skip
        arrival = sync = None
        if self._shaped and exchange and self.size() > 1:
            # Everybody's arrival time, so the modeled transfer starts when the last rank shows up.
            arrival = torch.tensor([issued], dtype=torch.float64, device=device)
            sync = inner.allreduce([arrival], _max_options())
        works = launch(inner)
        works = works if isinstance(works, list) else [works]
        finish = (lambda begin: self._model_finish(begin, volume)) if self._shaped else None
        return ShapedWork(shaper, works, finish, row, issued, arrival, sync)

    # -- collectives: what each op is, what it counts, how the wrapped backend runs it ---------
    def allreduce(self, tensors, opts=None):
        """All-reduce through the funnel."""
        opts = AllreduceOptions() if opts is None else opts
        return self._funnel("all_reduce", tensors, lambda g: g.allreduce(tensors, opts))

    def allreduce_coalesced(self, tensors, opts=None):
        """Coalesced all-reduce through the funnel."""
        return self._funnel(
            "all_reduce", tensors, lambda g: g.allreduce_coalesced(tensors, *_a(opts))
        )

    def allgather(self, output_lists, inputs, opts=None):
        """All-gather into lists through the funnel."""
        return self._funnel(
            "all_gather", inputs, lambda g: g.allgather(output_lists, inputs, *_a(opts))
        )

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        """Coalesced all-gather through the funnel."""
        launch = lambda g: g.allgather_coalesced(output_lists, inputs, *_a(opts))
        return self._funnel("all_gather", inputs, launch)

    def _allgather_base(self, output, inp, opts=None):
        """All-gather into one tensor through the funnel."""
        return self._funnel("all_gather", inp, lambda g: g._allgather_base(output, inp, *_a(opts)))

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        """Coalesced all-gather into tensors through the funnel."""
        return self._funnel("all_gather", inputs, _pairs("_allgather_base", outputs, inputs, opts))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        """Reduce-scatter of lists through the funnel."""
        launch = lambda g: g.reduce_scatter(outputs, input_lists, *_a(opts))
        return self._funnel("reduce_scatter", input_lists, launch)

    def _reduce_scatter_base(self, output, inp, opts=None):
        """Reduce-scatter of one tensor through the funnel."""
        launch = lambda g: g._reduce_scatter_base(output, inp, *_a(opts))
        return self._funnel("reduce_scatter", inp, launch)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        """Coalesced reduce-scatter of tensors through the funnel."""
        launch = _pairs("_reduce_scatter_base", outputs, inputs, opts)
        return self._funnel("reduce_scatter", inputs, launch)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def alltoall_base(self, output, inp, output_splits, input_splits, opts=None):
        """All-to-all of one tensor through the funnel."""
        launch = lambda g: g.alltoall_base(output, inp, output_splits, input_splits, *_a(opts))
        return self._funnel("all_to_all", inp, launch)

    all_to_all_single = alltoall_base

    def alltoall(self, outputs, inputs, opts=None):
        """All-to-all of lists through the funnel."""
        return self._funnel("all_to_all", inputs, lambda g: g.alltoall(outputs, inputs, *_a(opts)))

    def broadcast(self, tensors, opts=None):
        """Broadcast through the funnel."""
        root = getattr(opts, "rootRank", 0)
        return self._funnel("broadcast", tensors, lambda g: g.broadcast(tensors, *_a(opts)), root)

    def reduce(self, tensors, opts=None):
        """Reduce through the funnel."""
        root = getattr(opts, "rootRank", 0)
        return self._funnel("reduce", tensors, lambda g: g.reduce(tensors, *_a(opts)), root)

    def gather(self, output_lists, inputs, opts=None):
        """Gather through the funnel."""
        root = getattr(opts, "rootRank", 0)
        launch = lambda g: g.gather(output_lists, inputs, *_a(opts))
        return self._funnel("gather", inputs, launch, root)

    def scatter(self, outputs, input_lists, opts=None):
        """Scatter through the funnel (counted by the chunk each rank ends up with)."""
        root = getattr(opts, "rootRank", 0)
        launch = lambda g: g.scatter(outputs, input_lists, *_a(opts))
        return self._funnel("scatter", outputs, launch, root)

    # Point-to-point: only two ranks take part, so no arrival exchange over the whole group.
    def send(self, tensors, dst, tag=0):
        """Send through the funnel."""
        return self._funnel("send", tensors, lambda g: g.send(tensors, dst, tag), exchange=False)

    def recv(self, tensors, src, tag=0):
        """Receive through the funnel."""
        return self._funnel("recv", tensors, lambda g: g.recv(tensors, src, tag), exchange=False)

    def recv_anysource(self, tensors, tag=0):
        """Receive from any rank through the funnel."""
        launch = lambda g: g.recv_anysource(tensors, tag)
        return self._funnel("recv", tensors, launch, exchange=False)

    def barrier(self, opts=None):
        """Barrier through the funnel (no payload)."""
        return self._funnel("barrier", None, lambda g: g.barrier(*_a(opts)))
