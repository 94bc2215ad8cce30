"""The replicator interface: what the optimizer calls, and the schedule every replicator owns."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from .._checks import check
from ..knobs import Knobs, ScheduleKnobs
from ..program import Program
from ..wire import CommStats, all_reduce_bytes

Group = dist.ProcessGroup | None


def mean_payload(numel: int, itemsize: int = 4) -> tuple[str, int]:
    """The collective that averages ``numel`` values of ``itemsize`` bytes over the replicas
    (one SUM all-reduce) and the bytes each rank hands in: the sizing the replicators count
    and the planner (``experiments.plan``) plans with."""
    return "all_reduce", numel * itemsize


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: Group) -> object:
    """Post an all-gather of every replica's ``inp`` into ``out`` (ranks x inp); its handle."""
    # torch 2.13 renamed all_gather_into_tensor; older releases only have the old name.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, inp, group=group, async_op=True)


class Replicator:
    """Turns local shard gradients into the updates every replica applies; subclass per scheme.

    The optimizer hands a replicator its local shards once (:meth:`setup`), then on every step
    asks :meth:`replicates_on`; on those steps it calls :meth:`replicate` before the base step
    and :meth:`after_update` after it, on the others :meth:`accumulate`; after the last step,
    :meth:`drain`. Every collective goes over ``group`` (one rank per node) and is recorded in
    the ``CommStats`` it is handed.
    A new scheme is one subclass: set ``name`` and ``knobs_type``, override the hooks it needs,
    and write its :meth:`program` (what it sends when, as data) for a planner and an emulator.

    Its knobs are a ``knobs_type`` (:mod:`flexdemo.knobs`), handed in whole or by name over
    their defaults (``DeMoReplicator(topk=8)``); building checks them once and sets each as an
    attribute of the same name. The base schema is the schedule: ``replicate_every`` and
    ``skip_every`` (replicate only on steps divisible by the first, never on those divisible
    by the second).
    """

    name: ClassVar[str] = "base"
    # The schema of this scheme's knobs: the one place their defaults and checks are written.
    knobs_type: ClassVar[type[Knobs]] = ScheduleKnobs
    # True when the builder must hand in node_group (the ranks of this rank's node).
    uses_node_group: ClassVar[bool] = False
    # The base step and whether it takes the sign of the update, when the optimizer is not told.
    default_base: ClassVar[str] = "sign"
    default_sign: ClassVar[bool] = True
    # True when replicate() returns the replicator's own buffers (the optimizer may then take
    # the sign in place); False when it may return the user's .grad tensors.
    owns_updates: ClassVar[bool] = False
    # True when a replicating step's update already carries the learning rate (a momentum
    # built from lr * grad): a base step without sign then must not multiply by lr again.
    lr_in_update: ClassVar[bool] = False
    # True when its program's sync could start unit by unit in the backward (its
    # Program.unit_elements), which a plan may assume (`sync_in_backward`).
    sync_in_backward: ClassVar[bool] = False

    def __init__(self, knobs: Knobs | None = None, **given: Any) -> None:
        """Build from ``knobs`` (a ``knobs_type``; None: its defaults) with ``given`` replaced."""
        base = self.knobs_type() if knobs is None else knobs
        check(isinstance(base, self.knobs_type),
              f"knobs={base!r} must be a {self.knobs_type.__name__} for {type(self).__name__}.")
        self.knobs = base.with_given(given)
        for f in dataclasses.fields(self.knobs):
            setattr(self, f.name, getattr(self.knobs, f.name))
        # Schemes without a schedule knob replicate on every step.
        self.replicate_every: int = getattr(self.knobs, "replicate_every", 1)
        self.skip_every: int | None = getattr(self.knobs, "skip_every", None)
        self.group: Group = None
        self.ranks = 1

    @classmethod
    def from_reference(cls, *, topk: int | None = None, chunk: int | None = None,
                       decay: float | None = None, value_dtype: torch.dtype | None = None,
                       chunking: str | None = None) -> Replicator:
        """Build from the reference call's ``compression_*`` knobs (those this scheme reads)."""
        given = {"topk": topk, "chunk": chunk, "decay": decay, "value_dtype": value_dtype,
                 "chunking": chunking}
        return cls(**{k: v for k, v in given.items() if k in cls.knobs_type.names()})

    @classmethod
    def program(cls, knobs: Knobs, shard_shapes: Sequence[tuple[int, ...]], replicas: int, *,
                node: int = 0, graph: str | None = None) -> Program | None:
        """This scheme's exchange, step by step (:mod:`flexdemo.program`), as one rank runs it
        whose local shards have ``shard_shapes`` (fp32) among ``replicas`` replicas, written
        from the scheme's own sizing and schedule; None: it has none (a planner refuses it).

        ``node`` is the rank's replica (node index: a gossip's neighbours); ``graph`` the graph
        a scheme that picks its own (Ada) gossips on (None: where it starts). ValueError (one
        sentence) where the knobs cannot run on these shards.
        """
        return None

    def replicates_on(self, step: int) -> bool:
        """Whether the 1-based optimizer step ``step`` communicates."""
        if step % self.replicate_every != 0:
            return False
        return self.skip_every is None or step % self.skip_every != 0

    def setup(self, params: list[torch.Tensor], group: Group, ranks: int) -> None:
        """Allocate state for the local shards ``params`` replicated over ``ranks`` ranks."""
        self.group = group
        self.ranks = ranks

    def replicate(self, grads: list[torch.Tensor], lrs: list[float],
                  stats: CommStats) -> list[torch.Tensor]:
        """Return the update each shard applies on a replicating step."""
        raise NotImplementedError

    def accumulate(self, grads: list[torch.Tensor], lrs: list[float]) -> list[torch.Tensor]:
        """Fold a step without replication into the local state; return the local update."""
        return grads

    def after_update(self, params: list[torch.Tensor], stats: CommStats) -> None:
        """Hook run after the base step of a replicating step (DiLoCo's outer step lives here)."""

    def drain(self) -> None:
        """Wait for any exchange still in flight after the last step (none unless overlapped)."""

    def state_dict(self) -> dict:
        """Tensors and counters needed to resume exactly."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""

    def _all_reduce_mean_flat(self, flat: torch.Tensor, stats: CommStats) -> torch.Tensor:
        # gloo has no AVG reduction: sum, then divide.
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        n = all_reduce_bytes(mean_payload(flat.numel(), flat.element_size())[1], self.ranks)
        stats.add(n, n)
        return flat.div_(self.ranks)

    def _all_reduce_mean(self, tensors: list[torch.Tensor],
                         stats: CommStats) -> list[torch.Tensor]:
        """Average ``tensors`` over the replicas in one bucketed all-reduce."""
        if self.ranks == 1 or not tensors:
            return tensors
        flat = self._all_reduce_mean_flat(torch.cat([t.reshape(-1) for t in tensors]), stats)
        return [f.view_as(t) for f, t in zip(flat.split([t.numel() for t in tensors]), tensors,
                                              strict=True)]


def copy_state(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """Copy saved tensors into live state, refusing a state saved over other parameters."""
    if len(dst) != len(src):
        raise ValueError(f"state holds {len(src)} tensors but this optimizer has {len(dst)}; "
                         "load a state_dict saved by an optimizer over the same parameters.")
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)

