"""`flexbench simulate`: replay a run's communication trace on another network with netsim's model.

    flexbench simulate runs/flex --inter-bw 1Gbit --inter-lat 20ms --out sim.csv
    flexbench simulate runs/flex --inter-bw 10Gbit --nodes 64 --gpus-per-node 8 --steps 100 \\
        --compute-scale 0.05 --out h100.csv
    flexbench simulate runs/flex --inter-bw 1Gbit --node-link 1=100Mbit,20ms --out slow-site.csv
    flexbench simulate runs/flex --topology experiments/topologies/sites.toml --gpus-per-node 8 \\
        --compute-scale 0.05 --out sites.csv

`--topology F.toml` replays on sites (netsim.sites: nodes, a shared uplink and downlink per
site, links inside, RTTs between sites) instead of --inter-bw/--inter-lat/--node-link; the node
count is the file's, and collectives across sites run hierarchically (the assumption printed).

For synchronous schemes the loss at step t does not depend on the network, so the run's loss
curve placed on the simulated time axis predicts the time to reach a target loss.

At another node count or global batch the loss curve is stated, never assumed silently
(`experiments.replay.loss_curve`): `--loss-from RUN` (repeatable) adds recordings at other node
counts and the one with the nearest global batch gives the curve (the trace is always the first
run's); `--loss-scaling none|linear-to-critical-batch:B` maps it to the target's global batch;
the rule is printed beside the time to target and stored in OUT's sidecar `.loss.json`. Gossip
and Ada replays at a node count no recording has give no time to target.

    flexbench simulate runs/ada-4 --loss-from runs/ada-8 --nodes 8 --inter-bw 1Gbit --out a.csv
    flexbench simulate runs/flex --nodes 64 --loss-scaling linear-to-critical-batch:512 \
        --inter-bw 10Gbit --out f.csv

Another --gpus-per-node re-shards the run's payloads (experiments.replay.reshard); declared
compute (--compute-scale, --step-compute, or a GPU's --compute-profile from `flexbench
profile-compute`, which sets each step phase's compute to its measured seconds) prices the
intra-node collectives on an NVLink-class link unless told otherwise (--intra, --intra-bw,
--intra-lat); the output then says per part (compute, intra-node, inter-node) what was measured
and what modeled. `--overlap fsdp2` (the default with declared compute, when the recording marks
FSDP2's units) replays each unit's gradient reduce alongside the next unit's backward, as a
GPU's communication streams run it; `--overlap recorded` keeps the trace's order (serial on CPU
gloo).

Gossip runs (method gossip, or ada, whose graph steps.parquet records per step) are replayed on
their communication graph rebuilt at the target node count: each node exchanges with its
neighbours there, so a step costs what the graph's degree costs, whatever the node count. A site
graph (sites:S) is rebuilt on S sites of the target's nodes, the busiest node (a gateway) setting
each round's pace; with --topology its sites must be the file's (RunConfig.topology()).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path

from experiments.errors import ConfigError
from experiments.io import check_output_file, write_atomic
from experiments.replay.engine import replay
from experiments.replay.flags import add_replay_arguments, replay_inputs, target_from_flags
from experiments.replay.loss_curve import LossCurve, Recording, check_loss_from, choose_loss_curve
from experiments.replay.recordings import RecordedRun, read_loss_run, read_run
from experiments.replay.target import ReplayTarget
from experiments.scoring.targets import time_to_target
from experiments.values import POSITIVE, POSITIVE_INT
from netsim.model import Replay, algorithm_summary
from netsim.sites import hierarchy_line
from netsim.units import format_bandwidth

log = logging.getLogger(__name__)

MAX_STEPS = 1_000_000  # a replayed step costs ~0.1-1 ms of model time: this is minutes already

__all__ = ["configure", "main"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of `flexbench simulate`."""
    parser.add_argument("run_dir", help="a folder written by `flexbench run`")
    add_replay_arguments(parser)
    parser.add_argument("--steps", type=POSITIVE_INT.arg,
                        help="steps to simulate (default: the run's; at another shape, as "
                        "many as the loss curve used needs)")
    parser.add_argument("--target", type=POSITIVE.arg,
                        help="target validation loss (default: the final one of the run whose "
                        "loss curve is used)")
    parser.add_argument("--loss-from", action="append", default=None, metavar="RUN",
                        help="another recording of the same method and workload, e.g. at another "
                        "node count; repeatable; the loss curve comes from the run (RUN_DIR "
                        "included) whose global batch is nearest the target's, the trace from "
                        "RUN_DIR")
    parser.add_argument("--out", required=True, help="CSV file for the per-step times")


def main(args: argparse.Namespace) -> int:
    """Run `flexbench simulate`."""
    out = _check_arguments(args)
    target = target_from_flags(args)
    run = read_run(args.run_dir)
    curve = _loss_curve(args.loss_from or [], run, target)
    sidecar = out.with_suffix(".loss.json") if curve.stated else None  # checked with --out
    replayed = replay(run, target, progress=True,
                      steps=args.steps if args.steps is not None else curve.steps_needed())
    write_atomic(out, replayed.frame.to_csv(index=False))
    _print_replay(target, run, replayed, out)
    for line in replayed.basis:
        print(f"  {line}")
    _print_time_to_target(args.target, curve, replayed, sidecar)
    return 0


