"""The two ends of the scale: average everything (full) or nothing (none)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..knobs import Knobs
from ..program import Program
from ..wire import CommStats
from .base import Replicator


class FullReplicator(Replicator):
    """Average the full shard gradient over the replicas with one bucketed all-reduce."""

    name = "full"

    def replicate(self, grads: list[torch.Tensor], lrs: list[float],
                  stats: CommStats) -> list[torch.Tensor]:
        """The replicas' mean gradient."""
        return self._all_reduce_mean(grads, stats)


class NoReplicator(Replicator):
    """Keep every replica on its own gradients: no inter-node traffic."""

    name = "none"
    knobs_type = Knobs  # nothing is sent, so no schedule either

    @classmethod
    def program(cls, knobs: Knobs, shard_shapes: Sequence[tuple[int, ...]], replicas: int, *,
                node: int = 0, graph: str | None = None) -> Program:
        """Nothing crosses nodes; no state."""
        return Program()

    def replicate(self, grads: list[torch.Tensor], lrs: list[float],
                  stats: CommStats) -> list[torch.Tensor]:
        """The local gradient, unchanged."""
        return grads
