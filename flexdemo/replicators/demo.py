"""DeMo: exchange the top-k DCT coefficients of a decoupled momentum, in one bucket per step."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..chunking import BlockLayout
from ..codec import clamp_topk
from ..formats import make_format
from ..knobs import DeMoKnobs
from ..program import Op, Program, schedule_period
from ..wire import (
    CommStats,
    all_gather_bytes,
    all_reduce_bytes,
    dense_is_cheaper,
    pack,
    plan_bucket,
    unpack,
)
from .base import Group, Replicator, all_gather_flat, copy_state
from .blocks import BlockGroup
from .reference_blocks import ReferenceBlockGroup

Picked = list[tuple[torch.Tensor, torch.Tensor]]  # per block group: (int64 indices, values)
Wire = list[tuple[list[torch.Tensor], torch.Tensor | None]]  # per group: (segments, what's read)
# The dense exchange's wire dtype: a bf16 all-reduce of the shard's coefficients.
DENSE_DTYPE = torch.bfloat16
# bf16 keeps 8 significant bits: a count of senders summed in it is exact up to 256.
MAX_COUNTED_RANKS = 256


@dataclass
class Ahead:
    """A look-ahead step taken (lookahead): sign of this rank's own update, and its lrs."""

    signs: list[torch.Tensor]
    lrs: list[float]


@dataclass
class Pending:
    """A launched exchange: the buffer it fills (all-gathered buckets, or the dense coefficients
    all-reduced in place), the handle to wait on, what this rank sent and (lookahead) the
    look-ahead step its mean will replace."""

    gathered: torch.Tensor
    work: object | None
    sent: torch.Tensor | None = None
    ahead: Ahead | None = None


GroupKey = tuple[int, int, torch.dtype]  # (c1, c2, dtype) of a block group


@dataclass(frozen=True)
class ExchangePlan:
    """What DeMo's exchange over one rank's shards is made of and how many bytes it moves.

    The one sizing of the exchange: :meth:`DeMoReplicator.setup` builds its block groups and
    wire layout from it, and the planner (``experiments.plan``) sizes the same exchange from a
    declared model's shard shapes with it, so the two cannot drift apart.
    """

    groups: tuple[tuple[GroupKey, tuple[tuple[int, BlockLayout], ...]], ...]
    """Per block group, in wire order: its key and its members (shard index, block layout)."""
    spans: tuple[tuple[int, int], ...]
    """Per group: its first segment in the bucket and how many segments it has."""
    segments: list
    """The bucket's segments (flexdemo.wire.Segment), every group's in order."""
    bucket_bytes: int
    """Bytes of one rank's packed bucket (the all-gather's input)."""
    dense_offsets: tuple[int, ...]
    """Where each group's coefficients start in the dense vector."""
    dense_numel: int
    """Coefficients of the shard's dense vector (every block's)."""
    counted: bool
    """Whether the dense buffer carries a count per coefficient (dense-mean, auto)."""
    dense_bytes: int
    """Bytes of the dense exchange's bf16 all-reduce."""
    dense: bool
    """Whether the replicas all-reduce the dense vector instead of all-gathering buckets."""

    @property
    def op(self) -> str:
        """The collective the exchange is: "all_reduce" (dense) or "all_gather"."""
        return "all_reduce" if self.dense else "all_gather"

    @property
    def payload_bytes(self) -> int:
        """The bytes one rank hands to that collective."""
        return self.dense_bytes if self.dense else self.bucket_bytes


