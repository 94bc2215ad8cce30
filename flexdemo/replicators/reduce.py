"""hsdp-adamw's inter-node gradient mean in low precision: bf16, or fp8 / int8 scaled rows."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..chunking import matrix_shape
from ..knobs import ReduceKnobs
from ..program import Periodic
from ..wire import (
    CommStats,
    Segment,
    all_gather_bytes,
    all_reduce_bytes,
    all_to_all_bytes,
    plan_bucket,
    unpack,
)
from .base import Group, Replicator

__all__ = ["ReduceReplicator", "RowLayout", "reduce_payloads"]

# Each format's wire dtype of a scaled row and the largest magnitude a row is scaled to (as
# torchft's quantized all-reduce: 448 for e4m3 fp8, 127 for its int8 fallback).
_CODES = {"fp8": (torch.float8_e4m3fn, 448.0), "int8": (torch.int8, 127.0)}


@dataclass(frozen=True)
class RowLayout:
    """One shard seen as rows for a quantized reduce over ``ranks`` replicas: ``rows`` rows of
    ``cols`` elements handed to each replica (zero rows pad the last)."""

    shape: tuple[int, ...]
    rows: int
    cols: int

    @classmethod
    def of(cls, shape: tuple[int, ...], ranks: int) -> RowLayout:
        """A matrix (more than one dim: first dim by the rest) keeps its rows, ceil(rows /
        ranks) to each replica, as torchft splits them; a vector is cut into one row each."""
        if len(shape) >= 2:
            m, c = matrix_shape(shape)
            return cls(tuple(shape), -(-m // ranks), c)
        return cls(tuple(shape), 1, -(-math.prod(shape) // ranks))

    def to_rows(self, t: torch.Tensor, ranks: int) -> torch.Tensor:
        """``t`` as (ranks * rows, cols), zero-padded."""
        flat = t.reshape(-1)
        pad = ranks * self.rows * self.cols - flat.numel()
        return torch.nn.functional.pad(flat, (0, pad)).view(ranks * self.rows, self.cols)

    def from_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`to_rows`: the shard of ``shape`` from its padded rows."""
        return rows.reshape(-1)[:math.prod(self.shape)].view(self.shape)


def _block_specs(layouts: list[RowLayout], fmt: str) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """One replica's block of every shard: its rows' codes, then their fp32 scales."""
    dtype = _CODES[fmt][0]
    specs: list[tuple[tuple[int, ...], torch.dtype]] = []
    for lay in layouts:
        specs += [((lay.rows, lay.cols), dtype), ((lay.rows,), torch.float32)]
    return specs


def reduce_payloads(shapes: list[tuple[int, ...]], reduce_format: str,
                    ranks: int) -> list[tuple[str, int]]:
    """The collectives of one gradient mean of shards of ``shapes`` over ``ranks`` replicas
    and the bytes each rank hands in to each, as :meth:`ReduceReplicator.replicate` posts them:
    the sizing the planner can ask for from shapes alone."""
    numel = sum(math.prod(s) for s in shapes)
    if reduce_format in ("fp32", "bf16"):
        return [("all_reduce", numel * (4 if reduce_format == "fp32" else 2))]
    layouts = [RowLayout.of(tuple(s), ranks) for s in shapes if math.prod(s) > 0]
    block = plan_bucket(_block_specs(layouts, reduce_format))[1]
    return [("all_to_all", ranks * block), ("all_gather", block)]


