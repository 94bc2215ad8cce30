"""SimPy cluster model: replay a recorded trace on any topology and predict per-step times.

How it scales: nodes that run at the same speed behave identically, so the model runs one SimPy
process per (node speed class, accelerator position) instead of one per rank, and one NIC per
speed class (per class and position with nic="per-accelerator"). A collective is one rendezvous
of its member processes followed by its latency steps and a processor-shared transfer of its
wire bytes over the NICs; ring phases are aggregated analytically. Cost therefore grows with
steps x accelerators_per_node x speed classes x events per step, and not with the node count.

Assumptions (also returned in the result's attrs["note"]):
- Compute between a rank's collectives (gaps in its trace where it was not blocked in wait()) is
  the per-step compute; it is scaled by compute_scale and divided by the node's speed. Explicit
  "compute" rows are informational: the gaps already hold them. Traffic outside a step's
  begin/end span (e.g. evaluation) is left out. A warm-up step is replayed like any other; drop
  it from the trace to leave it out.
- Payload sizes and the per-step program are kept from the recorded run when nodes, accelerators
  or steps grow (weak scaling); steps beyond the recording cycle through the recorded steps.
- Inter-node groups with one rank per node that span all recorded nodes span all target nodes;
  groups of all ranks span all target ranks; intra-node ops start when their node's members
  have all arrived and then take their closed-form time (or, with intra="recorded", the time
  their last-arriving member recorded, which holds no wait for peers).
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import pandas as pd
import simpy

from netsim.costs import collective_volume
from netsim.topology import Topology
from netsim.trace import load_trace, validate_trace

__all__ = ["SharedLink", "simulate", "MODEL_NOTE"]

MODEL_NOTE = (
    "weak scaling: per-step compute and payload sizes as recorded; steps beyond the recording "
    "cycle through recorded steps; replicate groups span all target nodes; compute scaled by "
    "compute_scale / node_speed; jitter enters with its mean (zero)."
)


class SharedLink:
    """A link whose bandwidth is shared fairly by all flows in flight (processor sharing)."""

    def __init__(self, env: simpy.Environment, bandwidth: float) -> None:
        self.env = env
        self.bandwidth = bandwidth
        self._flows: dict[int, list] = {}
        self._next_id = 0
        self._last = env.now
        self._generation = 0

    def transfer(self, nbytes: float) -> simpy.Event:
        """Event that fires when nbytes have crossed the link, sharing it with other flows."""
        done = self.env.event()
        if nbytes <= 0:
            done.succeed()
            return done
        self._advance()
        self._flows[self._next_id] = [float(nbytes), done]
        self._next_id += 1
        self._schedule()
        return done

    def _advance(self) -> None:
        elapsed = self.env.now - self._last
        if self._flows and elapsed > 0:
            moved = self.bandwidth / len(self._flows) * elapsed
            for flow in self._flows.values():
                flow[0] -= moved
        self._last = self.env.now

    def _schedule(self) -> None:
        # Any change of the flow set invalidates the pending completion timer.
        self._generation += 1
        if not self._flows:
            return
        rate = self.bandwidth / len(self._flows)
        smallest = min(f[0] for f in self._flows.values())
        # The flows due at the timer are named now: float rounding must not leave them a sliver.
        due = [k for k, f in self._flows.items() if f[0] <= smallest * (1 + 1e-12)]
        timer = self.env.timeout(max(0.0, smallest / rate))
        generation = self._generation
        timer.callbacks.append(lambda _event: self._on_timer(generation, due))

    def _on_timer(self, generation: int, due: list[int]) -> None:
        if generation != self._generation:
            return
        self._advance()
        for key in due:
            self._flows.pop(key)[1].succeed()
        self._schedule()


@dataclass(frozen=True)
class _Spec:
    """One collective of a program: what it is and which model processes meet for it."""

    op: str
    algorithm: str
    nbytes: int
    inter: bool
    scope: str  # "replicate", "world", "other" (inter) or "intra"
    positions: frozenset  # recorded accelerator positions taking part (inter "other")
    size: int  # group size for non-scaling groups
    nic_share: float


def _layout(df: pd.DataFrame) -> tuple[int, int]:
    """Recorded (nodes, accelerators_per_node), checked against the rank numbering."""
    per_node = int(df["local"].max()) + 1
    nodes = int(df["node"].max()) + 1
    if not (df["rank"] == df["node"] * per_node + df["local"]).all():
        raise ValueError(
            "trace rank/node/local columns disagree with rank = node * per_node + local; "
            "record the trace with the topology the run really had."
        )
    return nodes, per_node


def _classify(group: str, recorded: Topology) -> tuple[str, frozenset, int, float]:
    ranks = [int(r) for r in group.split(",")]
    if max(ranks) >= recorded.world_size:
        raise ValueError(
            f"trace group {group!r} names ranks beyond the {recorded.world_size} ranks present; "
            f"the trace must hold every rank of the run."
        )
    nodes = {recorded.node_of(r) for r in ranks}
    locals_ = frozenset(recorded.local_of(r) for r in ranks)
    if len(nodes) == 1:
        return "intra", locals_, len(ranks), 1.0
    ordered = sorted(ranks)
    crossing = sum(
        recorded.node_of(a) != recorded.node_of(b)
        for a, b in zip(ordered, ordered[1:] + ordered[:1], strict=True)
    )
    # Bytes through one node's NIC per rank's wire bytes: the ring's crossing edges per node.
    share = crossing / len(nodes)
    if len(locals_) == 1 and len(nodes) == len(ranks) == recorded.nodes:
        return "replicate", locals_, len(ranks), 1.0
    if len(ranks) == recorded.world_size:
        return "world", locals_, len(ranks), share
    return "other", locals_, len(ranks), share


def _programs(df: pd.DataFrame, recorded: Topology):
    """Per (recorded position, recorded step index): a list of ("c", s) / ("i", k) / ("w", k)."""
    steps = sorted(df["step"].unique())
    step_index = {s: i for i, s in enumerate(steps)}
    specs: list[_Spec] = []
    spec_ids: dict = {}
    classes: dict = {}
    per_rank: dict = {}
    df = df.sort_values(["rank", "step", "seq"], kind="stable")
    # Plain lists: iterating pandas groups row by row costs ~10 us per row, far too slow here.
    cols = {
        c: df[c].tolist()
        for c in (
            "rank",
            "step",
            "kind",
            "op",
            "group",
            "inter",
            "algorithm",
            "bytes",
            "start_s",
            "wait_s",
            "end_s",
        )
    }
    n = len(df)
    # A collective's own time is what its last-arriving member saw: the others' recorded spans
    # also hold their wait for that peer, which the model's rendezvous already accounts for.
    # Members issue a group's ops in the same order, so (group, step, k-th call) names one op.
    own: dict = {}
    calls: dict = defaultdict(int)
    occurrence = [None] * n
    for r in range(n):
        if cols["kind"][r] != "collective":
            continue
        key = (cols["rank"][r], cols["step"][r], str(cols["group"][r]))
        op = (key[2], key[1], calls[key])
        calls[key] += 1
        occurrence[r] = op
        start, wait, end = cols["start_s"][r], cols["wait_s"][r], cols["end_s"][r]
        wait = start if wait != wait else wait
        span = max(0.0, (wait if end != end else end) - start)
        own[op] = min(own.get(op, span), span)
    i = 0
    while i < n:
        rank, step = cols["rank"][i], cols["step"][i]
        j = i
        while j < n and cols["rank"][j] == rank and cols["step"][j] == step:
            j += 1
        begin = finish = None
        for r in range(i, j):
            if cols["kind"][r] == "step":
                begin, finish = cols["start_s"][r], cols["end_s"][r]
        points = []
        for r in range(i, j):
            kind, start, end = cols["kind"][r], cols["start_s"][r], cols["end_s"][r]
            if kind != "collective":
                continue
            # Traffic outside the step's span (e.g. evaluation labeled with this step) is left out.
            if begin is not None and not begin <= start <= finish:
                continue
            group = str(cols["group"][r])
            if group not in classes:
                classes[group] = _classify(group, recorded)
            scope, positions, size, share = classes[group]
            key = (
                cols["op"][r],
                cols["algorithm"][r],
                int(cols["bytes"][r]),
                bool(cols["inter"][r]),
                scope,
                positions,
                size,
            )
            if key not in spec_ids:
                spec_ids[key] = len(specs)
                specs.append(_Spec(*key[:6], size, share))
            wait = cols["wait_s"][r]
            wait = start if wait != wait else wait
            end = wait if end != end else end
            points.append((start, 0, r, spec_ids[key], end))
            points.append((wait, 1, r, -1, end))
        if begin is None:
            times = [cols["start_s"][r] for r in range(i, j)]
            times += [cols["end_s"][r] for r in range(i, j) if cols["end_s"][r] == cols["end_s"][r]]
            begin, finish = min(times), max(times)
        points.sort()
        program: list = []
        cursor = begin
        for t, is_wait, k, spec_id, end in points:
            if t > cursor:
                program.append(("c", t - cursor))
                cursor = t
            if is_wait:
                program.append(("w", k))
                cursor = max(cursor, end)
            else:
                # The op's own recorded duration rides along for simulate(intra="recorded").
                program.append(("i", k, spec_id, own[occurrence[k]]))
        if finish > cursor:
            program.append(("c", finish - cursor))
        per_rank[(recorded.local_of(rank), step_index[step], recorded.node_of(rank))] = program
        i = j
    # One program per position and step: node 0's structure, compute = median over the nodes.
    merged: dict = {}
    by_slot: dict = defaultdict(list)
    for (pos, s, node), program in per_rank.items():
        by_slot[(pos, s)].append((node, program))
    for slot, entries in by_slot.items():
        entries.sort(key=lambda e: e[0])
        base = entries[0][1]
        same = [p for _, p in entries if len(p) == len(base)]
        if len(same) > 1:
            base = [
                ("c", _median([p[i][1] for p in same if p[i][0] == "c"] or [item[1]]))
                if item[0] == "c"
                else item
                for i, item in enumerate(base)
            ]
        merged[slot] = base
    return merged, specs, len(steps)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


class _Cluster:
    """The SimPy side: one process per (speed class, position), NICs per class."""

    def __init__(
        self,
        topology: Topology,
        recorded: Topology,
        programs,
        specs,
        n_recorded: int,
        compute_scale: float,
        intra: str = "model",
    ) -> None:
        self.env = simpy.Environment()
        self.topo = topology
        self.recorded = recorded
        self.programs = programs
        self.specs = specs
        self.n_recorded = n_recorded
        self.compute_scale = compute_scale
        self.intra = intra
        speeds = sorted(set(topology.node_speed))
        self.classes = speeds  # class c runs at speed speeds[c]
        g = topology.accelerators_per_node
        bw = topology.inter.effective_bandwidth
        if topology.nic == "per-accelerator":
            self.nics = {
                (c, j): SharedLink(self.env, bw) for c in range(len(speeds)) for j in range(g)
            }
        else:
            self.nics = {c: SharedLink(self.env, bw) for c in range(len(speeds))}
        self.rendezvous: dict = {}
        self.step_end: list[float] = []
        self.compiled = {slot: self._compile(program) for slot, program in programs.items()}

    def _nic(self, c: int, j: int) -> SharedLink:
        return self.nics[(c, j)] if self.topo.nic == "per-accelerator" else self.nics[c]

    def _group_size(self, spec: _Spec) -> int:
        t, r = self.topo, self.recorded
        if spec.scope == "replicate":
            return t.nodes
        if spec.scope == "world":
            return t.world_size
        if spec.scope == "intra":
            if spec.size == r.accelerators_per_node:
                return t.accelerators_per_node
            if spec.size > t.accelerators_per_node:
                raise ValueError(
                    f"the trace has intra-node groups of {spec.size} ranks, more than the target "
                    f"topology's {t.accelerators_per_node} accelerators per node."
                )
        return spec.size

    def _members(self, spec: _Spec, j: int) -> tuple[tuple, int]:
        n_classes, g, g_rec = (
            len(self.classes),
            self.topo.accelerators_per_node,
            self.recorded.accelerators_per_node,
        )
        if spec.scope == "replicate":
            return ("rep", j), n_classes
        if spec.scope == "world":
            return ("world",), n_classes * g
        count = sum(1 for jj in range(g) if jj % g_rec in spec.positions)
        return ("other", spec.positions), n_classes * count

    def _compile(self, program: list) -> list:
        """Resolve a program for this topology: intra ops become delays or meetings, delays merge.

        Items: ("t", compute_s, fixed_s) a timeout of compute_s * factor + fixed_s;
        ("i", k, spec_id, volume) an inter-node collective; ("d", k, spec_id, seconds) an intra
        op that starts when its node's members meet; ("w", k) wait for op k. Folding keeps SimPy
        events per step few, which keeps replay fast.
        """
        out: list = []
        pending_intra: dict = {}
        for n, item in enumerate(program):
            kind = item[0]
            if kind == "c":
                self._add_delay(out, item[1], 0.0)
            elif kind == "i":
                spec = self.specs[item[2]]
                p = self._group_size(spec)
                rooted = spec.op in ("gather", "scatter")
                volume = collective_volume(
                    spec.op, p, spec.nbytes, spec.algorithm or None, is_root=rooted
                )
                if spec.inter:
                    out.append(("i", item[1], item[2], volume))
                    continue
                seconds = item[3] if self.intra == "recorded" else volume.time(self.topo.intra)
                following = program[n + 1] if n + 1 < len(program) else None
                if p > 1:
                    # A real collective holds every member until the last one arrives; a plain
                    # delay would let a node's positions drift a step apart, and the one ahead
                    # would then use the shared NIC alone while the other is still behind.
                    out.append(("d", item[1], item[2], seconds))
                elif following is not None and following[0] == "w" and following[1] == item[1]:
                    pending_intra[item[1]] = None  # waited at once: a plain delay
                    self._add_delay(out, 0.0, seconds)
                else:
                    out.append(("d", item[1], None, seconds))
            elif item[1] in pending_intra:
                del pending_intra[item[1]]
            else:
                out.append(("w", item[1]))
        return out

    @staticmethod
    def _add_delay(out: list, compute: float, fixed: float) -> None:
        if out and out[-1][0] == "t":
            last = out[-1]
            out[-1] = ("t", last[1] + compute, last[2] + fixed)
        else:
            out.append(("t", compute, fixed))

    def _launch(self, spec: _Spec, volume, j: int, counters: dict) -> simpy.Event:
        key, n_members = self._members(spec, j)
        entry = self._meet(key, n_members, counters)
        if entry[0] == n_members:
            self.env.process(self._collective(spec, volume, j, entry[1]))
        return entry[1]

    def _meet(self, key: tuple, n_members: int, counters: dict) -> list:
        """Count one arrival at the next meeting of `key`: [arrived, done event, longest time]."""
        occurrence = counters[key]
        counters[key] += 1
        entry = self.rendezvous.setdefault((key, occurrence), [0, self.env.event(), 0.0])
        entry[0] += 1
        if entry[0] == n_members:
            del self.rendezvous[(key, occurrence)]
        return entry

    def _intra_members(self, spec: _Spec, c: int, j: int) -> tuple[tuple, int]:
        """Rendezvous key and member count of an intra-node op issued by process (c, j)."""
        g, g_rec = self.topo.accelerators_per_node, self.recorded.accelerators_per_node
        if spec.size == g_rec:
            return ("intra", c), g  # whole-node groups grow with the node
        # Smaller groups repeat in blocks of the recorded node size when nodes grow.
        block = j // g_rec
        span = range(block * g_rec, min(g, (block + 1) * g_rec))
        members = sum(1 for jj in span if jj % g_rec in spec.positions)
        return ("intra", c, block, spec.positions), members

    def _launch_intra(self, spec: _Spec, seconds: float, c: int, j: int, counters: dict):
        key, n_members = self._intra_members(spec, c, j)
        entry = self._meet(key, n_members, counters)
        entry[2] = max(entry[2], seconds)
        if entry[0] == n_members:
            done = entry[1]
            timer = self.env.timeout(entry[2])
            timer.callbacks.append(lambda _event: done.succeed())
        return entry[1]

    def _collective(self, spec: _Spec, volume, j: int, done: simpy.Event):
        link = self.topo.inter
        yield self.env.timeout(volume.latency_steps * link.latency)
        nbytes = max(volume.bytes_sent, volume.bytes_received)
        flows = []
        for c in range(len(self.classes)):
            if spec.scope == "replicate":
                flows.append(self._nic(c, j).transfer(nbytes))
            elif spec.scope == "world":
                # Ring over sorted ranks: each node has one edge leaving it, from its last rank.
                flows.append(self._nic(c, self.topo.accelerators_per_node - 1).transfer(nbytes))
            else:
                flows.append(self._nic(c, j).transfer(nbytes * spec.nic_share))
        yield self.env.all_of(flows)
        done.succeed()

    def _rank(self, c: int, j: int, n_steps: int):
        factor = self.compute_scale / self.classes[c]
        g_rec = self.recorded.accelerators_per_node
        counters: dict = defaultdict(int)
        env = self.env
        for s in range(n_steps):
            program = self.compiled.get((j % g_rec, s % self.n_recorded), [])
            pending: dict = {}
            for item in program:
                kind = item[0]
                if kind == "t":
                    yield env.timeout(item[1] * factor + item[2])
                elif kind == "i":
                    pending[item[1]] = self._launch(self.specs[item[2]], item[3], j, counters)
                elif kind == "d":
                    if item[2] is None:
                        pending[item[1]] = env.timeout(item[3])
                    else:
                        spec = self.specs[item[2]]
                        pending[item[1]] = self._launch_intra(spec, item[3], c, j, counters)
                elif item[1] in pending:
                    yield pending.pop(item[1])
            # Ops never waited on in the trace still finish within their step.
            yield env.all_of(list(pending.values()))
            if len(self.step_end) <= s:
                self.step_end.append(env.now)
            else:
                self.step_end[s] = max(self.step_end[s], env.now)

    def run(self, n_steps: int) -> list[float]:
        for c in range(len(self.classes)):
            for j in range(self.topo.accelerators_per_node):
                self.env.process(self._rank(c, j, n_steps))
        self.env.run()
        if self.rendezvous:
            raise ValueError(
                "the trace's collectives do not pair up across nodes (some ranks issue ops the "
                "others never do); check that the trace holds every rank of the run."
            )
        return self.step_end


def simulate(
    trace: pd.DataFrame | str | os.PathLike,
    topology: Topology,
    steps: int | None = None,
    compute_scale: float = 1.0,
    intra: str = "model",
) -> pd.DataFrame:
    """Predict per-step times of a recorded run on `topology`: DataFrame[step, step_time_s, time_s].

    Args:
        trace: combined trace of all ranks (DataFrame or path to trace.parquet).
        topology: target cluster; may have more nodes/accelerators than the recording.
        steps: steps to simulate (default: the recorded number); more cycle the recorded ones.
        compute_scale: multiplies every compute interval (0.5 = accelerators twice as fast).
        intra: "model" times intra-node collectives on topology.intra; "recorded" keeps their
            recorded durations as seen by each op's last-arriving member (real runs never shape
            intra-node groups, so validating a model against a shaped run wants "recorded").
    """
    if not isinstance(topology, Topology):
        raise ValueError(f"topology {topology!r} must be a netsim.Topology.")
    if isinstance(trace, (str, os.PathLike)):
        df = load_trace(trace)
    else:
        df = validate_trace(trace)
    if (
        isinstance(compute_scale, bool)
        or not isinstance(compute_scale, (int, float))
        or not compute_scale > 0
    ):
        raise ValueError(f"compute_scale {compute_scale!r} must be a positive number.")
    nodes, per_node = _layout(df)
    recorded = Topology(nodes, per_node, topology.intra, topology.inter)
    programs, specs, n_recorded = _programs(df, recorded)
    n_steps = n_recorded if steps is None else steps
    if isinstance(n_steps, bool) or not isinstance(n_steps, (int, np.integer)) or n_steps < 1:
        raise ValueError(f"steps {steps!r} must be a positive integer or None.")
    if intra not in ("model", "recorded"):
        raise ValueError(f'intra {intra!r} is not known; use "model" or "recorded".')
    cluster = _Cluster(topology, recorded, programs, specs, n_recorded, float(compute_scale), intra)
    ends = cluster.run(int(n_steps))
    times = np.asarray(ends, dtype=float)
    out = pd.DataFrame(
        {
            "step": np.arange(len(times), dtype=np.int64),
            "step_time_s": np.diff(times, prepend=0.0),
            "time_s": times,
        }
    )
    out.attrs["note"] = MODEL_NOTE
    out.attrs["recorded_topology"] = (nodes, per_node)
    return out
