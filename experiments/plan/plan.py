"""A plan: each method's synthesized program replayed on every declared bandwidth.

Per method, the trace (`experiments.plan.synth`) is written once per kind of step the
replicator's program holds (`flexdemo.program`: a step without its exchange and each distinct
one with it; a window from a post to the step that waits on it; three consecutive steps for an
exchange carried from every step into the next) and replayed by `netsim.model.simulate` on the
target cluster. A periodic method's step time is the mean over its program's period (H steps
for DiLoCo): each kind's time x how often it comes in a period, over the period. Compute
utilization is compute per step over step time; exposed communication is the rest; the
replicator's memory is its program's `state_bytes`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from experiments.errors import ConfigError
from experiments.plan.hardware import StepCompute
from experiments.plan.models import DeclaredModel, padded_shard_elements
from experiments.plan.synth import (
    DTYPE_BYTES,
    Precision,
    RankProgram,
    Shape,
    local_shard_shapes,
    method_program,
    rank_program,
    synthesize,
    wired,
)
from experiments.replay import gossip
from flexdemo.build import replicator_of
from flexdemo.graphs import busiest_degree, period
from flexdemo.methods import Method
from netsim.model import (
    OVERLAP_NOTE,
    AlgorithmChoice,
    ReplayOptions,
    algorithm_summary,
    simulate_each,
)
from netsim.topology import Topology

__all__ = ["CU_TARGETS", "MethodPlan", "Memory", "PlanPoint", "bandwidth_needed", "memory",
           "plan_method"]

CU_TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU a method holds, by part (activations are not counted)."""

    params: int
    grads: int
    optimizer: int
    replicator: int
    working: int
    """FSDP2's gathered working set: the root and two blocks in param_dtype, one block's
    unsharded gradient in reduce_dtype."""

    @property
    def total(self) -> int:
        """Every part together."""
        return self.params + self.grads + self.optimizer + self.replicator + self.working


@dataclass(frozen=True)
class PlanPoint:
    """One method at one inter-node bandwidth."""

    inter_bw: str
    inter_bw_bps: float
    step_time_s: float
    bytes_per_node_step: float


@dataclass(frozen=True)
class MethodPlan:
    """A method's plan over the bandwidths, with what it assumed."""

    method: str
    compute_s: float
    period: int
    exchanges_per_period: int
    memory: Memory
    peak_exchange_bytes: int = 0
    """The largest payload one rank hands to one of the method's inter-node ops."""
    points: list[PlanPoint] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def frame(self) -> pd.DataFrame:
        """One row per bandwidth: the CSV's columns."""
        rows = []
        for p in self.points:
            rows.append({
                "method": self.method, "inter_bw": p.inter_bw, "inter_bw_bps": p.inter_bw_bps,
                "step_time_s": p.step_time_s, "compute_s": self.compute_s,
                "compute_utilization": self.compute_s / p.step_time_s,
                "exposed_comm_s": max(0.0, p.step_time_s - self.compute_s),
                "bytes_per_node_step": p.bytes_per_node_step,
                # One outer round (a DiLoCo sync, a fragment's): a period's bytes per exchange.
                "bytes_per_node_round": p.bytes_per_node_step * self.period
                / max(1, self.exchanges_per_period),
                "memory_per_gpu_bytes": self.memory.total, "period_steps": self.period,
                "peak_exchange_bytes": self.peak_exchange_bytes,
            })
        return pd.DataFrame(rows)


# One trace to replay: (first step, steps, how many times it counts in a period, whether all
# its steps count or only its last).
Kind = tuple[int, int, int, bool]


