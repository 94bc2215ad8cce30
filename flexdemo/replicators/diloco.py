"""DiLoCo: local inner steps; every ``diloco_h`` steps an outer Nesterov step on the mean."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..knobs import DiLoCoKnobs
from ..program import Periodic
from ..wire import CommStats
from .base import Group, Replicator, copy_state, mean_payload
from .outer_wire import make_outer_wire


def outer_payload(numels: list[int], itemsize: int = 4,
                  outer_format: str = "fp32") -> tuple[str, int]:
    """DiLoCo's outer sync of local shards of ``numels`` elements: the collective of their
    pseudo-gradient and the bytes each rank hands in, as :meth:`DiLoCoReplicator.after_update`
    posts it (fp32: one all-reduce in the parameters' dtype, ``itemsize`` bytes; another
    ``outer_format``: that wire's, :mod:`.outer_wire`)."""
    if outer_format == "fp32":
        return mean_payload(sum(numels), itemsize)
    return make_outer_wire(outer_format).payload(sum(numels))


class DiLoCoReplicator(Replicator):
    """DiLoCo (Douillard et al.): replicas train alone for ``diloco_h`` steps, then synchronise.

    On a synchronising step the pseudo-gradient (last synchronised parameters minus the current
    ones) is averaged over the replicas in one all-reduce and drives an outer
    ``torch.optim.SGD(nesterov=True)`` step from the synchronised parameters, as torchft does
    (plain SGD at ``outer_momentum`` 0, which torch refuses with Nesterov); every replica then
    continues from the result. The inner optimizer is the base (AdamW, no sign).

    ``outer_format`` other than fp32 sends the pseudo-gradient as streaming-diloco does
    (:mod:`.outer_wire`: bf16 all-reduced, int8 and 4bit all-gathered with one fp32 scale);
    what rounding loses stays on this replica and is added to the next pseudo-gradient (error
    feedback). With a single replica nothing crosses a network and the pseudo-gradient is used
    as is. fp32 is the one all-reduce above, unchanged.
    Knobs: :class:`flexdemo.knobs.DiLoCoKnobs` (``diloco_h``, ``outer_lr``, ``outer_momentum``,
    ``outer_format``).
    """

    name = "diloco"
    knobs_type = DiLoCoKnobs
    default_base = "adamw"
    default_sign = False
    sync_in_backward = True

    @classmethod
    def program(cls, knobs: DiLoCoKnobs, shard_shapes: Sequence[tuple[int, ...]],
                replicas: int, *, node: int = 0, graph: str | None = None) -> Periodic:
        """The outer sync of the whole shard every ``diloco_h`` steps (:func:`outer_payload`),
        which could start parameter by parameter in the backward."""
        numels = [math.prod(s) for s in shard_shapes]
        shard = sum(numels)
        op = outer_payload(numels, outer_format=knobs.outer_format)
        # The anchor, the outer momentum (torch's SGD keeps none at momentum 0) and, on a lossy
        # wire, the rounding carried to the next sync; fp32 each.
        state = shard * 4 * (1 + (knobs.outer_momentum > 0)
                             + make_outer_wire(knobs.outer_format).lossy)
        return Periodic(cls(knobs).replicates_on, lambda _step: [op], period=knobs.diloco_h,
                        state_bytes=state, elements=dict(enumerate(numels)))

    def __init__(self, knobs: DiLoCoKnobs | None = None, **given: Any) -> None:
        super().__init__(knobs, **given)
        self.replicate_every = self.diloco_h  # synchronise every H steps
        self.wire = make_outer_wire(self.outer_format)

    def setup(self, params: list[torch.Tensor], group: Group, ranks: int) -> None:
        """Remember the starting point and build the outer optimizer over it."""
        super().setup(params, group, ranks)
        self.anchor = [p.detach().clone() for p in params]
        self.outer = torch.optim.SGD(self.anchor, lr=self.outer_lr,
                                     momentum=self.outer_momentum,
                                     nesterov=self.outer_momentum > 0)
        total = sum(p.numel() for p in params)
        device = params[0].device if params else torch.device("cpu")
        self.residual = torch.zeros(total, dtype=torch.float32, device=device) \
            if self.wire.lossy else None

    def replicate(self, grads: list[torch.Tensor], lrs: list[float],
                  stats: CommStats) -> list[torch.Tensor]:
        """The inner step of a synchronising step is local too; the sync follows it."""
        return grads

    def after_update(self, params: list[torch.Tensor], stats: CommStats) -> None:
        """Average the pseudo-gradient, take the outer step, move every replica there."""
        deltas = [a - p for a, p in zip(self.anchor, params, strict=True)]
        if self.residual is None:
            pseudo = self._all_reduce_mean(deltas, stats)
        else:
            pseudo = self._lossy_mean(deltas, stats)
        for a, g in zip(self.anchor, pseudo, strict=True):
            a.grad = g
        self.outer.step()
        for a, p in zip(self.anchor, params, strict=True):
            a.grad = None
            p.copy_(a)

    def _lossy_mean(self, deltas: list[torch.Tensor], stats: CommStats) -> list[torch.Tensor]:
        """The replicas' mean of ``deltas`` sent in ``outer_format``, its rounding carried."""
        if self.ranks == 1 or not deltas:
            return deltas  # nothing crosses a network
        x = torch.cat([d.reshape(-1).float() for d in deltas]) + self.residual
        payload, read = self.wire.encode(x)
        self.residual = x - read  # error feedback: what rounding lost goes next time
        mean = self.wire.post(payload, x.numel(), self.group, self.ranks, stats).mean()
        return [m.view_as(d).to(d.dtype)
                for m, d in zip(mean.split([d.numel() for d in deltas]), deltas, strict=True)]

    def state_dict(self) -> dict:
        """The synchronised parameters, the outer optimizer's momentum, the carried error."""
        return {"anchor": [a.clone() for a in self.anchor], "outer": self.outer.state_dict(),
                "residual": None if self.residual is None else self.residual.clone()}

    def load_state_dict(self, state: dict) -> None:
        """Restore the synchronised parameters, the outer momentum and the carried error."""
        copy_state(self.anchor, state["anchor"])
        self.outer.load_state_dict(state["outer"])
        if self.residual is not None and state.get("residual") is not None:
            self.residual.copy_(state["residual"])
