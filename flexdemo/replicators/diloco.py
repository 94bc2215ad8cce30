"""DiLoCo: local inner steps; every ``diloco_h`` steps an outer Nesterov step on the mean."""

from __future__ import annotations

from typing import Any

import torch

from ..knobs import DiLoCoKnobs
from ..wire import CommStats
from .base import Group, Replicator, copy_state, mean_payload


def outer_payload(numels: list[int], itemsize: int = 4) -> tuple[str, int]:
    """DiLoCo's outer sync of local shards of ``numels`` elements: the all-reduce of their
    pseudo-gradient (the parameters' dtype, ``itemsize`` bytes) and the bytes each rank hands
    in, as :meth:`DiLoCoReplicator.after_update` posts it."""
    return mean_payload(sum(numels), itemsize)


class DiLoCoReplicator(Replicator):
    """DiLoCo (Douillard et al.): replicas train alone for ``diloco_h`` steps, then synchronise.

    On a synchronising step the pseudo-gradient (last synchronised parameters minus the current
    ones) is averaged over the replicas in one all-reduce and drives an outer
    ``torch.optim.SGD(nesterov=True)`` step from the synchronised parameters, as torchft does;
    every replica then continues from the result. The inner optimizer is the base (AdamW, no sign).
    Knobs: :class:`flexdemo.knobs.DiLoCoKnobs` (``diloco_h``, ``outer_lr``, ``outer_momentum``).
    """

    name = "diloco"
    knobs_type = DiLoCoKnobs
    default_base = "adamw"
    default_sign = False

    def __init__(self, knobs: DiLoCoKnobs | None = None, **given: Any) -> None:
        super().__init__(knobs, **given)
        self.replicate_every = self.diloco_h  # synchronise every H steps

    def setup(self, params: list[torch.Tensor], group: Group, ranks: int) -> None:
        """Remember the starting point and build the outer optimizer over it."""
        super().setup(params, group, ranks)
        self.anchor = [p.detach().clone() for p in params]
        self.outer = torch.optim.SGD(self.anchor, lr=self.outer_lr,
                                     momentum=self.outer_momentum, nesterov=True)

    def replicate(self, grads: list[torch.Tensor], lrs: list[float],
                  stats: CommStats) -> list[torch.Tensor]:
        """The inner step of a synchronising step is local too; the sync follows it."""
        return grads

    def after_update(self, params: list[torch.Tensor], stats: CommStats) -> None:
        """Average the pseudo-gradient, take the outer step, move every replica there."""
        pseudo = self._all_reduce_mean(
            [a - p for a, p in zip(self.anchor, params, strict=True)], stats)
        for a, g in zip(self.anchor, pseudo, strict=True):
            a.grad = g
        self.outer.step()
        for a, p in zip(self.anchor, params, strict=True):
            a.grad = None
            p.copy_(a)

    def state_dict(self) -> dict:
        """The synchronised parameters and the outer optimizer's momentum."""
        return {"anchor": [a.clone() for a in self.anchor], "outer": self.outer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore the synchronised parameters and the outer momentum."""
        copy_state(self.anchor, state["anchor"])
        self.outer.load_state_dict(state["outer"])