def plan_exchange(shapes: list[tuple[int, ...]], dtypes: list[torch.dtype], knobs: DeMoKnobs,
                  ranks: int) -> ExchangePlan:
    """DeMo's exchange over shards of these shapes and dtypes among ``ranks`` replicas.

    Needs no tensors and no process group: shapes only (a meta-device model's shards will do).
    ValueError (one sentence) for a counted dense exchange over more than 256 replicas.
    """
    chunking, chunk, topk = knobs.chunking, knobs.chunk, knobs.topk
    members: dict[GroupKey, list[tuple[int, BlockLayout]]] = {}
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True)):
        numel = math.prod(shape)
        if numel == 0:
            continue  # FSDP2 can leave a rank with nothing of a small parameter.
        layout = BlockLayout.for_shape((numel,) if chunking == "flat" else shape, chunk)
        members.setdefault((layout.c1, layout.c2, dtype), []).append((i, layout))
    # A fixed order (same on every replica, whose shards have the same shapes) defines the
    # wire layout.
    keys = sorted(members, key=lambda k: (k[0], k[1], str(k[2])))
    fmt = make_format(knobs.value_format)
    specs, spans, offsets, dense_numel = [], [], [], 0
    for key in keys:
        c1, c2, _ = key
        blocks = sum(layout.num_blocks for _, layout in members[key])
        group_specs = fmt.specs(blocks, clamp_topk(topk, c1 * c2), c1 * c2)
        spans.append((len(specs), len(group_specs)))
        specs += group_specs
        offsets.append(dense_numel)
        dense_numel += blocks * c1 * c2
    segments, bucket_bytes = plan_bucket(specs)
    # dense-mean (and auto, which keeps DeMo's mean) all-reduce a count per coefficient
    # beside its sum, in the same buffer: twice the elements, one collective.
    counted = knobs.exchange in ("dense-mean", "auto")
    dense_bytes = dense_numel * DENSE_DTYPE.itemsize * (2 if counted else 1)
    dense = knobs.exchange in ("dense", "dense-mean") or (
        knobs.exchange == "auto" and dense_is_cheaper(bucket_bytes, dense_bytes, ranks))
    if counted and dense and ranks > MAX_COUNTED_RANKS:
        # A ring all-reduce adds one rank at a time: a bf16 count of ones stops at 256, and
        # the divisor would be wrong without a word. Refuse rather than train on it.
        raise ValueError(
            f"exchange {knobs.exchange!r} all-reduces a bf16 count of senders, exact only up "
            f"to {MAX_COUNTED_RANKS} replicas, and this group has {ranks}; use exchange "
            "'dense' (the sum over all replicas) or 'allgather'.")
    return ExchangePlan(tuple((k, tuple(members[k])) for k in keys), tuple(spans), segments,
                        bucket_bytes, tuple(offsets), dense_numel, counted, dense_bytes, dense)


class DeMoProgram(Program):
    """DeMo's exchange: one bucket (or dense vector) per replicating step, sized by
    :func:`plan_exchange`, waited on in its step (``delay=0``) or at the next replicating one
    (``delay=1``)."""

    def __init__(self, replicator: DeMoReplicator, plan: ExchangePlan, replicas: int) -> None:
        self.replicates_on, self.delay = replicator.replicates_on, replicator.delay
        self.plan = plan
        self.period = schedule_period(replicator.replicate_every, replicator.skip_every)
        self.exchanges_on = self.replicates_on
        # The momentum (every coefficient, fp32), this rank's bucket and what it receives
        # (all-gather: every replica's bucket; dense: the buffer reduced in place), twice
        # while one exchange is in flight across a step (delay=1).
        received = plan.dense_bytes if plan.dense else replicas * plan.bucket_bytes
        exchange = plan.payload_bytes + received
        self.state_bytes = plan.dense_numel * 4 + exchange * (2 if self.delay == 1 else 1)

    def posts(self, step: int) -> list[Op]:
        """The bucket (or dense vector) of a replicating step."""
        if not self.replicates_on(step):
            return []
        return [Op(self.plan.op, self.plan.payload_bytes, key=step)]

    def waits(self, step: int) -> list[Hashable]:
        """delay=0: this step's own; delay=1: the previous replicating step's."""
        if not self.replicates_on(step):
            return []
        if self.delay == 0:
            return [step]
        return next(([s] for s in range(step - 1, 0, -1) if self.replicates_on(s)), [])


