"""FlexDeMo: decoupled-momentum optimizer over a sharding group and a replication group."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from .replicators import (
    REPLICATORS,
    DeMoReplicator,
    DiLoCoReplicator,
    FullReplicator,
    NoReplicator,
    RandomReplicator,
    Replicator,
    StridingReplicator,
)
from .wire import CommStats

BASES = ("sign", "adamw")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local part of ``t``: the shard of an FSDP2 DTensor, else ``t`` itself."""
    # DTensor.to_local() can hand back a tensor that does not alias the parameter's storage
    # (FSDP2 keeps a padded shard); in-place updates must reach the real local shard.
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _group_size(group: dist.ProcessGroup | None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


class FlexDeMo(torch.optim.Optimizer):
    """Decoupled Momentum (DeMo) and its DeToNATION relatives on (hybrid) sharded parameters.

    Each step works on the local shard of every parameter: the selected replicator exchanges
    (part of) the gradient or momentum with the other replicas over ``replication_group`` in one
    bucketed collective, then sign-SGD or AdamW applies the result with decoupled weight decay.
    ``last_step_comm`` and ``comm_totals`` count the bytes and calls on the replication group.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        compression_topk: int = 32,
        compression_chunk: int = 64,
        compression_decay: float = 0.999,
        weight_decay: float = 0.0,
        sign: bool | None = None,
        replicator: str = "demo",
        value_dtype: torch.dtype = torch.bfloat16,
        sharding_group: dist.ProcessGroup | None = None,
        replication_group: dist.ProcessGroup | None = None,
        *,
        base: str | None = None,
        replicate_every: int = 1,
        skip_every: int | None = None,
        compression_rate: float = 0.1,
        seed: int = 42,
        sync_every: int = 50,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ):
        """Build the optimizer; ``sign``/``base`` default to sign-SGD (AdamW, no sign, for diloco).

        Args:
            params: parameters (plain tensors or FSDP2 DTensors) or parameter groups.
            replicator: one of ``REPLICATORS``.
            value_dtype: dtype of the coefficient values on the wire (float32 reproduces DeMo).
            sharding_group: the intra-node group FSDP2 shards over (informational; FSDP2 does
                the intra-node reduce-scatter). None: parameters are not sharded.
            replication_group: the inter-node group (one rank per node). None: the default group.
            replicate_every / skip_every: replicate only on steps divisible by
                ``replicate_every`` and not by ``skip_every``; other steps fold the gradient into
                the replicator's momentum (if it keeps one) and step on the local gradient.
            compression_rate / seed: fraction of rows (random) or chunks (striding) sent.
            sync_every / outer_lr / outer_momentum: DiLoCo's H and outer Nesterov SGD.
        """
        _check(replicator in REPLICATORS,
               f"replicator={replicator!r} is unknown; use one of {', '.join(REPLICATORS)}.")
        _check(isinstance(lr, (int, float)) and lr >= 0, f"lr={lr!r} must be a number >= 0.")
        _check(isinstance(compression_topk, int) and compression_topk > 0,
               f"compression_topk={compression_topk!r} must be a positive integer.")
        _check(isinstance(compression_chunk, int) and compression_chunk > 0,
               f"compression_chunk={compression_chunk!r} must be a positive integer.")
        _check(0.0 <= compression_decay < 1.0,
               f"compression_decay={compression_decay!r} must lie in [0, 1).")
        _check(weight_decay >= 0, f"weight_decay={weight_decay!r} must be >= 0.")
        _check(isinstance(value_dtype, torch.dtype) and value_dtype.is_floating_point,
               f"value_dtype={value_dtype!r} must be a floating-point torch.dtype.")
        base = base if base is not None else ("adamw" if replicator == "diloco" else "sign")
        _check(base in BASES, f"base={base!r} is unknown; use one of {', '.join(BASES)}.")
        sign = sign if sign is not None else replicator != "diloco"
        _check(isinstance(replicate_every, int) and replicate_every >= 1,
               f"replicate_every={replicate_every!r} must be an integer >= 1.")
        _check(skip_every is None or (isinstance(skip_every, int) and skip_every >= 1),
               f"skip_every={skip_every!r} must be None or an integer >= 1.")
        _check(0.0 < compression_rate <= 1.0,
               f"compression_rate={compression_rate!r} must lie in (0, 1].")
        _check(isinstance(sync_every, int) and sync_every >= 1,
               f"sync_every={sync_every!r} must be an integer >= 1.")
        _check(outer_lr > 0, f"outer_lr={outer_lr!r} must be > 0.")
        _check(0.0 <= outer_momentum < 1.0,
               f"outer_momentum={outer_momentum!r} must lie in [0, 1).")
        _check(0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0,
               f"betas={betas!r} must both lie in [0, 1).")

        defaults = {"lr": lr, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.sign, self.base, self.betas, self.eps = sign, base, betas, eps
        self.replicator_name = replicator
        self.replicate_every, self.skip_every = replicate_every, skip_every
        self.sharding_group = sharding_group
        self.replication_group = replication_group
        self.replicas = _group_size(replication_group)

        self._params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        shards = [local_tensor(p.detach()) for p in self._params]
        self.replicator = self._make_replicator(
            replicator, compression_topk, compression_chunk, compression_decay, value_dtype,
            compression_rate, seed, sync_every, outer_lr, outer_momentum)
        self.replicator.setup(shards, replication_group, self.replicas)
        if base == "adamw":
            self._exp_avg = [torch.zeros_like(s) for s in shards]
            self._exp_avg_sq = [torch.zeros_like(s) for s in shards]
        self.steps = 0
        self.base_steps = 0
        self.last_step_comm = CommStats().as_dict()
        self.comm_totals = CommStats()

    @staticmethod
    def _make_replicator(name: str, topk: int, chunk: int, decay: float,
                         value_dtype: torch.dtype, rate: float, seed: int, sync_every: int,
                         outer_lr: float, outer_momentum: float) -> Replicator:
        if name == "demo":
            return DeMoReplicator(topk, chunk, decay, value_dtype)
        if name == "full":
            return FullReplicator()
        if name == "none":
            return NoReplicator()
        if name == "random":
            return RandomReplicator(decay, rate, seed)
        if name == "striding":
            return StridingReplicator(decay, rate, chunk)
        return DiLoCoReplicator(sync_every, outer_lr, outer_momentum)

    def _replicates(self, step: int) -> bool:
        if self.replicator_name == "diloco":
            return True  # DiLoCo runs on its own sync_every clock.
        if step % self.replicate_every != 0:
            return False
        return self.skip_every is None or step % self.skip_every != 0

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Replicate the gradients as configured and update the local parameter shards."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.steps += 1
        stats = CommStats()
        shards, grads, lrs, wds = [], [], [], []
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                shard = local_tensor(p)
                shards.append(shard)
                # A parameter that took no part in the loss still moves with its replicas.
                grads.append(local_tensor(p.grad) if p.grad is not None
                             else torch.zeros_like(shard))
                lrs.append(group["lr"])
                wds.append(group["weight_decay"])
        replicating = self._replicates(self.steps)
        if replicating:
            updates = self.replicator.replicate(grads, lrs, stats)
        else:
            self.replicator.accumulate(grads, lrs)
            updates = grads
        self._apply(shards, updates, lrs, wds, replicating and self.replicator.owns_updates)
        self.replicator.after_update(shards, lrs, stats)
        self.last_step_comm = stats.as_dict()
        self.comm_totals.add(stats.bytes_sent, stats.bytes_received, stats.calls)
        return loss

    def _apply(self, shards: list[torch.Tensor], updates: list[torch.Tensor], lrs: list[float],
               wds: list[float], owned: bool) -> None:
        self.base_steps += 1
        b1, b2 = self.betas
        for i, (p, u, lr, wd) in enumerate(zip(shards, updates, lrs, wds, strict=True)):
            if p.numel() == 0:
                continue
            if self.sign:
                # In place only on the replicator's own buffers, never on a user's .grad.
                u = u.sign_() if owned else u.sign()
            if wd != 0.0:
                p.mul_(1.0 - lr * wd)
            if self.base == "sign":
                p.add_(u, alpha=-lr)
                continue
            m, v = self._exp_avg[i], self._exp_avg_sq[i]
            m.mul_(b1).add_(u, alpha=1.0 - b1)
            v.mul_(b2).addcmul_(u, u, value=1.0 - b2)
            bias1 = 1.0 - b1 ** self.base_steps
            bias2 = 1.0 - b2 ** self.base_steps
            denom = (v.sqrt() / bias2 ** 0.5).add_(self.eps)
            p.addcdiv_(m, denom, value=-lr / bias1)

    def state_dict(self) -> dict:
        """Everything needed to resume: hyper-parameters, momentum (delta), counters."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        state = {"param_groups": groups, "steps": self.steps, "base_steps": self.base_steps,
                 "replicator_name": self.replicator_name,
                 "replicator": self.replicator.state_dict(),
                 "comm_totals": self.comm_totals.as_dict()}
        if self.base == "adamw":
            state["exp_avg"] = [t.clone() for t in self._exp_avg]
            state["exp_avg_sq"] = [t.clone() for t in self._exp_avg_sq]
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a :meth:`state_dict` saved by an optimizer of the same configuration."""
        name = state_dict.get("replicator_name")
        _check(name == self.replicator_name,
               f"state_dict comes from replicator {name!r} but this optimizer uses "
               f"{self.replicator_name!r}.")
        _check(len(state_dict["param_groups"]) == len(self.param_groups),
               f"state_dict has {len(state_dict['param_groups'])} parameter groups but this "
               f"optimizer has {len(self.param_groups)}.")
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update(saved)
        self.steps = int(state_dict["steps"])
        self.base_steps = int(state_dict["base_steps"])
        self.replicator.load_state_dict(state_dict["replicator"])
        totals = state_dict["comm_totals"]
        self.comm_totals = CommStats(totals["bytes_sent"], totals["bytes_received"],
                                     totals["calls"])
        if self.base == "adamw":
            for dst, src in zip(self._exp_avg + self._exp_avg_sq,
                                state_dict["exp_avg"] + state_dict["exp_avg_sq"], strict=True):
                dst.copy_(src)
