"""`flexbench report` on a sweep made of fake runs: every figure and the summary table."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_sweep import CONFIG
from tests.test_sweep_fakes import ensure_units_module, fake_launch, fake_simulate

ensure_units_module()

from experiments import cli, report, sweep  # noqa: E402


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

    from experiments import metrics

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
