"""`flexbench compare` over several node counts or bandwidths: who is first in each cell.

    flexbench compare results/standard --nodes 2 8 64 512 --inter-bw 10Mbit 100Mbit 1Gbit \\
        --inter-lat 1ms --loss-scaling linear-to-critical-batch:512 \\
        --out nodes.csv --out crossover_nodes.png

Given more than one --nodes or --inter-bw, compare replays every run in every (node count x
bandwidth) cell at the one latency (`compare.rank`, the single-network answer, per cell) and
prints a map: the method first to the target, its margin over the runner-up (the runner-up's
time over the first's, paired by seed) and whether the brackets separate the two (clear, tie,
apart on n seeds; with --step-noise decided on the widened brackets). At another node count the
loss curve follows the declared --loss-scaling rule, printed in the map's title and table.
A gossip or Ada method has no loss curve at a node count no recording has: it is left out of
that cell, and the reason is printed beside the map (never a guess).

Per bandwidth, each method against hsdp-adamw: the node count from which it is faster (or
slower), per seed pair (method seed s, hsdp-adamw seed s), between the grid node counts where
the pair changes order, by bisection over whole node counts with both runs replayed there
(`crossings.crossover_nodes`); its median over the pairs that cross, with its bracket.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from experiments import winner_cells
from experiments.io import write_atomic
from experiments.logs import progress
from experiments.replay import compare
from experiments.replay.compare import Question
from experiments.replay.target import ReplayTarget
from experiments.scoring import crossings, intervals, ranking, targets
from netsim.units import parse_bandwidth

__all__ = ["FIGURE_SUFFIXES", "NodeMap", "main", "map_text", "node_map", "plot_node_map"]

FIGURE_SUFFIXES = (".png", ".svg")


@dataclass(frozen=True)
class NodeMap:
    """Who is first in each (node count, bandwidth) cell, where methods overtake, and why not."""

    first: pd.DataFrame
    """`ranking.winners` rows, one per cell, keyed by nodes, inter_bw and inter_bw_bps; plus
    left_out (the methods not timed there, with their reason)."""
    crossovers: pd.DataFrame
    """Per bandwidth and method: the node count from which its order against the baseline holds."""
    latency: str
    rule: str
    """The declared loss rule (--loss-scaling), as the flag spells it."""
    target: float
    target_rule: str
    compute_basis: str
    assumptions: list[str]


def node_map(question: Question, grid: list[ReplayTarget]) -> NodeMap:
    """Every run replayed in every cell of `grid`, the first per cell and the crossovers."""
    given = compare.gather(question, grid[0])
    rows, times, notes = [], [], []
    runs_per_cell = len(given.runs) + sum(c.status != "done" for c in given.candidates)
    with progress(total=len(grid) * runs_per_cell, desc=f"compare map ({len(grid)} cells)",
                  unit="run") as bar:
        for cell in grid:
            left_out: dict[str, str] = {}
            try:
                result = compare.rank(cell, given, left_out=left_out, bar=bar)
            except compare.NothingToRank:
                rows.append(_empty_row(cell, left_out))
                continue
            first = result.first.drop(labels=["network"]).to_dict()
            rows.append({**_cell_keys(cell), **first, "left_out": _left_out_text(left_out)})
            times.append(result.runs.assign(**_cell_keys(cell)))
            notes.append((f"{_nodes_text(cell.nodes)} nodes, {cell.inter_bw}",
                          result.assumptions))
    first = pd.DataFrame(rows, columns=[*_cell_keys(grid[0]), *ranking.WINNER_COLUMNS,
                                        "left_out"])
    runs = pd.concat(times, ignore_index=True) if times else pd.DataFrame()
    return NodeMap(first, _crossovers(grid[0], given, runs), grid[0].inter_lat or "0ms",
                   grid[0].loss_rule.describe(), given.target, given.target_rule,
                   given.basis_text, _cell_notes(notes))


def _cell_notes(notes: list[tuple[str, list[str]]]) -> list[str]:
    """The first cell's assumptions in full, then each other cell's lines not said before."""
    said: set[str] = set()
    lines: list[str] = []
    for i, (cell, mine) in enumerate(notes):
        new = [n for n in mine if n not in said]
        said.update(new)
        if i == 0:
            lines += [f"at {cell}:", *(f"  {n}" for n in new)]
        elif new:
            lines += [f"at {cell}, besides the above:", *(f"  {n}" for n in new)]
    return lines


def _nodes_text(nodes: object) -> str:
    """A cell's node count as printed: the number, or 'own' (each run's recorded count)."""
    missing = nodes is None or (isinstance(nodes, float) and math.isnan(nodes))
    return "own" if missing else str(int(nodes))


def _cell_keys(cell: ReplayTarget) -> dict:
    """A cell's key columns: its node count (None: each run's own) and bandwidth."""
    return {"nodes": cell.nodes, "inter_bw": cell.inter_bw,
            "inter_bw_bps": parse_bandwidth(cell.inter_bw)}


def _empty_row(cell: ReplayTarget, left_out: dict[str, str]) -> dict:
    """A cell where no method can be timed: blank, with every method's reason."""
    return {**_cell_keys(cell), "first": None, "runner_up": None, "verdict": "none",
            "margin_interval": "none", "left_out": _left_out_text(left_out)}


