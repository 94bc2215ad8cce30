"""Where methods trade places: who is first in each (bandwidth, latency) cell of a sweep, and the
bandwidth at which each method overtakes hsdp-adamw.

    flexbench report results/quick   # -> figures/crossover_map.{png,svg}, a table in summary.md

The map colours each grid cell by the method first to the target (`ranking.winners`), writes
the margin over the runner-up, and hatches the cells where the brackets do not separate the
two. The crossover bandwidth is found per seed pair (method seed s against baseline seed s):
between the two grid bandwidths where their times change order, the two units are replayed at
extra bandwidths with `flexbench simulate`'s replay (`experiments.replay.simulate`) and the
point where log(t_method / t_baseline) = 0 is found by regula falsi (Illinois) on log bandwidth,
to `RTOL` (`experiments.scoring.crossings`). Its bracket over seed pairs is
`intervals.median_interval`'s (the range at 2 seeds).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pandas as pd

from experiments import winner_cells
from experiments.logs import progress
from experiments.report import metrics
from experiments.scoring import formats, intervals, ranking, targets
from experiments.scoring.crossings import RTOL, Crossing, TimeAt, crossings

__all__ = ["crossover_markdown", "crossover_table", "plot_crossover_map"]


def crossover_table(res: Any, unit_time: Callable[[str, str, float], TimeAt],
                    ) -> pd.DataFrame:  # res: figures.Results (it imports this)
    """Per variant and grid latency: the bandwidth where it overtakes the baseline, over seeds.

    `unit_time(unit, latency, target)` replays a unit between grid points (at its recorded
    compute: `experiments.replay.on_basis.recorded_unit_time`; on a --same-compute basis:
    `OnBasis.unit_time`).

    One row per (variant, latency) with a crossing on any seed pair: `faster` (below, above, or
    mixed when seed pairs disagree), the median crossover (bytes/s) with its bracket over the
    seed pairs that cross, and how many of the paired seeds cross inside the grid. Pairs whose
    units cannot be replayed are listed in `table.attrs["skipped"]`.
    """
    sim = res.runs[(res.runs["source"] == "sim") & res.runs["on_grid"]
                   & (res.runs["kind"] == "train")]
    rows: list[dict] = []
    skipped: list[str] = []
    groups = sim.groupby(["variant", "inter_lat"], sort=False)
    for (variant, lat), here in progress(groups, total=groups.ngroups,
                                         desc="report: crossovers", unit="variant"):
        if here["method"].iloc[0] == targets.BASELINE:
            continue
        base = _baseline_of(sim, here)
        base = base[base["inter_lat"] == lat]
        found: list[Crossing] = []
        seeds = sorted(set(here["seed"]) & set(base["seed"]))
        for seed in seeds:
            try:
                found += _seed_crossings(res, here[here["seed"] == seed],
                                         base[base["seed"] == seed], unit_time)
            except ValueError as err:  # a unit the model cannot replay: said, not guessed
                skipped.append(f"{variant} seed {seed} at {lat}: {err}")
        if found:
            rows.append(_row(variant, lat, found, len(seeds)))
    table = pd.DataFrame(rows, columns=["variant", "inter_lat", "faster", "crossover_bps",
                                        "low_bps", "high_bps", "interval", "crossing", "pairs"])
    table.attrs["skipped"] = skipped
    return table


def _baseline_of(sim: pd.DataFrame, here: pd.DataFrame) -> pd.DataFrame:
    """The baseline runs `here` is scored against: those of its baseline cluster, if named."""
    base = sim[sim["method"] == targets.BASELINE]
    if "baseline_cluster" not in sim.columns:
        return base
    return base[base["cluster"].isin(set(here["baseline_cluster"].dropna()))]


def _seed_crossings(res: Any, mine: pd.DataFrame, theirs: pd.DataFrame,
                    unit_time: Callable[[str, str, float], TimeAt]) -> list[Crossing]:
    """The first crossing of one seed pair at one latency (none when they never swap)."""
    mine, theirs = mine.sort_values("inter_bw_bps"), theirs.sort_values("inter_bw_bps")
    if list(mine["inter_bw_bps"]) != list(theirs["inter_bw_bps"]) or len(mine) < 2:
        return []
    target = float(mine["target_val_loss"].iloc[0])
    if math.isnan(target) or (mine["status"] != "done").any() or (theirs["status"] != "done").any():
        return []
    lat = str(mine["inter_lat"].iloc[0])
    times = [unit_time(str(u), lat, target)
             for u in (mine["unit"].iloc[0], theirs["unit"].iloc[0])]
    found = crossings(list(mine["inter_bw_bps"]), *times,
                      known=(list(mine["time_to_target_s"]), list(theirs["time_to_target_s"])))
    return found[:1]


def _row(variant: str, lat: str, found: list[Crossing], pairs: int) -> dict:
    """A crossover_table row from the crossings of the seed pairs that cross."""
    sides = {c.faster for c in found}
    span = intervals.median_interval([c.bandwidth for c in found])
    return {"variant": variant, "inter_lat": lat,
            "faster": sides.pop() if len(sides) == 1 else "mixed",
            "crossover_bps": span.median, "low_bps": span.low, "high_bps": span.high,
            "interval": span.kind, "crossing": len(found), "pairs": pairs}


def _bits(bytes_per_s: float) -> str:
    """A bandwidth in bytes/s as bit/s text with three significant digits."""
    from netsim.units import format_bandwidth

    if not math.isfinite(bytes_per_s):
        return "-"
    return format_bandwidth(float(f"{bytes_per_s * 8:.3g}") / 8)


def _crossover_text(row) -> str:
    """'699Mbit [363Mbit–1.04Gbit]': a crossover_table row's bandwidth and its bracket."""
    span = intervals.Interval(row.crossover_bps, row.low_bps, row.high_bps, row.crossing,
                              row.interval)
    return _bits(span.median) + span.bracket(_bits)


