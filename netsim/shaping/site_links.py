"""Shaping a collective across sites: the hierarchical plan booked on a node's NIC and its
site's uplink and downlink, which every node of the site books alike (one shared file)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from netsim.nic import Timeline
from netsim.sites import hierarchical_plan, phase_time

if TYPE_CHECKING:
    from netsim.shaping.state import ShaperState

__all__ = ["site_finish"]


def site_finish(shaper: ShaperState, node: int, nic: Timeline, begin: float, op: str,
                nbytes: float) -> float:
    """When node `node`'s part of `op` over one rank per node of every site ends.

    Phase by phase (netsim.sites.hierarchical_plan): the phase ends with the slowest site run
    alone, or later where this node's NIC or its site's uplink or downlink is still busy with
    earlier bookings. The node books its own share of the site's uplink and downlink bytes
    (1/n_s each), so the site's nodes together book the site's whole; exact when the op runs
    alone, queued (FIFO, the same total as fair sharing) behind concurrent ones.
    """
    sites = shaper.topology.sites
    s = sites.site_index(node)
    site = sites.sites[s]
    share = 1.0 / len(site.nodes)
    links = shaper.timeline(("site", s), f"site{s}")
    t = begin
    for phase in hierarchical_plan(op, nbytes, sites):
        alone = max(phase_time(phase, k, sites) for k in range(len(sites.sites)))
        start = t + phase.latency_s[s]
        t = max(
            t + alone,
            nic.reserve(start, phase.nic_bytes[s], 0.0, site.intra_bw),
            links.reserve(start, phase.up_bytes[s] * share, 0.0, site.uplink),
            links.reserve(start, 0.0, phase.down_bytes[s] * share, site.downlink),
        )
    return t
