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
- ``complete``: every other node; one step is the exact average.

:func:`graph_ladder` orders the graphs that fit a node count from sparsest to densest, for Ada.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only in mixing_matrix: settings checks read the rest without it
    import torch

GRAPHS = ("ring", "torus", "exponential", "one-peer-exponential", "complete")

# The fewest nodes a graph is built on (a 2-node ring is one edge, as the 2-node complete graph).
MIN_NODES = {"ring": 2, "torus": 4, "exponential": 2, "one-peer-exponential": 2, "complete": 2}


def torus_shape(nodes: int) -> tuple[int, int]:
    """(rows, cols) of the torus on ``nodes``: the factorization nearest a square."""
    rows = max(d for d in range(1, math.isqrt(nodes) + 1) if nodes % d == 0)
    return rows, nodes // rows


def fitting_graphs(nodes: int) -> list[str]:
    """The graphs that can be built on ``nodes`` nodes."""
    return [g for g in GRAPHS if graph_problem(g, nodes) is None]


def graph_problem(graph: str, nodes: int) -> str | None:
    """One sentence saying why ``graph`` cannot run on ``nodes`` nodes, or None when it can."""
    if graph not in GRAPHS:
        return f"graph={graph!r} is unknown; use one of {', '.join(GRAPHS)}."
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


def peers(graph: str, nodes: int, node: int, step: int = 0) -> list[int]:
    """The distinct nodes ``node`` exchanges with at gossip round ``step`` (0-based), sorted."""
    check_graph(graph, nodes)
    if graph == "ring":
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


def degree_of(graph: str, nodes: int, node: int, step: int = 0) -> int:
    """How many peers ``node`` exchanges with at round ``step``."""
    return len(peers(graph, nodes, node, step))


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
