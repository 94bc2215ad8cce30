"""Streaming DiLoCo's wire: a fragment's flat pseudo-gradient posted, then its replica mean.

One class per ``outer_format`` (:data:`flexdemo.knobs.OUTER_FORMATS`):

- ``fp32``, ``bf16``: one asynchronous SUM all-reduce of the values in that dtype, divided by
  the replicas once it lands (gloo has no AVG; torchft's Manager sums and divides too).
- ``int8``, ``4bit``: symmetric codes with one fp32 scale per fragment (the largest magnitude),
  all-gathered, since summing codes of different scales is meaningless; every replica decodes
  every replica's codes and averages them in fp32. 4-bit codes are packed two to a byte.

``encode`` also returns what the receivers will read of the values, so that the replicator can
keep what rounding lost and carry it into the fragment's next sync (error feedback).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..bitpack import pack_bits, packed_nbytes, unpack_bits
from ..wire import CommStats, all_gather_bytes, all_reduce_bytes, pack, plan_bucket, unpack
from .base import Group

__all__ = ["DenseWire", "OuterWire", "Pending", "QuantizedWire", "make_outer_wire"]


@dataclass
class Pending:
    """A posted reduction of one fragment: the buffer it fills, its handle, how to read it."""

    buffer: torch.Tensor
    work: object | None
    read: Callable[[torch.Tensor], torch.Tensor]
    _mean: torch.Tensor | None = None

    @classmethod
    def done(cls, mean: torch.Tensor) -> Pending:
        """A reduction already complete (one replica, or restored from a saved state)."""
        return cls(mean, None, lambda b: b, mean)

    def mean(self) -> torch.Tensor:
        """Wait for the collective (once) and return the flat fp32 replica mean."""
        if self._mean is None:
            if self.work is not None:
                self.work.wait()  # type: ignore[attr-defined]
            self._mean = self.read(self.buffer)
        return self._mean

    def wait(self) -> None:
        """Wait for the collective without decoding (a drained sync is dropped)."""
        if self.work is not None and self._mean is None:
            self.work.wait()  # type: ignore[attr-defined]
            self.work = None


class OuterWire:
    """One ``outer_format``: how a flat fp32 fragment is encoded, posted and read back."""

    name: str = ""
    lossy: bool = False

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The payload that crosses the wire and what receivers read of ``x`` (fp32)."""
        raise NotImplementedError

    def post(self, payload: torch.Tensor, numel: int, group: Group, ranks: int,
             stats: CommStats) -> Pending:
        """Launch the collective of ``payload`` (``numel`` values; counted in ``stats``)."""
        raise NotImplementedError

    def payload(self, numel: int) -> tuple[str, int]:
        """The collective a fragment of ``numel`` values goes by and the bytes each rank hands
        in: the one sizing that :meth:`post` counts and the planner (``experiments.plan``)
        plans with."""
        raise NotImplementedError


class DenseWire(OuterWire):
    """The values themselves, in ``dtype``, summed by one all-reduce."""

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name, self.dtype = name, dtype
        self.lossy = dtype != torch.float32

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` in the wire dtype, and that read back in fp32."""
        payload = x.to(self.dtype)
        return payload, payload.float()

    def post(self, payload: torch.Tensor, numel: int, group: Group, ranks: int,
             stats: CommStats) -> Pending:
        """One SUM all-reduce, divided by ``ranks`` when read."""
        work = dist.all_reduce(payload, op=dist.ReduceOp.SUM, group=group, async_op=True)
        n = all_reduce_bytes(self.payload(numel)[1], ranks)
        stats.add(n, n)
        return Pending(payload, work, lambda b: b.float().div_(ranks))


    def payload(self, numel: int) -> tuple[str, int]:
        """A SUM all-reduce of the values in the wire dtype."""
        return "all_reduce", numel * self.dtype.itemsize


class QuantizedWire(OuterWire):
    """Symmetric ``bits``-bit codes in [-L, L] (L = 2**(bits-1) - 1) and one fp32 scale."""

    lossy = True

    def __init__(self, name: str, bits: int) -> None:
        self.name, self.bits = name, bits
        self.levels = 2 ** (bits - 1) - 1

    def _specs(self, numel: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        codes = ((numel,), torch.int8) if self.bits == 8 else \
            ((packed_nbytes(numel, self.bits),), torch.uint8)
        return [codes, ((1,), torch.float32)]

    def _dequantize(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        # The one formula the sender (error feedback) and every receiver use.
        return codes.to(torch.float32) * (scale / self.levels)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed codes and scale, and the dequantized values receivers read."""
        scale = x.abs().amax().reshape(1) if x.numel() else torch.ones(1)
        # A zero scale is an all-zero fragment: any code decodes to 0 there.
        safe = scale.masked_fill(scale == 0, 1.0)
        codes = torch.round(x / safe * self.levels).clamp_(-self.levels, self.levels)
        wire_codes = codes.to(torch.int8) if self.bits == 8 else \
            pack_bits((codes + self.levels).to(torch.int64), self.bits)
        segments, total = plan_bucket(self._specs(x.numel()))
        return pack([wire_codes, scale], segments, total), self._dequantize(codes, scale)

    def post(self, payload: torch.Tensor, numel: int, group: Group, ranks: int,
             stats: CommStats) -> Pending:
        """One all-gather of every replica's payload, averaged in fp32 when read."""
        gathered = torch.empty(ranks * payload.numel(), dtype=torch.uint8, device=payload.device)
        # torch 2.13 renamed all_gather_into_tensor; older releases only have the old name.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = gather(gathered, payload, group=group, async_op=True)
        n = all_gather_bytes(self.payload(numel)[1], ranks)
        stats.add(n, n)
        return Pending(gathered, work, lambda b: self._mean(b, ranks, numel))

    def payload(self, numel: int) -> tuple[str, int]:
        """An all-gather of the packed codes and the scale (the bucket ``encode`` packs)."""
        return "all_gather", plan_bucket(self._specs(numel))[1]

    def _mean(self, gathered: torch.Tensor, ranks: int, numel: int) -> torch.Tensor:
        segments, nbytes = plan_bucket(self._specs(numel))
        codes, scales = unpack(gathered.view(ranks, nbytes), segments)
        if self.bits != 8:
            codes = unpack_bits(codes, self.bits, numel) - self.levels
        return self._dequantize(codes, scales).sum(0).div_(ranks)


def make_outer_wire(outer_format: str) -> OuterWire:
    """The wire of ``outer_format`` (one of :data:`flexdemo.knobs.OUTER_FORMATS`)."""
    if outer_format in ("fp32", "bf16"):
        return DenseWire(outer_format, torch.float32 if outer_format == "fp32" else torch.bfloat16)
    return QuantizedWire(outer_format, 8 if outer_format == "int8" else 4)
