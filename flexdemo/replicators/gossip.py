"""Gossip (D-PSGD style): a local base step, then a weighted average with the graph neighbours."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..graphs import (
    averages_exactly,
    busiest_degree,
    check_graph,
    degree_of,
    graph_problem,
    peers,
    weights,
)
from ..knobs import GossipKnobs
from ..program import Op, Program, replicating_before, schedule_period
from ..wire import CommStats
from .base import Group, Replicator, mean_payload


def message_bytes(numels: list[int], itemsize: int = 4) -> int:
    """Bytes of one gossip message: every local shard (``numels`` elements of ``itemsize``
    bytes) in one flat buffer, to each neighbour, as :meth:`GossipReplicator._exchange` sends
    it and the planner (``experiments.plan``) plans with."""
    return sum(numels) * itemsize


RECEIVE_LIMIT = 64
"""The most peers a replica exchanges with at once. A round with more peers goes in windows
(:func:`exchange_windows`), so a replica holds at most this many received messages: 256
replicas on the complete graph would otherwise hold 255 each, 65,280 copies of the model."""


def exchange_windows(peers: list[int], nodes: int, node: int) -> list[list[int]]:
    """``node``'s ``peers`` in the windows it exchanges with one after another.

    One window when they are at most :data:`RECEIVE_LIMIT`; else by ring distance,
    ``RECEIVE_LIMIT // 2`` distances a window (at most ``RECEIVE_LIMIT`` peers). A pair's
    distance is the same from both ends, so both post their messages in the same window, and
    ranks that take windows in order cannot wait on each other in a cycle (on gloo, or on
    NCCL, whose grouped sends and receives run in order).
    """
    if len(peers) <= RECEIVE_LIMIT:
        return [sorted(peers)]
    windows: dict[int, list[int]] = {}
    for peer in sorted(peers):
        offset = (peer - node) % nodes
        windows.setdefault((min(offset, nodes - offset) - 1) // (RECEIVE_LIMIT // 2),
                           []).append(peer)
    return [windows[k] for k in sorted(windows)]


class GossipProgram(Program):
    """Gossip's exchange on one ``graph``: after the local step of each round, one message each
    way per neighbour (:func:`flexdemo.graphs.peers` of replica ``node`` at the round), sized by
    :func:`message_bytes`; a round that is the exact average
    (:func:`flexdemo.graphs.averages_exactly`) one all-reduce of the shard instead.

    ``measure`` (Ada's): a round index at which the spread is measured first, an all-reduce of
    ``entries`` sampled float64 entries and their sum of squares between the replicas, then an
    all-gather of two float64 inside the node (:class:`SampledSpread`).
    """

    ends_step = True  # the mixing after the exchange is a weighted sum, no optimizer step

    def __init__(self, replicates_on: Callable[[int], bool], graph: str,
                 shard_shapes: Sequence[tuple[int, ...]], replicas: int, node: int, period: int,
                 measure: Callable[[int], bool] | None = None, entries: int = 0) -> None:
        self.replicates_on, self.graph = replicates_on, graph
        self.replicas, self.node = replicas, node
        self.shard = sum(math.prod(s) for s in shard_shapes)
        self.measure, self.entries = measure, entries
        self.period = period
        self.exchanges_on = replicates_on
        # The flat copy of the shard it sends and an inbox per neighbour of the busiest replica
        # in flight at once: at most RECEIVE_LIMIT (its windows), and with several windows the
        # mixed copy besides; none on a graph that all-reduces (the complete one). Ada's probe:
        # its sampled entries' indices (int64).
        degree = busiest_degree(graph, replicas, 0) if replicas > 1 and graph_problem(
            graph, replicas) is None and not averages_exactly(graph, replicas) else 0
        self.state_bytes = ((1 + min(degree, RECEIVE_LIMIT) + (degree > RECEIVE_LIMIT))
                            * self.shard * 4 + 8 * entries)

    def _round(self, step: int) -> int | None:
        """The gossip round ``step`` runs (0-based), or None."""
        if self.replicas < 2 or not self.replicates_on(step):
            return None
        return replicating_before(self.replicates_on, step)

    def posts(self, step: int) -> list[Op]:
        """A send and a receive per neighbour of the round (none on an exact round)."""
        round_ = self._round(step)
        if round_ is None or averages_exactly(self.graph, self.replicas, round_):
            return []
        nbytes = message_bytes([self.shard])
        return [Op(op, nbytes, key=(step, peer, op), peer=peer)
                for peer in peers(self.graph, self.replicas, self.node, round_)
                for op in ("send", "recv")]

    def waits(self, step: int) -> list[Hashable]:
        """Every message of the round, in its step."""
        return [op.key for op in self.posts(step)]

    def blocking(self, step: int) -> list[Op]:
        """Ada's measurement on a measuring round, then an exact round's all-reduce."""
        round_ = self._round(step)
        if round_ is None:
            return []
        ops = []
        if self.measure is not None and self.measure(round_):
            ops += [Op("all_reduce", (self.entries + 1) * 8), Op("all_gather", 2 * 8, inter=False)]
        if averages_exactly(self.graph, self.replicas, round_):
            ops.append(Op(*mean_payload(self.shard)))
        return ops


class GossipReplicator(Replicator):
    """Decentralized data parallel: each node mixes its parameters with its neighbours' only.

    Every step (every ``replicate_every``-th) each replica first takes its own base step (AdamW,
    no sign, by default), then sends its local shards, in one flat buffer, to each neighbour of
    the communication ``graph`` (see :mod:`flexdemo.graphs`) and receives theirs, point to point
    (``dist.batch_isend_irecv``): one message each way per neighbour, nothing else, all in
    flight at once (in windows of peers when there are more than :data:`RECEIVE_LIMIT`). The new
    shard is row i of the mixing matrix applied to the replicas: ``w_ii x_i + sum_j w_ij x_j``.
    A round that is the exact average (:func:`flexdemo.graphs.averages_exactly`: the complete
    graph) is one all-reduce of the flat buffer instead, the same mean for 2(n-1)/n of the
    bytes of n - 1 messages each way.
    Under FSDP2 each rank gossips its shard with the same-index ranks of the neighbour nodes,
    which is what the replication group (one rank per node) connects.
    Knobs: :class:`flexdemo.knobs.GossipKnobs` (``graph``, ``replicate_every``).
    """

    name = "gossip"
    knobs_type = GossipKnobs
    default_base = "adamw"
    default_sign = False

    def __init__(self, knobs: GossipKnobs | None = None, **given: Any) -> None:
        super().__init__(knobs, **given)
        self.rounds = 0  # gossip rounds so far: selects a time-varying graph's peer
        self.node = 0

    @classmethod
    def program(cls, knobs: GossipKnobs, shard_shapes: Sequence[tuple[int, ...]],
                replicas: int, *, node: int = 0, graph: str | None = None) -> GossipProgram:
        """Replica ``node``'s messages on its graph (:class:`GossipProgram`)."""
        return GossipProgram(cls(knobs).replicates_on, knobs.graph, shard_shapes, replicas, node,
                             schedule_period(knobs.replicate_every, None))

    def setup(self, params: list[torch.Tensor], group: Group, ranks: int) -> None:
        """Check the graph fits the number of replicas and find this replica's node index."""
        super().setup(params, group, ranks)
        if ranks > 1:
            check_graph(self.graph, ranks)
            # The node's index in the replication group names it in the graph.
            self.node = dist.get_rank(group)

    def degree(self) -> int:
        """Neighbours this replica exchanges messages with in the next gossip round (0 on a
        round that all-reduces)."""
        if self.ranks == 1 or averages_exactly(self.graph, self.ranks, self.rounds):
            return 0
        return degree_of(self.graph, self.ranks, self.node, self.rounds)

    def replicate(self, grads: list[torch.Tensor], lrs: list[float],
                  stats: CommStats) -> list[torch.Tensor]:
        """The local gradient: the base step is local, the mixing follows it."""
        return grads

    def after_update(self, params: list[torch.Tensor], stats: CommStats) -> None:
        """Exchange shards with this round's neighbours and replace them by the weighted mean."""
        if self.ranks == 1:
            return
        exact = averages_exactly(self.graph, self.ranks, self.rounds)
        own, theirs = weights(self.graph, self.ranks, self.node, self.rounds)
        self.rounds += 1
        if not theirs or not params:
            return
        flat = torch.cat([p.reshape(-1) for p in params])
        if exact:
            self._copy_back(self._all_reduce_mean_flat(flat, stats), params)
            return
        windows = exchange_windows(list(theirs), self.ranks, self.node)
        mixed = None
        for window in windows:
            inbox = self._exchange(flat, window, stats)
            if mixed is None:
                # One window: its sends are done, so mix into ``flat`` itself; more: ``flat``
                # is still to be sent to the next windows' peers, so mix into a copy.
                mixed = flat.mul_(own) if len(windows) == 1 else flat * own
            for peer in window:  # popped: a window's messages are freed as they are mixed in
                mixed.add_(inbox.pop(peer), alpha=theirs[peer])
        self._copy_back(mixed, params)

    @staticmethod
    def _copy_back(flat: torch.Tensor, params: list[torch.Tensor]) -> None:
        """Write the mixed flat buffer back into the shards it was cut from."""
        offset = 0
        for p in params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def _exchange(self, flat: torch.Tensor, peers: list[int],
                  stats: CommStats) -> dict[int, torch.Tensor]:
        """Send ``flat`` to every peer and receive each peer's, all in flight at once."""
        inbox = {peer: torch.empty_like(flat) for peer in peers}
        ops = []
        for peer in peers:
            # Posting every send and receive before waiting on any cannot deadlock.
            ops.append(dist.P2POp(dist.isend, flat, group=self.group, group_peer=peer))
            ops.append(dist.P2POp(dist.irecv, inbox[peer], group=self.group, group_peer=peer))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        nbytes = message_bytes([flat.numel()], flat.element_size())
        for _ in peers:  # one send and one receive per peer, as netsim records them
            stats.add(nbytes, 0)
            stats.add(0, nbytes)
        return inbox

    def state_dict(self) -> dict:
        """The gossip round counter (a time-varying graph resumes at its place)."""
        return {"rounds": self.rounds}

    def load_state_dict(self, state: dict) -> None:
        """Restore the round counter."""
        self.rounds = int(state["rounds"])
