"""DBench's two findings at 16-256 nodes, on the emulated units of run.sh.

Run from the repository root: python results/decentralized-emulated/analyze.py
It reads units/ only (whatever shapes are there) and prints, per workload and node count:

- a row per graph (and Ada): mean degree (peers a node and round, `flexdemo.graphs.mean_degree`;
  Ada's changes, so it has none), replica variance and consensus distance (each unit's mean over
  its evaluations, then the median over seeds), the early val loss (at the first evaluation at
  or after 20% of the steps: vision-tiny's val loss is flat from about step 80 on, where the
  model starts to overfit, so its final one separates nothing) and the final val loss (each the
  median over seeds, with the 95% percentile-bootstrap interval of that median,
  `experiments.scoring.intervals`);
- DBench's findings over the fixed-graph units of the graphs run on every seed of the shape (a
  graph on fewer seeds would move those seeds' centring), for the early and the final val loss:
  Spearman rho of the loss with degree (finding 1 holds where rho < 0: more peers, lower loss) and
  with replica variance (finding 2: rho > 0), each with a 95% bootstrap interval over the units
  and a permutation p-value (`experiments.report.graphs`), on the losses as they are and
  seed-centred (less the median of the seed's fixed-graph units, the seed's own offset). A finding
  is said to hold only where its interval excludes 0;
- time to target on three networks (flat 100 Mbit/s and 1 Gbit/s, 10 ms; 4 sites of N/4 nodes
  with the links of experiments/topologies/sites-1024.toml): each graph's real 16-node trace
  of the workload (traces/WORKLOAD/, record_traces.sh) replayed by netsim's model at N nodes on
  the graph rebuilt at N, every trace's compute rescaled to one figure a step (the median of the
  workload's traces', each replayed on a link too fast to matter), and each unit's emulated
  loss curve put on that time axis. The
  target is the complete graph's early val loss (median over its seeds).
"""

from __future__ import annotations

import math
import statistics
import tempfile
from pathlib import Path

import numpy as np

from experiments.replay.engine import loss_on_time_axis, replay
from experiments.replay.recordings import RecordedRun, read_loss_run, read_run
from experiments.replay.target import ComputeBasis, ReplayTarget
from experiments.report.graphs import permutation_p, spearman
from experiments.scoring.formats import format_seconds
from experiments.scoring.intervals import CONFIDENCE, RESAMPLES, median_interval
from experiments.scoring.targets import baseline_target_at, time_to_target
from flexdemo.graphs import mean_degree

HERE = Path(__file__).resolve().parent
LABELS = ("ring", "torus", "exponential", "one-peer-exponential", "sites:4", "complete", "ada")
REFERENCE = "complete"
EARLY = 0.2
"""The early val loss is the one at the first evaluation at or after this share of the steps."""
SITE_FILE = HERE.parents[1] / "experiments" / "topologies" / "sites-1024.toml"
FLAT = {"100 Mbit/s": {"inter_bw": "100Mbit", "inter_lat": "10ms"},
        "1 Gbit/s": {"inter_bw": "1Gbit", "inter_lat": "10ms"}}
SITES = "4 sites"


def label(run: RecordedRun) -> str:
    """The unit's graph, or "ada" for Ada (whose graph changes)."""
    return "ada" if run.config.method == "ada" else str(run.config.graph)


def spread(run: RecordedRun, column: str) -> float:
    """The unit's mean of replica_variance or consensus_distance over its evaluations."""
    return float(run.steps[column].dropna().mean())


def rho_interval(x: list[float], y: list[float], seed: int = 0) -> tuple[float, float]:
    """A 95% percentile-bootstrap interval of Spearman rho, resampling the units (fixed seed)."""
    rng = np.random.default_rng(seed)
    xs, ys = np.asarray(x), np.asarray(y)
    draws = []
    for _ in range(RESAMPLES):
        pick = rng.integers(0, len(xs), len(xs))
        draws.append(spearman(xs[pick], ys[pick]))
    draws = np.asarray([d for d in draws if not math.isnan(d)])  # a draw of one repeated value
    tail = (1 - CONFIDENCE) / 2
    low, high = np.quantile(draws, [tail, 1 - tail])
    return float(low), float(high)


