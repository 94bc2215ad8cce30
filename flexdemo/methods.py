"""Named training methods: which wiring each needs and the optimizer that implements it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .hsdp import replicate_group, shard_group
from .optimizer import FlexDeMo

METHODS = ("flexdemo", "demo", "hsdp-adamw", "diloco", "random", "striding", "none")

# Starting points for each method; the experiments layer tunes them.
DEFAULT_LR = {
    "flexdemo": 1e-3,
    "demo": 1e-3,
    "hsdp-adamw": 1e-3,
    "diloco": 1e-3,
    "random": 1e-3,
    "striding": 1e-3,
    "none": 1e-3,
}

_REPLICATOR_OF = {"flexdemo": "demo", "demo": "demo", "diloco": "diloco", "random": "random",
                  "striding": "striding", "none": "none"}


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


def build_optimizer(method: str, model: nn.Module, mesh: DeviceMesh | None, lr: float | None = None,
                    *, topk: int = 32, chunk: int = 64, decay: float = 0.999,
                    value_dtype: torch.dtype = torch.bfloat16, weight_decay: float = 0.0,
                    sign: bool | None = None, base: str | None = None, replicate_every: int = 1,
                    skip_every: int | None = None, rate: float = 0.1, seed: int = 42,
                    H: int = 50, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                    betas: tuple[float, float] = (0.9, 0.999),
                    eps: float = 1e-8) -> torch.optim.Optimizer:
    """Return the optimizer implementing ``method`` for ``model`` on ``mesh``.

    Sharded methods expect ``parallelize(model, mesh, method_uses_inter_all_reduce(method))``
    to have run. ``demo`` expects an unsharded model; every rank is a replica, so its
    replication group is the mesh's replicate group when the shard dim has size 1 (or there is
    no mesh: the default group), else the whole world. ``lr=None`` takes ``DEFAULT_LR``.
    """
    _check_method(method)
    lr = DEFAULT_LR[method] if lr is None else lr
    if method == "hsdp-adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, eps=eps,
                                 weight_decay=weight_decay)
    if method == "demo":
        shard = None
        if mesh is not None and mesh.size(1) == 1:
            replicas = replicate_group(mesh)
        else:
            replicas = dist.group.WORLD
    else:
        if mesh is None:
            raise ValueError(f"method={method!r} needs a (replicate, shard) mesh, got None.")
        shard, replicas = shard_group(mesh), replicate_group(mesh)
    return FlexDeMo(model.parameters(), lr=lr, compression_topk=topk, compression_chunk=chunk,
                    compression_decay=decay, weight_decay=weight_decay, sign=sign,
                    replicator=_REPLICATOR_OF[method], value_dtype=value_dtype,
                    sharding_group=shard, replication_group=replicas, base=base,
                    replicate_every=replicate_every, skip_every=skip_every,
                    compression_rate=rate, seed=seed, sync_every=H, outer_lr=outer_lr,
                    outer_momentum=outer_momentum, betas=betas, eps=eps)
