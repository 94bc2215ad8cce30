"""Replicators that average a chosen part of a parameter-space momentum: random rows, strides."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from ..chunking import largest_divisor_at_most, matrix_shape
from ..knobs import PartialKnobs, RandomKnobs, StridingKnobs
from ..program import Periodic, replicating_before, schedule_period
from ..wire import CommStats
from .base import Group, Replicator, copy_state

Selection = list[torch.Tensor | None]  # per shard: the rows to send (None: an empty shard)

__all__ = ["RandomReplicator", "StridingReplicator", "partial_payload", "random_row_count",
           "striding_rows"]


def _row_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    # A 1-D tensor's rows are its elements (the reference indexes delta[rows] on it); one row
    # would send the whole tensor every step whatever the rate.
    return (int(shape[0]), 1) if len(shape) == 1 else matrix_shape(shape)


def random_row_count(rows: int, rate: float) -> int:
    """Rows a random replicator sends of a shard with ``rows`` rows (the draw picks which)."""
    return max(1, int(rate * rows))


def _striding_view(numel: int, chunk: int) -> tuple[int, int]:
    """(chunks, elements per chunk) striding cuts a shard of ``numel`` elements into."""
    n = largest_divisor_at_most(numel, chunk)
    return n, numel // n


def striding_rows(chunks: int, rate: float, counter: int) -> torch.Tensor:
    """The chunks striding sends at its ``counter``-th replicating step out of ``chunks``."""
    m = max(1, int(rate * chunks))
    stride = math.ceil(chunks / m)
    # Shifting the comb by one each step visits every chunk within `stride` steps.
    offset = counter % stride
    return torch.unique((offset + torch.arange(m) * stride) % chunks)


def partial_payload(kind: str, shapes: list[tuple[int, ...]], knobs: PartialKnobs,
                    counter: int = 0, itemsize: int = 4) -> tuple[str, int]:
    """The all-reduce a random (``kind="random"``) or striding replicator posts over shards of
    ``shapes`` at its ``counter``-th replicating step, and the bytes each rank hands in: the
    sizing the replicators send by and the planner (``experiments.plan``) plans with."""
    numel = 0
    for shape in shapes:
        if math.prod(shape) == 0:
            continue
        if kind == "random":
            rows, width = _row_shape(tuple(shape))
            numel += random_row_count(rows, knobs.rate) * width
        else:
            chunks, width = _striding_view(math.prod(shape), knobs.chunk)
            numel += int(striding_rows(chunks, knobs.rate, counter).numel()) * width
    return "all_reduce", numel * itemsize


@functools.lru_cache(maxsize=256)
def _comb_sizes(chunks: int, rate: float) -> frozenset[int]:
    """The sizes striding's comb over ``chunks`` chunks takes as its offset turns."""
    m = max(1, int(rate * chunks))
    return frozenset(int(striding_rows(chunks, rate, c).numel())
                     for c in range(math.ceil(chunks / m)))


def _check_steady_comb(shapes: list[tuple[int, ...]], knobs: PartialKnobs) -> None:
    """Refuse a striding rate whose comb changes size from step to step (a program of one
    replicating step for all of them would not hold it)."""
    for shape in shapes:
        numel = math.prod(shape)
        if numel and len(_comb_sizes(largest_divisor_at_most(numel, knobs.chunk),
                                     knobs.rate)) > 1:
            raise ValueError(f"rate={knobs.rate} makes the comb over a shard of {numel} "
                             "elements send a different number of chunks at different steps, "
                             "which the plan does not replay; plan a lower rate (such as the "
                             "default 0.1).")


