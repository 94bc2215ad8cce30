"""How far the replicas have drifted apart: a measurement, taken on the local shards."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from .devices import side_channel_device
from .optimizer import local_tensor


@torch.no_grad()
def replica_spread(params: Iterable[torch.Tensor], replica_group: dist.ProcessGroup | None,
                   world_group: dist.ProcessGroup | None = None) -> tuple[float, float]:
    """``(replica_variance, consensus_distance)`` of the replicas over ``replica_group``.

    With x_i the parameters of replica i (n replicas, N entries) and m their mean:
    ``replica_variance`` = mean over the N entries of the (population) variance across the
    replicas; ``consensus_distance`` = sqrt(mean_i ||x_i - m||^2) / ||m||. Every rank of the
    world calls it: the mean is one all-reduce of the local shards (float64) over
    ``replica_group`` (one rank per node, same shard index), the three totals one all-reduce of
    scalars over ``world_group`` (default: the world), where every node's shards meet.
    """
    shards = [local_tensor(p.detach()).reshape(-1).double() for p in params]
    flat = torch.cat(shards) if shards else torch.zeros(0, dtype=torch.float64)
    # The shards stay where they are when the group has a backend there (a GPU's on NCCL).
    flat = flat.to(side_channel_device(replica_group, flat.device))
    mean = flat.clone()
    replicas = dist.get_world_size(replica_group)
    # Ranks of one replica group hold the same shard index, so they skip together.
    if replicas > 1 and flat.numel():
        dist.all_reduce(mean, group=replica_group)
        mean.div_(replicas)
    # Two passes (mean, then deviations) keep identical replicas at exactly ~0, where
    # E[x^2] - E[x]^2 would leave cancellation noise of the size of x^2. The totals stay
    # tensors (no host round trip per number) until they have crossed the world group.
    count = torch.tensor(float(flat.numel()), dtype=torch.float64, device=mean.device)
    totals = torch.stack([(flat - mean).square().sum(), mean.square().sum(), count])
    totals = totals.to(side_channel_device(world_group, totals.device))
    dist.all_reduce(totals, group=world_group)
    spread, norm2, entries = totals.tolist()
    # Over the world: spread = sum_i ||x_i - m||^2, norm2 = n ||m||^2, entries = n N.
    variance = spread / entries if entries else 0.0
    distance = math.sqrt(spread / norm2) if norm2 > 0 else 0.0
    return variance, distance
