"""Time to target and the default target: the first evaluation at or below it, AlgoPerf's rule.

A run's time to target is the time of its first *evaluation* whose validation loss is at or
below the target (timing excludes evaluation itself); a run that never gets there scores inf and
stays in every table as "not reached". Without a stated target, the sweeps' default is the
baseline's median final val_loss over seeds plus TARGET_MARGIN.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import pandas as pd

from flexdemo.methods import BASELINE

__all__ = ["BASELINE", "TARGET_MARGIN", "baseline_target_at", "default_target", "time_to_target"]

TARGET_MARGIN = 0.02


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
