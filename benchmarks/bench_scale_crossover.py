"""Where DeMo-style all-gathers start to cost more than an all-reduce of the gradients.

Run: python benchmarks/bench_scale_crossover.py [--inter-bw 10Gbit --inter-lat 10us ...]
     [--dense-run DIR ... --nodes 64,1024,10000]
Replays the committed quick-sweep runs (2 x 2 recordings: flexdemo-s0, one 74,516-byte all-gather
per rank and step; hsdp-adamw-s0, 1,734,144 bytes of fp32 gradient shards all-reduced per rank
and step) at growing node counts, with the same model as `flexbench simulate`: re-sharded to
--gpus-per-node (experiments.replay.reshard) and, as the compute is declared, intra-node links
modeled on the NVLink-class default. It prints the median step time of each side by side:
hsdp-adamw as recorded (fp32) and with its all-reduce bytes halved (bf16).
An all-gather's received bytes grow with the node count, an all-reduce's do not, so flexdemo's
step overtakes both at some node count; the script finds the first such count by bisection.

The dense exchanges (``exchange = "dense"``, ``"dense-mean"``: one bf16 all-reduce of the shard's
DCT coefficients per rank and step, 2 or 4 bytes an element, re-sharded exactly, as hsdp-adamw's)
are derived from flexdemo-s0: its all-gather turned into that all-reduce, its compute kept, so
the columns differ by the exchange alone (recordings on this shared machine differ by more in
their compute). ``auto``: at each node count the column ``exchange = "auto"`` would run
(flexdemo.wire.dense_is_cheaper on the re-sharded per-rank bytes). Each --dense-run (a recorded
run with a dense exchange) adds its own column, "(rec.)", as a cross-check.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from experiments.replay.engine import GPU_INTRA
from experiments.replay.recordings import RecordedRun, read_run
from experiments.replay.reshard import reshard_trace, run_layout, shard_elements
from flexdemo.wire import dense_is_cheaper
from netsim import ReplayOptions, Topology, parse_bandwidth, parse_latency, simulate
from netsim.costs import ALGORITHM_CHOICES

NODES = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def bf16_gradients(trace: pd.DataFrame) -> pd.DataFrame:
    """The same trace with its inter-node all-reduces halved: bf16 instead of fp32 gradients."""
    out = trace.copy()
    rows = (out["kind"] == "collective") & out["inter"] & (out["op"] == "all_reduce")
    out.loc[rows, "bytes"] = out.loc[rows, "bytes"] // 2
    return out


def resharded(run_dir: Path, per_node: int,
              derive: Callable[[pd.DataFrame, RecordedRun], pd.DataFrame] | None = None
              ) -> pd.DataFrame:
    """A recorded run's trace (through `derive` first, if given) re-sharded to `per_node` ranks
    per node, as `flexbench simulate` replays it."""
    run = read_run(run_dir)
    trace = run.trace if derive is None else derive(run.trace, run)
    if per_node == run.config.gpus_per_node:
        return trace
    return reshard_trace(trace, run.config, run_layout(run.meta, run.config), per_node).trace


def dense_exchange(per_element: int) -> Callable[[pd.DataFrame, RecordedRun], pd.DataFrame]:
    """Turn a flexdemo recording's inter-node all-gathers into the dense exchange's all-reduce
    of the rank's whole shard, `per_element` bytes an element (2: dense, 4: dense-mean)."""

    def derive(trace: pd.DataFrame, run: RecordedRun) -> pd.DataFrame:
        units, _ = run_layout(run.meta, run.config)
        shard = sum(shard_elements(s, run.config.gpus_per_node) for unit in units for s in unit)
        out = trace.copy()
        rows = ((out["kind"] == "collective") & out["inter"] & (out["op"] == "all_gather")
                & (out["phase"] == "train"))
        out.loc[rows, "op"] = "all_reduce"
        out.loc[rows, "bytes"] = per_element * shard
        return out

    return derive


