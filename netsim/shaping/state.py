"""What a shaped group and its works read of the Shaper that made them, as a Protocol.

`group.py` and `work.py` name `ShaperState` in their hints rather than `shaper.Shaper`: the
Shaper makes the groups, so a hint the other way would close an import circle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from netsim.nic import Timeline
    from netsim.topology import Topology
    from netsim.trace import TraceRecorder

__all__ = ["ShaperState"]


class ShaperState(Protocol):
    """One process's shaping state as its groups and works see it (`shaper.Shaper` has it)."""

    topology: Topology
    mode: str  # "off", "wall" or "virtual"
    recorder: TraceRecorder | None
    shape_intra: bool
    seed: int
    t0: float  # when the Shaper was made, on its time base

    def now(self) -> float:
        """Absolute time on the shaping time base (wall, or wall + virtual lead)."""
        ...

    def advance_to(self, target: float) -> None:
        """Virtual mode: move the clock forward so that now() >= target."""
        ...

    def timeline(self, key: tuple, shared_node: int | str | None) -> Timeline:
        """The NIC reservation timeline for `key`; file-backed when a node's processes share it
        (a str names a file that processes of several nodes share, such as a site's uplink)."""
        ...
