"""A processor-shared link for the SimPy model: flows in flight share its bandwidth equally."""

from __future__ import annotations

import simpy

__all__ = ["SharedLink"]


class SharedLink:
    """A link whose bandwidth is shared fairly by all flows in flight (processor sharing)."""

    def __init__(self, env: simpy.Environment, bandwidth: float) -> None:
        self.env = env
        self.bandwidth = bandwidth
        self._flows: dict[int, list] = {}  # id -> [bytes left, done event]
        self._next_id = 0
        self._last = env.now
        self._generation = 0

    def transfer(self, nbytes: float) -> simpy.Event:
        """Event that fires when nbytes have crossed the link, sharing it with other flows."""
        done = self.env.event()
        if nbytes <= 0:
            done.succeed()
            return done
        self._advance()
        self._flows[self._next_id] = [float(nbytes), done]
        self._next_id += 1
        self._schedule()
        return done

    def _advance(self) -> None:
        elapsed = self.env.now - self._last
        if self._flows and elapsed > 0:
            moved = self.bandwidth / len(self._flows) * elapsed
            for flow in self._flows.values():
                flow[0] -= moved
        self._last = self.env.now

    def _schedule(self) -> None:
        # Any change of the flow set invalidates the pending completion timer.
        self._generation += 1
        if not self._flows:
            return
        rate = self.bandwidth / len(self._flows)
        smallest = min(f[0] for f in self._flows.values())
        # The flows due at the timer are named now: float rounding must not leave them a sliver.
        due = [k for k, f in self._flows.items() if f[0] <= smallest * (1 + 1e-12)]
        timer = self.env.timeout(max(0.0, smallest / rate))
        generation = self._generation
        timer.callbacks.append(lambda _event: self._on_timer(generation, due))

    def _on_timer(self, generation: int, due: list[int]) -> None:
        if generation != self._generation:
            return
        self._advance()
        for key in due:
            self._flows.pop(key)[1].succeed()
        self._schedule()
