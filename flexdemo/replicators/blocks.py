"""DeMo's momentum over same-shaped DCT blocks of several shards, transformed as one batch."""

from __future__ import annotations

import torch

from ..chunking import BlockLayout
from ..codec import clamp_topk, mean_decode, topk_encode
from ..dct import dct_chunked, idct_chunked


class BlockGroup:
    """The decoupled momentum of every (c1 × c2) block of several shards, in the DCT domain.

    Momentum lives in the DCT domain: the transform is orthonormal and linear, so this equals
    DeMo's parameter-space delta up to rounding and saves one inverse transform per step. This
    is the fast arithmetic; :class:`~.reference_blocks.ReferenceBlockGroup` is the package's.
    """

    def __init__(self, c1: int, c2: int, topk: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.c1, self.c2 = c1, c2
        self.k = clamp_topk(topk, c1 * c2)
        # (shard index, its layout, first block, end block) of each member.
        self.members: list[tuple[int, BlockLayout, int, int]] = []
        self.num_blocks = 0
        self.dtype, self.device = dtype, device
        self.delta = torch.empty(0)

    def add(self, index: int, layout: BlockLayout, one_dim: bool = False) -> None:
        """Make shard ``index`` (cut as ``layout``) a member (``one_dim``: the reference
        arithmetic's, unused here: every member is a matrix of blocks)."""
        del one_dim
        start = self.num_blocks
        self.num_blocks += layout.num_blocks
        self.members.append((index, layout, start, self.num_blocks))

    def allocate(self) -> None:
        """Create delta and the buffers reused every step (call once, after the last add)."""
        self.delta = torch.zeros(self.num_blocks, self.c1 * self.c2, dtype=self.dtype,
                                 device=self.device)
        # On CPU, fresh multi-megabyte tensors are returned to the OS when freed and page-fault
        # back in on the next step, which cost as much as the inverse transform itself.
        self.updates = {i: torch.empty(layout.rows, layout.cols, dtype=self.dtype,
                                       device=self.device) for i, layout, _, _ in self.members}
        largest = max(layout.rows * layout.cols for _, layout, _, _ in self.members)
        self.scratch = [torch.empty(largest, dtype=self.dtype, device=self.device)
                        for _ in range(2)]
        self._plan_decode()

    def _plan_decode(self) -> None:
        # Decoding scatters straight into the members' natural layouts, laid end to end, so
        # the inverse transform needs no block-to-natural copy. Per block: where its (0, 0)
        # coefficient sits in that flat buffer and the row stride of its member.
        bases, strides, offset = [], [], 0
        self.natural_offsets = []
        for _, layout, _, _ in self.members:
            brows, bcols = layout.rows // layout.c1, layout.cols // layout.c2
            a = torch.arange(brows).repeat_interleave(bcols)
            b = torch.arange(bcols).repeat(brows)
            bases.append(offset + a * layout.c1 * layout.cols + b * layout.c2)
            strides.append(torch.full((layout.num_blocks,), layout.cols))
            self.natural_offsets.append(offset)
            offset += layout.rows * layout.cols
        self.block_base = torch.cat(bases).to(self.device).unsqueeze(1)
        self.block_stride = torch.cat(strides).to(self.device).unsqueeze(1)
        self.decoded = torch.zeros(offset, dtype=self.dtype, device=self.device)

    def decay_and_add(self, grads: list[torch.Tensor], lrs: list[float], decay: float) -> None:
        """delta <- decay * delta + lr * DCT(grad), block by block."""
        weight = 1.0 - decay
        for i, layout, s, e in self.members:
            # One pass: lerp towards lr*DCT(g)/(1-decay), that factor folded into the small
            # basis matrix.
            coeffs = dct_chunked(grads[i].reshape(layout.rows, layout.cols), layout.c1, layout.c2,
                                 scratch=self.scratch[0], out=self.scratch[1],
                                 scale=lrs[i] / weight)
            # The strided update doubles as the copy from natural into block layout.
            self.delta[s:e].view(-1, layout.cols // layout.c2, layout.c1, layout.c2).lerp_(
                layout.blocks_view(coeffs), weight)

    def topk(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k coefficients of every block of delta: (blocks, k) indices and values."""
        return topk_encode(self.delta, self.k)

    def remove_sent(self, idx: torch.Tensor, vals: torch.Tensor,
                    read: torch.Tensor | None) -> None:
        """delta -= what receivers read (rounding or quantization error stays: error feedback)."""
        if read is None:
            self.delta.scatter_(1, idx, 0.0)
        else:
            self.delta.scatter_(1, idx, vals - read.to(self.delta.dtype))

    def take_all(self, out: list[torch.Tensor], shapes: list[torch.Size]) -> None:
        """The whole momentum becomes the update and delta restarts from zero (one replica)."""
        self.inverse_into(self.delta.clone(), out, shapes)
        self.delta.zero_()

    def inverse_into(self, coeffs: torch.Tensor, out: list[torch.Tensor],
                     shapes: list[torch.Size]) -> None:
        """Inverse-transform dense (num_blocks, c1*c2) coefficients into the members' ``out``."""
        for i, layout, s, e in self.members:
            natural = self.scratch[0][:layout.rows * layout.cols].view(layout.rows, layout.cols)
            layout.from_blocks(coeffs[s:e].view(-1, layout.c1, layout.c2), natural)
            out[i] = idct_chunked(natural, layout.c1, layout.c2, scratch=self.scratch[1],
                                  out=self.updates[i]).view(shapes[i])

    def decode_mean_into(self, idx: torch.Tensor, vals: torch.Tensor, out: list[torch.Tensor],
                         shapes: list[torch.Size]) -> None:
        """Mean-decode (blocks, m) contributions and inverse-transform them into ``out``."""
        flat = (self.block_base + (idx // self.c2) * self.block_stride + idx % self.c2).reshape(-1)
        mean_decode(flat, vals.reshape(-1), self.decoded.numel(), self.dtype, out=self.decoded)
        for (i, layout, _, _), offset in zip(self.members, self.natural_offsets, strict=True):
            natural = self.decoded[offset:offset + layout.rows * layout.cols]
            out[i] = idct_chunked(natural.view(layout.rows, layout.cols), layout.c1, layout.c2,
                                  scratch=self.scratch[1], out=self.updates[i]).view(shapes[i])
        self.decoded.scatter_(0, flat, 0.0)  # cheaper than refilling the whole buffer
