"""A sweep's wall-shaped [[validate]] points: the model's ratio, and what it cannot separate.

A [[validate]] unit trains once more with wall-clock shaping at one network point, minutes
after the unshaped recording it is compared with, on a machine that pins no rank to a core.
The sweep's simulated time replays the recording's compute, so "simulated / measured" mixes
the machine's compute drift between the two runs with the model's error. Replaying the shaped
run itself, its own compute with the links modeled (as `flexbench validate-sim`'s
network_error_pct), is the network model alone. `own_compute` adds that replay and both runs'
median compute per step to each measured row; `metrics.validation_table` shows them beside
the ratio, with `metrics.VALIDATION_NOTE`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path

import pandas as pd

log = logging.getLogger(__name__)

__all__ = ["OWN_COLUMNS", "own_compute"]

# own_compute_final_s: the shaped run replayed with its own compute on its own network (s);
# shaped_compute_s, recording_compute_s: median compute per step of each run (s).
OWN_COLUMNS = ("own_compute_final_s", "shaped_compute_s", "recording_compute_s")



def _median_compute(run_dir: Path) -> float:
    """A run's median recorded compute per step (s); NaN when its steps do not say."""
    steps = pd.read_parquet(run_dir / "steps.parquet")
    return float(steps["compute_s"].median()) if "compute_s" in steps else math.nan


def own_compute(out: Path, runs: pd.DataFrame,
                replay_axis: Callable[..., pd.DataFrame]) -> pd.DataFrame:
    """`runs` with OWN_COLUMNS on each finished measured row (NaN elsewhere).

    `replay_axis(run_dir, inter_bw=..., inter_lat=...)` gives a run's simulated time axis (a
    frame with time_s): `experiments.replay.on_basis.run_axis`, or a sweep's cached one.
    """
    runs = runs.assign(**{c: math.nan for c in OWN_COLUMNS})
    done = runs.index[(runs["source"] == "measured") & (runs["status"] == "done")]
    for i in done:
        row = runs.loc[i]
        shaped = Path(out) / "units" / str(row["unit"])
        try:
            axis = replay_axis(shaped, inter_bw=row["inter_bw"], inter_lat=row["inter_lat"])
        except Exception as err:  # one point the model cannot replay must not lose the report
            log.warning("%s: no own-compute replay (%s: %s)", row["unit"], type(err).__name__, err)
            continue
        runs.loc[i, "own_compute_final_s"] = float(axis["time_s"].iloc[-1])
        runs.loc[i, "shaped_compute_s"] = _median_compute(shaped)
        recording = runs[(runs["kind"] == "train") & (runs["status"] == "done")
                         & (runs["variant"] == row["variant"]) & (runs["seed"] == row["seed"])]
        if len(recording):
            unit = str(recording["unit"].iloc[0])
            runs.loc[i, "recording_compute_s"] = _median_compute(Path(out) / "units" / unit)
    return runs
