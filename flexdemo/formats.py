"""Wire formats for DeMo's top-k coefficients: index width, value dtype or quantizer, scales.

A format turns one block group's picked ``(indices, values)`` — (blocks, k) each — into the
tensors that go into the step's bucket, tells the optimizer what the receivers will read back
(so the rest stays in the momentum: error feedback), and decodes every replica's segments.

| format | indices | values | per-chunk scale |
| --- | --- | --- | --- |
| ``fp32``, ``bf16`` (any float ``value_dtype``) | int16 (int32 above 65536) | that dtype | none |
| ``fp32-packed``, ``bf16-packed`` | ceil(log2(chunk elements)) bits | that dtype | none |
| ``int8`` | packed | int8, symmetric, max-abs scaled to ±127 | bf16 |
| ``int2`` | packed | 2 bits: levels ±1/3, ±1 of the max-abs | bf16 |
| ``sign`` | packed | 1 bit | bf16 mean of the magnitudes |

``fp32`` and ``bf16`` are today's layout, byte for byte; packed indices come only with the
compact formats, so the default bytes per step do not change.
"""

from __future__ import annotations

import torch

from .bitpack import index_width, pack_bits, packed_nbytes, unpack_bits
from .codec import decode_indices, encode_indices, index_dtype
from .knobs import VALUE_FORMATS, check_value_format

Spec = tuple[tuple[int, ...], torch.dtype]
_FLOATS = {"fp32": torch.float32, "bf16": torch.bfloat16}
# bf16 keeps fp32's exponent range: a fp16 scale would flush small momenta (lr * grad) to 0.
SCALE_DTYPE = torch.bfloat16


