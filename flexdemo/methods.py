"""Named training methods: which wiring each needs and the optimizer that implements it."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from .hsdp import replicate_group, shard_group
from .optimizer import FlexDeMo
from .wire import CommStats, all_reduce_bytes

METHODS = ("flexdemo", "demo", "hsdp-adamw", "diloco", "random", "striding", "none")

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
}

_REPLICATOR_OF = {"flexdemo": "demo", "demo": "demo", "diloco": "diloco", "random": "random",
                  "striding": "striding", "none": "none"}


class HSDPAdamW(torch.optim.AdamW):
    """AdamW on an HSDP model whose FSDP2 all-reduce averages gradients across nodes.

    ``last_step_comm`` reports what FSDP2 puts on the replication group each step: one
    all-reduce per FSDP2 module, of its reduce-scattered gradient shard (dim 0 padded to a
    multiple of the shard-group size, as FSDP2 does).
    """

    def __init__(self, model: nn.Module, mesh: DeviceMesh, **adamw_kwargs):
        """Wrap ``model.parameters()``; ``mesh`` gives the shard and replicate sizes."""
        super().__init__(model.parameters(), **adamw_kwargs)
        owner: dict[int, int] = {}
        # model.modules() lists parents before children: the innermost FSDP2 module wins.
        for n, module in enumerate(model.modules()):
            if isinstance(module, FSDPModule):
                for p in module.parameters():
                    owner[id(p)] = n
        shards, replicas = mesh.size(1), mesh.size(0)
        per_group: dict[int, int] = {}
        for p in model.parameters():
            if id(p) in owner and p.requires_grad:
                rows = math.ceil(p.shape[0] / shards) if p.dim() else 1
                numel = rows * math.prod(p.shape[1:])
                per_group[owner[id(p)]] = (per_group.get(owner[id(p)], 0)
                                           + numel * p.element_size())
        self.step_comm = CommStats()
        if replicas > 1:
            for nbytes in per_group.values():
                n = all_reduce_bytes(nbytes, replicas)
                self.step_comm.add(n, n)
        self.last_step_comm = CommStats().as_dict()
        self.comm_totals = CommStats()

    def step(self, closure=None):  # type: ignore[override]
        """One AdamW step; the all-reduce it accounts for ran during backward."""
        loss = super().step(closure)
        self.last_step_comm = self.step_comm.as_dict()
        self.comm_totals.add(self.step_comm.bytes_sent, self.step_comm.bytes_received,
                             self.step_comm.calls)
        return loss


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
    ``mesh=None`` for the other FlexDeMo methods means no sharding, the default group as
    replicas. ``sign`` applies to the DeMo family only (diloco's inner AdamW never takes the
    sign); knobs a method does not use are ignored.
    """
    _check_method(method)
    lr = DEFAULT_LR[method] if lr is None else lr
    if method == "diloco":
        # ``sign`` is a knob of the DeMo family; DiLoCo's inner optimizer is plain AdamW.
        sign = False
    if method == "hsdp-adamw":
        if mesh is None:
            raise ValueError("method='hsdp-adamw' needs a (replicate, shard) mesh, got None.")
        return HSDPAdamW(model, mesh, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if method == "demo":
        shard = None
        if mesh is not None and mesh.size(1) == 1:
            replicas = replicate_group(mesh)
        else:
            replicas = dist.group.WORLD
    elif mesh is None:
        shard, replicas = None, None  # no sharding; every rank of the default group a replica
    else:
        shard, replicas = shard_group(mesh), replicate_group(mesh)
    return FlexDeMo(model.parameters(), lr=lr, compression_topk=topk, compression_chunk=chunk,
                    compression_decay=decay, weight_decay=weight_decay, sign=sign,
                    replicator=_REPLICATOR_OF[method], value_dtype=value_dtype,
                    sharding_group=shard, replication_group=replicas, base=base,
                    replicate_every=replicate_every, skip_every=skip_every,
                    compression_rate=rate, seed=seed, sync_every=H, outer_lr=outer_lr,
                    outer_momentum=outer_momentum, betas=betas, eps=eps)
