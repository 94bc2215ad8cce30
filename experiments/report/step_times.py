"""`flexbench report --step-noise`: each unit's time to target under its resampled step times.

    flexbench report results/standard --step-noise

A sweep's simulated time axis of a unit at a network point is in its steps.parquet (`time_s`,
one row per step), beside the unit's recorded compute per step (`compute_s`). Each simulated
row of runs.parquet gets that unit's times to target over block-resampled compute
(`experiments.scoring.step_noise`, as `flexbench compare --step-noise` does: same blocks, same
resamples, the same seed per unit, so at a grid point the two print the same brackets), in
`intervals.SAMPLES_COLUMN`; `speedups.speedups` and `ranking.winners` then widen the
time-to-target brackets by them and decide tie or clear on the widened brackets. The sweep
replays each unit at its recorded compute (scale 1). A miss (failed, diverged, or never
reaching the target) is inf in every resample. Speed-ups stay paired over seeds only.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from experiments.scoring import intervals, step_noise

__all__ = ["check_step_noise", "with_step_noise"]

_KEYS = ["unit", "network", "source"]


def check_step_noise(runs: pd.DataFrame, steps: pd.DataFrame) -> None:
    """ValueError (one sentence) for a finished unit without finite compute per step."""
    done = runs.loc[(runs["source"] == "sim") & (runs["status"] == "done"), "unit"].unique()
    if not len(done):
        return
    compute = steps["compute_s"] if "compute_s" in steps else pd.Series(np.nan, steps.index)
    ok = steps.assign(ok=np.isfinite(compute.astype(float)) & (compute >= 0))
    per_unit = ok[ok["unit"].isin(done)].groupby("unit")["ok"].all() if len(ok) else {}
    for unit in done:
        if unit not in per_unit or not per_unit[unit]:
            raise ValueError(f"unit {unit!r} has no finite compute per step (compute_s) in the "
                             "sweep's steps.parquet; --step-noise cannot resample it.")


def with_step_noise(runs: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """`runs` with `intervals.SAMPLES_COLUMN`: each row's time to target per resample.

    Simulated rows of finished units are resampled; every other row (a miss, a measured run)
    holds its own time to target in every resample, so it adds no width of its own.
    """
    check_step_noise(runs, steps)
    sim = steps[steps["source"] == "sim"] if len(steps) else steps
    axes = {key: g.sort_values("step") for key, g in sim.groupby(_KEYS, sort=False)} \
        if len(sim) else {}
    samples = []
    for row in runs.itertuples(index=False):
        ttt = float(row.time_to_target_s)
        axis = axes.get((row.unit, row.network, row.source))
        if axis is None or not math.isfinite(ttt) or row.status != "done":
            samples.append(np.full(step_noise.RESAMPLES, ttt))
            continue
        points = axis.loc[axis["val_loss"].notna(), ["step", "val_loss", "time_s"]]
        samples.append(step_noise.time_to_target_samples(
            axis[["step", "time_s"]], points, float(row.target_val_loss),
            axis["compute_s"].to_numpy(dtype=float), 1.0, name=str(row.unit)))
    return runs.assign(**{intervals.SAMPLES_COLUMN: samples})
