"""One tiny sweep through the real launcher and cost model: two steps of hsdp-adamw on 2 x 1."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from experiments import sweep

CONFIG = """
name = "e2e"
timeout_s = 240

[run]
workload = "lm-tiny"
nodes = 2
gpus_per_node = 1
steps = 2
eval_every = 1

[grid]
methods = ["hsdp-adamw"]
inter_bw = ["10Mbit", "10Gbit"]
inter_lat = ["1ms"]
seeds = [0]
"""


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_real_sweep_trains_once_and_times_every_point(tmp_path: Path) -> None:
    (tmp_path / "e2e.toml").write_text(CONFIG)
    cfg = sweep.load_config(tmp_path / "e2e.toml")
    runs = sweep.run_sweep(cfg, tmp_path / "out", progress=False)
    assert list(runs["status"]) == ["done", "done"], runs["error"].tolist()
    run = json.loads((tmp_path / "out" / "units" / "hsdp-adamw-s0" / "run.json").read_text())
    assert run["config"]["extra"]["unit"] == "hsdp-adamw-s0"
    slow, fast = (runs.set_index("inter_bw").loc[bw] for bw in ("10Mbit", "10Gbit"))
    # One real run: the same losses on both points, only the time axis differs.
    assert slow["final_val_loss"] == fast["final_val_loss"]
    assert slow["inter_bytes_per_step"] > 0
    assert slow["reached"] and fast["reached"]  # the baseline reaches its own target + 2%
    assert slow["time_to_target_s"] > fast["time_to_target_s"] > 0
    steps = pd.read_parquet(tmp_path / "out" / "steps.parquet")
    assert len(steps) == 4 and (steps.groupby("network")["time_s"].diff().dropna() > 0).all()
