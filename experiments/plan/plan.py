"""A plan: each method's synthesized program replayed on every declared bandwidth.

Per method, the program (`experiments.plan.synth`) is written once per kind of step (a step
without the method's exchange and one with it; three consecutive steps for an exchange carried
into the next step) and replayed by `netsim.model.simulate` on the target cluster. A periodic
method's step time is the mean over its period (H steps for DiLoCo): (steps without exchange x
their time + steps with it x theirs) / period. Compute utilization is compute per step over
step time; exposed communication is the rest.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from experiments.errors import ConfigError
from experiments.plan.hardware import StepCompute
from experiments.plan.models import DeclaredModel, padded_shard_elements
from experiments.plan.synth import (
    DTYPE_BYTES,
    AdaOnGraph,
    Precision,
    Shape,
    local_shard_shapes,
    sampled_entries,
    schedule,
    synthesize,
)
from experiments.replay import gossip
from flexdemo.graphs import averages_exactly, busiest_degree, graph_problem, period
from flexdemo.knobs import DeMoKnobs, StreamingDiLoCoKnobs
from flexdemo.methods import Method
from flexdemo.replicators import REPLICATORS
from flexdemo.replicators.ada import AdaRule
from flexdemo.replicators.demo import plan_exchange
from flexdemo.replicators.gossip import RECEIVE_LIMIT
from flexdemo.replicators.streaming_diloco import fragment_numels
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


def _step_kinds(record: Method, knobs: object) -> tuple[int, list[Kind], bool]:
    """(period, the traces that make it up, whether an exchange is carried across steps).

    Steps alike are replayed once: a step without the exchange and one with it (every such
    step is alike); an exchange carried into the next step: three steps, the third the steady
    state; Streaming DiLoCo: each fragment's window, from the step that posts its sync to the
    one that applies it, whole, and one step outside every window.
    """
    if isinstance(knobs, StreamingDiLoCoKnobs):
        return _streaming_kinds(knobs)
    period, exchanges = schedule(record, knobs)
    if isinstance(knobs, AdaOnGraph):
        return _ada_kinds(knobs, period, exchanges)
    delayed = isinstance(knobs, DeMoKnobs) and knobs.delay == 1
    syncs = sum(exchanges(s) for s in range(1, period + 1))
    if delayed:
        if period != 1:
            raise ConfigError(f"--method {record.name}: a delayed exchange (delay=1) with "
                              f"replicate_every or skip_every is not planned; plan it with "
                              "delay=0 or every step replicating.")
        return period, [(1, 3, 1, False)], True
    kinds = []
    quiet = next((s for s in range(1, period + 1) if not exchanges(s)), None)
    if quiet is not None:
        kinds.append((quiet, 1, period - syncs, False))
    loud = next((s for s in range(1, period + 1) if exchanges(s)), None)
    if loud is not None:
        kinds.append((loud, 1, syncs, False))
    return period, kinds, False


def _ada_kinds(knobs: AdaOnGraph, period: int,
               exchanges: Callable[[int], bool]) -> tuple[int, list[Kind], bool]:
    """Ada on one graph: steps without a round, rounds, and rounds that measure the spread
    first (every `ada_every`-th); the period holds a whole number of measurements, taken from
    the second (round 0 never measures)."""
    rounds = sum(exchanges(s) for s in range(1, period + 1))
    if rounds == 0:
        return period, [(1, 1, period, False)], False
    period *= math.lcm(rounds, knobs.ada_every) // rounds
    rule = AdaRule(1, knobs.ada_every, knobs.ada_high, knobs.ada_low)
    found: dict[tuple[bool, bool], list[int]] = {}
    for step in range(period + 1, 2 * period + 1):
        round_ = sum(exchanges(s) for s in range(1, step)) if exchanges(step) else -1
        key = (exchanges(step), round_ >= 0 and rule.measures_at(round_))
        found.setdefault(key, [step, 0])[1] += 1
    return period, [(first, 1, count, False) for first, count in found.values()], False


def _streaming_kinds(knobs: StreamingDiLoCoKnobs) -> tuple[int, list[Kind], bool]:
    """A full fragment cycle (sync_every steps): every fragment's window and the steps between."""
    fragments, tau = knobs.num_fragments, knobs.fragment_sync_delay
    every = knobs.sync_every // fragments  # the replicator's period between two syncs
    kinds: list[Kind] = [((k + 1) * every - tau, tau + 1, 1, True) for k in range(fragments)]
    quiet = fragments * (every - tau - 1)
    if quiet:
        kinds.append((1, 1, quiet, False))  # step 1 lies in no window: every >= tau + 2
    return knobs.sync_every, kinds, tau > 0


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
    target = topologies[0]
    shape = Shape(min(target.nodes, 2), target.accelerators_per_node)
    period, kinds, delayed = _step_kinds(record, knobs)
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
    plan = MethodPlan(record.name, compute.total_s, period, _syncs(record, knobs, period),
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


def _syncs(record: Method, knobs: object, period: int) -> int:
    """Steps of a period that exchange (Streaming DiLoCo: its syncs, one per fragment)."""
    if isinstance(knobs, StreamingDiLoCoKnobs):
        return knobs.num_fragments
    _, exchanges = schedule(record, knobs)
    return sum(exchanges(s) for s in range(1, period + 1))


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
    """Bytes per GPU of local rank 0 (the largest shard), by part (see Memory); a method
    without sharding (demo) holds the whole model on every GPU, each a replica."""
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
    base = step.base or REPLICATORS[record.replicator].default_base
    return Memory(params, grads, adamw if base == "adamw" else 0,
                  _replicator_memory(record, knobs, model, per_node, nodes, shard), working)


def _replicator_memory(record: Method, knobs: object, model: DeclaredModel, per_node: int,
                       nodes: int, shard: int) -> int:
    """Bytes of the replicator's own state and buffers on local rank 0."""
    if isinstance(knobs, DeMoKnobs):
        shapes = local_shard_shapes(model, per_node, 0)
        plan = plan_exchange(list(shapes), [torch.float32] * len(shapes), knobs, nodes)
        # The momentum (every coefficient, fp32), this rank's bucket and what it receives
        # (all-gather: every replica's bucket; dense: the buffer reduced in place).
        received = plan.dense_bytes if plan.dense else nodes * plan.bucket_bytes
        exchange = plan.payload_bytes + received
        return plan.dense_numel * 4 + exchange * (2 if knobs.delay == 1 else 1)
    if isinstance(knobs, StreamingDiLoCoKnobs):
        # Every fragment's anchor and outer momentum, the rounding residuals of a lossy wire,
        # and the largest fragment's sync in flight (all-gathered: every replica's payload).
        wire = REPLICATORS[record.replicator](knobs).wire
        sizes = [math.prod(s) for s in local_shard_shapes(model, per_node, 0)]
        biggest = max(fragment_numels(sizes, knobs.num_fragments, knobs.fragment_cut,
                                      knobs.fragment_runs))
        op, nbytes = wire.payload(biggest)
        in_flight = nbytes * (nodes if op == "all_gather" else 1)
        return 2 * shard * 4 + (shard * 4 if wire.lossy else 0) + in_flight
    if record.replicator == "diloco":
        return 2 * shard * 4  # the anchor and the outer momentum, fp32
    if record.replicator in ("random", "striding"):
        # The momentum (delta) and the update it returns (the shard's zeros, the chosen rows
        # filled in), fp32 both; the chosen rows' flat buffer is a fraction of a shard.
        return 2 * shard * 4
    if record.replicator in ("gossip", "ada"):
        # The flat copy of the shard it sends and an inbox per neighbour of the busiest node in
        # flight at once: at most RECEIVE_LIMIT (the replicator's windows), and with several
        # windows the mixed copy besides; none on a graph that all-reduces (the complete one).
        graph = knobs.graph
        degree = busiest_degree(graph, nodes, 0) if nodes > 1 and graph_problem(
            graph, nodes) is None and not averages_exactly(graph, nodes) else 0
        held = (1 + min(degree, RECEIVE_LIMIT) + (degree > RECEIVE_LIMIT)) * shard * 4
        if isinstance(knobs, AdaOnGraph):  # the probe: its sampled entries' indices (int64)
            held += 8 * sampled_entries(local_shard_shapes(model, per_node, 0),
                                        knobs.ada_sample, knobs.seed)
        return held
    return 0


def _replica_memory(record: Method, knobs: object, model: DeclaredModel, world: int) -> Memory:
    """Memory per GPU of a method without sharding: the whole model, its gradient and the
    replicator's state over `world` replicas; no FSDP2 working set."""
    params = model.params * 4
    _, step = record.settings({})
    base = step.base or REPLICATORS[record.replicator].default_base
    return Memory(params, params, 2 * params if base == "adamw" else 0,
                  _replicator_memory(record, knobs, model, 1, world, model.params), 0)


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
