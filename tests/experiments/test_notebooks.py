"""The notebooks run headless, cell by cell, on the committed quick sweep and on fake results."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
QUICK = ROOT / "results" / "quick"


def _execute(path: Path, results: Path, monkeypatch: pytest.MonkeyPatch) -> nbformat.NotebookNode:
    """Run every cell in a fresh kernel; nbclient raises CellExecutionError if one fails."""
    monkeypatch.setenv("FLEXBENCH_RESULTS", str(results))
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    return nb


@pytest.mark.timeout(10)
def test_both_notebooks_are_committed_without_outputs() -> None:
    assert {p.name for p in NOTEBOOKS} >= {"loss_vs_wallclock.ipynb", "bandwidth_sweep.ipynb"}
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, path.name


@pytest.mark.timeout(240)
@pytest.mark.skipif(not (QUICK / "runs.parquet").exists(),
                    reason="results/quick has not been committed yet; run "
                    "`flexbench sweep experiments/configs/quick.toml` and commit its results")
@pytest.mark.dist
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_on_committed_quick_results(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nb = _execute(path, QUICK, monkeypatch)
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if "image/png" in o.get("data", {})]
    assert images, f"{path.name} drew no figure"


@pytest.mark.timeout(240)
@pytest.mark.skipif((QUICK / "runs.parquet").exists(),
                    reason="covered by the run on the committed quick results")
def test_notebooks_run_on_fake_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.experiments.sweep_fakes import ensure_units_module, fake_launch, fake_simulate
    from tests.experiments.test_sweep import CONFIG

    ensure_units_module()
    from experiments import sweep

    (tmp_path / "t.toml").write_text(CONFIG)
    out = tmp_path / "res"
    sweep.run_sweep(sweep.load_config(tmp_path / "t.toml"), out, launcher=fake_launch,
                    simulator=fake_simulate, progress=False)
    for path in NOTEBOOKS:
        nb = _execute(path, out, monkeypatch)
        assert any(o.get("output_type") for c in nb.cells if c.cell_type == "code"
                   for o in c.outputs)
    assert os.environ["FLEXBENCH_RESULTS"] == str(out)


def test_a_relative_results_folder_is_taken_from_where_the_user_stands(tmp_path, monkeypatch):
    from experiments import report

    monkeypatch.delenv("FLEXBENCH_RESULTS", raising=False)
    assert report.results_folder() == ROOT / "results" / "quick"
    monkeypatch.setenv("FLEXBENCH_RESULTS", "runs/quick")
    monkeypatch.setenv("PWD", str(tmp_path))  # the shell Jupyter was started from
    monkeypatch.chdir(ROOT / "notebooks")  # where the kernel runs
    assert report.results_folder() == tmp_path / "runs" / "quick"


@pytest.mark.timeout(240)
@pytest.mark.skipif(not (QUICK / "runs.parquet").exists(),
                    reason="needs the committed quick sweep")
@pytest.mark.dist
def test_the_bandwidth_notebook_widens_its_brackets_with_step_noise(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    from experiments.scoring import step_noise

    monkeypatch.setenv("FLEXBENCH_STEP_NOISE", "1")
    nb = _execute(ROOT / "notebooks" / "bandwidth_sweep.ipynb", QUICK, monkeypatch)
    shown = "".join(str(o.get("text", "")) + str(o.get("data", {}).get("text/markdown", ""))
                    for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "brackets widened by step-time variation" in shown
    assert step_noise.note() in shown
    assert "the time brackets that decided are over seeds widened" in shown


@pytest.mark.timeout(240)
@pytest.mark.dist
def test_the_bandwidth_notebook_takes_every_method(monkeypatch: pytest.MonkeyPatch) -> None:
    """On results/methods (every built-in method), its summary names every variant."""
    import pandas as pd

    methods = ROOT / "results" / "methods"
    nb = _execute(ROOT / "notebooks" / "bandwidth_sweep.ipynb", methods, monkeypatch)
    shown = "".join(str(o.get("data", {}).get("text/markdown", ""))
                    for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    variants = set(pd.read_parquet(methods / "runs.parquet")["variant"])
    assert len(variants) >= 16 and not [v for v in variants if v not in shown]