def _loss_curve(loss_from: list[str], run: RecordedRun, target: ReplayTarget) -> LossCurve:
    """The loss curve the replay uses among RUN_DIR and the --loss-from recordings."""
    runs = [run, *(read_loss_run(path) for path in loss_from)]
    return choose_loss_curve(
        [Recording.of(r.path, r.config, r.meta, r.steps) for r in runs],
        nodes=target.nodes or run.config.nodes,
        gpus_per_node=target.gpus_per_node or run.config.gpus_per_node, rule=target.loss_rule,
    )  # fmt: skip


def _check_arguments(args: argparse.Namespace) -> Path:
    """The --out file, after checking the numeric flags (ConfigError, one sentence)."""
    reads = replay_inputs(args, [args.run_dir])
    out = check_output_file(args.out, what="--out", reads=reads)
    # Written beside --out when the loss curve is carried to another shape: checked now too.
    check_output_file(out.with_suffix(".loss.json"), what="the loss sidecar", reads=reads)
    if args.target is not None and not (math.isfinite(args.target) and args.target > 0):
        raise ConfigError(f"--target must be a finite loss > 0, got {args.target}.")
    check_loss_from(args.loss_from or [], [args.run_dir])
    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {args.steps}.")
    if args.steps is not None and args.steps > MAX_STEPS:
        raise ConfigError(f"--steps {args.steps} is more than a replay runs here (at most "
                          f"{MAX_STEPS:,}: hours of model time); replay fewer steps, the time "
                          "axis grows linearly beyond the recording.")
    return out


_LISTED_LINKS = 8  # node links a replay's summary line lists one by one


def _print_replay(target: ReplayTarget, run: RecordedRun, replayed: Replay, out: Path) -> None:
    """What was simulated, on which network, and what the model assumed to get there."""
    frame, topology = replayed.frame, replayed.topology
    links = topology.describe_node_links()
    if len(links) > _LISTED_LINKS:  # 10^4 of them would make a line of 200 kB
        slowest = topology.inter_link()
        links = [*links[:3], f"... {len(links):,} in all, slowest "
                 f"{format_bandwidth(slowest.bandwidth)}, largest latency "
                 f"{slowest.latency * 1e3:g}ms"]
    print(f"simulated {len(frame)} steps of {run.config.method} on "
          f"{topology.nodes} nodes x {topology.accelerators_per_node} "
          f"{'on' if target.topology else 'at'} {target.network}"
          f"{' (node links ' + ', '.join(links) + ')' if links else ''}: total "
          f"{frame['time_s'].iloc[-1]:.2f} s, median step "
          f"{frame['step_time_s'].median() * 1e3:.1f} ms -> {out}")
    sites = ([*topology.sites.describe(), hierarchy_line(topology.sites)]
             if topology.sites is not None else [])
    for line in [*sites, *replayed.graphs, *algorithm_summary(replayed.algorithms)]:
        print(f"  {line}")
    if target.calibration is not None:
        print(f"  links {target.calibration.describe()}")
    if replayed.note:
        log.info("model: %s", replayed.note)


def _print_time_to_target(target: float | None, curve: LossCurve, replayed: Replay,
                          sidecar: Path | None) -> None:
    """The loss curve on the simulated time axis: when it reaches the target, and which curve.

    A replay at another shape (`curve.stated`) prints where its trace and curve came from, the
    rule beside the time, and stores both in `sidecar`.
    """
    if target is None:
        target = curve.recording.final_val_loss
    if target is not None and isinstance(target, float) and math.isnan(target):
        target = None
    if curve.stated:
        print(f"  {curve.summary()}")
    ttt = None
    if target is None:
        print(f"no time to target: {str(curve.recording.path / 'run.json')!r} records no final "
              "val_loss to take as the target; give --target")
    elif curve.refusal is not None:
        print(f"no time to val_loss <= {target:.4f}: {curve.refusal}")
    else:
        points = curve.on_time_axis(replayed.frame)
        ttt = time_to_target(points["time_s"], points["val_loss"], float(target))
        when = "not reached" if math.isinf(ttt) else f"{ttt:.2f} s"
        label = f" ({curve.label()})" if curve.stated else ""
        print(f"predicted time to val_loss <= {target:.4f}: {when}{label}")
    if sidecar is not None:
        stored = {**curve.record(), "target_val_loss": target,
                  "time_to_target_s": None if ttt is None or math.isinf(ttt) else ttt,
                  "reached": ttt is not None and math.isfinite(ttt)}
        write_atomic(sidecar, json.dumps(stored, indent=2) + "\n")
        print(f"  loss curve and rule stored in {sidecar}")
