"""A replicator's program: its exchange between replicas, step by step, as data.

A replicator writes its program once, from its own sizing and schedule
(:meth:`flexdemo.replicators.base.Replicator.program`), for one rank whose local shards have
given shapes among a given number of replicas. Per 1-based training step it says

- ``blocking(step)``: the ops the step runs and waits for one after another, before the rest
  (PowerSGD's three all-reduces, Ada's measurement, a quantized reduce's all-to-all then
  all-gather);
- ``posts(step)``: the ops posted after the step's update, each under a key;
- ``waits(step)``: the keys of posted ops the step waits on, after its posts (DeMo with
  ``delay=1`` waits on the previous step's; Streaming DiLoCo on a fragment posted tau steps ago);
- ``unit_elements(step)``: for a sync that could start unit by unit in the backward (DiLoCo's),
  per posted key its elements per parameter index (empty: none can).

Beside them: ``period`` (steps after which the schedule repeats, from ``steady_from`` on),
``exchanges`` (steps of a period that exchange, or fragment syncs), ``state_bytes`` (the
replicator's own state and exchange buffers per GPU), ``ends_step`` (the exchange is the step's
last work, as gossip's mixing: no optimizer compute follows it) and ``notes`` (what a plan of
it assumes).
An op's size is the payload one rank hands to it, as netsim's counters and
:mod:`flexdemo.wire` take it. A planner (``experiments.plan``) writes a trace from it; an
emulator takes a method with a program, whose ops are all of kinds it runs (:data:`OPS`).

Torch-free: a program is read without building a tensor.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

__all__ = ["OPS", "Op", "Periodic", "Program", "replicating_before", "schedule_period"]

OPS = ("all_reduce", "all_gather", "all_to_all", "reduce_scatter", "broadcast", "send", "recv")
"""The op kinds a program may name (netsim's names of the collectives it counts)."""


@dataclass(frozen=True)
class Op:
    """One collective, or one message, of an exchange as one rank hands it in."""

    op: str
    """One of :data:`OPS`."""
    nbytes: int
    """The payload this rank hands in (a message: its bytes)."""
    key: Hashable = None
    """What a later wait names a posted op by."""
    peer: int | None = None
    """A message's other end: the replica (node index) it goes to or comes from."""
    inter: bool = True
    """Over the replicate group, between nodes; False: inside the node."""

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"op={self.op!r} is unknown; use one of {', '.join(OPS)}.")


class Program:
    """A replicator's exchange, step by step (module docstring); this one sends nothing."""

    period: int = 1
    steady_from: int = 1
    state_bytes: int = 0
    ends_step: bool = False

    @functools.cached_property
    def exchanges(self) -> int:
        """Exchanging steps in one period from ``steady_from`` (by the program's
        ``exchanges_on(step)``; none without one), counted on first use: a period may be too
        long to walk, which a plan refuses before it asks."""
        exchanges_on = getattr(self, "exchanges_on", None)
        if exchanges_on is None:
            return 0
        return sum(map(exchanges_on, range(self.steady_from, self.steady_from + self.period)))

    def blocking(self, step: int) -> list[Op]:
        """Ops 1-based ``step`` runs and waits for, one after another, before its posts."""
        return []

    def posts(self, step: int) -> list[Op]:
        """Ops posted after ``step``'s update, each with its key."""
        return []

    def waits(self, step: int) -> list[Hashable]:
        """Keys of posted ops ``step`` waits on, after its posts."""
        return []

    def unit_elements(self, step: int) -> dict[Hashable, dict[int, int]]:
        """Per key posted after ``step``: its elements per parameter index, for a sync that
        can start unit by unit in the backward (empty: none can)."""
        return {}

    def notes(self) -> list[str]:
        """What a plan of this program assumes beyond its ops (one sentence each)."""
        return []


@dataclass
class Periodic(Program):
    """Ops on the steps of a schedule, waited on in the step that posts them: the program of
    most replicators (a DiLoCo sync every H steps, a top-k every step).

    ``ops(step)`` gives an exchanging step's ops; ``sequential`` runs them one after another
    before anything else (:meth:`blocking`), else they are posted under the step's number and
    waited on at once; ``elements`` (per parameter index) lets the sync start in the backward.
    """

    exchanges_on: Callable[[int], bool]
    ops: Callable[[int], list[tuple[str, int]]]
    period: int = 1
    state_bytes: int = 0
    sequential: bool = False
    elements: dict[int, int] | None = None
    steady_from: int = 1
    said: list[str] = field(default_factory=list)

    def _ops(self, step: int) -> list[tuple[str, int]]:
        return self.ops(step) if self.exchanges_on(step) else []

    def blocking(self, step: int) -> list[Op]:
        """A chain of ops (``sequential``), run in order."""
        return [Op(op, n) for op, n in self._ops(step)] if self.sequential else []

    def posts(self, step: int) -> list[Op]:
        """The step's ops under its number (not ``sequential``)."""
        if self.sequential:
            return []
        return [Op(op, n, key=(step, i)) for i, (op, n) in enumerate(self._ops(step))]

    def waits(self, step: int) -> list[Hashable]:
        """What the step posted."""
        return [op.key for op in self.posts(step)]

    def unit_elements(self, step: int) -> dict[Hashable, dict[int, int]]:
        """The whole of each posted op, parameter by parameter (with ``elements``)."""
        if self.elements is None:
            return {}
        return {op.key: self.elements for op in self.posts(step)}

    def notes(self) -> list[str]:
        """As given."""
        return list(self.said)


def schedule_period(every: int, skip: int | None) -> int:
    """Steps after which a ``replicate_every`` / ``skip_every`` schedule repeats."""
    return every if skip is None else math.lcm(every, skip)


def replicating_before(replicates_on: Callable[[int], bool], step: int) -> int:
    """Exchanging steps before 1-based ``step``: a replicator's counter at that step."""
    return sum(1 for s in range(1, step) if replicates_on(s))
