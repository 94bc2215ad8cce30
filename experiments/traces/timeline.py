"""One rank's steps, collectives, busy time and marks, read from its events.

The timeline a rank's step is replayed on: on a GPU trace the device's (its compute kernels and
copies, and the gaps where it waits on the host), each collective from its NCCL kernel's start to
its end; on a CPU trace the host's (its threads' innermost ops), each collective from its host
event (issue) to the end of the backend's work ("gloo:OP" on a worker thread). Steps are
`ProfilerStep#N` spans; on the device a step runs from where the host began it, or where the
previous step's device work ended if later, to where the next one begins.

Marks, as a recording's (netsim.trace): "backward" where `Optimizer.step#...` begins (the
optimizer's first device work on a GPU), "unit_backward" where FSDP2's `FSDP::post_backward_reduce
(UNIT)` begins, the unit numbered as a recording numbers them (blocks in forward order, the root
last).
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict
from dataclasses import dataclass, field

from experiments.errors import ConfigError
from experiments.traces.chrome import Event, RankFile
from experiments.traces.names import (
    FIELDS,
    c10d_op,
    collective_op,
    element_size,
    elements_of,
    is_nccl_kernel,
    worker_names,
)
from experiments.traces.units import boundaries, unit_compute
from netsim.trace import BACKWARD, UNIT_BACKWARD

__all__ = ["Collective", "RankTimeline", "rank_timeline"]

_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_OPTIMIZER = "Optimizer.step#"
_FSDP_REDUCE = re.compile(r"^FSDP::post_backward_reduce(?: \((.*)\))?$")
_FSDP_GATHER = re.compile(r"^FSDP::all_gather(?: \((.*)\))?$")
_FSDP_PRE_FORWARD = re.compile(r"^FSDP::pre_forward(?: \((.*)\))?$")
_LAUNCH = ("cuda_runtime", "cuda_driver")
_REDUCTIONS = ("reduce_scatter", "all_reduce")  # a gradient's, in a unit's post-backward
_DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # what a GPU runs: kernels, copies
_EPS = 1e-9


@dataclass
class Collective:
    """One collective of one rank, as read: what it moved, on which ranks, and when."""

    op: str
    elements: int
    """Elements handed in ("In msg nelems"; a scatter's: out)."""
    out_elements: int | None
    dtype: str
    itemsize: int
    ranks: tuple[int, ...] | None
    """The group's global ranks (None until inferred)."""
    size: int | None
    issue: float
    """Host time it was issued (steps, units and marks are told apart on the host)."""
    start: float
    end: float
    inferred: set[str] = field(default_factory=set)
    """Fields the trace did not write: ranks, group size, elements, dtype."""
    gathered_unit: str | None = None
    """The FSDP2 unit an all-gather was issued for (`FSDP::all_gather (UNIT)`), if named."""
    description: str = ""
    wait: float = float("nan")
    step: int = 0
    unit: int = -1

    @property
    def nbytes(self) -> int:
        """Bytes handed in, as netsim's trace counts a payload."""
        return self.elements * self.itemsize


@dataclass
class RankTimeline:
    """A rank's steps, collectives, busy intervals and marks on the timeline it is replayed on."""

    source: RankFile
    device: bool
    """Whether the timeline is a GPU's (else the host's)."""
    steps: list[tuple[int, float, float]]
    """(ProfilerStep number, start, end) in order."""
    collectives: list[Collective]
    busy: list[tuple[float, float]]
    """Merged intervals in which the timeline ran something other than a collective."""
    marks: list[tuple[float, str, int, int, float]]
    """(time, "backward" | "unit_backward", unit, step index, host time)."""
    units: list[str]
    host_steps: list[tuple[int, float, float]] = field(default_factory=list)
    """The ProfilerStep spans on the host, where collectives and marks are told apart."""
    unit_seconds: dict[str, list[float]] | None = None
    """Per phase of `units.PHASES`, per FSDP2 unit its compute seconds (`units.unit_compute`)."""
    dropped: dict[str, int] = field(default_factory=dict)
    """What was left out and how often (host-side collectives of a GPU trace, ...)."""
    work: list[tuple[float, float]] | None = None
    """(host time it ran or was launched, seconds) of each piece of compute: a GPU's kernels,
    a host's time in its steps not spent waiting on a collective."""
    waits_named: bool = False
    """Whether the trace's own wait events said when the rank began each wait."""

    @property
    def rank(self) -> int:
        """The rank."""
        return self.source.rank

    def skip(self, n: int) -> None:
        """Leave out the first n steps (the profiler's warm-up, a first step's setup)."""
        self.steps, self.host_steps = self.steps[n:], self.host_steps[n:]
        self.collectives = [c for c in self.collectives if c.step >= n]
        for c in self.collectives:
            c.step -= n
        self.marks = [(t, op, u, k - n, h) for t, op, u, k, h in self.marks if k >= n]
        self.unit_seconds = None if self.work is None else unit_compute(
            self.source.events, self.work, self.host_steps, self.units, self.reductions(),
            self.optimizer_starts())

    def optimizer_starts(self) -> list[float]:
        """Host times at which an optimizer step began (its "backward" marks)."""
        return [host for _, op, _, _, host in self.marks if op == BACKWARD]

    def reductions(self) -> list[tuple[float, str]]:
        """(host time issued, FSDP2 unit) of each gradient reduction in a backward."""
        return [(c.issue, self.units[c.unit]) for c in self.collectives
                if c.op in _REDUCTIONS and 0 <= c.unit < len(self.units)]


def _nest(events: list[Event]) -> tuple[list[int], list[int]]:
    """Per event (sorted by thread, start, longest first): its enclosing event's index on the
    same thread (-1: none) and its number of children."""
    parent, children = [-1] * len(events), [0] * len(events)
    stack: list[int] = []
    for i, e in enumerate(events):
        if stack and events[stack[-1]].tid != e.tid:
            stack = []
        while stack and events[stack[-1]].end <= e.start + _EPS:
            stack.pop()
        if stack and e.end <= events[stack[-1]].end + _EPS:
            parent[i] = stack[-1]
            children[stack[-1]] += 1
        stack.append(i)
    return parent, children


class _Host:
    """A rank's host events, nested per thread, and the queries the reader asks of them."""

    def __init__(self, events: list[Event]) -> None:
        self.events = sorted((e for e in events if not e.on_device),
                             key=lambda e: (str(e.tid), e.start, -e.end))
        self.parent, self.children = _nest(self.events)

    def inside(self, i: int) -> list[int]:
        """The events nested in event i (same thread), in order."""
        out, j, outer = [], i + 1, self.events[i]
        while j < len(self.events) and self.events[j].tid == outer.tid \
                and self.events[j].start < outer.end - _EPS:
            out.append(j)
            j += 1
        return out

    def ancestors(self, i: int) -> list[int]:
        """The events enclosing event i, innermost first."""
        out, j = [], self.parent[i]
        while j >= 0:
            out.append(j)
            j = self.parent[j]
        return out


def _steps(host: _Host, path: str) -> list[tuple[int, float, float]]:
    steps = sorted((int(m.group(1)), e.start, e.end) for e in host.events
                   if (m := _STEP.match(e.name)))
    if not steps:
        raise ConfigError(f"{path!r} holds no training steps (no ProfilerStep#N): profile with "
                          "a schedule and call prof.step() once per step, as torchtitan does.")
    return steps


def _fields(e: Event) -> dict | None:
    """The record_param_comms fields of an event, if it has them and names a collective."""
    if "Collective name" not in e.args or collective_op(e.args["Collective name"]) is None:
        return None
    return {k: e.args.get(k) for k in FIELDS}


def _candidate_op(e: Event) -> str | None:
    fields = _fields(e)
    if fields is not None:
        return collective_op(fields["Collective name"])
    return c10d_op(e.name)


def _from_fields(fields: dict) -> dict:
    ranks = fields.get("Process Group Ranks")
    parsed = None
    if isinstance(ranks, str) and ranks.strip("[] "):
        try:
            parsed = tuple(sorted(int(r) for r in ranks.strip("[] ").split(",")))
        except ValueError:
            parsed = None
    return {"op": collective_op(fields["Collective name"]), "dtype": fields.get("dtype"),
            "elements": fields.get("In msg nelems"), "out": fields.get("Out msg nelems"),
            "size": fields.get("Group size"), "ranks": parsed}


def _from_shapes(host: _Host, i: int) -> dict:
    """A c10d op's metadata from its own input shapes, or its backend annotation's inside it."""
    e = host.events[i]
    op = c10d_op(e.name)
    dims, types = e.args.get("Input Dims"), e.args.get("Input type")
    elements = elements_of(dims)
    dtype = types[0] if isinstance(types, list) and types else None
    out = None
    if op in ("all_gather", "reduce_scatter", "all_to_all") and isinstance(dims, list) \
            and len(dims) > 1:
        # _allgather_base_(output, input), _reduce_scatter_base_(output, input): input second.
        out, elements = elements, elements_of(dims[1:])
        dtype = types[1] if isinstance(types, list) and len(types) > 1 else dtype
    if elements is None or element_size(str(dtype)) is None:
        for j in host.inside(i):  # nccl:all_reduce, gloo:..., record_param_comms: their shapes
            inner = host.events[j]
            n, t = elements_of(inner.args.get("Input Dims")), inner.args.get("Input type")
            if n is not None and isinstance(t, list) and t and element_size(str(t[0])):
                elements, dtype = n, t[0]
                break
    return {"op": op, "dtype": dtype, "elements": elements, "out": out, "size": None,
            "ranks": None}


def _host_collectives(host: _Host) -> list[tuple[int, dict]]:
    """(event index, metadata) of each collective issued on the host: the outermost event
    naming it, its fields from itself or the record_param_comms inside it."""
    found = []
    for i, e in enumerate(host.events):
        if _candidate_op(e) is None or any(_candidate_op(host.events[a]) is not None
                                           for a in host.ancestors(i)):
            continue
        meta = None
        for j in [i, *host.inside(i)]:
            fields = _fields(host.events[j])
            if fields is not None and fields.get("In msg nelems") is not None:
                meta = _from_fields(fields)
                break
        if meta is None:
            meta = _from_shapes(host, i)
            meta["inferred"] = {"elements", "dtype", "ranks", "group size"}
        found.append((i, meta))
    return found


def _make(meta: dict, issue: float, path: str) -> Collective | None:
    """A Collective from its metadata (None for a barrier: no payload). An element type the
    issuing op does not name (a TensorList's) stays unknown (itemsize 0) until the backend's
    own work names it (`_time_on_host`)."""
    itemsize = element_size(str(meta["dtype"])) or 0
    elements = meta["elements"]
    if meta["op"] == "barrier":
        return None
    if elements is None:
        raise ConfigError(f"{path!r}: a {meta['op']} at {issue:.6f} s names no element count; "
                          "profile with record_shapes=True.")
    if meta["op"] == "scatter" and meta.get("out") is not None:
        elements = int(meta["out"])
    size = meta.get("size")
    return Collective(meta["op"], int(elements), meta.get("out"),
                      str(meta["dtype"]) if itemsize else "", itemsize, meta.get("ranks"),
                      int(size) if size else None, issue, issue, issue,
                      set(meta.get("inferred", ())))


def _check_types(colls: list[Collective], path: str) -> None:
    """Every collective's element type known (ConfigError, one sentence, naming the first)."""
    for c in colls:
        if not c.itemsize:
            raise ConfigError(f"{path!r}: a {c.op} of {c.elements} elements names no element "
                              "type the import knows, nor does its backend's work; profile with "
                              "record_shapes=True.")


def _unit_gathered(host: _Host, i: int) -> str | None:
    for a in host.ancestors(i):
        m = _FSDP_GATHER.match(host.events[a].name)
        if m:
            return m.group(1) or ""
    return None


def _launches(host: _Host) -> dict[int, float]:
    """A GPU activity's correlation id -> the host time it was launched."""
    return {int(e.args["correlation"]): e.start for e in host.events
            if e.cat in _LAUNCH and isinstance(e.args.get("correlation"), int)}


def _kernel_links(host: _Host, i: int) -> set[int]:
    """The correlation ids of the launches inside host event i."""
    return {int(host.events[j].args["correlation"]) for j in host.inside(i)
            if host.events[j].cat in _LAUNCH
            and isinstance(host.events[j].args.get("correlation"), int)}


def _nccl_kernels(device: list[Event]) -> dict[int, Event]:
    """NCCL kernels by the correlation id of their launch."""
    return {int(k.args["correlation"]): k for k in device
            if k.cat == "kernel" and is_nccl_kernel(k.name)
            and isinstance(k.args.get("correlation"), int)}


def _time_on_device(colls: list[tuple[int, Collective]], host: _Host,
                    device: list[Event]) -> tuple[list[Collective], int]:
    """Each collective timed by its NCCL kernel(s); (kept, how many had none). A kernel that
    names its collective (newer profilers) but whose host event is not traced is one too."""
    kernels = _nccl_kernels(device)
    kept, missing, used = [], 0, set()
    for i, c in colls:
        mine = [kernels[x] for x in _kernel_links(host, i) if x in kernels]
        if not mine:
            missing += 1
            continue
        used.update(id(k) for k in mine)
        c.start, c.end = min(k.start for k in mine), max(k.end for k in mine)
        kept.append(c)
    for k in kernels.values():
        fields = _fields(k)
        c = None if id(k) in used or fields is None else _make(_from_fields(fields), k.start,
                                                                "kernel")
        if c is not None:
            c.start, c.end = k.start, k.end
            kept.append(c)
    return kept, missing


def _time_on_host(colls: list[tuple[int, Collective]], host: _Host) -> set:
    """Each collective's end from gloo's worker event of it (FIFO per name and size); returns
    the worker threads (they are not the timeline)."""
    workers = defaultdict(list)
    threads = set()
    for e in host.events:
        if e.name.startswith("gloo:"):
            workers[(e.name, elements_of(e.args.get("Input Dims")))].append(e)
            threads.add(e.tid)
    for queue in workers.values():
        queue.sort(key=lambda e: e.start)
    for i, c in sorted(colls, key=lambda ic: ic[1].issue):
        c.end = host.events[i].end  # the host event's own end, where no worker event matches
        for name in worker_names(c.op):
            queue = workers.get((name, c.elements), [])
            at = next((k for k, w in enumerate(queue) if w.start >= c.issue - 1e-4), None)
            if at is not None:
                work = queue.pop(at)
                c.end = max(c.issue, work.end)
                _type_from(c, work)
                break
    return threads


def _type_from(c: Collective, work: Event) -> None:
    """The element type of a collective whose issuing op named none, from its work's inputs."""
    types = work.args.get("Input type")
    size = element_size(str(types[0])) if isinstance(types, list) and types else None
    if not c.itemsize and size:
        c.dtype, c.itemsize = str(types[0]), size


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1] + _EPS:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        elif e > s:
            out.append((s, e))
    return out


