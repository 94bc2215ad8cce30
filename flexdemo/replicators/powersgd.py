"""PowerSGD: HSDP's inter-node gradient all-reduce replaced by rank-r factors, P then Q."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._checks import check
from ..knobs import PowerSGDKnobs
from ..program import Periodic
from ..wire import CommStats, all_reduce_bytes
from .base import Group, Replicator, copy_state, mean_payload

# numpy's legacy RandomState(seed).randint(10**9), which PyTorch's hook seeds each draw of its
# Qs from: MT19937 words masked to 30 bits, those above 10**9 - 1 rejected.
_SEED_BOUND = 10**9
_SEED_MASK = 2**30 - 1
_MT_WORDS = 624


class HookSeeds:
    """The seeds PyTorch's ``powerSGD_hook`` draws its random Qs from, one per draw, in order.

    The hook keeps ``numpy.random.RandomState(random_seed)`` and seeds torch with its next
    ``randint(1_000_000_000)`` before each draw; this is the same sequence without numpy.
    """

    def __init__(self, seed: int, drawn: int = 0) -> None:
        words = [seed & 0xFFFFFFFF]
        for i in range(1, _MT_WORDS):  # MT19937's init_genrand, as numpy seeds from an int
            last = words[-1]
            words.append((1812433253 * (last ^ (last >> 30)) + i) & 0xFFFFFFFF)
        self._mt = random.Random()
        # Python's Random is MT19937 too: its state is the 624 words and the read position.
        self._mt.setstate((3, (*words, _MT_WORDS), None))
        self.drawn = 0
        for _ in range(drawn):
            self.next()

    def next(self) -> int:
        """The next seed, in [0, 10**9)."""
        while True:
            value = self._mt.getrandbits(32) & _SEED_MASK
            if value < _SEED_BOUND:
                self.drawn += 1
                return value


def orthonormalize(matrix: torch.Tensor) -> None:
    """Make the columns of an (n, r) ``matrix`` orthonormal in place, as PyTorch's hook does:
    Gram-Schmidt up to r = 2, a QR factorization above (faster there)."""
    rank = matrix.shape[1]
    if rank > 2:
        matrix.copy_(torch.linalg.qr(matrix).Q)
        return
    for i in range(rank):
        col = matrix[:, i:i + 1]
        norm = col.norm()
        # A zero column stays zero (the hook, without its epsilon, would divide 0 by 0).
        col.div_(torch.where(norm > 0, norm, torch.ones_like(norm)))
        if i + 1 < rank:
            rest = matrix[:, i + 1:]
            rest.sub_((col * rest).sum(0, keepdim=True) * col)


@dataclass(frozen=True)
class PowerSGDPlan:
    """Which of a rank's shards PowerSGD compresses, at which rank, and what each step sends.

    The one sizing of the exchange: :meth:`PowerSGDReplicator.setup` lays out its factors
    from it, and a planner sizes the same exchange from shard shapes alone with it.
    """

    compressed: tuple[tuple[int, int, int, int], ...]
    """(shard index, n, m, r) of every compressed shard, viewed as an n x m matrix, in the
    order the factors are drawn and laid out: grouped by matrix shape, in first-seen order
    (PyTorch's hook's order)."""
    whole: tuple[int, ...]
    """Shard indices all-reduced whole (1-D, 0-D, empty and not worth compressing)."""
    numels: tuple[int, ...]
    """Elements of every shard."""
    itemsize: int
    """Bytes of one gradient element."""
    start: int
    """Steps all-reduced whole before compression starts."""

    @property
    def whole_numel(self) -> int:
        """Elements all-reduced whole on a compressing step."""
        return sum(self.numels[i] for i in self.whole)

    @property
    def p_numel(self) -> int:
        """Elements of all the Ps (sum of n * r)."""
        return sum(n * r for _, n, _, r in self.compressed)

    @property
    def q_numel(self) -> int:
        """Elements of all the Qs (sum of m * r)."""
        return sum(m * r for _, _, m, r in self.compressed)

    def payloads(self, step: int) -> list[tuple[str, int]]:
        """The collectives of 1-based ``step`` and the bytes each rank hands to each: before
        compression starts, one all-reduce of every shard; after it, the whole tensors', the
        Ps' and the Qs' (an empty one left out)."""
        if step <= self.start:
            return [mean_payload(sum(self.numels), self.itemsize)]
        sizes = (self.whole_numel, self.p_numel, self.q_numel)
        return [mean_payload(n, self.itemsize) for n in sizes if n > 0]

    def step_bytes(self, step: int, ranks: int) -> int:
        """Bytes one rank sends (and receives) on 1-based ``step`` among ``ranks`` replicas."""
        return sum(all_reduce_bytes(n, ranks) for _, n in self.payloads(step))


def _matrix(shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The (rows, columns) a gradient is compressed as (view(shape[0], -1)); None for 0-D."""
    if not shape:
        return None
    return shape[0], math.prod(shape[1:])


