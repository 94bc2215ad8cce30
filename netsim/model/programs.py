"""From a recorded trace to per-step programs: what each accelerator position computes and issues.

A program is the list of one rank's step as the model replays it: `Compute` gaps, `Issue` of a
collective (named by its `OpSpec`) and `Wait` for an issued one. Programs are built per (recorded
accelerator position, recorded step); at each step every node replays the slowest recorded
node's programs (the nodes meet at inter-node ops, so the slowest sets a synchronous step's pace).

With overlap "fsdp2" FSDP2's gradient reduction leaves the program's order: a reduce-scatter or
all-reduce the trace attributes to a unit (issued after that unit's backward mark) is issued
where it was but not waited on there; it starts once the ops before it on its stream are done
(`Issue.after`: the previous op of its kind, and its unit's reduce-scatter), as on a GPU's
reduce-scatter and all-reduce streams, and the "backward" mark waits for all of them (FSDP2's
final callback makes the compute stream wait for the last reduce). The all-gathers before the
backward mark (FSDP2's, which the next compute waits for) keep their recorded waits but run one
at a time, each after the one before it, as on FSDP2's all-gather stream: a prefetch issued at
the instant the previous all-gather is waited on does not run beside it. The methods' own
exchanges in opt.step keep the recorded order.

An op waited on after its own step ended (flexdemo-async posts its exchange in one step and
waits in the next) is carried: its step's program issues it and does not wait; the program of
the step in which the trace waited waits for it there (at that step's start if the wait fell
between steps), so the transfer overlaps that step's compute. Carried ops have ids of their own,
the same on every rank (`carried_id`), and `Programs.carried` says how many steps after its own
each is waited on (for one drained after the last step: as many as the others).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import pandas as pd

from netsim.costs import P2P_OPS
from netsim.topology import Topology, ring_nic_share
from netsim.trace import BACKWARD

__all__ = ["OpSpec", "Compute", "Issue", "Wait", "Item", "Programs", "build_programs",
           "OVERLAPS", "STREAMED_OPS", "PHASES", "FORWARD_BACKWARD", "OPTIMIZER", "phase_compute",
           "carried_id"]

OVERLAPS = ("recorded", "fsdp2")
# A step's compute phases, split at the "backward" mark: Compute.phase indexes this tuple.
PHASES = ("forward_backward", "optimizer")
FORWARD_BACKWARD, OPTIMIZER = 0, 1
# FSDP2's gradient reduction of one unit: reduce-scatter inside the node, then (HSDP) all-reduce.
STREAMED_OPS = ("reduce_scatter", "all_reduce")

# Plain lists of these columns: iterating pandas row by row costs ~10 us per row, far too slow.
_COLUMNS = (
    "rank", "step", "kind", "op", "group", "inter", "algorithm", "bytes", "start_s", "wait_s",
    "end_s", "unit",
)  # fmt: skip


@dataclass(frozen=True)
class OpSpec:
    """One collective of a program: what it is and which model processes meet for it."""

    op: str
    algorithm: str
    nbytes: int
    inter: bool
    scope: str  # "replicate", "world", "other", "p2p" (inter) or "intra"
    positions: frozenset  # recorded accelerator positions taking part (inter "other")
    size: int  # group size for non-scaling groups
    nic_share: float  # bytes through one node's NIC per rank's wire bytes


class Compute(NamedTuple):
    """Compute between collectives, in recorded seconds, in phase FORWARD_BACKWARD or OPTIMIZER."""

    seconds: float
    phase: int = 0


class Issue(NamedTuple):
    """Issue collective `op` (a row id unique in the rank's step) of spec `spec`."""

    op: int
    spec: int
    recorded_s: float  # the op's own duration, for simulate(intra="recorded")
    after: tuple[int, ...] | None = None  # streamed (overlap fsdp2): ops it starts after


class Wait(NamedTuple):
    """Block until the issued collective `op` has finished."""

    op: int


Item = Compute | Issue | Wait


class Programs(NamedTuple):
    """Programs per (recorded position, recorded step index), their op specs and the step count."""

    by_slot: dict[tuple[int, int], list[Item]]
    specs: list[OpSpec]
    n_steps: int
    step_numbers: list[int]  # the trace's step number of each recorded step index
    carried: dict[int, int]  # carried op id -> steps after its own step it is waited on


# A moment in a rank's step, as a plain tuple (built ~10^5 times per replay, so no NamedTuple):
# (time, side, what, row, spec id or -1, end), sorted by time. `what`: ISSUE, WAIT, MARK (the
# "backward" mark) or CARRIED_WAIT (row is then a carried op id, of an op of an earlier step).
# `side`: the "backward" marks before the row in the trace, so that moments at a mark's very
# time keep the trace's order about it (a synthesized trace's collectives take no time: the
# root's reduce-scatter, the mark and the method's exchange all fall at one instant).
_Point = tuple[float, int, int, int, int, float]
ISSUE, WAIT, MARK, CARRIED_WAIT = 0, 1, 2, 3
# A carried op's wait ties after every other moment at its time (it follows the step's posts).
_LAST_SIDE = 1 << 30
# Carried op ids: negative, so they never meet a row number; room for this many per step.
_PER_STEP = 1 << 16
_EPS = 1e-9  # seconds: trace times are compared with this slack, as netsim.trace does


def carried_id(step_index: int, k: int) -> int:
    """The id of the k-th op (in issue order) of recorded step `step_index` waited after it."""
    return -(1 + step_index * _PER_STEP + k)


def _classify(group: str, recorded: Topology) -> tuple[str, frozenset, int, float]:
    """Scope, recorded positions, size and NIC share of a trace group such as "0,2"."""
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
    share = ring_nic_share(ranks, recorded, per="node")
    if len(locals_) == 1 and len(nodes) == len(ranks) == recorded.nodes:
        return "replicate", locals_, len(ranks), 1.0
    if len(ranks) == recorded.world_size:
        return "world", locals_, len(ranks), share
    return "other", locals_, len(ranks), share


class _SpecCatalog:
    """Interns the OpSpecs of a trace, so equal collectives share one spec id."""

    def __init__(self, recorded: Topology) -> None:
        self.recorded = recorded
        self.specs: list[OpSpec] = []
        self._ids: dict[tuple, int] = {}
        self._groups: dict[str, tuple[str, frozenset, int, float]] = {}
        self._rows: dict[tuple, int] = {}  # (group, op, algorithm, bytes, inter) -> spec id

    def spec_id(self, group: str, op: str, algorithm: str, nbytes: int, inter: bool) -> int:
        """The spec id of a collective as the trace row names it."""
        row_key = (group, op, algorithm, nbytes, inter)
        found = self._rows.get(row_key)
        if found is None:
            found = self._rows[row_key] = self._intern(*row_key)
        return found

    def _intern(self, group: str, op: str, algorithm: str, nbytes: int, inter: bool) -> int:
        if group not in self._groups:
            self._groups[group] = _classify(group, self.recorded)
        scope, positions, size, share = self._groups[group]
        if op in P2P_OPS and inter:
            # A message meets only its peer, whatever group it was sent on.
            scope, share = "p2p", 1.0
        key = (op, algorithm, int(nbytes), bool(inter), scope, positions, size)
        if key not in self._ids:
            self._ids[key] = len(self.specs)
            self.specs.append(OpSpec(*key, share))
        return self._ids[key]


def _own_durations(cols: dict[str, list]) -> tuple[dict[tuple, float], list[tuple | None]]:
    """Each op's own duration (its last-arriving member's span) and each row's op occurrence.

    The other members' recorded spans also hold their wait for that peer, which the model's
    rendezvous already accounts for. Members issue a group's ops in the same order, so (group,
    step, k-th call) names one op.
    """
    own: dict[tuple, float] = {}
    calls: dict[tuple, int] = defaultdict(int)
    occurrence: list[tuple | None] = [None] * len(cols["rank"])
    for r, kind in enumerate(cols["kind"]):
        if kind != "collective":
            continue
        key = (cols["rank"][r], cols["step"][r], str(cols["group"][r]))
        op = (key[2], key[1], calls[key])
        calls[key] += 1
        occurrence[r] = op
        start, wait, end = cols["start_s"][r], cols["wait_s"][r], cols["end_s"][r]
        wait = start if wait != wait else wait  # NaN: never waited on
        span = max(0.0, (wait if end != end else end) - start)
        own[op] = min(own.get(op, span), span)
    return own, occurrence


def _blocks(cols: dict[str, list]) -> Iterator[tuple[int, int]]:
    """Row ranges [i, j) of one (rank, step) each, in a frame sorted by rank, step, seq."""
    ranks, steps, n = cols["rank"], cols["step"], len(cols["rank"])
    i = 0
    while i < n:
        j = i
        while j < n and ranks[j] == ranks[i] and steps[j] == steps[i]:
            j += 1
        yield i, j
        i = j


def _step_span(cols: dict[str, list], i: int, j: int) -> tuple[float, float] | None:
    """The (begin, finish) of the block's kind="step" row, if it has one."""
    span = None
    for r in range(i, j):
        if cols["kind"][r] == "step":
            span = (cols["start_s"][r], cols["end_s"][r])
    return span


def _points(
    cols: dict[str, list], i: int, j: int, span: tuple[float, float] | None, catalog: _SpecCatalog,
    carried: dict[int, int],
) -> list[_Point]:
    """Issue and wait moments of the block's collectives inside the step span, in time order.

    The "backward" marks are points too (MARK): the optimizer phase starts there, and with
    overlap "fsdp2" the streamed ops are joined there; an op issued after a mark at its very
    time comes after it, so that the optimizer step's exchange never overlaps the backward's
    reduce. Ops in `carried` (row -> carried id) are waited on in a later step: only their
    issue is a point here.
    """
    kinds, starts, ends, waits, groups = (
        cols["kind"], cols["start_s"], cols["end_s"], cols["wait_s"], cols["group"]
    )  # fmt: skip
    ops, algorithms, sizes, inters = cols["op"], cols["algorithm"], cols["bytes"], cols["inter"]
    points: list[_Point] = []
    side = 0
    for r in range(i, j):
        if kinds[r] == "mark" and ops[r] == BACKWARD:
            points.append((starts[r], side, MARK, r, -1, starts[r]))
            side += 1
        if kinds[r] != "collective":
            continue
        start, end, wait = starts[r], ends[r], waits[r]
        # Traffic outside the step's span is not part of the step's program.
        if span is not None and not span[0] <= start <= span[1]:
            continue
        spec = catalog.spec_id(str(groups[r]), ops[r], algorithms[r], sizes[r], inters[r])
        wait = start if wait != wait else wait
        end = wait if end != end else end
        points.append((start, side, ISSUE, r, spec, end))
        if r not in carried:
            points.append((wait, side, WAIT, r, -1, end))
    points.sort()
    return points


def _fallback_span(cols: dict[str, list], i: int, j: int) -> tuple[float, float]:
    """A step without a step row spans its rows' earliest start to latest end."""
    times = [cols["start_s"][r] for r in range(i, j)]
    times += [cols["end_s"][r] for r in range(i, j) if cols["end_s"][r] == cols["end_s"][r]]
    return min(times), max(times)


class _Streams:
    """FSDP2's reduce streams of one rank's step: which ops are streamed, what each starts after."""

    def __init__(self, cols: dict[str, list] | None) -> None:
        self.cols = cols  # None: overlap "recorded", nothing streamed
        self.last: dict[str, int] = {}  # stream (op kind) -> its last op
        self.unit_last: dict[int, int] = {}  # unit -> its last streamed op
        self.open: list[int] = []  # streamed ops not yet joined

    def streamed(self, row: int) -> bool:
        """Whether the op of `row` is a unit's gradient reduction (on a stream)."""
        cols = self.cols
        return cols is not None and cols["unit"][row] >= 0 and cols["op"][row] in STREAMED_OPS

    def issue(self, row: int) -> tuple[int, ...]:
        """Put the op of `row` on its stream; the ops it must start after."""
        kind, unit = self.cols["op"][row], self.cols["unit"][row]
        after = {op for op in (self.last.get(kind), self.unit_last.get(unit)) if op is not None}
        self.last[kind] = self.unit_last[unit] = row
        self.open.append(row)
        return tuple(sorted(after))

    def gathers(self, row: int) -> bool:
        """Whether the op of `row` is an all-gather inside the node (before the backward mark:
        FSDP2's; one across nodes there is a method's, posted in the backward)."""
        return (self.cols is not None and self.cols["op"][row] == "all_gather"
                and not self.cols["inter"][row])

    def gather(self, row: int) -> tuple[int, ...]:
        """Put the all-gather of `row` on the all-gather stream; the op it starts after."""
        before, self.last["all_gather"] = self.last.get("all_gather"), row
        return () if before is None else (before,)

    def join(self) -> list[Item]:
        """Waits for every streamed op still open (the backward mark: the optimizer waits)."""
        waits: list[Item] = [Wait(op) for op in self.open]
        self.open = []
        return waits


def _program(
    points: list[_Point], span: tuple[float, float], own: dict, occurrence: list,
    streams: _Streams | None = None, carried: dict[int, int] | None = None,
) -> list[Item]:
    """A block's points as a program: compute fills the gaps in which the rank was not blocked.

    A streamed op's recorded wait adds no Wait (its blocked time is not compute either); the
    backward mark (MARK) waits for the streamed ops instead, and starts the optimizer phase.
    An all-gather before the mark keeps its Wait and starts after the one before it.
    A carried op (row in `carried`) is issued under its carried id; CARRIED_WAIT waits for one.
    """
    streams = streams or _Streams(None)
    carried = carried or {}
    program: list[Item] = []
    cursor, finish = span
    phase = FORWARD_BACKWARD
    for time, _side, what, row, spec, end in points:
        if time > cursor:
            program.append(Compute(time - cursor, phase))
            cursor = time
        if what == MARK:
            program.extend(streams.join())
            phase = OPTIMIZER
        elif what == CARRIED_WAIT:
            program.append(Wait(row))
            cursor = max(cursor, end)
        elif what == WAIT:
            if not streams.streamed(row):
                program.append(Wait(row))
            cursor = max(cursor, end)
        elif streams.streamed(row):
            program.append(Issue(row, spec, own[occurrence[row]], streams.issue(row)))
        elif phase == FORWARD_BACKWARD and row not in carried and streams.gathers(row):
            program.append(Issue(row, spec, own[occurrence[row]], streams.gather(row)))
        else:
            program.append(Issue(carried.get(row, row), spec, own[occurrence[row]]))
    if finish > cursor:
        program.append(Compute(finish - cursor, phase))
    return program


class _Carried(NamedTuple):
    """The ops of a trace waited on after their own step, and where they are waited."""

    ids: dict[int, int]  # row -> carried id
    waits: dict[int, list[_Point]]  # block index -> CARRIED_WAIT points of earlier steps' ops
    delays: dict[int, int]  # carried id -> steps after its own it is waited on


def _late_rows(cols: dict[str, list], i: int, j: int, span: tuple[float, float]) -> list[int]:
    """The block's collectives issued inside its step span and waited on after it, by issue."""
    late = []
    for r in range(i, j):
        wait = cols["wait_s"][r]
        # The issue bound is _points' own, so that every carried op is issued in its program.
        if (cols["kind"][r] == "collective" and span[0] <= cols["start_s"][r] <= span[1]
                and wait == wait and wait > span[1] + _EPS):
            late.append((cols["start_s"][r], r))
    return [r for _, r in sorted(late)]


def _carried_ops(cols: dict[str, list], blocks: list[tuple[int, int]],
                 spans: list[tuple[float, float] | None], step_index: dict) -> _Carried:
    """Find the carried ops (module docstring) of blocks with a step row (`spans` not None).

    A wait between two steps is taken at the next step's start; one after the rank's last step
    (a drain, off the training clock) is not waited on at all, and is due as many steps later
    as the trace's other carried ops.
    """
    found = _Carried({}, defaultdict(list), {})
    drained: set[int] = set()
    by_rank: dict[int, list[int]] = defaultdict(list)  # blocks of one rank, in step order
    for b, (i, _) in enumerate(blocks):
        if spans[b] is not None:
            by_rank[cols["rank"][i]].append(b)
    for bs in by_rank.values():
        begins = [spans[b][0] for b in bs]
        for n, b in enumerate(bs):
            s = step_index[cols["step"][blocks[b][0]]]
            for k, r in enumerate(_late_rows(cols, *blocks[b], spans[b])):
                op = found.ids[r] = carried_id(s, k)
                wait, end = cols["wait_s"][r], cols["end_s"][r]
                end = wait if end != end else end
                m = max(n + 1, bisect.bisect_right(begins, wait) - 1)
                if m < len(bs) and wait > spans[bs[m]][1] + _EPS:
                    m += 1  # waited between steps m and m + 1: at the start of m + 1
                if m >= len(bs):
                    drained.add(op)
                    continue
                at = max(wait, begins[m])
                found.waits[bs[m]].append((at, _LAST_SIDE, CARRIED_WAIT, op, -1, max(end, at)))
                waited = step_index[cols["step"][blocks[bs[m]][0]]]
                found.delays[op] = max(found.delays.get(op, 0), waited - s)
    # A drained op would have been waited on as the others were: the method's delay.
    delay = max(found.delays.values(), default=1)
    for op in drained - found.delays.keys():
        found.delays[op] = delay
    return found


def _compute_s(program: list[Item]) -> float:
    return sum(item.seconds for item in program if type(item) is Compute)


def _merge_nodes(per_rank: dict[tuple[int, int, int], list[Item]]) -> dict:
    """One program per position and step: every position takes the step's slowest node's.

    The nodes meet at every inter-node op, so a synchronous step lasts as long as its slowest
    node (whose own positions meet at intra-node ops): a node's time is its busiest position's
    compute. Replaying a median node instead under-predicted such steps by 1-2% on 2 cores,
    where the recorded nodes' compute differs from step to step by a few %. Only nodes whose
    programs have node 0's shape (the same number of items per position) are candidates.
    """
    by_step: dict[int, dict[int, dict[int, list[Item]]]] = defaultdict(lambda: defaultdict(dict))
    for (pos, s, node), program in per_rank.items():
        by_step[s][node][pos] = program
    merged: dict[tuple[int, int], list[Item]] = {}
    for s, nodes in by_step.items():
        first = nodes[min(nodes)]
        alike = [
            n for n in sorted(nodes)
            if nodes[n].keys() == first.keys()
            and all(len(nodes[n][pos]) == len(first[pos]) for pos in first)
        ]  # fmt: skip
        slowest = max(alike, key=lambda n: max(_compute_s(p) for p in nodes[n].values()))
        for pos, program in nodes[slowest].items():
            merged[(pos, s)] = program
    return merged


def build_programs(df: pd.DataFrame, recorded: Topology, overlap: str = "recorded") -> Programs:
    """Per (recorded position, recorded step index): the program the model replays.

    `overlap` "fsdp2" puts FSDP2's per-unit gradient reduction on streams (module docstring).
    """
    steps = sorted(df["step"].unique())
    step_index = {s: i for i, s in enumerate(steps)}
    df = df.sort_values(["rank", "step", "seq"], kind="stable")
    cols = {c: df[c].tolist() for c in _COLUMNS}
    own, occurrence = _own_durations(cols)
    catalog = _SpecCatalog(recorded)
    blocks = list(_blocks(cols))
    spans = [_step_span(cols, i, j) for i, j in blocks]
    carried = _carried_ops(cols, blocks, spans, step_index)
    per_rank: dict[tuple[int, int, int], list[Item]] = {}
    for b, (i, j) in enumerate(blocks):
        rank, step = cols["rank"][i], cols["step"][i]
        fsdp2 = overlap == "fsdp2"
        points = _points(cols, i, j, spans[b], catalog, carried.ids) + carried.waits.get(b, [])
        points.sort()
        program = _program(points, spans[b] or _fallback_span(cols, i, j), own, occurrence,
                           _Streams(cols if fsdp2 else None), carried.ids)
        per_rank[(recorded.local_of(rank), step_index[step], recorded.node_of(rank))] = program
    return Programs(_merge_nodes(per_rank), catalog.specs, len(steps), [int(s) for s in steps],
                    carried.delays)


def phase_compute(programs: Programs) -> tuple[float, float]:
    """Median seconds per step of compute in each phase (PHASES order), of the busiest position.

    The compute a replay scales: the gaps in which a rank was not blocked on a collective.
    """
    per_step: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for (_, s), program in programs.by_slot.items():
        split = [0.0, 0.0]
        for item in program:
            if type(item) is Compute:
                split[item.phase] += item.seconds
        per_step[s].append((split[0], split[1]))
    if not per_step:
        return 0.0, 0.0
    busiest = [max(rows, key=sum) for rows in per_step.values()]
    return (float(pd.Series([b[0] for b in busiest]).median()),
            float(pd.Series([b[1] for b in busiest]).median()))