def _is_wait(e: Event) -> bool:
    """A host event of a rank waiting for a collective (NCCL's record_param_comms, netsim's)."""
    return e.args.get("Collective name") == "wait"


def _host_work(host: _Host, workers: set) -> list[Event]:
    """The host's innermost ops on its own threads: what it computed (waits left out)."""
    return [e for i, e in enumerate(host.events)
            if host.children[i] == 0 and e.tid not in workers and not _STEP.match(e.name)
            and not _is_wait(e)]


def _busy(host: _Host, device_events: list[Event], on_device: bool,
          workers: set) -> list[tuple[float, float]]:
    """The timeline's activity: compute kernels and copies, or the host's innermost ops."""
    if on_device:
        return _merged([(e.start, e.end) for e in _compute(device_events)])
    return _merged([(e.start, e.end) for e in _host_work(host, workers)])


def _waited_from(host: _Host, colls: list[tuple[int, Collective]]) -> bool:
    """On a host timeline with wait events: each collective waited on from the start of the
    wait in progress on its thread when it ended, to that wait's return (none: it ended while
    the rank computed)."""
    waits: dict = defaultdict(list)
    for e in host.events:
        if _is_wait(e):
            waits[e.tid].append(e)
    if not waits:
        return False
    for i, c in colls:
        mine = waits.get(host.events[i].tid, [])
        holding = [w for w in mine if w.start <= c.end + _EPS and w.end >= c.end - 1e-4]
        c.wait = max(holding[0].start, c.start) if holding else c.end
        if holding:
            c.end = max(c.end, holding[0].end)
    return True


