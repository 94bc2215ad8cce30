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


_FFT_BASES: dict[tuple[int, torch.dtype, torch.dtype, torch.device],
                 tuple[torch.Tensor, torch.Tensor]] = {}


def _fft_forward(n: int, dtype: torch.dtype) -> torch.Tensor:
    # Makhoul's DCT-II by one FFT, applied to each unit vector: reorder the samples (evens,
    # then odds reversed), FFT, rotate by exp(-i*pi*k/2n), keep the real part, normalize.
    eye = torch.eye(n, dtype=dtype)
    spectrum = torch.view_as_real(torch.fft.fft(torch.cat([eye[:, ::2], eye[:, 1::2].flip([1])],
                                                          dim=1), dim=1))
    angle = -torch.arange(n, dtype=dtype)[None, :] * math.pi / (2 * n)
    out = spectrum[:, :, 0] * torch.cos(angle) - spectrum[:, :, 1] * torch.sin(angle)
    out[:, 0] /= math.sqrt(n) * 2
    out[:, 1:] /= math.sqrt(n / 2) * 2
    return 2 * out


def _fft_inverse(n: int, dtype: torch.dtype) -> torch.Tensor:
    # The inverse (DCT-III) the same way backwards: un-normalize, rotate, inverse real FFT of
    # the Hermitian half, undo the reordering.
    half = torch.eye(n, dtype=dtype) / 2
    half[:, 0] *= math.sqrt(n) * 2
    half[:, 1:] *= math.sqrt(n / 2) * 2
    angle = torch.arange(n, dtype=dtype)[None, :] * math.pi / (2 * n)
    cos, sin = torch.cos(angle), torch.sin(angle)
    imag = torch.cat([half[:, :1] * 0, -half.flip([1])[:, :-1]], dim=1)
    rotated = torch.stack([half * cos - imag * sin, half * sin + imag * cos], dim=2)
    samples = torch.fft.irfft(torch.view_as_complex(rotated), n=n, dim=1)
    out = samples.new_zeros(samples.shape)
    out[:, ::2] += samples[:, :n - n // 2]
    out[:, 1::2] += samples.flip([1])[:, :n // 2]
    return out


def fft_dct_bases(n: int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The cached (n x n) DCT-II bases (F, B) in ``dtype`` as DeToNATION 0.5.2 builds them.

    ``x @ F`` is the orthonormal DCT of the rows of ``x`` and ``X @ B`` its inverse. They hold
    the same matrix as :func:`dct_matrix` (transposed) but rounded the way an FFT in torch's
    default dtype (float32) rounds, then cast to ``dtype``: up to 3e-8 off the true cosines,
    and B is not exactly F's transpose. Only the reference arithmetic
    (``DeMoKnobs.arithmetic``) uses them, to reproduce the package bit for bit.
    """
    built_in = torch.get_default_dtype()  # the package's torch.eye(n)
    key = (n, built_in, dtype, torch.device(device))
    bases = _FFT_BASES.get(key)
    if bases is None:
        # Each operation above in the package's order and dtype: a reordered one rounds
        # differently, and one ulp in a basis entry decides a top-k tie a few steps later.
        bases = (_fft_forward(n, built_in).to(dtype).to(key[3]),
                 _fft_inverse(n, built_in).to(dtype).to(key[3]))
        _FFT_BASES[key] = bases
    return bases
