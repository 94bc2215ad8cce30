"""Sites: groups of nodes with fast links inside, a shared uplink each, and RTTs between them.

A site file (TOML) lists the sites in order, then the round-trip times between them:

    [[site]]
    name = "east"
    nodes = 8              # a count takes the next node numbers; or a list, such as [0, 1, 2]
    uplink = "5Gbit"       # out of the site, shared by its nodes' inter-site traffic
    downlink = "5Gbit"     # into the site (default: the uplink)
    intra_bw = "100Gbit"   # each node's link to the others of its site
    intra_lat = "5us"      # one-way, inside the site (default: 0)

    [rtt]
    matrix = [["0ms", "40ms"], ["40ms", "0ms"]]   # one row per site, in the order above

The file is parsed once (`load_sites`) into bytes/s and seconds. A collective across sites runs
as hierarchical (NCCL-style) libraries run it (`hierarchical_plan`): inside each site first,
then across the sites over their uplinks and downlinks, then inside each site again. A round of
gossip's messages is priced per site from the graph's peers (`gossip_round`).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

from netsim.units import format_bandwidth, parse_bandwidth, parse_latency

__all__ = ["Site", "Sites", "SitePhase", "SITE_OPS", "hierarchical_plan", "plan_time", "phase_time",
           "parse_sites", "load_sites", "hierarchy_line", "SiteRound", "gossip_round",
           "gossip_line"]

# Ops a collective across sites is replayed for (gloo's reduce-scatter is an all-reduce).
SITE_OPS = ("all_reduce", "all_gather", "barrier")
_SITE_KEYS = ("name", "nodes", "uplink", "downlink", "intra_bw", "intra_lat")


@dataclass(frozen=True)
class Site:
    """One site: its nodes, its uplink and downlink (bytes/s) and the link between its nodes."""

    name: str
    nodes: tuple[int, ...]
    uplink: float
    """Bytes/s out of the site, shared by all of its nodes' traffic to other sites."""
    downlink: float
    """Bytes/s into the site, shared likewise."""
    intra_bw: float
    """Bytes/s of each node's link to the other nodes of the site."""
    intra_lat: float
    """One-way seconds between two nodes of the site."""

    def __post_init__(self) -> None:
        # Frozen: rates and times given as numbers or human strings are kept in bytes/s and s.
        for key, parse in (("uplink", parse_bandwidth), ("downlink", parse_bandwidth),
                           ("intra_bw", parse_bandwidth), ("intra_lat", parse_latency)):
            object.__setattr__(self, key, _parsed(self.name, key, parse, getattr(self, key)))
        object.__setattr__(self, "nodes", tuple(self.nodes))


@dataclass(frozen=True)
class Sites:
    """Sites in file order, and the round-trip time between each pair (seconds)."""

    sites: tuple[Site, ...]
    rtt: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        if not self.sites:
            raise ValueError("a site topology needs at least one [[site]].")
        names = [site.name for site in self.sites]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"site name {name!r} is given twice; name each site once.")
        owner: dict[int, str] = {}
        for site in self.sites:
            if not site.nodes:
                raise ValueError(f"site {site.name!r} has no nodes; give it a count >= 1 or a "
                                 "list of node numbers.")
            for node in site.nodes:
                if node in owner:
                    raise ValueError(f"node {node} is in two sites, {owner[node]!r} and "
                                     f"{site.name!r}; put each node in one site.")
                owner[node] = site.name
        missing = sorted(set(range(len(owner))) - set(owner))
        if missing:
            raise ValueError(f"the sites' nodes must be 0..{len(owner) - 1} each once, and node "
                             f"{missing[0]} is in none (highest given: {max(owner)}).")
        _check_rtt(self.rtt, names)

    @property
    def nodes(self) -> int:
        """Nodes in all sites together."""
        return sum(len(site.nodes) for site in self.sites)

    def site_of(self) -> list[int]:
        """The site index of each node, indexed by node (a copy of the one built once)."""
        return list(self._site_of)

    def site_index(self, node: int) -> int:
        """The index of the site node `node` is in."""
        return self._site_of[node]

    @cached_property
    def _site_of(self) -> tuple[int, ...]:
        out = [0] * self.nodes
        for s, site in enumerate(self.sites):
            for node in site.nodes:
                out[node] = s
        return tuple(out)

    def ring_latency(self) -> float:
        """One-way latency a lock-step ring over the sites (file order) waits each step."""
        count = len(self.sites)
        if count == 1:
            return 0.0
        return max(self.rtt[s][(s + 1) % count] / 2 for s in range(count))

    def flat_view(self) -> tuple[float, float]:
        """The whole as one link's (bytes/s, seconds): one site its inside link, several the
        slowest uplink or downlink at the ring's latency (what a flat view would see)."""
        if len(self.sites) == 1:
            return self.sites[0].intra_bw, self.sites[0].intra_lat
        return (min(min(site.uplink, site.downlink) for site in self.sites),
                self.ring_latency())

    def describe(self) -> list[str]:
        """One line per site, then the round-trip times, in human units."""
        lines = [
            f"site {site.name}: {len(site.nodes)} nodes, uplink {format_bandwidth(site.uplink)}, "
            f"downlink {format_bandwidth(site.downlink)}, inside "
            f"{format_bandwidth(site.intra_bw)}, {site.intra_lat * 1e6:g} us"
            for site in self.sites
        ]
        for a in range(len(self.sites)):
            for b in range(a + 1, len(self.sites)):
                lines.append(f"rtt {self.sites[a].name}-{self.sites[b].name}: "
                             f"{self.rtt[a][b] * 1e3:g} ms (one-way {self.rtt[a][b] * 500:g} ms)")
        return lines