def _left_out_text(left_out: dict[str, str]) -> str:
    """'ada: <reason>; gossip: <reason>', '' when every method was timed."""
    return "; ".join(f"{v}: {why}" for v, why in left_out.items())


def _crossovers(target: ReplayTarget, given: compare.Inputs,
                runs: pd.DataFrame) -> pd.DataFrame:
    """Per bandwidth and method: where it changes order with the baseline between node counts."""
    columns = ["inter_bw", "variant", "faster", "nodes_median", "nodes_low", "nodes_high",
               "interval", "crossing", "pairs"]
    if runs.empty or runs["nodes"].isna().any() or runs["nodes"].nunique() < 2:
        return pd.DataFrame(columns=columns)
    replayed = {str(c.path): (c, r) for c, r in given.runs}
    # The grid's cells already timed every run: a bisection replays only between them.
    memo = {(str(r), str(bw), int(n)): float(t) for r, bw, n, t in
            zip(runs["run"], runs["inter_bw"], runs["nodes"], runs["time_to_target_s"],
                strict=True)}
    rows = []
    for (bw, variant), mine in runs.groupby(["inter_bw", "variant"], sort=False):
        if mine["method"].iloc[0] == targets.BASELINE:
            continue
        base = runs[(runs["inter_bw"] == bw) & (runs["method"] == targets.BASELINE)]
        found, pairs = [], 0
        for seed in sorted(set(mine["seed"]) & set(base["seed"])):
            pairs += 1
            a = mine[mine["seed"] == seed].sort_values("nodes")
            b = base[base["seed"] == seed].sort_values("nodes")
            time_of = [_time_at(target, given, replayed.get(r), bw, memo)
                       for r in (a["run"].iloc[0], b["run"].iloc[0])]
            found += _pair_crossing(list(a["nodes"]), list(a["time_to_target_s"]),
                                    list(b["time_to_target_s"]), *time_of)
        if found:
            span = intervals.median_interval([n for n, _ in found])
            sides = {side for _, side in found}
            rows.append({"inter_bw": bw, "variant": variant,
                         "faster": sides.pop() if len(sides) == 1 else "mixed",
                         "nodes_median": span.median, "nodes_low": span.low,
                         "nodes_high": span.high, "interval": span.kind,
                         "crossing": len(found), "pairs": pairs})
    return pd.DataFrame(rows, columns=columns)


