"""Communication graphs for gossip: who a node talks to at a step, and with which weights.

Pure python (torch only for :func:`mixing_matrix`). Nodes are ``0..n-1`` (a node's index in
the replicate group). Every graph is undirected, so the Metropolis-Hastings weights
``w_ij = 1 / (1 + max(d_i, d_j))`` make its mixing matrix symmetric and doubly stochastic; on
the regular graphs here that is ``1/(d+1)``.

- ``ring``: the two nodes next to i (one on 2 nodes).
- ``torus``: a 2-D wrap-around grid of r x c nodes, r the largest divisor of n not above
  sqrt(n); the four grid neighbours, fewer where they coincide (needs a non-prime n >= 4).
- ``exponential``: static, the nodes 2^k hops away in both directions, for every 2^k < n.
- ``one-peer-exponential``: time-varying, one peer per step: at step t the partner is
  ``i XOR 2^(t mod ceil(log2 n))`` (2^k hops away), weights 1/2; when n is a power of two,
  log2(n) steps give the exact average (recursive doubling). A partner >= n sits the step out.
- ``complete``: every other node; one step is the exact average. A round in which every node
  has all others as peers (:func:`averages_exactly`: the complete graph, and any graph that
  is complete on so few nodes) mixes with weights 1/n, the replicas' mean, which gossip then
  takes with one all-reduce instead of n - 1 messages each way per node: DBench's complete
  graph is all-reduce, and its bytes are 2(n-1)/n of a shard a node, not 2(n-1).
- ``sites:S`` (S >= 2 dividing n): S sites of n/S consecutive nodes; inside each site the
  exponential graph of the site (the complete graph up to 4 nodes a site), and across sites a
  ring of gateways: the first node of site s also talks to the first node of sites s-1 and
  s+1. Exponential inside because a site's links are fast but a node's messages per round
  should grow with log2 of the site, not with the site (complete on 256 nodes is 255 messages
  a round). One gateway per site because a site's uplink is the scarce link: the ring of
  gateways puts 2 messages a round on each uplink whatever the site's size (1 on two sites),
  where pairing node i of every site with node i of the next would put 2 n/S there. The price
  is slower mixing across sites: one edge, of weight 1/(d+3) (d the in-site degree), joins two
  sites. Not vertex-transitive: the gateways have 2 peers more than the other nodes.

:func:`graph_ladder` orders the graphs that fit a node count from sparsest to densest, for Ada.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only in mixing_matrix: settings checks read the rest without it
    import torch

GRAPHS = ("ring", "torus", "exponential", "one-peer-exponential", "complete")
SITE_GRAPH = "sites"
"""The family of site graphs, named ``sites:S`` for S sites (not in :data:`GRAPHS`: it takes S)."""

# The fewest nodes a graph is built on (a 2-node ring is one edge, as the 2-node complete graph).
MIN_NODES = {"ring": 2, "torus": 4, "exponential": 2, "one-peer-exponential": 2, "complete": 2}


def torus_shape(nodes: int) -> tuple[int, int]:
    """(rows, cols) of the torus on ``nodes``: the factorization nearest a square."""
    rows = max(d for d in range(1, math.isqrt(nodes) + 1) if nodes % d == 0)
    return rows, nodes // rows


def fitting_graphs(nodes: int) -> list[str]:
    """The graphs that can be built on ``nodes`` nodes."""
    return [g for g in GRAPHS if graph_problem(g, nodes) is None]


def site_count(graph: str) -> int | None:
    """S of a site graph ``sites:S``; None for a graph of another family or a malformed S."""
    family, _, count = graph.partition(":")
    if family != SITE_GRAPH or not count.isdigit():
        return None
    return int(count)


def graph_name_problem(graph: object) -> str | None:
    """One sentence saying why ``graph`` names no graph, or None when it names one."""
    if isinstance(graph, str) and graph in GRAPHS:
        return None
    if isinstance(graph, str) and graph.partition(":")[0] == SITE_GRAPH:
        count = site_count(graph)
        if count is None or count < 2:
            return (f"graph={graph!r} needs a whole number of sites >= 2 after 'sites:', such "
                    "as sites:4.")
        return None
    return f"graph={graph!r} is unknown; use one of {', '.join(GRAPHS)}, or sites:S."


def _site_problem(graph: str, nodes: int) -> str | None:
    """Why the site graph ``graph`` cannot be built on ``nodes`` nodes, or None."""
    count = site_count(graph)
    if nodes % count:
        return (f"graph={graph!r} needs {count} equal sites of consecutive nodes, but "
                f"nodes={nodes} is not a multiple of {count}; use a node count that "
                f"{count} divides.")
    return None


def graph_problem(graph: str, nodes: int) -> str | None:
    """One sentence saying why ``graph`` cannot run on ``nodes`` nodes, or None when it can."""
    problem = graph_name_problem(graph)
    if problem is not None:
        return problem
    if site_count(graph) is not None:
        return _site_problem(graph, nodes)
    need = MIN_NODES[graph]
    if nodes < need:
        return (f"graph={graph!r} needs at least {need} nodes, got nodes={nodes}; "
                f"use nodes >= {need}.")
    if graph == "torus" and torus_shape(nodes)[0] == 1:
        others = [g for g in GRAPHS if g != "torus" and nodes >= MIN_NODES[g]]
        return (f"graph='torus' needs a node count with a 2-D factorization, but nodes={nodes} "
                f"is prime; on {nodes} nodes use one of {', '.join(others)}.")
    return None


def check_graph(graph: str, nodes: int) -> None:
    """Raise ValueError (one sentence) unless ``graph`` can run on ``nodes`` nodes."""
    problem = graph_problem(graph, nodes)
    if problem is not None:
        raise ValueError(problem)


def _hops(nodes: int) -> list[int]:
    """The powers of two below ``nodes``: 1, 2, 4, ..."""
    return [1 << k for k in range(max(1, (nodes - 1).bit_length())) if (1 << k) < nodes]


def _torus_peers(nodes: int, node: int) -> set[int]:
    rows, cols = torus_shape(nodes)
    r, c = divmod(node, cols)
    return {((r + dr) % rows) * cols + (c + dc) % cols
            for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1))}


def site_blocks(graph: str, nodes: int) -> list[range]:
    """The sites of the site graph ``graph`` on ``nodes`` nodes, each a range of nodes."""
    check_graph(graph, nodes)
    count = site_count(graph)
    if count is None:
        raise ValueError(f"graph={graph!r} is not a site graph (sites:S).")
    size = nodes // count
    return [range(s * size, (s + 1) * size) for s in range(count)]


def _site_peers(count: int, nodes: int, node: int) -> set[int]:
    """``node``'s peers in the site graph of ``count`` sites: in-site exponential, gateways."""
    size = nodes // count
    site, position = divmod(node, size)
    first = site * size
    found = {first + (position + s * h) % size for h in _hops(size) for s in (1, -1)}
    if position == 0:  # the site's gateway: the gateways of the sites before and after
        found |= {((site + s) % count) * size for s in (1, -1)}
    return found


