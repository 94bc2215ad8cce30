"""A replica spanning several nodes of a site, as the plan replays it.

With `--nodes-per-replica K`, FSDP2 shards each replica over the K x G GPUs of K nodes of one
site, and the method's exchange runs between replicas. The replay sees one node per replica:
K x G ranks inside it, its "intra-node" link the one between the replica's nodes (a ring over
K nodes is paced by its slowest hop, a node's link to the others: the NVLink-class link inside
a node, or the site's link between nodes, whichever is slower, at the latter's latency), and
its NIC K nodes' NICs side by side (K x a node's link: the replica's K x G ranks spread their
exchange over the K nodes' NICs alike). Sites keep their uplinks and round trips; each site
holds its nodes / K replicas. FSDP2's traffic between the replica's nodes crosses each of the K
nodes' NICs once and shares them with the exchange (`Topology.node_span`): an all-gather
prefetched while a gradient all-reduce is in flight slows both.
"""

from __future__ import annotations

import dataclasses

from experiments.errors import ConfigError
from netsim.sites import Site, Sites
from netsim.topology import Link, Topology

__all__ = ["check_nodes_per_replica", "divisors", "divisors_text", "replica_line",
           "replica_topology"]


def check_nodes_per_replica(k: int, nodes: int, sites: Sites | None = None) -> None:
    """Refuse, in one sentence, a K that does not cut the nodes (and each site) into replicas."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"--nodes-per-replica {k!r} must be a whole number >= 1.")
    if nodes % k:
        raise ConfigError(f"--nodes-per-replica {k} does not divide --nodes {nodes} into whole "
                          f"replicas; use {divisors_text(nodes)}.")
    for site in () if sites is None else sites.sites:
        if len(site.nodes) % k:
            raise ConfigError(f"--nodes-per-replica {k} does not divide site {site.name!r}'s "
                              f"{len(site.nodes)} nodes: a replica spans nodes of one site; "
                              "use a K that divides every site's node count.")


def divisors(n: int) -> list[int]:
    """The divisors of `n` in order, found up to its square root (so a count of 10^12 nodes
    takes 10^6 trials, not 10^12)."""
    low, high = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            low.append(d)
            if d != n // d:
                high.append(n // d)
        d += 1
    return low + high[::-1]


# Divisors named in a refusal: the smallest and the largest, with an ellipsis between.
_SHOWN = 12


def divisors_text(n: int) -> str:
    """ "one of 1, 2, 4" or, for a count of many divisors, "one of its 64 divisors: 1, 2, ...,
    N" (the few smallest and largest)."""
    found = divisors(n)
    if len(found) <= _SHOWN:
        return f"one of {', '.join(map(str, found))}"
    half = _SHOWN // 2
    return (f"one of its {len(found)} divisors: {', '.join(map(str, found[:half]))}, ..., "
            f"{', '.join(map(str, found[-half:]))}")


def replica_topology(topology: Topology, k: int) -> Topology:
    """`topology` (N nodes x G) as N/K replicas of K x G ranks (module docstring)."""
    if k == 1:
        return topology
    check_nodes_per_replica(k, topology.nodes, topology.sites)
    if topology.sites is None:
        between = topology.inter
        nic = dataclasses.replace(topology.inter, bandwidth=topology.inter.bandwidth * k)
        return Topology(topology.nodes // k, topology.accelerators_per_node * k,
                        _inside(topology.intra, between), nic, nic=topology.nic, node_span=k)
    sites, first = [], 0
    for site in topology.sites.sites:
        count = len(site.nodes) // k
        sites.append(Site(site.name, tuple(range(first, first + count)), site.uplink,
                          site.downlink, site.intra_bw * k, site.intra_lat))
        first += count
    slowest = min(topology.sites.sites, key=lambda s: s.intra_bw)
    between = Link(slowest.intra_bw, max(s.intra_lat for s in topology.sites.sites))
    spanning = Topology.on_sites(Sites(tuple(sites), topology.sites.rtt),
                                 topology.accelerators_per_node * k,
                                 _inside(topology.intra, between), nic=topology.nic)
    return dataclasses.replace(spanning, node_span=k)


def _inside(intra: Link, between: Link) -> Link:
    """The link a replica's FSDP2 ring is paced by: the slower of the node's and the nodes'."""
    return Link(min(intra.bandwidth, between.bandwidth), max(intra.latency, between.latency))


def replica_line(k: int, nodes: int, per_node: int, sites: bool) -> str:
    """The assumption printed with a plan of replicas spanning `k` nodes."""
    if k == 1:
        return (f"replicas: one per node, FSDP2 over its {per_node} GPUs on the intra-node "
                "link; the exchange between nodes")
    where = "its site's link between nodes" if sites else "the inter-node link (one network)"
    return (f"replicas: {nodes // k} of {k} nodes each, FSDP2 over {k * per_node} GPUs; its "
            f"all-gathers and reduce-scatters cross the replica's nodes on {where}, a ring "
            "paced by that hop at its latency; the exchange between replicas on the K nodes' "
            f"links side by side ({k} x a node's); FSDP2's traffic between a replica's nodes "
            "crosses each node's link once, sharing it with the exchange; bytes per node are a "
            f"replica's exchange / {k}, FSDP2's traffic between a replica's nodes not counted "
            "in them")