def _pair_crossing(nodes: list[int], mine: list[float], theirs: list[float],
                   mine_at: Callable[[int], float],
                   theirs_at: Callable[[int], float]) -> list[tuple[int, str]]:
    """A seed pair's first swap over the grid's node counts: (node count, side), or none.

    `mine` and `theirs` are the two runs' times at `nodes`; `mine_at` and `theirs_at` give
    them at any node count."""
    for i in range(len(nodes) - 1):
        ends = [mine[i], theirs[i], mine[i + 1], theirs[i + 1]]
        if not np.isfinite(ends).all():
            continue  # a miss at either end: no time to compare
        if (mine[i] < theirs[i]) == (mine[i + 1] < theirs[i + 1]):
            continue
        swap = crossings.crossover_nodes(mine_at, theirs_at, nodes[i], nodes[i + 1])
        side = "above" if mine[i + 1] < theirs[i + 1] else "below"
        return [(swap, side)]
    return []


def _time_at(target: ReplayTarget, given: compare.Inputs, found: tuple | None, bw: str,
             memo: dict[tuple[str, str, int], float]) -> Callable[[int], float]:
    """One run's time to target at any node count on bandwidth `bw` (replayed, memoised)."""
    candidate, run = found if found is not None else (None, None)

    def at(nodes: int) -> float:
        key = (str(candidate.path) if candidate else "", bw, nodes)
        if key not in memo:
            cell = target.at(nodes=nodes, inter_bw=bw)
            memo[key] = compare.score(cell, given, candidate, run,
                                      noise=False).time_to_target_s
        return memo[key]

    return at


def _cell_text(row: pd.Series) -> str:
    """'diloco 1.48× [1.43–2.13] clear', or '-' where no method was timed."""
    if not isinstance(row["first"], str):
        return "-"
    if not isinstance(row["runner_up"], str):
        return f"{row['first']} (alone)"
    return f"{row['first']} {ranking.margin_text(row)} {row['verdict']}"


def _title(result: NodeMap) -> str:
    """What the map shows, with the loss rule it stands on."""
    return (f"first to val_loss <= {result.target:.4f} per (nodes x bandwidth) at "
            f"{result.latency}; runner-up's time / first's, paired by seed; loss at other node "
            f"counts: --loss-scaling {result.rule}")


def map_text(result: NodeMap) -> str:
    """The map as aligned text: node counts down, bandwidths across."""
    first = result.first
    bws = list(dict.fromkeys(first["inter_bw"]))
    texts = {(n, bw): _cell_text(row) for n, bw, (_, row) in
             zip(first["nodes"], first["inter_bw"], first.iterrows(), strict=True)}
    width = max(len(t) for t in texts.values()) + 2
    lines = [f"{'nodes':<8}" + "".join(f"{bw:<{width}}" for bw in bws)]
    for n in dict.fromkeys(first["nodes"]):
        lines.append(f"{_nodes_text(n):<8}" + "".join(f"{texts[n, bw]:<{width}}" for bw in bws))
    return "\n".join(lines)


def _notes(result: NodeMap) -> list[str]:
    """What stands under the map: the legend, then the assumptions of each cell."""
    return [*_legend(result), *result.assumptions]


def _legend(result: NodeMap) -> list[str]:
    """The verdicts' brackets, the methods left out of a cell and why, the crossovers."""
    lines = [f"verdict: clear, tie or apart on n seeds, as `flexbench compare` decides it; the "
             f"time brackets that decided: {_decided(result.first)}"]
    for _, row in result.first[result.first["left_out"] != ""].iterrows():
        lines.append(f"left out at {_nodes_text(row['nodes'])} nodes, {row['inter_bw']}: "
                     f"{row['left_out']}")
    for row in result.crossovers.itertuples():
        span = intervals.Interval(row.nodes_median, row.nodes_low, row.nodes_high,
                                  row.crossing, row.interval)
        where = f"{span.median:g} nodes{span.bracket(lambda v: f'{v:g}')}"
        side = {"below": f"faster below {where}", "above": f"faster from {where} on"}.get(
            row.faster, f"changes order at {where} (the seed pairs disagree on the side)")
        lines.append(f"{row.variant} against {targets.BASELINE} at {row.inter_bw}: {side} "
                     f"({row.crossing}/{row.pairs} seed pairs cross between the grid's node "
                     "counts; per pair the first node count of the new order, by bisection)")
    return lines