def peers(graph: str, nodes: int, node: int, step: int = 0) -> list[int]:
    """The distinct nodes ``node`` exchanges with at gossip round ``step`` (0-based), sorted."""
    check_graph(graph, nodes)
    count = site_count(graph)
    if count is not None:
        found = _site_peers(count, nodes, node)
    elif graph == "ring":
        found = {(node + 1) % nodes, (node - 1) % nodes}
    elif graph == "torus":
        found = _torus_peers(nodes, node)
    elif graph == "exponential":
        found = {(node + s * h) % nodes for h in _hops(nodes) for s in (1, -1)}
    elif graph == "one-peer-exponential":
        hops = _hops(nodes)
        partner = node ^ hops[step % len(hops)]
        found = {partner} if partner < nodes else set()
    else:
        found = set(range(nodes))
    found.discard(node)
    return sorted(found)


def busiest_degree(graph: str, nodes: int, step: int = 0) -> int:
    """Peers of the busiest node at round ``step``: on a vertex-transitive graph, any node's."""
    if graph == "one-peer-exponential" or site_count(graph) is not None:
        # Off a power of two some one-peer nodes sit a round out; a site's gateway has 2 more.
        return max(degree_of(graph, nodes, node, step) for node in range(nodes))
    return degree_of(graph, nodes, 0, step)


