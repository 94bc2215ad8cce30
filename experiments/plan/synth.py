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
- after the "backward" mark: the optimizer step and the method's own exchange, which its
  replicator writes (`Replicator.program`, `flexdemo.program`) from its own sizing and
  schedule for each rank's shard shapes: the ops it runs and waits for first, then those it
  posts, then the posted ones it waits on (in a later step than the one that posted them:
  carried there, as a recording holds it). The exchange sits between the optimizer step's two
  halves, or after the whole step where the program says its exchange ends the step
  (`ends_step`: gossip's mixing). A message goes to the rank of the same local index on its
  peer's node.

FSDP2's mixed precision sets the sizes: all-gathers carry `param_dtype`, reduce-scatters and
hsdp-adamw's all-reduce `reduce_dtype`. Collectives take no time in the trace (waited on as
issued, returned at once): the replay times them. Compute is the gaps between them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from experiments.errors import ConfigError
from experiments.plan.hardware import StepCompute
from experiments.plan.models import DeclaredModel, padded_shard_elements, shard_rows
from flexdemo.build import has_program, program_of, replicator_of
from flexdemo.knobs import AdaKnobs
from flexdemo.methods import RECORDS, Method
from flexdemo.program import Op, Program
from netsim.costs import collective_volume, default_algorithm
from netsim.trace import BACKWARD, TRACE_COLUMNS, TRAIN, UNIT_BACKWARD

__all__ = ["DTYPE_BYTES", "PLANNED_METHODS", "AdaOnGraph", "Precision", "RankProgram", "Shape",
           "has_program", "local_shard_shapes", "method_program", "rank_program",
           "sync_in_backward", "synthesize", "synthesize_replicas", "wired"]

DTYPE_BYTES = {"fp32": 4, "bf16": 2}
# The least compute after a delayed exchange's wait in its step (seconds).
_DECODE_S = 1e-6


PLANNED_METHODS = tuple(m.name for m in RECORDS if has_program(m))
"""The built-in methods the planner plans: those whose replicator writes a program."""


def sync_in_backward(record: Method) -> bool:
    """Whether the method's sync could start unit by unit in the backward (its replicator's
    `sync_in_backward`: its program's `unit_elements`)."""
    cls = replicator_of(record)
    return cls is not None and cls.sync_in_backward


def wired(record: Method, knobs: object) -> Method:
    """The record as its knobs wire it (`Method.wired`: hsdp-adamw in low precision is the
    reduce replicator's)."""
    if record.replicator is None and dataclasses.is_dataclass(knobs):
        return record.wired(dataclasses.asdict(knobs))
    return record


@dataclass(frozen=True)
class AdaOnGraph:
    """Ada's knobs while it gossips on one `graph` of its ladder: a plan of Ada is the plan of
    each graph its steps spend time on (`experiments.plan.ada`); every other knob is Ada's."""

    knobs: AdaKnobs
    graph: str

    def __getattr__(self, name: str) -> object:
        return getattr(self.knobs, name)


@functools.lru_cache(maxsize=64)
def method_program(record: Method, knobs: object, shapes: tuple[tuple[int, ...], ...],
                   replicas: int, node: int = 0) -> Program:
    """The program `record`'s replicator writes for a rank whose shards have `shapes` (fp32)
    among `replicas` replicas, as replica `node` (`flexdemo.build.program_of`; cached:
    sizing a 70B model's DeMo chunks takes seconds). ConfigError (one sentence) for a
    replicator without a program, or knobs it cannot run on the shards."""
    record = wired(record, knobs)
    graph = None
    if isinstance(knobs, AdaOnGraph):
        knobs, graph = knobs.knobs, knobs.graph
    try:
        program = program_of(record, knobs, shapes, replicas, node=node, graph=graph)
    except ValueError as err:
        raise ConfigError(f"--method {record.name}: {err}") from None
    if program is None:
        raise ConfigError(f"--method {record.name!r} has no program for the planner: its "
                          f"replicator {replicator_of(record).__name__} writes none "
                          f"(Replicator.program); plan one of {', '.join(PLANNED_METHODS)}.")
    return program


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