class DeMoReplicator(Replicator):
    """DeMo (Peng et al.): each replica sends the top-k DCT coefficients of its momentum.

    One step, as in the paper, with batched kernels behind each name (:meth:`start` and
    :meth:`finish` split it around the collective so the wait can overlap other work)::

        decay_and_add     delta <- decay * delta + lr * grad     (fast: in the DCT domain)
        dct_topk          the top-k coefficients of every chunk of DCT(delta)
        to_wire, remove_sent   round them for the wire; delta -= what leaves this rank
        all_gather        one bucketed all-gather of every replica's coefficients
        decode_mean       mean over the replicas that sent a coefficient, inverse DCT
    The optimizer's base then takes the sign step.

    Dense exchange (``exchange="dense"``): the same top-k and error feedback, but each rank
    scatters the values it sends (the format's read values, rounded to bf16; what that rounding
    loses stays in the momentum) into a zero dense coefficient vector of its shard and the
    replicas all-reduce it in bf16; the update is that sum divided by N. Its cost is a bf16
    all-reduce of the shard at any N, where the all-gather's grows as (N-1) x the bucket. Its
    mean differs from the all-gather's where fewer than N replicas sent a coefficient: DeMo's
    mean is over the replicas that sent it, this one over all N (a replica that did not send it
    counts its zero), so such a coefficient's decoded update is count/N of DeMo's.
    ``exchange="dense-mean"`` all-reduces a one per coefficient sent beside each value, in the
    same bf16 buffer (twice the bytes, one collective), and divides each sum by its count: DeMo's
    mean, to bf16 rounding (counts are exact up to 256 senders; a ring over more ranks stops a
    count of ones at 256, a pairwise tree rounds it by at most 2^-9). ``auto`` picks the
    all-gather or dense-mean, whichever moves fewer bytes, once at setup
    (:func:`flexdemo.wire.dense_is_cheaper`): the update is DeMo's at any N.

    Delayed DeMo (``delay=1``): a replicating step runs :meth:`start` (momentum, top-k, error
    feedback and the posted all-gather exactly as with ``delay=0``) and applies the decoded
    mean of the exchange the previous replicating step posted, so the network time overlaps
    the next step's compute; exactly one bucket is in flight between steps. The first step has
    nothing to apply and applies a zero update: every replica then still applies the same
    update at every step, so replicas that start equal stay equal (the rank's own decoded top-k
    would differ per rank, and DeMo never re-synchronizes the parameters themselves). The
    exchange in flight after the last step is drained and dropped (:meth:`drain`: waited on,
    never applied), since applying it would be a step after the run's last one. With a single
    replica nothing crosses a network and the update applies at once, as with ``delay=0``.

    Look-ahead (``lookahead=True``, with ``delay=1`` and the sign step): the step that posts an
    exchange steps on this rank's own decoded top-k at once, and the next step, once the
    exchange has arrived (:meth:`after_update`), takes that sign step back and takes the
    replicas' mean's instead: every replica's parameters are the synchronous sequence of means
    plus its own latest look-ahead, so the next gradient is taken where the step just sent
    points rather than one step behind it. The replicas then differ by one sign step of their
    own, for one step (with weight decay, by its product with it too), and by float rounding:
    taking a step back rounds differently on each replica (a few ulps per step, which nothing
    amplifies, since every replica then applies the bit-equal mean). :meth:`drain` applies the
    last correction, so they end equal up to that rounding.

    Arithmetic (``arithmetic``): the steps above run on a :class:`~.blocks.BlockGroup` (fast:
    momentum in the DCT domain, batched transforms) or a
    :class:`~.reference_blocks.ReferenceBlockGroup` (DeToNATION 0.5.2's operations in its
    order); the same step up to float rounding, which the sign step amplifies. With fp32 values
    the reference one is the default and the package's step bit for bit
    (``tests/flexdemo/test_demo_reference.py``).

    Knobs: :class:`flexdemo.knobs.DeMoKnobs` (``topk``, ``chunk``, ``decay``, ``chunking``,
    ``value_format`` or its alias ``value_dtype``, ``exchange``, ``arithmetic``, the schedule,
    ``fold_skipped``). Block chunking clamps ``topk`` to a block's elements; flat chunking
    refuses a ``topk`` above ``chunk`` and, like the reference, clamps it where a tensor's chunk
    (the largest divisor of its size not above ``chunk``) is shorter. ``value_format`` "fp32"
    and "bf16" are today's layout (int16 indices; fp32 is the exact mode); the compact
    formats bit-pack the indices, and what a format loses stays in the momentum (error
    feedback). Off-schedule steps apply the local gradient and, as in the reference, leave the
    momentum alone.
    """

    name = "demo"
    knobs_type = DeMoKnobs
    owns_updates = True
    lr_in_update = True

    def __init__(self, knobs: DeMoKnobs | None = None, **given: Any) -> None:
        super().__init__(knobs, **given)
        self.format = make_format(self.value_format)
        # delay=1: the exchange posted by the last replicating step, applied by the next one.
        self.in_flight: Pending | None = None
        # lookahead: the exchange whose look-ahead after_update corrects, and the shards it
        # corrects (kept for the drain, which is handed none).
        self.arrived: Pending | None = None
        self.shards: list[torch.Tensor] = []

    @classmethod
    def program(cls, knobs: DeMoKnobs, shard_shapes: Sequence[tuple[int, ...]], replicas: int,
                *, node: int = 0, graph: str | None = None) -> DeMoProgram:
        """DeMo's exchange over fp32 shards of ``shard_shapes`` (:class:`DeMoProgram`)."""
        shapes = [tuple(s) for s in shard_shapes]
        plan = plan_exchange(shapes, [torch.float32] * len(shapes), knobs, replicas)
        return DeMoProgram(cls(knobs), plan, replicas)

    def setup(self, params: list[torch.Tensor], group: Group, ranks: int) -> None:
        """Group the shards' blocks by shape and plan the bucket every step sends."""
        super().setup(params, group, ranks)
        self.shapes = [p.shape for p in params]
        self.empty_like = [(p.shape, p.dtype, p.device) for p in params]
        plan = plan_exchange([tuple(p.shape) for p in params], [p.dtype for p in params],
                             self.knobs, ranks)
        group_type = ReferenceBlockGroup if self.knobs.arithmetic_used == "reference" \
            else BlockGroup
        self.groups = []
        for (c1, c2, dtype), members in plan.groups:
            g = group_type(c1, c2, self.topk, dtype, params[members[0][0]].device)
            for index, layout in members:
                # The package transforms a 1-D tensor (and FSDP1's flat shard) along one axis.
                g.add(index, layout, one_dim=self.chunking == "flat" or params[index].dim() < 2)
            g.allocate()
            self.groups.append(g)
        self.spans, self.segments, self.bucket_bytes = list(plan.spans), plan.segments, \
            plan.bucket_bytes
        self.dense_offsets, self.dense_numel = list(plan.dense_offsets), plan.dense_numel
        self.counted, self.dense_bytes, self.dense = plan.counted, plan.dense_bytes, plan.dense

    # -- the paper's steps ---------------------------------------------------------------------
    def decay_and_add(self, grads: list[torch.Tensor], lrs: list[float]) -> None:
        """delta <- decay * delta + lr * grad (fast: DCT domain; reference: parameter space)."""
        for g in self.groups:
            g.decay_and_add(grads, lrs, self.decay)

    def dct_topk(self) -> Picked:
        """The top-k coefficients per chunk of DCT(delta): (indices, values) per block group."""
        return [g.topk() for g in self.groups]

    def to_wire(self, picked: Picked) -> Wire:
        """Every group's segments in ``value_format``, and the values receivers will read."""
        return [self.format.encode(idx, vals, g.c1 * g.c2)
                for (idx, vals), g in zip(picked, self.groups, strict=True)]

    def remove_sent(self, picked: Picked, wire: Wire) -> None:
        """delta -= what receivers read (rounding or quantization error stays: error feedback)."""
        for ((idx, vals), g), (_, read) in zip(zip(picked, self.groups, strict=True), wire,
                                               strict=True):
            g.remove_sent(idx, vals, read)

    def to_dense_wire(self, picked: Picked, wire: Wire) -> Wire:
        """The dense exchange's values: what receivers would read, rounded to bf16."""
        return [([], (vals if read is None else read).to(DENSE_DTYPE))
                for (_, vals), (_, read) in zip(picked, wire, strict=True)]

    def all_reduce_dense(self, picked: Picked, wire: Wire, stats: CommStats) -> Pending:
        """Launch one bf16 all-reduce (a sum) of every replica's top-k scattered into zeros
        (dense-mean: and a one per coefficient sent, in the buffer's second half)."""
        device = self.groups[0].delta.device
        buf = torch.zeros(self.dense_bytes // DENSE_DTYPE.itemsize, dtype=DENSE_DTYPE,
                          device=device)
        for (idx, _), (_, sent), g, start in zip(picked, wire, self.groups, self.dense_offsets,
                                                 strict=True):
            n = g.num_blocks * g.c1 * g.c2
            buf[start:start + n].view(g.num_blocks, -1).scatter_(1, idx, sent)
            if self.counted:
                counts = buf[self.dense_numel + start:self.dense_numel + start + n]
                counts.view(g.num_blocks, -1).scatter_(1, idx, 1.0)
        own = buf.clone() if self.lookahead else None  # the look-ahead steps on its own
        work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        sent_bytes = all_reduce_bytes(self.dense_bytes, self.ranks)
        stats.add(sent_bytes, sent_bytes)
        return Pending(buf, work, own)

    def all_gather(self, wire: Wire, stats: CommStats) -> Pending:
        """Launch one all-gather of every replica's packed coefficients."""
        buf = pack([t for segments, _ in wire for t in segments], self.segments,
                   self.bucket_bytes)
        gathered = torch.empty(self.ranks * self.bucket_bytes, dtype=torch.uint8,
                               device=buf.device)
        work = all_gather_flat(gathered, buf, self.group)
        sent = all_gather_bytes(self.bucket_bytes, self.ranks)
        stats.add(sent, sent)
        return Pending(gathered, work, buf)

    def decode_mean(self, pending: Pending) -> list[torch.Tensor]:
        """Wait for the exchange; the replicas' mean per coefficient, inverse DCT (all-gather
        and dense-mean: over the replicas that sent it; dense: the sum over N)."""
        if pending.work is not None:
            pending.work.wait()
        if self.dense:
            return self._decode_dense(pending.gathered, self.ranks)
        return self._decode(pending.gathered, self.ranks)

    def dense_coefficients(self, summed: torch.Tensor, ranks: int) -> list[torch.Tensor]:
        """Per block group, (blocks, c1*c2) coefficients of an all-reduced dense vector: the sum
        divided by ``ranks`` (dense), or by its count of senders (dense-mean; 0 where none)."""
        out = []
        for g, start in zip(self.groups, self.dense_offsets, strict=True):
            n = g.num_blocks * g.c1 * g.c2
            total = summed[start:start + n].view(g.num_blocks, -1).to(g.dtype)
            if not self.counted:
                out.append(total / ranks)
                continue
            counts = summed[self.dense_numel + start:self.dense_numel + start + n]
            out.append(total / counts.view(g.num_blocks, -1).to(g.dtype).clamp(min=1.0))
        return out

    def _decode_dense(self, summed: torch.Tensor, ranks: int) -> list[torch.Tensor]:
        # A dense sum over `ranks` replicas (one: this rank's own values), divided, inverted.
        out = self._placeholders()
        for g, coeffs in zip(self.groups, self.dense_coefficients(summed, ranks), strict=True):
            g.inverse_into(coeffs, out, self.shapes)
        return out

    def _decode(self, packed: torch.Tensor, ranks: int) -> list[torch.Tensor]:
        # The mean over `ranks` packed buckets per coefficient (one: this rank's own update).
        views = unpack(packed.view(ranks, self.bucket_bytes), self.segments)
        out = self._placeholders()
        for g, (first, count) in zip(self.groups, self.spans, strict=True):
            idx, vals = self.format.decode(views[first:first + count], g.num_blocks, g.k,
                                           g.c1 * g.c2, g.dtype)
            # (ranks, blocks, k) -> (blocks, ranks * k): every block's contributions in a row.
            idx = idx.permute(1, 0, 2).reshape(g.num_blocks, ranks * g.k)
            vals = vals.permute(1, 0, 2).reshape(g.num_blocks, ranks * g.k)
            g.decode_mean_into(idx, vals, out, self.shapes)
        return out

    # -- the optimizer's hooks -----------------------------------------------------------------
    def start(self, grads: list[torch.Tensor], lrs: list[float],
              stats: CommStats) -> Pending | None:
        """Steps up to the all-gather; None when nothing crosses the group."""
        self.decay_and_add(grads, lrs)
        if self.ranks == 1 or not self.groups:
            return None
        picked = self.dct_topk()
        wire = self.to_wire(picked)
        if self.dense:
            wire = self.to_dense_wire(picked, wire)
        self.remove_sent(picked, wire)
        if self.dense:
            return self.all_reduce_dense(picked, wire, stats)
        return self.all_gather(wire, stats)

    def finish(self, pending: Pending | None) -> list[torch.Tensor]:
        """Steps after the all-gather: the update every replica applies."""
        if pending is None:
            return self._whole_momentum()
        return self.decode_mean(pending)

    def replicate(self, grads: list[torch.Tensor], lrs: list[float],
                  stats: CommStats) -> list[torch.Tensor]:
        """One replicating step: :meth:`start`, then :meth:`finish` of this or the last one."""
        posted = self.start(grads, lrs, stats)
        if self.delay == 0 or posted is None:
            return self.finish(posted)
        previous, self.in_flight = self.in_flight, posted
        if self.lookahead:
            # Step on our own top-k now; after_update swaps the previous look-ahead for the mean.
            self.arrived = previous
            own = (self._decode_dense if self.dense else self._decode)(posted.sent, 1)
            posted.ahead = Ahead([u.sign() for u in own], list(lrs))
            return own
        if previous is None:
            return self._zeros()  # the first step: nothing has arrived yet (see the class doc)
        return self.finish(previous)

    def after_update(self, params: list[torch.Tensor], stats: CommStats) -> None:
        """lookahead: take the previous look-ahead back, step on the replicas' mean instead."""
        if not self.lookahead:
            return
        self.shards = params
        arrived, self.arrived = self.arrived, None
        if arrived is not None and arrived.ahead is not None:
            self._correct(arrived)

    @torch.no_grad()  # drain() runs outside the optimizer's step
    def _correct(self, pending: Pending) -> None:
        # The sign base stepped p -= lr * sign(own); p += lr * (sign(own) - sign(mean)) makes
        # it p -= lr * sign(mean), the step every replica takes.
        ahead = pending.ahead
        for p, own, mean, lr in zip(self.shards, ahead.signs, self.decode_mean(pending),
                                    ahead.lrs, strict=True):
            if p.numel():
                p.add_(own - mean.sign(), alpha=lr)

    def drain(self) -> None:
        """Wait for the exchange still in flight (delay=1): dropped, or with lookahead applied
        in place of the last look-ahead (so that the replicas end equal)."""
        pending, self.in_flight = self.in_flight, None
        if self.lookahead and pending is not None and pending.ahead is not None and self.shards:
            self._correct(pending)
        elif pending is not None and pending.work is not None:
            pending.work.wait()

    def accumulate(self, grads: list[torch.Tensor], lrs: list[float]) -> list[torch.Tensor]:
        """A step off the schedule: step on the local gradient (delta kept, as the reference)."""
        if self.fold_skipped:
            self.decay_and_add(grads, lrs)
        return grads

    def state_dict(self) -> dict:
        """The momentum of every block group and, with delay=1, the gathered bucket in flight."""
        state: dict = {"delta": [g.delta.clone() for g in self.groups]}
        if self.in_flight is not None:
            # Waited on here, so that a resumed run applies exactly what this one would have;
            # the bytes are the same on every replica, the wait only comes earlier.
            if self.in_flight.work is not None:
                self.in_flight.work.wait()
                self.in_flight = dataclasses.replace(self.in_flight, work=None)
            state["in_flight"] = self.in_flight.gathered.clone()
            ahead = self.in_flight.ahead
            if ahead is not None:  # lookahead: the step the exchange in flight will correct
                state["ahead"] = {"signs": [t.clone() for t in ahead.signs],
                                  "lrs": list(ahead.lrs)}
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore the momentum and any exchange that was in flight."""
        copy_state([g.delta for g in self.groups], state["delta"])
        gathered = state.get("in_flight")  # absent: saved with nothing in flight
        if gathered is None:
            self.in_flight = None
            return
        if self.delay == 0:
            raise ValueError("state_dict holds an exchange in flight, saved with delay=1, but "
                             "this replicator has delay=0; load it with delay=1.")
        size = self.dense_bytes // DENSE_DTYPE.itemsize if self.dense else (
            self.ranks * self.bucket_bytes)
        if gathered.numel() != size:
            raise ValueError(f"state_dict's exchange in flight holds {gathered.numel()} elements "
                             f"but this replicator exchanges {size}; load a state_dict saved over "
                             "the same parameters, replicas and exchange.")
        ahead = state.get("ahead")
        self.in_flight = Pending(gathered.to(self.groups[0].delta.device, copy=True), None,
                                 ahead=None if ahead is None else Ahead(
                                     [t.clone() for t in ahead["signs"]], list(ahead["lrs"])))

    def _zeros(self) -> list[torch.Tensor]:
        # The update of a step that applies nothing.
        return [torch.zeros(s, dtype=d, device=dev) for s, d, dev in self.empty_like]

    def _whole_momentum(self) -> list[torch.Tensor]:
        # Nobody to exchange with: like the reference, the whole momentum becomes the update.
        out = self._placeholders()
        for g in self.groups:
            g.take_all(out, self.shapes)
        return out

    def _placeholders(self) -> list[torch.Tensor]:
        # Decoding replaces every non-empty one; empty shards keep a zero update.
        return [torch.zeros(s, dtype=d, device=dev) if math.prod(s) == 0
                else torch.empty(0, dtype=d, device=dev) for s, d, dev in self.empty_like]
