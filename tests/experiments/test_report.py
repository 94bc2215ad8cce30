"""`flexbench report` on a sweep made of fake runs: every figure and the summary table."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.experiments.sweep_fakes import ensure_units_module, fake_launch, fake_simulate
from tests.experiments.test_sweep import CONFIG

ensure_units_module()

from experiments import cli, report, sweep  # noqa: E402
from experiments.report import graphs as report_graphs  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("report")
    (root / "t.toml").write_text(CONFIG)
    cfg = sweep.load_config(root / "t.toml")
    out = root / "res"
    sweep.run_sweep(cfg, out, launcher=fake_launch, simulator=fake_simulate, progress=False)
    return out


@pytest.mark.timeout(90)
def test_report_writes_figures_and_summary(results: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["report", str(results)]) == 0
    printed = capsys.readouterr().out.split()
    for name in ("loss_vs_wallclock", "time_to_target", "bytes_per_step", "frontier"):
        png = results / "figures" / f"{name}.png"
        svg = results / "figures" / f"{name}.svg"
        assert str(png) in printed and str(svg) in printed
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "<svg" in svg.read_text()[:2000]
    summary = (results / "summary.md").read_text()
    assert "## Sweep `t`" in summary
    assert "| method | 10Mbit / 1ms | 10Mbit / 20ms | 1Gbit / 1ms | 1Gbit / 20ms |" in summary
    assert "diloco[diloco_h=5]" in summary and "not reached" in summary
    assert "Cost model vs wall-shaped real runs" in summary
    # No temp files are left behind by the atomic writes.
    assert not [p for p in results.rglob("*.tmp")]


@pytest.mark.timeout(30)
def test_loaded_results_expose_target_and_variants(results: Path) -> None:
    res = report.load_results(results)
    assert res.name == "t"
    assert res.variants()[:2] == ["hsdp-adamw", "flexdemo"]
    assert res.target == pytest.approx(res.runs["target_val_loss"].iloc[0])
    assert set(res.palette()) == set(res.variants())


@pytest.mark.timeout(30)
def test_report_on_a_folder_without_results_fails_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert cli.main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "holds no runs.parquet" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "figures").exists()


@pytest.mark.timeout(90)
def test_report_survives_a_sweep_whose_baseline_failed(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.report import metrics

    def launcher(cfg, out, **kw):
        if cfg.method == "hsdp-adamw":
            raise RuntimeError("boom")
        return fake_launch(cfg, out, **kw)

    (tmp_path / "t.toml").write_text(CONFIG)
    cfg = sweep.load_config(tmp_path / "t.toml")
    sweep.run_sweep(cfg, tmp_path / "res", launcher=launcher, simulator=fake_simulate,
                    progress=False)
    res = report.load_results(tmp_path / "res")
    for draw in (report.plot_loss_vs_time, report.plot_time_to_target, report.plot_bytes_per_step):
        fig = draw(res)
        fig.canvas.draw()  # layout and ticks are computed here; empty log axes would raise
        plt.close(fig)
    text = metrics.summary_markdown(res.runs)
    assert "val_loss undetermined" in text and "not reached (0/2 seeds)" in text
    assert "- `hsdp-adamw-s0`: failed (RuntimeError: boom)" in text


@pytest.fixture(scope="module")
def graph_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.experiments.test_sweep_graphs import graph_sweep

    out, _ = graph_sweep(tmp_path_factory.mktemp("graph-report"))
    return out


@pytest.mark.timeout(120)
def test_report_of_a_graph_sweep_adds_degree_variance_and_per_graph_figures(
    graph_results: Path, results: Path
) -> None:
    written = report.write_report(graph_results)
    for name in ("loss_vs_degree", "loss_vs_variance", "time_to_target_by_graph"):
        png = graph_results / "figures" / f"{name}.png"
        assert png in written and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (graph_results / "summary.md").read_text()
    assert "### Decentralized: graphs, replica spread and final loss" in summary
    assert "| 8 nodes · complete | 7.00 |" in summary
    assert "| 4 nodes · hsdp-adamw | - |" in summary
    # The fake gossip learns faster and drifts less with more peers: DBench's two signs.
    corr = report_graphs.correlations(report_graphs.unit_table(report.load_results(
        graph_results).runs)).set_index("units")
    assert list(corr.index) == ["4 nodes", "8 nodes", "pooled"]
    assert (corr["rho(loss, degree)"] < -0.8).all() and (corr["rho(loss, variance)"] > 0.8).all()
    assert list(corr["n"]) == [6, 6, 12]
    assert "No `ada` units in this sweep" in summary
    # A sweep without gossip draws none of them.
    report.write_report(results)
    assert not (results / "figures" / "loss_vs_degree.png").exists()
    assert "Decentralized" not in (results / "summary.md").read_text()


@pytest.mark.timeout(30)
def test_spearman_is_pearson_on_average_ranks() -> None:
    assert report_graphs.spearman([1, 2, 3, 4], [10, 20, 30, 1000]) == pytest.approx(1.0)
    assert report_graphs.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(report_graphs.spearman([1, 2], [2, 1]))  # too few points
    assert math.isnan(report_graphs.spearman([1, 1, 1], [1, 2, 3]))  # no order in x
    x, y = [1, 2, 2, 3, 5, float("inf")], [3, 1, 2, 5, 4, 0]
    stats = pytest.importorskip("scipy.stats")
    assert report_graphs.spearman(x, y) == pytest.approx(stats.spearmanr(x[:5], y[:5])[0])
    assert report_graphs.permutation_p([1, 2, 3, 4, 5, 6, 7, 8], range(8)) < 0.01


@pytest.mark.timeout(30)
def test_ada_verdict_compares_with_every_fixed_graph_per_point_and_cluster() -> None:
    import pandas as pd

    def row(method: str, graph: str | None, nodes: int, ttt: float) -> dict:
        return {"source": "sim", "on_grid": True, "kind": "train", "network": "1Gbit / 10ms",
                "nodes": nodes, "method": method, "graph": graph, "time_to_target_s": ttt}

    runs = pd.DataFrame([row("gossip", "ring", 4, 10.0), row("gossip", "complete", 4, 8.0),
                         row("ada", None, 4, 7.0), row("hsdp-adamw", None, 4, 1.0),
                         row("gossip", "ring", 8, 10.0), row("ada", None, 8, math.inf)])
    lines = report_graphs.ada_verdicts(runs)
    assert lines[0].startswith("- 1Gbit / 10ms, 4 nodes: yes") and "complete 8.0 s" in lines[0]
    assert lines[1].startswith("- 1Gbit / 10ms, 8 nodes: no") and "not reached" in lines[1]
    # With seeds, the margin over the best graph carries its bracket and says when it is a tie.
    seeded = pd.DataFrame([{**row(m, g, 4, t), "seed": s} for m, g, times in
                           (("gossip", "ring", (10.0, 12.0)), ("ada", None, (11.0, 10.0)))
                           for s, t in enumerate(times)])
    (line,) = report_graphs.ada_verdicts(seeded)
    # ring/ada per seed: 10/11 and 12/10 -> median 1.05, range 0.91..1.20: a tie.
    assert line.endswith("(ring's time / ada's: 1.05× [0.91–1.20], tie)"), line


@pytest.mark.timeout(30)
def test_graph_summary_without_finished_gossip_units_says_so() -> None:
    import pandas as pd

    runs = pd.DataFrame([{"unit": "ada-s0", "kind": "train", "status": "done", "method": "ada",
                          "variant": "ada", "seed": 0, "nodes": 4, "graph": None,
                          "graph_degree": 2.5, "replica_variance": 1e-8,
                          "consensus_distance": 1e-3, "final_val_loss": 2.5, "source": "sim",
                          "on_grid": True, "network": "1Gbit / 10ms",
                          "time_to_target_s": 3.0}])
    assert report_graphs.has_graph_units(runs)
    text = report_graphs.graphs_markdown(runs)
    assert "nothing to correlate" in text and "| 4 nodes · ada | 2.50 |" in text


@pytest.mark.timeout(90)
def test_report_refuses_runs_gone_or_changed_since_scoring(results: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    import shutil

    copy = tmp_path / "res"
    shutil.copytree(results, copy)
    trace = copy / "units" / "flexdemo-s1" / "trace.parquet"
    trace.write_bytes(trace.read_bytes() + b"\0")  # retrained, or edited, after the scoring
    assert cli.main(["report", str(copy)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("again to re-score.") and "'flexdemo-s1'" in err and "has changed" in err
    shutil.rmtree(copy / "units" / "flexdemo-s1")
    assert cli.main(["report", str(copy)]) == 2
    assert "is gone from units/" in capsys.readouterr().err
    assert not (copy / "summary.md").exists() or (copy / "summary.md").read_text() == (
        results / "summary.md").read_text()


@pytest.mark.timeout(30)
def test_a_validation_point_replays_the_shaped_run_with_its_own_compute(results: Path) -> None:
    import pandas as pd

    from experiments.report import metrics
    from tests.experiments.sweep_fakes import COMPUTE_S, FAKE_BYTES, STEPS

    runs = pd.read_parquet(results / "runs.parquet")
    m = runs[runs["source"] == "measured"].iloc[0]
    # The fake shaped run takes compute + bytes / bandwidth a step; the fake model adds its 3
    # calls x 1 ms of latency: the own-compute replay differs from it by that alone.
    link = FAKE_BYTES["flexdemo"] / (100e6 / 8)
    assert m["final_time_s"] == pytest.approx(STEPS * (COMPUTE_S + link))
    assert m["own_compute_final_s"] == pytest.approx(STEPS * (COMPUTE_S + link + 3e-3))
    assert m["shaped_compute_s"] == m["recording_compute_s"] == pytest.approx(COMPUTE_S)
    row = metrics.validation_table(runs).iloc[0]
    ratio = (COMPUTE_S + link + 3e-3) / (COMPUTE_S + link)
    assert row["own compute: simulated / measured"] == f"{ratio:.2f}"
    assert row["compute/step: recording → shaped run"] == "100 → 100 ms"
    assert metrics.VALIDATION_NOTE in metrics.summary_markdown(runs)
    assert runs[runs["source"] == "sim"]["own_compute_final_s"].isna().all()