class RankProgram:
    """One trace rank's view of its method's program: what `synthesize` writes for it.

    A message to replica p goes to global rank p x G + local. A trace of fewer nodes than the
    replicas (the plan's two for any count) stands in for them: a round's messages are one
    send and one receive with each of the node's neighbours on a ring of the trace's nodes
    (with two, the other), and the replay counts the target graph's degree
    (`simulate(degrees=...)`).
    """

    def __init__(self, program: Program, model: DeclaredModel, node: int, nodes: int,
                 local: int, per_node: int, replicas: int) -> None:
        self.program, self.model = program, model
        self.node, self.local, self.per_node = node, local, per_node
        self.stand_in = nodes < replicas
        self.ring = sorted({(node - 1) % nodes, (node + 1) % nodes} - {node})

    @property
    def ends_step(self) -> bool:
        """Whether the exchange is the step's last work (after the whole optimizer step)."""
        return self.program.ends_step

    def blocking(self, step: int) -> list[Op]:
        """The ops the step runs and waits for first."""
        return self.program.blocking(step)

    def posts(self, step: int) -> list[Op]:
        """The ops posted after the update, messages addressed to global ranks."""
        out, sent = [], set()
        for op in self.program.posts(step):
            if op.peer is None:
                out.append(op)
                continue
            if not self.stand_in:
                out.append(self._to_rank(op, op.peer, op.key))
            elif op.op not in sent:
                sent.add(op.op)
                out += [self._to_rank(op, peer, (op.key, peer)) for peer in self.ring]
        return out

    def _to_rank(self, op: Op, peer: int, key: Hashable) -> Op:
        """A message of `op` to or from node `peer`'s rank of this local index, under `key`."""
        return dataclasses.replace(op, peer=peer * self.per_node + self.local, key=key)

    def waits(self, step: int) -> list[Hashable]:
        """The keys waited on after the posts (a stand-in's messages under their own)."""
        if not self.stand_in:
            return self.program.waits(step)
        stood = {op.key: [(op.key, peer) for peer in self.ring]
                 for op in self.program.posts(step) if op.peer is not None}
        return [k for key in self.program.waits(step) for k in stood.get(key, [key])]

    def unit_elements(self, step: int) -> dict[Hashable, dict[int, int]]:
        """Per posted key, its elements in each FSDP2 unit."""
        out: dict[Hashable, dict[int, int]] = {}
        for key, per_param in self.program.unit_elements(step).items():
            units: dict[int, int] = {}
            for i, n in per_param.items():
                unit = self.model.unit_of[i]
                units[unit] = units.get(unit, 0) + n
            out[key] = units
        return out


