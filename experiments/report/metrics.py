"""Time-to-target-loss, speed-ups against full-sync HSDP-AdamW, and method x network tables.

The scoring follows AlgoPerf: a run's time-to-target is the first *evaluation* whose validation
loss is at or below the target (timing excludes evaluation itself); a run that never gets there
scores infinity and stays in every table as "not reached". Speed-ups are paired ratios, the
baseline's time over the method's seed by seed at the same network point (every pair where the
seeds differ), summarised by their median with a bracket (`intervals`: a bootstrap interval
from 3 seeds, the range at 2) and their min and max.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd

from experiments.replay import step_noise
from experiments.report import intervals, ranking
from flexdemo.methods import BASELINE

TARGET_MARGIN = 0.02

# What `speedups` adds to its key columns, per variant and network point.
SPEEDUP_COLUMNS = ["ttt_median_s", "ttt_min_s", "ttt_max_s", "ttt_low_s", "ttt_high_s",
                   "ttt_interval", "reached", "seeds", "baseline_ttt_s", "speedup_median",
                   "speedup_min", "speedup_max", "speedup_low", "speedup_high",
                   "speedup_interval", "paired"]

__all__ = [
    "BASELINE",
    "COMPUTE_BASIS",
    "SPEEDUP_COLUMNS",
    "TARGET_MARGIN",
    "VALIDATION_BASIS",
    "VALIDATION_NOTE",
    "baseline_target_at",
    "pareto_front",
    "default_target",
    "format_seconds",
    "format_speedup",
    "format_speedup_interval",
    "format_time_interval",
    "markdown_table",
    "pivot",
    "speedups",
    "summary_markdown",
    "SWEEP_SPEEDUP_KEYS",
    "sweep_speedups",
    "target_text",
    "validation_table",
    "winners_markdown",
    "time_to_target",
]


def time_to_target(times: Iterable[float], val_losses: Iterable[float], target: float) -> float:
    """First time at which an evaluated val_loss is <= target; inf if it never is."""
    if not isinstance(target, (int, float)) or math.isnan(target):
        raise ValueError(f"target must be a number, got {target!r}.")
    t = np.asarray(list(times), dtype=float)
    v = np.asarray(list(val_losses), dtype=float)
    if t.shape != v.shape:
        raise ValueError(f"times and val_losses differ in length ({t.size} vs {v.size}).")
    # NaN marks steps without an evaluation; those can never count as reaching the target.
    hit = np.flatnonzero(~np.isnan(v) & (v <= target))
    return float(t[hit[0]]) if hit.size else math.inf


def default_target(
    final_losses: pd.DataFrame, *, baseline: str = BASELINE, margin: float = TARGET_MARGIN
) -> float:
    """The baseline's median final val_loss over seeds, plus `margin` (2% by default).

    `final_losses` has columns `method` and `final_val_loss` (one row per baseline seed).
    """
    base = final_losses.loc[final_losses["method"] == baseline, "final_val_loss"].dropna()
    if base.empty:
        raise ValueError(
            f"no finished {baseline!r} run to derive the target from; "
            "set [target] val_loss in the sweep config or include it in grid.methods."
        )
    return float(base.median()) * (1.0 + margin)


def baseline_target_at(curves: list[pd.DataFrame], fraction: float) -> float:
    """The baseline's val_loss at the first evaluation at or after `fraction` of its steps.

    Median over the baseline's runs (one `steps.parquet` frame each). A target set this way is
    reached by the baseline no earlier than that fraction of its budget, whatever the workload.
    """
    values = []
    for steps in curves:
        evals = steps.dropna(subset=["val_loss"]).sort_values("step")
        if evals.empty:
            continue
        at = evals[evals["step"] >= fraction * steps["step"].max()]
        values.append(float(at["val_loss"].iloc[0]))
    if not values:
        raise ValueError(
            f"no finished {BASELINE!r} run to derive the target from; "
            "set [target] val_loss in the sweep config or include it in grid.methods."
        )
    return float(np.median(values))


def pareto_front(costs: Iterable[float], losses: Iterable[float]) -> list[bool]:
    """Which points no other point beats on both cost and loss (lower is better for both)."""
    c = np.asarray(list(costs), dtype=float)
    v = np.asarray(list(losses), dtype=float)
    front = []
    for i in range(c.size):
        dominated = np.any((c <= c[i]) & (v <= v[i]) & ((c < c[i]) | (v < v[i])))
        front.append(bool(np.isfinite(v[i]) and not dominated))
    return front


def speedups(
    runs: pd.DataFrame,
    *,
    baseline: str = BASELINE,
    by: Sequence[str] = ("source", "network"),
    variant: str = "variant",
    cohort: str = "baseline_cluster",
) -> pd.DataFrame:
    """Per variant and network point: time to target and speed-up over seeds, with intervals.

    `runs` needs `method`, `variant`, `seed`, `time_to_target_s`, `reached` and the `by`
    columns. When it has a `cohort` column (the sweep's `baseline_cluster`), each run is
    compared with the baseline runs of the cohort it names, e.g. hsdp-adamw on the same number
    of nodes. The speed-up is the paired ratio baseline time / run time of the same seed, or
    over every (baseline seed, run seed) pair where the seeds differ (`intervals.ratio_interval`;
    `paired` says which): a run that never reaches the target has speed-up 0; when the baseline
    never does, a run that does gets inf; when neither does (or there is no baseline), NaN.
    Columns: ttt_median_s, ttt_min_s, ttt_max_s and the bracket ttt_low_s..ttt_high_s of kind
    ttt_interval (widened by each run's resampled step times where `runs` has
    `intervals.SAMPLES_COLUMN`: --step-noise); speedup_median, speedup_min, speedup_max (over
    the pairs) and speedup_low..speedup_high of kind speedup_interval
    (`intervals.Interval.kind`); baseline_ttt_s is the baseline's median.
    """
    keys = list(by)
    join = [*keys, cohort] if cohort in runs.columns else keys
    base_rows = runs[runs["method"] == baseline]
    base_times = {_key(k): dict(zip(g["seed"], g["time_to_target_s"].astype(float), strict=True))
                  for k, g in base_rows.groupby(join, dropna=False, sort=False)}
    rows = []
    for group, g in runs.groupby([*keys, variant, "method"], dropna=False, sort=False):
        times = g["time_to_target_s"].astype(float)
        ttt = intervals.time_interval(g)
        base = base_times.get(_key(tuple(g.iloc[0][c] for c in join)), {})
        speed, paired = intervals.ratio_interval(base, dict(zip(g["seed"], times, strict=True)))
        pair_ratios = _pair_ratios(base, g["seed"], times, paired)
        rows.append({
            **dict(zip([*keys, variant, "method"], group, strict=True)),
            "ttt_median_s": ttt.median, "ttt_min_s": float(times.min()),
            "ttt_max_s": float(times.max()), "ttt_low_s": ttt.low, "ttt_high_s": ttt.high,
            "ttt_interval": ttt.kind, "reached": int(g["reached"].sum()),
            "seeds": int(g["seed"].count()),
            "baseline_ttt_s": float(np.median(list(base.values()))) if base else math.nan,
            "speedup_median": speed.median,
            "speedup_min": _nan_or(np.nanmin, pair_ratios),
            "speedup_max": _nan_or(np.nanmax, pair_ratios),
            "speedup_low": speed.low, "speedup_high": speed.high,
            "speedup_interval": speed.kind, "paired": paired,
        })
    columns = [*keys, variant, "method", *SPEEDUP_COLUMNS]
    return pd.DataFrame(rows, columns=columns)


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

# The keys of a sweep's speedups.parquet: one row per source, network point and variant.
SWEEP_SPEEDUP_KEYS = ("source", "network", "inter_bw_bps", "inter_lat_s")


def sweep_speedups(runs: pd.DataFrame) -> pd.DataFrame:
    """A sweep's speedups.parquet, derived from its runs.parquet alone (no replay needed)."""
    return speedups(runs, by=SWEEP_SPEEDUP_KEYS)


def _key(values: object) -> tuple:
    """A group key with missing values spelled alike (NaN never equals NaN in a dict)."""
    values = values if isinstance(values, tuple) else (values,)
    return tuple("<none>" if _missing(v) else v for v in values)


def _nan_or(reduce, values: np.ndarray) -> float:
    """`reduce` over the defined values (nanmin, nanmax); NaN when none is defined."""
    defined = values[~np.isnan(values)] if len(values) else values
    return float(reduce(defined)) if len(defined) else math.nan


def _pair_ratios(base: dict, seeds: pd.Series, times: pd.Series, paired: bool) -> np.ndarray:
    """Every speed-up the interval is over: one per seed when paired, else one per pair."""
    if not base:
        return np.array([])
    if paired:
        return np.array([intervals.ratio(base[s], t) for s, t in zip(seeds, times, strict=True)])
    return np.array([intervals.ratio(b, t) for b in base.values() for t in times])


def pivot(
    table: pd.DataFrame, value: str, *, rows: str = "variant", cols: str = "network"
) -> pd.DataFrame:
    """A rows x cols table of `value`, keeping the order in which rows and columns first appear."""
    row_order = list(dict.fromkeys(table[rows]))
    col_order = list(dict.fromkeys(table[cols]))
    wide = table.pivot_table(index=rows, columns=cols, values=value, aggfunc="first", dropna=False)
    return wide.reindex(index=row_order, columns=col_order)


def format_seconds(value: float) -> str:
    """Seconds for a table cell: 'not reached' for inf, '-' for missing."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if math.isinf(value):
        return "not reached"
    if value >= 100:
        return f"{value:.0f} s"
    if value >= 1:
        return f"{value:.1f} s"
    return f"{value * 1000:.0f} ms"


def format_speedup(median: float, low: float, high: float) -> str:
    """A speed-up cell: 'median× [min–max]' over seeds."""
    if median is None or math.isnan(median):
        return "-"

    def one(x: float) -> str:
        return "inf" if math.isinf(x) else f"{x:.2f}"

    if low == high:
        return f"{one(median)}×"
    return f"{one(median)}× [{one(low)}–{one(high)}]"


def markdown_table(frame: pd.DataFrame, *, index_name: str | None = None) -> str:
    """Render a small DataFrame (index = first column) as a GitHub Markdown table."""
    head = [index_name or (frame.index.name or ""), *[str(c) for c in frame.columns]]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for idx, row in frame.iterrows():
        cells = [str(idx), *["" if _missing(v) else str(v) for v in row.tolist()]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _missing(value: object) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


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


def format_time_interval(interval: intervals.Interval) -> str:
    """'12.3 s [11.0–13.5]': a median time to target with its bracket ('inf' for a miss)."""
    def end(value: float) -> str:
        return "inf" if math.isinf(value) else format_seconds(value).removesuffix(" s")

    if math.isinf(interval.low):  # every seed missed: 'not reached', no bracket of infinities
        return format_seconds(interval.median)
    return format_seconds(interval.median) + interval.bracket(end)


def format_speedup_interval(interval: intervals.Interval) -> str:
    """'2.10× [1.90–2.30]': a median speed-up with its bracket ('2.10×' without one)."""
    if interval.kind in ("single", "none") or math.isnan(interval.low):
        return format_speedup(interval.median, interval.median, interval.median)
    return format_speedup(interval.median, interval.low, interval.high)


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
