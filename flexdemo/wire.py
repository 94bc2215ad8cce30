"""One-buffer wire format for a step's bucket and the per-rank byte accounting of collectives."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The bucket length is padded to this many bytes so every segment can be viewed in place.
_ALIGN = 4


@dataclass(frozen=True)
class Segment:
    """Where one tensor lives inside a packed bucket."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Size of the segment in bytes."""
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def plan_bucket(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[Segment], int]:
    """Place tensors of the given (shape, dtype) into one byte buffer; return segments and size.

    Wider dtypes go first so each segment starts at a multiple of its element size.
    """
    order = sorted(range(len(specs)),
                   key=lambda i: -torch.empty((), dtype=specs[i][1]).element_size())
    segments: list[Segment | None] = [None] * len(specs)
    offset = 0
    for i in order:
        seg = Segment(offset, tuple(specs[i][0]), specs[i][1])
        segments[i] = seg
        offset += seg.nbytes
    total = -(-offset // _ALIGN) * _ALIGN
    return [s for s in segments if s is not None], total


def pack(tensors: list[torch.Tensor], segments: list[Segment], total: int) -> torch.Tensor:
    """Copy ``tensors`` into a fresh uint8 buffer laid out by ``segments``."""
    device = tensors[0].device if tensors else "cpu"
    buf = torch.zeros(total, dtype=torch.uint8, device=device)
    for t, seg in zip(tensors, segments, strict=True):
        buf[seg.offset:seg.offset + seg.nbytes].view(seg.dtype).copy_(t.reshape(-1))
    return buf


def unpack(buf: torch.Tensor, segments: list[Segment]) -> list[torch.Tensor]:
    """Views (leading rank dim) of each segment of a (ranks, total) or (total,) uint8 buffer."""
    rows = buf.view(1, -1) if buf.dim() == 1 else buf
    ranks = rows.shape[0]
    return [rows[:, s.offset:s.offset + s.nbytes].view(s.dtype).view(ranks, *s.shape)
            for s in segments]


def all_gather_bytes(nbytes: int, ranks: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-gather of ``nbytes`` input bytes."""
    return (ranks - 1) * nbytes


def all_to_all_bytes(nbytes: int, ranks: int) -> int:
    """Bytes one rank sends (and receives) in an all-to-all of ``nbytes`` input bytes, a share
    1/ranks of them for each rank (its own stays)."""
    return (ranks - 1) * nbytes // ranks


def all_reduce_bytes(nbytes: int, ranks: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``nbytes`` bytes."""
    return 2 * (ranks - 1) * nbytes // ranks


def dense_is_cheaper(sparse_bytes: int, dense_bytes: int, ranks: int) -> bool:
    """Whether a ring all-reduce of ``dense_bytes`` moves fewer bytes per rank than an all-gather
    of ``sparse_bytes``: 2(N-1)/N x dense < (N-1) x sparse, i.e. 2 x dense < N x sparse (ties:
    the all-gather; one rank: neither moves anything, so the all-gather)."""
    return ranks > 1 and 2 * dense_bytes < ranks * sparse_bytes


@dataclass
class CommStats:
    """Bytes sent, bytes received and collective calls on the replication group."""

    bytes_sent: int = 0
    bytes_received: int = 0
    calls: int = 0

    def add(self, sent: int, received: int, calls: int = 1) -> None:
        """Record one (or ``calls``) collectives."""
        self.bytes_sent += sent
        self.bytes_received += received
        self.calls += calls

    def as_dict(self) -> dict[str, int]:
        """Plain dict with keys bytes_sent, bytes_received, calls."""
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "calls": self.calls}