def step_time(trace: pd.DataFrame, nodes: int, args: argparse.Namespace) -> float:
    """Median predicted step time (s) of a trace on `nodes` x gpus_per_node."""
    topo = Topology.from_strings(
        nodes, args.gpus_per_node, parse_bandwidth(args.inter_bw), parse_latency(args.inter_lat),
        intra_bw=GPU_INTRA[0], intra_lat=GPU_INTRA[1],
    )
    # intra="model", as `flexbench simulate` does when the compute is declared (--compute-scale).
    sim = simulate(
        trace, topo,
ReplayOptions(compute_scale=args.compute_scale, intra="model", algorithm=args.algorithm)
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


def exchange_bytes(trace: pd.DataFrame, op: str) -> int:
    """Rank 0's inter-node `op` bytes per training step (its one DeMo exchange per step)."""
    rows = trace[(trace["phase"] == "train") & (trace["kind"] == "collective") & trace["inter"]
                 & (trace["op"] == op) & (trace["rank"] == 0)]
    return round(rows["bytes"].sum() / rows["step"].nunique())


def node_counts(text: str) -> tuple[int, ...]:
    """A comma-separated list of node counts, each at least 2."""
    counts = tuple(int(n) for n in text.split(","))
    if any(n < 2 for n in counts):
        raise argparse.ArgumentTypeError(f"--nodes {text!r} must list node counts >= 2.")
    return counts


def crossings(traces: dict[str, pd.DataFrame], times: dict[str, dict[int, float]],
              nodes: tuple[int, ...], args: argparse.Namespace) -> None:
    """Print, for each flexdemo column, from how many nodes on it costs more than hsdp-adamw."""
    for flex in (name for name in traces if not name.startswith("hsdp")):
        for name in ("hsdp-adamw fp32", "hsdp-adamw bf16"):
            above = [n for n in nodes if times[flex][n] > times[name][n]]
            if not above:
                print(f"{flex} stays cheaper than {name} up to {nodes[-1]} nodes")
                continue
            high = above[0]
            low = nodes[nodes.index(high) - 1] if high != nodes[0] else 1
            found = first_crossing(
                lambda n, a=traces[flex], b=traces[name]: step_time(a, n, args)
                > step_time(b, n, args), low, high)
            print(f"{flex}'s step costs more than {name}'s from {found} nodes on")


def recorded_and_derived(args: argparse.Namespace) -> dict[str, pd.DataFrame]:
    """The traces to replay, by column name, each re-sharded to the target ranks per node."""
    units = Path(args.units)
    flex, fp32 = (resharded(units / name, args.gpus_per_node)
                  for name in ("flexdemo-s0", "hsdp-adamw-s0"))
    traces = {"flexdemo": flex, "hsdp-adamw fp32": fp32, "hsdp-adamw bf16": bf16_gradients(fp32)}
    for exchange, per_element in (("dense", 2), ("dense-mean", 4)):
        traces[f"flexdemo {exchange}"] = resharded(units / "flexdemo-s0", args.gpus_per_node,
                                                   dense_exchange(per_element))
    for run_dir in args.dense_run:
        traces[f"{read_run(run_dir).config.exchange} (rec.)"] = resharded(run_dir,
                                                                          args.gpus_per_node)
    sizes = {name: exchange_bytes(t, "all_reduce") for name, t in traces.items()
             if name.startswith(("flexdemo ", "dense"))}
    print(f"per rank and step (re-sharded to {args.gpus_per_node} per node): flexdemo's "
          f"all-gather bucket {exchange_bytes(flex, 'all_gather'):,} bytes; all-reduce of "
          + ", ".join(f"{b:,} bytes ({name})" for name, b in sizes.items())
          + "; flexdemo dense and dense-mean derived from flexdemo-s0 (its compute, its "
          "all-gather turned into the all-reduce of its shard), (rec.) columns recorded")
    return traces


def auto_picks(traces: dict[str, pd.DataFrame], args: argparse.Namespace) -> dict[int, str]:
    """Per node count, the column exchange=auto would run: the all-gather or dense-mean."""
    sparse = exchange_bytes(traces["flexdemo"], "all_gather")
    dense = exchange_bytes(traces["flexdemo dense-mean"], "all_reduce")
    print(f"auto: dense-mean where 2 x {dense:,} < N x {sparse:,}, else the all-gather")
    return {n: "flexdemo dense-mean" if dense_is_cheaper(sparse, dense, n) else "flexdemo"
            for n in args.nodes}


def main() -> None:
    """Print the sweep over node counts and the crossover node counts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # docs/replay.md's figures come from these recordings (the quick sweep of 2026-11-30).
    parser.add_argument("--units", default="results/quick-2026-11-30/units",
                        help="folder of recorded runs")
    parser.add_argument("--inter-bw", default="10Gbit")
    parser.add_argument("--inter-lat", default="10us")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--compute-scale", type=float, default=0.05)
    parser.add_argument("--algorithm", choices=ALGORITHM_CHOICES, default="auto")
    parser.add_argument("--dense-run", type=Path, action="append", default=[],
                        help="a recorded flexdemo run with exchange=dense or dense-mean "
                             "(repeatable; adds its column beside the derived ones)")
    parser.add_argument("--nodes", type=node_counts, default=NODES,
                        help="comma-separated node counts to replay")
    args = parser.parse_args()
    traces = recorded_and_derived(args)
    picks = auto_picks(traces, args)
    print(
        f"median step time (ms), {args.inter_bw}, {args.inter_lat}, x{args.gpus_per_node} per "
        f"node, compute x{args.compute_scale}, algorithm {args.algorithm}"
    )
    columns = [*traces, "flexdemo auto"]
    print(f"{'nodes':>6}" + "".join(f"{name:>21}" for name in columns))
    times: dict[str, dict[int, float]] = {name: {} for name in columns}
    for n in args.nodes:
        for name, trace in traces.items():
            times[name][n] = step_time(trace, n, args)
        times["flexdemo auto"][n] = times[picks[n]][n]
        print(f"{n:>6}" + "".join(f"{times[name][n] * 1e3:>21.1f}" for name in columns))
    crossings(traces, times, args.nodes, args)


if __name__ == "__main__":
    main()
