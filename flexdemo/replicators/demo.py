"""DeMo: exchange the top-k DCT coefficients of a decoupled momentum, in one bucket per step."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._checks import float_dtype, in_unit_interval, int_at_least
from ..chunking import BlockLayout
from ..codec import decode_indices, encode_indices, index_dtype, topk_encode
from ..wire import CommStats, all_gather_bytes, pack, plan_bucket, unpack
from .base import Group, Replicator, copy_state
from .blocks import BlockGroup

Picked = list[tuple[torch.Tensor, torch.Tensor]]  # per block group: (int64 indices, values)


@dataclass
class Pending:
    """A launched all-gather: the buffer it fills and the handle to wait on."""

    gathered: torch.Tensor
    work: object | None


def _all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: Group) -> object:
    # torch 2.13 renamed all_gather_into_tensor; older releases only have the old name.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, inp, group=group, async_op=True)


class DeMoReplicator(Replicator):
    """DeMo (Peng et al.): each replica sends the top-k DCT coefficients of its momentum.

    One step, as in the paper, with batched kernels behind each name (:meth:`start` and
    :meth:`finish` split it around the collective so the wait can overlap other work)::

        decay_and_add     delta <- decay * delta + lr * grad     (kept in the DCT domain)
        dct_topk          the top-k coefficients of every chunk of DCT(delta)
        to_wire, remove_sent   round them for the wire; delta -= what leaves this rank
        all_gather        one bucketed all-gather of every replica's coefficients
        decode_mean       mean over the replicas that sent a coefficient, inverse DCT
    The optimizer's base then takes the sign step.

    Args:
        topk: coefficients kept per chunk.
        chunk: chunk side; each dimension uses its largest divisor not above it.
        decay: momentum decay in [0, 1).
        value_dtype: dtype of the values on the wire (float32 reproduces DeMo's figures).
        replicate_every / skip_every: the schedule (see :class:`Replicator`); other steps
            fold the gradient into the momentum and step on the local gradient.
    """

    name = "demo"
    owns_updates = True

    def __init__(self, topk: int = 32, chunk: int = 64, decay: float = 0.999,
                 value_dtype: torch.dtype = torch.bfloat16, replicate_every: int = 1,
                 skip_every: int | None = None) -> None:
        super().__init__(replicate_every, skip_every)
        int_at_least("topk", topk, 1)
        int_at_least("chunk", chunk, 1)
        in_unit_interval("decay", decay, closed_low=True, closed_high=False)
        float_dtype("value_dtype", value_dtype)
        self.topk, self.chunk, self.decay, self.value_dtype = topk, chunk, decay, value_dtype

    @classmethod
    def from_reference(cls, *, topk: int | None = None, chunk: int | None = None,
                       decay: float | None = None,
                       value_dtype: torch.dtype | None = None) -> Replicator:
        """Build from the reference call's ``compression_*`` knobs."""
        given = {"topk": topk, "chunk": chunk, "decay": decay, "value_dtype": value_dtype}
        return cls(**{k: v for k, v in given.items() if v is not None})

    def setup(self, params: list[torch.Tensor], group: Group, ranks: int) -> None:
        """Group the shards' blocks by shape and plan the bucket every step sends."""
        super().setup(params, group, ranks)
        self.shapes = [p.shape for p in params]
        self.empty_like = [(p.shape, p.dtype, p.device) for p in params]
        groups: dict[tuple[int, int, torch.dtype], BlockGroup] = {}
        for i, p in enumerate(params):
            if p.numel() == 0:
                continue  # FSDP2 can leave a rank with nothing of a small parameter.
            layout = BlockLayout.for_shape(p.shape, self.chunk)
            key = (layout.c1, layout.c2, p.dtype)
            if key not in groups:
                groups[key] = BlockGroup(layout.c1, layout.c2, self.topk, p.dtype, p.device)
            groups[key].add(i, layout)
        # A fixed order (same on every replica, whose shards have the same shapes) defines the
        # wire layout.
        self.groups = [groups[k] for k in sorted(groups, key=lambda k: (k[0], k[1], str(k[2])))]
        specs = []
        for g in self.groups:
            g.allocate()
            specs.append(((g.num_blocks, g.k), index_dtype(g.c1 * g.c2)))
            specs.append(((g.num_blocks, g.k), self.value_dtype))
        self.segments, self.bucket_bytes = plan_bucket(specs)

    # -- the paper's steps ---------------------------------------------------------------------
    def decay_and_add(self, grads: list[torch.Tensor], lrs: list[float]) -> None:
        """delta <- decay * delta + lr * grad (in the DCT domain)."""
        for g in self.groups:
            g.decay_and_add(grads, lrs, self.decay)

    def dct_topk(self) -> Picked:
        """The top-k coefficients per chunk of DCT(delta): (indices, values) per block group."""
        return [topk_encode(g.delta, g.k) for g in self.groups]

    def to_wire(self, picked: Picked) -> list[torch.Tensor]:
        """Compact indices and values rounded to ``value_dtype``, in bucket order."""
        wire = []
        for (idx, vals), g in zip(picked, self.groups, strict=True):
            wire += [encode_indices(idx, g.c1 * g.c2), vals.to(self.value_dtype)]
        return wire

    def remove_sent(self, picked: Picked, wire: list[torch.Tensor]) -> None:
        """delta -= what leaves this rank (only the rounded value left: the error stays)."""
        for n, ((idx, vals), g) in enumerate(zip(picked, self.groups, strict=True)):
            sent = wire[2 * n + 1]
            if sent.dtype == g.delta.dtype:
                g.delta.scatter_(1, idx, 0.0)
            else:
                g.delta.scatter_(1, idx, vals - sent.to(g.delta.dtype))

    def all_gather(self, wire: list[torch.Tensor], stats: CommStats) -> Pending:
        """Launch one all-gather of every replica's packed coefficients."""
        buf = pack(wire, self.segments, self.bucket_bytes)
        gathered = torch.empty(self.ranks * self.bucket_bytes, dtype=torch.uint8,
                               device=buf.device)
        work = _all_gather_flat(gathered, buf, self.group)
        sent = all_gather_bytes(self.bucket_bytes, self.ranks)
        stats.add(sent, sent)
        return Pending(gathered, work)

    def decode_mean(self, pending: Pending) -> list[torch.Tensor]:
        """Wait for the all-gather; mean of what the replicas sent per coefficient, inverse DCT."""
        if pending.work is not None:
            pending.work.wait()
        views = unpack(pending.gathered.view(self.ranks, self.bucket_bytes), self.segments)
        out = self._placeholders()
        for n, g in enumerate(self.groups):
            idx, vals = views[2 * n], views[2 * n + 1]
            # (ranks, blocks, k) -> (blocks, ranks * k): every block's contributions in a row.
            idx = decode_indices(idx).permute(1, 0, 2).reshape(g.num_blocks, self.ranks * g.k)
            vals = vals.permute(1, 0, 2).reshape(g.num_blocks, self.ranks * g.k)
            g.decode_mean_into(idx, vals, out, self.shapes)
        return out

    # -- the optimizer's hooks -----------------------------------------------------------------
    def start(self, grads: list[torch.Tensor], lrs: list[float],
              stats: CommStats) -> Pending | None:
        """Steps up to the all-gather; None when nothing crosses the group."""
        self.decay_and_add(grads, lrs)
        if self.ranks == 1 or not self.groups:
            return None
        picked = self.dct_topk()
        wire = self.to_wire(picked)
        self.remove_sent(picked, wire)
        return self.all_gather(wire, stats)

    def finish(self, pending: Pending | None) -> list[torch.Tensor]:
        """Steps after the all-gather: the update every replica applies."""
        if pending is None:
            return self._whole_momentum()
        return self.decode_mean(pending)

    def replicate(self, grads: list[torch.Tensor], lrs: list[float],
                  stats: CommStats) -> list[torch.Tensor]:
        """One replicating step: :meth:`start`, then :meth:`finish`."""
        return self.finish(self.start(grads, lrs, stats))

    def accumulate(self, grads: list[torch.Tensor], lrs: list[float]) -> list[torch.Tensor]:
        """A step off the schedule: fold the gradient into delta, step on the local gradient."""
        self.decay_and_add(grads, lrs)
        return grads

    def state_dict(self) -> dict:
        """The momentum of every block group."""
        return {"delta": [g.delta.clone() for g in self.groups]}

    def load_state_dict(self, state: dict) -> None:
        """Restore the momentum."""
        copy_state([g.delta for g in self.groups], state["delta"])

    def _whole_momentum(self) -> list[torch.Tensor]:
        # Nobody to exchange with: like the reference, the whole momentum becomes the update.
        out = self._placeholders()
        for g in self.groups:
            g.inverse_into(g.delta.clone(), out, self.shapes)
            g.delta.zero_()
        return out

    def _placeholders(self) -> list[torch.Tensor]:
        # Decoding replaces every non-empty one; empty shards keep a zero update.
        return [torch.zeros(s, dtype=d, device=dev) if math.prod(s) == 0
                else torch.empty(0, dtype=d, device=dev) for s, d, dev in self.empty_like]
