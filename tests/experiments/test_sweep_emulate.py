"""A sweep's [emulate] node counts: emulated units beside the recorded ones, each timed by its
recorded unit's trace replayed at its node count, scored against the baseline emulated there."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from experiments import sweep
from experiments.errors import ConfigError
from experiments.replay.engine import replay
from experiments.replay.recordings import read_run
from experiments.replay.target import ReplayTarget
from experiments.report import metrics
from experiments.scoring import targets

CONFIG = """
name = "emulate"
timeout_s = 240

[run]
workload = "lm-tiny"
nodes = 2
gpus_per_node = 1
steps = 4
eval_every = 2
graph = "ring"

[grid]
methods = ["hsdp-adamw", "gossip"]
inter_bw = ["10Mbit"]
inter_lat = ["1ms"]
seeds = [0]
"""

EMULATE = """
[emulate]
nodes = [4]
"""


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_emulated_units_join_a_finished_sweep_timed_by_their_recorded_traces(
        tmp_path: Path) -> None:
    out = tmp_path / "out"
    (tmp_path / "plain.toml").write_text(CONFIG)
    sweep.run_sweep(sweep.load_config(tmp_path / "plain.toml"), out, progress=False)
    recorded = {u: (out / "units" / u / "run.json").stat().st_mtime_ns
                for u in ("hsdp-adamw-s0", "gossip-s0")}
    # The same sweep with [emulate] resumes in the same folder: the recorded units stay as they
    # were and only the emulated ones run.
    (tmp_path / "emulate.toml").write_text(CONFIG + EMULATE)
    cfg = sweep.load_config(tmp_path / "emulate.toml")
    runs = sweep.run_sweep(cfg, out, progress=False)
    assert {u: (out / "units" / u / "run.json").stat().st_mtime_ns for u in recorded} == recorded
    assert (runs["status"] == "done").all(), runs["error"].tolist()
    rows = runs.set_index("unit")
    emulated = rows.loc["gossip-nodes=4-s0-emulated"]
    assert emulated["variant"] == "gossip[nodes=4]" and emulated["cluster"] == "4x1"
    assert emulated["emulated"] and emulated["recorded_unit"] == "gossip-s0"
    assert json.loads((out / "units" / "gossip-nodes=4-s0-emulated" / "run.json")
                      .read_text())["executor"] == "emulated"
    # Its time axis is the recorded gossip trace replayed at 4 nodes (the ring rebuilt there);
    # its losses are its own emulated curve.
    axis = replay(read_run(out / "units" / "gossip-s0"),
                  ReplayTarget(nodes=4, inter_bw="10Mbit", inter_lat="1ms")).frame
    steps = pd.read_parquet(out / "steps.parquet")
    mine = steps[steps["unit"] == "gossip-nodes=4-s0-emulated"].sort_values("step")
    assert mine["time_s"].tolist() == pytest.approx(axis["time_s"].tolist(), rel=1e-12)
    own = pd.read_parquet(out / "units" / "gossip-nodes=4-s0-emulated" / "steps.parquet")
    assert mine["val_loss"].dropna().tolist() == own["val_loss"].dropna().tolist()
    assert emulated["graph_degree"] == 2  # a ring at 4 nodes
    assert pd.isna(emulated["inter_bytes_per_step"])  # the emulator measures no bytes
    # Each cluster has its own target: the 4-node units are scored against the baseline
    # emulated at 4 nodes.
    base = json.loads((out / "units" / "hsdp-adamw-nodes=4-s0-emulated" / "run.json").read_text())
    finals = pd.DataFrame([{"method": "hsdp-adamw", "final_val_loss": base["final_val_loss"]}])
    assert emulated["baseline_cluster"] == "4x1"
    assert emulated["target_val_loss"] == pytest.approx(targets.default_target(finals))
    assert rows.loc["gossip-s0", "baseline_cluster"] == "2x1"
    assert "Emulated units" in metrics.summary_markdown(runs)  # the report says what they are


@pytest.mark.parametrize("change, says", [
    ("gpus_per_node = 1", "set run.gpus_per_node = 1"),
    ("[emulate]\nnodes = [4]", "emulate.nodes lists 2"),
    ("[emulate]\nnodes = [4]", "emulate.nodes must be"),
    ("[emulate]\nnodes = [4]", "unknown key 'steps' in [emulate]"),
    ("seeds = [0]", "do not mix"),
])
def test_bad_emulate_settings_are_one_sentence(tmp_path: Path, change: str, says: str) -> None:
    text = CONFIG + EMULATE
    replacement = {
        "set run.gpus_per_node = 1": "gpus_per_node = 2",
        "emulate.nodes lists 2": "[emulate]\nnodes = [2]",
        "emulate.nodes must be": "[emulate]\nnodes = [0]",
        "unknown key 'steps' in [emulate]": "[emulate]\nnodes = [4]\nsteps = 2",
        "do not mix": "seeds = [0]\n[grid.knobs.gossip]\nnodes = [2, 3]",
    }[says]
    (tmp_path / "bad.toml").write_text(text.replace(change, replacement))
    with pytest.raises(ConfigError) as err:
        sweep.load_config(tmp_path / "bad.toml")
    assert says in str(err.value)
