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

    def __init__(self, wall_step_s: float = 0.0) -> None:
        self.requested: list[float] = []
        self._module: types.ModuleType | None = None
        self.wall_step_s = wall_step_s  # the wall clock as if set forward by this much

    def time(self) -> float:
        return time.time() + self.wall_step_s

    def monotonic(self) -> float:
        return time.monotonic()

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


def assert_link_goodput(result: dict, high: float = 1.15) -> None:
    """A kernel-shaped link (netsim.kernel_probe's result) runs at its rate and no faster.

    What the code controls is bounded both ways: every qdisc carries the rate that was asked
    for, as tc reports it (which catches bits taken for bytes or the wrong node's rate, the
    slow side a wall-clock lower bound used to guard), and every qdisc carried the payload, so
    the traffic went through the shaping. The one wall-clock bound is the one load cannot
    push: the fastest repeat moves no more than `high` x the rate (catching a link that is not
    shaped, or shaped too fast); load only slows a repeat down.
    """
    for key, asked in result["asked_rates_bps"].items():
        shown = result["qdisc_rates_bps"].get(key)
        assert shown is not None and abs(shown - asked) <= 0.01 * asked, (key, asked, result)
        assert result["qdisc_sent_bytes"][key] >= result["repeats"] * result[
            "wire_bytes_each_way"], (key, result)
    best = result["wire_bytes_each_way"] / min(result["times_s"])
    pace = result["goodput_bps"] / result["goodput_ratio"]  # the rate the ratio is taken to
    assert best / pace <= high, result
