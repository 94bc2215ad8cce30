"""A processor-shared link for the SimPy model: flows in flight share its bandwidth equally."""

from __future__ import annotations

import simpy

__all__ = ["SharedLink"]


class SharedLink:
    """A link whose bandwidth is shared fairly by all flows in flight (processor sharing).

    A flow of weight w stands for w equal flows that start and end together (a node's messages
    to its w neighbours): it gets w shares of the bandwidth, at the cost of one flow's events.
    """

    def __init__(self, env: simpy.Environment, bandwidth: float) -> None:
        self.env = env
        self.bandwidth = bandwidth
        # id -> [bytes left per unit of weight, weight, done event]
        self._flows: dict[int, list] = {}
        self._weight = 0.0  # total weight in flight
        self._next_id = 0
        self._last = env.now
        self._generation = 0

    def transfer(self, nbytes: float, weight: float = 1.0) -> simpy.Event:
        """Event that fires when nbytes have crossed the link, sharing it with other flows."""
        done = self.env.event()
        if nbytes <= 0:
            done.succeed()
            return done
        self._advance()
        self._flows[self._next_id] = [float(nbytes) / weight, weight, done]
        self._weight += weight
        self._next_id += 1
        self._schedule()
        return done

    def transfer_each(self, nbytes: float, count: int) -> simpy.Event:
        """Event that fires when `count` equal flows of nbytes each, started together, have
        crossed (one flow's events; `transfer(nbytes)` when count is 1)."""
        if count == 1:
            return self.transfer(nbytes)
        done = self.env.event()
        if nbytes <= 0:
            done.succeed()
            return done
        self._advance()
        # Bytes left per unit of weight are one flow's: no division, so no rounding.
        self._flows[self._next_id] = [float(nbytes), count, done]
        self._weight += count
        self._next_id += 1
        self._schedule()
        return done

    def _advance(self) -> None:
        elapsed = self.env.now - self._last
        if self._flows and elapsed > 0:
            moved = self.bandwidth / self._weight * elapsed
            for flow in self._flows.values():
                flow[0] -= moved
        self._last = self.env.now

    def _schedule(self) -> None:
        # Any change of the flow set invalidates the pending completion timer.
        self._generation += 1
        if not self._flows:
            self._weight = 0.0  # no rounding left over from the weights that came and went
            return
        rate = self.bandwidth / self._weight
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
            flow = self._flows.pop(key)
            self._weight -= flow[1]
            flow[2].succeed()
        self._schedule()
