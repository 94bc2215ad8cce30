"""The replay flags every replaying command shares, and the one `ReplayTarget` they describe.

    flexbench simulate RUN --inter-bw 1Gbit --inter-lat 20ms --nodes 16 --gpus-per-node 8 \\
        --compute-scale 0.05 --out sim.csv

`add_replay_arguments` declares them (simulate, compare); `target_from_flags` turns a parsed
command line into a checked `ReplayTarget`, reading each flag once: the only place a replay's
settings are read from an argparse namespace.
"""

from __future__ import annotations

import argparse

from experiments.errors import ConfigError
from experiments.replay.compute_profile import load_profile
from experiments.replay.engine import GPU_INTRA
from experiments.replay.loss_curve import LOSS_SCALING_CHOICES, parse_loss_scaling
from experiments.replay.target import INTRA_MODES, ComputeBasis, ReplayTarget
from experiments.values import POSITIVE, POSITIVE_INT
from netsim.calibration import load_calibration
from netsim.costs import ALGORITHM_CHOICES
from netsim.model.programs import OVERLAPS

__all__ = ["add_replay_arguments", "replay_inputs", "target_from_flags"]

_GIVEN = object()  # target_from_flags: take the value from the flags


def add_replay_arguments(parser: argparse.ArgumentParser, *, grid: bool = False) -> None:
    """The target network, cluster, compute and loss-rule flags of a replay (simulate, compare).

    `grid`: --inter-bw and --nodes take one value or several (compare's map over their cells).
    """
    several = {"nargs": "+"} if grid else {}
    parser.add_argument("--inter-bw", **several,
                        help="inter-node bandwidth, e.g. 1Gbit (or --topology)"
                        + ("; several: a map over them" if grid else ""))
    parser.add_argument("--inter-lat", default=None, help="inter-node latency, e.g. 20ms "
                        "(default 0ms)")
    parser.add_argument("--topology", default=None, metavar="FILE",
                        help="a TOML file of sites (uplink, downlink, links inside, RTT matrix; "
                        "experiments/topologies/sites.toml) instead of --inter-bw/--inter-lat/"
                        "--node-link; the node count is the file's")
    parser.add_argument("--nodes", type=POSITIVE_INT.arg, **several,
                        help="nodes to simulate (default: the run's)"
                        + ("; several: a map over them" if grid else ""))
    parser.add_argument("--gpus-per-node", type=POSITIVE_INT.arg,
                        help="ranks per node (default: the run's)")
    speed = parser.add_mutually_exclusive_group()
    speed.add_argument("--compute-scale", type=POSITIVE.arg, default=None,
                       help="multiply recorded compute time (0.05: accelerators 20x faster)")
    speed.add_argument("--step-compute", type=POSITIVE.arg, default=None, metavar="SECONDS",
                       help="compute time per step on the target accelerators")
    speed.add_argument("--compute-profile", default=None, metavar="FILE",
                       help="per-phase compute measured by `flexbench profile-compute` on the "
                       "target's device (same workload, method and batch): forward+backward and "
                       "optimizer each scaled to it; a GPU profile declares GPU-class hardware "
                       "(intra-node links modeled, overlap fsdp2 by default)")
    parser.add_argument("--intra", choices=INTRA_MODES, default=None,
                        help="intra-node collectives: recorded durations, or priced on the "
                        "intra link (default: model when --compute-scale or --step-compute "
                        "declares other hardware, else recorded)")
    parser.add_argument("--intra-bw", default=None,
                        help="modeled intra-node link bandwidth (default: the run's intra_bw, "
                        f"{GPU_INTRA[0]} unless set: NVLink-class)")
    parser.add_argument("--intra-lat", default=None,
                        help=f"modeled intra-node link latency (default: the run's intra_lat, "
                        f"{GPU_INTRA[1]} unless set)")
    parser.add_argument("--overlap", choices=OVERLAPS, default=None,
                        help="FSDP2's per-unit gradient reduce: recorded (the trace's order, "
                        "serial on CPU gloo) or fsdp2 (alongside the next unit's backward, as "
                        "on a GPU's communication streams; needs a recording with FSDP2 "
                        "backward marks); default: fsdp2 when --compute-scale or --step-compute "
                        "declares GPU-class compute and the recording has marks, else recorded")
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
    parser.add_argument("--loss-scaling", default=None, metavar=LOSS_SCALING_CHOICES,
                        help="rule for the loss per step at another global batch: none (as "
                        "recorded, the default) or linear-to-critical-batch:B (k-times the batch, "
                        "k-times fewer steps, up to batch B; McCandlish et al. 2018); an "
                        "assumption, printed and stored with the replay")


def replay_inputs(args: argparse.Namespace, runs: list[str]) -> list[str]:
    """Every file and folder a replay reads: the `runs`, --loss-from, and the files its flags
    name (an output may be none of them, nor inside one)."""
    return [*runs, *(getattr(args, "loss_from", None) or ()), *(path for path in (
        args.topology, args.compute_profile, args.calibration) if path is not None)]


def target_from_flags(args: argparse.Namespace, *, nodes: object = _GIVEN,
                      inter_bw: object = _GIVEN, same_compute: str | None = None,
                      ) -> ReplayTarget:
    """The checked ReplayTarget of `add_replay_arguments`' flags (ConfigError, one sentence).

    `nodes` and `inter_bw` replace the flags' (one cell of compare's map); `same_compute` is
    compare's --same-compute, one basis for every run (method or all; None: each run's own).
    The latency defaults to 0ms on a flat network; the files named are read here.
    """
    inter_bw = args.inter_bw if inter_bw is _GIVEN else inter_bw
    nodes = args.nodes if nodes is _GIVEN else nodes
    if (inter_bw is None) == (args.topology is None):
        raise ConfigError("give the target's network as --inter-bw (with --inter-lat, "
                          "--node-link) or as --topology FILE of sites, one of the two.")
    if args.intra == "recorded" and (args.intra_bw is not None or args.intra_lat is not None):
        flag = "--intra-bw" if args.intra_bw is not None else "--intra-lat"
        raise ConfigError(f"{flag} prices modeled intra-node links; it has no effect with "
                          "--intra recorded (drop one of them).")
    if args.topology is not None and args.calibration is not None:
        raise ConfigError("--calibration fits flat inter-node links; replaying --topology's "
                          "sites with it is not built (drop one of them).")
    def compute(**files: object) -> ComputeBasis:
        return ComputeBasis(scale=args.compute_scale, step_s=args.step_compute,
                            same=same_compute, **files)

    target = ReplayTarget(
        inter_bw=inter_bw, topology=args.topology, nodes=nodes,
        inter_lat=args.inter_lat if args.inter_lat is not None or args.topology is not None
        else "0ms",
        node_links=None if args.node_link is None else tuple(args.node_link),
        gpus_per_node=args.gpus_per_node, compute=compute(), intra=args.intra,
        intra_bw=args.intra_bw, intra_lat=args.intra_lat, overlap=args.overlap,
        algorithm=args.algorithm, loss_rule=parse_loss_scaling(args.loss_scaling),
        calibration_file=args.calibration,
    )  # fmt: skip
    # The files last: a bad flag is refused before any file is read.
    profile = load_profile(args.compute_profile) if args.compute_profile else None
    calibration = load_calibration(args.calibration) if args.calibration else None
    return target.at(compute=compute(profile=profile, profile_file=args.compute_profile),
                     calibration=calibration)