def _check_rtt(rtt: Sequence[Sequence[float]], names: list[str]) -> None:
    """ValueError unless rtt is a square, symmetric matrix with a zero diagonal, one row a site."""
    count = len(names)
    lengths = [len(row) for row in rtt]
    if len(rtt) != count or any(length != count for length in lengths):
        raise ValueError(f"the rtt matrix must be square with one row and column per site "
                         f"({count}x{count}); got {len(rtt)} rows of lengths {lengths}.")
    for a in range(count):
        bad = [v for v in rtt[a] if not isinstance(v, (int, float)) or isinstance(v, bool)
               or not 0 <= v < float("inf")]
        if bad:
            raise ValueError(f"the rtt matrix's row of site {names[a]!r} holds {bad[0]!r}; give "
                             "zero or positive finite seconds.")
        if rtt[a][a] != 0:
            raise ValueError(f"the rtt matrix's diagonal must be 0 (inside a site the latency is "
                             f"intra_lat); site {names[a]!r} has {rtt[a][a] * 1e3:g} ms.")
        for b in range(a + 1, count):
            if rtt[a][b] != rtt[b][a]:
                raise ValueError(f"the rtt matrix is not symmetric: {names[a]!r} to {names[b]!r} "
                                 f"is {rtt[a][b] * 1e3:g} ms but back {rtt[b][a] * 1e3:g} ms.")


