"""How sure a comparison is: medians over seeds with a bootstrap interval, or their range.

A time to target over seeds is summarised by its median and a 95% percentile-bootstrap interval
of that median (numpy, a fixed seed, so a report prints the same numbers every time). A miss is
inf: it stays in the sample, pulls the median up, and ranks last. With fewer than three seeds a
bootstrap only reshuffles two numbers, so the bracket printed is the range (min–max), labelled
as such; one seed gives no bracket at all.

A speed-up is a paired ratio: baseline time / method time per seed where the two share their
seeds (the same data order and init), else over every (baseline seed, method seed) pair. Its
interval is the bootstrap over seeds (over both sides' seeds for all pairs). A comparison whose
interval includes 1 is "no clear winner"; the first two methods whose intervals overlap tie.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

__all__ = ["CONFIDENCE", "MIN_SEEDS", "RESAMPLES", "SAMPLES_COLUMN", "Interval", "interval_note",
           "median_interval", "ranked", "ratio", "ratio_interval", "separation", "time_interval",
           "widened"]

CONFIDENCE = 0.95
RESAMPLES = 2000
MIN_SEEDS = 3  # below this a bootstrap interval pretends more than the data holds: the range
_RNG_SEED = 0  # fixed: a report's brackets do not move between runs of `flexbench report`
# A runs frame column holding, per run, its time to target under resampled step times (an
# array; `experiments.scoring.step_noise`). Present only when asked for (--step-noise).
SAMPLES_COLUMN = "ttt_samples"


@dataclass(frozen=True)
class Interval:
    """A median over seeds with its bracket: a bootstrap interval, the range, or none."""

    median: float
    low: float
    high: float
    n: int
    """Seeds (or seed pairs) the median is over."""
    kind: str
    """"bootstrap" (n >= MIN_SEEDS), "range" (2 seeds: min–max), "single" or "none" (no data);
    "resampled": one seed's bracket over its resampled step times (`widened`)."""

    def includes(self, value: float) -> bool:
        """Whether `value` lies inside the bracket (a NaN bracket includes everything)."""
        if math.isnan(self.low) or math.isnan(self.high):
            return True
        return self.low <= value <= self.high

    def overlaps(self, other: Interval) -> bool:
        """Whether the two brackets share a point (ranges and intervals alike)."""
        if any(math.isnan(v) for v in (self.low, self.high, other.low, other.high)):
            return True
        return self.low <= other.high and other.low <= self.high

    def bracket(self, fmt) -> str:
        """' [low–high]' with `fmt` for each end; '' for a single seed or no data."""
        if self.kind in ("single", "none") or math.isnan(self.low):
            return ""
        return f" [{fmt(self.low)}–{fmt(self.high)}]"


def interval_note(kinds: set[str] | list[str]) -> str:
    """One sentence saying what the brackets of a table are (which kinds it holds)."""
    parts = []
    if "bootstrap" in kinds:
        parts.append(f"{CONFIDENCE:.0%} percentile-bootstrap interval of the median over seeds "
                     f"({RESAMPLES} resamples, fixed seed)")
    if "range" in kinds:
        parts.append("with 2 seeds: the range (min–max), not an interval")
    if "single" in kinds:
        parts.append("one seed: no bracket")
    if "resampled" in kinds:
        parts.append(f"one seed: the {CONFIDENCE:.0%} range of its step-time resamples")
    return "Brackets: " + "; ".join(parts) + "." if parts else ""


def median_interval(values, *, confidence: float = CONFIDENCE,
                    resamples: int = RESAMPLES, seed: int = _RNG_SEED) -> Interval:
    """The median of `values` (inf for a miss) with its bracket over them."""
    data = np.asarray(list(values), dtype=float)
    return _bracketed(data, lambda d: np.median(d, axis=-1), confidence, resamples, seed)


def _bracketed(data: np.ndarray, statistic, confidence: float, resamples: int,
               seed: int) -> Interval:
    """`statistic` of one sample with a bootstrap interval (n >= MIN_SEEDS) or its range."""
    n = int(data.size)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0, "none")
    point = float(statistic(data))
    if np.isnan(data).any():  # an undefined member (both missed) leaves the bracket undefined
        return Interval(point, math.nan, math.nan, n, "single" if n == 1 else "range")
    if n == 1:
        return Interval(point, point, point, 1, "single")
    if n < MIN_SEEDS:
        return Interval(point, float(data.min()), float(data.max()), n, "range")
    rng = np.random.default_rng(seed)
    draws = statistic(data[rng.integers(0, n, size=(resamples, n))])
    low, high = _quantiles(draws, confidence)
    return Interval(point, low, high, n, "bootstrap")


def _quantiles(draws: np.ndarray, confidence: float) -> tuple[float, float]:
    """The two-sided percentile bounds; inverted_cdf never interpolates, so inf stays inf."""
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(draws, [tail, 1.0 - tail], method="inverted_cdf")
    return float(low), float(high)


