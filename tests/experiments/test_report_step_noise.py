"""`flexbench report --step-noise`: brackets widened by each unit's recorded step-time spread,
and the tie/clear verdicts decided on the widened brackets."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.experiments.sweep_fakes import ensure_units_module, fake_launch, fake_simulate
from tests.experiments.test_sweep import CONFIG

ensure_units_module()

from experiments import cli, sweep  # noqa: E402
from experiments.report import metrics, step_times  # noqa: E402
from experiments.scoring import intervals, ranking, speedups, targets  # noqa: E402  # noqa: E402

STEPS = 100
TARGET_STEP = 50  # the evaluation at step 50 is the first at or below the target
COMPUTE_S = 0.2
TARGET = 2.0


def _unit(unit: str, variant: str, seed: int, comm_s: float,
          sigma: float) -> tuple[dict, pd.DataFrame]:
    """One simulated unit: a runs row and its steps (compute COMPUTE_S + sigma x a fixed normal
    draw per step, the same draw for every unit, and comm_s of link time per step)."""
    z = np.random.default_rng(3).standard_normal(STEPS)
    compute = COMPUTE_S + sigma * (z - z.mean())
    step = np.arange(1, STEPS + 1)
    loss = np.where(step % 5 == 0, 3.0 - 0.1 * step / 5 - 1e-9, np.nan)
    steps = pd.DataFrame({"step": step, "compute_s": compute, "val_loss": loss,
                          "time_s": np.cumsum(compute + comm_s), "unit": unit,
                          "network": "n", "source": "sim"})
    ttt = targets.time_to_target(steps["time_s"], steps["val_loss"], TARGET)
    assert ttt == pytest.approx(steps["time_s"].iloc[TARGET_STEP - 1])
    row = {"unit": unit, "variant": variant, "method": variant, "seed": seed, "network": "n",
           "source": "sim", "status": "done", "time_to_target_s": ttt, "reached": True,
           "target_val_loss": TARGET}
    return row, steps


def _sweep(sigma: float, seeds: int = 5) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Two methods whose seeds alone separate them: 'fast' spends 0.05 s + 1 ms x seed on the
    link per step, 'slow' 0.06 s + 1 ms x seed (4% slower, every seed)."""
    made = [_unit(f"{v}-s{s}", v, s, comm + 0.001 * s, sigma)
            for v, comm in (("fast", 0.05), ("slow", 0.06)) for s in range(seeds)]
    return (pd.DataFrame([r for r, _ in made]),
            pd.concat([s for _, s in made], ignore_index=True))


@pytest.mark.timeout(60)
def test_one_units_bracket_is_its_step_time_spread() -> None:
    sigma = 0.02
    runs, steps = _sweep(sigma, seeds=1)
    table = speedups.speedups(step_times.with_step_noise(runs, steps), by=("network",))
    row = table.set_index("variant").loc["fast"]
    assert row["ttt_interval"] == "resampled"
    # The sum over the 50 steps to the target of block-resampled compute: sd sigma sqrt(50).
    spread = steps.loc[steps["unit"] == "fast-s0", "compute_s"].std(ddof=0) * math.sqrt(50)
    assert row["ttt_high_s"] - row["ttt_low_s"] == pytest.approx(2 * 1.96 * spread, rel=0.3)
    assert row["ttt_low_s"] < row["ttt_median_s"] < row["ttt_high_s"]
    plain = speedups.speedups(runs, by=("network",)).set_index("variant").loc["fast"]
    assert plain["ttt_low_s"] == plain["ttt_high_s"] == row["ttt_median_s"]


@pytest.mark.timeout(60)
def test_a_clear_lead_over_seeds_is_a_tie_once_the_step_times_vary() -> None:
    runs, steps = _sweep(sigma=0.05)
    seeds = ranking.winners(runs).iloc[0]
    assert (seeds["first"], seeds["runner_up"], seeds["verdict"]) == ("fast", "slow", "clear")
    assert seeds["decided_by"] == ranking.SEEDS_ONLY
    noisy = step_times.with_step_noise(runs, steps)
    widened = ranking.winners(noisy).iloc[0]
    assert (widened["first"], widened["verdict"]) == ("fast", "tie")
    assert widened["decided_by"] == ranking.WITH_STEP_NOISE
    # The margin is over seeds alone: the same either way; the time brackets moved.
    assert widened["margin_low"] == seeds["margin_low"]
    before = speedups.speedups(runs, by=("network",)).set_index("variant")
    after = speedups.speedups(noisy, by=("network",)).set_index("variant")
    assert (after["ttt_low_s"] < before["ttt_low_s"]).all()
    assert (after["ttt_high_s"] > before["ttt_high_s"]).all()
    assert (after["ttt_median_s"] == before["ttt_median_s"]).all()
    assert "widened by each run's recorded step-time variation" in metrics.winners_markdown(
        ranking.winners(noisy))
    # Without spread the widening changes nothing: the verdict stays the seeds'.
    still = ranking.winners(step_times.with_step_noise(*_sweep(sigma=0.0))).iloc[0]
    assert still["verdict"] == "clear"


