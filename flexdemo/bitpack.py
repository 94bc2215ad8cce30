"""Vectorized bit packing of small non-negative integers (indices, quantized codes) into bytes."""

from __future__ import annotations

import torch

# 32 bits index any tensor of up to 2**32 elements (a whole-tensor top-k's indices).
MAX_WIDTH = 32
# Values travel in groups of 8: 8 values of w bits are exactly w bytes, so no value straddles
# a group and every group packs and unpacks with the same few whole-tensor shifts.
_GROUP = 8


def index_width(block_numel: int) -> int:
    """Bits per in-chunk index for chunks of ``block_numel`` elements: ceil(log2), at least 1."""
    return max(1, (block_numel - 1).bit_length())


def packed_nbytes(count: int, width: int) -> int:
    """Bytes :func:`pack_bits` uses for ``count`` values of ``width`` bits (whole groups of 8)."""
    return -(-count // _GROUP) * width


def _check_width(width: int) -> None:
    if not (isinstance(width, int) and 1 <= width <= MAX_WIDTH):
        raise ValueError(f"width={width!r} must be an integer in [1, {MAX_WIDTH}].")


def _pack_narrow(v: torch.Tensor, width: int) -> torch.Tensor:
    # v: (..., groups, 8) int64 below 2**width <= 2**8. One int64 word per group holds 8*width
    # bits; disjoint bit fields make the sum an OR, and two's complement wrap at bit 63 keeps
    # the bit pattern, so the low bytes read back right.
    shifts = torch.arange(_GROUP, device=v.device) * width
    word = (v << shifts).sum(-1, keepdim=True)
    byte_shifts = torch.arange(width, device=v.device) * 8
    return ((word >> byte_shifts) & 0xFF).to(torch.uint8).flatten(-2)


def _unpack_narrow(b: torch.Tensor, width: int) -> torch.Tensor:
    # b: (..., groups * width) uint8 -> (..., groups, 8) int64.
    b = b.reshape(*b.shape[:-1], -1, width).to(torch.int64)
    byte_shifts = torch.arange(width, device=b.device) * 8
    word = (b << byte_shifts).sum(-1, keepdim=True)
    shifts = torch.arange(_GROUP, device=b.device) * width
    return (word >> shifts) & ((1 << width) - 1)


def pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """Pack the last dim of integer ``values`` (each in [0, 2**width)) at ``width`` bits each.

    Returns uint8 of shape (..., packed_nbytes(n, width)); the count is padded with zeros to a
    multiple of 8. Widths above 8 send the low byte as is and pack the rest at width - 8 (so
    up to 16 bits: one whole byte, then the high bits packed; above: two whole bytes, ...).
    """
    _check_width(width)
    n = values.shape[-1]
    v = values.to(torch.int64)
    pad = -n % _GROUP
    if pad:
        v = torch.nn.functional.pad(v, (0, pad))
    return _pack_groups(v.reshape(*v.shape[:-1], -1, _GROUP), width)


def _pack_groups(v: torch.Tensor, width: int) -> torch.Tensor:
    # v: (..., groups, 8) int64 below 2**width.
    if width <= 8:
        return _pack_narrow(v, width)
    low = (v & 0xFF).to(torch.uint8).flatten(-2)
    return torch.cat([low, _pack_groups(v >> 8, width - 8)], dim=-1)


def unpack_bits(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: int64 (..., count) from uint8 (..., packed_nbytes)."""
    _check_width(width)
    groups = -(-count // _GROUP)
    return _unpack_groups(packed, width, groups).flatten(-2)[..., :count]


def _unpack_groups(packed: torch.Tensor, width: int, groups: int) -> torch.Tensor:
    # packed: (..., groups * width) uint8 -> (..., groups, 8) int64.
    if width <= 8:
        return _unpack_narrow(packed, width)
    low = packed[..., :groups * _GROUP].to(torch.int64)
    high = _unpack_groups(packed[..., groups * _GROUP:], width - 8, groups)
    return low.reshape(*low.shape[:-1], groups, _GROUP) | (high << 8)