def widened(interval: Interval, samples: list[np.ndarray], *,
            confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
            seed: int = _RNG_SEED) -> Interval:
    """`interval` (a median over seeds) widened by each seed's resampled times to target.

    `samples` holds, per seed, that run's time to target under resampled step times. One
    seed: the percentile bounds of its samples. Two: the range from the lowest seed's lower
    bound to the highest seed's upper one. From MIN_SEEDS on: a two-level bootstrap (seeds with
    replacement, then one resample of each) of the median. The result never lies inside
    `interval`: it holds the seed bracket and the step-time one.
    """
    if not samples or interval.kind == "none":
        return interval
    if len(samples) == 1:
        low, high = _quantiles(samples[0], confidence)
        kind = "resampled"
    elif len(samples) < MIN_SEEDS:
        bounds = [_quantiles(s, confidence) for s in samples]
        low, high = min(b[0] for b in bounds), max(b[1] for b in bounds)
        kind = interval.kind
    else:
        rng = np.random.default_rng(seed)
        table = np.stack(samples)
        picked = rng.integers(0, table.shape[0], size=(resamples, table.shape[0]))
        column = rng.integers(0, table.shape[1], size=picked.shape)
        low, high = _quantiles(np.median(table[picked, column], axis=-1), confidence)
        kind = interval.kind
    if not math.isnan(interval.low):
        low, high = min(low, interval.low), max(high, interval.high)
    return Interval(interval.median, low, high, interval.n, kind)


def time_interval(runs) -> Interval:
    """One method's median time to target over its runs (a DataFrame) with its bracket: over
    seeds, widened by each run's resampled step times where `runs` has SAMPLES_COLUMN."""
    seeds = median_interval(runs["time_to_target_s"].astype(float))
    if SAMPLES_COLUMN not in runs.columns:
        return seeds
    return widened(seeds, [np.asarray(s, dtype=float) for s in runs[SAMPLES_COLUMN]])


def ratio(baseline_ttt: float, ttt: float) -> float:
    """Speed-up of one run: baseline time / its time; a miss is 0, a baseline miss inf, both NaN."""
    if baseline_ttt is None or math.isnan(baseline_ttt) or math.isnan(ttt):
        return math.nan
    if math.isinf(ttt):
        return math.nan if math.isinf(baseline_ttt) else 0.0
    if math.isinf(baseline_ttt):
        return math.inf
    return baseline_ttt / ttt if ttt > 0 else math.inf


_ratios = np.vectorize(ratio, otypes=[float])


def ratio_interval(baseline: Mapping[object, float], method: Mapping[object, float], *,
                   confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
                   seed: int = _RNG_SEED) -> tuple[Interval, bool]:
    """Median speed-up baseline/method with its bracket, and whether seeds were paired.

    `baseline` and `method` map seed -> time to target. Paired when every seed of `method` has
    a baseline run of the same seed; else every (baseline, method) pair, resampled on both sides.
    """
    if not baseline or not method:
        return Interval(math.nan, math.nan, math.nan, 0, "none"), False
    if set(method) <= set(baseline):
        pairs = _ratios([baseline[s] for s in method], list(method.values()))
        return _bracketed(pairs, _ratio_median, confidence, resamples, seed), True
    base = np.asarray(list(baseline.values()), dtype=float)
    mine = np.asarray(list(method.values()), dtype=float)
    every = _ratios(base[:, None], mine[None, :]).ravel()
    point = float(_ratio_median(every))
    n = min(base.size, mine.size)
    if np.isnan(every).any() or n < MIN_SEEDS:
        kind = "single" if every.size == 1 else "range"
        low, high = (math.nan, math.nan) if np.isnan(every).any() else (every.min(), every.max())
        return Interval(point, float(low), float(high), n, kind), False
    rng = np.random.default_rng(seed)
    draws = np.empty(resamples)
    for i in range(resamples):
        b = base[rng.integers(0, base.size, base.size)]
        m = mine[rng.integers(0, mine.size, mine.size)]
        draws[i] = np.median(_ratios(b[:, None], m[None, :]))
    low, high = _quantiles(draws, confidence)
    return Interval(point, low, high, n, "bootstrap"), False


def _ratio_median(ratios: np.ndarray) -> np.ndarray:
    """Median speed-up over the pairs where one side reached the target (both missed: NaN,
    left out of the median, as a pandas median over seeds leaves it; the bracket is then NaN)."""
    if np.isnan(ratios).all():
        return np.full(ratios.shape[:-1], np.nan)
    return np.nanmedian(ratios, axis=-1)


def ranked(times: Mapping[str, Interval]) -> list[str]:
    """Names by median time to target, fastest first; a miss (inf) and no data (NaN) last."""
    def key(name: str) -> tuple[int, float]:
        m = times[name].median
        return (2, 0.0) if math.isnan(m) else (1, 0.0) if math.isinf(m) else (0, m)

    return sorted(times, key=key)


def separation(first: Interval, second: Interval, margin: Interval) -> str:
    """'clear', 'tie', or 'apart on n seeds' (disjoint ranges, too few seeds for an interval).

    `margin` is the runner-up's time over the first's (a ratio interval); the two are a tie
    when it includes 1 or when their time intervals overlap.
    """
    if math.isinf(first.median) and math.isinf(second.median):
        return "tie"  # neither reaches the target
    if margin.includes(1.0) or first.overlaps(second) or margin.kind == "none":
        return "tie"
    if "bootstrap" == first.kind == second.kind == margin.kind:
        return "clear"
    return f"apart on {min(first.n, second.n)} seed{'s' if min(first.n, second.n) > 1 else ''}"
