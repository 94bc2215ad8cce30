"""Orthonormal DCT-II bases and batched block transforms built on matrix products."""

from __future__ import annotations

import math

import torch

_BASES: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def dct_matrix(n: int, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """Return the cached orthonormal DCT-II matrix C (n × n): ``C @ x`` is the DCT of ``x``."""
    key = (n, dtype, torch.device(device))
    basis = _BASES.get(key)
    if basis is None:
        # Built in float64 so every dtype gets the same correctly rounded basis.
        k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
        i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
        c = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
        c[0] /= math.sqrt(2.0)
        basis = c.to(dtype=dtype, device=key[2])
        _BASES[key] = basis
    return basis


def _chunked(x: torch.Tensor, c1: int, c2: int, inverse: bool, scratch: torch.Tensor | None,
             out: torch.Tensor | None, scale: float = 1.0) -> torch.Tensor:
    rows, cols = x.shape
    right = dct_matrix(c2, x.dtype, x.device)
    left = dct_matrix(c1, x.dtype, x.device)
    right = right if inverse else right.T
    if scale != 1.0:
        right = right * scale  # scaling the small basis is free; scaling the output is a pass
    left = left.T if inverse else left
    if c1 == 1:
        first_out = out
    else:
        first_out = scratch
    first_out = None if first_out is None else first_out.reshape(-1)[:rows * cols].view(-1, c2)
    y = torch.mm(x.reshape(-1, c2), right, out=first_out)
    if c1 == 1:
        return y.view(rows, cols)
    second_out = None if out is None else out.reshape(-1)[:rows * cols].view(rows // c1, c1, cols)
    return torch.matmul(left, y.view(rows // c1, c1, cols), out=second_out).view(rows, cols)


def dct_chunked(x: torch.Tensor, c1: int, c2: int, scratch: torch.Tensor | None = None,
                out: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
    """Blockwise 2-D DCT of a (rows, cols) matrix in its natural layout, for (c1 × c2) blocks.

    Coefficient (i, j) of block (a, b) lands at (a*c1 + i, b*c2 + j). Working in the natural
    layout turns both transforms into large matrix products, much faster than a batch of tiny
    per-block products. ``scratch`` and ``out`` (contiguous, at least rows*cols elements) let a
    caller reuse buffers: fresh large CPU tensors cost page faults on every step. The result is
    multiplied by ``scale``.
    """
    return _chunked(x, c1, c2, False, scratch, out, scale)


def idct_chunked(x: torch.Tensor, c1: int, c2: int, scratch: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`dct_chunked` (same buffer arguments)."""
    return _chunked(x, c1, c2, True, scratch, out)
