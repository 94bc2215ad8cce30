"""Compute at another shape than the recording's: which phase scales with what, stated.

A replay at another number of ranks per node (G) keeps each rank's forward and backward as
recorded: every rank runs its own per-rank batch through the whole model (FSDP2 gathers a unit
before computing it), whatever G. The optimizer step works on the rank's FSDP2 shard (AdamW's
update, DeMo's momentum with its DCT, top-k and decode, DiLoCo's inner step), so its compute is
scaled by the shard's element count at the target over the one it was measured at
(`reshard.shard_elements`, FSDP2's padding included): x0.25 from 2 to 8 ranks per node. Methods
that do not shard keep it. The rule needs the trace's "backward" marks, which split a step into
its two phases; without them the optimizer phase stays as recorded and the replay says so.

At another node count the DeMo family decodes every node's top-k, work that grows with the node
count; the replay keeps the recorded decode and says so rather than guess its cost.
"""

from __future__ import annotations

from dataclasses import dataclass

from experiments.config import RunConfig
from experiments.replay.reshard import shard_ratio

__all__ = ["ShapeCompute", "shape_compute"]

# Replicators whose optimizer phase decodes one payload per node (an all-gather of top-k).
_DECODES_PER_NODE = ("demo",)


@dataclass(frozen=True)
class ShapeCompute:
    """A factor per step phase (forward+backward, optimizer) for the target shape, and why."""

    phase_scale: tuple[float, float] | None
    """None: both phases as measured (the replay then needs no "backward" marks)."""
    notes: tuple[str, ...]


def shape_compute(config: RunConfig, units: list | None, measured_g: int, target: RunConfig,
                  marks: bool, what: str = "the recording's") -> ShapeCompute:
    """How `config`'s compute, measured at `measured_g` ranks per node, carries to `target`.

    `units` is the run's FSDP2 layout (None for a method that does not shard); `marks` whether
    the trace splits its steps into phases; `what` names the measurement in the notes.
    """
    notes: list[str] = []
    scale = None
    g_new = target.gpus_per_node
    if config.record.shards and units is not None and g_new != measured_g:
        ratio = shard_ratio(units, measured_g, g_new)
        if marks:
            scale = (1.0, ratio)
            notes.append(
                f"compute at {g_new} ranks per node: forward+backward per rank as {what} (the "
                f"same per-rank batch through the whole model); the optimizer step x{ratio:.4g}, "
                f"the shard's element count at {g_new} over {measured_g} ranks per node (it "
                "works on the rank's shard)")
        else:
            notes.append(
                f"compute at {g_new} ranks per node: both phases as {what}, the optimizer step "
                f"too, though it works on a shard x{ratio:.4g} the size (the trace has no "
                '"backward" marks to split a step at; record it again to scale it)')
    decodes = config.record.replicator in _DECODES_PER_NODE
    if decodes and target.nodes != config.nodes:
        notes.append(
            f"compute at {target.nodes} nodes: {config.method}'s decode of every node's top-k "
            f"(work that grows with the node count) as {what} at {config.nodes} nodes, not "
            "modeled")
    return ShapeCompute(scale, tuple(notes))
