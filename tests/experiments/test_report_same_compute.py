"""`flexbench report --same-compute`: its tables are compare's on the same basis; its refusals.

The sweep is a slice of the committed results/quick (hsdp-adamw and flexdemo, two seeds each, at
100Mbit / 1ms, 1Gbit / 1ms and 100Mbit / 20ms, and the shaped flexdemo run at 100Mbit / 20ms): a
few replays only.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from experiments import cli
from experiments.replay import compare, compare_cli
from experiments.report import metrics
from experiments.scoring import speedups

ROOT = Path(__file__).resolve().parents[2]
QUICK = ROOT / "results" / "quick"
UNITS = ["hsdp-adamw-s0", "hsdp-adamw-s1", "flexdemo-s0", "flexdemo-s1",
         "flexdemo-s0-100Mbit_20ms"]
NETWORKS = {"100Mbit / 1ms": ("100Mbit", "1ms"), "1Gbit / 1ms": ("1Gbit", "1ms"),
            "100Mbit / 20ms": ("100Mbit", "20ms")}
pytestmark = pytest.mark.skipif(not (QUICK / "runs.parquet").exists(),
                                reason="needs the committed results/quick sweep")


def _slice(out: Path) -> Path:
    """A sweep folder holding UNITS of results/quick at NETWORKS, as the sweep scored them."""
    (out / "units").mkdir(parents=True)
    for unit in UNITS:
        shutil.copytree(QUICK / "units" / unit, out / "units" / unit)
    for name in ("runs", "steps"):
        frame = pd.read_parquet(QUICK / f"{name}.parquet")
        keep = frame["unit"].isin(UNITS) & frame["network"].isin(NETWORKS)
        frame[keep].to_parquet(out / f"{name}.parquet", index=False)
    shutil.copy(QUICK / "sweep.json", out / "sweep.json")
    return out


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _slice(tmp_path_factory.mktemp("same-compute") / "quick")


def _compare(*argv: str) -> compare.Comparison:
    """The comparison `flexbench compare ARGV` prints (one network)."""
    args = cli.build_parser(["compare", *argv]).parse_args(["compare", *argv])
    (target,) = compare_cli.grid_targets(args)
    return compare.compare(compare_cli.question_of(args), target)


@pytest.mark.timeout(240)
def test_report_on_one_basis_equals_compare_and_without_it_is_unchanged(
    sweep: Path, capsys: pytest.CaptureFixture
) -> None:
    scored = (sweep / "runs.parquet").read_bytes()
    assert cli.main(["report", str(sweep), "--same-compute", "all"]) == 0
    assert str(sweep / "compute_basis.json") in capsys.readouterr().out.split()
    table = pd.read_parquet(sweep / "speedups.parquet")
    assert set(table["same_compute"]) == {"all"}
    summary = (sweep / "summary.md").read_text()
    for network, (bw, lat) in NETWORKS.items():
        result = _compare(str(sweep), "--inter-bw", bw, "--inter-lat", lat,
                          "--same-compute", "all")
        mine = table[(table["network"] == network) & (table["source"] == "sim")]
        mine = mine.set_index("variant").sort_index()
        theirs = result.table.set_index("variant").sort_index()
        for column in ("ttt_median_s", "ttt_low_s", "ttt_high_s", "speedup_median"):
            pd.testing.assert_series_equal(mine[column], theirs[column], rtol=1e-12)
    # The basis is compare's sentence, named in every table's line and in compute_basis.json.
    line = ("Compute basis: `--same-compute all`, "
            + result.compute_basis.removeprefix("compute basis: "))
    assert "one compute per step for every run" in line
    assert summary.count(line) == 3 and metrics.COMPUTE_BASIS not in summary
    recorded = json.loads((sweep / "compute_basis.json").read_text())
    assert recorded["same_compute"] == "all" and recorded["compute_basis"] == result.compute_basis
    assert len(set(recorded["compute_per_step_s"].values())) == 1
    # The validation table stays on the units' own compute: the sweep's simulated time there.
    shaped_row = next(row for row in (QUICK / "summary.md").read_text().splitlines()
                      if row.startswith("| flexdemo seed 0 @ 100Mbit / 20ms |"))
    assert metrics.VALIDATION_BASIS in summary and shaped_row in summary
    assert (sweep / "runs.parquet").read_bytes() == scored  # the sweep's record stays
    # Without the flag: each unit's own compute, the sweep's own numbers, no basis file left.
    assert cli.main(["report", str(sweep)]) == 0
    summary = (sweep / "summary.md").read_text()
    assert summary.count(metrics.COMPUTE_BASIS) == 3 and "--same-compute all`" not in summary
    assert not (sweep / "compute_basis.json").exists()
    runs = pd.read_parquet(sweep / "runs.parquet")
    pd.testing.assert_frame_equal(pd.read_parquet(sweep / "speedups.parquet"),
                                  speedups.sweep_speedups(runs))


@pytest.mark.timeout(60)
def test_same_compute_method_names_each_methods_compute(sweep: Path) -> None:
    from experiments.replay.on_basis import replay_on_basis
    from experiments.report import load_results

    res = load_results(sweep)
    sim = res.runs[(res.runs["source"] == "sim") & (res.runs["network"] == "1Gbit / 1ms")]
    on = replay_on_basis(str(sweep), sim, res.steps, "method")
    result = _compare(str(sweep), "--inter-bw", "1Gbit", "--inter-lat", "1ms",
                      "--same-compute", "method")
    mine = on.runs.set_index(["variant", "seed"])["time_to_target_s"].sort_index()
    theirs = result.runs.set_index(["variant", "seed"])["time_to_target_s"].sort_index()
    pd.testing.assert_series_equal(mine, theirs, rtol=1e-12, check_names=False)
    assert on.summary_line.startswith("Compute basis: `--same-compute method`, each method's "
                                      "median recorded compute per step over its seeds (")
    assert set(on.per_variant) == {"hsdp-adamw", "flexdemo"}


@pytest.mark.timeout(60)
def test_report_same_compute_refusals_write_nothing(
    sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # Refused by its parser in one line, as compare refuses it.
    assert cli.main(["report", str(sweep), "--same-compute", "each"]) == 2
    assert "invalid choice: 'each' (choose from 'method', 'all')" in capsys.readouterr().err
    # A unit changed since the sweep scored it: refused before any replay.
    changed = _slice(tmp_path / "changed")
    meta = changed / "units" / "flexdemo-s1" / "run.json"
    meta.write_text(meta.read_text() + "\n")
    assert cli.main(["report", str(changed), "--same-compute", "all"]) == 2
    err = capsys.readouterr().err
    assert "unit 'flexdemo-s1'" in err and "has changed" in err and len(err.splitlines()) == 1
    # Two targets (two baseline clusters): compare ranks one; refused in one sentence.
    runs = pd.read_parquet(sweep / "runs.parquet")
    two = tmp_path / "two"
    shutil.copytree(sweep, two, ignore=shutil.ignore_patterns("figures", "summary.md",
                                                              "speedups.parquet"))
    runs.loc[runs["method"] == "flexdemo", "target_val_loss"] += 0.1
    runs.to_parquet(two / "runs.parquet", index=False)
    assert cli.main(["report", str(two), "--same-compute", "method"]) == 2
    err = capsys.readouterr().err
    assert "scores against 2 targets" in err and len(err.splitlines()) == 1
    # No target (the baseline never finished): the report's tables stand on the sweep's own.
    none = tmp_path / "none"
    shutil.copytree(two, none)
    runs["target_val_loss"] = float("nan")
    runs.to_parquet(none / "runs.parquet", index=False)
    assert cli.main(["report", str(none), "--same-compute", "all"]) == 2
    err = capsys.readouterr().err
    assert "has none (its baseline never finished)" in err and len(err.splitlines()) == 1
    for folder in (changed, two, none):
        assert not (folder / "figures").exists() and not (folder / "summary.md").exists()