class WireFormat:
    """One way to put a block group's top-k on the wire; subclasses per value encoding."""

    name = "base"

    def specs(self, blocks: int, k: int, block_numel: int) -> list[Spec]:
        """(shape, dtype) of every segment this format sends for one block group."""
        raise NotImplementedError

    def encode(self, idx: torch.Tensor, vals: torch.Tensor,
               block_numel: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Wire tensors in ``specs`` order, and the values receivers read (None: exactly vals)."""
        raise NotImplementedError

    def decode(self, views: list[torch.Tensor], blocks: int, k: int, block_numel: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(ranks, blocks, k) int64 indices and ``dtype`` values from every replica's segments."""
        raise NotImplementedError


class DtypeFormat(WireFormat):
    """Today's layout: int16 indices and values rounded to a float dtype."""

    def __init__(self, dtype: torch.dtype, name: str) -> None:
        self.dtype, self.name = dtype, name

    def specs(self, blocks: int, k: int, block_numel: int) -> list[Spec]:
        """int16 (or int32) indices and values, (blocks, k) each."""
        return [((blocks, k), index_dtype(block_numel)), ((blocks, k), self.dtype)]

    def encode(self, idx: torch.Tensor, vals: torch.Tensor,
               block_numel: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Shifted indices and rounded values."""
        sent = vals.to(self.dtype)
        return [encode_indices(idx, block_numel), sent], None if sent.dtype == vals.dtype else sent

    def decode(self, views: list[torch.Tensor], blocks: int, k: int, block_numel: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices back to int64; values as they came."""
        return decode_indices(views[0]), views[1]


class _PackedIndices(WireFormat):
    """Shared part of the compact formats: indices bit-packed at ceil(log2(chunk)) bits."""

    def _index_spec(self, blocks: int, k: int, block_numel: int) -> Spec:
        return (packed_nbytes(blocks * k, index_width(block_numel)),), torch.uint8

    def _pack_indices(self, idx: torch.Tensor, block_numel: int) -> torch.Tensor:
        return pack_bits(idx.reshape(-1), index_width(block_numel))

    def _unpack_indices(self, view: torch.Tensor, blocks: int, k: int,
                        block_numel: int) -> torch.Tensor:
        idx = unpack_bits(view, index_width(block_numel), blocks * k)
        return idx.view(-1, blocks, k)


class PackedFloatFormat(_PackedIndices):
    """Packed indices and values rounded to a float dtype."""

    def __init__(self, dtype: torch.dtype, name: str) -> None:
        self.dtype, self.name = dtype, name

    def specs(self, blocks: int, k: int, block_numel: int) -> list[Spec]:
        """Packed indices, then (blocks, k) values."""
        return [self._index_spec(blocks, k, block_numel), ((blocks, k), self.dtype)]

    def encode(self, idx: torch.Tensor, vals: torch.Tensor,
               block_numel: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Packed indices and rounded values."""
        sent = vals.to(self.dtype)
        return ([self._pack_indices(idx, block_numel), sent],
                None if sent.dtype == vals.dtype else sent)

    def decode(self, views: list[torch.Tensor], blocks: int, k: int, block_numel: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Unpacked indices; values as they came."""
        return self._unpack_indices(views[0], blocks, k, block_numel), views[1]


class QuantizedFormat(_PackedIndices):
    """Packed indices, values quantized to a few bits with one bf16 scale per chunk."""

    def __init__(self, name: str, bits: int) -> None:
        self.name, self.bits = name, bits

    def _code_spec(self, blocks: int, k: int) -> Spec:
        if self.bits == 8:
            return (blocks, k), torch.int8
        return (packed_nbytes(blocks * k, self.bits),), torch.uint8

    def specs(self, blocks: int, k: int, block_numel: int) -> list[Spec]:
        """Packed indices, codes, one scale per chunk."""
        return [self._index_spec(blocks, k, block_numel), self._code_spec(blocks, k),
                ((blocks,), SCALE_DTYPE)]

    def _scale(self, vals: torch.Tensor) -> torch.Tensor:
        # sign: the mean magnitude is the L2-best single level; the others span the max.
        mag = vals.abs()
        s = mag.mean(1, keepdim=True) if self.bits == 1 else mag.amax(1, keepdim=True)
        return s.to(SCALE_DTYPE)

    def _quantize(self, vals: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Integer codes (in [0, 2**bits) except int8's signed codes) for ``vals``."""
        # A zero scale means an all-zero chunk: any code decodes to 0 there.
        s = scale.to(vals.dtype).masked_fill(scale == 0, 1.0)
        if self.bits == 1:
            return (vals < 0).to(torch.int64)
        if self.bits == 2:
            # Levels (2c - 3) / 3 * s for c in 0..3: -1, -1/3, 1/3, 1 of the max.
            return torch.round((vals / s * 3 + 3) / 2).clamp_(0, 3).to(torch.int64)
        return torch.round(vals / s * 127).clamp_(-127, 127).to(torch.int8)

    def _dequantize(self, codes: torch.Tensor, scale: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
        s = scale.to(dtype)
        if self.bits == 1:
            return (1 - 2 * codes.to(dtype)) * s
        if self.bits == 2:
            return (2 * codes.to(dtype) - 3) / 3 * s
        return codes.to(dtype) * (s / 127)

    def encode(self, idx: torch.Tensor, vals: torch.Tensor,
               block_numel: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Packed indices, codes and scales; receivers read the dequantized values."""
        scale = self._scale(vals)
        codes = self._quantize(vals, scale)
        wire_codes = codes if self.bits == 8 else pack_bits(codes.reshape(-1), self.bits)
        return ([self._pack_indices(idx, block_numel), wire_codes, scale.reshape(-1)],
                self._dequantize(codes, scale, vals.dtype))

    def decode(self, views: list[torch.Tensor], blocks: int, k: int, block_numel: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Unpacked indices and dequantized values of every replica."""
        idx = self._unpack_indices(views[0], blocks, k, block_numel)
        codes = views[1]
        if self.bits != 8:
            codes = unpack_bits(codes, self.bits, blocks * k).view(-1, blocks, k)
        return idx, self._dequantize(codes, views[2].unsqueeze(-1), dtype)


__all__ = ["VALUE_FORMATS", "DtypeFormat", "PackedFloatFormat", "QuantizedFormat", "WireFormat",
           "make_format"]


def make_format(value_format: str | None,
                value_dtype: torch.dtype | None = None) -> WireFormat:
    """The wire format called ``value_format``; None keeps today's layout in ``value_dtype``."""
    if value_format is None:
        if value_dtype is None:
            raise ValueError("make_format needs a value_format or a value_dtype, got neither.")
        names = {v: k for k, v in _FLOATS.items()}
        return DtypeFormat(value_dtype, names.get(value_dtype, str(value_dtype)))
    check_value_format(value_format)
    if value_format in _FLOATS:
        return DtypeFormat(_FLOATS[value_format], value_format)
    if value_format.endswith("-packed"):
        base = value_format.removesuffix("-packed")
        return PackedFloatFormat(_FLOATS[base], value_format)
    return QuantizedFormat(value_format, {"int8": 8, "int2": 2, "sign": 1}[value_format])
