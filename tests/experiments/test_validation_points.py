"""A committed sweep's [[validate]] point: its shaped run replayed with its own compute."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from experiments.replay import on_basis
from experiments.replay.engine import replay
from experiments.replay.recordings import read_run
from experiments.replay.target import ReplayTarget
from experiments.report import metrics, validation

QUICK = Path(__file__).resolve().parents[2] / "results" / "quick"
SHAPED = QUICK / "units" / "flexdemo-s0-100Mbit_20ms"
pytestmark = pytest.mark.skipif(not SHAPED.is_dir(), reason="needs the committed results/quick")


@pytest.mark.timeout(120)
def test_the_own_compute_column_replays_the_shaped_run_not_its_recording() -> None:
    runs = validation.own_compute(QUICK, pd.read_parquet(QUICK / "runs.parquet"),
                                  on_basis.run_axis)
    point = runs[(runs["source"] == "measured") & (runs["unit"] == SHAPED.name)].iloc[0]
    own = replay(read_run(SHAPED), ReplayTarget(inter_bw="100Mbit", inter_lat="20ms")
                 ).frame["time_s"].iloc[-1]
    assert point["own_compute_final_s"] == pytest.approx(own, rel=1e-12)
    recorded = replay(read_run(QUICK / "units" / "flexdemo-s0"),
                      ReplayTarget(inter_bw="100Mbit", inter_lat="20ms")).frame["time_s"].iloc[-1]
    assert not math.isclose(own, recorded, rel_tol=1e-3)  # two runs, two computes
    median = {u: pd.read_parquet(QUICK / "units" / u / "steps.parquet")["compute_s"].median()
              for u in (SHAPED.name, "flexdemo-s0")}
    assert point["shaped_compute_s"] == pytest.approx(median[SHAPED.name])
    assert point["recording_compute_s"] == pytest.approx(median["flexdemo-s0"])
    row = metrics.validation_table(runs).loc["flexdemo seed 0 @ 100Mbit / 20ms"]
    assert row["own compute: simulated / measured"] == f"{own / point['final_time_s']:.2f}"
    assert row["compute/step: recording → shaped run"] == (
        f"{median['flexdemo-s0'] * 1e3:.0f} → {median[SHAPED.name] * 1e3:.0f} ms")
