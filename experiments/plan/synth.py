"""A method's program for a declared model, written as the trace a recording of it would hold.

The trace has the columns of a recorded one (`netsim.trace.TRACE_COLUMNS`), so it replays
through the same `netsim.model.simulate` on any topology. Per rank and training step, as
`flexdemo.parallelize` sets FSDP2 up (every block its own unit, resharded after the forward;
the root kept gathered through the backward):

- forward: an all-gather of each unit's shard, the root's first, then every block's; each
  after the first is issued when the unit before it starts computing (FSDP2's prefetch on a
  GPU) and waited on when that unit's forward ends;
- backward: an all-gather of each block's shard, issued when the unit after it starts its
  backward and waited on when that backward ends; after each unit's backward (its
  "unit_backward" mark) a reduce-scatter of its gradients (input: G shards) and, for hsdp-adamw,
  the inter-node all-reduce of the rank's gradient shard, both tagged with the unit so that
  overlap "fsdp2" streams them alongside the following backward;
- after the "backward" mark: the optimizer step and the method's own exchange (the DeMo
  family's top-k, sized by `flexdemo.replicators.demo.plan_exchange`, the code the optimizer
  sets itself up with; DiLoCo's outer all-reduce of the shard every H steps; Streaming
  DiLoCo's fragment syncs, cut by `fragment_pieces` and sized by the outer wire's `payload`,
  posted and applied on the replicator's own schedule). An exchange waited on in a later step
  than the one that posted it is carried there, as a recording holds it.

FSDP2's mixed precision sets the sizes: all-gathers carry `param_dtype`, reduce-scatters and
hsdp-adamw's all-reduce `reduce_dtype`. Collectives take no time in the trace (waited on as
issued, returned at once): the replay times them. Compute is the gaps between them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from experiments.errors import ConfigError
from experiments.plan.hardware import StepCompute
from experiments.plan.models import DeclaredModel, padded_shard_elements, shard_rows
from flexdemo.chunking import largest_divisor_at_most
from flexdemo.graphs import averages_exactly, peers
from flexdemo.knobs import AdaKnobs, DeMoKnobs
from flexdemo.methods import Method
from flexdemo.replicators import REPLICATORS
from flexdemo.replicators.ada import AdaRule
from flexdemo.replicators.base import mean_payload
from flexdemo.replicators.demo import plan_exchange
from flexdemo.replicators.diloco import outer_payload
from flexdemo.replicators.gossip import message_bytes
from flexdemo.replicators.partial import partial_payload, striding_rows
from flexdemo.replicators.sampled_spread import SampledSpread
from flexdemo.replicators.streaming_diloco import fragment_pieces
from netsim.costs import collective_volume, default_algorithm
from netsim.trace import BACKWARD, TRACE_COLUMNS, TRAIN, UNIT_BACKWARD

__all__ = ["DTYPE_BYTES", "PLANNED_METHODS", "AdaOnGraph", "Exchange", "Precision", "Shape",
           "exchanges", "local_shard_shapes", "outer_bytes", "sampled_entries", "schedule",
           "synthesize", "synthesize_replicas"]

DTYPE_BYTES = {"fp32": 4, "bf16": 2}
# The least compute after a delayed exchange's wait in its step (seconds).
_DECODE_S = 1e-6
# Methods whose program this module writes; others are refused by name.
PLANNED_METHODS = ("hsdp-adamw", "flexdemo", "flexdemo-async", "flexdemo-adamw", "demo",
                   "diloco", "streaming-diloco", "random", "striding", "gossip", "ada", "none")


@dataclass(frozen=True)
class AdaOnGraph:
    """Ada's knobs while it gossips on one `graph` of its ladder: a plan of Ada is the plan of
    each graph its steps spend time on (`experiments.plan.ada`); every other knob is Ada's."""

    knobs: AdaKnobs
    graph: str

    def __getattr__(self, name: str) -> object:
        return getattr(self.knobs, name)


def _own_knobs(knobs: object) -> object:
    """The knobs the replicator itself takes (Ada's, under one graph of its schedule)."""
    return knobs.knobs if isinstance(knobs, AdaOnGraph) else knobs


@dataclass(frozen=True)
class Precision:
    """FSDP2's mixed precision: the dtype its all-gathers carry and the one it reduces in."""

    param_dtype: str = "bf16"
    reduce_dtype: str = "fp32"

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value not in DTYPE_BYTES:
                raise ConfigError(f"{name}={value!r} is unknown; use one of "
                                  f"{', '.join(DTYPE_BYTES)}.")

    def describe(self) -> str:
        """One line: what FSDP2's traffic is sized in."""
        return (f"FSDP2 mixed precision: param_dtype={self.param_dtype} (its all-gathers), "
                f"reduce_dtype={self.reduce_dtype} (its reduce-scatters and hsdp-adamw's "
                "inter-node all-reduce); master parameters, gradients and optimizer state fp32")


