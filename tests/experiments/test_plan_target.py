"""Time to target in a plan: only from a stated source of steps, never a guess."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from experiments.cli import main

ROOT = Path(__file__).resolve().parents[2]
QUICK = ROOT / "results/quick/units"
BASE = ["plan", "--model", "lm-tiny", "--nodes", "2", "--gpus-per-node", "2",
        "--step-compute", "0.2", "--inter-bw", "1Gbit", "--inter-lat", "1ms"]


def test_without_a_source_no_time_is_planned(tmp_path, capsys):
    assert main([*BASE, "--method", "flexdemo", "--out", str(tmp_path / "p.csv")]) == 0
    assert "time_to_target_s" not in pd.read_csv(tmp_path / "p.csv").columns
    assert "time to target: not planned, as no steps are stated" in capsys.readouterr().out


def test_given_steps_times_the_step_time(tmp_path, capsys):
    assert main([*BASE, "--method", "flexdemo", "diloco", "--steps-to-target", "flexdemo=300",
                 "--out", str(tmp_path / "p.csv")]) == 0
    frame = pd.read_csv(tmp_path / "p.csv").set_index("method")
    assert frame.loc["flexdemo", "time_to_target_s"] == pytest.approx(
        300 * frame.loc["flexdemo", "step_time_s"])
    assert frame["time_to_target_s"].isna()["diloco"]  # no steps stated for it: no number
    out = capsys.readouterr().out
    assert "time to target of flexdemo: 300 steps (--steps-to-target, as given)" in out
    assert "time to target of diloco: not planned" in out


def test_steps_from_recordings_of_the_planned_workload(tmp_path, capsys):
    runs = [str(QUICK / f"diloco-s{s}") for s in (0, 1)]
    reached = []
    for run in runs:
        steps = pd.read_parquet(f"{run}/steps.parquet")
        hit = steps[steps["val_loss"] <= 3.0]
        reached.append(int(hit["step"].iloc[0]))
    assert main([*BASE, "--method", "diloco", "--steps-from", *runs, "--target", "3.0",
                 "--out", str(tmp_path / "p.csv")]) == 0
    row = pd.read_csv(tmp_path / "p.csv").iloc[0]
    assert row["steps_to_target"] == pytest.approx(sum(reached) / 2)
    assert row["time_to_target_s"] == pytest.approx(row["steps_to_target"] * row["step_time_s"])
    assert "val_loss <= 3 first reached at step" in capsys.readouterr().out


@pytest.mark.parametrize(("extra", "words"), [
    (["--steps-from", str(QUICK / "diloco-s0"), "--target", "3", "--model", "lm-small"],
     "trained workload 'lm-tiny', not --model 'lm-small'"),
    (["--steps-from", str(QUICK / "diloco-s0")], "--steps-from needs --target LOSS"),
    (["--steps-from", str(QUICK / "hsdp-adamw-s0"), "--target", "3"], "which is not planned"),
    (["--steps-from", str(QUICK / "diloco-s0"), "--target", "0.01"], "never reaches --target"),
    (["--steps-to-target", "0"], "must be a whole number of steps >= 1"),
    (["--steps-to-target", "gossip=10"], "names 'gossip', which is not planned"),
    (["--target", "3"], "give them as --steps-from RUN"),
])
def test_a_bad_steps_source_is_one_sentence_and_writes_nothing(tmp_path, capsys, extra, words):
    base = [*BASE]
    if "--model" in extra:  # a flag given twice is refused: this case's --model replaces BASE's
        del base[1:3]
    argv = [*base, "--method", "diloco", *extra, "--out", str(tmp_path / "p.csv")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []
