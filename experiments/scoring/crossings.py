"""Where two methods' times to target change order: the crossover bandwidth and node count.

Between two bandwidths where a method's and the baseline's times to target change order, the
point where log(t_method / t_baseline) = 0 is found by regula falsi (Illinois) on log bandwidth,
to RTOL; between two node counts, by bisection over whole node counts. Each time is a function
(a replay), so these hold no data of their own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["FTOL", "RTOL", "Crossing", "TimeAt", "crossover_bandwidth", "crossover_nodes",
           "crossings"]

RTOL = 0.005  # relative bandwidth tolerance of a crossover: 0.5%, far inside any seed spread
FTOL = 1e-4  # or: the two times to target within 0.01% of each other
_MAX_EVALS = 40

# bandwidth (bytes/s) -> time to target (s)
TimeAt = Callable[[float], float]


@dataclass(frozen=True)
class Crossing:
    """A bandwidth where a method's time to target equals the baseline's, and its side."""

    bandwidth: float
    """bytes/s."""
    faster: str
    """"below" (the method is faster at lower bandwidths) or "above"."""


def _gap(method: TimeAt, baseline: TimeAt) -> Callable[[float], float]:
    """log(t_method / t_baseline) at log bandwidth x: < 0 where the method is faster."""
    def gap(x: float) -> float:
        bw = math.exp(x)
        return math.log(method(bw) / baseline(bw))

    return gap


def crossover_bandwidth(method: TimeAt, baseline: TimeAt, low: float, high: float, *,
                        rtol: float = RTOL, ftol: float = FTOL,
                        ends: tuple[float, float] | None = None) -> float:
    """The bandwidth in [low, high] (bytes/s) where the two times to target are equal.

    Found to `rtol` in bandwidth, or where the two times differ by less than `ftol` (relative).
    NaN when they do not change order between `low` and `high`. `ends` are the gaps
    log(t_method / t_baseline) at low and high when already known (a sweep's grid points).
    """
    gap = _gap(method, baseline)
    a, b = math.log(low), math.log(high)
    fa, fb = ends if ends is not None else (gap(a), gap(b))
    if fa == 0.0 or fb == 0.0:
        return low if fa == 0.0 else high
    if not (np.isfinite(fa) and np.isfinite(fb)) or (fa > 0) == (fb > 0):
        return math.nan
    moved = 0  # Illinois: the end that stayed twice in a row has its weight halved
    for _ in range(_MAX_EVALS):
        x = (a * fb - b * fa) / (fb - fa)
        if b - a <= math.log1p(rtol):
            return math.exp(x)
        fx = gap(x)
        if abs(fx) <= ftol:
            return math.exp(x)
        if (fx > 0) == (fb > 0):
            b, fb = x, fx
            fa, moved = (fa / 2 if moved == 1 else fa), 1
        else:
            a, fa = x, fx
            fb, moved = (fb / 2 if moved == -1 else fb), -1
    return math.exp((a * fb - b * fa) / (fb - fa))


def crossings(grid: list[float], method: TimeAt, baseline: TimeAt, *,
              known: tuple[list[float], list[float]] | None = None,
              rtol: float = RTOL) -> list[Crossing]:
    """Every crossover between consecutive `grid` bandwidths (sorted), lowest first.

    `known` gives the two times at the grid points when already computed (else they are)."""
    grid = sorted(grid)
    t_method, t_base = known if known is not None else (
        [method(bw) for bw in grid], [baseline(bw) for bw in grid])
    gaps = [math.log(m / b) if 0 < m < math.inf and 0 < b < math.inf else math.nan
            for m, b in zip(t_method, t_base, strict=True)]
    found = []
    for i in range(len(grid) - 1):
        lo, hi = gaps[i], gaps[i + 1]
        if not (np.isfinite(lo) and np.isfinite(hi)) or (lo < 0) == (hi < 0):
            continue
        bw = crossover_bandwidth(method, baseline, grid[i], grid[i + 1], rtol=rtol,
                                 ends=(lo, hi))
        found.append(Crossing(bw, "below" if lo < 0 else "above"))
    return found


def crossover_nodes(method: Callable[[int], float], baseline: Callable[[int], float],
                    low: int, high: int) -> int | None:
    """The first node count in (low, high] from which the method and baseline keep the order
    they have at `high` (method faster or not), by bisection over whole node counts.

    `method` and `baseline` map a node count to a time to target. None when the order at
    `low` is already the order at `high` (no swap between them); like `crossover_bandwidth`
    it assumes one swap between the two ends.
    """
    def faster(n: int) -> bool:
        return method(n) < baseline(n)

    side = faster(high)
    if low >= high or faster(low) == side:
        return None
    while high - low > 1:  # invariant: faster(low) != side == faster(high)
        middle = (low + high) // 2
        if faster(middle) == side:
            high = middle
        else:
            low = middle
    return high