@dataclass(frozen=True)
class Shape:
    """The trace's cluster: nodes (1 or 2: the replay spreads replicate groups over the target's)
    and ranks per node (the target's)."""

    nodes: int
    per_node: int

    @property
    def world(self) -> int:
        """Ranks in the trace."""
        return self.nodes * self.per_node


@functools.lru_cache(maxsize=64)
def local_shard_shapes(model: DeclaredModel, per_node: int,
                       local: int) -> tuple[tuple[int, ...], ...]:
    """Every parameter's local FSDP2 shard on local rank `local` (unpadded), in the order the
    optimizer is handed them (``model.parameters()``)."""
    shapes = model.shapes or tuple(shape for unit in model.units for shape in unit)
    out = []
    for shape in shapes:
        full = tuple(shape) or (1,)
        out.append((shard_rows(full[0], per_node, local), *full[1:]))
    return tuple(out)


def outer_bytes(model: DeclaredModel, per_node: int, local: int, itemsize: int = 4) -> int:
    """Bytes of DiLoCo's outer all-reduce of `anchor - params` (fp32) on local rank `local`,
    sized by the replicator's own `outer_payload`."""
    numels = [math.prod(s) for s in local_shard_shapes(model, per_node, local)]
    return outer_payload(numels, itemsize)[1]


def schedule(record: Method, knobs: object) -> tuple[int, Callable[[int], bool]]:
    """(period in steps, whether 1-based step s exchanges), from the replicator's own schedule."""
    if record.replicator is None:
        return 1, lambda _step: True
    replicator = REPLICATORS[record.replicator](_own_knobs(knobs))
    every = replicator.replicate_every
    skip = replicator.skip_every
    period = every if skip is None else math.lcm(every, skip)
    return period, replicator.replicates_on


@functools.lru_cache(maxsize=4096)
def _volume(op: str, size: int, nbytes: int, algorithm: str) -> object:
    """netsim's wire bytes of one op (the same few sizes recur in every step)."""
    return collective_volume(op, size, nbytes, algorithm)


class _Rank:
    """One rank's rows, written along its own compute clock."""

    def __init__(self, rank: int, shape: Shape, backend: str) -> None:
        self.backend = backend
        self.rank, self.node, self.local = rank, rank // shape.per_node, rank % shape.per_node
        self.shape = shape
        self.rows: list[dict] = []
        self.t = 0.0
        self.step = 0
        self.unit = -1
        first = self.node * shape.per_node
        self.intra = ",".join(str(first + j) for j in range(shape.per_node))
        self.replicate = ",".join(str(self.local + k * shape.per_node)
                                  for k in range(shape.nodes))

    def _row(self, **values: object) -> dict:
        row = {"rank": self.rank, "node": self.node, "local": self.local, "step": self.step,
               "seq": len(self.rows), "kind": "compute", "op": "", "group": "", "group_size": 0,
               "peer": -1, "inter": False, "algorithm": "", "bytes": 0, "bytes_sent": 0.0,
               "bytes_received": 0.0, "start_s": self.t, "wait_s": math.nan, "end_s": self.t,
               "modeled_s": math.nan, "phase": TRAIN, "unit": self.unit}
        row.update(values)
        self.rows.append(row)
        return row

    def compute(self, seconds: float) -> None:
        """Advance the clock: compute, which the replay finds as the gap."""
        self.t += seconds

    def issue(self, op: str, nbytes: int, inter: bool, unit: int | None = None) -> dict:
        """A collective issued now on the node's group (inter: the replicate group)."""
        group = self.replicate if inter else self.intra
        size = self.shape.nodes if inter else self.shape.per_node
        if size == 1:  # FSDP2 runs nothing on a one-rank shard group (a 2 x 1 recording has none)
            return {}
        algorithm = default_algorithm(op, self.backend)
        volume = _volume(op, size, int(nbytes), algorithm)
        return self._row(kind="collective", op=op, group=group, group_size=size, inter=inter,
                         algorithm=algorithm, bytes=int(nbytes),
                         bytes_sent=float(volume.bytes_sent),
                         bytes_received=float(volume.bytes_received), wait_s=math.nan,
                         end_s=math.nan, unit=self.unit if unit is None else unit)

    def message(self, op: str, nbytes: int, peer: int) -> dict:
        """A point-to-point message ("send" or "recv") to or from global rank `peer`, issued
        now on the replicate group (gossip's)."""
        sent = float(nbytes) if op == "send" else 0.0
        return self._row(kind="collective", op=op, group=self.replicate,
                         group_size=self.shape.nodes, peer=int(peer), inter=True,
                         algorithm="direct", bytes=int(nbytes), bytes_sent=sent,
                         bytes_received=float(nbytes) - sent, wait_s=math.nan, end_s=math.nan)

    def wait(self, row: dict) -> None:
        """Wait on an issued collective now (it returns at once: the replay times it)."""
        row["wait_s"] = row["end_s"] = self.t

    def run(self, op: str, nbytes: int, inter: bool) -> None:
        """Issue a collective and wait on it at once."""
        self.wait(self.issue(op, nbytes, inter))

    def mark(self, op: str, unit: int = -1) -> None:
        """A moment in the step: a unit's backward ended, or the whole backward."""
        self.unit = unit
        self._row(kind="mark", op=op, unit=unit)

    def begin(self, step: int) -> float:
        """Start a step; returns its start time."""
        self.step, self.unit = step, -1
        return self.t

    def end(self, begin: float) -> None:
        """Close the step with its kind="step" row."""
        self.unit = -1
        self._row(kind="step", start_s=begin, end_s=self.t)


