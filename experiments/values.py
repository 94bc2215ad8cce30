"""The kinds of number a flag or config key may take, each with the one check refusing the rest.

A flag gets its kind as its argparse type (``type=POSITIVE.arg``), a config key through
``Kind.check``; both refuse infinities, NaN and values outside the kind's range with one sentence
naming the value and what is allowed. Every numeric flag of every `flexbench` subcommand and
every numeric run setting names one (tests/experiments/test_values.py finds any that does not).
Torch-free: checked before anything is imported or written.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

from experiments.errors import ConfigError

__all__ = ["AT_LEAST_ONE", "AT_LEAST_ZERO", "COUNT", "FRACTION", "INT64_MAX", "INTEGER", "NUMBER",
           "POSITIVE", "POSITIVE_INT", "SEED", "UNIT_CLOSED", "UNIT_OPEN_LOW", "Kind", "kind_of",
           "BANDWIDTH", "LATENCY", "Quantity"]


@dataclass(frozen=True)
class Kind:
    """A kind of number: integer or real, finite, between bounds that are open or closed."""

    integer: bool
    low: float
    low_open: bool = False
    high: float = math.inf
    high_open: bool = True
    most: float = math.inf
    """For a count or size: the largest value what holds it can take (above it the refusal
    says so, with `why`); the kind's own range is `high`."""
    why: str = ""
    """What sets `most`, in words: "numpy's and torch's int64"."""

    @property
    def text(self) -> str:
        """What is allowed, in words: "a finite number > 0", "an integer from 0 to 4294967295"."""
        noun = "an integer" if self.integer else "a finite number"
        if math.isinf(self.low) and math.isinf(self.high):
            return noun
        if math.isinf(self.high):
            return f"{noun} {'>' if self.low_open else '>='} {_number(self.low)}"
        if self.integer:
            return f"{noun} from {_number(self.low)} to {_number(self.high)}"
        ends = ("(" if self.low_open else "[") + f"{_number(self.low)}, {_number(self.high)}" + (
            ")" if self.high_open else "]")
        return f"a number in {ends}"

    def allows(self, value: Any) -> bool:
        """Whether ``value`` (already a number, not a string) is of this kind."""
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        if not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below and value <= self.most

    def allowed(self, value: Any) -> str:
        """What is allowed, in words, as said to ``value``: the range, or the size bound and
        why when ``value`` is a number past it."""
        past = (isinstance(value, int | float) and not isinstance(value, bool)
                and value > self.most)
        return f"at most {_number(self.most)} ({self.why})" if past else self.text

    def check(self, name: str, value: Any) -> Any:
        """``value`` if it is of this kind, else ConfigError: "NAME must be ..., got VALUE."."""
        if not self.allows(value):
            raise ConfigError(f"{name} must be {self.allowed(value)}, got {value!r}.")
        return value

    def parse(self, text: str) -> int | float:
        """A command-line string as a number of this kind (ValueError, one sentence, if not)."""
        try:
            value: int | float = int(text) if self.integer else float(text)
        except (TypeError, ValueError):
            value = None  # type: ignore[assignment]
        if value is None or not self.allows(value):
            raise ValueError(f"must be {self.allowed(value)}, got {text!r}")
        return value

    def arg(self, text: str) -> int | float:
        """The argparse type of a flag of this kind: argparse names the flag in the refusal."""
        try:
            return self.parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"{err}.") from None


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


@dataclass(frozen=True)
class Quantity:
    """A quantity written with its unit ("100Mbit", "20ms"): a flag keeps the text, and its
    argparse type refuses one netsim's parser refuses, naming the flag."""

    unit: str
    """netsim.units' parser: "bandwidth" or "latency"."""

    def arg(self, text: str) -> str:
        """The argparse type of a flag of this quantity: the text, once it parses."""
        from netsim import units

        try:
            getattr(units, f"parse_{self.unit}")(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return text


BANDWIDTH = Quantity("bandwidth")
"""A rate with its unit: "100Mbit", "25GB/s"."""
LATENCY = Quantity("latency")
"""A time with its unit: "20ms", "5us"."""


# Every count is held as a 64-bit integer somewhere (numpy arrays, torch tensors, Parquet
# columns), so none may exceed one; tighter bounds come from what a command's work costs
# (experiments.sizes).
INT64_MAX = 2**63 - 1
_INT64 = "a count is held as a 64-bit integer by numpy, torch and Parquet"

POSITIVE = Kind(integer=False, low=0.0, low_open=True)
"""Rates, scales, seconds, learning rates, losses: a finite number above zero."""
AT_LEAST_ZERO = Kind(integer=False, low=0.0)
"""Weight decay, tolerances, thresholds: a finite number, zero included."""
AT_LEAST_ONE = Kind(integer=False, low=1.0)
"""Ratios that cannot fall below one (a compression rate): a finite number >= 1."""
FRACTION = Kind(integer=False, low=0.0, high=1.0, high_open=True)
"""Momentum decays and warm-up fractions: [0, 1)."""
UNIT_OPEN_LOW = Kind(integer=False, low=0.0, low_open=True, high=1.0, high_open=False)
"""A share of the whole, all of it included: (0, 1]."""
UNIT_CLOSED = Kind(integer=False, low=0.0, high=1.0, high_open=False)
"""A weight between two things: [0, 1]."""
POSITIVE_INT = Kind(integer=True, low=1, most=INT64_MAX, why=_INT64)
"""Nodes, ranks, steps, batches, repeats, fragments: an integer >= 1."""
COUNT = Kind(integer=True, low=0, most=INT64_MAX, why=_INT64)
"""Warm-up steps, delays: an integer >= 0."""
SEED = Kind(integer=True, low=0, high=2**32 - 1, high_open=False)
"""A seed: torch's generators take 64 bits, and seeds are mixed with step numbers."""
NUMBER = Kind(integer=False, low=-math.inf, low_open=True)
"""Any finite number: a plug-in's float knob whose field names no kind of its own."""
INTEGER = Kind(integer=True, low=-math.inf, low_open=True)
"""Any integer: a plug-in's int knob whose field names no kind of its own."""


def kind_of(action: argparse.Action) -> Kind | None:
    """The Kind an argparse action's values are checked by, or None for a non-numeric flag."""
    owner = getattr(action.type, "__self__", None)
    return owner if isinstance(owner, Kind) else None
