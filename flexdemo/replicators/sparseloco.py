"""SparseLoCo: DiLoCo's outer step on a chunked top-k of an error-feedback buffer, 2-bit values."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..bitpack import index_width, pack_bits, packed_nbytes, unpack_bits
from ..codec import topk_indices
from ..knobs import SparseLoCoKnobs
from ..program import Periodic
from ..wire import CommStats, all_gather_bytes, pack, plan_bucket, unpack
from .base import Group, Replicator, copy_state

__all__ = ["SparseLayout", "SparseLoCoReplicator", "sparse_payload"]

Spec = tuple[tuple[int, ...], torch.dtype]
# The paper's 2-bit statistical quantizer (its public code's defaults): 4 bins, each 1.5
# standard deviations of the kept values wide (a range of 6 sigma) around their mean.
_BINS = 4
_RANGE_SIGMAS = 6.0
_STATS = 1 + _BINS  # the mean, then the mean of each bin: fp32 each, one set per tensor


@dataclass(frozen=True)
class SparseLayout:
    """How one shard of ``numel`` elements is cut: ``chunks`` chunks of ``chunk`` elements (the
    last padded with zeros), ``keep`` of each sent."""

    numel: int
    chunk: int
    chunks: int
    keep: int

    @classmethod
    def of(cls, numel: int, chunk: int, topk: int) -> SparseLayout:
        """The cut of a shard of ``numel`` >= 1 elements: chunks of ``chunk`` (the whole shard
        where it is shorter), each keeping ``topk`` (a shorter chunk its share, rounded half
        up, at least 1)."""
        c = min(chunk, numel)
        keep = max(1, (2 * c * topk + chunk) // (2 * chunk))
        return cls(numel, c, -(-numel // c), min(keep, c))

    @property
    def kept(self) -> int:
        """Values (and indices) sent for this shard."""
        return self.chunks * self.keep

    @property
    def width(self) -> int:
        """Bits of one in-chunk index."""
        return index_width(self.chunk)


def _values_specs(value_format: str, count: int) -> list[Spec]:
    """The segments of ``count`` kept values in ``value_format``."""
    if value_format == "2bit":
        return [((packed_nbytes(count, 2),), torch.uint8), ((_STATS,), torch.float32)]
    dtype = torch.float32 if value_format == "fp32" else torch.bfloat16
    return [((count,), dtype)]


def _specs(layouts: list[SparseLayout], value_format: str) -> list[Spec]:
    """Every segment of one replica's bucket: per shard its packed indices, then its values."""
    specs: list[Spec] = []
    for lay in layouts:
        specs.append(((packed_nbytes(lay.kept, lay.width),), torch.uint8))
        specs.extend(_values_specs(value_format, lay.kept))
    return specs


def sparse_payload(numels: list[int], knobs: SparseLoCoKnobs) -> tuple[str, int]:
    """One sync of shards of ``numels`` elements: the collective (an all-gather) and the bytes
    each rank hands in, as :meth:`SparseLoCoReplicator.after_update` packs them: the sizing the
    planner can ask for from shapes alone."""
    layouts = [SparseLayout.of(n, knobs.chunk, knobs.topk) for n in numels if n > 0]
    return "all_gather", plan_bucket(_specs(layouts, knobs.value_format))[1]