class _Sizes:
    """Bytes of each unit's FSDP2 collectives at G ranks per node, in the plan's precision."""

    def __init__(self, model: DeclaredModel, per_node: int, precision: Precision) -> None:
        shard = [sum(padded_shard_elements(s, per_node) for s in unit) for unit in model.units]
        self.gather = [n * DTYPE_BYTES[precision.param_dtype] for n in shard]
        reduce = DTYPE_BYTES[precision.reduce_dtype]
        self.scatter = [n * per_node * reduce for n in shard]
        self.all_reduce = [n * reduce for n in shard]


def _fsdp2_step(rank: _Rank, sizes: _Sizes, compute: StepCompute, inter_all_reduce: bool,
                reduced: Callable[[int], None] | None = None) -> None:
    """Forward and backward of one step, with FSDP2's collectives (module docstring);
    ``reduced(unit)`` once a unit's gradient reduction is issued."""
    root = len(sizes.gather) - 1
    forward = [root, *range(root)]
    rank.run("all_gather", sizes.gather[forward[0]], False)
    _prefetching(rank, sizes, forward, compute.forward_s)
    # Backward: the root (kept gathered) first, its head's gradient; then the blocks, last first.
    backward = [root, *range(root - 1, -1, -1)]

    def reduce_unit(unit: int) -> None:
        _reduce(rank, sizes, unit, inter_all_reduce)
        if reduced is not None:
            reduced(unit)

    def reduce_block(unit: int) -> None:
        if unit != root:  # the root's reduction waits for the backward's end
            reduce_unit(unit)

    _prefetching(rank, sizes, backward, compute.backward_s, then=reduce_block)
    reduce_unit(root)
    # After the root's reduction, as a recording marks it (the backward's end, FSDP2's last
    # reduce-scatter included): the optimizer step, and any exchange in it, waits for them all.
    rank.mark(BACKWARD)


def _prefetching(rank: _Rank, sizes: _Sizes, order: list[int], seconds: Sequence[float],
                 then: Callable[[int], None] | None = None) -> None:
    """Compute the units in ``order``, each next unit all-gathered while this one computes
    (FSDP2's prefetch); ``then(unit)`` once a unit's compute and the prefetch are done."""
    for i, unit in enumerate(order):
        ahead = (rank.issue("all_gather", sizes.gather[order[i + 1]], False)
                 if i + 1 < len(order) else None)
        rank.compute(seconds[unit])
        if ahead is not None:
            rank.wait(ahead)
        if then is not None:
            then(unit)


def _reduce(rank: _Rank, sizes: _Sizes, unit: int, inter_all_reduce: bool) -> None:
    """A unit's backward ended: its reduce-scatter and (HSDP) inter-node all-reduce."""
    rank.mark(UNIT_BACKWARD, unit)
    rank.wait(rank.issue("reduce_scatter", sizes.scatter[unit], False))
    if inter_all_reduce and rank.shape.nodes > 1:
        rank.wait(rank.issue("all_reduce", sizes.all_reduce[unit], True))