def _step_kinds(record: Method, view: RankProgram) -> tuple[list[Kind], bool]:
    """The traces that make up the program's period, and whether an exchange is carried
    across steps, read from the program itself (`flexdemo.program`) from its `steady_from`.

    Steps alike are replayed once: each distinct step with ops (a DiLoCo sync, Ada's measuring
    round), in the order they first come, then a step without any; an exchange waited on in a
    later step than the one that posted it makes a window from one to the other, replayed
    whole (Streaming DiLoCo's fragments) before the steps outside every window; an exchange
    carried from each step into the next (DeMo's delay=1): three steps, the third the steady
    state.
    """
    program = view.program
    start, period = program.steady_from, program.period
    carried = _carried(view, start + 3 * period)
    if any(a2 <= b1 for (_, b1), (a2, _) in zip(carried, carried[1:], strict=False)):
        if period != 1:
            raise ConfigError(f"--method {record.name}: its exchange is carried from one "
                              f"exchanging step into the next on a schedule that repeats every "
                              f"{period} steps, which the plan does not replay; plan it with "
                              "every step exchanging (or its exchange waited on in its step).")
        return [(start, 3, 1, False)], True
    windows = [(a, b) for a, b in carried if start <= a < start + period]
    covered = {start + (t - start) % period for a, b in windows for t in range(a, b + 1)}
    kinds: list[Kind] = [(a, b - a + 1, 1, True) for a, b in windows]
    groups: dict[tuple, list[int]] = {}
    for step in range(start, start + period):
        if step not in covered:
            groups.setdefault(_step_signature(view, step), [step, 0])[1] += 1
    quiet = groups.pop(((), (), ()), None)
    kinds += [(first, 1, count, False) for first, count in
              list(groups.values()) + ([quiet] if quiet else [])]
    return kinds, bool(windows)


def _carried(view: RankProgram, last: int) -> list[tuple[int, int]]:
    """(posting step, waiting step) of every exchange waited on after the step that posted it,
    over steps 1 to `last`, by posting step."""
    posted: dict[object, int] = {}
    out = []
    for step in range(1, last + 1):
        for op in view.posts(step):
            posted[op.key] = step
        for key in view.waits(step):
            at = posted.pop(key, step)
            if at < step:
                out.append((at, step))
    return sorted(out)


def _step_signature(view: RankProgram, step: int) -> tuple:
    """What sets a step's ops apart from another's: its blocking ops, its posts (keys aside)
    with their units' elements, and which of them it waits on."""
    posts = view.posts(step)
    elements = view.unit_elements(step)
    keys = [op.key for op in posts]
    return (tuple((op.op, op.nbytes, op.peer, op.inter) for op in view.blocking(step)),
            tuple((op.op, op.nbytes, op.peer, op.inter,
                   tuple(sorted(elements.get(op.key, {}).items()))) for op in posts),
            tuple(keys.index(key) for key in view.waits(step) if key in keys))


def _peak_exchange(trace: pd.DataFrame, split: bool) -> int:
    """The largest exchange between nodes a rank posts: one collective's bytes, or with the
    sync `split` into the backward's pieces (`sync_in_backward`), a step's pieces together."""
    inter = trace.loc[trace["inter"] & (trace["kind"] == "collective")]
    if inter.empty:
        return 0
    if split:
        return int(inter.groupby(["rank", "step"])["bytes"].sum().max())
    return int(inter["bytes"].max())


