"""ShapedProcessGroup: a group over real gloo/nccl backends; every op goes through one funnel.

Each collective method below only says which trace op it is, which tensors it counts and how the
wrapped backend runs it; `_funnel` does the rest once for all of them: pick the wrapped backend by
device, compute the wire volume, exchange arrival times, launch, record, and hand back a
ShapedWork that holds completion to the modeled time.

Point-to-point messages (send, recv; `dist.batch_isend_irecv` posts one per op) meet only their
peer: the sender hands its issue time to the receiver in a tiny message of its own, and the
transfer starts when both ends are there. Messages a rank has in flight together share its NIC
fairly (processor sharing), each way on its own: a rank sending to two neighbours at once moves
each at half the rate. They are booked as one batch when the first of them is waited on, after
the other ranks' traffic on the node's NIC timeline, and each ends one latency after its bytes.
A receive is paced by the receiving NIC and the pair's link rate: the sender's other messages
are not visible to it (on a regular graph, such as gossip's, both ends carry the same load).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllreduceOptions, ReduceOp

from netsim.costs import P2P_OPS, CollectiveVolume, collective_volume, default_algorithm
from netsim.nic import Timeline, fair_share_finishes
from netsim.shaping.annotate import profiled
from netsim.shaping.site_links import site_finish
from netsim.shaping.work import ShapedWork
from netsim.sites import SITE_OPS
from netsim.topology import Link, ring_nic_share

if TYPE_CHECKING:
    from netsim.shaping.state import ShaperState

__all__ = ["BACKEND", "ShapedProcessGroup"]

BACKEND = "netsim"

Launch = Callable[[Any], Any]  # runs the op on a wrapped backend; returns a Work or a list

# Added to a message's tag for its issue-time stamp, so a stamp never matches a payload.
_STAMP_TAG = 1 << 30


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


def _as_list(works: Any) -> list:
    return works if isinstance(works, list) else [works]


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


class _Message:
    """One shaped send or recv of this rank, waiting to be booked on the NIC with its batch."""

    __slots__ = ("sending", "nbytes", "issued", "link", "inter", "stamp", "stamp_work", "booked")

    def __init__(self, sending: bool, nbytes: int, issued: float, link: Link, inter: bool) -> None:
        self.sending = sending
        self.nbytes = nbytes
        self.issued = issued
        self.link = link
        self.inter = inter
        self.stamp: torch.Tensor | None = None  # a receive's copy of the sender's issue time
        self.stamp_work: Any = None
        self.booked: tuple[float, float] | None = None  # (begin, finish) from this rank's side

    def lateness(self) -> float:
        """How much later than this rank the other end issued it (a receive waits for that)."""
        if self.stamp_work is None:
            return 0.0
        if not self.stamp_work.is_completed():  # gloo hangs on a second wait() of a receive
            self.stamp_work.wait()
        return max(0.0, float(self.stamp[0].item()) - self.issued)


def _fair_shares(batch: list[_Message], bandwidth: float) -> tuple[dict[int, float], list[float]]:
    """Each message's end with each way's messages sharing `bandwidth`; bytes sent, received."""
    ends: dict[int, float] = {}
    totals = []
    for sending in (True, False):
        ids = [i for i, m in enumerate(batch) if m.sending == sending]
        shared = fair_share_finishes([batch[i].issued for i in ids],
                                     [batch[i].nbytes for i in ids], bandwidth)
        ends.update(zip(ids, shared, strict=True))
        totals.append(sum(batch[i].nbytes for i in ids))
    return ends, totals


def _queue_delays(batch: list[_Message], ends: dict[int, float], totals: list[float],
                  booked: tuple[float, float], start: float) -> list[float]:
    """How much later the sends, and the receives, end for queueing behind the NIC's bookings."""
    delay = [0.0, 0.0]
    for d, sending in enumerate((True, False)):
        last = max((ends[i] for i, m in enumerate(batch) if m.sending == sending),
                   default=start)
        delay[d] = max(0.0, booked[d] - last) if totals[d] else 0.0
    return delay


