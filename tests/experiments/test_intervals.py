"""Intervals over seeds: bootstrap coverage, ranges below three seeds, misses, ties."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from experiments.scoring import intervals, ranking
from experiments.scoring.intervals import Interval, median_interval, ratio_interval


@pytest.mark.timeout(60)
def test_the_bootstrap_interval_covers_the_true_median_about_95_percent_of_the_time() -> None:
    # Seeds drawn from a normal law of median 10 and spread 1: the 95% interval of the median
    # over 10 seeds should hold 10 in about 95% of 400 draws (binomial sd ~1.1%; the percentile
    # bootstrap of a median runs a little narrow at small n, hence the tolerance).
    rng = np.random.default_rng(1)
    trials = 400
    hits = sum(median_interval(rng.normal(10.0, 1.0, 10), resamples=1000, seed=t).includes(10.0)
               for t in range(trials))
    assert 0.91 <= hits / trials <= 0.98
    # Its width follows the spread: ten times the spread, ten times the width (same draws).
    draws = np.random.default_rng(2).normal(0.0, 1.0, 10)
    narrow, wide = median_interval(10 + draws), median_interval(10 + 10 * draws)
    assert wide.high - wide.low == pytest.approx(10 * (narrow.high - narrow.low))


def test_below_three_seeds_the_bracket_is_the_range_and_says_so() -> None:
    two = median_interval([3.0, 5.0])
    assert (two.median, two.low, two.high, two.kind) == (4.0, 3.0, 5.0, "range")
    one = median_interval([3.0])
    assert one.kind == "single" and one.bracket(str) == ""
    assert "2 seeds: the range (min–max), not an interval" in intervals.interval_note({"range"})
    assert median_interval([]).kind == "none"


def test_a_miss_is_inf_stays_in_the_median_and_ranks_last() -> None:
    missed = median_interval([1.0, math.inf, math.inf])
    assert missed.median == math.inf  # never the median of the one run that got there
    times = {"slow": median_interval([50.0, 60.0, 70.0]), "never": missed,
             "fast": median_interval([5.0, 6.0, 7.0]), "nodata": median_interval([])}
    assert intervals.ranked(times) == ["fast", "slow", "never", "nodata"]
    # The baseline misses: a method that reaches the target is infinitely faster; both miss: NaN.
    assert intervals.ratio(math.inf, 3.0) == math.inf
    assert intervals.ratio(3.0, math.inf) == 0.0
    assert math.isnan(intervals.ratio(math.inf, math.inf))


def test_paired_ratios_pair_seeds_and_otherwise_take_every_pair() -> None:
    paired, is_paired = ratio_interval({0: 10.0, 1: 20.0, 2: 30.0}, {0: 5.0, 1: 5.0, 2: 10.0})
    assert is_paired and paired.median == 3.0 and paired.kind == "bootstrap"
    assert 2.0 <= paired.low <= 3.0 <= paired.high <= 4.0
    every, is_paired = ratio_interval({0: 10.0, 1: 20.0}, {7: 5.0})
    assert not is_paired and (every.median, every.low, every.high) == (3.0, 2.0, 4.0)
    # Unpaired from 3 seeds a side: both sides resampled; the bracket holds the pairs' median.
    wide, is_paired = ratio_interval({0: 10.0, 1: 20.0, 2: 30.0}, {5: 5.0, 6: 10.0, 7: 10.0})
    assert not is_paired and wide.kind == "bootstrap" and wide.median == 2.0
    assert 1.0 <= wide.low <= 2.0 <= wide.high <= 6.0


def _runs(rows: list[tuple[str, int, float]]) -> pd.DataFrame:
    frame = pd.DataFrame(rows, columns=["variant", "seed", "time_to_target_s"])
    frame["method"] = frame["variant"]
    frame["network"] = "n"
    return frame


def test_overlapping_intervals_are_a_tie_and_separated_ones_are_clear() -> None:
    close = _runs([(m, s, t) for m, base in (("a", 10.0), ("b", 10.5)) for s, t in
                   enumerate(base + np.array([-1.0, 0.0, 1.0, -0.5, 0.5]))])
    row = ranking.winners(close).iloc[0]
    assert (row["first"], row["runner_up"], row["verdict"]) == ("a", "b", "tie")
    apart = _runs([(m, s, t) for m, base in (("a", 10.0), ("b", 30.0)) for s, t in
                   enumerate(base + np.array([-1.0, 0.0, 1.0, -0.5, 0.5]))])
    row = ranking.winners(apart).iloc[0]
    assert row["verdict"] == "clear" and row["margin_low"] > 1.0
    # Two seeds apart: honest about the count, never "clear".
    two = _runs([("a", 0, 1.0), ("a", 1, 2.0), ("b", 0, 5.0), ("b", 1, 6.0)])
    assert ranking.winners(two).iloc[0]["verdict"] == "apart on 2 seeds"
    # A method that misses on every seed ranks last and stays in the table.
    missed = _runs([("a", 0, math.inf), ("a", 1, math.inf), ("b", 0, 5.0), ("b", 1, 6.0)])
    row = ranking.winners(missed).iloc[0]
    assert (row["first"], row["runner_up"], row["margin_median"]) == ("b", "a", math.inf)


def test_separation_ties_when_the_margin_includes_one() -> None:
    first = Interval(10.0, 9.0, 11.0, 5, "bootstrap")
    second = Interval(12.0, 11.5, 12.5, 5, "bootstrap")
    assert intervals.separation(first, second, Interval(1.2, 1.05, 1.3, 5, "bootstrap")) == "clear"
    assert intervals.separation(first, second, Interval(1.2, 0.95, 1.3, 5, "bootstrap")) == "tie"