def plan_method(record: Method, knobs: object, model: DeclaredModel, topologies: list[Topology],
                labels: list[str], compute: StepCompute, precision: Precision,
                algorithm: str = "auto", progress: Callable[[str], None] | None = None,
                backend: str = "nccl", nodes_per_replica: int = 1,
                sync_in_backward: bool = False) -> MethodPlan:
    """Replay `record`'s program on each topology (one per bandwidth; module docstring).

    `nodes_per_replica` K > 1: the topologies are already the replicas'
    (`experiments.plan.replicas.replica_topology`: one node a replica of K nodes); bytes and
    bandwidths are reported per real node. `sync_in_backward`: as `synthesize` takes it.
    """
    record = wired(record, knobs)
    target = topologies[0]
    shape = Shape(min(target.nodes, 2), target.accelerators_per_node)
    view = rank_program(record, knobs, model, shape, target.nodes)
    period = view.program.period
    kinds, delayed = _step_kinds(record, view)
    traces: dict[tuple, list] = {}
    for first, length, count, whole in kinds:
        trace = synthesize(record, knobs, model, shape, compute, precision, length,
                           replicas=target.nodes, backend=backend, first=first,
                           sync_in_backward=sync_in_backward)
        # Windows alike (Streaming DiLoCo's fragments of one size) replay once, counted twice.
        key = (_signature(trace, first), length, whole)
        if key in traces:
            traces[key][2] += count
        else:
            traces[key] = [trace, length, count, whole]
    plan = MethodPlan(record.name, compute.total_s, period, view.program.exchanges,
                      memory(record, knobs, model, target.accelerators_per_node, target.nodes,
                             precision))
    plan = dataclasses.replace(plan, peak_exchange_bytes=max(
        (_peak_exchange(t, sync_in_backward) for t, *_ in traces.values()), default=0))
    totals = [[0.0, 0.0] for _ in topologies]  # per topology: seconds and egress per period
    degrees, site_rounds = gossip_graph(record, knobs, target)
    algorithms: list[AlgorithmChoice] = []  # what each trace's replay on the target assumed
    for trace, length, count, whole in traces.values():
        # Without sharding there are no FSDP2 units to overlap: the trace's order is the plan.
        replays = simulate_each(trace, topologies, ReplayOptions(overlap="fsdp2" if record.shards
                                else "recorded", intra="model", algorithm=algorithm,
                                degrees=degrees, site_rounds=site_rounds))
        for total, replay in zip(totals, replays, strict=True):
            times = replay.frame["step_time_s"]
            if whole:  # a window: every step of it, and every byte it sent
                total[0] += float(times.sum()) * count
                total[1] += replay.node_egress_bytes * count
            else:  # the last step is the steady state (a carried exchange arrives in it)
                total[0] += float(times.iloc[-1]) * count
                # A carried exchange's steps each send one: the egress per step is the mean.
                total[1] += replay.node_egress_bytes / length * count
        algorithms.extend(replays[0].algorithms)
        if progress is not None:
            progress(f"{record.name}: {len(topologies)} networks")
    plan.notes.extend(_method_notes(record, knobs, target))
    plan.notes.extend(view.program.notes())
    plan.notes.extend(_replay_notes(algorithms, delayed))
    k = nodes_per_replica
    for (seconds, egress), topology, label in zip(totals, topologies, labels, strict=True):
        # A replica's NIC is its K nodes' side by side (flat networks); sites keep their links.
        declared = topology.inter.bandwidth / (k if topology.sites is None else 1)
        plan.points.append(PlanPoint(label, declared, seconds / period, egress / period / k))
    return plan


def gossip_graph(record: Method, knobs: object, target: Topology) -> tuple[object, object]:
    """For gossip: the busiest node's peers per round of its graph on the target's nodes
    (`simulate(degrees=...)`), and on several sites each site's messages per round
    (`site_rounds=`); (None, None) for other methods."""
    if not record.gossips:
        return None, None
    graph = knobs.graph
    return gossip.schedule(lambda step: graph, [graph], target.nodes, target.sites,
                           f"--method {record.name}")


def _signature(trace: pd.DataFrame, first: int) -> tuple:
    """What sets a trace's replay apart from another's of the same method: its inter-node ops
    (rank, step from its first, op, bytes, issue and wait moments), the rest being alike."""
    inter = trace[trace["inter"] & (trace["kind"] == "collective")]
    return tuple(zip(inter["rank"], inter["step"] - first, inter["op"], inter["bytes"],
                     inter["start_s"].round(12), inter["wait_s"].round(12), strict=True))


def _method_notes(record: Method, knobs: object, target: Topology) -> list[str]:
    """What the method's program assumed that the others' did not (sharding, its graph)."""
    if not record.shards:
        return [f"{record.name}: no sharding: every GPU holds the whole model and is a "
                f"replica; its exchange spans all {target.world_size} GPUs (ranks of a node "
                "share its link)"]
    if record.gossips and target.nodes > 1:
        graph, nodes = knobs.graph, target.nodes
        found = sorted({busiest_degree(graph, nodes, r) for r in range(period(graph, nodes))})
        return [f"{record.name}: graph {graph} on {nodes} replicas, the busiest one's "
                f"{'/'.join(map(str, found))} neighbours a round pacing it; one message each "
                "way per neighbour, every rank's whole fp32 shard"]
    return []


