"""Helpers for the `timing` tests: bound what the code controls, not what a loaded machine takes.

A loaded machine stretches every wall-clock interval (a late wake-up, a slow peer), never shrinks
one. So the timing tests keep lower bounds on shaped durations, and where they need an upper
bound they take it from the code's own figures: the sleeps the shaper asked for, the compute a
trace recorded, the modeled seconds of each op.
"""

from __future__ import annotations

import time
import types


class SleepLog:
    """Stands in for a module's `time`: the same clock, but every sleep requested is logged.

    `install(module)` swaps it in for `module.time` (e.g. netsim.shaping.work, whose wall hold
    sleeps in slices until the modeled finish); `remove()` puts the real module back.
    """

    def __init__(self) -> None:
        self.requested: list[float] = []
        self._module: types.ModuleType | None = None

    def time(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        self.requested.append(float(seconds))
        time.sleep(seconds)

    def install(self, module: types.ModuleType) -> SleepLog:
        self._module = module
        module.time = self
        return self

    def remove(self) -> None:
        if self._module is not None:
            self._module.time = time
            self._module = None

    def total(self) -> float:
        return sum(self.requested)


def assert_link_goodput(result: dict, low: float = 0.85, high: float = 1.15) -> None:
    """A kernel-shaped link's goodput (netsim.kernel_probe's result) is close to its rate.

    Taken on the fastest repeat: load only slows a repeat down, so the fastest is the one
    nearest to what the link allows. The upper bound cannot be pushed by load at all and
    catches a link that is not shaped (or shaped too fast); the lower bound catches one shaped
    far too slow (bits taken for bytes, the wrong node's rate) unless load slowed every one of
    the repeats by more than 15 %, which the link's seconds per repeat make unlikely.
    """
    best = result["wire_bytes_each_way"] / min(result["times_s"])
    pace = result["goodput_bps"] / result["goodput_ratio"]  # the rate the ratio is taken to
    assert low <= best / pace <= high, result