def synthesize(record: Method, knobs: object, model: DeclaredModel, shape: Shape,
               compute: StepCompute, precision: Precision, steps: int,
               replicas: int | None = None, backend: str = "nccl",
               first: int = 1, sync_in_backward: bool = False) -> pd.DataFrame:
    """The trace of `steps` training steps of `record`'s method on `shape` (module docstring).

    `knobs` are the replicator's (record.settings); steps are numbered from `first` (1-based,
    as runs number them), so that the replicator's schedule decides which exchange.
    `replicas`: the target's node count (default: the trace's), which sizes what depends on it
    (DeMo's exchange="auto"). `backend` names the algorithm each op runs
    (`netsim.costs.default_algorithm`): "nccl" rings; "gloo" runs a reduce-scatter as an
    all-reduce, as CPU recordings hold it. An exchange still in flight after the last step is
    waited on after it (a run's drain). `sync_in_backward`: DiLoCo's and Streaming DiLoCo's
    sync is posted unit by unit, each piece when its unit's gradient reduction is issued in
    the backward (`in_backward`), not after the backward.
    """
    if record.name not in PLANNED_METHODS:
        raise ConfigError(f"--method {record.name!r} has no synthesized program yet; plan one "
                          f"of {', '.join(PLANNED_METHODS)}.")
    if not record.shards:
        return synthesize_replicas(record, knobs, model, shape, compute, steps,
                                   replicas=replicas, backend=backend, first=first)
    sizes = _Sizes(model, shape.per_node, precision)
    exchange = exchanges(record, knobs, model, shape.per_node, replicas or shape.nodes)
    if isinstance(exchange, _GossipExchange):
        return _synthesize_each_rank(record, exchange, sizes, shape, compute, steps, backend,
                                     first)
    # Every rank runs the same FSDP2 program; only the exchange's payload may differ from one
    # local rank to another (FSDP2's last shards can be short). One rank's rows stand for all
    # the ranks whose exchange is the same, relabelled.
    steps_run = range(first, first + steps)
    alike: dict[tuple, list[int]] = {}
    for local in range(shape.per_node):
        posts = tuple(tuple(exchange.posts(s, local)) for s in steps_run) if shape.nodes > 1 \
            else ()
        alike.setdefault(posts, []).append(local)
    frames = []
    for locals_ in alike.values():
        rank = _Rank(locals_[0], shape, backend)
        _sharded_steps(rank, record, exchange, sizes, compute, steps_run,
                       sync_in_backward and shape.nodes > 1)
        template = pd.DataFrame(rank.rows, columns=list(TRACE_COLUMNS))
        frames.append(_relabelled(template, shape,
                                  [(node, local) for node in range(shape.nodes)
                                   for local in locals_]))
    trace = pd.concat(frames, ignore_index=True).astype(TRACE_COLUMNS)
    return trace.sort_values(["rank", "seq"], kind="stable", ignore_index=True)


def _sharded_steps(rank: _Rank, record: Method, exchange: Exchange, sizes: _Sizes,
                   compute: StepCompute, steps: range, sync_in_backward: bool) -> None:
    """One rank's steps: FSDP2's forward and backward, the optimizer step around the method's
    exchange (none on one node), and the drain of what is still in flight."""
    in_flight: dict[object, list[dict]] = {}
    for step in steps:
        begin = rank.begin(step)
        early = in_backward(exchange, step, rank.local) if sync_in_backward else {}
        _fsdp2_step(rank, sizes, compute, record.inter_all_reduce,
                    functools.partial(_post_in_backward, rank, early, in_flight) if early
                    else None)
        rank.compute(compute.optimizer_s / 2)
        # The method's exchange belongs to no FSDP2 unit (as recordings tag it): tagged
        # with the root's, the fsdp2 overlap would stream it as the root's reduction and
        # make the optimizer step wait for it, a carried exchange included.
        rank.unit = -1
        if rank.shape.nodes > 1:
            _exchange_step(rank, exchange, step, in_flight,
                           posted={key for unit in early.values() for key, *_ in unit})
        rank.compute(compute.optimizer_s / 2)
        rank.end(begin)
    for rows in in_flight.values():  # the run's drain: waited on after its last step
        for row in rows:
            row["wait_s"] = row["end_s"] = rank.t + _DECODE_S


def _relabelled(template: pd.DataFrame, shape: Shape,
                ranks: list[tuple[int, int]]) -> pd.DataFrame:
    """One rank's rows as each (node, local) rank's, one after another: its rank, node, local
    index and groups (built column by column: a 100B model's trace has 10^5 rows a rank)."""
    count, rows = len(ranks), len(template)
    nodes = np.array([node for node, _ in ranks], dtype=np.int64)
    locals_ = np.array([local for _, local in ranks], dtype=np.int64)
    columns = {name: np.tile(template[name].to_numpy(), count) for name in template.columns}
    columns["rank"] = np.repeat(nodes * shape.per_node + locals_, rows)
    columns["node"], columns["local"] = np.repeat(nodes, rows), np.repeat(locals_, rows)
    collective = template["kind"].to_numpy() == "collective"
    inter = template["inter"].to_numpy().astype(bool)
    intra_groups = [",".join(str(node * shape.per_node + j) for j in range(shape.per_node))
                    for node, _ in ranks]
    inter_groups = [",".join(str(local + k * shape.per_node) for k in range(shape.nodes))
                    for _, local in ranks]
    group = columns["group"].astype(object)
    for i in range(count):
        block = group[i * rows:(i + 1) * rows]  # a view: written in place
        block[collective & ~inter] = intra_groups[i]
        block[collective & inter] = inter_groups[i]
    columns["group"] = group
    return pd.DataFrame(columns, columns=template.columns)


def _post_in_backward(rank: _Rank, early: dict[int, list[tuple[object, str, int]]],
                      in_flight: dict[object, list[dict]], unit: int) -> None:
    """Post the pieces of the sync that start when `unit`'s backward ends (`in_backward`); they
    belong to no FSDP2 unit, so the replay does not stream them as its gradient reduction."""
    for key, op, nbytes in early.get(unit, ()):
        in_flight.setdefault(key, []).append(rank.issue(op, nbytes, True, unit=-1))