def _decided(first: pd.DataFrame) -> str:
    """Which brackets the verdicts were decided on."""
    used = set(first["decided_by"].dropna())
    return ", ".join(sorted(used)) if used else "none (no cell had two methods)"


def plot_node_map(result: NodeMap):
    """The map as a figure: a cell per (bandwidth, node count), coloured by its first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns
    from matplotlib.patches import Patch

    first = result.first.assign(nodes=result.first["nodes"].fillna(0))
    bws = sorted(set(first["inter_bw_bps"]))
    nodes = sorted(set(first["nodes"]))
    names = list(dict.fromkeys([*first["first"].dropna(), *first["runner_up"].dropna()]))
    palette = dict(zip(names, sns.color_palette("tab10", max(len(names), 1)), strict=False))
    fig, ax = plt.subplots(figsize=(2.4 * max(len(bws), 2) + 2.8,
                                    1.1 * max(len(nodes), 2) + 1.6))
    winner_cells.draw_cells(ax, first, ("inter_bw_bps", bws), ("nodes", nodes), palette)
    ax.set(xlabel=f"inter-node bandwidth (latency {result.latency})", ylabel="nodes")
    ax.set_xticks([i + 0.5 for i in range(len(bws))],
                  [first.loc[first["inter_bw_bps"] == b, "inter_bw"].iloc[0] for b in bws])
    ax.set_yticks([i + 0.5 for i in range(len(nodes))],
                  [str(int(n)) if n else "own" for n in nodes])
    handles = [Patch(facecolor=palette[v], alpha=0.55, label=v)
               for v in dict.fromkeys(first["first"].dropna())]
    handles.append(Patch(facecolor="white", hatch="//", edgecolor="grey", label="tie"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    below = [*_legend(result), result.compute_basis,
             "every assumption per cell: the command's printout and its --out .json"]
    fig.text(0.01, -0.02, "\n".join(below), ha="left", va="top", fontsize=6.5, wrap=True)
    fig.suptitle(_title(result), fontsize=8.5)
    fig.tight_layout()
    return fig


def _record(result: NodeMap) -> dict:
    """The map as JSON: title, rule, target, basis, cells, crossovers, notes."""
    rows = compare.json_rows
    return {"title": _title(result), "latency": result.latency, "loss_scaling": result.rule,
            "target_val_loss": result.target, "target_rule": result.target_rule,
            "compute_basis": result.compute_basis, "cells": rows(result.first),
            "crossovers": rows(result.crossovers), "notes": _notes(result)}


def main(question: Question, grid: list[ReplayTarget], outs: list[Path]) -> int:
    """Print (and write to `outs`) the map over `grid`'s cells."""
    result = node_map(question, grid)
    print(_title(result) + ":")
    print(result.compute_basis)
    print(map_text(result))
    for line in _notes(result):
        print(f"  {line}")
    for out in outs:
        if out.suffix == ".csv":
            write_atomic(out, result.first.assign(loss_scaling=result.rule,
                                                  latency=result.latency,
                                                  compute_basis=result.compute_basis)
                         .to_csv(index=False))
        elif out.suffix == ".json":
            write_atomic(out, json.dumps(_record(result), indent=2) + "\n")
        else:
            import matplotlib.pyplot as plt

            fig = plot_node_map(result)
            buf = io.BytesIO()
            fig.savefig(buf, format=out.suffix[1:], dpi=130, bbox_inches="tight")
            plt.close(fig)
            write_atomic(out, buf.getvalue())
        print(f"-> {out}")
    return 0
