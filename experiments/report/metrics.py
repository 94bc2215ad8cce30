"""A sweep's tables in Markdown: time to target and speed-up per method and network, the
winners, the validation against shaped runs, the bytes per step; and the Pareto front.

The statistics behind them (time to target, intervals, speed-ups, rankings) are
`experiments.scoring`'s.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import pandas as pd

from experiments.scoring import intervals, ranking, step_noise
from experiments.scoring.formats import (
    format_seconds,
    format_speedup_interval,
    format_time_interval,
    markdown_table,
)
from experiments.scoring.speedups import speedups
from flexdemo.methods import BASELINE

__all__ = ["COMPUTE_BASIS", "EMULATED_NOTE", "VALIDATION_BASIS", "VALIDATION_NOTE",
           "pareto_front", "pivot", "summary_markdown", "target_text",
           "validation_table", "winners_markdown"]


def pareto_front(costs: Iterable[float], losses: Iterable[float]) -> list[bool]:
    """Which points no other point beats on both cost and loss (lower is better for both)."""
    c = np.asarray(list(costs), dtype=float)
    v = np.asarray(list(losses), dtype=float)
    front = []
    for i in range(c.size):
        dominated = np.any((c <= c[i]) & (v <= v[i]) & ((c < c[i]) | (v < v[i])))
        front.append(bool(np.isfinite(v[i]) and not dominated))
    return front


# What every simulated time of a sweep stands on, printed beside each of its tables.
COMPUTE_BASIS = ("Compute basis: each unit's own recorded compute (the machine's load while it "
                 "trained included); `flexbench report SWEEP --same-compute method|all` replays "
                 "every method on one basis.")

# Above the validation table when the headline tables replay another compute basis.
VALIDATION_BASIS = ("Compute basis of this table: each unit's own recorded compute, whatever "
                    "the basis above: it checks the model against the shaped runs, which ran on "
                    "their own compute.")

# Printed under a sweep's validation table: what its two ratios can and cannot tell apart.
VALIDATION_NOTE = (
    "Each shaped run was made minutes after its recording, unpinned, on the same machine: "
    "\"simulated / measured\" replays the recording's compute, so a compute drift between the "
    "two runs enters it with any model error; \"own compute\" replays the shaped run with its "
    "own compute and the links modeled (the network model alone, as `flexbench validate-sim`'s "
    "network_error_pct).")
def pivot(
    table: pd.DataFrame, value: str, *, rows: str = "variant", cols: str = "network"
) -> pd.DataFrame:
    """A rows x cols table of `value`, keeping the order in which rows and columns first appear."""
    row_order = list(dict.fromkeys(table[rows]))
    col_order = list(dict.fromkeys(table[cols]))
    wide = table.pivot_table(index=rows, columns=cols, values=value, aggfunc="first", dropna=False)
    return wide.reindex(index=row_order, columns=col_order)
EMULATED_NOTE = ("Emulated units (`[emulate] nodes`, the variants ending `nodes=N`): N replicas "
                 "trained in one process (`flexbench run --emulate`), each timed by its recorded "
                 "unit's trace replayed at N nodes with the emulated loss curve on that time "
                 "axis; they measure no bytes (\"-\" below), and each node count is scored "
                 "against the baseline emulated there.")


def summary_markdown(runs: pd.DataFrame, *, basis: str = COMPUTE_BASIS,
                     recorded: pd.DataFrame | None = None) -> str:
    """The sweep's headline tables in Markdown: time-to-target and speed-up, validation, bytes.

    `basis` is the "Compute basis:" line beside each time-to-target table; `recorded` (when
    `runs` were replayed on another basis: `same_compute`) the sweep's own rows, which the
    validation table compares with the shaped runs.
    """
    if runs.empty:
        return "No runs yet.\n"
    parts: list[str] = []
    target = target_text(runs)
    sim = runs[(runs["source"] == "sim") & runs.get("on_grid", True)]
    if not sim.empty:
        parts.extend(_time_to_target_section(sim, target, basis))
    if "emulated" in runs.columns and runs["emulated"].eq(True).any():
        parts.append(EMULATED_NOTE + "\n")
    measured = runs[runs["source"] == "measured"]
    if not measured.empty:
        parts.append("### Cost model vs wall-shaped real runs\n")
        if recorded is not None:  # a model check: the shaped runs ran on their own compute
            parts.append(VALIDATION_BASIS + "\n")
        shown = runs if recorded is None else recorded
        parts.append(markdown_table(validation_table(shown), index_name="run") + "\n")
        parts.append(VALIDATION_NOTE + "\n")
    per_variant = runs.drop_duplicates(subset=["variant", "seed"]).groupby(
        "variant", sort=False
    )[["inter_bytes_per_step", "inter_calls_per_step", "intra_bytes_per_step"]].median()
    per_variant = per_variant.map(lambda v: "-" if pd.isna(v) else f"{v:,.0f}" if v >= 10
                                  else f"{v:.2g}")
    per_variant.columns = ["inter-node bytes/step (per node)", "inter-node calls/step",
                           "intra-node bytes/step (per node)"]
    parts.append("### Communication per step\n")
    parts.append(markdown_table(per_variant, index_name="method") + "\n")
    bad = runs[runs["status"] != "done"].drop_duplicates(subset=["unit", "status"])
    if not bad.empty:
        parts.append("### Units without results\n")
        parts.extend(f"- `{u}`: {s}{f' ({e})' if isinstance(e, str) else ''}"
                     for u, s, e in zip(bad["unit"], bad["status"], bad["error"], strict=True))
        parts.append("")
    return "\n".join(parts)


def winners_markdown(table: pd.DataFrame, *, key: str = "network") -> str:
    """The winners table in Markdown: first, its time, runner-up, margin, verdict."""
    shown = pd.DataFrame({
        "first": table["first"],
        "its time to target": table["first_ttt_s"].map(format_seconds),
        "runner-up": table["runner_up"].fillna("-"),
        "runner-up's time / first's": [ranking.margin_text(row) for _, row in table.iterrows()],
        "verdict": table["verdict"],
    })
    shown.index = table[key]
    note = ("verdict: clear (bootstrap brackets apart and the margin's excludes 1), tie (they "
            "overlap, or the margin's includes 1), or apart on 2 seeds (ranges apart: too few "
            "seeds for an interval)")
    if "decided_by" in table and (table["decided_by"] == ranking.WITH_STEP_NOISE).any():
        note += ("; the time brackets that decided are over seeds widened by each run's "
                 "recorded step-time variation (--step-noise), the margin's over seeds")
    return markdown_table(shown, index_name=key) + "\n\n" + note


def target_text(runs: pd.DataFrame) -> str:
    """'2.6500', or one target per baseline cluster ('2.7000 (4x1), 2.6500 (8x1)')."""
    target = runs["target_val_loss"].dropna()
    if target.empty:
        return "undetermined"
    if "baseline_cluster" not in runs.columns or target.nunique() == 1:
        return f"{target.iloc[0]:.4f}"
    per = runs.dropna(subset=["target_val_loss", "baseline_cluster"]).drop_duplicates(
        "baseline_cluster")
    return ", ".join(f"{t:.4f} ({c})" for c, t in zip(per["baseline_cluster"],
                                                      per["target_val_loss"], strict=True))


def _time_to_target_section(sim: pd.DataFrame, target: str, basis: str) -> list[str]:
    """The headline table (time to target and speed-up with brackets) and who is first where."""
    table = speedups(sim, by=("network",))
    table["cell"] = [_cell(row) for row in table.itertuples()]
    kinds = set(table["ttt_interval"]) | set(table["speedup_interval"])
    cohorts, key = _by_cohort(sim)
    first = ranking.winners(cohorts, by=key)
    return [
        f"### Time to target val_loss {target} (simulated; median over seeds [bracket] · "
        f"speed-up vs {BASELINE}, paired by seed, median [bracket])\n",
        f"{intervals.interval_note(kinds)} \"no clear winner\": the speed-up's bracket "
        "includes 1.\n",
        *([step_noise.note() + "\n"] if intervals.SAMPLES_COLUMN in sim else []),
        basis + "\n",
        markdown_table(pivot(table, "cell"), index_name="method") + "\n",
        "### First to the target at each network point\n",
        basis + "\n",
        winners_markdown(first, key=first.columns[0]) + "\n",
    ]


def _by_cohort(sim: pd.DataFrame) -> tuple[pd.DataFrame, tuple[str, ...]]:
    """The runs and the key the winners are found over: the network point, and the baseline
    cluster when units are scored against several (different targets never share a ranking)."""
    cohorts = sim["baseline_cluster"].dropna().unique() if "baseline_cluster" in sim else []
    if len(cohorts) < 2:
        return sim, ("network",)
    label = sim["network"] + " · " + sim["baseline_cluster"].fillna("no baseline") + " cluster"
    return sim.assign(**{"network · cluster": label}), ("network · cluster",)


def _cell(row) -> str:
    """'12.3 s [11.0–13.5] · 2.10× [1.9–2.3]'; 'not reached' when the median run never gets there.

    When only some seeds reach the target, '(k/n seeds)' says so: a median over two seeds is
    infinite as soon as one of them misses. A speed-up whose bracket includes 1 is marked
    'no clear winner' (never on the baseline's own row).
    """
    count = "" if row.reached == row.seeds else f" ({row.reached}/{row.seeds} seeds)"
    if math.isinf(row.ttt_median_s):
        return format_seconds(row.ttt_median_s) + count
    span = intervals.Interval(row.ttt_median_s, row.ttt_low_s, row.ttt_high_s, row.seeds,
                              row.ttt_interval)
    speed = intervals.Interval(row.speedup_median, row.speedup_low, row.speedup_high,
                               row.seeds, row.speedup_interval)
    unclear = row.method != BASELINE and speed.includes(1.0) and not math.isnan(speed.median)
    return (f"{format_time_interval(span)} · {format_speedup_interval(speed)}{count}"
            f"{' · no clear winner' if unclear else ''}")
def _ratio(top: float, bottom: float) -> str:
    """'0.97', or '-' where either side is missing."""
    if any(v is None or math.isnan(v) for v in (top, bottom)) or not bottom:
        return "-"
    return f"{top / bottom:.2f}"


def _own_cells(m: pd.Series) -> dict[str, str]:
    """The own-compute columns of one measured row (none when it was not replayed)."""
    if "own_compute_final_s" not in m or math.isnan(m["own_compute_final_s"]):
        return {}
    rec, shaped = m["recording_compute_s"], m["shaped_compute_s"]
    drift = "-" if math.isnan(rec) or math.isnan(shaped) else \
        f"{rec * 1e3:.0f} → {shaped * 1e3:.0f} ms"
    return {"compute/step: recording → shaped run": drift,
            "own compute, simulated total": format_seconds(m["own_compute_final_s"]),
            "own compute: simulated / measured": _ratio(m["own_compute_final_s"],
                                                        m["final_time_s"])}


def validation_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Measured (wall-shaped) runs next to the simulation of the same run at the same point.

    "simulated / measured" replays the recording's compute; the own-compute columns (when
    `own_compute` filled them) replay the shaped run's own and show both runs' compute per step.
    """
    keys = ["variant", "seed", "network"]
    measured = runs[runs["source"] == "measured"].set_index(keys)
    sim = runs[runs["source"] == "sim"].set_index(keys)
    rows = []
    for key, m in measured.iterrows():
        s = sim.loc[key] if key in sim.index else None
        if isinstance(s, pd.DataFrame):
            s = s.iloc[0]
        sim_final = math.nan if s is None else s["final_time_s"]
        rows.append({
            "run": f"{key[0]} seed {key[1]} @ {key[2]}",
            "measured time to target": format_seconds(m["time_to_target_s"]),
            "simulated time to target": format_seconds(
                math.nan if s is None else s["time_to_target_s"]),
            "measured total": format_seconds(m["final_time_s"]),
            "simulated total": format_seconds(sim_final),
            "simulated / measured": _ratio(sim_final, m["final_time_s"]),
            **_own_cells(m),
        })
    return pd.DataFrame(rows).set_index("run") if rows else pd.DataFrame()
