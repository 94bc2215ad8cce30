"""Links and cluster topologies: nodes x accelerators, links, NIC sharing, stragglers."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from netsim.sites import Sites
from netsim.units import format_bandwidth, parse_bandwidth, parse_latency, parse_node_link

__all__ = ["Link", "Topology", "NIC_MODES", "ring_nic_share", "parse_node_links"]

NIC_MODES = ("per-node", "per-accelerator")


@dataclass(frozen=True)
class Link:
    """A link: bandwidth (bytes/s or "100Mbit"), latency, jitter (s or "1ms"), loss in [0, 1)."""

    bandwidth: float
    latency: float = 0.0
    jitter: float = 0.0
    loss: float = 0.0

    def __post_init__(self) -> None:
        # Frozen dataclass: normalise human strings once, so every user sees bytes/s and seconds.
        object.__setattr__(self, "bandwidth", parse_bandwidth(self.bandwidth))
        object.__setattr__(self, "latency", parse_latency(self.latency))
        try:
            jitter = parse_latency(self.jitter)
        except ValueError:
            raise ValueError(
                f'jitter {self.jitter!r} must be zero or a positive time, such as "1ms".'
            ) from None
        object.__setattr__(self, "jitter", jitter)
        loss = self.loss
        if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not 0.0 <= loss < 1.0:
            raise ValueError(f"loss {loss!r} must be a fraction in [0, 1), such as 0.01.")
        object.__setattr__(self, "loss", float(loss))

    @property
    def effective_bandwidth(self) -> float:
        """Goodput in bytes/s: lost packets are resent, so (1 - loss) of the rate carries data."""
        return self.bandwidth * (1.0 - self.loss)



def _as_link(value: Link | dict, name: str) -> Link:
    """Accept a Link or a dict of Link fields, so configs can pass plain mappings."""
    if isinstance(value, Link):
        return value
    if isinstance(value, dict):
        return Link(**value)
    raise ValueError(f"{name} link {value!r} is not valid; give a Link or a dict of its fields.")


NodeLinks = tuple[tuple[int, Link], ...]


def _parsed(name: str, parse: Callable[[object], float], value: object) -> float:
    """`parse(value)`, its ValueError naming the setting (callers' flags share these names)."""
    try:
        return parse(value)
    except ValueError as err:
        raise ValueError(f"{name} {value!r} does not parse: {err}") from None


def parse_node_links(specs: Iterable[str], nodes: int, inter: Link) -> dict[int, Link]:
    """Per-node links from "NODE=BANDWIDTH[,LATENCY]" strings, nodes checked against `nodes`.

    The one parser of per-node links: a link without a latency keeps inter's, and every node
    link keeps inter's jitter and loss.
    """
    if isinstance(specs, str):
        specs = [specs]
    out: dict[int, Link] = {}
    for spec in specs:
        node, bandwidth, latency = parse_node_link(spec)
        if node >= nodes:
            raise ValueError(f"node link {spec!r} names node {node}, outside this topology's "
                             f"nodes 0..{nodes - 1}.")
        if node in out:
            raise ValueError(f"node link {spec!r} gives node {node} a second link; give each "
                             "node at most one.")
        out[node] = Link(bandwidth, inter.latency if latency is None else latency,
                         jitter=inter.jitter, loss=inter.loss)
    return out


def _as_node_links(value: object, nodes: int, inter: Link) -> NodeLinks:
    """Normalise {node: Link}, (node, link) pairs or spec strings into sorted pairs, in range."""
    if isinstance(value, str) or (isinstance(value, (list, tuple)) and value
                                  and all(isinstance(v, str) for v in value)):
        value = parse_node_links(value, nodes, inter)  # type: ignore[arg-type]
    pairs = value.items() if isinstance(value, Mapping) else value
    out: dict[int, Link] = {}
    for node, link in pairs:  # type: ignore[union-attr]
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < nodes:
            raise ValueError(f"node link for node {node!r} is outside this topology's nodes "
                             f"0..{nodes - 1}.")
        out[node] = _as_link(link, f"node {node}")
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class Topology:
    """A cluster of nodes x accelerators joined by an intra-node and an inter-node link.

    `nic` says whether a node's accelerators share one NIC of `inter.bandwidth` ("per-node") or each
    has its own ("per-accelerator"). `node_speed[i]` is node i's relative compute speed (1.0
    nominal, 0.5 = a straggler whose compute takes twice as long). `node_links` gives some nodes
    a link of their own instead of `inter` (a {node: Link} mapping, stored as sorted pairs): a
    collective across nodes runs at the pace of its slowest member link and pays the largest
    member latency per hop (`link_for`). `sites` (netsim.sites.Sites) groups the nodes into
    sites with links of their own inside, a shared uplink each and round-trip times between them;
    `inter` is then the sites' flat view (`Sites.flat_view`) and node_links are not allowed.
    `op_costs` (from `netsim.calibration.Calibration.op_costs`) prices some collective kinds on
    inter-node links apart: (op, bandwidth factor, latency per hop added), what a calibration
    measured of that op kind against the shared fit.
    `node_span` K > 1 makes each node stand for K nodes (a data-parallel replica spanning them):
    `intra` is the ring's link across them, `inter` their K NICs side by side, and an intra-node
    collective crosses each of those NICs once, sharing them with the inter-node traffic
    (`netsim.model`; per-node NICs only).
    """

    nodes: int
    accelerators_per_node: int
    intra: Link
    inter: Link
    nic: str = "per-node"
    node_speed: tuple[float, ...] = field(default=())
    node_links: NodeLinks = field(default=())
    sites: Sites | None = None
    op_costs: tuple[tuple[str, float, float], ...] = field(default=())
    node_span: int = 1

    def __post_init__(self) -> None:
        for name in ("nodes", "accelerators_per_node", "node_span"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} {value!r} must be a positive integer.")
        object.__setattr__(self, "intra", _as_link(self.intra, "intra"))
        object.__setattr__(self, "inter", _as_link(self.inter, "inter"))
        self._check_nic()
        speeds = tuple(self.node_speed) if self.node_speed else (1.0,) * self.nodes
        if len(speeds) != self.nodes:
            raise ValueError(
                f"node_speed has {len(speeds)} entries but the topology has {self.nodes} nodes; "
                f"give one speed per node."
            )
        for speed in speeds:
            if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not speed > 0:
                raise ValueError(
                    f"node_speed entry {speed!r} must be a positive number (1.0 = nominal)."
                )
        object.__setattr__(self, "node_speed", tuple(float(s) for s in speeds))
        object.__setattr__(self, "node_links", _as_node_links(self.node_links or (), self.nodes,
                                                                 self.inter))
        if self.sites is not None:
            self._check_sites()

    def _check_nic(self) -> None:
        """ValueError unless the NIC mode is known (per-node where a node stands for several)."""
        if self.nic not in NIC_MODES:
            raise ValueError(f"nic {self.nic!r} is not known; use one of {', '.join(NIC_MODES)}.")
        if self.node_span > 1 and self.nic != "per-node":
            raise ValueError(f"node_span {self.node_span} stands a node for several nodes' NICs "
                             "side by side, which takes nic 'per-node'.")

    def _check_sites(self) -> None:
        """ValueError unless the sites hold exactly this topology's nodes and no node links."""
        if self.sites.nodes != self.nodes:
            raise ValueError(f"the sites hold {self.sites.nodes} nodes but the topology has "
                             f"{self.nodes}; give as many nodes as the sites hold.")
        if self.node_links:
            raise ValueError("node links and sites both set links between nodes; give one of "
                             "them.")

    @classmethod
    def from_strings(
        cls,
        nodes: int,
        per_node: int,
        inter_bw: object | None = "1Gbit",
        inter_lat: object = "0ms",
        intra_bw: object = "25GB/s",
        intra_lat: object = "5us",
        nic: str = "per-node",
        node_speed: Sequence[float] | None = None,
        jitter: object = 0.0,
        loss: float = 0.0,
        node_links: Iterable[str] = (),
    ) -> Topology:
        """Build a topology from CLI-style strings; jitter and loss apply to every inter-node link.

        node_links: "NODE=BANDWIDTH[,LATENCY]" strings, e.g. ["3=100Mbit,20ms"]. inter_bw None
        is a placeholder inter link at intra_bw: an unshaped run's traffic is labelled with it,
        never timed. A value that does not parse is one ValueError naming its argument
        ("inter_bw '1x' does not parse: ...").
        """
        inter_bps = None if inter_bw is None else _parsed("inter_bw", parse_bandwidth, inter_bw)
        inter_lat_s = _parsed("inter_lat", parse_latency, inter_lat)
        intra = Link(_parsed("intra_bw", parse_bandwidth, intra_bw),
                     _parsed("intra_lat", parse_latency, intra_lat))
        inter = Link(intra.bandwidth if inter_bps is None else inter_bps, inter_lat_s,
                     jitter=jitter, loss=loss)
        return cls(
            nodes=nodes,
            accelerators_per_node=per_node,
            intra=intra,
            inter=inter,
            nic=nic,
            node_speed=tuple(node_speed) if node_speed else (),
            node_links=parse_node_links(node_links, nodes, inter),
        )

    @classmethod
    def on_sites(cls, sites: Sites, per_node: int, intra: Link, nic: str = "per-node",
                 node_speed: Sequence[float] | None = None) -> Topology:
        """A topology of the sites' nodes; its inter link is the sites' flat view."""
        return cls(nodes=sites.nodes, accelerators_per_node=per_node, intra=intra,
                   inter=Link(*sites.flat_view()), nic=nic,
                   node_speed=tuple(node_speed) if node_speed else (), sites=sites)

    @property
    def world_size(self) -> int:
        """Number of ranks: nodes x accelerators_per_node."""
        return self.nodes * self.accelerators_per_node

    def _check_rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not 0 <= int(rank) < self.world_size:
            raise ValueError(
                f"rank {rank!r} is outside this topology's ranks 0..{self.world_size - 1}."
            )
        return int(rank)

    def node_of(self, rank: int) -> int:
        """Node index of a global rank (rank // accelerators_per_node)."""
        return self._check_rank(rank) // self.accelerators_per_node

    def local_of(self, rank: int) -> int:
        """Accelerator index of a global rank inside its node."""
        return self._check_rank(rank) % self.accelerators_per_node

    def nodes_of(self, ranks: Iterable[int]) -> set[int]:
        """Set of nodes a group of global ranks spans."""
        return {self.node_of(r) for r in ranks}

    def crosses_nodes(self, ranks: Iterable[int]) -> bool:
        """Whether a group of global ranks spans more than one node (so it uses the inter link)."""
        return len(self.nodes_of(ranks)) > 1

    @cached_property
    def _own_links(self) -> dict[int, Link]:
        """node_links as a dict, built once: a lookup per node must not rebuild it (10^4 nodes)."""
        return dict(self.node_links)

    def node_link(self, node: int) -> Link:
        """Node `node`'s own link to the others: its entry in node_links, else inter."""
        return self._own_links.get(node, self.inter)

    def inter_link(self, nodes: Iterable[int] | None = None) -> Link:
        """The link a collective across `nodes` (default: all) runs over, as one uniform link.

        A ring (or tree) moves in lock-step, so its slowest member link sets the pace (with that
        link's loss) and each hop waits for the largest latency (and jitter) on the path.
        """
        if not self.node_links:
            return self.inter  # uniform: the very same object, so results stay bit-identical
        members = range(self.nodes) if nodes is None else sorted(set(nodes))
        links = [self.node_link(k) for k in members]
        slowest = min(links, key=lambda link: link.effective_bandwidth)
        return Link(slowest.bandwidth, max(link.latency for link in links),
                    jitter=max(link.jitter for link in links), loss=slowest.loss)

    def describe_node_links(self) -> list[str]:
        """The per-node links as "NODE=BANDWIDTH,LATENCY" strings (what run.json can record)."""
        return [f"{k}={format_bandwidth(link.bandwidth)},{link.latency * 1e3:g}ms"
                for k, link in self.node_links]

    def link_for(self, ranks: Iterable[int]) -> Link:
        """The link a group's collectives run over: intra inside a node, else `inter_link`."""
        nodes = self.nodes_of(ranks)
        return self.inter_link(nodes) if len(nodes) > 1 else self.intra

def ring_nic_share(ranks: Iterable[int], topology: Topology, per: str = "rank") -> float:
    """Share of a ring collective's wire bytes that crosses NICs, per group rank or per node.

    A ring over the sorted ranks crosses node boundaries on c of its p edges. Averaged over the
    group's ranks, c/p of a rank's bytes go through its node's NIC (what shaping books per rank);
    per node of the group, a NIC carries c/nodes of one rank's wire bytes (what the model sends
    through a node's NIC). One rank per node gives 1.0 either way; a group inside one node, 0.0.
    """
    if per not in ("rank", "node"):
        raise ValueError(f'ring_nic_share per={per!r} is not known; use "rank" or "node".')
    ordered = sorted(int(r) for r in ranks)
    if len(ordered) < 2:
        return 0.0
    crossing = sum(
        topology.node_of(a) != topology.node_of(b)
        for a, b in zip(ordered, ordered[1:] + ordered[:1], strict=True)
    )
    return crossing / (len(ordered) if per == "rank" else len(topology.nodes_of(ordered)))