def _site_nodes(value: object, name: str, first: int) -> tuple[int, ...]:
    """A site's nodes from a count (the next `value` nodes from `first`) or a list of numbers."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(f"site {name!r} has no nodes; give it a count >= 1 or a list of "
                             "node numbers.")
        return tuple(range(first, first + value))
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                       for v in value):
        if len(set(value)) != len(value):
            raise ValueError(f"site {name!r} lists a node twice in {value!r}.")
        return tuple(value)
    raise ValueError(f"site {name!r} nodes {value!r} must be a count >= 1 or a list of node "
                     "numbers >= 0.")


def _parsed(site: str, key: str, parse, value: object) -> float:
    """`parse(value)`, its ValueError naming the site and the key."""
    try:
        return parse(value)
    except ValueError as err:
        raise ValueError(f"site {site!r} {key}: {err}") from None


def _parse_site(table: object, index: int, first: int) -> Site:
    """One [[site]] table as a Site, its node numbers from `first` when given as a count."""
    if not isinstance(table, Mapping):
        raise ValueError(f"site {index} must be a table ([[site]]), got {table!r}.")
    unknown = sorted(set(table) - set(_SITE_KEYS))
    if unknown:
        raise ValueError(f"site {index} has an unknown key {unknown[0]!r}; known keys: "
                         f"{', '.join(_SITE_KEYS)}.")
    for key in ("name", "nodes", "uplink", "intra_bw"):
        if key not in table:
            raise ValueError(f"site {index} has no {key!r}; every site needs name, nodes, "
                             "uplink and intra_bw.")
    name = table["name"]
    if not isinstance(name, str) or not name:
        raise ValueError(f"site {index} name {name!r} must be a non-empty string.")
    # Site parses the rates and times (named by site and key when one does not parse).
    return Site(name, _site_nodes(table["nodes"], name, first), table["uplink"],
                table.get("downlink", table["uplink"]), table["intra_bw"],
                table.get("intra_lat", 0.0))


def parse_sites(data: Mapping) -> Sites:
    """Sites from a site file's tables ({"site": [...], "rtt": {"matrix": [...]}}); ValueError
    with one sentence for anything the module docstring does not allow."""
    unknown = sorted(set(data) - {"site", "rtt"})
    if unknown:
        raise ValueError(f"a site file holds [[site]] tables and one [rtt] table; {unknown[0]!r} "
                         "is not known.")
    tables = data.get("site")
    if not isinstance(tables, list) or not tables:
        raise ValueError("a site file needs at least one [[site]] table.")
    sites: list[Site] = []
    for index, table in enumerate(tables):
        first = 1 + max((n for site in sites for n in site.nodes), default=-1)
        sites.append(_parse_site(table, index, first))
    return Sites(tuple(sites), _parse_rtt(data.get("rtt"), len(sites)))


def _parse_rtt(table: object, count: int) -> tuple[tuple[float, ...], ...]:
    """The [rtt] table's matrix in seconds (one site may leave it out)."""
    if table is None and count == 1:
        return ((0.0,),)
    if not isinstance(table, Mapping) or set(table) != {"matrix"}:
        raise ValueError(f"the site file needs an [rtt] table with one key, matrix: {count} rows "
                         'of round-trip times, such as [["0ms", "40ms"], ["40ms", "0ms"]].')
    matrix = table["matrix"]
    if not isinstance(matrix, list) or not all(isinstance(row, list) for row in matrix):
        raise ValueError(f"rtt matrix {matrix!r} must be a list of rows, one per site.")
    try:
        return tuple(tuple(parse_latency(v) for v in row) for row in matrix)
    except ValueError as err:
        raise ValueError(f"rtt matrix: {err}") from None


def load_sites(path: str | os.PathLike) -> Sites:
    """The Sites of a TOML site file (ValueError naming the file for a missing or bad one)."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as err:
        raise ValueError(f"site file {str(path)!r} cannot be read: {err.strerror}.") from None
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"site file {str(path)!r} is not valid TOML: {err}.") from None
    try:
        return parse_sites(data)
    except ValueError as err:
        raise ValueError(f"site file {str(path)!r}: {err}") from None


class SitePhase(NamedTuple):
    """One phase of a hierarchical collective, per site: latency, then bytes on each link."""

    latency_s: tuple[float, ...]
    """Seconds of latency steps before the site's bytes move."""
    nic_bytes: tuple[float, ...]
    """Bytes each node of the site sends through its own link (its NIC)."""
    up_bytes: tuple[float, ...]
    """Bytes through the site's uplink (all its nodes together)."""
    down_bytes: tuple[float, ...]
    """Bytes through the site's downlink."""


def hierarchical_plan(op: str, nbytes: float, sites: Sites) -> tuple[SitePhase, ...]:
    """The phases of `op` over one rank per node of every site, n = nbytes per rank.

    all_reduce (and barrier, n = 0): ring reduce-scatter inside each site, ring all-reduce of n
    across the sites (2(S-1)/S n through each uplink and downlink, a 1/n_s shard per node), ring
    all-gather inside each site. all_gather: ring all-gather inside each site, ring all-gather
    of the sites' blocks across them (a site receives the N - n_s blocks of the others and
    forwards all but its successor's), then the remote blocks shared inside each site by a ring.
    Every level is a lock-step ring: a cross-site step waits the ring's largest one-way latency.
    """
    if op not in SITE_OPS:
        raise ValueError(f"a collective across sites is modeled for {', '.join(SITE_OPS)}, not "
                         f"{op!r}.")
    count = len(sites.sites)
    sizes = [len(site.nodes) for site in sites.sites]
    total = sum(sizes)
    lat = [site.intra_lat for site in sites.sites]
    ring = sites.ring_latency()
    n = 0.0 if op == "barrier" else float(nbytes)
    if op == "all_gather":
        inside = SitePhase(tuple((k - 1) * a for k, a in zip(sizes, lat, strict=True)),
                           tuple((k - 1) * n for k in sizes), (0.0,) * count, (0.0,) * count)
        up = tuple((total - sizes[(s + 1) % count]) * n for s in range(count))
        down = tuple((total - k) * n for k in sizes)
        across = SitePhase((ring * (count - 1),) * count,
                           tuple(u / k for u, k in zip(up, sizes, strict=True)), up, down)
        share = SitePhase(inside.latency_s,
                          tuple((k - 1) / k * d for k, d in zip(sizes, down, strict=True)),
                          (0.0,) * count, (0.0,) * count)
        return inside, across, share
    inside = SitePhase(tuple((k - 1) * a for k, a in zip(sizes, lat, strict=True)),
                       tuple((k - 1) / k * n for k in sizes), (0.0,) * count, (0.0,) * count)
    moved = 2 * (count - 1) / count * n
    across = SitePhase((ring * 2 * (count - 1),) * count, tuple(moved / k for k in sizes),
                       (moved,) * count, (moved,) * count)
    return inside, across, inside


