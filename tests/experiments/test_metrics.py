"""Time-to-target, the default target, speed-ups and tables."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from experiments.report import metrics
from experiments.scoring import formats, speedups, targets


@pytest.mark.timeout(10)
def test_time_to_target_takes_the_first_evaluation_at_or_below_target() -> None:
    times = [1.0, 2.0, 3.0, 4.0, 5.0]
    losses = [math.nan, 3.0, math.nan, 2.0, 1.0]
    assert targets.time_to_target(times, losses, 2.0) == 4.0  # equal counts as reached
    assert targets.time_to_target(times, losses, 3.5) == 2.0
    # Steps without an evaluation never count, even if the training loss would be lower.
    assert targets.time_to_target(times, losses, 0.5) == math.inf
    assert targets.time_to_target([], [], 1.0) == math.inf


@pytest.mark.timeout(10)
def test_time_to_target_rejects_a_target_that_is_not_a_number() -> None:
    with pytest.raises(ValueError, match="target must be a number"):
        targets.time_to_target([1.0], [1.0], math.nan)
    with pytest.raises(ValueError, match="differ in length"):
        targets.time_to_target([1.0, 2.0], [1.0], 1.0)


@pytest.mark.timeout(10)
def test_default_target_is_baseline_median_plus_two_percent() -> None:
    finals = pd.DataFrame({"method": ["hsdp-adamw"] * 3 + ["flexdemo"],
                           "final_val_loss": [3.0, 2.0, 10.0, 0.1]})
    assert targets.default_target(finals) == pytest.approx(3.0 * 1.02)
    with pytest.raises(ValueError, match="no finished 'hsdp-adamw' run"):
        targets.default_target(finals[finals["method"] == "flexdemo"])


def _runs(rows: list[tuple[str, int, str, float]]) -> pd.DataFrame:
    frame = pd.DataFrame(rows, columns=["method", "seed", "network", "time_to_target_s"])
    frame["variant"] = frame["method"]
    frame["source"] = "sim"
    frame["reached"] = frame["time_to_target_s"].map(math.isfinite)
    return frame


@pytest.mark.timeout(10)
def test_speedups_pair_seeds_and_report_spread_over_them() -> None:
    runs = _runs([
        ("hsdp-adamw", 0, "slow", 10.0), ("hsdp-adamw", 1, "slow", 30.0),
        ("hsdp-adamw", 2, "slow", 20.0),
        ("flexdemo", 0, "slow", 5.0), ("flexdemo", 1, "slow", 4.0),
        ("flexdemo", 2, "slow", math.inf),
        ("hsdp-adamw", 0, "fast", math.inf), ("hsdp-adamw", 1, "fast", math.inf),
        ("flexdemo", 0, "fast", 2.0), ("flexdemo", 1, "fast", math.inf),
    ])
    table = speedups.speedups(runs).set_index(["network", "variant"])
    slow = table.loc[("slow", "flexdemo")]
    assert slow["baseline_ttt_s"] == 20.0
    # paired by seed: 10/5 = 2, 30/4 = 7.5, not reached = 0  -> median 2, min 0, max 7.5
    assert (slow["speedup_median"], slow["speedup_min"], slow["speedup_max"]) == (2.0, 0.0, 7.5)
    assert slow["paired"] and slow["speedup_interval"] == "bootstrap"
    assert 0.0 <= slow["speedup_low"] <= 2.0 <= slow["speedup_high"] <= 7.5
    assert slow["reached"] == 2 and slow["seeds"] == 3
    # The miss stays in the median: (4, 5, inf) -> 5, never the median of the two that reached.
    assert slow["ttt_median_s"] == 5.0 and slow["ttt_max_s"] == math.inf
    base = table.loc[("slow", "hsdp-adamw")]
    assert (base["speedup_median"], base["speedup_min"], base["speedup_max"]) == (1.0, 1.0, 1.0)
    fast = table.loc[("fast", "flexdemo")]
    # The baseline never reaches the target: reaching it is an infinite speed-up; neither is NaN.
    assert fast["speedup_max"] == math.inf
    assert math.isnan(table.loc[("fast", "hsdp-adamw"), "speedup_median"])
    assert fast["ttt_interval"] == "range" and fast["speedup_interval"] == "range"


@pytest.mark.timeout(10)
def test_speedups_over_every_pair_when_the_seeds_differ() -> None:
    runs = _runs([("hsdp-adamw", 0, "n", 10.0), ("hsdp-adamw", 1, "n", 20.0),
                  ("flexdemo", 5, "n", 5.0), ("flexdemo", 6, "n", 10.0)])
    row = speedups.speedups(runs).set_index("variant").loc["flexdemo"]
    # pairs: 10/5, 10/10, 20/5, 20/10 = 2, 1, 4, 2 -> median 2, range 1..4
    assert not row["paired"]
    assert (row["speedup_median"], row["speedup_low"], row["speedup_high"]) == (2.0, 1.0, 4.0)


@pytest.mark.timeout(10)
def test_pivot_keeps_first_seen_order_and_markdown_renders_it() -> None:
    table = pd.DataFrame({"variant": ["b", "a", "b", "a"], "network": ["x", "x", "y", "y"],
                          "cell": ["1", "2", "3", "4"]})
    wide = metrics.pivot(table, "cell")
    assert list(wide.index) == ["b", "a"] and list(wide.columns) == ["x", "y"]
    text = formats.markdown_table(wide, index_name="method")
    assert text.splitlines() == ["| method | x | y |", "| --- | --- | --- |", "| b | 1 | 3 |",
                                 "| a | 2 | 4 |"]


@pytest.mark.timeout(10)
def test_formatting_spells_out_not_reached() -> None:
    assert formats.format_seconds(math.inf) == "not reached"
    assert formats.format_seconds(math.nan) == "-"
    assert formats.format_seconds(12.34) == "12.3 s"
    assert formats.format_seconds(0.25) == "250 ms"
    assert formats.format_speedup(2.0, 1.5, 3.0) == "2.00× [1.50–3.00]"
    assert formats.format_speedup(2.0, 2.0, 2.0) == "2.00×"


def test_pareto_front_keeps_points_nothing_beats_on_both_axes() -> None:
    from experiments.report.metrics import pareto_front

    costs = [10.0, 100.0, 1000.0, 100.0, 5.0]
    losses = [3.0, 2.5, 2.0, 2.7, float("nan")]
    # (100, 2.7) is beaten by (100, 2.5); a NaN loss is never on the front.
    assert pareto_front(costs, losses) == [True, True, True, False, False]
