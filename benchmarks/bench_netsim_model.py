"""Speed of the netsim SimPy model: replay and extrapolation figures against their targets.

Run: python benchmarks/bench_netsim_model.py
Prints seconds and peak memory for (a) replaying 1,000 steps of a 2-node x 2 trace (target < 2 s),
(b) 1,024 nodes x 8 accelerators for 100 steps, and 10,000 nodes x 8 with every node a link of
its own (each target < 60 s on one core, < 2 GB), (c) how the cost grows with nodes and steps,
and (d) gossip recorded on 4 nodes replayed on 1,024 nodes for ring, torus and exponential
graphs (target: seconds; the step cost follows the degree).
"""

from __future__ import annotations

import resource
import time

import pandas as pd

from experiments.replay.gossip import recorded_schedule
from flexdemo import graphs
from netsim import ReplayOptions, Topology, TraceRecorder, simulate


def hsdp_like_trace(steps: int, nodes: int = 2, per_node: int = 2) -> pd.DataFrame:
    """A synthetic HSDP trace: per step 4 layers of intra all-gather / reduce-scatter, compute in
    between, and one inter-node all-reduce of the gradient shard overlapped with the last layer."""
    topo = Topology.from_strings(nodes, per_node, "1Gbit", "1ms")
    frames = []
    for rank in range(topo.world_size):
        now = [0.0]
        rec = TraceRecorder(rank, topo, clock=lambda now=now: now[0])
        node = rank // per_node
        shard = list(range(node * per_node, (node + 1) * per_node))
        rep = [rank % per_node + k * per_node for k in range(nodes)]

        def coll(op, group, nbytes, real=0.0005, wait_after=0.0, now=now, rec=rec):
            start = now[0]
            row = rec.record_collective(
                op, group, topo.crosses_nodes(group), "ring", nbytes, 0, 0, start
            )
            now[0] += wait_after
            rec.complete(row, now[0], now[0] + real)
            now[0] += real

        for step in range(steps):
            rec.begin_step(step)
            for _layer in range(4):
                coll("all_gather", shard, 2_000_000)
                now[0] += 0.010  # forward + backward compute of a layer
                coll("reduce_scatter", shard, 4_000_000)
            coll("all_reduce", rep, 8_000_000, wait_after=0.005)  # overlapped with 5 ms compute
            now[0] += 0.002  # optimizer step
            rec.end_step(step)
        frames.append(rec.frame())
    return pd.concat(frames, ignore_index=True)


def gossip_trace(steps: int, graph: str, nodes: int = 4, shard: int = 4_000_000) -> pd.DataFrame:
    """A synthetic gossip trace: per step 20 ms compute, then a send and a recv per neighbour."""
    topo = Topology.from_strings(nodes, 1)
    frames = []
    for rank in range(nodes):
        now = [0.0]
        rec = TraceRecorder(rank, topo, clock=lambda now=now: now[0])
        for step in range(steps):
            rec.begin_step(step)
            now[0] += 0.020
            rows = [
                rec.record_collective(op, range(nodes), True, "direct", shard,
                                      shard if op == "send" else 0,
                                      0 if op == "send" else shard, now[0], peer=peer)
                for peer in graphs.peers(graph, nodes, rank, step) for op in ("send", "recv")
            ]  # fmt: skip
            for row in rows:
                rec.complete(row, now[0], now[0] + 0.01)
            now[0] += 0.01
            rec.end_step(step)
        frames.append(rec.frame())
    return pd.concat(frames, ignore_index=True)


def timed(fn):
    """(seconds, result) of one call."""
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    print("netsim model benchmark (synthetic 2-node x 2 HSDP trace, 10 collectives per step)")
    trace = hsdp_like_trace(1000)
    two = Topology.from_strings(2, 2, "1Gbit", "1ms")
    secs, out = timed(lambda: simulate(trace, two))
    print(f"{'figure':<46}{'measured':>12}{'target':>12}")
    print(f"{'replay 1,000 steps of 2x2 trace (s)':<46}{secs:>12.3f}{'< 2':>12}")
    big = Topology.from_strings(1024, 8, "100Gbit", "5us", nic="per-accelerator")
    short = hsdp_like_trace(100)
    secs_big, big_out = timed(lambda: simulate(short, big, ReplayOptions(steps=100)))
    print(f"{'1,024 nodes x 8, 100 steps (s)':<46}{secs_big:>12.3f}{'< 60':>12}")
    # Every node its own link: one class per speed, paced by its slowest link.
    links = [f"{k}={1 + k * 1e-3:.4f}Gbit,{1 + (k % 13) * 0.05:.2f}ms" for k in range(10_000)]
    secs_het, het_out = timed(lambda: simulate(  # the topology's 10,000 links parsed too
        short, Topology.from_strings(10_000, 8, "10Gbit", "1ms", node_links=links),
ReplayOptions(steps=100)))
    print(f"{'10,000 nodes x 8, each its own link (s)':<46}{secs_het:>12.3f}{'< 60':>12}")
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{'peak resident memory of this process (MB)':<46}{peak_mb:>12.0f}{'< 2048':>12}")
    print(
        f"  predicted 2x2 step time {out.frame['step_time_s'].median():.4f} s; "
        f"1024x8 step time {big_out.frame['step_time_s'].median():.4f} s; 10,000 distinct "
        f"links {het_out.frame['step_time_s'].median():.4f} s"
    )
    print("\ncost growth (seconds per simulate call; 100-step trace, cycled):")
    print(f"{'nodes x per_node':<20}" + "".join(f"{s:>12} st" for s in (100, 1000)))
    for nodes, per_node in ((2, 2), (16, 8), (128, 8), (1024, 8), (4096, 8)):
        topo = Topology.from_strings(
            nodes, per_node, "10Gbit", "10us", node_speed=[1.0] * (nodes - 1) + [0.8]
        )
        row = [timed(lambda t=topo, s=s: simulate(short, t,
                                                  ReplayOptions(steps=s)))[0] for s in (100, 1000)]
        print(f"{f'{nodes} x {per_node}':<20}" + "".join(f"{r:>15.3f}" for r in row))
    print(
        "(with a straggler node: 2 speed classes x per_node processes; cost is linear in steps and"
        "\n per_node, flat in the node count)"
    )
    print("\ngossip recorded on 4 nodes x 1, replayed on 1,024 nodes x 1 (1,000 steps, 10 Gbit/s):")
    print(f"{'graph':<14}{'degree':>8}{'seconds':>10}{'step (ms)':>12}{'target':>10}")
    for graph in ("ring", "torus", "exponential"):
        trace = gossip_trace(100, graph)
        steps = pd.DataFrame({"step": range(100)})
        degrees, _, _ = recorded_schedule({"config": {"method": "gossip", "graph": graph}},
                                          steps, 1024, None)
        topo = Topology.from_strings(1024, 1, "10Gbit", "1ms")
        secs, out = timed(lambda t=trace, d=degrees, topo=topo: simulate(t, topo,
                                                                         ReplayOptions(steps=1000,
                                                                        degrees=d)))
        print(f"{graph:<14}{out.p2p_degrees[0]:>8}{secs:>10.3f}"
              f"{out.frame['step_time_s'].median() * 1e3:>12.2f}{'seconds':>10}")


if __name__ == "__main__":
    main()