def rank_timeline(rank: RankFile) -> RankTimeline:
    """One rank's timeline (ConfigError, one sentence, for a trace without steps)."""
    path = str(rank.path)
    host = _Host(rank.events)
    device_events = [e for e in rank.events if e.on_device]
    host_steps = _steps(host, path)
    colls = []
    for i, meta in _host_collectives(host):
        c = _make(meta, host.events[i].start, path)
        if c is not None:
            c.gathered_unit = _unit_gathered(host, i)
            colls.append((i, c))
    on_device = any(e.cat == "kernel" for e in device_events)
    dropped: dict[str, int] = {}
    named = False
    if on_device:
        kept, missing = _time_on_device(colls, host, device_events)
        if missing:
            dropped["host-side collectives without a GPU kernel (CPU tensors)"] = missing
        workers: set = set()
    else:
        workers = _time_on_host(colls, host)
        named = _waited_from(host, colls)
        kept = [c for _, c in colls]
    _check_types(kept, path)
    launches = _launches(host) if on_device else {}
    steps = _step_spans(host_steps, kept, device_events, launches, on_device)
    busy = _busy(host, device_events, on_device, workers)
    units = _unit_names(host)
    marks = _marks(host, host_steps, steps, device_events, launches, on_device, units)
    _place(kept, host_steps, steps, marks, busy, dropped)
    timeline = RankTimeline(rank, on_device, steps, kept, busy, marks, units, host_steps,
                            dropped=dropped, waits_named=named)
    if on_device:
        timeline.work = _work(device_events, launches)
    else:
        issued = [t for t, _ in timeline.reductions()]
        timeline.work = _host_compute(host_steps, kept, sorted(
            [*boundaries(rank.events), *issued, *timeline.optimizer_starts()]))
    timeline.skip(0)
    return timeline


