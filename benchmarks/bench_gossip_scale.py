"""Gossip at 16-1,024 nodes and on sites: which graph reaches the target first as N grows.

    python benchmarks/bench_gossip_scale.py [--units results/decentralized-scale/units]

Reads the 16-node recordings (gossip on ring, exponential, one-peer-exponential and sites:4, and
hsdp-adamw as the centralized reference; lm-tiny, 100 steps) and replays each with netsim's model
at 16, 64, 256 and 1,024 nodes of one rank on three networks:

- flat: every node on 100 Mbit/s or on 1 Gbit/s, 10 ms (the decentralized study's two points);
- sites: 4 sites of N/4 nodes with the uplinks (10, 10, 5, 2 Gbit/s), inside links (100 Gbit/s,
  5 us) and RTTs (80-300 ms) of experiments/topologies/sites-1024.toml (that very file at 1,024).

Compute: the model replays each step with its slowest rank's recorded compute (the nodes meet at
every round). Every unit's is rescaled to one median per step (the median over the 16-node
recordings, each measured by a replay on a link too fast to matter), so that within a node count
the graphs differ by the network alone: the recordings ran 16 ranks on a loaded 2-core machine,
so their compute is inflated and varies with the load of the moment. The figure is printed.

Time to target: at 16 nodes, where the recordings are, the target is hsdp-adamw's val loss at
60% of its steps (median over its seeds), as in the decentralized study, and the time is the
recorded loss curve on the modeled time axis. At other node counts the loss of gossip is not
recorded and the replay refuses a time to target (experiments.replay.loss_curve, whose refusal
this script asks for): the cell says "no loss recording at N". Step times at 64-1,024 nodes are
the 16-node traces replayed on the graph rebuilt at N: a model extrapolation.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
from pathlib import Path

import torch

from experiments.replay import engine
from experiments.replay.engine import loss_on_time_axis
from experiments.replay.loss_curve import LossScaling, Recording, choose_loss_curve
from experiments.replay.recordings import RecordedRun, read_run
from experiments.replay.target import ComputeBasis, ReplayTarget
from experiments.report.graphs import permutation_p, spearman
from experiments.scoring.targets import baseline_target_at, time_to_target
from flexdemo.graphs import busiest_degree, mean_degree, mixing_matrix, peers, period
from netsim.model import Replay
from netsim.sites import gossip_round, load_sites

ROOT = Path(__file__).resolve().parents[1]
UNITS = ROOT / "results" / "decentralized-scale" / "units"
SITE_FILE = ROOT / "experiments" / "topologies" / "sites-1024.toml"
GRAPHS = ("ring", "exponential", "one-peer-exponential", "sites:4")
BASELINE = "hsdp-adamw"
RECORDED_NODES = 16
NODE_COUNTS = (16, 64, 256, 1024)
NETWORKS = {"100 Mbit/s": {"inter_bw": "100Mbit", "inter_lat": "10ms"},
            "1 Gbit/s": {"inter_bw": "1Gbit", "inter_lat": "10ms"}}
SITES = "4 sites"
TARGET_FRACTION = 0.6


def unit_runs(units: Path, arm: str) -> list[RecordedRun]:
    """The recordings of one arm (a gossip graph, or the baseline) at 16 nodes, by seed."""
    name = (f"{BASELINE}-nodes={RECORDED_NODES}" if arm == BASELINE
            else f"gossip-nodes={RECORDED_NODES}_graph={arm.replace(':', '_')}")
    return [read_run(path) for path in sorted(units.glob(f"{name}-s*"))]


def site_file(nodes: int, folder: Path) -> Path:
    """sites-1024.toml with its 4 sites of 256 resized to 4 sites of nodes / 4."""
    path = folder / f"sites-{nodes}.toml"
    path.write_text(SITE_FILE.read_text().replace("nodes = 256", f"nodes = {nodes // 4}"))
    return path


def cross_site_messages(graph: str, nodes: int, path: Path) -> float:
    """Messages leaving their site per round of `graph` on the sites of `path` (mean over a
    period of a time-varying graph)."""
    sites = load_sites(path)
    rounds = range(period(graph, nodes))
    return statistics.mean(sum(gossip_round(sites, lambda k, r=r: peers(graph, nodes, k, r)).remote)
                           for r in rounds)


def spectral_gap(graph: str, nodes: int) -> float:
    """1 - |lambda_2| of a round's mixing matrix: how much of the disagreement between replicas
    one round removes, asymptotically (per round, from a period's product when time-varying)."""
    product = torch.eye(nodes, dtype=torch.float64)
    rounds = period(graph, nodes)
    for r in range(rounds):
        product = mixing_matrix(graph, nodes, r) @ product
    # The product of symmetric rounds is not symmetric: its singular values bound the rate.
    values = torch.linalg.svdvals(product - torch.full_like(product, 1 / nodes))
    return 1 - float(values[0]) ** (1 / rounds)


def replayed_compute_s(run: RecordedRun) -> float:
    """The median step of `run` replayed at its own shape on a link too fast to matter: the
    compute per step as the model takes it (each step its slowest rank's)."""
    fast = engine.replay(run, ReplayTarget(inter_bw="100Tbit", inter_lat="0ms"))
    return float(fast.frame["step_time_s"].median())


def replay(run: RecordedRun, nodes: int, network: dict, scale: float) -> Replay:
    """`run` replayed at `nodes` on `network`, its compute scaled by `scale`."""
    # Compute rescaled on the recording CPU: intra-node and FSDP2 order as recorded.
    return engine.replay(run, ReplayTarget(nodes=nodes, compute=ComputeBasis(scale=scale),
                                           intra="recorded", overlap="recorded", **network))


def refusal(run: RecordedRun, nodes: int) -> str | None:
    """The replay's own refusal of a time to target at `nodes` (None: a curve is recorded)."""
    curve = choose_loss_curve([Recording.of(run.path, run.config, run.meta, run.steps)],
                              nodes=nodes, gpus_per_node=1, rule=LossScaling())
    return curve.refusal


def arm_cells(runs: list[RecordedRun], nodes: int, networks: dict, scales: dict[Path, float],
              target: float) -> tuple[list[str], list[str]]:
    """One row's cells per network: the mean step time, and the time to target or why none."""
    steps_cells, target_cells = [], []
    for network in networks.values():
        steps, times = [], []
        for run in runs:
            sim = replay(run, nodes, network, scales[run.path])
            steps.append(float(sim.frame["step_time_s"].mean()))  # a period's costly rounds count
            if nodes == RECORDED_NODES:
                points = loss_on_time_axis(run.steps, sim.frame)
                times.append(time_to_target(points["time_s"], points["val_loss"], target))
        steps_cells.append(f"{statistics.median(steps) * 1e3:,.1f} ms")
        target_cells.append(_bracket(times) if times else _refused(runs[0], nodes))
    return steps_cells, target_cells


def _refused(run: RecordedRun, nodes: int) -> str:
    if run.config.method == BASELINE:
        return "-"  # a rule (--loss-scaling) would give one; not the question here
    assert refusal(run, nodes) is not None, "the replay must refuse a gossip time to target"
    return f"no loss recording at {nodes}"


def _bracket(times: list[float]) -> str:
    """Median [min-max] over seeds, in seconds; a miss counts as infinity."""
    def fmt(t: float) -> str:
        return "not reached" if math.isinf(t) else f"{t:.1f} s"

    mid = statistics.median(times)
    if len(times) == 1:
        return fmt(mid)
    return f"{fmt(mid)} [{fmt(min(times))}-{fmt(max(times))}]"


def study_at_16(arms: dict[str, list[RecordedRun]]) -> None:
    """The decentralized study's columns at 16 nodes, and its two rank correlations."""
    print(f"\n{RECORDED_NODES} nodes, recorded: | graph | mean degree | consensus distance | "
          "final val loss |")
    losses, degrees, distances = [], [], []
    for graph in GRAPHS:
        runs = arms[graph]
        finals = [float(r.meta["final_val_loss"]) for r in runs]
        spread = [float(r.steps["consensus_distance"].dropna().mean()) for r in runs]
        degree = mean_degree(graph, RECORDED_NODES)
        print(f"| {graph} | {degree:g} | {statistics.median(spread):.1e} | "
              f"{statistics.median(finals):.4f} ({len(runs)} seeds) |")
        losses += finals
        degrees += [degree] * len(runs)
        distances += spread
    for name, x in (("degree", degrees), ("consensus distance", distances)):
        print(f"Spearman rho(final loss, {name}) over {len(losses)} runs: "
              f"{spearman(losses, x):+.2f} (permutation p {permutation_p(losses, x):.3f})")


def main() -> None:
    """Print the table of results/decentralized-scale/summary.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=Path, default=UNITS)
    args = parser.parse_args()
    arms = {arm: unit_runs(args.units, arm) for arm in (*GRAPHS, BASELINE)}
    missing = [arm for arm, runs in arms.items() if not runs]
    if missing:
        raise SystemExit(f"no {RECORDED_NODES}-node recording of {', '.join(missing)} in "
                         f"{args.units}; record them first "
                         "(results/decentralized-scale/README.md).")
    target = baseline_target_at([r.steps for r in arms[BASELINE]], TARGET_FRACTION)
    own = {r.path: replayed_compute_s(r) for runs in arms.values() for r in runs}
    compute_s = statistics.median(own.values())
    scales = {path: compute_s / seconds for path, seconds in own.items()}
    print(f"target: val_loss <= {target:.4f} ({BASELINE}'s at {TARGET_FRACTION:.0%} of its "
          f"steps, median of {len(arms[BASELINE])} seeds); compute: every unit's replayed "
          f"compute (its slowest rank's per step, {min(own.values()) * 1e3:.0f}-"
          f"{max(own.values()) * 1e3:.0f} ms as recorded) rescaled to {compute_s * 1e3:.0f} ms "
          "per step (median), the same for every graph")
    study_at_16(arms)
    names = [*NETWORKS, SITES]
    print(f"\n| nodes | graph | busiest degree | spectral gap | messages across sites a round | "
          f"{' | '.join(f'step, {n}' for n in names)} | to target: {' · '.join(names)} |")
    print("|" + " --- |" * (6 + len(names)))
    with tempfile.TemporaryDirectory() as tmp:
        for nodes in NODE_COUNTS:
            sites = site_file(nodes, Path(tmp))
            networks = {**NETWORKS, SITES: {"topology": str(sites)}}
            for arm in (*GRAPHS, BASELINE):
                steps, targets = arm_cells(arms[arm], nodes, networks, scales, target)
                degree, gap = (("(all-reduce)", "1 (exact mean)") if arm == BASELINE
                               else (str(busiest_degree(arm, nodes)),
                                     f"{spectral_gap(arm, nodes):.3g}"))
                crossing = ("-" if arm == BASELINE
                            else f"{cross_site_messages(arm, nodes, sites):,.4g}")
                reach = (" · ".join(targets) if len(set(targets)) > 1 else targets[0])
                print(f"| {nodes} | {arm} | {degree} | {gap} | {crossing} | {' | '.join(steps)} | "
                      f"{reach} |", flush=True)


if __name__ == "__main__":
    main()
