"""How large a count a command takes: what each item of its work costs, and the one check.

Every count a user gives (layers, nodes, GPUs per node, grid points, steps, replicas, units)
multiplies some of a command's work. A command writes that work as terms, each a product of
counts times what one item costs (`Cost`: bytes held, seconds taken, as measured on a 2-core
machine), and `check_work` refuses it before it starts when the estimate passes what this
machine has available (memory) or what the command may take (its --timeout; without one,
`UNATTENDED_S`), in one sentence naming the count, the estimate and the most that fits. The
figures are estimates: a count well inside a bound is never refused, one near it may be.
Torch-free.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from experiments.errors import ConfigError

__all__ = ["LONG_S", "UNATTENDED_S", "Cost", "Count", "Term", "available_bytes", "check_work",
           "format_bytes", "format_seconds"]

UNATTENDED_S = 600.0
"""The longest a piece of work without a --timeout of its own (one replay, one listing of a
sweep's units) is let start: such work takes seconds, and ten minutes of it is a count gone
wrong (a command with --timeout is held to that instead)."""

LONG_S = 86_400.0
"""The longest a command that runs for hours on purpose (a sweep, a validation) is let start:
a day; past it the count is a mistyped one."""


@dataclass(frozen=True)
class Cost:
    """What one item of work costs, about: the bytes it holds and the seconds it takes."""

    item: str
    """The item, in words: "a node's entries in a topology"."""
    bytes: float = 0.0
    seconds: float = 0.0


@dataclass(frozen=True)
class Count:  # equal counts are one count: GPUs per node twice in a term is their square
    """A count the user gave: its flag or key, its value and what it counts."""

    flag: str
    value: int
    noun: str
    said: str = ""
    """How the refusal names it when it is the one to lower (default: "FLAG VALUE")."""
    given: bool = True
    """Whether the user gave it (else a default or a recording's): the refusal names a given
    count before one that is not."""

    @property
    def head(self) -> str:
        """The refusal's first words when this count is the one to lower."""
        return self.said or f"{self.flag} {self.value:,}"


@dataclass(frozen=True)
class Term:
    """Items of work: the product of `counts`, each item costing `cost`."""

    cost: Cost
    counts: tuple[Count, ...]

    @property
    def items(self) -> int:
        """How many items: the product of the counts."""
        return math.prod(c.value for c in self.counts)

    def amount(self, resource: str) -> float:
        """Bytes (resource "bytes") or seconds (resource "seconds") of all its items."""
        return self.items * getattr(self.cost, resource)

    def describe(self, resource: str) -> str:
        """The term in words: "3 methods x 10 bandwidths x 0.2 ms to replay a unit"."""
        each = getattr(self.cost, resource)
        per = format_bytes(each) if resource == "bytes" else format_seconds(each)
        counts = [f"{c.value:,} {c.noun}" for c in self.counts if c.value != 1]
        return " x ".join([*counts, f"{per} {self.cost.item}"])

    def amount_at(self, count: Count, value: int, resource: str) -> float:
        """`amount` with `count` at `value` instead (a count that appears k times, as GPUs per
        node in pairs of them, scales as its k-th power)."""
        items = math.prod(value if c == count else c.value for c in self.counts)
        return items * getattr(self.cost, resource)


def available_bytes() -> int:
    """MemAvailable of /proc/meminfo (all physical memory where that is missing)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_work(what: str, terms: list[Term], *, budget_s: float | None = None,
               budget: str = "", memory: float | None = None) -> None:
    """ConfigError (one sentence) when `terms` hold more memory than is available or take
    longer than `budget_s` (named `budget`, e.g. "--timeout 600 s"; None: `UNATTENDED_S`)."""
    if budget_s is None:
        budget_s = UNATTENDED_S
        budget = f"{format_seconds(UNATTENDED_S)}, the most work without a --timeout may take"
    memory = available_bytes() if memory is None else memory
    limits = (("bytes", memory, f"the {format_bytes(memory)} this machine has available"),
              ("seconds", budget_s, budget))
    for resource, limit, limit_text in limits:
        total = sum(t.amount(resource) for t in terms)
        if total <= limit:
            continue
        worst = max(terms, key=lambda t: t.amount(resource))
        # The count to lower: of the worst term's, one the user gave, furthest above the most of
        # it that fits both the memory and the time (the other counts as given), among those
        # that can be lowered to fit.
        mosts = {c: min(_most(terms, c, bound, kind) for kind, bound, _ in limits)
                 for c in worst.counts}
        count = max(worst.counts, key=lambda c: (mosts[c] > 0, c.given,
                                                 c.value / max(mosts[c], 1)))
        most = mosts[count]
        amount = format_bytes(total) if resource == "bytes" else format_seconds(total)
        verb = "hold" if resource == "bytes" else "take"
        raise ConfigError(f"{count.head}: {what} would {verb} about {amount} "
                          f"({worst.describe(resource)}), more than {limit_text}; at most "
                          f"{most:,} {count.noun} fit.")


def _most(terms: list[Term], count: Count, limit: float, resource: str) -> int:
    """The largest value of `count` (up to its own) whose work fits in `limit`, the other
    counts as given: a bisection, as the work grows with it in every term it is part of."""
    def fits(value: int) -> bool:
        return sum(t.amount_at(count, value, resource) for t in terms) <= limit

    if fits(count.value):
        return count.value
    low, high = 0, count.value  # fits(low) is taken as true; fits(high) is known false
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def format_bytes(value: float) -> str:
    """Bytes in the largest binary unit that keeps a number >= 1: "7.3 TiB", "64 B"."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_seconds(value: float) -> str:
    """Seconds in words a reader weighs at a glance: "0.2 ms", "40 s", "3.1 hours", "12 years"."""
    if value < 1:
        return f"{value * 1e6:.3g} us" if value < 1e-3 else f"{value * 1e3:.3g} ms"
    for unit, size in (("years", 365 * 86_400), ("days", 86_400), ("hours", 3_600),
                       ("minutes", 60)):
        if value >= 2 * size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.3g} s"