def _exchange_step(rank: _Rank, exchange: Exchange, step: int,
                   in_flight: dict[object, list[dict]], posted: set[object] = frozenset()) -> None:
    """This step's exchange: what it runs first and waits for (Ada's measurement), then post
    what it posts (but the keys in `posted`: already posted in the backward), then wait on
    what it applies."""
    for op, nbytes, inter in exchange.blocking(step, rank.local):
        row = rank.issue(op, nbytes, inter)
        if row:  # a group of one runs nothing
            rank.wait(row)
            # What follows starts after it (ops at one moment would replay as issued
            # together): the arithmetic on its result (Ada's spread and decision).
            rank.compute(_DECODE_S)
    posted_now = set(posted)
    for key, op, nbytes, *peer in exchange.posts(step, rank.local):
        if key in posted:
            continue
        in_flight[key] = [rank.message(op, nbytes, peer[0]) if peer
                          else rank.issue(op, nbytes, True)]
        posted_now.add(key)
    carried = False
    for key in exchange.waits(step):
        for row in in_flight.pop(key, []):
            rank.wait(row)
            carried = carried or key not in posted_now
    if carried:
        # A wait at the very end of its step reads as one between steps, taken at the next
        # step's start (netsim.model.programs); the decode that follows keeps it in its step.
        rank.compute(_DECODE_S)


class Exchange:
    """A method's inter-node ops of one step: the ones it posts and the ones it waits on."""

    def posts(self, step: int, local: int) -> list[tuple[object, str, int]]:
        """(key, op, payload bytes) of every op posted after 1-based step `step`'s update."""
        return []

    def waits(self, step: int) -> list[object]:
        """Keys of the posted ops step `step` waits on (after its posts)."""
        return []

    def blocking(self, step: int, local: int) -> list[tuple[str, int, bool]]:
        """(op, payload bytes, whether it crosses nodes) of every op step `step` runs and waits
        for before its posts."""
        return []

    def unit_elements(self, step: int, local: int) -> dict[object, dict[int, int]]:
        """Per key posted after step `step`: its elements in each FSDP2 unit, for a sync that
        can start unit by unit in the backward (empty: none can)."""
        return {}


def in_backward(exchange: Exchange, step: int,
                local: int) -> dict[int, list[tuple[object, str, int]]]:
    """Per FSDP2 unit, the pieces of step `step`'s posts that start when its backward ends:
    each post's bytes split over the units by their elements (the total kept exact)."""
    elements = exchange.unit_elements(step, local)
    out: dict[int, list[tuple[object, str, int]]] = {}
    for key, op, nbytes, *_ in exchange.posts(step, local):
        per_unit = {u: n for u, n in sorted(elements.get(key, {}).items()) if n}
        total, done, sent = sum(per_unit.values()), 0, 0
        for unit, n in per_unit.items():
            done += n
            share = nbytes * done // total - sent
            sent += share
            out.setdefault(unit, []).append((key, op, share))
    return out


def _unit_totals(model: DeclaredModel, pieces: list[tuple[int, int, int]]) -> dict[int, int]:
    """Elements of (parameter, start, end) pieces per FSDP2 unit."""
    out: dict[int, int] = {}
    for i, start, end in pieces:
        unit = model.unit_of[i]
        out[unit] = out.get(unit, 0) + end - start
    return out


@functools.lru_cache(maxsize=256)
def sampled_entries(shapes: tuple[tuple[int, ...], ...], sample: int, seed: int) -> int:
    """Entries Ada's spread is measured on for shards of `shapes`: the count `SampledSpread`
    itself draws (its seeded picks, de-duplicated), on meta tensors."""
    params = [torch.empty(shape, device="meta") for shape in shapes]
    return SampledSpread(params, sample, seed).entries


class _DeMoExchange(Exchange):
    """The DeMo family's one bucket per replicating step, sized by `plan_exchange`."""

    def __init__(self, record: Method, knobs: DeMoKnobs, model: DeclaredModel, per_node: int,
                 replicas: int) -> None:
        self.knobs, self.model, self.per_node, self.replicas = knobs, model, per_node, replicas
        self.replicates_on = REPLICATORS[record.replicator](knobs).replicates_on
        self.plans: dict[tuple, object] = {}

    def plan(self, local: int) -> object:
        """The exchange of local rank `local` (ranks whose shards have the same shapes, all of
        them where FSDP2 cuts evenly, share one: sizing a 70B model's chunks takes seconds)."""
        shapes = tuple(local_shard_shapes(self.model, self.per_node, local))
        if shapes not in self.plans:
            self.plans[shapes] = plan_exchange(list(shapes), [torch.float32] * len(shapes),
                                               self.knobs, self.replicas)
        return self.plans[shapes]

    def posts(self, step: int, local: int) -> list[tuple[object, str, int]]:
        """The bucket (or dense vector) of a replicating step."""
        if not self.replicates_on(step):
            return []
        plan = self.plan(local)
        return [(step, plan.op, plan.payload_bytes)]

    def waits(self, step: int) -> list[object]:
        """delay=0: this step's own; delay=1: the previous replicating step's."""
        if not self.replicates_on(step):
            return []
        if self.knobs.delay == 0:
            return [step]
        earlier = [s for s in range(step - 1, 0, -1) if self.replicates_on(s)]
        return earlier[:1]