def site_layout(graph: str, nodes: int) -> str:
    """The site graph ``graph`` on ``nodes`` nodes in words: its sites and their degrees."""
    count = site_count(graph)
    if count is None:
        raise ValueError(f"graph={graph!r} is not a site graph (sites:S).")
    size = nodes // count
    inside = len(_site_peers(count, nodes, 1)) if size > 1 else 0
    nodes_word = "node" if size == 1 else "nodes"
    return (f"{count} sites of {size} {nodes_word}, exponential inside (degree {inside}), a "
            f"ring of gateways (each site's first node) across: degree "
            f"{len(_site_peers(count, nodes, 0))} at the {count} gateways, {inside} elsewhere")


def degree_of(graph: str, nodes: int, node: int, step: int = 0) -> int:
    """How many peers ``node`` exchanges with at round ``step``."""
    return len(peers(graph, nodes, node, step))


@functools.lru_cache(maxsize=256)
def averages_exactly(graph: str, nodes: int, step: int = 0) -> bool:
    """Whether round ``step`` of ``graph`` on ``nodes`` nodes is the exact average: every node
    has every other as a peer (so every weight is 1/n). Cached: gossip asks every round."""
    step %= period(graph, nodes)
    return nodes > 1 and all(degree_of(graph, nodes, node, step) == nodes - 1
                             for node in range(nodes))


def period(graph: str, nodes: int) -> int:
    """Gossip rounds after which a graph's schedule repeats (1 for static graphs)."""
    return len(_hops(nodes)) if graph == "one-peer-exponential" else 1


def weights(graph: str, nodes: int, node: int, step: int = 0) -> tuple[float, dict[int, float]]:
    """``node``'s own weight and its peers' weights (Metropolis-Hastings) at round ``step``."""
    mine = peers(graph, nodes, node, step)
    degree = len(mine)
    theirs = {j: 1.0 / (1 + max(degree, len(peers(graph, nodes, j, step)))) for j in mine}
    return 1.0 - sum(theirs.values()), theirs


def mixing_matrix(graph: str, nodes: int, step: int = 0) -> torch.Tensor:
    """The n x n mixing matrix W of round ``step`` (float64): x_next = W @ x."""
    import torch

    w = torch.zeros(nodes, nodes, dtype=torch.float64)
    for i in range(nodes):
        own, theirs = weights(graph, nodes, i, step)
        w[i, i] = own
        for j, wij in theirs.items():
            w[i, j] = wij
    return w


def mean_degree(graph: str, nodes: int) -> float:
    """Peers per node and round, averaged over the nodes and one period of the schedule."""
    rounds = period(graph, nodes)
    total = sum(degree_of(graph, nodes, i, t) for t in range(rounds) for i in range(nodes))
    return total / (nodes * rounds)


def graph_ladder(nodes: int) -> list[str]:
    """The graphs fitting ``nodes`` nodes from sparsest to densest, each costlier than the last.

    Sorted by :func:`mean_degree` (the messages a node sends per round, so the bytes a round
    costs). Graphs of equal mean degree cost the same, so only one of them is a rung: the first
    in :data:`GRAPHS` order, except that a graph of degree ``nodes - 1`` is the complete graph
    and is called so (on 4 nodes: one-peer-exponential, ring, complete). Empty on one node.
    """
    by_cost: dict[float, str] = {}
    for graph in fitting_graphs(nodes):
        by_cost.setdefault(mean_degree(graph, nodes), graph)
    if nodes > 1:
        by_cost[float(nodes - 1)] = "complete"
    return [by_cost[cost] for cost in sorted(by_cost)]
