"""Named training methods: the one place a method name becomes a wiring, a replicator and a base."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .hsdp import replicate_group, shard_group
from .optimizer import FlexDeMo
from .replicators import (
    AdaReplicator,
    DeMoReplicator,
    DiLoCoReplicator,
    GossipReplicator,
    NoReplicator,
    RandomReplicator,
    Replicator,
    StridingReplicator,
)
from .replicators.ada import DEFAULT_EVERY, DEFAULT_HIGH, DEFAULT_LOW

METHODS = ("flexdemo", "demo", "hsdp-adamw", "diloco", "random", "striding", "none", "gossip",
           "ada")

# Tuned on lm-tiny, 2 nodes x 2, 300 steps, constant lr (README "Learning rates"): both
# hsdp-adamw and flexdemo degrade sharply above about 1.2e-3.
DEFAULT_LR = {
    "flexdemo": 1e-3,
    "demo": 1e-3,
    "hsdp-adamw": 1e-3,
    "diloco": 1e-3,
    "random": 1e-3,
    "striding": 1e-3,
    "none": 1e-3,
    # Not tuned: the AdamW base of hsdp-adamw at its default.
    "gossip": 1e-3,
    "ada": 1e-3,
}


# FlexDeMo's defaults come from the frontier sweep (README "FlexDeMo at the paper's settings"):
# the paper's 1-D chunks of 64 elements with the top 4 kept reached the target first at
# 100 Mbit/s; its indices are bit-packed (6 bits instead of 16: lossless, 31% fewer bytes).
# Every other method keeps DeMo's original setting: 64 x 64 blocks, top 32, 16-bit indices.
DEFAULT_KNOBS: dict[str, dict[str, Any]] = {
    "flexdemo": {"chunking": "flat", "topk": 4, "packed": True},
}
_DEMO_DEFAULTS: dict[str, Any] = {"chunking": "block", "topk": 32, "packed": False}


def resolve_knobs(method: str, topk: int | None = None, chunking: str | None = None,
                  value_format: str | None = None,
                  value_dtype: torch.dtype = torch.bfloat16) -> tuple[int, str, str | None]:
    """(topk, chunking, value_format) with what was not given taken from ``DEFAULT_KNOBS``."""
    defaults = {**_DEMO_DEFAULTS, **DEFAULT_KNOBS.get(method, {})}
    if value_format is None and defaults["packed"]:
        value_format = "fp32-packed" if value_dtype == torch.float32 else "bf16-packed"
    return (defaults["topk"] if topk is None else topk, chunking or defaults["chunking"],
            value_format)


@dataclass(frozen=True)
class _Recipe:
    """A FlexDeMo method: its replicator class and which knobs (by their one name) it takes."""

    replicator: type[Replicator]
    knobs: tuple[str, ...]
    # DiLoCo's inner optimizer is plain AdamW: the run's ``sign`` knob is the DeMo family's.
    takes_sign: bool = True


_SCHEDULE = ("replicate_every", "skip_every")
_RECIPES = {
    "flexdemo": _Recipe(DeMoReplicator, ("topk", "chunk", "decay", "value_dtype", "value_format",
                                         "chunking", *_SCHEDULE)),
    "demo": _Recipe(DeMoReplicator, ("topk", "chunk", "decay", "value_dtype", "value_format",
                                     "chunking", *_SCHEDULE)),
    "random": _Recipe(RandomReplicator, ("rate", "decay", "seed", *_SCHEDULE)),
    "striding": _Recipe(StridingReplicator, ("rate", "decay", "chunk", *_SCHEDULE)),
    "diloco": _Recipe(DiLoCoReplicator, ("diloco_h", "outer_lr", "outer_momentum"),
                      takes_sign=False),
    "none": _Recipe(NoReplicator, ()),
    # Gossip's local step is plain AdamW, as DiLoCo's inner one.
    "gossip": _Recipe(GossipReplicator, ("graph", "replicate_every"), takes_sign=False),
    "ada": _Recipe(AdaReplicator, ("ada_every", "ada_high", "ada_low", "seed", "node_group",
                                   "replicate_every"), takes_sign=False),
}


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"method={method!r} is unknown; use one of {', '.join(METHODS)}.")


def method_uses_sharding(method: str) -> bool:
    """Whether ``method`` expects the model wrapped by :func:`parallelize` (FSDP2)."""
    _check_method(method)
    return method != "demo"


def method_uses_inter_all_reduce(method: str) -> bool:
    """Whether ``method`` keeps FSDP2's inter-node gradient all-reduce on."""
    _check_method(method)
    return method == "hsdp-adamw"


