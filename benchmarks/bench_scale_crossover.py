"""Where DeMo-style all-gathers start to cost more than an all-reduce of the gradients.

Run: python benchmarks/bench_scale_crossover.py [--inter-bw 10Gbit --inter-lat 10us ...]
Replays the committed quick-sweep runs (2 x 2 recordings: flexdemo-s0, one 74,516-byte all-gather
per rank and step; hsdp-adamw-s0, 1,734,144 bytes of fp32 gradient shards all-reduced per rank
and step) at growing node counts, with the same model as `flexbench simulate`: re-sharded to
--gpus-per-node (experiments.replay.reshard) and, as the compute is declared, intra-node links
modeled on the NVLink-class default. It prints the median step time of each side by side:
hsdp-adamw as recorded (fp32) and with its all-reduce bytes halved (bf16).
An all-gather's received bytes grow with the node count, an all-reduce's do not, so flexdemo's
step overtakes both at some node count; the script finds the first such count by bisection.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from experiments.replay.reshard import reshard_trace, run_layout
from experiments.replay.simulate import GPU_INTRA, read_run
from netsim import Topology, parse_bandwidth, parse_latency, simulate
from netsim.costs import ALGORITHM_CHOICES

NODES = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def bf16_gradients(trace: pd.DataFrame) -> pd.DataFrame:
    """The same trace with its inter-node all-reduces halved: bf16 instead of fp32 gradients."""
    out = trace.copy()
    rows = (out["kind"] == "collective") & out["inter"] & (out["op"] == "all_reduce")
    out.loc[rows, "bytes"] = out.loc[rows, "bytes"] // 2
    return out


def resharded(run_dir: Path, per_node: int) -> pd.DataFrame:
    """A recorded run's trace re-sharded to `per_node` ranks per node, as `flexbench simulate`
    replays it."""
    run = read_run(run_dir)
    if per_node == run.config.gpus_per_node:
        return run.trace
    return reshard_trace(run.trace, run.config, run_layout(run.meta, run.config), per_node).trace


def step_time(trace: pd.DataFrame, nodes: int, args: argparse.Namespace) -> float:
    """Median predicted step time (s) of a trace on `nodes` x gpus_per_node."""
    topo = Topology.from_strings(
        nodes, args.gpus_per_node, parse_bandwidth(args.inter_bw), parse_latency(args.inter_lat),
        intra_bw=GPU_INTRA[0], intra_lat=GPU_INTRA[1],
    )
    # intra="model", as `flexbench simulate` does when the compute is declared (--compute-scale).
    sim = simulate(
        trace, topo, compute_scale=args.compute_scale, intra="model", algorithm=args.algorithm
    )
    return float(sim.frame["step_time_s"].median())


def first_crossing(costlier: Callable[[int], bool], low: int, high: int) -> int | None:
    """Smallest n in (low, high] with costlier(n), given costlier(high) and not costlier(low)."""
    if not costlier(high):
        return None
    while high - low > 1:
        mid = (low + high) // 2
        if costlier(mid):
            high = mid
        else:
            low = mid
    return high


def main() -> None:
    """Print the sweep over node counts and the crossover node counts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", default="results/quick/units", help="folder of recorded runs")
    parser.add_argument("--inter-bw", default="10Gbit")
    parser.add_argument("--inter-lat", default="10us")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--compute-scale", type=float, default=0.05)
    parser.add_argument("--algorithm", choices=ALGORITHM_CHOICES, default="auto")
    args = parser.parse_args()
    units = Path(args.units)
    flex, fp32 = (resharded(units / name, args.gpus_per_node)
                  for name in ("flexdemo-s0", "hsdp-adamw-s0"))
    traces = {"flexdemo": flex, "hsdp-adamw fp32": fp32, "hsdp-adamw bf16": bf16_gradients(fp32)}
    print(
        f"median step time (ms), {args.inter_bw}, {args.inter_lat}, x{args.gpus_per_node} per "
        f"node, compute x{args.compute_scale}, algorithm {args.algorithm}"
    )
    print(f"{'nodes':>6}" + "".join(f"{name:>18}" for name in traces))
    times: dict[str, dict[int, float]] = {name: {} for name in traces}
    for n in NODES:
        for name, trace in traces.items():
            times[name][n] = step_time(trace, n, args)
        print(f"{n:>6}" + "".join(f"{times[name][n] * 1e3:>18.1f}" for name in traces))
    for name in ("hsdp-adamw fp32", "hsdp-adamw bf16"):
        above = [n for n in NODES if times["flexdemo"][n] > times[name][n]]
        if not above:
            print(f"flexdemo stays cheaper than {name} up to {NODES[-1]} nodes")
            continue
        high = above[0]
        low = NODES[NODES.index(high) - 1] if high != NODES[0] else 1
        found = first_crossing(
            lambda n, other=traces[name]: step_time(flex, n, args) > step_time(other, n, args),
            low,
            high,
        )
        print(f"flexdemo's step costs more than {name}'s from {found} nodes on")


if __name__ == "__main__":
    main()