class ShapedProcessGroup(dist.ProcessGroup):
    """A process group that delegates to real gloo/nccl backends, recording and shaping each op."""

    def __init__(
        self, shaper: ShaperState, inners: dict, group_rank: int, group_size: int, ranks: list[int]
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
        # On several sites a group of one rank per node over all nodes runs hierarchically
        # (netsim.sites); other groups and messages see the sites' flat view, topo.inter.
        sites = topo.sites
        self._on_sites = (sites is not None and len(sites.sites) > 1 and self._inter
                          and len(topo.nodes_of(self._ranks)) == len(self._ranks) == topo.nodes)
        self._nic_share = ring_nic_share(self._ranks, topo) if self._inter else 1.0
        self._rng = random.Random(f"{shaper.seed}:{self._global_rank}:{self._ranks}")
        self._unbooked: list[_Message] = []  # messages issued, not yet booked on a NIC
        self._p2p_lock = threading.Lock()
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
    def _timeline(self, inter: bool | None = None) -> Timeline:
        topo, shaper = self._shaper.topology, self._shaper
        if not (self._inter if inter is None else inter):
            return shaper.timeline(("intra", self._global_rank), None)
        if topo.nic == "per-accelerator":
            return shaper.timeline(("nic", self._global_rank), None)
        node = topo.node_of(self._global_rank)
        return shaper.timeline(("nic", node), node)

    def _model_finish(self, begin: float, volume: CollectiveVolume, op: str = "",
                      nbytes: float = 0.0) -> float:
        """Modeled completion time of a collective that starts at `begin`."""
        if self._on_sites and op in SITE_OPS:
            node = self._shaper.topology.node_of(self._global_rank)
            return site_finish(self._shaper, node, self._timeline(), begin, op, nbytes)
        link = self._link
        latency = self._jittered(volume.latency_steps * link.latency, link, volume.latency_steps)
        share = self._nic_share
        through = self._timeline().reserve(
            begin,
            volume.bytes_sent * share,
            volume.bytes_received * share,
            link.effective_bandwidth,
        )
        return through + latency

    def _jittered(self, latency: float, link: Link, steps: int = 1) -> float:
        if link.jitter > 0 and steps:
            latency += sum(self._rng.uniform(-link.jitter, link.jitter) for _ in range(steps))
        return max(0.0, latency)

    def _message_span(self, message: _Message) -> tuple[float, float]:
        """(begin, finish) of a message; the first one asked books all this rank has in flight.

        Every message issued and not yet booked belongs to the batch: a receive's start is taken
        as its own issue time there (waiting for other stamps could deadlock), and the whole
        span moves later by however late its sender turns out to have been.
        """
        with self._p2p_lock:
            if message.booked is None:
                batch, self._unbooked = self._unbooked, []
                for inter in (True, False):
                    self._book_batch([m for m in batch if m.inter == inter], inter)
            late = message.lateness()
            return message.booked[0] + late, message.booked[1] + late

    def _book_batch(self, batch: list[_Message], inter: bool) -> None:
        """Processor-shared NIC time of messages in flight together, queued after other ranks'."""
        if not batch:
            return
        topo = self._shaper.topology
        nic = topo.node_link(topo.node_of(self._global_rank)) if inter else topo.intra
        bandwidth = nic.effective_bandwidth
        start = min(m.issued for m in batch)
        ends, totals = _fair_shares(batch, bandwidth)
        # The node's other ranks may hold the NIC already: the batch then waits its turn.
        booked = self._timeline(inter).reserve_each(start, totals[0], totals[1], bandwidth)
        delay = _queue_delays(batch, ends, totals, booked, start)
        for i, m in enumerate(batch):
            # A slower link at the other end paces the message too.
            through = max(ends[i] + delay[0 if m.sending else 1],
                          m.issued + m.nbytes / m.link.effective_bandwidth)
            m.booked = (m.issued, through + self._jittered(m.link.latency, m.link))

    def _message(
        self, op: str, tensors: Any, peer: int | None, tag: int, launch: Launch, row: dict | None,
        issued: float, device: str, inner: Any, issued_mono: float,
    ) -> ShapedWork:
        """A send or recv: shaped as a pairwise transfer that starts when both ends are there."""
        topo, shaper = self._shaper.topology, self._shaper
        if peer is None:  # from any source: the group's link, no stamp to wait for
            link, inter = self._link, self._inter
        else:
            pair = [self._global_rank, self._ranks[peer]]
            link, inter = topo.link_for(pair), topo.crosses_nodes(pair)
        if shaper.mode == "off" or not (inter or shaper.shape_intra):
            return ShapedWork(shaper, _as_list(launch(inner)), None, row, issued,
                              issued_mono=issued_mono)
        message = _Message(op == "send", _nbytes(tensors), issued, link, inter)
        works = []
        if peer is not None:
            # The stamp goes first on both ends, so backends that match by order pair them too.
            if message.sending:
                stamp = torch.tensor([issued], dtype=torch.float64, device=device)
                works.append(inner.send([stamp], peer, tag + _STAMP_TAG))
            else:
                message.stamp = torch.empty(1, dtype=torch.float64, device=device)
                message.stamp_work = inner.recv([message.stamp], peer, tag + _STAMP_TAG)
                works.append(message.stamp_work)
        works += _as_list(launch(inner))
        with self._p2p_lock:
            self._unbooked.append(message)
        span = lambda: self._message_span(message)
        return ShapedWork(shaper, works, None, row, issued, span=span, issued_mono=issued_mono)

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
        self, op: str, tensors: Any, launch: Launch, root: int | None = None,
        peer: int | None = None, tag: int = 0,
    ) -> ShapedWork:
        """Every op's one path: count `tensors`, launch on the wrapped backend, record, shape.

        Args:
            root: group rank of a rooted op's root (its volume differs from the others').
            peer, tag: a send's or recv's other end (group rank; None: any source) and tag.
        """
        shaper = self._shaper
        device, inner = self._inner_for(tensors)
        nbytes = _nbytes(tensors)
        algorithm = default_algorithm(op, "gloo" if device == "cpu" else "nccl")
        volume = collective_volume(op, self.size(), nbytes, algorithm, is_root=self.rank() == root)
        # The same instant on both clocks: the shared one to agree on when the transfer
        # starts, the monotonic one to hold this rank for it (see ShapedWork).
        issued, issued_mono = shaper.now(), time.monotonic()
        row = None
        p2p = op in P2P_OPS
        peer_rank = self._ranks[peer] if p2p and peer is not None else -1
        if shaper.recorder is not None:
            inter = self._inter if peer_rank < 0 else self._shaper.topology.crosses_nodes(
                [self._global_rank, peer_rank])
            row = shaper.recorder.record_collective(
                op, self._ranks, inter, algorithm, nbytes, volume.bytes_sent,
                volume.bytes_received, issued - shaper.t0, peer=peer_rank,
            )  # fmt: skip
        with profiled(op, tensors, self._ranks):  # named in a torch.profiler trace, if any
            if p2p:
                return self._message(op, tensors, peer, tag, launch, row, issued, device, inner,
                                     issued_mono)
            arrival = sync = None
            if self._shaped and self.size() > 1:
                # Everybody's arrival time, so the modeled transfer starts when the last rank
                # shows up.
                arrival = torch.tensor([issued], dtype=torch.float64, device=device)
                sync = inner.allreduce([arrival], _max_options())
            works = _as_list(launch(inner))
        finish = ((lambda begin: self._model_finish(begin, volume, op, nbytes))
                  if self._shaped else None)
        return ShapedWork(shaper, works, finish, row, issued, arrival, sync,
                          issued_mono=issued_mono)

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
        launch = lambda g: g.send(tensors, dst, tag)
        return self._funnel("send", tensors, launch, peer=dst, tag=tag)

    def recv(self, tensors, src, tag=0):
        """Receive through the funnel."""
        launch = lambda g: g.recv(tensors, src, tag)
        return self._funnel("recv", tensors, launch, peer=src, tag=tag)

    def recv_anysource(self, tensors, tag=0):
        """Receive from any rank through the funnel."""
        launch = lambda g: g.recv_anysource(tensors, tag)
        return self._funnel("recv", tensors, launch, tag=tag)

    def barrier(self, opts=None):
        """Barrier through the funnel (no payload)."""
        return self._funnel("barrier", None, lambda g: g.barrier(*_a(opts)))
