"""Ada: gossip on a graph that grows denser or sparser with the measured replica spread.

The DBench paper (Ada) reports that decentralized training's accuracy follows the number of
connections in the graph and is sensitive to how far the replicas drift apart, and that adapting
the graph during training matches centralized accuracy. Its exact rule is not public; ours:

- **Ladder.** The graphs that fit the node count, sparsest to densest by messages per node and
  round (:func:`flexdemo.graphs.graph_ladder`; on 8 nodes: one-peer-exponential, ring, torus,
  exponential, complete). Graphs that cost the same are one rung.
- **Start dense.** Before the first measurement nothing is known about the spread, and the
  paper finds accuracy sensitive to it, so Ada starts on the densest rung (on ``complete``, the
  exact average) and earns its way down.
- **Measure every K rounds.** Every ``ada_every`` gossip rounds, after the local step and
  before mixing, Ada measures the relative consensus distance
  ``d = sqrt(mean_i ||x_i - m||^2) / ||m||`` (scale-free: the same threshold serves small and
  large weights) on a fixed, seeded sample of 4096 entries of each rank's shard
  (:class:`SampledSpread`). Before mixing, ``d`` is what this round's mixing has to remove:
  the drift of the local steps plus what earlier rounds left, so a sparse graph that keeps up
  reads low and one that falls behind reads high. (After mixing it would read 0 on the
  complete graph, which would send Ada down a rung every time it gets there.)
- **Move one rung, with hysteresis.** ``d > ada_high``: one rung denser; ``d < ada_low``: one
  rung sparser; in between: stay. The band keeps Ada from flapping between two rungs whose
  spreads straddle one threshold; one rung per decision and a decision every K rounds let the
  spread settle on the new graph (a few rounds of mixing) before the next look. The ends clamp.

So Ada spends bytes where the replicas disagree: dense while the drift is large (after the
learning rate rises), sparse once it is small (as a cosine schedule decays). The ladder is
ordered by cost, not by measured spread: on a power-of-two node count one-peer-exponential
averages exactly every log2(n) rounds and, on lm-tiny with 4 nodes, reads a lower spread than
the costlier ring, which Ada then only passes through.

Every rank decides alike. All replicas of a replication group hold the same all-reduced sums
(an all-reduce hands every member the same result, which data parallel training relies on to
keep replicas identical), and the ranks of a node, which hold different shards, add the partial
spreads of all shards in one fixed order after an all-gather inside the node: every rank of the
world computes the same ``d`` bit for bit, so all shards of a node gossip on the same graph.

The measurement is part of the algorithm, so its all-reduce (4096 + 1 float64 numbers over the
replication group, every K rounds) is recorded in the step's ``CommStats`` like the gossip
messages, and netsim records it in the training phase; the two-number all-gather inside a node
is intra-node traffic (netsim's ``intra_bytes``), outside the replication-group counter.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch

from .._checks import check, int_at_least
from ..graphs import graph_ladder
from ..knobs import AdaKnobs, check_ada_thresholds
from ..program import schedule_period
from ..wire import CommStats
from .base import Group
from .gossip import GossipProgram, GossipReplicator
from .sampled_spread import SampledSpread


class AdaRule:
    """Ada's decision alone: the rung to gossip on at each round, from measured spreads.

    Pure: no process group. :meth:`tick` is called once per gossip round with the round's
    0-based index and a callable that measures the spread; it calls it only on measuring rounds
    (every ``every``-th, never round 0) and moves at most one rung then.
    """

    def __init__(self, rungs: int, every: int = AdaKnobs.ada_every,
                 high: float = AdaKnobs.ada_high, low: float = AdaKnobs.ada_low) -> None:
        int_at_least("rungs", rungs, 1)
        int_at_least("ada_every", every, 1)
        check_ada_thresholds(high, low)
        self.rungs, self.every, self.high, self.low = rungs, every, high, low
        self.rung = rungs - 1  # densest first: replicas drift apart fastest early
        self.last_spread = math.nan

    def measures_at(self, round_index: int) -> bool:
        """Whether the round ``round_index`` (0-based) measures the spread."""
        return round_index > 0 and round_index % self.every == 0

    def decide(self, spread: float) -> int:
        """Move one rung for ``spread`` (denser above high, sparser below low); the new rung."""
        self.last_spread = spread
        if spread > self.high:
            self.rung = min(self.rung + 1, self.rungs - 1)
        elif spread < self.low:
            self.rung = max(self.rung - 1, 0)
        return self.rung  # NaN compares false both ways: a run gone bad stays where it is

    def tick(self, round_index: int, measure: Callable[[], float]) -> int:
        """The rung of round ``round_index``, measuring (and deciding) first when it is due."""
        if self.measures_at(round_index):
            self.decide(measure())
        return self.rung


class AdaReplicator(GossipReplicator):
    """Gossip whose graph follows the measured replica spread (the rule: module docstring).

    Knobs: :class:`flexdemo.knobs.AdaKnobs` (``ada_every``, ``ada_high``, ``ada_low``,
    ``ada_sample``, ``seed``, ``replicate_every``). ``node_group`` is the ranks of this rank's
    node (FSDP2's shard group), over which the shards' spreads are summed; None when every node
    is one rank. ``graph`` is the graph of the latest round (None before setup and on one
    node), ``ladder`` the rungs, ``rule`` the :class:`AdaRule` with ``rung`` and ``last_spread``.
    """

    name = "ada"
    knobs_type = AdaKnobs
    uses_node_group = True

    def __init__(self, knobs: AdaKnobs | None = None, *, node_group: Group = None,
                 **given: object) -> None:
        super().__init__(knobs, **given)
        self.node_group = node_group
        self.graph = None  # known once setup has the node count
        self.ladder: list[str] = []
        self.rule: AdaRule | None = None

    @classmethod
    def program(cls, knobs: AdaKnobs, shard_shapes: Sequence[tuple[int, ...]], replicas: int,
                *, node: int = 0, graph: str | None = None) -> GossipProgram:
        """Gossip on ``graph`` (None: the ladder's densest, where Ada starts) with Ada's
        measurement every ``ada_every`` rounds; the period holds a whole number of them, taken
        from the second (round 0 never measures)."""
        if graph is None:
            ladder = graph_ladder(replicas)
            graph = ladder[-1] if ladder else "complete"
        rule = AdaRule(1, knobs.ada_every, knobs.ada_high, knobs.ada_low)
        period = schedule_period(knobs.replicate_every, None) * knobs.ada_every
        program = GossipProgram(cls(knobs).replicates_on, graph, shard_shapes, replicas, node,
                                period, rule.measures_at,
                                sampled_entries(tuple(map(tuple, shard_shapes)),
                                                knobs.ada_sample, knobs.seed))
        program.steady_from = period + 1
        return program

    def setup(self, params: list[torch.Tensor], group: Group, ranks: int) -> None:
        """Build the ladder for ``ranks`` nodes, start on its top and draw the sample."""
        self.ladder = graph_ladder(ranks)
        if self.ladder:
            self.rule = AdaRule(len(self.ladder), self.ada_every, self.ada_high, self.ada_low)
            self.graph = self.ladder[self.rule.rung]
        super().setup(params, group, ranks)
        self.probe = SampledSpread(params, self.ada_sample, self.seed)

    def after_update(self, params: list[torch.Tensor], stats: CommStats) -> None:
        """Measure and move on a due round, then gossip on the round's graph."""
        if self.rule is not None and self.ranks > 1:
            measure = lambda: self.probe.measure(params, self.group, self.ranks,
                                                 self.node_group, stats)
            self.graph = self.ladder[self.rule.tick(self.rounds, measure)]
        super().after_update(params, stats)

    def state_dict(self) -> dict:
        """The round counter and the rung."""
        return {"rounds": self.rounds, "rung": None if self.rule is None else self.rule.rung}

    def load_state_dict(self, state: dict) -> None:
        """Restore the round counter and the rung (saved on the same number of nodes)."""
        super().load_state_dict(state)
        rung = state["rung"]
        if self.rule is None:
            check(rung is None, f"rung={rung!r} was saved with a graph ladder, but this "
                                "replicator has none (one node); load it on the same nodes.")
            return
        check(isinstance(rung, int) and 0 <= rung < len(self.ladder),
              f"rung={rung!r} is outside this ladder of {len(self.ladder)} graphs "
              f"({', '.join(self.ladder)}); load a state saved on the same number of nodes.")
        self.rule.rung = rung
        self.graph = self.ladder[rung]


@functools.lru_cache(maxsize=256)
def sampled_entries(shapes: tuple[tuple[int, ...], ...], sample: int, seed: int) -> int:
    """Entries Ada's spread is measured on for shards of ``shapes``: the count
    :class:`SampledSpread` itself draws (its seeded picks, de-duplicated), on meta tensors."""
    params = [torch.empty(shape, device="meta") for shape in shapes]
    return SampledSpread(params, sample, seed).entries