def phase_time(phase: SitePhase, s: int, sites: Sites) -> float:
    """Seconds of site s's part of a phase run alone: its latency, then its busiest link."""
    site = sites.sites[s]
    return phase.latency_s[s] + max(phase.nic_bytes[s] / site.intra_bw,
                                    phase.up_bytes[s] / site.uplink,
                                    phase.down_bytes[s] / site.downlink)


def plan_time(plan: Sequence[SitePhase], sites: Sites) -> float:
    """Seconds of a plan run alone: each phase ends with its slowest site, on its busiest link."""
    return sum(max(phase_time(phase, s, sites) for s in range(len(sites.sites)))
               for phase in plan)


def hierarchy_line(sites: Sites) -> str:
    """The assumption a replay on sites makes about collectives across them, in one line."""
    count = len(sites.sites)
    if count == 1:
        return ("one site: collectives run flat over the site's links, as without sites (its "
                "uplink and downlink carry nothing)")
    return (f"hierarchical collectives: all-reduce = in-site ring reduce-scatter, ring across "
            f"{count} sites over their uplinks/downlinks (one-way {sites.ring_latency() * 1e3:g} "
            "ms a step, the ring's largest), in-site ring all-gather; all-gather = in-site ring, "
            "ring of site blocks across sites, in-site ring of the remote blocks; each site's "
            "uplink and downlink processor-shared by its nodes' concurrent flows")


class SiteRound(NamedTuple):
    """One round of point-to-point messages (gossip) on sites, per site."""

    peers: tuple[int, ...]
    """Messages the busiest node of the site sends (and receives) in the round."""
    remote: tuple[int, ...]
    """Messages that leave the site in the round, all its nodes together (as many arrive)."""
    latency_s: tuple[float, ...]
    """One-way latency of the site's slowest message: to its farthest peer site, else inside."""


def gossip_round(sites: Sites, peers_of: Callable[[int], Iterable[int]]) -> SiteRound:
    """A round on sites from every node's peers (`peers_of(node)`, an undirected graph)."""
    site_of = sites._site_of
    count = len(sites.sites)
    busiest, remote = [0] * count, [0] * count
    latency = [site.intra_lat if len(site.nodes) > 1 else 0.0 for site in sites.sites]
    for node in range(sites.nodes):
        s = site_of[node]
        found = list(peers_of(node))
        busiest[s] = max(busiest[s], len(found))
        for peer in found:
            far = site_of[peer]
            if far != s:
                remote[s] += 1
                latency[s] = max(latency[s], sites.rtt[s][far] / 2)
    return SiteRound(tuple(busiest), tuple(remote), tuple(latency))


def gossip_line(sites: Sites, first: SiteRound) -> str:
    """The assumption a gossip replay on sites makes, with its first round's figures."""
    return (f"gossip on {len(sites.sites)} sites: the graph's nodes numbered site by site; a "
            f"message to a peer in another site crosses both sites' uplink/downlink (first "
            f"round: {sum(first.remote):,} messages cross sites, the busiest node sends "
            f"{max(first.peers)}); each site's messages end one latency (to its farthest peer "
            "site) after its flows; the busiest node of a site stands for all its nodes (an "
            "upper bound where they differ)")