def _replay_notes(algorithms: list[AlgorithmChoice], delayed: bool) -> list[str]:
    """What the replay assumed, once per method: the algorithms of all its traces' replays
    (a step with the exchange and one without assume different ones), merged per op kind."""
    merged: dict[tuple, AlgorithmChoice] = {}
    for entry in algorithms:
        key = (entry.op, entry.algorithm, entry.ranks, entry.one_per_node)
        seen = merged.get(key, entry)
        merged[key] = dataclasses.replace(entry, min_bytes=min(seen.min_bytes, entry.min_bytes),
                                          max_bytes=max(seen.max_bytes, entry.max_bytes))
    lines = [f"overlap fsdp2: {OVERLAP_NOTE.removeprefix('overlap fsdp2: ')}"]
    lines += [f"inter-node algorithm {line}" for line in algorithm_summary(merged.values())]
    if delayed:
        lines.append("an exchange carried across steps (delay=1, or Streaming DiLoCo's "
                     "fragment_sync_delay): posted after the optimizer step, waited on where "
                     "the method applies it, the link busy meanwhile")
    return lines


def memory(record: Method, knobs: object, model: DeclaredModel, per_node: int, nodes: int,
           precision: Precision) -> Memory:
    """Bytes per GPU of local rank 0 (the largest shard), by part (see Memory), the
    replicator's from its program (`state_bytes`); a method without sharding (demo) holds the
    whole model on every GPU, each a replica."""
    record = wired(record, knobs)
    if not record.shards:
        return _replica_memory(record, knobs, model, per_node * nodes)
    shard = sum(padded_shard_elements(s, per_node) for unit in model.units for s in unit)
    full = [model.unit_params(u) for u in range(len(model.units))]
    blocks = sorted(full[:-1], reverse=True)[:2]
    working = ((full[-1] + sum(blocks)) * DTYPE_BYTES[precision.param_dtype]
               + (blocks[0] if blocks else full[-1]) * DTYPE_BYTES[precision.reduce_dtype])
    params, grads = shard * 4, shard * 4
    adamw = 8 * shard  # exp_avg and exp_avg_sq, fp32
    if record.replicator is None:
        return Memory(params, grads, adamw, 0, working)
    _, step = record.settings({})
    base = step.base or replicator_of(record).default_base
    program = method_program(record, knobs, local_shard_shapes(model, per_node, 0), nodes)
    return Memory(params, grads, adamw if base == "adamw" else 0, program.state_bytes, working)


def _replica_memory(record: Method, knobs: object, model: DeclaredModel, world: int) -> Memory:
    """Memory per GPU of a method without sharding: the whole model, its gradient and the
    replicator's state over `world` replicas; no FSDP2 working set."""
    params = model.params * 4
    _, step = record.settings({})
    base = step.base or replicator_of(record).default_base
    program = method_program(record, knobs, local_shard_shapes(model, 1, 0), world)
    return Memory(params, params, 2 * params if base == "adamw" else 0, program.state_bytes, 0)


def bandwidth_needed(frame: pd.DataFrame, target: float) -> tuple[float | None, str]:
    """The lowest bandwidth (bytes/s) at which one method's CU reaches `target`, and how found.

    Between grid points the CU is interpolated linearly in log(bandwidth); "grid point" when a
    point reaches it exactly or it is reached at the grid's lowest; None when never reached.
    """
    frame = frame.sort_values("inter_bw_bps")
    bws = frame["inter_bw_bps"].to_numpy()
    cus = frame["compute_utilization"].to_numpy()
    above = np.nonzero(cus >= target)[0]
    if len(above) == 0:
        return None, f"not reached (at most {cus.max():.1%} on this grid)"
    i = int(above[0])
    if i == 0:
        return float(bws[0]), ("grid point" if math.isclose(cus[0], target) or len(bws) == 1
                               else "at or below the grid's lowest bandwidth")
    if math.isclose(cus[i], target):
        return float(bws[i]), "grid point"
    lo, hi = math.log(bws[i - 1]), math.log(bws[i])
    share = (target - cus[i - 1]) / (cus[i] - cus[i - 1])
    return float(math.exp(lo + share * (hi - lo))), "interpolated"
