"""DeMo's momentum in parameter space, transformed operation for operation as the package does.

The reference arithmetic (``DeMoKnobs.arithmetic="reference"``): what DeToNATION 0.5.2's
``DeMoReplicator`` computes, in its order, so that FlexDeMo's update equals the package's bit
for bit. Sign-SGD turns any one-ulp difference into a whole step where a decoded update is near
zero, or into a different coefficient where two tie for the k-th place, and the trajectories
part within a few steps; so the differences below are all kept, not only the large ones.

Against :class:`~flexdemo.replicators.blocks.BlockGroup` (the fast arithmetic) it keeps the
momentum in parameter space and removes what was sent by subtracting its inverse transform
(the fast one keeps it in the DCT domain and zeroes the sent coefficients); transforms each
shard on its own with ``torch.einsum`` over its (row block, row, column block, column) view and
the FFT-built bases of :func:`flexdemo.dct.fft_dct_bases` (the fast one: two large matrix
products per block group with correctly rounded cosines); picks the top-k with one
``torch.topk`` over a whole block (the fast one in two stages, which can break an exact tie the
other way); and averages with ``scatter_reduce(mean)`` (a sum, then one division).
"""

from __future__ import annotations

import torch

from ..chunking import BlockLayout
from ..codec import clamp_topk
from ..dct import fft_dct_bases


class ReferenceBlockGroup:
    """The parameter-space momentum of several shards cut into same-shaped (c1 x c2) blocks.

    The interface of :class:`~flexdemo.replicators.blocks.BlockGroup`; ``delta`` holds every
    member's momentum in its own layout, laid end to end.
    """

    def __init__(self, c1: int, c2: int, topk: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.c1, self.c2 = c1, c2
        self.k = clamp_topk(topk, c1 * c2)
        # (shard index, its layout, first block, end block, 1-D) of each member.
        self.members: list[tuple[int, BlockLayout, int, int, bool]] = []
        self.num_blocks = 0
        self.dtype, self.device = dtype, device
        self.delta = torch.empty(0)

    def add(self, index: int, layout: BlockLayout, one_dim: bool = False) -> None:
        """Make shard ``index`` (cut as ``layout``) a member; ``one_dim``: a 1-D tensor (or a
        flat chunking's shard), which the package transforms along one axis only."""
        start = self.num_blocks
        self.num_blocks += layout.num_blocks
        self.members.append((index, layout, start, self.num_blocks, one_dim))

    def allocate(self) -> None:
        """Create delta (call once, after the last add)."""
        sizes = [layout.rows * layout.cols for _, layout, _, _, _ in self.members]
        self.delta = torch.zeros(sum(sizes), dtype=self.dtype, device=self.device)
        self.deltas = [m.view(layout.rows, layout.cols) for m, (_, layout, _, _, _)
                       in zip(self.delta.split(sizes), self.members, strict=True)]
        forward, inverse = {}, {}
        for side in {self.c1, self.c2}:
            forward[side], inverse[side] = fft_dct_bases(side, self.dtype, self.device)
        self.forward, self.inverse = forward, inverse

    # -- the package's transform, one member at a time ----------------------------------------
    def _encode(self, x: torch.Tensor, layout: BlockLayout, one_dim: bool) -> torch.Tensor:
        """DCT coefficients of a (rows, cols) member: (blocks, c1*c2) rows in block order."""
        c1, c2 = layout.c1, layout.c2
        if one_dim:
            return torch.einsum("bi,ij->bj", x.reshape(-1, c2), self.forward[c2])
        blocks = x.reshape(layout.rows // c1, c1, layout.cols // c2, c2)
        coeffs = torch.einsum("ahbw,hi,wj->abij", blocks, self.forward[c1], self.forward[c2])
        return coeffs.reshape(layout.num_blocks, c1 * c2)

    def _decode(self, coeffs: torch.Tensor, layout: BlockLayout, one_dim: bool) -> torch.Tensor:
        """The inverse of :meth:`_encode`: a (rows, cols) member from its block rows."""
        c1, c2 = layout.c1, layout.c2
        if one_dim:
            return torch.einsum("bi,ij->bj", coeffs, self.inverse[c2]).reshape(layout.rows,
                                                                            layout.cols)
        blocks = coeffs.reshape(layout.rows // c1, layout.cols // c2, c1, c2)
        x = torch.einsum("abij,ih,jw->ahbw", blocks, self.inverse[c1], self.inverse[c2])
        return x.reshape(layout.rows, layout.cols)

    def _spread(self, idx: torch.Tensor, vals: torch.Tensor, s: int, e: int) -> torch.Tensor:
        """Dense block rows of one member from (blocks, m) contributions: their mean where any
        arrived (a sum, then one division), zero elsewhere."""
        dense = torch.zeros(e - s, self.c1 * self.c2, dtype=self.dtype, device=self.device)
        return dense.scatter_reduce_(1, idx[s:e], vals[s:e].to(self.dtype), "mean",
                                     include_self=False)

    # -- the steps ------------------------------------------------------------------------------
    def decay_and_add(self, grads: list[torch.Tensor], lrs: list[float], decay: float) -> None:
        """delta <- decay * delta + lr * grad, in parameter space."""
        for (i, layout, _, _, _), delta in zip(self.members, self.deltas, strict=True):
            if decay != 1:
                delta.mul_(decay)
            delta.add_(grads[i].reshape(layout.rows, layout.cols), alpha=lrs[i])

    def topk(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k coefficients of every block of DCT(delta): (blocks, k) indices and values."""
        picked = []
        for (_, layout, _, _, one_dim), delta in zip(self.members, self.deltas, strict=True):
            coeffs = self._encode(delta, layout, one_dim)
            idx = torch.topk(coeffs.abs(), self.k, dim=-1, largest=True, sorted=False).indices
            picked.append((idx, torch.gather(coeffs, -1, idx)))
        return torch.cat([i for i, _ in picked]), torch.cat([v for _, v in picked])

    def remove_sent(self, idx: torch.Tensor, vals: torch.Tensor,
                    read: torch.Tensor | None) -> None:
        """delta -= inverse DCT of what receivers read (error feedback in parameter space)."""
        sent = vals if read is None else read
        for (_, layout, s, e, one_dim), delta in zip(self.members, self.deltas, strict=True):
            delta.sub_(self._decode(self._spread(idx, sent, s, e), layout, one_dim))

    def inverse_into(self, coeffs: torch.Tensor, out: list[torch.Tensor],
                     shapes: list[torch.Size]) -> None:
        """Inverse-transform dense (num_blocks, c1*c2) coefficients into the members' ``out``."""
        for i, layout, s, e, one_dim in self.members:
            out[i] = self._decode(coeffs[s:e], layout, one_dim).view(shapes[i])

    def decode_mean_into(self, idx: torch.Tensor, vals: torch.Tensor, out: list[torch.Tensor],
                         shapes: list[torch.Size]) -> None:
        """Mean-decode (blocks, m) contributions and inverse-transform them into ``out``."""
        for i, layout, s, e, one_dim in self.members:
            out[i] = self._decode(self._spread(idx, vals, s, e), layout, one_dim).view(shapes[i])

    def take_all(self, out: list[torch.Tensor], shapes: list[torch.Size]) -> None:
        """The whole momentum becomes the update and delta restarts from zero (one replica)."""
        for (i, _, _, _, _), delta in zip(self.members, self.deltas, strict=True):
            out[i] = delta.clone().view(shapes[i])
        self.delta.zero_()
