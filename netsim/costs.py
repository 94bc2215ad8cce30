"""Alpha-beta cost formulas and per-rank wire bytes of collectives (p ranks, n bytes, a, b = 1/bw).

Conventions: `nbytes` is always the payload this rank hands in (the input tensor); for an all-gather
the output is p times larger, so the textbook (p-1)/p * n_out becomes (p-1) * n_in here. Every
formula is `latency_steps * a + max(bytes_sent, bytes_received) / (bandwidth * efficiency)`: a ring
moves its bytes in lock-step, so the busier direction of a rank's link sets the pace.

Algorithm choice (`choose_algorithm`), as NCCL's tuner makes it (src/graph/tuning.cc): for each
candidate the tuner predicts `latency + bytes / algorithm bandwidth` and runs the cheapest.
The candidates here are the ring and one logarithmic-depth algorithm per op:
- all-reduce: NCCL's (double binary) tree, 2 * floor(log2 p) hops instead of the ring's 2(p-1);
  NCCL's algorithm bandwidth for it is half the bus bandwidth (each rank moves 2n up and down the
  tree, against the ring's 2(p-1)/p n) and it derates the tree's bus bandwidth by 0.92.
- all-gather / reduce-scatter: Bruck's algorithm (recursive doubling / halving for powers of two;
  what MPICH runs for short messages), ceil(log2 p) rounds and the ring's bytes. NCCL's
  counterpart is PAT (2.23+), which it offers only with one rank per node and derates by 0.75; the
  model takes both conditions from it, so this candidate loses at large messages.
NCCL's empirical size-dependent tree correction and protocol (LL/LL128) tables are left out: they
describe its GPUs' kernels, not the network.
"""

from __future__ import annotations

from dataclasses import dataclass

from netsim.topology import Link

__all__ = [
    "OPS",
    "P2P_OPS",
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
    "ALGORITHM_CHOICES",
    "TREE_EFFICIENCY",
    "BRUCK_EFFICIENCY",
    "log_depth_algorithm",
    "choose_algorithm",
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
P2P_OPS = ("send", "recv")  # point-to-point: one message between two ranks
# "allreduce": what gloo really runs for reduce_scatter_tensor (all-reduce, then a local slice).
ALGORITHMS = ("ring", "allreduce", "pipeline", "direct", "hierarchical", "tree", "bruck")
# What a model user may ask for: the library's pick, always the ring, always the log-depth one.
ALGORITHM_CHOICES = ("auto", "ring", "tree")
# Bandwidth derating NCCL's tuner applies to its tree all-reduce and to PAT (src/graph/tuning.cc).
TREE_EFFICIENCY = 0.92
BRUCK_EFFICIENCY = 0.75


@dataclass(frozen=True)
class CollectiveVolume:
    """What one rank pays for a collective: sequential latency steps and bytes on its link."""

    latency_steps: int
    bytes_sent: float
    bytes_received: float
    efficiency: float = 1.0  # share of the link's goodput the algorithm achieves

    @property
    def paced_bytes(self) -> float:
        """Bytes that set the pace: the busier direction, inflated by the algorithm's efficiency."""
        return max(self.bytes_sent, self.bytes_received) / self.efficiency

    def time(self, link: Link) -> float:
        """Seconds on a link: steps * latency + busier direction / (goodput * efficiency)."""
        return self.latency_steps * link.latency + self.paced_bytes / link.effective_bandwidth


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
    if algorithm in ("tree", "bruck"):
        return _log_depth_volume(op, p, n, algorithm)
    if op in ("broadcast", "gather", "scatter"):
        return _rooted_volume(op, p, n, is_root)
    return _symmetric_volume(op, p, n, algorithm)


def _symmetric_volume(op: str, p: int, n: float, algorithm: str) -> CollectiveVolume:
    """Volume of an op every rank runs alike (ring or direct; p >= 2)."""
    share = (p - 1) / p
    if op == "all_reduce" or (op == "reduce_scatter" and algorithm == "allreduce"):
        return CollectiveVolume(2 * (p - 1), 2 * share * n, 2 * share * n)
    if op == "barrier":
        return CollectiveVolume(2 * (p - 1), 0.0, 0.0)
    if op == "all_gather":
        return CollectiveVolume(p - 1, (p - 1) * n, (p - 1) * n)
    # reduce_scatter, all_to_all, reduce
    return CollectiveVolume(p - 1, share * n, share * n)


def _rooted_volume(op: str, p: int, n: float, is_root: bool) -> CollectiveVolume:
    """Volume of broadcast, gather or scatter, whose root moves other bytes (p >= 2)."""
    if op == "broadcast":
        # Pipelined chain: the root only sends, the others receive and pass the data on.
        return CollectiveVolume(p - 1, n, 0.0 if is_root else n)
    if op == "gather":
        return CollectiveVolume(1, 0.0 if is_root else n, (p - 1) * n if is_root else 0.0)
    # scatter: nbytes is the chunk each rank ends up with.
    return CollectiveVolume(1, (p - 1) * n if is_root else 0.0, 0.0 if is_root else n)


def _log_depth_volume(op: str, p: int, n: float, algorithm: str) -> CollectiveVolume:
    """Volume of the tree all-reduce or of Bruck's all-gather / reduce-scatter (p >= 2)."""
    if log_depth_algorithm(op) != algorithm:
        raise ValueError(
            f"algorithm {algorithm!r} does not run {op}; the tree is an all_reduce algorithm and "
            f"bruck an all_gather / reduce_scatter one."
        )
    if algorithm == "tree":
        # A binary tree of p nodes is floor(log2 p) deep; reduce up, then broadcast down.
        return CollectiveVolume(2 * (p.bit_length() - 1), 2 * n, 2 * n, TREE_EFFICIENCY)
    rounds = (p - 1).bit_length()  # ceil(log2 p)
    moved = (p - 1) * n if op == "all_gather" else (p - 1) / p * n
    return CollectiveVolume(rounds, moved, moved, BRUCK_EFFICIENCY)


def log_depth_algorithm(op: str) -> str | None:
    """The logarithmic-depth alternative to the ring for `op` (None if the model has none)."""
    if op == "all_reduce":
        return "tree"
    if op in ("all_gather", "reduce_scatter"):
        return "bruck"
    return None


def choose_algorithm(
    op: str,
    p: int,
    nbytes: float,
    link: Link,
    recorded: str = "ring",
    mode: str = "auto",
    one_per_node: bool = True,
) -> str:
    """The algorithm a library would run for `op` of nbytes over p ranks on `link`.

    mode "ring" keeps the recorded algorithm; "tree" forces the log-depth one where the op has it;
    "auto" picks the cheaper of the two by their alpha-beta time, ties to the ring (module
    docstring). Only ops recorded as rings have an alternative (gloo's reduce-scatter-as-all-
    reduce, broadcasts and point-to-point keep theirs), and Bruck only with one rank per node.
    """
    if mode not in ALGORITHM_CHOICES:
        raise ValueError(
            f"algorithm {mode!r} is not known; use one of {', '.join(ALGORITHM_CHOICES)}."
        )
    alternative = log_depth_algorithm(op)
    if mode == "ring" or recorded != "ring" or alternative is None or p < 2:
        return recorded
    if mode == "tree":
        return alternative
    if alternative == "bruck" and not one_per_node:
        return recorded
    ring = collective_volume(op, p, nbytes, "ring").time(link)
    other = collective_volume(op, p, nbytes, alternative).time(link)
    return alternative if other < ring else recorded


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