def early_val_loss(run: RecordedRun) -> float:
    """The unit's val loss at the first evaluation at or after EARLY of its steps."""
    return baseline_target_at([run.steps], EARLY)


def centred(losses: list[float], seeds: list[int]) -> list[float]:
    """Each loss less the median loss of its seed's fixed-graph units.

    A seed's data order and initialisation move every graph's loss alike; taking them out leaves
    the graphs' differences within a seed, which the seeds' spread would otherwise hide.
    """
    by_seed: dict[int, list[float]] = {}
    for loss, seed in zip(losses, seeds, strict=True):
        by_seed.setdefault(seed, []).append(loss)
    return [loss - statistics.median(by_seed[seed])
            for loss, seed in zip(losses, seeds, strict=True)]


def finding(loss: str, name: str, losses: list[float], x: list[float], holds_if: int,
            seeds: int) -> str:
    """One line: rho of a loss with x, its interval and p, and whether the finding holds.

    With one seed nothing is decided: resampling one seed's few units cannot tell the graphs'
    effect from that seed's, and a perfect order makes every resample's rho the same."""
    rho = spearman(losses, x)
    low, high = rho_interval(losses, x)
    if seeds < 2:
        verdict = "not decided (one seed)"
    elif low > 0 or high < 0:
        verdict = "holds" if (rho > 0) == (holds_if > 0) else "reversed"
    else:
        verdict = "not shown (the interval includes 0)"
    return (f"rho({loss} val loss, {name}) over {len(losses)} units: {rho:+.2f} "
            f"[{low:+.2f}, {high:+.2f}], permutation p {permutation_p(losses, x):.4f}: {verdict}")


def networks(nodes: int, folder: Path) -> dict[str, dict]:
    """The three networks at `nodes`: the flat two, and sites-1024.toml as 4 sites of nodes/4."""
    sites = folder / f"sites-{nodes}.toml"
    sites.write_text(SITE_FILE.read_text().replace("nodes = 256", f"nodes = {nodes // 4}"))
    return {**FLAT, SITES: {"topology": str(sites)}}


def compute_scales(traces: dict[str, RecordedRun]) -> tuple[float, dict[str, float]]:
    """The median compute a step over the traces, and each trace's factor to reach it."""
    own = {}
    for name, run in traces.items():
        fast = replay(run, ReplayTarget(inter_bw="100Tbit", inter_lat="0ms"))
        own[name] = float(fast.frame["step_time_s"].median())
    median = statistics.median(own.values())
    return median, {name: median / seconds for name, seconds in own.items()}


def time_table(workload: str, nodes: int, runs: list[RecordedRun]) -> list[str]:
    """Time to target per graph and network at `nodes`, from the traces and the units' curves."""
    folder = HERE / "traces" / workload
    if not all((folder / name.replace(":", "_") / "run.json").exists() for name in LABELS):
        return [f"No {workload} traces of every graph in traces/{workload}/: no time to target.",
                ""]
    traces = {name: read_run(folder / name.replace(":", "_")) for name in LABELS}
    compute_s, scales = compute_scales(traces)
    reference = [r.steps for r in runs if label(r) == REFERENCE]
    if not reference:
        return [f"No {REFERENCE} unit at {nodes} nodes: no target, no time to target.", ""]
    target = baseline_target_at(reference, EARLY)
    source = (f"median of {len(reference)} seeds" if len(reference) > 1
              else "of its one seed, "
              + ", ".join(str(r.config.seed) for r in runs if label(r) == REFERENCE))
    lines = [f"Time to val loss <= {target:.4f} ({REFERENCE}'s early val loss, {source}); "
             f"compute {compute_s * 1e3:.0f} ms a step for every graph (the traces' median); "
             "median over seeds [bootstrap interval]:", "",
             f"| graph | {' | '.join(FLAT)} | {SITES} |", "| --- |" + " --- |" * (len(FLAT) + 1)]
    steps = max(int(r.steps["step"].max()) for r in runs)
    with tempfile.TemporaryDirectory() as tmp:
        nets = networks(nodes, Path(tmp))
        for name in LABELS:
            arm = [r for r in runs if label(r) == name]
            if not arm:
                continue
            cells = []
            for network in nets.values():
                # Compute rescaled on the recording CPU: intra-node and FSDP2 order as recorded.
                target = ReplayTarget(nodes=nodes, compute=ComputeBasis(scale=scales[name]),
                                      intra="recorded", overlap="recorded", **network)
                sim = replay(traces[name], target, steps=steps)
                times = [time_to_target(*loss_on_time_axis(r.steps, sim.frame)[
                    ["time_s", "val_loss"]].T.to_numpy(), target) for r in arm]
                cell = median_interval(times)
                cells.append(format_seconds(cell.median) + cell.bracket(format_seconds))
            lines.append(f"| {name} | {' | '.join(cells)} |")
    return [*lines, ""]


