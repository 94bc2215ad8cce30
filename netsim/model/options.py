"""How a trace is replayed beside its target topology: one `ReplayOptions`, every choice named.

    simulate(trace, topology, ReplayOptions(steps=200, compute_scale=0.05, overlap="fsdp2"))

`simulate`, `simulate_each` and the `Cluster` they build all take these; the defaults replay the
trace as recorded on the target's links (intra-node collectives modeled on its intra link).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from netsim.sites import SiteRound

__all__ = ["Degrees", "ReplayOptions", "SiteRounds"]

# (recorded step number, gossip round on the target) -> peers per node: the graph rebuilt.
Degrees = Callable[[int, int], int]
# The same on sites: each site's busiest node's peers, messages leaving it, latency.
SiteRounds = Callable[[int, int], SiteRound]


@dataclass(frozen=True)
class ReplayOptions:
    """Every choice of a replay beside the trace and the target (see `simulate`'s Args)."""

    steps: int | None = None
    """Steps to simulate (None: the recorded number); more cycle the recorded ones."""
    compute_scale: float = 1.0
    """Multiplies every compute interval (0.5: accelerators twice as fast)."""
    intra: str = "model"
    """"model" times intra-node collectives on the intra link; "recorded" keeps their durations."""
    algorithm: str = "auto"
    """Inter-node collective algorithms: auto, ring or tree."""
    overlap: str = "recorded"
    """FSDP2's reduce: the trace's order, or "fsdp2" streams alongside the next backward."""
    degrees: Degrees | None = None
    """Peers per node on the target of a trace with point-to-point messages (gossip)."""
    site_rounds: SiteRounds | None = None
    """Each site's messages per round of such a trace on several sites."""
    payloads: str | None = None
    """How the caller resized the trace's payloads (None: as recorded), for the note."""
    phase_seconds: tuple[float, float] | None = None
    """Seconds per step of each phase (forward+backward, optimizer) to scale the compute to."""
    phase_scale: tuple[float, float] | None = None
    """A factor per phase on top of compute_scale (the optimizer on a smaller shard)."""
    progress: bool = False
    """A progress bar over the simulated steps (on a terminal, after 2 s)."""
