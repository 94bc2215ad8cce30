"""Base steps: how a replica applies the update its replicator hands back (sign-SGD or AdamW)."""

from __future__ import annotations

import torch
from torch.optim.adamw import adamw

from .knobs import BASES, check_base

__all__ = ["BASES", "AdamWBase", "SignBase", "make_base"]


class SignBase:
    """SGD with decoupled weight decay on the (already signed, if asked) update."""

    name = "sign"

    def apply(self, shards: list[torch.Tensor], updates: list[torch.Tensor],
              lrs: list[float], wds: list[float], carries_lr: bool = False) -> None:
        """p <- p * (1 - lr * wd) - lr * u for every shard (- u when ``carries_lr``)."""
        for p, u, lr, wd in zip(shards, updates, lrs, wds, strict=True):
            if p.numel() == 0:
                continue
            if wd != 0.0:
                p.mul_(1.0 - lr * wd)
            p.add_(u, alpha=-1.0 if carries_lr else -lr)

    def state_dict(self) -> dict:
        """Nothing: the step keeps no state."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore."""


class AdamWBase:
    """AdamW with decoupled weight decay, computed by ``torch.optim.adamw.adamw``.

    This is the functional form of ``torch.optim.AdamW``, not the class: the class keys its
    state by the tensor it updates and reads the update from that tensor's ``.grad``. Here the
    update is the replicator's output, not the parameter's gradient (the optimizer must not
    write the user's ``.grad``), and the rank-local shard is looked up afresh each step because
    FSDP2 may swap a DTensor's local tensor after its lazy init.
    """

    name = "adamw"

    def __init__(self, shards: list[torch.Tensor], betas: tuple[float, float], eps: float) -> None:
        self.betas, self.eps = betas, eps
        self.exp_avg = [torch.zeros_like(s) for s in shards]
        self.exp_avg_sq = [torch.zeros_like(s) for s in shards]
        # torch's AdamW counts steps in one float32 scalar per parameter.
        self.steps = [torch.zeros((), dtype=torch.float32) for _ in shards]

    def apply(self, shards: list[torch.Tensor], updates: list[torch.Tensor],
              lrs: list[float], wds: list[float], carries_lr: bool = False) -> None:
        """One AdamW step of every shard, one call per (lr, weight decay) setting.

        The update is AdamW's gradient. One that ``carries_lr`` (a momentum replicator's
        decoded ``sum decay^k lr grad``) is divided by this step's lr first, so that AdamW sees
        it in gradient units and applies lr exactly once. Left scaled, the lr would cancel in
        ``m / sqrt(v)`` all but for ``eps``, which would act as ``eps / lr`` (1e-5 instead of
        1e-8 at lr 1e-3). Under a constant lr this is AdamW fed the decoded momentum of the raw
        gradients; under a schedule, older gradients keep the lr they were added with,
        relative to this step's. At lr 0 the step moves nothing either way
        and the update goes in as it is.
        """
        if carries_lr:
            updates = [u / lr if lr > 0 else u for u, lr in zip(updates, lrs, strict=True)]
        by_setting: dict[tuple[float, float], list[int]] = {}
        for i, (lr, wd) in enumerate(zip(lrs, wds, strict=True)):
            by_setting.setdefault((lr, wd), []).append(i)
        for (lr, wd), idx in by_setting.items():
            adamw([shards[i] for i in idx], [updates[i] for i in idx],
                  [self.exp_avg[i] for i in idx], [self.exp_avg_sq[i] for i in idx], [],
                  [self.steps[i] for i in idx], amsgrad=False, beta1=self.betas[0],
                  beta2=self.betas[1], lr=lr, weight_decay=wd, eps=self.eps, maximize=False)

    def state_dict(self) -> dict:
        """Both moments and the step count."""
        return {"exp_avg": [t.clone() for t in self.exp_avg],
                "exp_avg_sq": [t.clone() for t in self.exp_avg_sq],
                "steps": [t.clone() for t in self.steps]}

    def load_state_dict(self, state: dict) -> None:
        """Restore both moments and the step count."""
        saved = state["exp_avg"] + state["exp_avg_sq"] + state["steps"]
        live = self.exp_avg + self.exp_avg_sq + self.steps
        if len(saved) != len(live):
            raise ValueError(f"AdamW state holds {len(saved) // 3} tensors but this optimizer has "
                             f"{len(live) // 3}; load a state_dict saved over the same parameters.")
        for dst, src in zip(live, saved, strict=True):
            dst.copy_(src)


def make_base(name: str, shards: list[torch.Tensor], betas: tuple[float, float],
              eps: float) -> SignBase | AdamWBase:
    """The base step called ``name`` (one of ``BASES``) for these shards."""
    check_base(name)
    return AdamWBase(shards, betas, eps) if name == "adamw" else SignBase()