class _DiLoCoExchange(Exchange):
    """DiLoCo's outer sync of the whole shard every diloco_h steps, in its outer_format."""

    def __init__(self, record: Method, knobs: object, model: DeclaredModel,
                 per_node: int) -> None:
        self.replicates_on = REPLICATORS[record.replicator](knobs).replicates_on
        self.outer_format = knobs.outer_format  # type: ignore[attr-defined]
        self.model, self.per_node = model, per_node

    def posts(self, step: int, local: int) -> list[tuple[object, str, int]]:
        """The pseudo-gradient's all-reduce (all-gather of codes) on a syncing step."""
        if not self.replicates_on(step):
            return []
        if self.outer_format == "fp32":
            return [(step, "all_reduce", outer_bytes(self.model, self.per_node, local))]
        numels = [math.prod(s) for s in local_shard_shapes(self.model, self.per_node, local)]
        op, nbytes = outer_payload(numels, outer_format=self.outer_format)
        return [(step, op, nbytes)]

    def waits(self, step: int) -> list[object]:
        """Waited on in the step that posts it."""
        return [step] if self.replicates_on(step) else []

    def unit_elements(self, step: int, local: int) -> dict[object, dict[int, int]]:
        """The whole shard, unit by unit."""
        if not self.replicates_on(step):
            return {}
        shapes = local_shard_shapes(self.model, self.per_node, local)
        return {step: _unit_totals(self.model, [(i, 0, math.prod(s))
                                                for i, s in enumerate(shapes)])}


class _StreamingExchange(Exchange):
    """Streaming DiLoCo: one fragment's sync posted tau steps before it is applied."""

    def __init__(self, record: Method, knobs: object, model: DeclaredModel,
                 per_node: int) -> None:
        replicator = REPLICATORS[record.replicator](knobs)
        self.prepared_on = replicator.fragment_prepared_on
        self.applied_on = replicator.fragment_applied_on
        self.wire = replicator.wire
        self.knobs, self.model, self.per_node = knobs, model, per_node

    def fragments(self, local: int) -> list[int]:
        """Elements of each fragment of local rank `local`'s shards (the replicator's cut)."""
        return [sum(b - a for _, a, b in pieces) for pieces in self.pieces(local)]

    def pieces(self, local: int) -> list[list[tuple[int, int, int]]]:
        """Each fragment's (parameter, start, end) pieces of local rank `local`'s shards."""
        sizes = [math.prod(s) for s in local_shard_shapes(self.model, self.per_node, local)]
        try:
            return fragment_pieces(sizes, self.knobs.num_fragments, self.knobs.fragment_cut,
                                   self.knobs.fragment_runs)
        except ValueError as err:
            raise ConfigError(f"--method streaming-diloco: {err}") from None

    def unit_elements(self, step: int, local: int) -> dict[object, dict[int, int]]:
        """The fragment prepared after this step, unit by unit."""
        fragment = self.prepared_on(step)
        if fragment is None:
            return {}
        return {fragment: _unit_totals(self.model, self.pieces(local)[fragment])}

    def posts(self, step: int, local: int) -> list[tuple[object, str, int]]:
        """The fragment prepared after this step, in the outer wire format."""
        fragment = self.prepared_on(step)
        if fragment is None:
            return []
        numel = self.fragments(local)[fragment]
        if numel == 0:
            return []  # nothing of it on this rank: nothing crosses (the replicator's rule)
        op, nbytes = self.wire.payload(numel)
        return [(fragment, op, nbytes)]

    def waits(self, step: int) -> list[object]:
        """The fragment applied after this step."""
        fragment = self.applied_on(step)
        return [] if fragment is None else [fragment]


def exchanges(record: Method, knobs: object, model: DeclaredModel, per_node: int,
              replicas: int) -> Exchange:
    """The method's inter-node exchange, from its replicator's own schedule and sizing."""
    if record.replicator is None:
        reduce_format = getattr(knobs, "reduce_format", "fp32")
        if reduce_format != "fp32":
            raise ConfigError(f"--method {record.name!r} with reduce_format={reduce_format!r} "
                              "has no synthesized program yet; plan it at reduce_format=fp32 "
                              "(FSDP2's all-reduce).")
        return Exchange()  # hsdp-adamw: FSDP2's all-reduce, in the backward
    if isinstance(knobs, DeMoKnobs):
        return _DeMoExchange(record, knobs, model, per_node, replicas)
    if record.replicator == "diloco":
        return _DiLoCoExchange(record, knobs, model, per_node)
    if record.replicator == "streaming-diloco":
        return _StreamingExchange(record, knobs, model, per_node)
    if record.replicator in ("random", "striding"):
        return _PartialExchange(record, knobs, model, per_node)
    if record.replicator in ("gossip", "ada"):
        return _GossipExchange(record, knobs, model, per_node, replicas)
    if record.replicator == "none":
        return Exchange()
    raise ConfigError(f"--method {record.name!r} has no synthesized program yet; plan one of "
                      f"{', '.join(PLANNED_METHODS)}.")