def _compute(device_events: list[Event]) -> list[Event]:
    """A GPU's compute kernels and copies (its NCCL kernels aside)."""
    return [e for e in device_events if e.cat in _DEVICE_WORK and not is_nccl_kernel(e.name)]


def _work(device_events: list[Event], launches: dict[int, float]) -> list[tuple[float, float]]:
    """A GPU timeline's compute: each kernel or copy at its launch, its seconds on the device."""
    return [(launches[e.args["correlation"]], e.end - e.start) for e in _compute(device_events)
            if e.args.get("correlation") in launches]


def _host_compute(host_steps: list[tuple[int, float, float]], colls: list[Collective],
                  cuts: list[float]) -> list[tuple[float, float]]:
    """A host timeline's compute as its replay counts it: its steps less the time it waited on
    collectives, in pieces (start, seconds) cut where the FSDP2 unit a moment counts for may
    change (`units.boundaries`, the reductions' issues, the optimizer steps' starts)."""
    waits = _merged([(c.wait, c.end) for c in colls if c.wait < c.end])  # NaN: never waited
    pieces = []
    for _, begin, end in host_steps:
        for a, b in _less(begin, end, waits):
            edges = [a, *(t for t in cuts if a < t < b), b]
            pieces += [(x, y - x) for x, y in zip(edges, edges[1:], strict=False)]
    return pieces