def _quantize_2bit(vals: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The paper's statistical 2-bit codes of ``vals`` (fp32, 1-D): packed codes, the stats
    (mean, then each bin's mean offset from it) and what receivers read."""
    shift = vals.mean() if vals.numel() else vals.new_zeros(())
    centered = vals - shift
    n = centered.numel()
    std = centered.norm() / math.sqrt(n - 1) if n > 1 else centered.new_zeros(())
    scale = _RANGE_SIGMAS * std / _BINS
    if not (torch.isfinite(scale) and scale > 0):
        scale = torch.ones((), dtype=vals.dtype, device=vals.device)
    codes = torch.round(centered / scale + _BINS // 2).clamp_(0, _BINS - 1).to(torch.int64)
    # Each bin reads back as the mean of the values that fell in it (0 for an empty bin).
    sums = centered.new_zeros(_BINS).scatter_add_(0, codes, centered)
    counts = centered.new_zeros(_BINS).scatter_add_(0, codes, torch.ones_like(centered))
    lookup = torch.where(counts > 0, sums / counts.clamp(min=1), centered.new_zeros(()))
    stats = torch.cat([shift.reshape(1), lookup]).float()
    return [pack_bits(codes, 2), stats], _read_2bit(codes, stats)


def _read_2bit(codes: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """Values of 2-bit ``codes`` (..., n) under ``stats`` (..., 5): the one formula the sender
    (error feedback) and every receiver use."""
    return stats[..., 1:].gather(-1, codes) + stats[..., :1]


class SparseLoCoReplicator(Replicator):
    """SparseLoCo (Sarfi et al., arXiv:2508.15706): DiLoCo whose outer momentum is replaced by
    an error-feedback buffer, of which only a chunked top-k, 2-bit quantized, crosses nodes.

    Every ``diloco_h`` steps each replica folds its pseudo-gradient (synchronized parameters
    minus current ones) into its buffer, ``e = error_decay * e + delta``; cuts the flattened
    buffer of each shard into chunks of ``chunk`` elements (:class:`SparseLayout`) and keeps the
    ``topk`` largest magnitudes of each; encodes their values in ``value_format`` (2bit: the
    paper's statistical codes) and their in-chunk indices bit-packed; takes what receivers will
    read out of its buffer (``e -= read``). One all-gather brings every replica's bucket; the
    mean over the replicas (a value a replica did not send counts as its zero: the paper's
    ``1/R sum``) drives a plain SGD step from the synchronized parameters, ``theta -= outer_lr
    * mean``, and every replica continues from there. With one replica nothing crosses a
    network and its own sparse update is applied. The inner optimizer is the base (AdamW).

    With ``topk == chunk`` and ``value_format`` fp32 everything is sent exactly, the buffer is
    emptied at each sync, and this is ``diloco`` with ``outer_momentum`` 0 step for step.
    Knobs: :class:`flexdemo.knobs.SparseLoCoKnobs`.
    """

    name = "sparseloco"
    knobs_type = SparseLoCoKnobs
    default_base = "adamw"
    default_sign = False

    def __init__(self, knobs: SparseLoCoKnobs | None = None, **given: Any) -> None:
        super().__init__(knobs, **given)
        self.replicate_every = self.diloco_h  # synchronize every H steps

    @classmethod
    def program(cls, knobs: SparseLoCoKnobs, shard_shapes: Sequence[tuple[int, ...]],
                replicas: int, *, node: int = 0, graph: str | None = None) -> Periodic:
        """One all-gather of the sparse bucket every ``diloco_h`` steps (:func:`sparse_payload`)."""
        numels = [math.prod(s) for s in shard_shapes]
        op, nbytes = sparse_payload(numels, knobs)
        # The anchors and error-feedback buffers (fp32), the bucket and what it gathers.
        state = 2 * sum(numels) * 4 + (1 + replicas) * nbytes
        return Periodic(cls(knobs).replicates_on, lambda _step: [(op, nbytes)],
                        period=knobs.diloco_h, state_bytes=state)

    def setup(self, params: list[torch.Tensor], group: Group, ranks: int) -> None:
        """Remember the starting point, give each shard an empty buffer and its cut."""
        super().setup(params, group, ranks)
        self.anchors = [p.detach().clone() for p in params]
        self.errors = [torch.zeros_like(p) for p in params]
        self.layouts = [SparseLayout.of(p.numel(), self.chunk, self.topk) if p.numel() else None
                        for p in params]
        sent = [lay for lay in self.layouts if lay is not None]
        self.segments, self.nbytes = plan_bucket(_specs(sent, self.value_format))

    def replicate(self, grads: list[torch.Tensor], lrs: list[float],
                  stats: CommStats) -> list[torch.Tensor]:
        """The inner step of a synchronizing step is local too; the sync follows it."""
        return grads

    def after_update(self, params: list[torch.Tensor], stats: CommStats) -> None:
        """Compress the buffers, average the replicas' sparse updates, take the outer step."""
        picked, wire, own = [], [], []
        for i, lay in enumerate(self.layouts):
            if lay is None:
                continue
            tensors, read = self._compress(i, params[i], lay)
            picked.append(i)
            wire.extend(tensors)
            own.append(read)
        if self.ranks == 1:
            means = own  # nothing crosses a network: this replica's own sparse update
        else:
            means = self._exchange(pack(wire, self.segments, self.nbytes), picked, stats)
        for i, mean in zip(picked, means, strict=True):
            anchor = self.anchors[i]
            anchor.add_(mean.view(-1)[:anchor.numel()].view_as(anchor), alpha=-self.outer_lr)
            params[i].copy_(anchor)

    def _compress(self, i: int, param: torch.Tensor,
                  lay: SparseLayout) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Fold shard ``i``'s pseudo-gradient into its buffer, pick its chunks' top-k, encode
        them and take what receivers read out of the buffer: (wire tensors, what receivers
        read as a (chunks, chunk) tensor)."""
        error = self.errors[i]
        error.mul_(self.error_decay).add_(self.anchors[i] - param)
        chunks = self._chunks(error, lay)
        idx = topk_indices(chunks, lay.keep)
        vals = chunks.gather(1, idx).reshape(-1).float()
        if self.value_format == "2bit":
            tensors, read = _quantize_2bit(vals)
        else:
            sent = vals.to(torch.float32 if self.value_format == "fp32" else torch.bfloat16)
            tensors, read = [sent], sent.float()
        dense = self._dense(lay, idx, read.to(error.dtype))
        error.view(-1).sub_(dense.view(-1)[:lay.numel])
        return [pack_bits(idx.reshape(-1), lay.width), *tensors], dense

    @staticmethod
    def _chunks(t: torch.Tensor, lay: SparseLayout) -> torch.Tensor:
        """``t`` flattened and zero-padded to (chunks, chunk)."""
        flat = t.reshape(-1)
        pad = lay.chunks * lay.chunk - lay.numel
        return (torch.nn.functional.pad(flat, (0, pad)) if pad else flat).view(lay.chunks,
                                                                               lay.chunk)

    @staticmethod
    def _dense(lay: SparseLayout, idx: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        """The (chunks, chunk) tensor holding ``vals`` at ``idx`` and zeros elsewhere."""
        out = torch.zeros(lay.chunks, lay.chunk, dtype=vals.dtype, device=vals.device)
        return out.scatter_(1, idx, vals.view(lay.chunks, lay.keep))

    def _exchange(self, bucket: torch.Tensor, picked: list[int],
                  stats: CommStats) -> list[torch.Tensor]:
        """All-gather every replica's bucket; each shard's mean over the replicas."""
        gathered = torch.empty(self.ranks * bucket.numel(), dtype=torch.uint8,
                               device=bucket.device)
        # torch 2.13 renamed all_gather_into_tensor; older releases only have the old name.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(gathered, bucket, group=self.group)
        n = all_gather_bytes(self.nbytes, self.ranks)
        stats.add(n, n)
        views = unpack(gathered.view(self.ranks, self.nbytes), self.segments)
        per_shard = 3 if self.value_format == "2bit" else 2
        means = []
        for j, i in enumerate(picked):
            lay = self.layouts[i]
            segs = views[j * per_shard:(j + 1) * per_shard]
            idx = unpack_bits(segs[0], lay.width, lay.kept).view(self.ranks, lay.chunks,
                                                                  lay.keep)
            vals = self._read(segs[1:], lay).to(self.anchors[i].dtype)
            total = torch.zeros(lay.chunks, lay.chunk, dtype=vals.dtype, device=vals.device)
            for r in range(self.ranks):  # in rank order, each replica's values added once
                total.scatter_add_(1, idx[r], vals[r].view(lay.chunks, lay.keep))
            means.append(total.div_(self.ranks))
        return means

    def _read(self, segs: list[torch.Tensor], lay: SparseLayout) -> torch.Tensor:
        """(ranks, kept) values every replica sent for one shard."""
        if self.value_format == "2bit":
            codes = unpack_bits(segs[0], 2, lay.kept)
            return _read_2bit(codes, segs[1])
        return segs[0].float()

    def state_dict(self) -> dict:
        """The synchronized parameters and the error-feedback buffers."""
        return {"anchors": [a.clone() for a in self.anchors],
                "errors": [e.clone() for e in self.errors]}

    def load_state_dict(self, state: dict) -> None:
        """Restore the synchronized parameters and the buffers."""
        copy_state(self.anchors, state["anchors"])
        copy_state(self.errors, state["errors"])