def _make_replicator(method: str, **knobs: Any) -> Replicator:
    """The replicator of FlexDeMo ``method``, built from the knobs it takes (others ignored)."""
    recipe = _RECIPES[method]
    return recipe.replicator(**{k: knobs[k] for k in recipe.knobs if k in knobs})


def _replication_group(method: str, mesh: DeviceMesh | None) -> dist.ProcessGroup | None:
    if method == "demo":
        # Unsharded: every rank is a replica. The mesh's replicate group is the world when
        # its shard dim has size 1 (or there is no mesh: the default group).
        if mesh is not None and mesh.size(1) == 1:
            return replicate_group(mesh)
        return dist.group.WORLD
    return None if mesh is None else replicate_group(mesh)


def _node_group(mesh: DeviceMesh | None) -> dist.ProcessGroup | None:
    """The ranks of this rank's node, which Ada's spread is summed over (None: one rank each)."""
    return None if mesh is None or mesh.size(1) == 1 else shard_group(mesh)


def build_optimizer(method: str, model: nn.Module, mesh: DeviceMesh | None, lr: float | None = None,
                    *, topk: int | None = None, chunk: int = 64, decay: float = 0.999,
                    value_dtype: torch.dtype = torch.bfloat16, weight_decay: float = 0.0,
                    sign: bool | None = None, base: str | None = None, replicate_every: int = 1,
                    skip_every: int | None = None, rate: float = 0.1, seed: int = 42,
                    diloco_h: int = 50, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                    betas: tuple[float, float] = (0.9, 0.999),
                    eps: float = 1e-8, chunking: str | None = None,
                    value_format: str | None = None,
                    graph: str = "ring", ada_every: int = DEFAULT_EVERY,
                    ada_high: float = DEFAULT_HIGH,
                    ada_low: float = DEFAULT_LOW) -> torch.optim.Optimizer:
    """Return the optimizer implementing ``method`` for ``model`` on ``mesh``.

    Sharded methods expect ``parallelize(model, mesh, method_uses_inter_all_reduce(method))``
    to have run. ``hsdp-adamw`` is ``torch.optim.AdamW``: FSDP2's all-reduce averages the
    gradients across nodes. ``demo`` expects an unsharded model; every rank is a replica.
    ``mesh=None`` for the other methods means no sharding, the default group as replicas.
    ``lr=None`` takes ``DEFAULT_LR``; ``topk``, ``chunking`` and ``value_format`` left None take
    the method's ``DEFAULT_KNOBS`` (``resolve_knobs``). Each knob keeps its name from the run
    config to the replicator class; knobs a method does not take are ignored. ``ada`` also
    gets the mesh's shard group, over which the ranks of a node agree on the measured spread.
    """
    _check_method(method)
    lr = DEFAULT_LR[method] if lr is None else lr
    if method == "hsdp-adamw":
        if mesh is None:
            raise ValueError("method='hsdp-adamw' needs a (replicate, shard) mesh, got None.")
        return torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, eps=eps,
                                 weight_decay=weight_decay)
    topk, chunking, value_format = resolve_knobs(method, topk, chunking, value_format,
                                                 value_dtype)
    knobs = {"topk": topk, "chunk": chunk, "decay": decay, "value_dtype": value_dtype,
             "value_format": value_format, "chunking": chunking,
             "replicate_every": replicate_every, "skip_every": skip_every, "rate": rate,
             "seed": seed, "diloco_h": diloco_h, "outer_lr": outer_lr,
             "outer_momentum": outer_momentum, "graph": graph, "ada_every": ada_every,
             "ada_high": ada_high, "ada_low": ada_low, "node_group": _node_group(mesh)}
    replicator = _make_replicator(method, **knobs)
    return FlexDeMo(model.parameters(), lr=lr, weight_decay=weight_decay,
                    sign=sign if _RECIPES[method].takes_sign else None, replicator=replicator,
                    replication_group=_replication_group(method, mesh), base=base,
                    betas=betas, eps=eps)
