"""Top-k with error feedback (Deep Gradient Compression): each shard's largest entries, gathered."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch

from ..codec import topk_indices
from ..formats import make_format
from ..knobs import TopKKnobs
from ..program import Periodic
from ..wire import CommStats, Segment, all_gather_bytes, pack, plan_bucket, unpack
from .base import Group, Replicator, all_gather_flat, copy_state


def topk_count(density: float, numel: int) -> int:
    """Entries sent of a shard of ``numel``: ceil(density * numel), at least 1 (0 for none).

    Taken on the density as written in decimal, so that 0.07 of 100 entries is 7 (the float
    product is 7.000000000000001).
    """
    if numel == 0:
        return 0
    return max(1, math.ceil(Fraction(repr(float(density))) * numel))


@dataclass(frozen=True)
class TopKPlan:
    """What one rank's top-k bucket holds and how many bytes it is.

    The one sizing of the exchange: :meth:`TopKReplicator.setup` packs its bucket from it, and a
    planner sizes the same all-gather from shard shapes alone with it.
    """

    members: tuple[tuple[int, int, int], ...]
    """(shard index, numel, k) of every non-empty shard, in shard order."""
    spans: tuple[tuple[int, int], ...]
    """Per member: its first segment in the bucket and how many segments it has."""
    segments: tuple[Segment, ...]
    """The bucket's segments (indices, values, a quantized format's scale), member by member."""
    bucket_bytes: int
    """Bytes of one rank's bucket: the all-gather's input (its output is ranks x this)."""

    op = "all_gather"

    def step_bytes(self, ranks: int) -> int:
        """Bytes one rank sends (and receives) per step among ``ranks`` replicas."""
        return all_gather_bytes(self.bucket_bytes, ranks)


def plan_topk(shapes: list[tuple[int, ...]], knobs: TopKKnobs) -> TopKPlan:
    """Top-k's bucket over shards of these shapes: k = ceil(density * numel) entries of each, in
    ``value_format`` (its values, indices and scale). Needs no tensors and no process group."""
    fmt = make_format(knobs.value_format)
    members, spans, specs = [], [], []
    for i, shape in enumerate(shapes):
        numel = math.prod(shape)
        if numel == 0:
            continue  # FSDP2 can leave a rank with nothing of a small parameter.
        k = topk_count(knobs.density, numel)
        member_specs = fmt.specs(1, k, numel)
        members.append((i, numel, k))
        spans.append((len(specs), len(member_specs)))
        specs += member_specs
    segments, bucket_bytes = plan_bucket(specs)
    return TopKPlan(tuple(members), tuple(spans), tuple(segments), bucket_bytes)


class TopKReplicator(Replicator):
    """Deep Gradient Compression (Lin et al.): top-k of an accumulated velocity, error feedback.

    One step, per shard (flattened), as the paper's momentum correction::

        accumulate      u <- decay * u + grad;  v <- v + u
        pick            the k = ceil(density * numel) entries of v largest in magnitude
        to_wire         their values in ``value_format`` and their indices
        mask            v -= what receivers read there (0 unless the format rounds);
                        u <- 0 there (momentum factor masking)
        all_gather      every replica's bucket, one all-gather over the replicas
        average         each replica's entries scattered and added, divided by the replicas

    The base step is SGD (sign base, no sign): p <- p - lr * average, as the paper's
    w <- w - lr * G, the momentum being inside the velocity already. Whatever is not sent stays
    in v and is sent later (Stich et al.'s memory). Knobs: :class:`flexdemo.knobs.TopKKnobs`.
    DGC's warm-up of the density and its local gradient clipping are left out.
    """

    name = "topk"
    knobs_type = TopKKnobs
    default_base = "sign"
    default_sign = False
    owns_updates = True

    def __init__(self, knobs: TopKKnobs | None = None, **given: Any) -> None:
        super().__init__(knobs, **given)
        self.format = make_format(self.value_format)

    @classmethod
    def program(cls, knobs: TopKKnobs, shard_shapes: Sequence[tuple[int, ...]],
                replicas: int, *, node: int = 0, graph: str | None = None) -> Periodic:
        """One all-gather of the bucket every step (:func:`plan_topk`)."""
        plan = plan_topk([tuple(s) for s in shard_shapes], knobs)
        # The momentum u and velocity v of every shard (fp32), the bucket and what it gathers.
        shard = sum(numel for _, numel, _ in plan.members)
        state = 2 * shard * 4 + (1 + replicas) * plan.bucket_bytes
        return Periodic(lambda _step: True, lambda _step: [(plan.op, plan.bucket_bytes)],
                        state_bytes=state)

    def setup(self, params: list[torch.Tensor], group: Group, ranks: int) -> None:
        """Plan the bucket; allocate each shard's momentum u and velocity v."""
        super().setup(params, group, ranks)
        self.plan = plan_topk([tuple(p.shape) for p in params], self.knobs)
        self.like = [(p.shape, p.dtype, p.device) for p in params]
        self.u = [torch.zeros(n, dtype=params[i].dtype, device=params[i].device)
                  for i, n, _ in self.plan.members]
        self.v = [torch.zeros_like(u) for u in self.u]

    # -- the paper's steps ---------------------------------------------------------------------
    def accumulate_velocity(self, grads: list[torch.Tensor]) -> None:
        """u <- decay * u + grad; v <- v + u (momentum correction)."""
        for (i, _, _), u, v in zip(self.plan.members, self.u, self.v, strict=True):
            u.mul_(self.decay).add_(grads[i].reshape(-1))
            v.add_(u)

    def pick_and_mask(self) -> list[torch.Tensor]:
        """Every shard's top-k in the wire format; v keeps what receivers will not read, and u
        is zeroed where v was sent. The wire tensors in bucket order."""
        wire = []
        for (_, numel, k), u, v in zip(self.plan.members, self.u, self.v, strict=True):
            idx = topk_indices(v.view(1, -1), k)
            vals = v.view(1, -1).gather(1, idx)
            segments, read = self.format.encode(idx, vals, numel)
            left = 0.0 if read is None else vals - read.to(v.dtype)
            v.view(1, -1).scatter_(1, idx, left)
            u.view(1, -1).scatter_(1, idx, 0.0)
            wire += segments
        return wire

    def average(self, gathered: torch.Tensor, ranks: int) -> list[torch.Tensor]:
        """Each shard's mean over ``ranks`` replicas' buckets (an entry not sent counts as 0)."""
        views = unpack(gathered.view(ranks, self.plan.bucket_bytes), list(self.plan.segments))
        out = [torch.zeros(s, dtype=d, device=dev) for s, d, dev in self.like]
        for (i, numel, k), (first, count) in zip(self.plan.members, self.plan.spans, strict=True):
            dtype = self.like[i][1]
            idx, vals = self.format.decode(views[first:first + count], 1, k, numel, dtype)
            dense = out[i].view(-1)
            dense.scatter_add_(0, idx.reshape(-1), vals.reshape(-1).to(dtype))
            dense.div_(ranks)
        return out

    # -- the optimizer's hooks -----------------------------------------------------------------
    def replicate(self, grads: list[torch.Tensor], lrs: list[float],
                  stats: CommStats) -> list[torch.Tensor]:
        """The replicas' mean of their top-k velocities: the update SGD applies."""
        self.accumulate_velocity(grads)
        buf = pack(self.pick_and_mask(), list(self.plan.segments), self.plan.bucket_bytes)
        if self.ranks == 1:
            return self.average(buf, 1)  # nothing crosses a network
        gathered = torch.empty(self.ranks * self.plan.bucket_bytes, dtype=torch.uint8,
                               device=buf.device)
        all_gather_flat(gathered, buf, self.group).wait()
        sent = self.plan.step_bytes(self.ranks)
        stats.add(sent, sent)
        return self.average(gathered, self.ranks)

    def state_dict(self) -> dict:
        """Every shard's momentum and velocity."""
        return {"u": [u.clone() for u in self.u], "v": [v.clone() for v in self.v]}

    def load_state_dict(self, state: dict) -> None:
        """Restore the momenta and velocities."""
        copy_state(self.u + self.v, state["u"] + state["v"])
