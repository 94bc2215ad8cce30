"""A method's record (:mod:`flexdemo.methods`) made into a model's optimizer
(:func:`build_optimizer`), or into the program of its exchange (:func:`program_of`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .hsdp import replicate_group, shard_group
from .knobs import Knobs
from .methods import Method, method_record
from .optimizer import FlexDeMo
from .program import Program
from .replicators import Replicator

__all__ = ["build_optimizer", "has_program", "program_of", "replicator_of"]


def _replication_group(record: Method, mesh: DeviceMesh | None) -> dist.ProcessGroup | None:
    if not record.shards:
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
                    *, weight_decay: float = 0.0, seed: int | None = None,
                    betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                    **knobs: Any) -> torch.optim.Optimizer:
    """Return the optimizer implementing ``method`` for ``model`` on ``mesh``.

    Sharded methods expect ``parallelize(model, mesh, record.inter_all_reduce)`` to have run
    (``record = method_record(method).wired(knobs)``). ``hsdp-adamw`` is
    ``torch.optim.AdamW``: FSDP2's all-reduce averages the gradients across nodes; with a
    ``reduce_format`` other than fp32 it is FlexDeMo's AdamW step over the ``reduce``
    replicator, which averages them (FSDP2 then reduces inside the node only). ``demo``
    expects an unsharded model; every rank is a replica. ``mesh=None`` for the other methods
    means no sharding, the default group as replicas. ``lr=None`` takes the record's lr.
    ``knobs`` are the method's knobs by their run-setting names (``record.takes``); those not
    given take the record's defaults, and one the method does not read is refused
    (ValueError, one sentence). ``seed`` seeds what a replicator draws (random's rows, Ada's
    sample); None: the replicator's own default. ``ada`` also gets the mesh's shard group,
    over which the ranks of a node agree on the measured spread. A ``beta1`` knob replaces
    ``betas[0]`` of the adamw base (ValueError, one sentence, where the method steps with the
    sign base).
    """
    record = method_record(method)
    lr = record.lr if lr is None else lr
    rep_knobs, step = record.settings(knobs, seed=seed)
    record = record.wired(knobs)
    if record.replicator is None:
        if mesh is None:
            raise ValueError(f"method={method!r} needs a (replicate, shard) mesh, got None.")
        return torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, eps=eps,
                                 weight_decay=weight_decay)
    cls = record.replicator_type
    if step.beta1 is not None:
        base = step.base or cls.default_base
        if base != "adamw":
            raise ValueError(f"beta1={step.beta1!r} is the adamw base's, but method {method!r} "
                             f"steps with base {base!r}; give base adamw or no beta1.")
        betas = (step.beta1, betas[1])
    wiring = {"node_group": _node_group(mesh)} if cls.uses_node_group else {}
    replicator = cls(rep_knobs, **wiring)
    return FlexDeMo(model.parameters(), lr=lr, weight_decay=weight_decay, sign=step.sign,
                    replicator=replicator, replication_group=_replication_group(record, mesh),
                    base=step.base, betas=betas, eps=eps)


def replicator_of(record: Method) -> type[Replicator] | None:
    """The replicator class of ``record``'s method (None: plain AdamW, FSDP2's all-reduce), by
    its name in ``REPLICATORS`` or the class a plug-in's record carries."""
    return record.replicator_type


def has_program(record: Method) -> bool:
    """Whether ``record``'s replicator writes a program (plain AdamW: FSDP2's, always)."""
    cls = replicator_of(record)
    return cls is None or getattr(cls.program, "__func__", None) is not Replicator.program.__func__


def program_of(record: Method, knobs: Knobs, shard_shapes: Sequence[tuple[int, ...]],
               replicas: int, *, node: int = 0, graph: str | None = None) -> Program | None:
    """The program of ``record``'s exchange (its knobs as ``record.settings`` gives them) for a
    rank whose local shards have ``shard_shapes`` among ``replicas`` replicas
    (:meth:`Replicator.program`); None where its replicator writes none. Plain AdamW
    (``replicator`` None): FSDP2's all-reduce of every gradient in the backward, which is no
    replicator's, so the program holds no op of its own and counts one exchange a step."""
    cls = replicator_of(record)
    if cls is None:
        fsdp2 = Program()
        fsdp2.exchanges = 1
        return fsdp2
    return cls.program(knobs, shard_shapes, replicas, node=node, graph=graph)
