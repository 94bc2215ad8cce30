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

import math
from collections.abc import Callable

import torch

from .._checks import check, int_at_least
from ..graphs import graph_ladder
from ..wire import CommStats
from .base import Group
from .gossip import GossipReplicator
from .sampled_spread import SampledSpread

# From lm-tiny, 4 nodes x 1, constant lr 1e-3 (benchmarks/bench_ada.py spread, README "Ada"):
# before mixing the complete graph reads 2.4e-3 early to 4.3e-3 late, ring 3.6e-3 to 7.3e-3.
# The band is a factor-2 budget around the exact average's ~4e-3: above 1.5x of it, buy edges;
# below ~0.75x, the replicas agree well enough to save some. The spread scales with the lr
# (a local step moves each replica by about lr per entry), so other settings re-tune both.
DEFAULT_EVERY = 10
DEFAULT_HIGH = 6e-3
DEFAULT_LOW = 3e-3
SAMPLE = 4096


def check_thresholds(high: object, low: object) -> None:
    """Raise ValueError (one sentence) unless ``0 <= low < high`` are finite numbers."""
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                  for v in (high, low))
    check(numbers and 0 <= low < high,
          f"ada_low={low!r} and ada_high={high!r} must be finite numbers with "
          "0 <= ada_low < ada_high.")


class AdaRule:
    """Ada's decision alone: the rung to gossip on at each round, from measured spreads.

    Pure: no process group. :meth:`tick` is called once per gossip round with the round's
    0-based index and a callable that measures the spread; it calls it only on measuring rounds
    (every ``every``-th, never round 0) and moves at most one rung then.
    """

    def __init__(self, rungs: int, every: int = DEFAULT_EVERY, high: float = DEFAULT_HIGH,
                 low: float = DEFAULT_LOW) -> None:
        int_at_least("rungs", rungs, 1)
        int_at_least("ada_every", every, 1)
        check_thresholds(high, low)
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

    Args:
        ada_every: gossip rounds between measurements (K); the graph changes at most this often.
        ada_high: relative consensus distance above which the graph moves one rung denser.
        ada_low: distance below which it moves one rung sparser (``0 <= ada_low < ada_high``).
        seed: draws the sampled entries (the same on every replica).
        node_group: the ranks of this rank's node (FSDP2's shard group), over which the shards'
            spreads are summed; None when every node is one rank.
        replicate_every: gossip only on steps divisible by this.
        sample: entries of the local shard the spread is measured on.

    ``graph`` is the graph of the latest round (None before setup and on one node),
    ``ladder`` the rungs, ``rule`` the :class:`AdaRule` with the ``rung`` and ``last_spread``.
    """

    name = "ada"

    def __init__(self, ada_every: int = DEFAULT_EVERY, ada_high: float = DEFAULT_HIGH,
                 ada_low: float = DEFAULT_LOW, seed: int = 0, node_group: Group = None,
                 replicate_every: int = 1, sample: int = SAMPLE) -> None:
        int_at_least("ada_every", ada_every, 1)
        check_thresholds(ada_high, ada_low)
        int_at_least("sample", sample, 1)
        super().__init__(graph="complete", replicate_every=replicate_every)
        self.every, self.high, self.low = ada_every, ada_high, ada_low
        self.seed, self.node_group, self.sample = seed, node_group, sample
        self.graph: str | None = None  # known once setup has the node count
        self.ladder: list[str] = []
        self.rule: AdaRule | None = None

    def setup(self, params: list[torch.Tensor], group: Group, ranks: int) -> None:
        """Build the ladder for ``ranks`` nodes, start on its top and draw the sample."""
        self.ladder = graph_ladder(ranks)
        if self.ladder:
            self.rule = AdaRule(len(self.ladder), self.every, self.high, self.low)
            self.graph = self.ladder[self.rule.rung]
        super().setup(params, group, ranks)
        self.probe = SampledSpread(params, self.sample, self.seed)

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
