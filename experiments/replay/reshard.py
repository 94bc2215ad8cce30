"""Re-shard on replay: a recorded trace's sharded collectives resized to another shard count.

FSDP2 shards every parameter on dim 0 over the G ranks of a node, padding dim 0 to a multiple of
G, so a unit's shard is ceil(d0 / G) rows of each of its parameters. From that layout (run.json's
`layout`, or the built-in workload's model for runs recorded before it was kept) each sharded
collective's payload is recomputed for the target's G:

- FSDP2's reduce-scatter input (G shards) and all-gather input (one shard), per unit, and
  hsdp-adamw's inter-node all-reduce of each rank's shard: exact.
- Dense exchanges of the whole shard (diloco's outer all-reduce, gossip's and ada's messages,
  flexdemo's dense exchange: a bf16 all-reduce of the shard's DCT coefficients, sized like
  hsdp-adamw's all-reduce of the shard's gradients): exact.
- Compressed views of the shard (flexdemo/DeMo top-k of its chunks, random and striding
  subsets): scaled by the shard's element count, ~1/G (approximate: chunk boundaries and index
  packing are not recomputed).
- ada's spread probe samples a fixed number of entries per rank: kept as recorded.
- Methods that do not shard (demo: every rank a whole replica) send what they recorded at any G.

A payload that fits none of these makes the replay refuse (ConfigError) rather than guess. The
node count never changes a shard: shards live inside a node.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import pandas as pd

from experiments.config import RunConfig
from experiments.errors import ConfigError
from netsim.trace import TRAIN

__all__ = ["Reshard", "run_layout", "shard_elements", "shard_ratio", "reshard_trace",
           "MISSING_INTRA"]

# Replicators whose inter-node payload is a compressed or partial view of each rank's shard.
_SHARD_PROPORTIONAL = {"demo": "top-k of the shard's chunks", "random": "a random subset",
                       "striding": "a strided subset"}
# Ops of those replicators that carry the whole shard, dense, and so re-shard exactly: DeMo's dense
# exchange all-reduces every coefficient of the shard (its top-k goes by all-gather).
_DENSE_OPS = {"demo": ("all_reduce",)}
# Replicators whose payloads that are no shard (a probe of fixed size) stay as recorded.
_FIXED = {"ada": "ada's spread probe (a fixed sample per rank)"}
# Element sizes a payload may be counted in: fp32, bf16/fp16, fp64/int64, int8/bytes.
_ITEMSIZES = (4, 2, 8, 1)
# Ops whose payload is G shards (the reduce-scatter input); every other op hands in one shard.
_FULL_OPS = ("reduce_scatter",)
_OPS = ("reduce_scatter", "all_gather", "all_reduce", "send", "recv", "broadcast")
# The start of the note on a recording of one rank per node, which has no intra-node traffic.
MISSING_INTRA = "the recording has one rank per node, so no intra-node FSDP2 traffic to resize"


@dataclass(frozen=True)
class Reshard:
    """A trace resized to another shard count, and one line per rule that resized it."""

    trace: pd.DataFrame
    notes: tuple[str, ...]


def shard_elements(shape: Iterable[int], shards: int) -> int:
    """Elements of one rank's FSDP2 shard of a parameter: ceil(dim0 / shards) rows, padded."""
    shape = list(shape) or [1]
    return math.ceil(shape[0] / shards) * math.prod(shape[1:])


def run_layout(meta: dict, config: RunConfig) -> tuple[list, str] | None:
    """The run's FSDP2 layout and where it came from: run.json, or the built-in model."""
    recorded = meta.get("layout")
    if recorded:
        return recorded, "recorded in run.json"
    import torch

    import flexdemo
    from experiments.workloads import builtin_model

    with torch.device("meta"):  # shapes only: no memory, no init
        model = builtin_model(config.workload)
    if model is None:
        return None
    return flexdemo.shard_layout(model), f"derived from the {config.workload} model"


def _candidates(layout: list, g: int, g_new: int, full: bool) -> dict[int, int]:
    """Element counts a payload of one op family may be (per unit, or all units) -> at g_new."""
    per_unit = [(sum(shard_elements(s, g) for s in unit),
                 sum(shard_elements(s, g_new) for s in unit)) for unit in layout]
    per_unit.append((sum(a for a, _ in per_unit), sum(b for _, b in per_unit)))
    scale = (g, g_new) if full else (1, 1)
    return {a * scale[0]: b * scale[1] for a, b in per_unit}


def _exact(nbytes: int, candidates: dict[int, int]) -> set[int]:
    """Every resized byte count that `nbytes` is as a payload of some candidate element count."""
    found = set()
    for elements, resized in candidates.items():
        for itemsize in _ITEMSIZES:
            if elements and nbytes == elements * itemsize:
                found.add(resized * itemsize)
    return found


def _refuse(method: str, g: int, g_new: int, why: str) -> ConfigError:
    return ConfigError(f"cannot re-shard the {method} run from {g} to {g_new} ranks per node: "
                       f"{why}; replay it with --gpus-per-node {g}.")


