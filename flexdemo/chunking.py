"""How a parameter shard is cut into DCT blocks: chunk sizes and the block layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: CHUNKINGS is read by torch-free settings checks
    import torch

# "block": 2-D (c1 x c2) blocks of each shard seen as a matrix; "flat": 1-D chunks of the
# flattened shard (the reference on FSDP1, whose shards are flat).
CHUNKINGS = ("block", "flat")


def largest_divisor_at_most(n: int, target: int) -> int:
    """Return the largest divisor of ``n`` that is not above ``target`` (1 for n <= 1)."""
    if n <= 1:
        return 1
    if target < 1:
        return 1
    if target * target <= n:
        # A small target (a chunk size against a 10^8-element shard): counting down from it
        # finds the same divisor in O(target) steps instead of O(sqrt(n)).
        for d in range(target, 0, -1):
            if n % d == 0:
                return d
    best = 1
    i = 1
    # Walk divisor pairs up to sqrt(n): O(sqrt(n)) and exact.
    while i * i <= n:
        if n % i == 0:
            if i <= target:
                best = max(best, i)
            j = n // i
            if j <= target:
                best = max(best, j)
        i += 1
    return best


def matrix_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """Return the 2-D (rows, cols) view used for a tensor of ``shape``.

    0-D and 1-D tensors become one row; tensors with more than two dims keep their first dim as
    rows and flatten the trailing dims into columns.
    """
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, int(shape[0])
    cols = 1
    for s in shape[1:]:
        cols *= int(s)
    return int(shape[0]), cols


@dataclass(frozen=True)
class BlockLayout:
    """Cutting of one (rows × cols) matrix into (c1 × c2) blocks, ordered row-major by block."""

    rows: int
    cols: int
    c1: int
    c2: int

    @classmethod
    def for_shape(cls, shape: torch.Size | tuple[int, ...], chunk: int) -> BlockLayout:
        """Layout of ``shape``: block sides are the largest divisors not above ``chunk``."""
        rows, cols = matrix_shape(shape)
        return cls(rows, cols, largest_divisor_at_most(rows, chunk),
                   largest_divisor_at_most(cols, chunk))

    @property
    def num_blocks(self) -> int:
        """Number of blocks."""
        return (self.rows // self.c1) * (self.cols // self.c2)

    def blocks_view(self, t: torch.Tensor) -> torch.Tensor:
        """Strided (blocks_r, blocks_c, c1, c2) view of ``t`` as blocks (no copy)."""
        m = t.reshape(self.rows // self.c1, self.c1, self.cols // self.c2, self.c2)
        return m.permute(0, 2, 1, 3)

    def from_blocks(self, blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Copy (num_blocks, c1, c2) ``blocks`` back into the natural layout of ``out``."""
        self.blocks_view(out).copy_(
            blocks.reshape(self.rows // self.c1, self.cols // self.c2, self.c1, self.c2))
        return out