def _replicating_before(replicates_on: Callable[[int], bool], step: int) -> int:
    """Replicating steps before 1-based step `step` (a replicator's counter at that step)."""
    return sum(1 for s in range(1, step) if replicates_on(s))


class _PartialExchange(Exchange):
    """Random and striding replication: one all-reduce of the chosen rows of the momentum per
    replicating step, sized by the replicator's own `partial_payload`."""

    def __init__(self, record: Method, knobs: object, model: DeclaredModel,
                 per_node: int) -> None:
        self.kind = record.replicator
        self.replicates_on = REPLICATORS[record.replicator](knobs).replicates_on
        self.knobs, self.model, self.per_node = knobs, model, per_node

    def posts(self, step: int, local: int) -> list[tuple[object, str, int]]:
        """The chosen rows' all-reduce on a replicating step (striding's comb by its counter)."""
        if not self.replicates_on(step):
            return []
        counter = _replicating_before(self.replicates_on, step) if self.kind == "striding" else 0
        shapes = list(local_shard_shapes(self.model, self.per_node, local))
        if self.kind == "striding":
            _check_steady_comb(shapes, self.knobs)
        op, nbytes = partial_payload(self.kind, shapes, self.knobs, counter)
        return [(step, op, nbytes)] if nbytes else []

    def waits(self, step: int) -> list[object]:
        """Waited on in the step that posts it."""
        return [step] if self.replicates_on(step) else []


@functools.lru_cache(maxsize=256)
def _comb_sizes(chunks: int, rate: float) -> frozenset[int]:
    """The sizes striding's comb over `chunks` chunks takes as its offset turns."""
    m = max(1, int(rate * chunks))
    return frozenset(int(striding_rows(chunks, rate, c).numel())
                     for c in range(math.ceil(chunks / m)))


def _check_steady_comb(shapes: list[tuple[int, ...]], knobs: object) -> None:
    """Refuse a striding rate whose comb changes size from step to step (the plan replays one
    replicating step for all of them)."""
    for shape in shapes:
        numel = math.prod(shape)
        if numel and len(_comb_sizes(largest_divisor_at_most(numel, knobs.chunk),
                                     knobs.rate)) > 1:
            raise ConfigError(f"--method striding: rate={knobs.rate} makes the comb over a "
                              f"shard of {numel} elements send a different number of chunks "
                              "at different steps, which the plan does not replay; plan a "
                              "lower rate (such as the default 0.1).")


class _GossipExchange(Exchange):
    """Gossip: after the local step, one message each way per neighbour of the graph, the
    neighbours from `flexdemo.graphs.peers` at the replicator's round, the message sized by
    the replicator's `message_bytes`; a round that is the exact average on the target's
    replicas (`flexdemo.graphs.averages_exactly`: the complete graph) one all-reduce of the
    shard instead, as the replicator takes it."""

    def __init__(self, record: Method, knobs: object, model: DeclaredModel, per_node: int,
                 replicas: int) -> None:
        self.replicates_on = REPLICATORS[record.replicator](_own_knobs(knobs)).replicates_on
        self.graph, self.replicas = knobs.graph, replicas
        self.model, self.per_node = model, per_node
        self.node, self.nodes = 0, 1
        # Ada: its rule's measuring rounds, each a blocking measurement before the messages.
        self.rule = (AdaRule(1, knobs.ada_every, knobs.ada_high, knobs.ada_low)
                     if isinstance(knobs, AdaOnGraph) else None)
        self.sample = knobs.ada_sample if self.rule is not None else 0
        self.rule_seed = knobs.seed if self.rule is not None else 0

    def at(self, node: int, nodes: int) -> _GossipExchange:
        """This exchange as node `node` of `nodes` runs it (its own neighbours)."""
        self.node, self.nodes = node, nodes
        return self

    def _peers(self, round_: int) -> list[int]:
        """This node's neighbours at `round_`. A trace of fewer nodes than the target (the
        plan's two) stands in for it: each node's one neighbour is the other, and the replay
        counts the target graph's degree (`simulate(degrees=...)`)."""
        if self._exact(round_):
            return []
        graph = self.graph if self.nodes == self.replicas else "ring"
        return peers(graph, self.nodes, self.node, round_)

    def _exact(self, round_: int) -> bool:
        """Whether the round all-reduces: the exact average on the target's replicas."""
        return averages_exactly(self.graph, self.replicas, round_)

    def posts(self, step: int, local: int) -> list[tuple[object, str, int, int]]:
        """A send and a receive per neighbour (global ranks of the same local index)."""
        if not self.replicates_on(step) or self.nodes < 2:
            return []
        round_ = _replicating_before(self.replicates_on, step)
        numels = [math.prod(s) for s in local_shard_shapes(self.model, self.per_node, local)]
        nbytes = message_bytes(numels)
        out = []
        for node in self._peers(round_):
            rank = node * self.per_node + local
            out += [((step, node, "send"), "send", nbytes, rank),
                    ((step, node, "recv"), "recv", nbytes, rank)]
        return out

    def waits(self, step: int) -> list[object]:
        """Every message of the round, in the step that posts them."""
        if not self.replicates_on(step) or self.nodes < 2:
            return []
        round_ = _replicating_before(self.replicates_on, step)
        return [(step, node, op) for node in self._peers(round_) for op in ("send", "recv")]

    def blocking(self, step: int, local: int) -> list[tuple[str, int, bool]]:
        """Ada's measurement on a measuring round (`AdaRule.measures_at`), before the messages
        (`SampledSpread.measure`): an all-reduce of the sampled entries and their sum of
        squares (float64) over the replicate group, then an all-gather of two float64 inside
        the node; and a round that is the exact average, its all-reduce of the shard."""
        if not self.replicates_on(step) or self.nodes < 2:
            return []
        round_ = _replicating_before(self.replicates_on, step)
        shapes = local_shard_shapes(self.model, self.per_node, local)
        ops = []
        if self.rule is not None and self.rule.measures_at(round_):
            entries = sampled_entries(shapes, self.sample, self.rule_seed)
            ops += [("all_reduce", (entries + 1) * 8, True), ("all_gather", 2 * 8, False)]
        if self._exact(round_):
            ops.append((*mean_payload(sum(math.prod(s) for s in shapes)), True))
        return ops


