"""Alpha-beta cost formulas and per-rank wire bytes of collectives (p ranks, n bytes, a, b = 1/bw).

Conventions: `nbytes` is always the payload this rank hands in (the input tensor); for an all-gather
the output is p times larger, so the textbook (p-1)/p * n_out becomes (p-1) * n_in here. Every
formula is `latency_steps * a + max(bytes_sent, bytes_received) / bandwidth`: a ring moves its
bytes in lock-step, so the busier direction of a rank's link sets the pace.
"""

from __future__ import annotations

from dataclasses import dataclass

from netsim.topology import Link

__all__ = [
    "OPS",
    "ALGORITHMS",
    "CollectiveVolume",
    "collective_volume",
    "collective_time",
    "ring_all_gather_time",
    "ring_reduce_scatter_time",
    "ring_all_reduce_time",
    "hierarchical_all_reduce_time",
    "point_to_point_time",
    "default_algorithm",
]

OPS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "send",
    "recv",
    "barrier",
    "gather",
    "scatter",
    "reduce",
)
# "allreduce": what gloo really runs for reduce_scatter_tensor (all-reduce, then a local slice).
ALGORITHMS = ("ring", "allreduce", "pipeline", "direct", "hierarchical")


@dataclass(frozen=True)
class CollectiveVolume:
    """What one rank pays for a collective: sequential latency steps and bytes on its link."""

    latency_steps: int
    bytes_sent: float
    bytes_received: float

    def time(self, link: Link) -> float:
        """Seconds on a link: steps * latency + busier direction / goodput."""
        return self.latency_steps * link.latency + max(self.bytes_sent, self.bytes_received) / (
            link.effective_bandwidth
        )


def default_algorithm(op: str, backend: str = "gloo") -> str:
    """Algorithm a real backend uses for an op (gloo turns reduce-scatter into an all-reduce)."""
    if op == "reduce_scatter" and backend == "gloo":
        return "allreduce"
    if op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "barrier", "reduce"):
        return "ring"
    if op == "broadcast":
        return "pipeline"
    return "direct"


def _check(op: str, p: int, nbytes: float) -> None:
    if op not in OPS:
        raise ValueError(f"collective op {op!r} is not known; use one of {', '.join(OPS)}.")
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ValueError(f"group size {p!r} must be a positive integer.")
    if not nbytes >= 0:
        raise ValueError(f"message size {nbytes!r} bytes must be zero or positive.")


def collective_volume(
    op: str, p: int, nbytes: float, algorithm: str | None = None, is_root: bool = False
) -> CollectiveVolume:
    """Latency steps and wire bytes sent/received by one rank for `op` over p ranks on nbytes input.

    `is_root` matters only for rooted ops (broadcast source, gather/scatter/reduce destination).
    """
    _check(op, p, nbytes)
    algorithm = algorithm or default_algorithm(op)
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"algorithm {algorithm!r} is not known; use one of {', '.join(ALGORITHMS)}."
        )
    n = float(nbytes)
    if op == "send":
        return CollectiveVolume(1, n, 0.0)
    if op == "recv":
        return CollectiveVolume(1, 0.0, n)
    if p == 1:
        return CollectiveVolume(0, 0.0, 0.0)
    share = (p - 1) / p
    if op == "all_reduce" or (op == "reduce_scatter" and algorithm == "allreduce"):
        return CollectiveVolume(2 * (p - 1), 2 * share * n, 2 * share * n)
    if op == "barrier":
        return CollectiveVolume(2 * (p - 1), 0.0, 0.0)
    if op == "all_gather":
        return CollectiveVolume(p - 1, (p - 1) * n, (p - 1) * n)
    if op in ("reduce_scatter", "all_to_all", "reduce"):
        return CollectiveVolume(p - 1, share * n, share * n)
    if op == "broadcast":
        # Pipelined chain: the root only sends, the others receive and pass the data on.
        return CollectiveVolume(p - 1, n, 0.0 if is_root else n)
    if op == "gather":
        return CollectiveVolume(1, 0.0 if is_root else n, (p - 1) * n if is_root else 0.0)
    # scatter: nbytes is the chunk each rank ends up with.
    return CollectiveVolume(1, (p - 1) * n if is_root else 0.0, 0.0 if is_root else n)


def collective_time(
    op: str, p: int, nbytes: float, link: Link, algorithm: str | None = None
) -> float:
    """Seconds for one collective over a single link type (the slowest rank's view)."""
    # The root of a rooted op is the busiest rank, so it sets the completion time.
    return (
        collective_volume(op, p, nbytes, algorithm, is_root=True).time(link)
        if op
        in (
            "gather",
            "scatter",
        )
        else collective_volume(op, p, nbytes, algorithm).time(link)
    )


def ring_all_gather_time(p: int, n_out: float, link: Link) -> float:
    """Ring all-gather: (p-1)a + (p-1)/p * n_out * b, n_out = gathered output bytes."""
    return (p - 1) * link.latency + (p - 1) / p * n_out / link.effective_bandwidth


def ring_reduce_scatter_time(p: int, n_in: float, link: Link) -> float:
    """Ring reduce-scatter: (p-1)a + (p-1)/p * n_in * b, n_in = input bytes."""
    return (p - 1) * link.latency + (p - 1) / p * n_in / link.effective_bandwidth


def ring_all_reduce_time(p: int, n: float, link: Link) -> float:
    """Ring all-reduce: 2(p-1)a + 2(p-1)/p * n * b."""
    return 2 * (p - 1) * link.latency + 2 * (p - 1) / p * n / link.effective_bandwidth


def point_to_point_time(n: float, link: Link) -> float:
    """Point-to-point message: a + n * b."""
    return link.latency + n / link.effective_bandwidth


def hierarchical_all_reduce_time(
    nodes: int, per_node: int, n: float, intra: Link, inter: Link, nic: str = "per-node"
) -> float:
    """Intra reduce-scatter, inter all-reduce of n/per_node, intra all-gather.

    With nic="per-node" the per_node concurrent inter-node all-reduces share one NIC, so together
    they move the whole n through it; with "per-accelerator" each uses its own NIC.
    """
    shard = n / per_node
    inter_time = ring_all_reduce_time(nodes, shard, inter)
    if nic == "per-node" and nodes > 1:
        inter_time += 2 * (nodes - 1) / nodes * shard * (per_node - 1) / inter.effective_bandwidth
    return (
        ring_reduce_scatter_time(per_node, n, intra)
        + inter_time
        + ring_all_gather_time(per_node, n, intra)
    )