def reshard_trace(trace: pd.DataFrame, config: RunConfig, layout: tuple[list, str] | None,
                  g_new: int) -> Reshard:
    """`trace` with each sharded training payload resized from the run's ranks per node to g_new.

    ConfigError (one sentence) where a payload cannot be resized: no layout, or a payload that
    matches no shard of it and belongs to no method rule (module docstring).
    """
    record, g = config.record, config.gpus_per_node
    if not record.shards:
        return Reshard(trace, (f"{config.method} does not shard (every rank a whole replica): "
                               f"payloads as recorded at {g_new} ranks per node",))
    if layout is None:
        raise _refuse(config.method, g, g_new, f"run.json has no parameter layout and workload "
                      f"{config.workload!r} is not built in")
    units, source = layout
    sizes, kinds = _resized_sizes(trace, config, units, g_new)
    rows = (trace["phase"] == TRAIN) & trace["bytes"].gt(0)
    resized = trace.copy()
    picked = trace.loc[rows]
    resized.loc[rows, "bytes"] = [
        sizes[key] for key in zip(picked["op"], picked["inter"].astype(bool),
                                  picked["bytes"].astype(int), strict=True)
    ]
    return Reshard(resized, _notes(config, source, g_new, kinds, units))


def _resized_sizes(trace: pd.DataFrame, config: RunConfig, units: list,
                   g_new: int) -> tuple[dict[tuple[str, bool, int], int], set[str]]:
    """(op, inter, recorded bytes) -> resized bytes for every training payload, and rules used."""
    g = config.gpus_per_node
    train = trace[(trace["phase"] == TRAIN) & trace["bytes"].gt(0)]
    per_shard = {full: _candidates(units, g, g_new, full) for full in (False, True)}
    ratio = shard_ratio(units, g, g_new)
    sizes: dict[tuple[str, bool, int], int] = {}
    kinds: set[str] = set()
    keys = zip(train["op"], train["inter"].astype(bool), train["bytes"].astype(int), strict=True)
    for op, inter, nbytes in set(keys):
        size, kind = _one_size(config, g_new, op, inter, nbytes, per_shard, ratio)
        sizes[(op, inter, nbytes)] = size
        kinds.add(kind)
        if kind == "exact":
            kinds.add(f"{'inter' if inter else 'intra'}-node {op}")
    return sizes, kinds


def _one_size(config: RunConfig, g_new: int, op: str, inter: bool, nbytes: int,
              per_shard: dict[bool, dict[int, int]], ratio: float) -> tuple[int, str]:
    """One payload resized, and the rule that did it ("exact", "proportional" or "fixed")."""
    method, g, replicator = config.method, config.gpus_per_node, config.record.replicator
    if inter and replicator in _SHARD_PROPORTIONAL and op not in _DENSE_OPS.get(replicator, ()):
        return round(nbytes * ratio), "proportional"
    found = _exact(nbytes, per_shard[op in _FULL_OPS])
    if len(found) > 1:
        raise _refuse(method, g, g_new, f"its {op} of {nbytes} bytes fits several FSDP2 units "
                      "of different sizes")
    if found:
        return found.pop(), "exact"
    if replicator in _FIXED:
        return nbytes, "fixed"
    where = "inter-node" if inter else "intra-node"
    raise _refuse(method, g, g_new, f"its {where} {op} of {nbytes} bytes matches no shard of the "
                  "parameter layout")


def shard_ratio(units: list, g: int, g_new: int) -> float:
    """A rank's whole shard at g_new over its shard at g (padding included)."""
    total = sum(shard_elements(s, g) for unit in units for s in unit)
    return sum(shard_elements(s, g_new) for unit in units for s in unit) / total


def _notes(config: RunConfig, source: str, g_new: int, kinds: set[str], units: list) -> tuple:
    """One line per re-sharding rule the replay applied."""
    g, replicator = config.gpus_per_node, config.record.replicator
    ratio = shard_ratio(units, g, g_new)
    notes = [f"re-sharded from {g} to {g_new} ranks per node with the FSDP2 layout {source} "
             f"({len(units)} units; a shard is ceil(dim0/{g_new}) rows, FSDP2's padding): "
             f"each rank's shard x{ratio:.4g}; the node count changes no shard"]
    if "exact" in kinds:
        ops = ", ".join(sorted(k for k in kinds if k.endswith(tuple(_OPS))))
        notes.append(f"exact: {ops} (FSDP2's reduce-scatter takes G shards, every other op one "
                     "shard of a unit or of the whole model)")
    if "proportional" in kinds:
        notes.append(f"approximate: {config.method}'s inter-node payload "
                     f"({_SHARD_PROPORTIONAL[replicator]}) scaled with the shard's element count "
                     f"x{ratio:.4g} (chunk boundaries and index packing not recomputed)")
    if "fixed" in kinds:
        notes.append(f"as recorded: {_FIXED[replicator]}")
    if g == 1 and g_new > 1:
        notes.append(f"{MISSING_INTRA}: the replay adds none (the target's intra-node traffic "
                     "is missing; a recording with FSDP2 marks gets it added)")
    return tuple(notes)