def rank_program(record: Method, knobs: object, model: DeclaredModel, shape: Shape,
                 replicas: int | None = None, node: int = 0, local: int = 0) -> RankProgram:
    """The program of rank (`node`, `local`) of a trace of `shape` for `replicas` replicas
    (default: the trace's nodes); a method without sharding (demo) is every rank a replica,
    holding the whole model."""
    if not record.shards:
        world = shape.world
        shapes = local_shard_shapes(model, 1, 0)
        program = method_program(record, knobs, shapes, replicas or world, node)
        return RankProgram(program, model, node, world, 0, 1, replicas or world)
    replicas = replicas or shape.nodes
    shapes = local_shard_shapes(model, shape.per_node, local)
    return RankProgram(method_program(record, knobs, shapes, replicas, node), model, node,
                       shape.nodes, local, shape.per_node, replicas)


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

    # The root's backward before the blocks' (the head's gradient), its tail after them, and
    # its end after its own reduction was issued.
    before = list(compute.backward_s)
    before[root] -= compute.root_tail_s + compute.root_end_s
    _prefetching(rank, sizes, backward, before, then=reduce_block)
    if compute.root_tail_s > 0:
        rank.compute(compute.root_tail_s)
    reduce_unit(root)
    if compute.root_end_s > 0:
        rank.compute(compute.root_end_s)
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
    waited on after it (a run's drain). `sync_in_backward`: a sync whose program gives its
    elements per parameter (DiLoCo's, Streaming DiLoCo's) is posted unit by unit, each piece
    when its unit's gradient reduction is issued in the backward (`in_backward`), not after
    the backward.
    """
    record = wired(record, knobs)
    if not has_program(record):
        method_program(record, knobs, (), 1)  # refused, in its one sentence
    if not record.shards:
        return synthesize_replicas(record, knobs, model, shape, compute, steps,
                                   replicas=replicas, backend=backend, first=first)
    sizes = _Sizes(model, shape.per_node, precision)
    steps_run = range(first, first + steps)
    views = {local: rank_program(record, knobs, model, shape, replicas, 0, local)
             for local in range(shape.per_node)}
    if shape.nodes > 1 and any(op.peer is not None for s in steps_run
                               for op in views[0].posts(s)):
        return _synthesize_each_rank(record, knobs, model, shape, sizes, compute, steps_run,
                                     replicas, backend)
    # Every rank runs the same FSDP2 program; only the exchange's payload may differ from one
    # local rank to another (FSDP2's last shards can be short). One rank's rows stand for all
    # the ranks whose exchange is the same, relabelled.
    alike: dict[tuple, list[int]] = {}
    for local, view in views.items():
        ops = tuple((tuple(view.blocking(s)), tuple(view.posts(s))) for s in steps_run) \
            if shape.nodes > 1 else ()
        alike.setdefault(ops, []).append(local)
    frames = []
    for locals_ in alike.values():
        rank = _Rank(locals_[0], shape, backend)
        _sharded_steps(rank, record, views[locals_[0]], sizes, compute, steps_run,
                       sync_in_backward and shape.nodes > 1)
        template = pd.DataFrame(rank.rows, columns=list(TRACE_COLUMNS))
        frames.append(_relabelled(template, shape,
                                  [(node, local) for node in range(shape.nodes)
                                   for local in locals_]))
    trace = pd.concat(frames, ignore_index=True).astype(TRACE_COLUMNS)
    return trace.sort_values(["rank", "seq"], kind="stable", ignore_index=True)


def _synthesize_each_rank(record: Method, knobs: object, model: DeclaredModel, shape: Shape,
                          sizes: _Sizes, compute: StepCompute, steps: range,
                          replicas: int | None, backend: str) -> pd.DataFrame:
    """`synthesize` for a program of messages: every rank's ops name its own peers, so every
    rank is written on its own."""
    frames = []
    for rank_id in range(shape.world):
        rank = _Rank(rank_id, shape, backend)
        view = rank_program(record, knobs, model, shape, replicas, rank.node, rank.local)
        _sharded_steps(rank, record, view, sizes, compute, steps, False)
        frames.append(pd.DataFrame(rank.rows, columns=list(TRACE_COLUMNS)))
    trace = pd.concat(frames, ignore_index=True).astype(TRACE_COLUMNS)
    return trace.sort_values(["rank", "seq"], kind="stable", ignore_index=True)


def _sharded_steps(rank: _Rank, record: Method, view: RankProgram, sizes: _Sizes,
                   compute: StepCompute, steps: range, sync_in_backward: bool) -> None:
    """One rank's steps: FSDP2's forward and backward, the optimizer step around the method's
    exchange (none on one node), and the drain of what is still in flight."""
    in_flight: dict[object, list[dict]] = {}
    for step in steps:
        begin = rank.begin(step)
        early = in_backward(view, step) if sync_in_backward else {}
        _fsdp2_step(rank, sizes, compute, record.inter_all_reduce,
                    functools.partial(_post_in_backward, rank, early, in_flight) if early
                    else None)
        rank.compute(compute.optimizer_s if view.ends_step else compute.optimizer_s / 2)
        # The method's exchange belongs to no FSDP2 unit (as recordings tag it): tagged
        # with the root's, the fsdp2 overlap would stream it as the root's reduction and
        # make the optimizer step wait for it, a carried exchange included.
        rank.unit = -1
        if rank.shape.nodes > 1:
            _exchange_step(rank, view, step, in_flight,
                           posted={key for unit in early.values() for key, *_ in unit})
        if not view.ends_step:
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


def _exchange_step(rank: _Rank, view: RankProgram, step: int,
                   in_flight: dict[object, list[dict]], posted: set[object] = frozenset()) -> None:
    """This step's exchange: what it runs first and waits for (Ada's measurement), then post
    what it posts (but the keys in `posted`: already posted in the backward), then wait on
    what it applies."""
    for op in view.blocking(step):
        row = rank.issue(op.op, op.nbytes, op.inter)
        if row:  # a group of one runs nothing
            rank.wait(row)
            # What follows starts after it (ops at one moment would replay as issued
            # together): the arithmetic on its result (Ada's spread and decision).
            rank.compute(_DECODE_S)
    posted_now = set(posted)
    for op in view.posts(step):
        if op.key in posted:
            continue
        in_flight[op.key] = [rank.message(op.op, op.nbytes, op.peer) if op.peer is not None
                             else rank.issue(op.op, op.nbytes, op.inter)]
        posted_now.add(op.key)
    carried = False
    for key in view.waits(step):
        for row in in_flight.pop(key, []):
            rank.wait(row)
            carried = carried or key not in posted_now
    if carried:
        # A wait at the very end of its step reads as one between steps, taken at the next
        # step's start (netsim.model.programs); the decode that follows keeps it in its step.
        rank.compute(_DECODE_S)


def in_backward(view: RankProgram, step: int) -> dict[int, list[tuple[object, str, int]]]:
    """Per FSDP2 unit, the pieces of step `step`'s posts that start when its backward ends:
    each post's bytes split over the units by their elements (the total kept exact)."""
    elements = view.unit_elements(step)
    out: dict[int, list[tuple[object, str, int]]] = {}
    for op in view.posts(step):
        per_unit = {u: n for u, n in sorted(elements.get(op.key, {}).items()) if n}
        total, done, sent = sum(per_unit.values()), 0, 0
        for unit, n in per_unit.items():
            done += n
            share = op.nbytes * done // total - sent
            sent += share
            out.setdefault(unit, []).append((op.key, op.op, share))
    return out


def synthesize_replicas(record: Method, knobs: object, model: DeclaredModel, shape: Shape,
                        compute: StepCompute, steps: int, replicas: int | None = None,
                        backend: str = "nccl", first: int = 1) -> pd.DataFrame:
    """The trace of a method without sharding (demo): every rank holds the whole model and is
    a replica; after its forward and backward (one compute, no FSDP2 collectives) and half
    the optimizer step, its exchange over every rank of the world (the program for the whole
    model's shapes among `replicas` ranks: the target's world, default the trace's)."""
    world = shape.world
    view = rank_program(record, knobs, model, shape, replicas)
    group = ",".join(str(r) for r in range(world))
    template = _Rank(0, shape, backend)
    template.replicate = group
    template.shape = Shape(world, 1)  # the exchange's group: every rank, one replica each
    in_flight: dict[object, list[dict]] = {}
    for step in range(first, first + steps):
        begin = template.begin(step)
        template.compute(sum(compute.forward_s) + sum(compute.backward_s))
        template.mark(BACKWARD)
        template.compute(compute.optimizer_s if view.ends_step else compute.optimizer_s / 2)
        if world > 1:
            _exchange_step(template, view, step, in_flight)
        if not view.ends_step:
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