def shape_table(workload: str, nodes: int, runs: list[RecordedRun]) -> list[str]:
    """The markdown lines of one workload and node count."""
    seeds = sorted({r.config.seed for r in runs})
    early_step = int(EARLY * max(int(r.steps["step"].max()) for r in runs))
    lines = [f"## {workload}, {nodes} nodes ({len(runs)} units, seeds "
             f"{', '.join(map(str, seeds))})", "",
             "| graph | mean degree | replica variance | consensus distance | "
             f"early val loss (step {early_step}) | final val loss |",
             "| --- | --- | --- | --- | --- | --- |"]
    losses: dict[str, list[float]] = {"early": [], "final": []}
    degrees, variances, unit_seeds = [], [], []
    untested: list[str] = []  # graphs not run on every seed: in the table, not in the tests
    for name in LABELS:
        arm = [r for r in runs if label(r) == name]
        if not arm:
            continue
        early = [early_val_loss(r) for r in arm]
        finals = [float(r.meta["final_val_loss"]) for r in arm]
        cells = []
        for values in (early, finals):
            cell = median_interval(values)
            cells.append(f"{cell.median:.4f}{cell.bracket(lambda v: f'{v:.4f}')}")
        degree = "changes" if name == "ada" else f"{mean_degree(name, nodes):g}"
        lines.append(
            f"| {name} | {degree} | "
            f"{statistics.median(spread(r, 'replica_variance') for r in arm):.2e} | "
            f"{statistics.median(spread(r, 'consensus_distance') for r in arm):.2e} | "
            f"{cells[0]} | {cells[1]} ({len(arm)} seed{'s' if len(arm) > 1 else ''}) |")
        if name != "ada" and {r.config.seed for r in arm} != set(seeds):
            untested.append(f"{name} (seed{'s' if len(arm) > 1 else ''} "
                            f"{', '.join(str(r.config.seed) for r in arm)})")
        elif name != "ada":
            losses["early"] += early
            losses["final"] += finals
            degrees += [mean_degree(name, nodes)] * len(arm)
            variances += [spread(r, "replica_variance") for r in arm]
            unit_seeds += [r.config.seed for r in arm]
    losses["early, seed-centred"] = centred(losses["early"], unit_seeds)
    losses["final, seed-centred"] = centred(losses["final"], unit_seeds)
    lines.append("")
    if untested:
        lines += [f"- Not in the tests below (not run on every seed): {', '.join(untested)}."]
    for loss, values in losses.items():
        lines += [f"- Finding 1 (more peers, lower loss), {loss}: "
                  + finding(loss, "degree", values, degrees, -1, len(seeds)),
                  f"- Finding 2 (more spread, higher loss), {loss}: "
                  + finding(loss, "replica variance", values, variances, +1, len(seeds))]
    return [*lines, ""] + time_table(workload, nodes, runs)


def main() -> None:
    """Print the summary: one table and the two findings per workload and node count."""
    runs = [read_loss_run(path) for path in sorted((HERE / "units").iterdir())
            if (path / "run.json").exists()]
    shapes = sorted({(r.config.workload, r.config.nodes) for r in runs})
    lines = ["# DBench's findings, emulated", "",
             "Brackets of val losses: 95% percentile-bootstrap interval of the median over "
             f"seeds ({RESAMPLES} resamples, fixed seed); of rho: 95% percentile bootstrap over "
             "the fixed-graph units.", ""]
    for workload, nodes in shapes:
        lines += shape_table(workload, nodes, [r for r in runs if (r.config.workload,
                                                                   r.config.nodes)
                                               == (workload, nodes)])
    print("\n".join(lines).rstrip())


if __name__ == "__main__":
    main()