class _DeltaReplicator(Replicator):
    """Shared steps: decay and add into ``delta``, send the selected rows, remove them.

    Off-schedule steps (``replicate_every``, ``skip_every``) apply the local gradient and leave
    delta alone, as the reference does; ``fold_skipped=True`` folds it into delta as well.
    Knobs: :class:`flexdemo.knobs.PartialKnobs` (``rate``, ``decay``, the schedule).
    """

    knobs_type = PartialKnobs
    owns_updates = True
    lr_in_update = True

    @classmethod
    def program(cls, knobs: PartialKnobs, shard_shapes: Sequence[tuple[int, ...]],
                replicas: int, *, node: int = 0, graph: str | None = None) -> Periodic:
        """One all-reduce of the chosen rows per replicating step (:func:`partial_payload`;
        striding's comb by its counter, of one size at every step)."""
        shapes = [tuple(s) for s in shard_shapes]
        striding = cls.name == "striding"
        if striding and replicas > 1:  # one replica sends nothing, at any rate
            _check_steady_comb(shapes, knobs)
        replicates_on = cls(knobs).replicates_on

        def ops(step: int) -> list[tuple[str, int]]:
            counter = replicating_before(replicates_on, step) if striding else 0
            op, nbytes = partial_payload(cls.name, shapes, knobs, counter)
            return [(op, nbytes)] if nbytes else []

        # The momentum (delta) and the update it returns (the shard's zeros, the chosen rows
        # filled in), fp32 both; the chosen rows' flat buffer is a fraction of a shard.
        shard = sum(math.prod(s) for s in shapes)
        return Periodic(replicates_on, ops,
                        period=schedule_period(knobs.replicate_every, knobs.skip_every),
                        state_bytes=2 * shard * 4)

    def setup(self, params: list[torch.Tensor], group: Group, ranks: int) -> None:
        """Allocate the momentum."""
        super().setup(params, group, ranks)
        self.delta = [torch.zeros_like(p) for p in params]

    def decay_and_add(self, grads: list[torch.Tensor], lrs: list[float]) -> None:
        """delta <- decay * delta + lr * grad."""
        for d, g, lr in zip(self.delta, grads, lrs, strict=True):
            d.mul_(self.decay).add_(g, alpha=lr)

    def accumulate(self, grads: list[torch.Tensor], lrs: list[float]) -> list[torch.Tensor]:
        """A step off the schedule: step on the local gradient (delta kept, as the reference)."""
        if self.fold_skipped:
            self.decay_and_add(grads, lrs)
        return grads

    def _rows(self, d: torch.Tensor) -> torch.Tensor:
        """2-D view of ``d`` whose rows are the units this replicator selects from."""
        raise NotImplementedError

    def _selection(self) -> Selection:
        """This step's rows per shard; the same on every replica."""
        raise NotImplementedError

    def replicate(self, grads: list[torch.Tensor], lrs: list[float],
                  stats: CommStats) -> list[torch.Tensor]:
        """Average the selected rows of delta over the replicas; they are the update."""
        self.decay_and_add(grads, lrs)
        if self.ranks == 1:
            out = [d.clone() for d in self.delta]
            for d in self.delta:
                d.zero_()
            return out
        chosen = self._selection()
        parts = [self._rows(d)[rows].reshape(-1)
                 for d, rows in zip(self.delta, chosen, strict=True) if rows is not None]
        out = [torch.zeros_like(d) for d in self.delta]
        if not parts:
            return out
        flat = self._all_reduce_mean_flat(torch.cat(parts), stats)
        offset = 0
        for d, o, rows in zip(self.delta, out, chosen, strict=True):
            if rows is None:
                continue
            view = self._rows(d)
            n = rows.numel() * view.shape[1]
            self._rows(o)[rows] = flat[offset:offset + n].view(rows.numel(), view.shape[1])
            view[rows] = 0.0  # remove what was sent
            offset += n
        return out

    def state_dict(self) -> dict:
        """The momentum."""
        return {"delta": [d.clone() for d in self.delta]}

    def load_state_dict(self, state: dict) -> None:
        """Restore the momentum."""
        copy_state(self.delta, state["delta"])


class RandomReplicator(_DeltaReplicator):
    """Average a seeded random subset (``rate``) of the rows of delta each step.

    Every replica draws from the same ``seed``, so all pick the same rows. The rows of a 1-D
    tensor are its elements, as in the reference (``delta[rows]`` on a 1-D delta).
    """

    name = "random"
    knobs_type = RandomKnobs

    def setup(self, params: list[torch.Tensor], group: Group, ranks: int) -> None:
        """Allocate the momentum and seed the row draws."""
        super().setup(params, group, ranks)
        self.generator = torch.Generator().manual_seed(self.seed)

    def _rows(self, d: torch.Tensor) -> torch.Tensor:
        return d.view(_row_shape(d.shape))

    def _selection(self) -> Selection:
        sizes = [_row_shape(d.shape)[0] if d.numel() else 0 for d in self.delta]
        # One draw per step shared by all shards, so replicas with equal shapes pick equal rows.
        scores = torch.rand(max(sizes, default=0), generator=self.generator)
        picks: dict[int, torch.Tensor] = {}
        out: Selection = []
        for n in sizes:
            if n == 0:
                out.append(None)
                continue
            if n not in picks:
                m = random_row_count(n, self.rate)
                rows = torch.topk(scores[:n], m, largest=False).indices.sort().values
                picks[n] = rows.to(self.delta[0].device)
            out.append(picks[n])
        return out

    def state_dict(self) -> dict:
        """The momentum and the generator's position."""
        return {**super().state_dict(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        """Restore the momentum and the generator's position."""
        super().load_state_dict(state)
        self.generator.set_state(state["generator"])


class StridingReplicator(_DeltaReplicator):
    """Average a rotating, evenly strided subset (``rate``) of the ``chunk`` chunks of delta.

    Differs from the reference on purpose: here the comb shifts by one chunk each step, so
    every chunk is sent within ``stride`` steps; the reference's offset
    ``counter * stride * chunks_per_step % size`` is always 0 when the chunk count divides the
    size, so it sends the same chunks forever. Do not read our striding figures as the paper's.
    """

    name = "striding"
    knobs_type = StridingKnobs

    def __init__(self, knobs: StridingKnobs | None = None, **given: object) -> None:
        super().__init__(knobs, **given)
        self.counter = 0

    def _rows(self, d: torch.Tensor) -> torch.Tensor:
        return d.view(*_striding_view(d.numel(), self.chunk))

    def _selection(self) -> Selection:
        out: Selection = []
        for d in self.delta:
            if d.numel() == 0:
                out.append(None)
                continue
            n = self._rows(d).shape[0]
            out.append(striding_rows(n, self.rate, self.counter).to(d.device))
        self.counter += 1
        return out

    def state_dict(self) -> dict:
        """The momentum and the comb's position."""
        return {**super().state_dict(), "counter": self.counter}

    def load_state_dict(self, state: dict) -> None:
        """Restore the momentum and the comb's position."""
        super().load_state_dict(state)
        self.counter = int(state["counter"])