def _less(begin: float, end: float,
          taken: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """[begin, end] less the sorted, disjoint intervals `taken`."""
    out, at = [], begin
    for a, b in taken:
        if b <= at:
            continue
        if a >= end:
            break
        if a > at:
            out.append((at, a))
        at = b
    if at < end:
        out.append((at, end))
    return out


def _step_of(host_steps: list[tuple[int, float, float]], t: float) -> int:
    """Index of the host step whose span holds host time t, -1 outside every step."""
    starts = [s for _, s, _ in host_steps]
    at = bisect.bisect_right(starts, t + _EPS) - 1
    return at if at >= 0 and t <= host_steps[at][2] + _EPS else -1


def _step_spans(host_steps, colls, device_events, launches, on_device):
    """Each step's span on the timeline: the host's, or on a GPU from where its device work
    can begin to where the next step's begins."""
    if not on_device:
        return list(host_steps)
    last_end = [0.0] * len(host_steps)
    launched = [(launches.get(e.args.get("correlation"), e.start), e.end) for e in device_events
                if e.cat in _DEVICE_WORK]
    launched += [(c.issue, c.end) for c in colls]
    for at, end in launched:
        k = _step_of(host_steps, at)
        if k >= 0:
            last_end[k] = max(last_end[k], end)
    spans, begin = [], _first_begin(host_steps[0], device_events, launches)
    for k, (number, _, host_end) in enumerate(host_steps):
        nxt = host_steps[k + 1][1] if k + 1 < len(host_steps) else host_end
        end = max(nxt, last_end[k], begin)
        spans.append((number, begin, end))
        begin = end
    return spans


def _first_begin(first: tuple[int, float, float], device_events: list[Event],
                 launches: dict[int, float]) -> float:
    """Where the first step's span begins on a GPU: where the host began it, or, where the
    device was still running work queued before the profile (which the trace does not hold),
    as much later as the step's first kernel on the busiest compute stream began after its
    launch (an NCCL kernel's start waits on the step's own compute)."""
    _, host_begin, host_end = first
    work = _compute(device_events)
    busy: dict[object, float] = {}
    for e in work:
        busy[e.args.get("stream")] = busy.get(e.args.get("stream"), 0.0) + e.end - e.start
    if not busy:
        return host_begin
    stream = max(busy, key=busy.get)
    ran = [(launches[e.args["correlation"]], e.start) for e in work
           if e.args.get("stream") == stream
           and host_begin <= launches.get(e.args.get("correlation"), -1.0) <= host_end]
    if not ran:
        return host_begin
    launched, start = min(ran)
    return host_begin + max(0.0, start - launched)


def _unit_names(host: _Host) -> list[str]:
    """FSDP2 units in a recording's order: blocks as the forward first reaches them (its
    pre-forward hook or its all-gather: a unit sharded over one rank gathers nothing), root
    last."""
    order: list[str] = []
    for e in sorted(host.events, key=lambda e: e.start):
        m = (_FSDP_PRE_FORWARD.match(e.name) or _FSDP_GATHER.match(e.name)
             or _FSDP_REDUCE.match(e.name))
        if m and (m.group(1) or "") not in order:
            order.append(m.group(1) or "")
    if "" in order:
        order.remove("")
        order.append("")
    return order


def _first_device(device_events, launches, begin: float, end: float) -> float | None:
    """Device start of the first GPU work launched in host span [begin, end]."""
    starts = [e.start for e in device_events if e.cat in _DEVICE_WORK
              and begin - _EPS <= launches.get(e.args.get("correlation"), -1.0) <= end + _EPS]
    return min(starts) if starts else None


def _marks(host, host_steps, steps, device_events, launches, on_device, units):
    """(time on the timeline, op, unit, step index) of the backward and unit marks."""
    marks = []
    for e in host.events:
        reduce = _FSDP_REDUCE.match(e.name)
        if not (e.name.startswith(_OPTIMIZER) or reduce):
            continue
        k = _step_of(host_steps, e.start)
        if k < 0:
            continue
        when = e.start
        if on_device:
            when = _first_device(device_events, launches, e.start, e.end)
            if when is None:
                continue
        when = min(max(when, steps[k][1]), steps[k][2])
        if reduce:
            marks.append((when, UNIT_BACKWARD, units.index(reduce.group(1) or ""), k, e.start))
        else:
            marks.append((when, BACKWARD, -1, k, e.start))
    return sorted(marks)


def _place(colls, host_steps, steps, marks, busy, dropped) -> None:
    """Each collective's step, FSDP2 unit, and wait (where the timeline stopped running)."""
    by_step = defaultdict(list)
    for _, op, unit, k, host_t in marks:
        by_step[k].append((host_t, op, unit))
    ends = [b for _, b in busy]
    kept = []
    for c in colls:
        k = _step_of(host_steps, c.issue)
        if k < 0:
            dropped["collectives outside every ProfilerStep"] = \
                dropped.get("collectives outside every ProfilerStep", 0) + 1
            continue
        c.step = k
        _, begin, end = steps[k]
        c.start = min(max(c.start, begin), end)
        c.end = min(max(c.end, c.start), end)
        c.unit = _unit_at(by_step[k], c.issue)
        if c.wait != c.wait:  # NaN: no wait event said it (_waited_from)
            c.wait = _wait(busy, ends, c.start, c.end)
        c.wait = min(max(c.wait, c.start), c.end)
        kept.append(c)
    colls[:] = kept


def _unit_at(marks: list[tuple[float, str, int]], issue: float) -> int:
    """The unit whose backward mark the collective followed within the backward (-1: none)."""
    unit = -1
    for host_t, op, u in sorted(marks):
        if host_t > issue + _EPS:
            break
        unit = u if op == UNIT_BACKWARD else -1
    return unit


def _wait(busy: list[tuple[float, float]], ends: list[float], start: float, end: float) -> float:
    """When the timeline began waiting for an op ending at `end`: `end` itself if it was busy
    then (the op finished under other work), else where its last work before `end` stopped."""
    at = bisect.bisect_left(ends, end - _EPS)
    if at < len(busy) and busy[at][0] < end - _EPS:
        return end
    last = ends[at - 1] if at > 0 else start
    return min(max(last, start), end)
