"""A cheap estimate of how far the replicas have drifted apart, for Ada's graph schedule."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .._checks import int_at_least
from ..devices import side_channel_device
from ..wire import CommStats, all_reduce_bytes
from .base import Group


class SampledSpread:
    """Relative consensus distance ``sqrt(mean_i ||x_i - m||^2) / ||m||`` on sampled entries.

    The same metric as :func:`flexdemo.consensus.replica_spread`, but on ``sample`` entries of
    the local flat shard, drawn once with ``seed`` (every replica of a replication group holds
    a shard of the same length, so all draw the same indices). One measurement is one all-reduce
    of ``k + 1`` float64 numbers over the replication group (the sampled entries and their sum
    of squares) and, when a node has several ranks, one all-gather of two float64 numbers over
    the node's ranks. Shards smaller than ``sample`` are used whole.
    """

    def __init__(self, params: list[torch.Tensor], sample: int = 4096, seed: int = 0) -> None:
        int_at_least("sample", sample, 1)
        sizes = [p.numel() for p in params]
        total = sum(sizes)
        if total <= sample:
            picks = torch.arange(total)
        else:
            gen = torch.Generator().manual_seed(seed)
            # Drawn with replacement (no permutation of a large shard), then de-duplicated.
            picks = torch.unique(torch.randint(total, (sample,), generator=gen))
        self.index: list[torch.Tensor] = []
        start = 0
        for p, size in zip(params, sizes, strict=True):
            inside = picks[(picks >= start) & (picks < start + size)] - start
            self.index.append(inside.to(p.device))
            start += size
        self.entries = int(picks.numel())

    def values(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The sampled entries of ``params`` (the local shards), as one float64 vector."""
        parts = [p.reshape(-1)[i].double() for p, i in zip(params, self.index, strict=True)]
        device = params[0].device if params else "cpu"
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=device)

    @torch.no_grad()
    def measure(self, params: list[torch.Tensor], group: Group, replicas: int,
                node_group: Group, stats: CommStats) -> float:
        """The relative consensus distance; collective over ``group`` and ``node_group``.

        Every rank of the world calls it at the same round. The all-reduce over ``group`` is
        recorded in ``stats`` (it crosses nodes); the all-gather inside the node is not, as
        the replicator's counter covers the replication group only (netsim counts it as
        intra-node traffic).
        """
        x = self.values(params)
        buf = torch.cat([x, x.square().sum().reshape(1)])
        # k + 1 numbers: moved (only when the group has no backend where they are) is cheap.
        buf = buf.to(side_channel_device(group, buf.device))
        dist.all_reduce(buf, group=group)
        n = all_reduce_bytes(buf.numel() * buf.element_size(), replicas)
        stats.add(n, n, 1)
        mean = buf[:-1] / replicas
        # sum_i ||x_i||^2 - n ||m||^2 = sum_i ||x_i - m||^2. One pass suffices in float64: the
        # cancellation leaves ~1e-16 of ||x||^2, far below the spreads Ada tells apart (>1e-6).
        norm2 = replicas * mean.square().sum()
        pair = torch.stack([(buf[-1] - norm2).clamp(min=0.0), norm2])
        if node_group is not None and dist.get_world_size(node_group) > 1:
            pair = pair.to(side_channel_device(node_group, pair.device))
            parts = [torch.empty_like(pair) for _ in range(dist.get_world_size(node_group))]
            dist.all_gather(parts, pair, group=node_group)
            # Summed in local-rank order on every rank: each node adds the same numbers in the
            # same order, so all ranks of the world hold the same bits and take one decision.
            pair = parts[0].clone()
            for part in parts[1:]:
                pair += part
        spread, total2 = pair.tolist()
        return math.sqrt(spread / total2) if total2 > 0 else 0.0
