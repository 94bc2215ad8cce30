"""`flexbench simulate`: replay a run's communication trace on another network with netsim's model.

    flexbench simulate runs/flex --inter-bw 1Gbit --inter-lat 20ms --out sim.csv
    flexbench simulate runs/flex --inter-bw 10Gbit --nodes 64 --gpus-per-node 8 --steps 100 \\
        --compute-scale 0.05 --out h100.csv
    flexbench simulate runs/flex --inter-bw 1Gbit --node-link 1=100Mbit,20ms --out slow-site.csv

For synchronous schemes the loss at step t does not depend on the network, so the run's loss
curve placed on the simulated time axis predicts the time to reach a target loss.

Gossip runs (method gossip, or ada, whose graph steps.parquet records per step) are replayed on
their communication graph rebuilt at the target node count: each node exchanges with its
neighbours there, so a step costs what the graph's degree costs, whatever the node count.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import pandas as pd

from experiments.errors import ConfigError
from experiments.io import check_output_file, write_atomic
from experiments.report.metrics import time_to_target
from flexdemo.graphs import degree_of, graph_problem, period
from flexdemo.methods import RECORDS
from netsim import Link, Topology, parse_bandwidth, parse_latency
from netsim.calibration import Calibration, load_calibration
from netsim.costs import ALGORITHM_CHOICES
from netsim.model import algorithm_summary, simulate
from netsim.topology import parse_node_links

log = logging.getLogger(__name__)

__all__ = ["simulate_run", "read_run", "gossip_degrees", "loss_on_time_axis", "configure", "main"]

# Methods whose traffic is messages to graph neighbours.
GOSSIP_METHODS = tuple(m.name for m in RECORDS if m.gossips)


def read_run(run_dir: Path | str) -> tuple[dict, pd.DataFrame]:
    """run.json and steps.parquet of a finished run (ConfigError if missing or unreadable)."""
    run_dir = Path(run_dir)
    try:
        meta = json.loads((run_dir / "run.json").read_text())
        steps = pd.read_parquet(run_dir / "steps.parquet")
    except FileNotFoundError as err:
        raise ConfigError(f"{str(run_dir)!r} is not a finished run: {Path(err.filename).name} "
                          "is missing.") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read the run in {str(run_dir)!r}: {err}") from None
    return meta, steps


@lru_cache(maxsize=4096)
def _busiest_degree(graph: str, nodes: int, round_: int) -> int:
    """Peers of the busiest node of `graph` on `nodes` nodes at gossip round `round_`."""
    round_ %= period(graph, nodes)
    if graph == "one-peer-exponential":
        # Off a power of two some nodes sit a round out; the busiest one paces its neighbours.
        return max(degree_of(graph, nodes, node, round_) for node in range(nodes))
    # The other graphs are vertex-transitive: every node has node 0's degree.
    return degree_of(graph, nodes, 0, round_)


def gossip_degrees(
    meta: dict, steps: pd.DataFrame, nodes: int
) -> tuple[Callable[[int, int], int] | None, list[str]]:
    """The gossip graph of a run rebuilt on `nodes` nodes: peers per (step, round), and a summary.

    The graph is the run's `graph` setting, or per step steps.parquet's `graph` column where a
    run recorded one (method ada; empty entries fall back to the setting). (None, []) for runs
    of other methods. ConfigError (one sentence) if a graph cannot be built on `nodes` nodes.
    """
    cfg = meta["config"]
    method = cfg.get("method")
    if method not in GOSSIP_METHODS:
        return None, []
    default = cfg.get("graph") or "ring"
    by_step: dict[int, str] = {}
    if "graph" in steps.columns:
        by_step = {int(step): str(graph) for step, graph in zip(steps["step"], steps["graph"],
                                                                 strict=True)
                   if isinstance(graph, str) and graph}
    used = sorted(set(by_step.values()) | ({default} if len(by_step) < len(steps) else set()))
    for graph in used:
        problem = graph_problem(graph, nodes)
        if problem is not None:
            raise ConfigError(f"cannot rebuild the {method} run's graph on --nodes {nodes}: "
                              f"{problem}")

    def degrees(step: int, round_: int) -> int:
        return _busiest_degree(by_step.get(step, default), nodes, round_)

    lines = []
    for graph in used:
        found = sorted({_busiest_degree(graph, nodes, r) for r in range(period(graph, nodes))})
        degree = "/".join(str(d) for d in found)
        extra = (f" (one new peer a round, {period(graph, nodes)}-round period)"
                 if graph == "one-peer-exponential" else "")
        lines.append(f"{method} graph {graph} rebuilt on {nodes} nodes: degree {degree}{extra}")
    return degrees, lines


def simulate_run(
    run_dir: Path | str,
    *,
    inter_bw_bps: float,
    inter_lat_s: float,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    steps: int | None = None,
    compute_scale: float = 1.0,
    intra: str = "recorded",
    algorithm: str = "auto",
    node_links: list[str] | None = None,
    calibration: Calibration | None = None,
) -> pd.DataFrame:
    """Per-step times of a recorded run replayed on another network: [step, step_time_s, time_s].

    `step` is 1-based like the run's steps.parquet; nodes, gpus_per_node and steps default to the
    run's own. Intra-node collectives keep their recorded durations (real runs never shape them)
    unless `intra="model"` prices them on the intra link. `algorithm` picks the inter-node
    collective algorithms (netsim.model.simulate). `node_links` ("NODE=BANDWIDTH[,LATENCY]")
    gives some nodes links of their own; None replays the run's own node_links. `calibration`
    (from `flexbench calibrate`) prices every inter-node link at its measured goodput and
    per-message cost. attrs["note"] states the assumptions and attrs["algorithms"] the algorithms
    assumed. Gossip runs replay their graph rebuilt on the target nodes (`gossip_degrees`;
    attrs["graphs"] describes it).
    """
    meta, recorded_steps = read_run(run_dir)
    cfg = meta["config"]
    net = {
        "intra_bw": parse_bandwidth(cfg["intra_bw"]),
        "intra_lat": parse_latency(cfg["intra_lat"]),
    }
    inter = Link(inter_bw_bps, inter_lat_s)
    n_nodes = nodes or cfg["nodes"]
    specs = (cfg.get("node_links") or []) if node_links is None else node_links
    try:
        per_node = parse_node_links(specs, n_nodes, inter)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    topology = Topology(
        nodes=n_nodes,
        accelerators_per_node=gpus_per_node or cfg["gpus_per_node"],
        intra=Link(net["intra_bw"], net["intra_lat"]),
        inter=inter,
        node_links=per_node,
    )
    if calibration is not None:
        topology = calibration.topology(topology)
    trace_path = Path(run_dir) / "trace.parquet"
    if not trace_path.exists():
        raise ConfigError(f"{str(run_dir)!r} has no trace.parquet to replay.")
    degrees, graphs = gossip_degrees(meta, recorded_steps, n_nodes)
    sim = simulate(
        trace_path, topology, steps=steps, compute_scale=compute_scale, intra=intra,
        algorithm=algorithm, degrees=degrees,
    )  # fmt: skip
    # assign() copies attrs, so the note and the algorithms travel with the result.
    sim = sim.assign(step=range(1, len(sim) + 1))
    sim.attrs["node_links"] = topology.describe_node_links()
    sim.attrs["graphs"] = graphs if sim.attrs.get("p2p_degrees") else []
    if calibration is not None:
        sim.attrs["note"] = f"{sim.attrs.get('note', '')} Links {calibration.describe()}."
    return sim


def loss_on_time_axis(steps: pd.DataFrame, sim: pd.DataFrame) -> pd.DataFrame:
    """The run's evaluations with the simulated time at which each step ends."""
    evals = steps.loc[steps["val_loss"].notna(), ["step", "val_loss"]]
    return evals.merge(sim[["step", "time_s"]], on="step", how="inner")


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of `flexbench simulate`."""
    parser.add_argument("run_dir", help="a folder written by `flexbench run`")
    parser.add_argument("--inter-bw", required=True, help="inter-node bandwidth, e.g. 1Gbit")
    parser.add_argument("--inter-lat", default="0ms", help="inter-node latency, e.g. 20ms")
    parser.add_argument("--nodes", type=int, help="nodes to simulate (default: the run's)")
    parser.add_argument("--gpus-per-node", type=int, help="ranks per node (default: the run's)")
    parser.add_argument("--steps", type=int, help="steps to simulate (default: the run's)")
    speed = parser.add_mutually_exclusive_group()
    speed.add_argument("--compute-scale", type=float, default=None,
                       help="multiply recorded compute time (0.05: accelerators 20x faster)")
    speed.add_argument("--step-compute", type=float, default=None, metavar="SECONDS",
                       help="compute time per step on the target accelerators")
    parser.add_argument("--intra", choices=("recorded", "model"), default="recorded",
                        help="intra-node collectives: recorded durations, or priced on the "
                        "intra link (for other accelerators)")
    parser.add_argument("--algorithm", choices=ALGORITHM_CHOICES, default="auto",
                        help="inter-node collective algorithms: auto picks ring or tree (Bruck "
                        "for all-gathers) by predicted time as NCCL's tuner does; ring or tree "
                        "forces one (default: auto)")
    parser.add_argument("--node-link", action="append", default=None, metavar="NODE=BW[,LAT]",
                        help="give node NODE a link of its own, e.g. 1=100Mbit,20ms (latency "
                        "defaults to --inter-lat); repeatable; replaces the run's own node links, "
                        "which are replayed when none is given")
    parser.add_argument("--calibration", metavar="FILE",
                        help="price links at the goodput and per-message cost measured by "
                        "`flexbench calibrate` (default: the configured rate, no extra cost)")
    parser.add_argument("--target", type=float,
                        help="target validation loss (default: the run's final one)")
    parser.add_argument("--out", required=True, help="CSV file for the per-step times")


def main(args: argparse.Namespace) -> int:
    """Run `flexbench simulate`."""
    out = check_output_file(args.out, what="--out")
    if args.target is not None and not (math.isfinite(args.target) and args.target > 0):
        raise ConfigError(f"--target must be a finite loss > 0, got {args.target}.")
    for name in ("nodes", "gpus_per_node", "steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}.")
    for name in ("compute_scale", "step_compute"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive number, got {value}.")
    calibration = load_calibration(args.calibration) if args.calibration else None
    meta, steps = read_run(args.run_dir)
    scale = args.compute_scale or 1.0
    if args.step_compute is not None:
        recorded = float(steps["compute_s"].median())
        scale = args.step_compute / recorded if recorded > 0 else 1.0
    sim = simulate_run(
        args.run_dir, inter_bw_bps=parse_bandwidth(args.inter_bw),
        inter_lat_s=parse_latency(args.inter_lat), nodes=args.nodes,
        gpus_per_node=args.gpus_per_node, steps=args.steps, compute_scale=scale,
        intra=args.intra, algorithm=args.algorithm, node_links=args.node_link,
        calibration=calibration,
    )
    write_atomic(out, sim.to_csv(index=False))
    cfg = meta["config"]
    links = sim.attrs.get("node_links") or []
    print(f"simulated {len(sim)} steps of {cfg['method']} on "
          f"{args.nodes or cfg['nodes']} nodes x {args.gpus_per_node or cfg['gpus_per_node']} "
          f"at {args.inter_bw}, {args.inter_lat}"
          f"{' (node links ' + ', '.join(links) + ')' if links else ''}: total "
          f"{sim['time_s'].iloc[-1]:.2f} s, median step {sim['step_time_s'].median() * 1e3:.1f} "
          f"ms -> {out}")
    for line in sim.attrs.get("graphs", []):
        print(f"  {line}")
    for line in algorithm_summary(sim.attrs.get("algorithms", [])):
        print(f"  {line}")
    if calibration is not None:
        print(f"  links {calibration.describe()}")
    if sim.attrs.get("note"):
        log.info("model: %s", sim.attrs["note"])
    if scale != 1.0:
        log.info("compute scaled by %.4g relative to the recording machine", scale)
    target = args.target if args.target is not None else meta.get("final_val_loss")
    if target is not None and not (isinstance(target, float) and math.isnan(target)):
        curve = loss_on_time_axis(steps, sim)
        ttt = time_to_target(curve["time_s"], curve["val_loss"], float(target))
        when = "not reached" if math.isinf(ttt) else f"{ttt:.2f} s"
        print(f"predicted time to val_loss <= {target:.4f}: {when}")
        if (args.nodes or cfg["nodes"], args.gpus_per_node or cfg["gpus_per_node"]) != (
            cfg["nodes"], cfg["gpus_per_node"]
        ):
            log.info("(assumes the recorded run's loss per step also holds on the larger "
                     "cluster)")
    return 0

