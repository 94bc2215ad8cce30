"""Top-k sparsification of coefficient blocks and mean-over-contributors decoding."""

from __future__ import annotations

import torch

# Block sizes up to this many coefficients travel with 16-bit indices.
INT16_INDEX_LIMIT = 65536
_INT16_OFFSET = 32768
# Elements per group in the two-stage top-k; see topk_indices.
_GROUP = 8


def index_dtype(block_numel: int) -> torch.dtype:
    """Wire dtype of the coefficient indices for blocks of ``block_numel`` coefficients."""
    return torch.int16 if block_numel <= INT16_INDEX_LIMIT else torch.int32


def encode_indices(idx: torch.Tensor, block_numel: int) -> torch.Tensor:
    """Turn int64 in-block indices into their compact wire dtype."""
    if index_dtype(block_numel) == torch.int16:
        # Shift 0..65535 into the signed int16 range; gloo and torch have no uint16 arithmetic.
        return (idx - _INT16_OFFSET).to(torch.int16)
    return idx.to(torch.int32)


def decode_indices(wire: torch.Tensor) -> torch.Tensor:
    """Turn wire indices back into int64 in-block indices."""
    if wire.dtype == torch.int16:
        return wire.to(torch.int64) + _INT16_OFFSET
    return wire.to(torch.int64)


def clamp_topk(topk: int, block_numel: int) -> int:
    """Number of coefficients kept per block: ``topk`` clamped to [1, block_numel]."""
    return max(1, min(topk, block_numel))


def _top_peaks(peak: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries per row of a non-negative 2-D tensor (unsorted)."""
    rows, n = peak.shape
    groups = n // _GROUP
    if n % _GROUP != 0 or groups < 2 * k:
        return torch.topk(peak, k, dim=1, sorted=False).indices
    # Same argument one level up: the k largest peaks lie in the k groups of peaks with the
    # largest maxima.
    strided = peak.view(rows, _GROUP, groups)
    best = _top_peaks(strided.amax(dim=1), k)
    cand = strided.gather(2, best.unsqueeze(1).expand(rows, _GROUP, k)).reshape(rows, -1)
    pick = torch.topk(cand, k, dim=1, sorted=False).indices
    return (pick // k) * groups + best.gather(1, pick % k)


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest-magnitude entries in each row of a 2-D tensor (unsorted)."""
    rows, n = x.shape
    groups = n // _GROUP
    if n % _GROUP != 0 or k * 4 > groups:
        return torch.topk(x.abs(), k, dim=1, sorted=False).indices
    # Exact up to ties: every one of the k largest entries lies in one of the k groups with
    # the largest maxima, so the final top-k runs over k*_GROUP candidates only. Group g holds
    # entries g, g + groups, g + 2*groups, ...: reducing over a strided axis keeps the inner
    # loop long and vectorised.
    strided = x.view(rows, _GROUP, groups)
    peak = torch.maximum(strided.amax(dim=1), strided.amin(dim=1).neg_())
    best = _top_peaks(peak, k)
    cand = strided.gather(2, best.unsqueeze(1).expand(rows, _GROUP, k)).reshape(rows, -1)
    pick = torch.topk(cand.abs(), k, dim=1, sorted=False).indices
    return (pick // k) * groups + best.gather(1, pick % k)


def topk_encode(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the ``k`` largest-magnitude coefficients per row: (int64 indices, signed values)."""
    idx = topk_indices(x, k)
    return idx, torch.gather(x, 1, idx)


def mean_decode(idx: torch.Tensor, vals: torch.Tensor, block_numel: int,
                dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dense (rows, block_numel) blocks from sparse (rows, m) contributions (or 1-D: one row).

    Where several contributors sent the same coefficient the result is the mean of what arrived
    (DeMo's ``scatter_reduce(mean, include_self=False)``); coefficients nobody sent are zero.
    ``out``, if given, must be all zeros; ``out.scatter_(1, idx, 0)`` makes it so again.
    """
    dtype = dtype or vals.dtype
    vals = vals.to(dtype)
    if out is None:
        out = torch.zeros(*idx.shape[:-1], block_numel, dtype=dtype, device=vals.device)
    # One dense buffer does both jobs: first count contributors per coefficient, then reset
    # only the touched entries and add each value divided by its coefficient's count.
    out.scatter_add_(-1, idx, torch.ones_like(vals))
    counts = out.gather(-1, idx)
    out.scatter_(-1, idx, 0.0)
    out.scatter_add_(-1, idx, vals / counts)
    return out
