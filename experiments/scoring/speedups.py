"""Per variant and network point: time to target over seeds and the speed-up over the baseline.

Speed-ups are paired ratios, the baseline's time over the method's seed by seed at the same
network point (every pair where the seeds differ), summarised by their median with a bracket
(`intervals`: a bootstrap interval from 3 seeds, the range at 2) and their min and max.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from experiments.scoring import intervals
from experiments.scoring.formats import missing
from flexdemo.methods import BASELINE

__all__ = ["SPEEDUP_COLUMNS", "SWEEP_SPEEDUP_KEYS", "speedups", "sweep_speedups"]

# What `speedups` adds to its key columns, per variant and network point.
SPEEDUP_COLUMNS = ["ttt_median_s", "ttt_min_s", "ttt_max_s", "ttt_low_s", "ttt_high_s",
                   "ttt_interval", "reached", "seeds", "baseline_ttt_s", "speedup_median",
                   "speedup_min", "speedup_max", "speedup_low", "speedup_high",
                   "speedup_interval", "paired"]


# The keys of a sweep's speedups.parquet: one row per source, network point and variant.
SWEEP_SPEEDUP_KEYS = ("source", "network", "inter_bw_bps", "inter_lat_s")


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


def sweep_speedups(runs: pd.DataFrame) -> pd.DataFrame:
    """A sweep's speedups.parquet, derived from its runs.parquet alone (no replay needed)."""
    return speedups(runs, by=SWEEP_SPEEDUP_KEYS)


def _key(values: object) -> tuple:
    """A group key with missing values spelled alike (NaN never equals NaN in a dict)."""
    values = values if isinstance(values, tuple) else (values,)
    return tuple("<none>" if missing(v) else v for v in values)


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