def _synthesize_each_rank(record: Method, exchange: _GossipExchange, sizes: _Sizes, shape: Shape,
                          compute: StepCompute, steps: int, backend: str,
                          first: int) -> pd.DataFrame:
    """`synthesize` for an exchange whose ops differ from node to node (gossip's neighbours):
    every rank written on its own."""
    frames = []
    for rank_id in range(shape.world):
        rank = _Rank(rank_id, shape, backend)
        exchange.at(rank.node, shape.nodes)
        in_flight: dict[object, list[dict]] = {}
        for step in range(first, first + steps):
            begin = rank.begin(step)
            _fsdp2_step(rank, sizes, compute, record.inter_all_reduce)
            rank.compute(compute.optimizer_s)
            rank.unit = -1  # the exchange belongs to no FSDP2 unit (see `synthesize`)
            _exchange_step(rank, exchange, step, in_flight)
            rank.end(begin)
        frames.append(pd.DataFrame(rank.rows, columns=list(TRACE_COLUMNS)))
    trace = pd.concat(frames, ignore_index=True).astype(TRACE_COLUMNS)
    return trace.sort_values(["rank", "seq"], kind="stable", ignore_index=True)


def synthesize_replicas(record: Method, knobs: object, model: DeclaredModel, shape: Shape,
                        compute: StepCompute, steps: int, replicas: int | None = None,
                        backend: str = "nccl", first: int = 1) -> pd.DataFrame:
    """The trace of a method without sharding (demo): every rank holds the whole model and is
    a replica; after its forward and backward (one compute, no FSDP2 collectives) and half
    the optimizer step, its exchange over every rank of the world (the DeMo family's bucket,
    sized by `plan_exchange` over the whole model's shapes for `replicas` ranks: the target's
    world, default the trace's)."""
    world = shape.world
    exchange = exchanges(record, knobs, model, 1, replicas or world)
    group = ",".join(str(r) for r in range(world))
    template = _Rank(0, shape, backend)
    template.replicate = group
    template.shape = Shape(world, 1)  # the exchange's group: every rank, one replica each
    in_flight: dict[object, list[dict]] = {}
    for step in range(first, first + steps):
        begin = template.begin(step)
        template.compute(sum(compute.forward_s) + sum(compute.backward_s))
        template.mark(BACKWARD)
        template.compute(compute.optimizer_s / 2)
        if world > 1:
            _exchange_step(template, exchange, step, in_flight)
        template.compute(compute.optimizer_s / 2)
        template.end(begin)
    for rows in in_flight.values():
        for row in rows:
            row["wait_s"] = row["end_s"] = template.t + _DECODE_S
    rows = pd.DataFrame(template.rows, columns=list(TRACE_COLUMNS))
    frames = []
    for rank in range(world):
        frame = rows.copy()
        frame["rank"], frame["node"] = rank, rank // shape.per_node
        frame["local"] = rank % shape.per_node
        frames.append(frame)
    trace = pd.concat(frames, ignore_index=True).astype(TRACE_COLUMNS)
    return trace.sort_values(["rank", "seq"], kind="stable", ignore_index=True)