def plan_powersgd(shapes: list[tuple[int, ...]], knobs: PowerSGDKnobs,
                  itemsize: int = 4) -> PowerSGDPlan:
    """PowerSGD's exchange over shards of these shapes: which it compresses, and its bytes.

    A shard is compressed as an n x m matrix (its first dimension by the rest) at rank
    r = min(n, m, powersgd_rank) where (n + m) * r * min_compression_rate < n * m, as PyTorch's
    hook decides; the rest (1-D tensors among them, since the rate is at least 1) travel whole.
    Needs no tensors and no process group.
    """
    by_shape: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
    whole = []
    for i, shape in enumerate(shapes):
        matrix = _matrix(tuple(shape))
        if matrix is None:
            whole.append(i)
            continue
        n, m = matrix
        r = min(n, m, knobs.powersgd_rank)
        if (n + m) * r * knobs.min_compression_rate < n * m:
            by_shape.setdefault((n, m), []).append((i, n, m, r))
        else:
            whole.append(i)
    compressed = tuple(entry for group in by_shape.values() for entry in group)
    return PowerSGDPlan(compressed, tuple(whole), tuple(math.prod(s) for s in shapes), itemsize,
                        knobs.powersgd_start)


class PowerSGDReplicator(Replicator):
    """PowerSGD (Vogels et al.) in place of HSDP's inter-node all-reduce, AdamW on top.

    For the first ``powersgd_start`` steps every gradient shard is averaged whole in one
    all-reduce. From then on, one step, as PyTorch's ``powerSGD_hook`` takes it::

        add_error       M <- grad + error              (error feedback; the matrix view of a shard)
        whole           1-D and small shards averaged in one all-reduce
        start_qs        Q drawn at random (first time, or every step without warm start) or
                        the last step's Q; orthonormalized
        P = M Q         summed over the replicas in one all-reduce, orthonormalized
        Q = M^T P       summed in one all-reduce, divided by the replicas
        update          P Q^T, the replicas' mean gradient approximated at rank r;
                        error <- M - P Q^T

    The base step (AdamW, no sign) applies the update. With FSDP2 inside a node each rank
    compresses its own shard (its local rows) with the same shard on the other nodes.
    Knobs: :class:`flexdemo.knobs.PowerSGDKnobs`. Where it differs from the hook: the hook keeps
    an error for the tensors it sends whole as well, which averages to zero over the replicas
    (only rounding differs), and a zero column of P or Q stays zero instead of becoming NaN.
    """

    name = "powersgd"
    knobs_type = PowerSGDKnobs
    default_base = "adamw"
    default_sign = False

    def __init__(self, knobs: PowerSGDKnobs | None = None, **given: Any) -> None:
        super().__init__(knobs, **given)
        self.steps = 0

    @classmethod
    def program(cls, knobs: PowerSGDKnobs, shard_shapes: Sequence[tuple[int, ...]],
                replicas: int, *, node: int = 0, graph: str | None = None) -> Periodic:
        """Every step's all-reduces one after another (:meth:`PowerSGDPlan.payloads`): one of
        every shard for the first ``powersgd_start`` steps, then the whole tensors', the Ps'
        and the Qs'; the schedule is steady from the first compressing step."""
        plan = plan_powersgd([tuple(s) for s in shard_shapes], knobs)
        start = plan.start
        # The errors (every compressed matrix) and the factors P and Q, fp32 each.
        errors = sum(n * m for _, n, m, _ in plan.compressed) if knobs.error_feedback else 0
        state = (errors + plan.p_numel + plan.q_numel) * plan.itemsize
        said = [f"powersgd: its first {start} step(s) all-reduce every gradient whole "
                f"({sum(plan.numels) * plan.itemsize:,} bytes a rank) before compression "
                f"starts; the step time is the compressing steps', from step {start + 1}"] \
            if start and replicas > 1 else []
        return Periodic(lambda _step: True, plan.payloads, state_bytes=state, sequential=True,
                        steady_from=start + 1, said=said)

    def setup(self, params: list[torch.Tensor], group: Group, ranks: int) -> None:
        """Plan which shards are compressed; allocate their errors and factors."""
        super().setup(params, group, ranks)
        dtypes = sorted({str(p.dtype) for p in params})
        check(len(dtypes) <= 1, f"powersgd sends every shard's factors in one buffer, so it needs "
                                f"one dtype, got {', '.join(dtypes)}; keep the parameters in one.")
        dtype = params[0].dtype if params else torch.float32
        device = params[0].device if params else torch.device("cpu")
        self.plan = plan_powersgd([tuple(p.shape) for p in params], self.knobs,
                                  dtype.itemsize)
        self.shapes = [p.shape for p in params]
        self.errors = [torch.zeros(n, m, dtype=dtype, device=device)
                       for _, n, m, _ in self.plan.compressed] if self.error_feedback else []
        self.p = torch.empty(self.plan.p_numel, dtype=dtype, device=device)
        self.q = torch.empty(self.plan.q_numel, dtype=dtype, device=device)
        self.ps = _views(self.p, [(n, r) for _, n, _, r in self.plan.compressed])
        self.qs = _views(self.q, [(m, r) for _, _, m, r in self.plan.compressed])
        self.seeds = HookSeeds(self.seed)
        self.fresh = True  # the Qs are drawn at the next compressing step

    # -- the paper's steps ---------------------------------------------------------------------
    def add_error(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every compressed shard as its matrix, plus the error it left last time."""
        mats = [grads[i].reshape(n, m) for i, n, m, _ in self.plan.compressed]
        if not self.error_feedback:
            return mats
        return [g + e for g, e in zip(mats, self.errors, strict=True)]

    def start_qs(self) -> None:
        """Qs to start the power iteration from, orthonormalized: drawn as the hook draws them
        (one seed, then each Q in order from the CPU generator), or the last step's."""
        if self.fresh:
            gen = torch.Generator().manual_seed(self.seeds.next())
            for q in self.qs:
                q.copy_(torch.randn(q.shape, generator=gen, dtype=q.dtype))
            self.fresh = not self.warm_start
        for q in self.qs:
            orthonormalize(q)

    def all_reduce_sum(self, flat: torch.Tensor, stats: CommStats) -> None:
        """Sum ``flat`` over the replicas in place, in one all-reduce."""
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        sent = all_reduce_bytes(mean_payload(flat.numel(), flat.element_size())[1], self.ranks)
        stats.add(sent, sent)

    def compress(self, grads: list[torch.Tensor], stats: CommStats) -> list[torch.Tensor]:
        """One compressing step: the whole shards' mean and the rank-r means of the others."""
        plan = self.plan
        mats = self.add_error(grads)
        updates = list(grads)
        means = self._all_reduce_mean([grads[i] for i in plan.whole], stats)
        for i, mean in zip(plan.whole, means, strict=True):
            updates[i] = mean
        if not plan.compressed:
            return updates
        self.start_qs()
        for mat, p, q in zip(mats, self.ps, self.qs, strict=True):
            torch.matmul(mat, q, out=p)
        self.all_reduce_sum(self.p, stats)  # orthonormalized next, so no division
        for p in self.ps:
            orthonormalize(p)
        for mat, p, q in zip(mats, self.ps, self.qs, strict=True):
            torch.matmul(mat.T, p, out=q)
        self.all_reduce_sum(self.q, stats)
        self.q.div_(self.ranks)
        for k, (i, _, _, _) in enumerate(plan.compressed):
            approx = self.ps[k] @ self.qs[k].T
            if self.error_feedback:
                torch.sub(mats[k], approx, out=self.errors[k])
            updates[i] = approx.view(self.shapes[i])
        return updates

    # -- the optimizer's hooks -----------------------------------------------------------------
    def replicate(self, grads: list[torch.Tensor], lrs: list[float],
                  stats: CommStats) -> list[torch.Tensor]:
        """The replicas' mean gradient: whole before ``powersgd_start``, compressed after."""
        self.steps += 1
        if self.ranks == 1:
            return grads  # nothing crosses a network: the gradient is the mean
        if self.steps <= self.powersgd_start:
            return self._all_reduce_mean(grads, stats)
        return self.compress(grads, stats)

    def state_dict(self) -> dict:
        """The step count, the errors, the last Qs and how many seeds were drawn."""
        return {"steps": self.steps, "errors": [e.clone() for e in self.errors],
                "q": self.q.clone(), "fresh": self.fresh, "drawn": self.seeds.drawn}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        copy_state(self.errors, state["errors"])
        copy_state([self.q], [state["q"]])
        self.steps, self.fresh = int(state["steps"]), bool(state["fresh"])
        self.seeds = HookSeeds(self.seed, drawn=int(state["drawn"]))


def _views(flat: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Consecutive views of ``flat`` with these shapes."""
    views, start = [], 0
    for rows, cols in shapes:
        views.append(flat[start:start + rows * cols].view(rows, cols))
        start += rows * cols
    return views