def crossover_markdown(table: pd.DataFrame) -> str:
    """The crossover table in Markdown, or a sentence when no method swaps places in the grid."""
    skipped = "".join(f"\n- not replayed: {s}" for s in table.attrs.get("skipped", []))
    if table.empty:
        return (f"No method changes places with {targets.BASELINE} between the grid's "
                f"bandwidths.{skipped}")
    shown = pd.DataFrame({
        "latency": table["inter_lat"],
        f"faster than {targets.BASELINE}": [f"{side} the crossover" for side in table["faster"]],
        "crossover bandwidth": [_crossover_text(row) for row in table.itertuples()],
        "seed pairs crossing in the grid": [f"{c}/{p}" for c, p in
                                            zip(table["crossing"], table["pairs"], strict=True)],
    })
    shown.index = table["variant"]
    note = (f"Per seed pair (method seed s, {targets.BASELINE} seed s): both units replayed "
            f"between the grid points where they change order, the crossover found to "
            f"{RTOL:.1%} in bandwidth; a pair that does not cross keeps its order across the "
            f"whole grid. {intervals.interval_note(set(table['interval']))}")
    return formats.markdown_table(shown, index_name="method") + "\n\n" + note + skipped


def plot_crossover_map(res: Any, table: pd.DataFrame | None = None):
    """Who is first in each bandwidth x latency cell (hatched: a tie), with the crossovers.

    One panel per baseline cluster when the sweep scores against several (each its own target).
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    sim = res.runs[(res.runs["source"] == "sim") & res.runs["on_grid"]]
    cohorts = (list(dict.fromkeys(sim["baseline_cluster"].dropna()))
               if "baseline_cluster" in sim.columns else [])
    panels = [(c, sim[sim["baseline_cluster"] == c]) for c in cohorts] if len(cohorts) > 1 \
        else [(None, sim)]
    bws = sorted(set(sim["inter_bw_bps"]))
    lats = sorted(set(sim["inter_lat_s"]))
    width, height = 2.4 * max(len(bws), 2) + 0.8, 1.1 * max(len(lats), 2) + 1.2
    fig, axes = plt.subplots(1, len(panels), figsize=(width * len(panels) + 2.0, height),
                             squeeze=False)
    palette = res.palette()
    shown: dict[str, None] = {}
    for ax, (cohort, runs) in zip(axes[0], panels, strict=True):
        first = ranking.winners(runs, by=("inter_bw_bps", "inter_lat_s"))
        _draw_cells(ax, first, bws, lats, palette)
        shown.update(dict.fromkeys(first["first"]))
        if cohort is not None:
            ax.set_title(f"{cohort} cluster (its own target)", fontsize=9)
    handles = [Patch(facecolor=palette[v], alpha=0.55, label=v) for v in shown]
    handles.append(Patch(facecolor="white", hatch="//", edgecolor="grey", label="tie"))
    axes[0][-1].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    if table is not None and len(table):
        lines = [f"{row.variant} against {targets.BASELINE} at {row.inter_lat}: faster "
                 f"{row.faster} {_crossover_text(row)}"
                 f" ({row.crossing}/{row.pairs} seed pairs cross in the grid)"
                 for row in table.itertuples()]
        fig.text(0.01, -0.02, "\n".join(lines), ha="left", va="top", fontsize=7)
    widened = ("; ties decided on brackets widened by step-time variation"
               if intervals.SAMPLES_COLUMN in sim else "")
    title = (f"{res.name}: first to val_loss {metrics.target_text(res.runs)} per cell "
             f"(runner-up's time / first's; hatched: a tie{widened})")
    fig.suptitle(res.titled(title) if hasattr(res, "titled") else title, fontsize=9)
    fig.tight_layout()
    return fig


def _draw_cells(ax, first: pd.DataFrame, bws: list[float], lats: list[float],
                palette: dict) -> None:
    """One panel of the map: a coloured cell per (bandwidth, latency) with its winner's text."""
    winner_cells.draw_cells(ax, first, ("inter_bw_bps", bws), ("inter_lat_s", lats), palette)
    ax.set(xlabel="inter-node bandwidth", ylabel="inter-node latency")
    ax.set_xticks([i + 0.5 for i in range(len(bws))], [_bits(b) for b in bws])
    ax.set_yticks([i + 0.5 for i in range(len(lats))], [f"{v * 1e3:g}ms" for v in lats])