class ReduceReplicator(Replicator):
    """The replicas' mean gradient in ``reduce_format``: hsdp-adamw's inter-node reduction
    taken from FSDP2 (which then reduces inside the node only) under an AdamW step.

    fp32 is one SUM all-reduce divided by the replicas (FSDP2's HSDP result to float
    rounding); bf16 the same all-reduce in bf16. fp8 and int8 reduce rows as torchft's
    quantized all-reduce does: each shard is seen as rows (:class:`RowLayout`), each row scaled
    by ``max / its largest magnitude`` (one fp32 scale) and rounded to e4m3 fp8 or int8; an
    all-to-all hands replica j the j-th share of every shard's rows from every replica, which
    it decodes, sums in fp32 and divides by the replicas, then scales and rounds
    again; an all-gather brings every replica every share, and all decode the same values.
    No error feedback (torchft keeps none). The codes travel as bytes, which gloo carries.
    Knobs: :class:`flexdemo.knobs.ReduceKnobs`.
    """

    name = "reduce"
    knobs_type = ReduceKnobs
    default_base = "adamw"
    default_sign = False

    @classmethod
    def program(cls, knobs: ReduceKnobs, shard_shapes: Sequence[tuple[int, ...]],
                replicas: int, *, node: int = 0, graph: str | None = None) -> Periodic:
        """Every step's mean, its ops one after another (:func:`reduce_payloads`): one
        all-reduce (fp32, bf16), or an all-to-all then an all-gather of scaled rows."""
        payloads = reduce_payloads([tuple(s) for s in shard_shapes], knobs.reduce_format,
                                   replicas)
        # What the exchange holds beside the gradients: the flat buffer reduced in place, or
        # the rows sent, received and gathered (each a replica's block per replica).
        if knobs.reduce_format in _CODES:
            state = 3 * payloads[0][1]
        else:
            state = payloads[0][1]
        return Periodic(lambda _step: True, lambda _step: payloads, state_bytes=state,
                        sequential=True)

    def setup(self, params: list[torch.Tensor], group: Group, ranks: int) -> None:
        """Cut every shard into rows and lay out one replica's block of them."""
        super().setup(params, group, ranks)
        if self.reduce_format in _CODES:
            self.layouts = [RowLayout.of(tuple(p.shape), ranks) if p.numel() else None
                            for p in params]
            self.segments, self.block = plan_bucket(
                _block_specs([lay for lay in self.layouts if lay is not None],
                             self.reduce_format))

    def replicate(self, grads: list[torch.Tensor], lrs: list[float],
                  stats: CommStats) -> list[torch.Tensor]:
        """The replicas' mean of ``grads`` in ``reduce_format``."""
        if self.ranks == 1 or not grads:
            return grads
        if self.reduce_format == "fp32":
            return self._all_reduce_mean(grads, stats)
        if self.reduce_format == "bf16":
            return self._bf16_mean(grads, stats)
        return self._quantized_mean(grads, stats)

    def _bf16_mean(self, grads: list[torch.Tensor], stats: CommStats) -> list[torch.Tensor]:
        """One SUM all-reduce of the gradients in bf16, divided in fp32."""
        flat = torch.cat([g.reshape(-1) for g in grads]).to(torch.bfloat16)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        n = all_reduce_bytes(flat.numel() * 2, self.ranks)
        stats.add(n, n)
        mean = flat.float().div_(self.ranks)
        return [m.view_as(g).to(g.dtype)
                for m, g in zip(mean.split([g.numel() for g in grads]), grads, strict=True)]

    def _quantized_mean(self, grads: list[torch.Tensor],
                        stats: CommStats) -> list[torch.Tensor]:
        """torchft's quantized all-reduce: all-to-all, sum of the shares, all-gather."""
        w = self.ranks
        shards = [(lay, g) for lay, g in zip(self.layouts, grads, strict=True) if lay is not None]
        send = torch.zeros(w, self.block, dtype=torch.uint8, device=grads[0].device)
        for k, (lay, g) in enumerate(shards):
            codes, scales = self._quantize(lay.to_rows(g.float(), w))
            self._put(send, self.segments[2 * k:2 * k + 2], codes, scales, w)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        n = all_to_all_bytes(send.numel(), w)
        stats.add(n, n)
        # This replica's share of every shard: the replicas' rows decoded and averaged.
        views = unpack(recv, self.segments)
        mine = torch.zeros(1, self.block, dtype=torch.uint8, device=send.device)
        for k in range(len(shards)):
            rows = self._dequantize(views[2 * k], views[2 * k + 1])
            codes, scales = self._quantize(rows.sum(0).div_(w))
            self._put(mine, self.segments[2 * k:2 * k + 2], codes, scales, 1)
        gathered = torch.empty(w * self.block, dtype=torch.uint8, device=send.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(gathered, mine.view(-1), group=self.group)
        n = all_gather_bytes(self.block, w)
        stats.add(n, n)
        views = unpack(gathered.view(w, self.block), self.segments)
        out = list(grads)
        k = 0
        for i, lay in enumerate(self.layouts):
            if lay is not None:
                rows = self._dequantize(views[2 * k], views[2 * k + 1])
                out[i] = lay.from_rows(rows).to(grads[i].dtype)
                k += 1
        return out

    def _quantize(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, fp32 scales) of fp32 ``rows`` (..., cols): each row times ``max / its
        largest magnitude`` (1 for an all-zero row, as torchft), rounded to the wire dtype."""
        dtype, top = _CODES[self.reduce_format]
        scales = top / rows.abs().amax(-1)
        scales = torch.where(torch.isinf(scales), torch.ones_like(scales), scales)
        scaled = rows * scales.unsqueeze(-1)
        if dtype == torch.int8:
            return scaled.round_().clamp_(-top, top).to(torch.int8), scales
        return scaled.to(dtype), scales

    @staticmethod
    def _dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """fp32 rows (..., rows, cols) from their ``codes`` in the wire dtype and ``scales``."""
        return codes.float() / scales.unsqueeze(-1)

    @staticmethod
    def _put(buf: torch.Tensor, segments: list[Segment], codes: torch.Tensor,
             scales: torch.Tensor, ranks: int) -> None:
        """Write ``ranks`` shares of one shard's codes and scales into rows of ``buf``."""
        for seg, t in zip(segments, (codes, scales), strict=True):
            dst = buf[:, seg.offset:seg.offset + seg.nbytes].view(seg.dtype)
            dst.copy_(t.reshape(ranks, -1))
