"""Who reaches the target first at each network point, by how much, and whether that is clear.

    first = winners(runs, by=("network",))   # one row per network point

Methods are ranked by their median time to target over seeds (a miss is inf, ranked last, never
dropped). The margin is the runner-up's time over the first's, paired by seed where the two
share seeds (`intervals.ratio_interval`); the verdict is "tie" when that margin's bracket
includes 1 or the two time brackets overlap (`intervals.separation`). Where the runs carry
their times under resampled step times (`intervals.SAMPLES_COLUMN`, `--step-noise`), the time
brackets that decide are the widened ones, and `decided_by` says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd

from experiments.scoring import intervals

__all__ = ["SEEDS_ONLY", "WINNER_COLUMNS", "WITH_STEP_NOISE", "margin_text", "winners"]

WINNER_COLUMNS = ["first", "runner_up", "first_ttt_s", "runner_up_ttt_s", "margin_median",
                  "margin_low", "margin_high", "margin_interval", "verdict", "seeds", "decided_by"]

SEEDS_ONLY = "seeds"
WITH_STEP_NOISE = "seeds and step-time variation"


def winners(runs: pd.DataFrame, *, by: Sequence[str] = ("network",),
            variant: str = "variant") -> pd.DataFrame:
    """Per `by` group: the first variant to the target, the runner-up, the margin and verdict."""
    keys = list(by)
    decided_by = WITH_STEP_NOISE if intervals.SAMPLES_COLUMN in runs.columns else SEEDS_ONLY
    rows = []
    for group, here in runs.groupby(keys, dropna=False, sort=False):
        per = {name: g for name, g in here.groupby(variant, sort=False)}
        times = {name: intervals.time_interval(g) for name, g in per.items()}
        order = intervals.ranked(times)
        row = dict(zip(keys, group if isinstance(group, tuple) else (group,), strict=True))
        row.update(first=order[0], first_ttt_s=times[order[0]].median,
                   seeds=times[order[0]].n, decided_by=decided_by)
        if len(order) == 1:
            row.update(runner_up=None, runner_up_ttt_s=math.nan, margin_median=math.nan,
                       margin_low=math.nan, margin_high=math.nan, margin_interval="none",
                       verdict="alone")
        else:
            margin = _margin(per[order[1]], per[order[0]])
            row.update(runner_up=order[1], runner_up_ttt_s=times[order[1]].median,
                       margin_median=margin.median, margin_low=margin.low,
                       margin_high=margin.high, margin_interval=margin.kind,
                       verdict=intervals.separation(times[order[0]], times[order[1]], margin))
        rows.append(row)
    return pd.DataFrame(rows, columns=[*keys, *WINNER_COLUMNS])


def _margin(runner_up: pd.DataFrame, first: pd.DataFrame) -> intervals.Interval:
    """The runner-up's time over the first's (>= 1 when the first is faster), with its bracket."""
    def by_seed(g: pd.DataFrame) -> dict:
        return dict(zip(g["seed"], g["time_to_target_s"].astype(float), strict=True))

    margin, _ = intervals.ratio_interval(by_seed(runner_up), by_seed(first))
    return margin


def margin_text(row) -> str:
    """'3.10× [2.60–3.70]' (the runner-up's time over the first's), '-' without a runner-up."""
    if row["runner_up"] is None or math.isnan(row["margin_median"]):
        return "-"
    interval = intervals.Interval(row["margin_median"], row["margin_low"], row["margin_high"],
                                  int(row["seeds"]), row["margin_interval"])
    ends = interval.bracket(lambda v: "inf" if math.isinf(v) else f"{v:.2f}")
    median = "inf" if math.isinf(interval.median) else f"{interval.median:.2f}"
    return f"{median}×{ends}"
