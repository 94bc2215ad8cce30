"""A traced job: every rank's file read, checked against the others, and turned into netsim's trace.

`read_job(paths, gpus_per_node)` reads the per-rank files, refuses what cannot be one data-parallel
run (ranks of two runs, steps that differ, no collectives, a world that --gpus-per-node does not
divide, pipeline- or tensor-parallel collectives), fills the groups the traces do not name
(`groups`), copies a traced rank for every rank not traced (the rest taken as alike, and said
so), and returns the job with netsim's trace rows (`Job.trace()`).
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import pandas as pd

from experiments.errors import ConfigError
from experiments.sizes import Cost, Count, Term, check_work
from experiments.traces.chrome import read_rank, trace_files
from experiments.traces.groups import assign_groups
from experiments.traces.timeline import Collective, RankTimeline, rank_timeline
from netsim.costs import collective_volume, default_algorithm
from netsim.trace import TRACE_COLUMNS, TRAIN

__all__ = ["Job", "read_job"]

# A process group torchtitan (and most stacks) names after a model-parallel mesh dimension.
_MODEL_PARALLEL = re.compile(r"(?:^|[_\W])(tp|pp|cp|tensor|pipe|pipeline|context)(?:$|[_\W])",
                             re.IGNORECASE)
_BACKWARD_OP = "autograd::engine::evaluate_function"


@dataclass
class Job:
    """Every rank of a traced job on the timeline it is replayed on."""

    timelines: list[RankTimeline]
    """The traced ranks, by rank."""
    world: int
    gpus_per_node: int
    backend: str
    alike: dict[int, int] = field(default_factory=dict)
    """Rank not traced -> the traced rank taken for it."""
    inferred: list[str] = field(default_factory=list)
    """What the traces did not say and the import inferred, one sentence each."""

    @property
    def nodes(self) -> int:
        """Nodes of the job: its world over --gpus-per-node."""
        return self.world // self.gpus_per_node

    @property
    def device(self) -> str:
        """The device the traced ranks ran on."""
        return self.timelines[0].source.device

    @property
    def steps(self) -> list[int]:
        """The ProfilerStep numbers, in order."""
        return [number for number, _, _ in self.timelines[0].steps]

    def trace(self) -> pd.DataFrame:
        """netsim's trace of every rank (traced and taken as alike), times from the first step."""
        origin = min(tl.steps[0][1] for tl in self.timelines)
        skewed = self.keeps_entry_skew
        rows = []
        for tl in self.timelines:
            rows += _rows(tl, tl.rank, self, origin, lambda r: r, skewed)
        for rank, source in sorted(self.alike.items()):
            tl = next(t for t in self.timelines if t.rank == source)
            rows += _rows(tl, rank, self, origin, self._mover(source, rank), skewed)
        frame = pd.DataFrame(rows, columns=list(TRACE_COLUMNS)).astype(TRACE_COLUMNS)
        return frame.sort_values(["rank", "start_s", "seq"], kind="stable").reset_index(drop=True)

    @property
    def keeps_entry_skew(self) -> bool:
        """Whether the first step begins for every rank where the first entered it: a window
        after the profiler's first step (ProfilerStep#N, N > 0), where a later rank was still
        at the step before; at #0 the ranks' skew is their start-up, left out as a recording
        leaves it out."""
        return self.steps[0] > 0

    def _mover(self, source: int, rank: int):
        """Global rank of `source`'s job -> the same place seen from `rank`: nodes and local
        indices shifted alike (intra-node groups move to its node, inter-node ones to its local
        index, the world stays the world)."""
        g = self.gpus_per_node
        dn, dl = rank // g - source // g, rank % g - source % g
        return lambda r: ((r // g + dn) % self.nodes) * g + (r % g + dl) % g


def _rows(tl: RankTimeline, rank: int, job: Job, origin: float, move,
          skewed: bool) -> list[dict]:
    """The trace rows of one rank: step spans, marks and collectives (`skewed`: the first step
    begins at `origin`, `Job.keeps_entry_skew`)."""
    g = job.gpus_per_node
    node, local = rank // g, rank % g
    base = {"rank": rank, "node": node, "local": local, "group": "", "group_size": 0,
            "peer": -1, "inter": False, "algorithm": "", "bytes": 0, "bytes_sent": 0.0,
            "bytes_received": 0.0, "modeled_s": math.nan, "phase": TRAIN, "unit": -1,
            "wait_s": math.nan}
    events = []
    for k, (_, start, end) in enumerate(tl.steps):
        begin = origin if k == 0 and skewed else start
        events.append((begin, 0, {**base, "step": k + 1, "kind": "step", "op": "",
                                  "start_s": begin - origin, "end_s": end - origin}))
    for when, op, unit, k, _ in tl.marks:
        events.append((when, 1, {**base, "step": k + 1, "kind": "mark", "op": op, "unit": unit,
                                 "start_s": when - origin, "end_s": when - origin}))
    backend = "nccl" if "nccl" in job.backend else "gloo"
    for c in tl.collectives:
        events.append((c.start, 2, _collective_row(c, base, move, g, backend, origin)))
    events.sort(key=lambda e: (e[0], e[1]))
    return [{**row, "seq": i} for i, (_, _, row) in enumerate(events)]


def _collective_row(c: Collective, base: dict, move, g: int, backend: str,
                    origin: float) -> dict:
    ranks = sorted(move(r) for r in c.ranks)
    algorithm = default_algorithm(c.op, backend)
    volume = collective_volume(c.op, len(ranks), c.nbytes, algorithm)
    return {**base, "step": c.step + 1, "kind": "collective", "op": c.op,
            "group": ",".join(map(str, ranks)), "group_size": len(ranks),
            "inter": len({r // g for r in ranks}) > 1, "algorithm": algorithm,
            "bytes": c.nbytes, "bytes_sent": volume.bytes_sent,
            "bytes_received": volume.bytes_received, "start_s": c.start - origin,
            "wait_s": c.wait - origin, "end_s": c.end - origin, "unit": c.unit}


def read_job(paths: list[str], gpus_per_node: int | None = None, skip_steps: int = 0) -> Job:
    """The traced job in `paths` (files or folders), checked (ConfigError, one sentence).

    `gpus_per_node` None: the GPUs the traces' host lists (refused on a CPU trace); the first
    `skip_steps` profiled steps are left out."""
    ranks = [read_rank(p) for p in trace_files(paths)]
    gpus_per_node = _gpus_per_node(ranks, gpus_per_node)
    _check_one_run(ranks, gpus_per_node)
    timelines = sorted((rank_timeline(r) for r in ranks), key=lambda t: t.rank)
    world = ranks[0].world_size
    _check_steps(timelines)
    if not 0 <= skip_steps < len(timelines[0].steps):
        raise ConfigError(f"--skip-steps {skip_steps} leaves none of the "
                          f"{len(timelines[0].steps)} profiled steps; give fewer.")
    for tl in timelines:
        tl.skip(skip_steps)
    for tl in timelines:
        _refuse_point_to_point(tl)
        _refuse_forward_all_reduce(tl)
    inferred = assign_groups(timelines, world, gpus_per_node)
    for tl in timelines:
        _refuse_model_parallel(tl)
    job = Job(timelines, world, gpus_per_node, ranks[0].backend, inferred=inferred)
    job.inferred += _entry_skew(job)
    _check_collectives(job)
    _check_size(job)
    job.alike = _alike(job)
    return job


def _entry_skew(job: Job) -> list[str]:
    """The sentence for traced ranks that entered the first step apart (`Job.trace`)."""
    entries = [tl.steps[0][1] for tl in job.timelines]
    skew = max(entries) - min(entries)
    if skew <= 0:
        return []
    apart = (f"the traced ranks entered the first step (ProfilerStep#{job.steps[0]}) up to "
             f"{skew * 1e3:.3g} ms apart")
    if job.keeps_entry_skew:
        return [f"{apart}; it begins for every rank where the first entered it, a later rank's "
                "time before its entry kept as compute (work of the step before, which the "
                "trace does not hold)"]
    return [f"{apart}: their start-up, as the profiler's first step; each rank's step begins "
            "at its own entry, as a recording's"]


def _gpus_per_node(ranks, given: int | None) -> int:
    """--gpus-per-node, or the GPUs the first trace's host lists where they divide the world."""
    if given is not None:
        return given
    first = ranks[0]
    if first.devices and first.world_size % min(first.devices, first.world_size) == 0:
        return min(first.devices, first.world_size)
    raise ConfigError(f"{str(first.path)!r} does not say how many GPUs a node holds (its host "
                      f"lists {first.devices}); give --gpus-per-node, the ranks per node the job "
                      "ran with.")


def _check_one_run(ranks, gpus_per_node: int) -> None:
    """The files are ranks of one job, each once, whose world --gpus-per-node divides."""
    first = ranks[0]
    for other in ranks[1:]:
        if other.world_size != first.world_size or other.backend != first.backend:
            raise ConfigError(f"{str(first.path)!r} is rank {first.rank} of a {first.backend} "
                              f"world of {first.world_size}, {str(other.path)!r} rank "
                              f"{other.rank} of a {other.backend} world of {other.world_size}: "
                              "ranks of two different runs; import one run's files.")
    seen: dict[int, object] = {}
    for r in ranks:
        if r.rank in seen:
            raise ConfigError(f"{str(seen[r.rank])!r} and {str(r.path)!r} are both rank "
                              f"{r.rank}: ranks of two different runs; import one run's files.")
        seen[r.rank] = r.path
    if first.world_size == 1:
        raise ConfigError(f"{str(first.path)!r} is the one rank of a job of one (world_size 1): "
                          "nothing crosses GPUs or nodes to replay; profile a job of several "
                          "ranks.")
    if first.world_size % gpus_per_node:
        raise ConfigError(f"--gpus-per-node {gpus_per_node} does not divide the traced world of "
                          f"{first.world_size} ranks; give the GPUs per node the job ran with.")


def _check_steps(timelines: list[RankTimeline]) -> None:
    """Every rank traced the same ProfilerSteps."""
    first = timelines[0]
    numbers = [n for n, _, _ in first.steps]
    for tl in timelines[1:]:
        theirs = [n for n, _, _ in tl.steps]
        if theirs != numbers:
            raise ConfigError(f"{str(first.source.path)!r} holds ProfilerStep "
                              f"{_span(numbers)} and {str(tl.source.path)!r} {_span(theirs)}: "
                              "ranks of two different runs or profiling windows; import files "
                              "of the same steps.")


def _span(numbers: list[int]) -> str:
    return f"#{numbers[0]}" if len(numbers) == 1 else f"#{numbers[0]}-#{numbers[-1]}"


def _refuse_point_to_point(tl: RankTimeline) -> None:
    """A pipeline-parallel job (its stages send and receive activations) is refused."""
    for c in tl.collectives:
        if c.op in ("send", "recv"):
            raise ConfigError(f"{str(tl.source.path)!r}: rank {tl.rank} {c.op}s {c.nbytes} bytes "
                              f"point to point in ProfilerStep#{tl.steps[c.step][0]}, as "
                              "pipeline-parallel stages pass activations; pipeline- and "
                              "tensor-parallel traces are not imported (data-parallel jobs "
                              "only: DDP, FSDP, HSDP).")


def _refuse_model_parallel(tl: RankTimeline) -> None:
    """Tensor- and other model-parallel jobs are refused, naming the collective that shows it."""
    path = str(tl.source.path)
    for c in tl.collectives:
        if c.description and _MODEL_PARALLEL.search(c.description):
            raise ConfigError(f"{path!r}: rank {tl.rank}'s {c.op} of {c.nbytes} bytes runs on "
                              f"process group {c.description!r} (ranks {list(c.ranks)}), a "
                              "model-parallel mesh dimension; pipeline- and tensor-parallel "
                              "traces are not imported (data-parallel jobs only).")


def _refuse_forward_all_reduce(tl: RankTimeline) -> None:
    """An all-reduce issued in a step's forward, before its backward, is tensor parallelism's."""
    begins = _backward_begins(tl)
    for c in tl.collectives:
        before = begins.get(c.step)
        if c.op == "all_reduce" and before is not None and c.issue < before \
                and (c.ranks is None or len(c.ranks) > 1):
            raise ConfigError(f"{str(tl.source.path)!r}: rank {tl.rank} all-reduces "
                              f"{c.elements} {c.dtype} elements in ProfilerStep#"
                              f"{tl.steps[c.step][0]}'s forward, before its backward, as tensor "
                              "parallelism sums a layer's partial outputs; pipeline- and "
                              "tensor-parallel traces are not imported (data-parallel jobs only).")


def _backward_begins(tl: RankTimeline) -> dict[int, float]:
    """Per step index, the host time its backward began (its first autograd engine op)."""
    begins: dict[int, float] = {}
    starts = [(s, e) for _, s, e in tl.host_steps]
    for e in tl.source.events:
        if e.name.startswith(_BACKWARD_OP) and not e.on_device:
            for k, (s, end) in enumerate(starts):
                if s <= e.start <= end:
                    begins[k] = min(begins.get(k, e.start), e.start)
                    break
    return begins


def _check_collectives(job: Job) -> None:
    """Collectives there are, and every rank of a group ran the same ones in each step."""
    if not any(tl.collectives for tl in job.timelines):
        raise ConfigError(f"{str(job.timelines[0].source.path)!r} and the other traces hold no "
                          "collective in their steps: nothing crosses GPUs or nodes to replay "
                          "(a single-GPU job, or a profile without its communication).")
    seen: dict[tuple, tuple[int, list]] = {}
    for tl in job.timelines:
        mine = defaultdict(list)
        for c in tl.collectives:
            mine[(c.ranks, c.step)].append((c.op, c.nbytes))
        for key, ops in mine.items():
            if key in seen and seen[key][1] != ops:
                other, theirs = seen[key]
                raise ConfigError(f"ranks {other} and {tl.rank} ran different collectives on "
                                  f"ranks {list(key[0])} in step {key[1] + 1} ({_count(theirs)} "
                                  f"against {_count(ops)}): ranks of two different runs?")
            seen.setdefault(key, (tl.rank, ops))


# What a rank of the imported trace holds (experiments.sizes): a row a step, mark and collective
# of the traced rank it copies, about 400 B in pandas, written in about 3 us.
_ROW = Cost("a row of a rank's imported trace", bytes=400, seconds=3e-6)


def _check_size(job: Job) -> None:
    """Refuse a world whose rows (every rank copies a traced one's) pass memory or ten minutes."""
    rows = max(len(tl.steps) + len(tl.marks) + len(tl.collectives) for tl in job.timelines)
    check_work("the import", [Term(_ROW, (
        Count("world_size", job.world, "ranks", said=f"the traces' world of {job.world:,} "
                                                     "ranks", given=False),
        Count("rows", rows, "rows a rank", said=f"{rows:,} rows a rank", given=False)))])


def _count(ops: list) -> str:
    return ", ".join(f"{n} {op}" for op, n in sorted(Counter(o for o, _ in ops).items()))


def _alike(job: Job) -> dict[int, int]:
    """Each rank not traced -> the traced rank of its local index taken for it."""
    traced = {tl.rank for tl in job.timelines}
    g = job.gpus_per_node
    alike = {}
    for rank in range(job.world):
        if rank in traced:
            continue
        same = [r for r in sorted(traced) if r % g == rank % g]
        alike[rank] = same[0] if same else min(traced)
    return alike
