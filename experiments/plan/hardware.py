"""Declared hardware and compute: a GPU table, and compute per step by the 6·N·tokens rule.

The rule: a training step costs 6 FLOPs per parameter per token (2 in the forward, 4 in the
backward), so a GPU's compute per step is 6 · N · tokens / (peak dense bf16 FLOP/s · MFU), with
N the model's parameters and tokens the GPU's own (batch x sequence). Attention's own FLOPs
(growing with the sequence) are not in it. Each FSDP2 unit gets the share of its parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from experiments.errors import ConfigError

__all__ = ["GPUS", "DEFAULT_MFU", "Gpu", "StepCompute", "gpu", "rule_compute", "given_compute"]


@dataclass(frozen=True)
class Gpu:
    """One accelerator: peak dense bf16 FLOP/s and memory, and where the figures come from."""

    name: str
    peak_flops: float
    memory_bytes: int
    source: str


# Peak dense (no sparsity) bf16 tensor FLOP/s and memory of each GPU, from the vendors' sheets.
GPUS: dict[str, Gpu] = {
    # NVIDIA H100 datasheet, SXM: BF16 Tensor Core 1,979 TFLOPS with sparsity (989 dense), 80 GB
    "h100": Gpu("h100", 989e12, 80 * 10**9, "NVIDIA H100 SXM datasheet"),
    # NVIDIA H200 datasheet, SXM: BF16 Tensor Core 1,979 TFLOPS with sparsity (989 dense), 141 GB
    "h200": Gpu("h200", 989e12, 141 * 10**9, "NVIDIA H200 SXM datasheet"),
    # NVIDIA A100 datasheet, SXM 80GB: BF16 Tensor Core 312 TFLOPS (624 with sparsity), 80 GB
    "a100": Gpu("a100", 312e12, 80 * 10**9, "NVIDIA A100 80GB SXM datasheet"),
    # NVIDIA DGX B200 datasheet: 8 GPUs, 1,440 GB in all (180 GB each); HGX B200 FP16/BF16
    # Tensor Core 4.5 PFLOPS with sparsity per GPU (2.25 dense)
    "b200": Gpu("b200", 2.25e15, 180 * 10**9, "NVIDIA DGX/HGX B200 datasheets"),
    # AMD Instinct MI300X datasheet: peak BF16 1,307.4 TFLOPS dense (2,614.9 with sparsity),
    # 192 GB HBM3
    "mi300x": Gpu("mi300x", 1307.4e12, 192 * 10**9, "AMD Instinct MI300X datasheet"),
    # NVIDIA L40S datasheet: BF16 Tensor Core 362.05 TFLOPS (733 with sparsity), 48 GB GDDR6
    "l40s": Gpu("l40s", 362.05e12, 48 * 10**9, "NVIDIA L40S datasheet"),
}

# Model FLOPs utilization when not given: Meta's Llama 3 paper (arXiv 2407.21783, Table 4)
# reports 38-43% BF16 MFU training on H100s; 0.4 sits inside that range.
DEFAULT_MFU = 0.4


def gpu(name: str) -> Gpu:
    """The table's GPU `name` (ConfigError, one sentence, naming the known ones)."""
    key = name.lower() if isinstance(name, str) else name
    if key not in GPUS:
        raise ConfigError(f"--gpu {name!r} is unknown; use one of {', '.join(GPUS)}.")
    return GPUS[key]


@dataclass(frozen=True)
class StepCompute:
    """One GPU's compute per training step, per FSDP2 unit and phase, and how it was found."""

    forward_s: tuple[float, ...]
    """Per unit (the layout's order): its forward's seconds."""
    backward_s: tuple[float, ...]
    """Per unit: its backward's seconds."""
    optimizer_s: float
    """The optimizer step's seconds."""
    rule: str
    """How these were found, in words (printed with the plan)."""
    root_tail_s: float = 0.0
    """Of the root's backward (the last unit's ``backward_s``), the seconds computed after every
    block's backward (the embedding's gradient): measured in a trace; 0 by the rule."""
    root_end_s: float = 0.0
    """Of the root's backward, the seconds computed after its gradient reduction was issued,
    before the optimizer step (the rest of FSDP2's post-backward, the loop's work before
    ``opt.step``), while the last reductions run: measured in a trace; 0 by the rule."""

    @property
    def total_s(self) -> float:
        """Seconds of compute in one step."""
        return sum(self.forward_s) + sum(self.backward_s) + self.optimizer_s


def _split(seconds: float, unit_params: list[int]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Forward (1/3) and backward (2/3) of `seconds`, shared among units by their parameters."""
    total = sum(unit_params)
    shares = [p / total for p in unit_params]
    return (tuple(seconds / 3 * s for s in shares), tuple(seconds * 2 / 3 * s for s in shares))


def rule_compute(unit_params: list[int], device: Gpu, mfu: float, batch: int, seq: int,
                 optimizer_s: float = 0.0) -> StepCompute:
    """Compute per step of one GPU by 6·N·tokens over (peak · mfu) (module docstring)."""
    if isinstance(mfu, bool) or not isinstance(mfu, int | float) or not 0 < mfu <= 1:
        raise ConfigError(f"--mfu {mfu!r} must be a fraction in (0, 1], such as "
                          f"{DEFAULT_MFU}.")
    for flag, value in (("--batch", batch), ("--seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{flag} {value!r} must be a whole number >= 1 (sequences per GPU "
                              "and tokens per sequence).")
    n, tokens = sum(unit_params), batch * seq
    seconds = 6 * n * tokens / (device.peak_flops * mfu)
    forward, backward = _split(seconds, unit_params)
    rule = (f"compute: 6 x N x tokens / (peak x MFU) = 6 x {n:,} x {tokens:,} tokens per GPU "
            f"({batch} x {seq}) / ({device.peak_flops / 1e12:.6g} TFLOP/s {device.name} dense "
            f"bf16, {device.source} x MFU {mfu:g}) = {seconds:.4g} s per step; forward 1/3, "
            "backward 2/3, each unit by its share of the parameters; attention's own FLOPs not "
            f"counted; optimizer step {optimizer_s:g} s")
    return StepCompute(forward, backward, float(optimizer_s), rule)


def given_compute(unit_params: list[int], step_s: float, optimizer_s: float = 0.0) -> StepCompute:
    """Compute per step as given (--step-compute), split as the rule splits it."""
    if isinstance(step_s, bool) or not isinstance(step_s, int | float) or not (
            math.isfinite(step_s) and step_s > 0):
        raise ConfigError(f"--step-compute {step_s!r} must be a positive number of seconds.")
    forward, backward = _split(float(step_s), unit_params)
    rule = (f"compute: {step_s:g} s per step as given (--step-compute); forward 1/3, backward 2/3, "
            f"each unit by its share of the parameters; optimizer step {optimizer_s:g} s")
    return StepCompute(forward, backward, float(optimizer_s), rule)