@pytest.mark.timeout(60)
def test_a_miss_adds_no_width() -> None:
    runs, steps = _sweep(sigma=0.05, seeds=1)
    runs.loc[runs["variant"] == "slow", ["time_to_target_s", "reached"]] = [math.inf, False]
    noisy = step_times.with_step_noise(runs, steps)
    samples = noisy.set_index("variant").loc["slow", intervals.SAMPLES_COLUMN]
    assert np.isinf(samples).all()


@pytest.fixture(scope="module")
def fake_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("noise")
    (root / "t.toml").write_text(CONFIG)
    out = root / "res"
    sweep.run_sweep(sweep.load_config(root / "t.toml"), out, launcher=fake_launch,
                    simulator=fake_simulate, progress=False)
    return out


@pytest.mark.timeout(120)
def test_report_step_noise_says_so_and_the_default_report_does_not(fake_sweep: Path,
                                                                   tmp_path: Path) -> None:
    noisy = tmp_path / "noisy"
    shutil.copytree(fake_sweep, noisy)
    assert cli.main(["report", str(fake_sweep)]) == 0
    assert cli.main(["report", str(noisy), "--step-noise"]) == 0
    plain = (fake_sweep / "summary.md").read_text()
    widened = (noisy / "summary.md").read_text()
    from experiments.scoring import step_noise

    assert step_noise.note() not in plain and "--step-noise" not in plain
    assert step_noise.note() in widened
    assert "the time brackets that decided are over seeds widened" in widened
    # speedups.parquet stays over seeds: the same file either way.
    pd.testing.assert_frame_equal(pd.read_parquet(fake_sweep / "speedups.parquet"),
                                  pd.read_parquet(noisy / "speedups.parquet"))


@pytest.mark.timeout(120)
def test_report_step_noise_refuses_a_unit_without_compute_and_writes_nothing(
    fake_sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(fake_sweep, bare, ignore=shutil.ignore_patterns("figures", "summary.md"))
    steps = pd.read_parquet(bare / "steps.parquet")
    steps.drop(columns=["compute_s"]).to_parquet(bare / "steps.parquet", index=False)
    before = sorted(p.relative_to(bare) for p in bare.rglob("*"))
    assert cli.main(["report", str(bare), "--step-noise"]) == 2
    err = capsys.readouterr().err
    assert "has no finite compute per step (compute_s)" in err and err.count(".") <= 3
    assert sorted(p.relative_to(bare) for p in bare.rglob("*")) == before
    assert cli.main(["report", str(bare), "--step-noise=yes"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("argument --step-noise: ignored explicit argument 'yes'")
    assert len(err.splitlines()) == 1


QUICK = Path(__file__).resolve().parents[2] / "results" / "quick"


@pytest.mark.timeout(180)
@pytest.mark.skipif(not (QUICK / "runs.parquet").exists(), reason="needs results/quick")
def test_at_a_grid_point_the_reports_widened_brackets_are_compares() -> None:
    from experiments.replay import compare, compare_cli

    argv = ["compare", str(QUICK), "--inter-bw", "100Mbit", "--inter-lat", "20ms",
            "--step-noise"]
    args = cli.build_parser(argv).parse_args(argv)
    (target,) = compare_cli.grid_targets(args)
    result = compare.compare(compare_cli.question_of(args), target)
    runs = pd.read_parquet(QUICK / "runs.parquet")
    steps = pd.read_parquet(QUICK / "steps.parquet")
    sim = runs[(runs["source"] == "sim") & (runs["network"] == "100Mbit / 20ms")]
    table = speedups.speedups(step_times.with_step_noise(sim, steps), by=("network",))
    mine, theirs = table.set_index("variant"), result.table.set_index("variant")
    for column in ("ttt_median_s", "ttt_low_s", "ttt_high_s"):
        pd.testing.assert_series_equal(mine[column].sort_index(), theirs[column].sort_index(),
                                       rtol=1e-9)
    assert (mine["ttt_high_s"] - mine["ttt_low_s"] > 0).all()
