"""Which ranks each collective ran on, where the trace does not say (gloo writes no group).

A collective read from a `c10d::` op names its kind, sizes and type but not its group. Its
group is one the rank belongs to (distributedInfo's pg_config; a trace without one: all ranks):
the one whose size fits the op (an all-gather's output is its input x the group size; a
reduce-scatter's the reverse), and where several fit, the one on whose every other traced rank
an op of the same kind, size and type ran at the same time (the ranks' clocks are taken to
agree within a collective's duration, as on one host or NTP-synchronised hosts). In a trace
that names no group, an all-gather or reduce-scatter whose sizes do not fit all ranks ran on
one of the groups of a (nodes x GPUs per node) device mesh, as `init_device_mesh` lays HSDP
out: the rank's node (FSDP2's shard group) or the ranks of its local index on every node (the
replicate group), whichever fits. A collective that fits none, or several alike, is refused in
one sentence.
"""

from __future__ import annotations

import bisect

from experiments.errors import ConfigError
from experiments.traces.timeline import Collective, RankTimeline

__all__ = ["assign_groups"]


def _fits(c: Collective, size: int) -> bool:
    if c.out_elements is None:
        return True
    if c.op == "all_gather":
        return c.out_elements == c.elements * size
    if c.op == "reduce_scatter":
        return c.elements == c.out_elements * size
    return True


class _Index:
    """Each rank's collectives by (op, elements, dtype), sorted by start, for overlap queries."""

    def __init__(self, timelines: list[RankTimeline]) -> None:
        self.by_rank: dict[int, dict[tuple, list[Collective]]] = {}
        for tl in timelines:
            table: dict[tuple, list[Collective]] = {}
            for c in tl.collectives:
                table.setdefault((c.op, c.elements, c.dtype), []).append(c)
            for ops in table.values():
                ops.sort(key=lambda c: c.start)
            self.by_rank[tl.rank] = table

    def ran_with(self, c: Collective, rank: int, group: tuple[int, ...]) -> bool:
        """Whether `rank` ran an op like `c` (not on another known group) overlapping it."""
        ops = self.by_rank.get(rank, {}).get((c.op, c.elements, c.dtype), [])
        at = bisect.bisect_right([o.start for o in ops], c.end + 1e-6)
        return any(o.end >= c.start - 1e-6 and o.ranks in (None, group) for o in ops[:at])


def assign_groups(timelines: list[RankTimeline], world: int,
                  gpus_per_node: int | None = None) -> list[str]:
    """Fill every collective's ranks and size; the sentences saying what was inferred."""
    index = _Index(timelines)
    traced = {tl.rank for tl in timelines}
    inferred = on_mesh = 0
    for tl in timelines:
        named = [g for g in tl.source.groups if tl.rank in g]
        mine = named or [tuple(range(world))]
        mesh = [] if named or not gpus_per_node else _mesh_groups(tl.rank, world, gpus_per_node)
        for c in tl.collectives:
            if c.ranks is None:
                c.ranks = _on_mesh(c, mesh, world) or _group_of(tl, c, mine, index, traced)
                c.inferred |= {"ranks", "group size"}
                inferred += 1
                on_mesh += c.ranks in mesh
            c.size = c.size or len(c.ranks)
            c.description = tl.source.descriptions.get(c.ranks, "")
    return _said(timelines, world, gpus_per_node, inferred, on_mesh)


def _said(timelines: list[RankTimeline], world: int, gpus_per_node: int | None, inferred: int,
          on_mesh: int) -> list[str]:
    """The sentences saying how many groups were inferred, and how."""
    if not inferred:
        return []
    how = ("its process groups (distributedInfo)" if any(tl.source.groups for tl in timelines)
           else f"all {world} ranks (the traces name no process groups)")
    said = [f"ranks and group size of {inferred} collectives (c10d ops, which name no group): "
            f"from {how}, matched by size and by the same op running on the group's other "
            "traced ranks at the same time"]
    if on_mesh:
        said.append(f"of those, {on_mesh} all-gathers or reduce-scatters sized for fewer ranks: "
                    f"on the rank's node ({gpus_per_node} ranks) or its local index on every "
                    f"node ({world // gpus_per_node} ranks), whichever their sizes fit, as a "
                    "(nodes x GPUs per node) device mesh lays HSDP out")
    return said


def _on_mesh(c: Collective, mesh: list[tuple[int, ...]], world: int) -> tuple[int, ...] | None:
    """The one device-mesh group an op sized for fewer ranks than the world fits (None: the
    world fits it, or none or several of the mesh's do)."""
    if _fits(c, world):
        return None
    sized = [g for g in mesh if _fits(c, len(g))]
    return sized[0] if len(sized) == 1 else None


def _mesh_groups(rank: int, world: int, per_node: int) -> list[tuple[int, ...]]:
    """The rank's groups on a (nodes x per_node) device mesh: its node's ranks and the ranks of
    its local index on every node (those of one rank, or all ranks, left out)."""
    first = rank - rank % per_node
    groups = [tuple(range(first, first + per_node)), tuple(range(rank % per_node, world, per_node))]
    return [g for g in groups if 1 < len(g) < world]


def _group_of(tl: RankTimeline, c: Collective, mine: list, index: _Index,
              traced: set) -> tuple[int, ...]:
    """The one group of the rank's that `c` ran on (ConfigError where none or several fit)."""
    fits = [g for g in mine if _fits(c, len(g))]
    if len(fits) > 1:
        fits = [g for g in fits
                if all(index.ran_with(c, r, g) for r in g if r != tl.rank and r in traced)]
    if len(fits) != 1:
        raise ConfigError(_unplaced(tl, c, mine, fits))
    return fits[0]


def _unplaced(tl: RankTimeline, c: Collective, groups: list, fits: list) -> str:
    what = (f"rank {tl.rank}'s {c.op} of {c.elements} {c.dtype} elements in ProfilerStep#"
            f"{tl.steps[c.step][0]}")
    if not fits:
        named = (f"none of its process groups {[list(g) for g in groups]}" if tl.source.groups
                 else f"the group of all {len(groups[0])} ranks (the trace names no process "
                      "groups), its output being another multiple of its input")
        return (f"{str(tl.source.path)!r}: {what} fits {named}; profile with a backend that "
                "writes record_param_comms (nccl in torch 2.1 or later).")
    return (f"{str(tl.source.path)!r}: {what} could have run on any of "
            f"{[list(g) for g in fits]}, and the trace names no group; profile with a backend "
            "that writes record_param_comms (nccl), or trace every rank of those groups.")
