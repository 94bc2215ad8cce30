"""Sweeps over node counts and gossip graphs: unit names, per-unit columns, per-cluster targets."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.experiments.sweep_fakes import (
    EVAL_EVERY,
    STEPS,
    ensure_units_module,
    fake_launch,
    fake_loss,
    fake_simulate,
    fake_variance,
)

ensure_units_module()

from experiments import sweep  # noqa: E402
from experiments.report import metrics  # noqa: E402
from experiments.scoring import speedups, targets  # noqa: E402
from experiments.sweep.describe import mean_degree  # noqa: E402

GRAPH_CONFIG = """
name = "g"
timeout_s = 30

[run]
workload = "lm-tiny"
gpus_per_node = 1
steps = 20

[grid]
methods = ["hsdp-adamw", "gossip"]
inter_bw = ["10Mbit", "1Gbit"]
inter_lat = ["1ms"]
seeds = [0, 1]

[grid.knobs.hsdp-adamw]
nodes = [4, 8]

[grid.knobs.gossip]
nodes = [4, 8]
graph = ["ring", "one-peer-exponential", "complete"]

[target]
baseline_fraction = 0.6
"""


def graph_sweep(root: Path, overrides: list[str] | None = None) -> tuple[Path, pd.DataFrame]:
    """Run GRAPH_CONFIG with fake runs under `root`; (output folder, runs.parquet)."""
    (root / "g.toml").write_text(GRAPH_CONFIG)
    cfg = sweep.load_config(root / "g.toml", overrides or [])
    out = root / "res"
    runs = sweep.run_sweep(cfg, out, launcher=_slower_on_8_nodes, simulator=fake_simulate,
                           progress=False)
    return out, runs


def _slower_on_8_nodes(cfg, out: Path, **kw: object) -> Path:
    """fake_launch, with twice the compute per step on 8 nodes, so clusters time apart."""
    out = fake_launch(cfg, out, **kw)
    if cfg.nodes == 8:
        steps = pd.read_parquet(out / "steps.parquet")
        steps.assign(compute_s=2 * steps["compute_s"]).to_parquet(out / "steps.parquet")
    return out


@pytest.fixture(scope="module")
def graph_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, pd.DataFrame]:
    return graph_sweep(tmp_path_factory.mktemp("graphs"))


@pytest.mark.timeout(30)
def test_nodes_and_graph_knobs_name_variants_units_and_folders(tmp_path: Path) -> None:
    (tmp_path / "g.toml").write_text(GRAPH_CONFIG)
    units = sweep.units_of(sweep.load_config(tmp_path / "g.toml"))
    assert len(units) == (2 + 2 * 3) * 2
    ring = next(u for u in units if u.id == "gossip-nodes=8_graph=ring-s1")
    assert ring.variant == "gossip[nodes=8,graph=ring]"
    assert (ring.config.nodes, ring.config.graph, ring.cluster) == (8, "ring", "8x1")
    base = [u for u in units if u.method == "hsdp-adamw"]
    assert [u.id for u in base] == ["hsdp-adamw-nodes=4-s0", "hsdp-adamw-nodes=4-s1",
                                    "hsdp-adamw-nodes=8-s0", "hsdp-adamw-nodes=8-s1"]


@pytest.mark.timeout(60)
def test_runs_carry_cluster_graph_degree_and_replica_spread(
    graph_runs: tuple[Path, pd.DataFrame],
) -> None:
    out, runs = graph_runs
    assert set(runs["status"]) == {"done"}
    assert (out / "units" / "gossip-nodes=4_graph=complete-s0" / "run.json").exists()
    per = runs.drop_duplicates("unit").set_index("unit")
    ring8 = per.loc["gossip-nodes=8_graph=ring-s0"]
    assert (ring8["nodes"], ring8["cluster"], ring8["graph"]) == (8, "8x1", "ring")
    # Counted from the trace: sends per rank and training step (the eval-phase send is left out).
    assert ring8["graph_degree"] == pytest.approx(2.0)
    assert per.loc["gossip-nodes=8_graph=complete-s0", "graph_degree"] == pytest.approx(7.0)
    assert per.loc["gossip-nodes=4_graph=one-peer-exponential-s1",
                   "graph_degree"] == pytest.approx(1.0)
    hsdp = per.loc["hsdp-adamw-nodes=4-s0"]
    assert pd.isna(hsdp["graph"]) and math.isnan(hsdp["graph_degree"])
    assert ring8["replica_variance"] == pytest.approx(fake_variance(2.0))
    assert ring8["consensus_distance"] == pytest.approx(1e-3 / 3)
    steps = pd.read_parquet(out / "steps.parquet")
    assert {"nodes", "cluster", "graph"} <= set(steps.columns)


@pytest.mark.timeout(60)
def test_each_node_count_is_scored_against_its_own_baseline(
    graph_runs: tuple[Path, pd.DataFrame],
) -> None:
    out, runs = graph_runs
    assert (runs["baseline_cluster"] == runs["cluster"]).all()
    step = next(s for s in range(12, STEPS + 1) if s % EVAL_EVERY == 0)
    for cluster in ("4x1", "8x1"):
        here = runs[runs["cluster"] == cluster]
        nodes = int(cluster.split("x")[0])
        curves = [pd.read_parquet(out / "units" / f"hsdp-adamw-nodes={nodes}-s{s}" /
                                  "steps.parquet") for s in (0, 1)]
        assert set(here["target_val_loss"]) == {targets.baseline_target_at(curves, 0.6)}
    # The fake baseline's loss does not depend on nodes; the per-cluster rule still applies.
    expected = float(np.median([fake_loss("hsdp-adamw", s, step) for s in (0, 1)]))
    assert runs["target_val_loss"].iloc[0] == pytest.approx(expected)
    # Speed-ups divide by the median baseline time of the same cluster (8 nodes are slower).
    sim = runs[runs["source"] == "sim"]
    table = pd.read_parquet(out / "speedups.parquet")
    for (network, cluster), part in sim.groupby(["network", "cluster"]):
        base = part.loc[part["method"] == "hsdp-adamw", "time_to_target_s"].median()
        rows = table[(table["network"] == network) & (table["source"] == "sim")
                     & table["variant"].str.contains(f"nodes={cluster[0]}")]
        assert len(rows) == 4 and (rows["baseline_ttt_s"] == base).all()
    ttt8 = sim.loc[(sim["cluster"] == "8x1") & (sim["method"] == "hsdp-adamw"), "time_to_target_s"]
    ttt4 = sim.loc[(sim["cluster"] == "4x1") & (sim["method"] == "hsdp-adamw"), "time_to_target_s"]
    assert ttt8.median() > ttt4.median()
    assert "Time to target val_loss" in metrics.summary_markdown(runs)


@pytest.mark.timeout(60)
def test_one_baseline_shape_scores_every_cluster_against_it(tmp_path: Path) -> None:
    _, runs = graph_sweep(tmp_path, ["grid.knobs.hsdp-adamw.nodes=[4]"])
    assert set(runs["baseline_cluster"]) == {"4x1"}
    assert runs["target_val_loss"].nunique() == 1
    gossip8 = runs[(runs["cluster"] == "8x1") & (runs["source"] == "sim")]
    assert gossip8["target_val_loss"].notna().all()


@pytest.mark.timeout(60)
def test_a_cluster_without_its_baseline_has_no_target(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        _, runs = graph_sweep(tmp_path, ["grid.knobs.hsdp-adamw.nodes=[4, 8]",
                                         "grid.knobs.gossip.nodes=[6]",
                                         "grid.knobs.gossip.graph=[\"ring\"]"])
    assert "no hsdp-adamw runs on cluster(s) 6x1" in caplog.text
    orphan = runs[runs["cluster"] == "6x1"]
    assert orphan["baseline_cluster"].isna().all() and orphan["target_val_loss"].isna().all()
    assert not orphan["reached"].any()
    table = speedups.speedups(runs[runs["source"] == "sim"], by=("network",))
    assert table.loc[table["method"] == "gossip", "speedup_median"].isna().all()


@pytest.mark.timeout(30)
def test_mean_degree_needs_point_to_point_sends(tmp_path: Path) -> None:
    old = tmp_path / "old.parquet"
    pd.DataFrame({"step": [1], "bytes": [1]}).to_parquet(old)
    assert math.isnan(mean_degree(old, 1))
    assert math.isnan(mean_degree(tmp_path / "missing.parquet", 1))
    trace = tmp_path / "t.parquet"
    pd.DataFrame({"rank": [0, 0, 1, 1], "op": ["send", "send", "send", "recv"],
                  "inter": [True, True, True, True],
                  "phase": ["train", "train", "train", "train"]}).to_parquet(trace)
    assert mean_degree(trace, 2) == pytest.approx(3 / 4)  # 3 sends, 2 ranks x 2 steps
