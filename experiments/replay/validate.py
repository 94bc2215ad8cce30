"""`flexbench validate-sim`: does the SimPy model predict what shaped real runs measure?

For each method, `--recordings` runs record traces (unshaped; for `--shaping kernel` through the
same namespaces on a 10 Gbit/s link, so that recording and measured runs start their ranks the
same way); then, at every grid point, a real run with `wall` (netsim's waits) or `kernel` (Linux
tc) shaping is measured and every recorded trace is replayed through the model on the same
network. The table compares median step times; the prediction is the median over the
recordings, with their range beside it, so one unlucky recording cannot swing a point.

Same shape (the default): recordings and measured runs are `--shape` NODESxRANKS, by default
2 nodes of as many ranks as leave one core per rank (2x1 on 2 cores). Every run pins rank r to
core r mod cores: with one rank per core a rank's compute does not depend on what the others
wait for, so the recording measures what the shaped run computes. `--extrapolate FROM:TO ...`
records on FROM and predicts and measures TO (default 2x2:4x1 2x1:2x2 2x2:3x1), the replay
re-sharding payloads for TO's ranks per node and scaling the optimizer step to TO's shard
(`experiments.replay.compute_rules`); a recording of one rank per node gets FSDP2's intra-node
traffic added, timed on this machine's loopback link measured at the target's shape (every
node's group at once, pinned as the run: `calibrate.machine_loopback`); where
either shape has more ranks than cores, compute is scaled by the host-contention rule
(`host_contention`). Each rule is printed with the table.

Every point is also replayed from the shaped run's own trace on its own network: its compute as
measured, the links as modeled (`network_error_pct`, the network model alone). On this VM the
compute of the same run drifted by up to 25% within minutes, more than any network effect at
fast links, so the same-shape check is judged on that by default (`--compute-from run`) and
`--extrapolate` on the recordings' prediction (`--compute-from recordings`); both are shown.

Links are priced by this machine's calibration for the shaping mode (`--calibration FILE`, or
found or made by `experiments.replay.calibrate.machine_calibration`; `--calibration none`: the
configured rates). Exit 1 when a point is outside the bound.

    flexbench validate-sim            # flexdemo and hsdp-adamw, 3 bandwidths x 2 latencies
    flexbench validate-sim --method flexdemo --inter-bw 100Mbit --inter-lat 1ms --steps 6
    flexbench validate-sim --extrapolate --methods flexdemo hsdp-adamw diloco --inter-lat 1ms
    flexbench validate-sim --shaping kernel --calibration results/calibration/kernel.json
"""

from __future__ import annotations

import argparse
import math
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm import tqdm

from experiments.aliases import add_old_spelling
from experiments.config import RunConfig, parse_sets, shared_for
from experiments.errors import ConfigError, RunFailed
from experiments.io import check_output_file, check_output_folder, write_atomic
from experiments.replay.engine import replay
from experiments.replay.recordings import RecordedRun, read_run
from experiments.replay.target import ComputeBasis, ReplayTarget
from experiments.run.launch import check_spawnable, launch
from experiments.scoring.formats import markdown_table
from experiments.sizes import LONG_S, Cost, Count, Term, check_work
from experiments.values import COUNT, POSITIVE, POSITIVE_INT
from netsim.calibration import Calibration, load_calibration

__all__ = ["validate", "median_step_time", "configure", "main", "Shape", "parse_shape",
           "default_shape", "host_contention", "DEFAULT_EXTRAPOLATIONS", "COMPUTE_FROM",
           "JUDGED_COLUMN"]

DEFAULT_BANDWIDTHS = ("10Mbit", "100Mbit", "1Gbit")
KERNEL_BANDWIDTHS = ("10Mbit", "50Mbit", "200Mbit")  # tc on veths: what the CPUs keep up with
# Kernel-shaped runs are recorded through the same launcher and namespaces, on a link fast
# enough to hide (a 74 kB exchange takes 0.06 ms): their ranks are fresh interpreters in network
# namespaces, and on this machine those computed 12% slower than spawned ranks (211 against
# 239 ms of compute per flexdemo step), which no network model should be asked to explain.
KERNEL_RECORDING_BW = "10Gbit"
DEFAULT_LATENCIES = ("1ms", "20ms")
# Another node count, fewer ranks per node, and an uneven node count, each runnable on 2 cores.
DEFAULT_EXTRAPOLATIONS = ("2x2:4x1", "2x1:2x2", "2x2:3x1")

# What a point is judged on: the recordings' prediction, or the run's own compute (the network
# model alone: compute on this VM drifted by up to 25% within minutes, see docs/cost-model.md).
COMPUTE_FROM = ("recordings", "run")
JUDGED_COLUMN = {"recordings": "error_pct", "run": "network_error_pct"}
_BASES = {"recordings": "the recordings' prediction (compute from the recordings)",
          "run": "each run's own compute with the links modeled (the network model alone)"}

Shape = tuple[int, int]
"""(nodes, ranks per node)."""


def parse_shape(text: str) -> Shape:
    """"2x2" -> (2, 2); ConfigError (one sentence) for anything else."""
    found = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", str(text))
    if not found or int(found[1]) < 2 or int(found[2]) < 1:
        raise ConfigError(f"shape {text!r} is not NODESxRANKS with 2 or more nodes of 1 or more "
                          "ranks, such as 2x2.")
    return int(found[1]), int(found[2])


def shape_name(shape: Shape) -> str:
    """(2, 2) -> "2x2"."""
    return f"{shape[0]}x{shape[1]}"


def usable_cores() -> int:
    """Cores this process may run on (what pinned ranks are spread over)."""
    return len(os.sched_getaffinity(0))


def default_shape(cores: int) -> Shape:
    """Two nodes of as many ranks as leave each rank a core of its own (at least one)."""
    return 2, max(1, cores // 2)


def host_contention(recorded: Shape, target: Shape, cores: int) -> float:
    """Compute factor from `recorded` to `target` when their ranks share `cores` cores.

    Rank r is pinned to core r mod cores, so the busiest core holds ceil(ranks / cores) ranks,
    and a synchronous step goes at the pace of the ranks that share it: their compute takes
    that many times a lone rank's. The rule ignores the core a waiting rank hands to the ranks
    beside it (ranks of a synchronous step compute at the same time).
    """
    def busiest(shape: Shape) -> int:
        return math.ceil(shape[0] * shape[1] / cores)

    return busiest(target) / busiest(recorded)


def median_step_time(step_ends: pd.Series, warmup: int) -> float:
    """Median duration of the steps after the first `warmup` ones, from cumulative end times."""
    durations = step_ends.diff().fillna(step_ends.iloc[0])
    return float(durations.iloc[warmup:].median())


@dataclass(frozen=True)
class Validation:
    """validate-sim's result: one row per grid point, and what the model assumed for all."""

    table: pd.DataFrame
    assumed: str


def validate(
    methods: list[str], bandwidths: list[str], latencies: list[str], *, workload: str,
    steps: int, warmup: int, bound: float, work_dir: Path, seed: int = 0,
    settings: dict[str, Any] | None = None, shaping: str = "wall", recordings: int = 3,
    calibration: Calibration | None = None, pairs: list[tuple[Shape, Shape]] | None = None,
    cores: int | None = None, compute_from: str = "recordings",
) -> Validation:
    """Run the grid: one row per (method, shape pair, bandwidth, latency) with both step times.

    `pairs` are (recorded shape, measured shape); default: the same-shape check on
    `default_shape(cores)`. `settings` are further run settings (RunConfig names) shared by
    every run; `shaping` is how the measured runs are slowed down ("wall" or "kernel");
    `recordings` runs per method and recorded shape (unshaped, or kernel-shaped at
    KERNEL_RECORDING_BW) are replayed at every point (prediction: their median;
    predicted_lo/hi: their range). `cores`: those the ranks are pinned over (default: this
    process's). Every row has both errors: `error_pct` (the recordings' prediction) and
    `network_error_pct` (the run replayed with its own compute); `within_bound` judges the one
    `compute_from` names ("recordings" or "run").
    """
    cores = cores or usable_cores()
    pairs = pairs or [(default_shape(cores),) * 2]
    base = RunConfig(workload=workload, steps=steps, seed=seed, eval_every=steps + 1,
                     pin_cores=True)
    base = base.replace(**(settings or {}))
    sources = list(dict.fromkeys(source for source, _ in pairs))
    units = [(m, source, None, None, None, k) for m in methods for source in sources
             for k in range(recordings)]
    units += [(m, source, target, bw, lat, 0) for m in methods for source, target in pairs
              for bw in bandwidths for lat in latencies]
    recorded: dict[tuple[str, Shape], list[RecordedRun]] = {}
    intra, intra_line = _loopback_for(pairs)
    rows = []
    for method, source, target, bw, lat, k in tqdm(units, desc="validate-sim", unit="run"):
        if target is None:
            cfg = _recording_config(base, method, shaping, source)
            out = launch(cfg, work_dir / f"{method}-{shape_name(source)}-recording-{k}",
                         quiet=True)
            recorded.setdefault((method, source), []).append(read_run(out))  # replayed at all
            continue
        cfg = _for_method(base, method, inter_bw=bw, inter_lat=lat, shaping=shaping,
                          nodes=target[0], gpus_per_node=target[1])
        out = launch(cfg, work_dir / f"{method}-{shape_name(source)}-{shape_name(target)}-{bw}"
                     f"-{lat}", quiet=True)
        measured = median_step_time(pd.read_parquet(out / "steps.parquet")["wall_time_s"], warmup)
        factor = host_contention(source, target, cores)
        # Intra-node durations and FSDP2's order as recorded (real runs never shape them); the
        # links FSDP2's added traffic is timed on, where a recording lacks it (`_loopback_for`).
        shape = ReplayTarget(inter_bw=bw, inter_lat=lat, calibration=calibration,
                             intra="recorded", overlap="recorded",
                             **intra.get((source, target), {}))
        predictions = sorted(
            median_step_time(replay(run, shape.at(nodes=target[0], gpus_per_node=target[1],
                                                  compute=ComputeBasis(scale=factor)))
                             .frame["time_s"], warmup)
            for run in recorded[(method, source)]
        )
        # The run itself replayed on its own network: its compute as measured, the links as
        # modeled; what is left of the error is the network model's alone.
        own = median_step_time(replay(read_run(out), ReplayTarget(
            inter_bw=bw, inter_lat=lat, calibration=calibration)).frame["time_s"], warmup)
        rows.append(_point_row(cfg, source, measured, predictions, own))
        rows[-1]["within_bound"] = abs(rows[-1][JUDGED_COLUMN[compute_from]]) <= 100 * bound
    assumed = _assumed(base, shaping, recordings, calibration, pairs, cores) + intra_line
    return Validation(pd.DataFrame(rows), f"{assumed} Judged on {_BASES[compute_from]}.")


def _loopback_for(pairs: list[tuple[Shape, Shape]]) -> tuple[dict, str]:
    """Per (recorded, target) pair from one rank per node to more: the intra link (run
    settings) FSDP2's added traffic is timed on, measured at the target's shape; and a sentence
    saying so (empty where no pair needs one)."""
    from experiments.replay.calibrate import machine_loopback

    settings, lines = {}, []
    for a, b in pairs:
        if a[1] == 1 < b[1]:
            link, how = machine_loopback(b)
            settings[(a, b)] = {"intra_bw": f"{link.bandwidth * 8 / 1e6:.6g}Mbit",
                                "intra_lat": f"{link.latency * 1e6:.6g}us"}
            lines.append(f"{shape_name(a)}->{shape_name(b)}: {how}")
    if not lines:
        return {}, ""
    return settings, (" FSDP2's intra-node traffic, which a recording of one rank per node "
                      "lacks, added from the layout and timed on this machine's loopback "
                      "measured at the target's shape, its nodes' collectives at once and "
                      f"pinned as the run is ({'; '.join(lines)}).")


def _assumed(base: RunConfig, shaping: str, recordings: int, calibration: Calibration | None,
             pairs: list[tuple[Shape, Shape]], cores: int) -> str:
    """What every prediction of the table assumed, in a few sentences."""
    how = (f"kernel-shaped at {KERNEL_RECORDING_BW}" if shaping == "kernel" else "unshaped")
    text = (f"{recordings} {how} recording(s) per method and shape, ranks pinned to cores: "
            f"{'yes' if base.pin_cores else 'no'} ({cores} cores); links "
            f"{calibration.describe() if calibration else 'at the configured rate, no extra cost'}")
    if any(s[0] * s[1] > cores for pair in pairs for s in pair):
        factors = ", ".join(f"{shape_name(a)}->{shape_name(b)} x{host_contention(a, b, cores):.3g}"
                            for a, b in pairs)
        text += (f". More ranks than cores: compute scaled by the host-contention rule (ranks "
                 f"on the busiest core of the measured shape over those of the recorded one: "
                 f"{factors})")
    if any(a[1] != b[1] for a, b in pairs):
        text += (". At other ranks per node the optimizer step is scaled to the target's shard "
                 "(forward+backward per rank as recorded)")
    return text + "."


def _recording_config(base: RunConfig, method: str, shaping: str, shape: Shape) -> RunConfig:
    """A recording run of `shape`: unshaped, or for kernel shaping through the namespaces on a
    fast link."""
    nodes, per_node = shape
    if shaping == "kernel":
        return _for_method(base, method, inter_bw=KERNEL_RECORDING_BW, inter_lat="0ms",
                           shaping="kernel", nodes=nodes, gpus_per_node=per_node)
    return _for_method(base, method, inter_lat="0ms", shaping="off", nodes=nodes,
                       gpus_per_node=per_node)


def _for_method(base: RunConfig, method: str, **changes: Any) -> RunConfig:
    """`base` with `changes` as `method` runs it: --set knobs it does not read are left out."""
    return RunConfig.from_dict(shared_for(method, {**base.to_dict(), "method": method,
                                                   **changes}))


def _point_row(cfg: RunConfig, source: Shape, measured: float, predictions: list[float],
               own: float) -> dict[str, Any]:
    """One table row: a shaped run's median step time against the recordings' predictions and
    against its own compute with modeled links (`own`)."""
    predicted = float(pd.Series(predictions).median())
    return {
        "method": cfg.method, "recorded": shape_name(source),
        "measured_shape": f"{cfg.nodes}x{cfg.gpus_per_node}",
        "inter_bw": cfg.inter_bw, "inter_lat": cfg.inter_lat,
        "measured_ms": measured * 1e3, "predicted_ms": predicted * 1e3,
        "predicted_lo_ms": predictions[0] * 1e3, "predicted_hi_ms": predictions[-1] * 1e3,
        "error_pct": 100.0 * (predicted / measured - 1.0),
        "with_own_compute_ms": own * 1e3, "network_error_pct": 100.0 * (own / measured - 1.0),
    }


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of `flexbench validate-sim`."""
    methods = parser.add_argument("--method", nargs="+", default=["flexdemo", "hsdp-adamw"],
                                  metavar="METHOD", help="methods recorded and measured")
    add_old_spelling(parser, "--methods", methods)
    parser.add_argument("--inter-bw", nargs="+", default=None,
                        help=f"default {' '.join(DEFAULT_BANDWIDTHS)} (wall), "
                        f"{' '.join(KERNEL_BANDWIDTHS)} (kernel)")
    parser.add_argument("--inter-lat", nargs="+", default=None,
                        help=f"default {' '.join(DEFAULT_LATENCIES)} (wall; with --extrapolate "
                        f"{DEFAULT_LATENCIES[0]}), 0ms (kernel)")
    parser.add_argument("--shaping", choices=("wall", "kernel"), default="wall",
                        help="how the measured runs are shaped: netsim's waits or Linux tc")
    parser.add_argument("--shape", metavar="NODESxRANKS",
                        help="the shape recorded and measured (default: 2 nodes, one core per "
                        "rank: 2x1 on 2 cores)")
    parser.add_argument("--extrapolate", nargs="*", metavar="FROM:TO",
                        help="record on FROM, predict and measure TO (alone: "
                        f"{' '.join(DEFAULT_EXTRAPOLATIONS)})")
    parser.add_argument("--compute-from", choices=COMPUTE_FROM, default=None,
                        help="judge each point on the recordings' prediction or on the run's own "
                        "compute with modeled links (default: run for the same shape, "
                        "recordings with --extrapolate); both errors are shown")
    parser.add_argument("--workload", default="lm-tiny")
    parser.add_argument("--steps", type=POSITIVE_INT.arg, default=8, help="steps per run")
    skip = parser.add_argument("--skip-steps", type=COUNT.arg, default=2,
                               help="first steps left out of medians")
    add_old_spelling(parser, "--warmup", skip)
    parser.add_argument("--bound", type=POSITIVE.arg, default=0.10, help="allowed relative error")
    parser.add_argument("--recordings", type=POSITIVE_INT.arg, default=3,
                        help="recorded runs per method whose predictions are pooled (median)")
    parser.add_argument("--calibration", metavar="FILE",
                        help="price links as `flexbench calibrate` measured them (its shaping "
                        "must match --shaping); default: this machine's, found or made now; "
                        "'none': the configured rates")
    parser.add_argument("--out", help="also write the table to this CSV file")
    parser.add_argument("--keep", help="keep the runs in this folder (default: a temp folder)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any other run setting, as for `flexbench run`; repeatable")


def main(args: argparse.Namespace) -> int:
    """Run `flexbench validate-sim`."""
    reads = [args.calibration] if args.calibration not in (None, "none") else []
    if args.out:
        check_output_file(args.out, what="--out", reads=reads)
    if args.keep:
        check_output_folder(args.keep, what="--keep", reads=reads)
    settings, pairs = _check_arguments(args)
    calibration = _calibration(args.calibration, args.shaping)
    with tempfile.TemporaryDirectory(prefix="validate-sim-") as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        try:
            result = validate(args.method, args.inter_bw, args.inter_lat, workload=args.workload,
                              steps=args.steps, warmup=args.skip_steps, bound=args.bound,
                              work_dir=work,
                              settings=settings, shaping=args.shaping,
                              recordings=args.recordings, calibration=calibration, pairs=pairs,
                              compute_from=args.compute_from)
        except RunFailed as err:
            print(f"flexbench validate-sim: a run failed: {err}")
            return 1
    table = result.table
    _print_table(result)
    if args.out:
        write_atomic(Path(args.out), table.to_csv(index=False))
    bad = table[~table["within_bound"]]
    if len(bad):
        print(f"{len(bad)} of {len(table)} points are outside ±{args.bound:.0%}.")
        return 1
    print(f"all {len(table)} points within ±{args.bound:.0%}.")
    return 0


def _calibration(given: str | None, shaping: str) -> Calibration | None:
    """--calibration: a file, 'none', or (not given) this machine's, found or made; says which."""
    if given == "none":
        print("calibration: none (links at their configured rates)")
        return None
    if given:
        return load_calibration(given, shaping=shaping)
    from experiments.replay.calibrate import machine_calibration

    found, how = machine_calibration(shaping)
    print(f"calibration: {how}")
    return found


def _pairs(args: argparse.Namespace) -> list[tuple[Shape, Shape]]:
    """(recorded, measured) shapes from --shape or --extrapolate."""
    if args.extrapolate is None:
        shape = parse_shape(args.shape) if args.shape else default_shape(usable_cores())
        return [(shape, shape)]
    if args.shape:
        raise ConfigError("--shape and --extrapolate cannot be combined; --extrapolate takes "
                          "FROM:TO pairs such as 2x2:4x1.")
    pairs = []
    for pair in args.extrapolate or DEFAULT_EXTRAPOLATIONS:
        source, sep, target = str(pair).partition(":")
        if not sep:
            raise ConfigError(f"--extrapolate {pair!r} is not FROM:TO, such as 2x2:4x1.")
        pairs.append((parse_shape(source), parse_shape(target)))
        if pairs[-1][0] == pairs[-1][1]:
            raise ConfigError(f"--extrapolate {pair!r} records and measures one shape, which "
                              "is the same-shape check, not an extrapolation; give two shapes, "
                              f"such as 2x2:4x1, or --shape {shape_name(pairs[-1][0])}.")
    if len(set(pairs)) < len(pairs):
        raise ConfigError(f"--extrapolate lists a pair twice ({' '.join(args.extrapolate)}).")
    return pairs


def _check_arguments(args: argparse.Namespace) -> tuple[dict[str, str], list]:
    """Fill the grid's defaults and check every run it will start; the --set settings and the
    (recorded, measured) shape pairs."""
    if args.steps <= args.skip_steps:
        raise ConfigError(f"--steps ({args.steps}) must exceed --skip-steps ({args.skip_steps}).")
    if not 0 < args.bound < 1:
        raise ConfigError(f"--bound must be in (0, 1), got {args.bound}.")
    if args.recordings < 1:
        raise ConfigError(f"--recordings must be >= 1, got {args.recordings}.")
    pairs = _pairs(args)
    wall = args.shaping == "wall"
    _fill_network(args)
    if args.compute_from is None:
        args.compute_from = "recordings" if args.extrapolate is not None else "run"
    _check_lists(args)
    settings = _settings(args.set)
    for method in args.method:
        base = _for_method(RunConfig(workload=args.workload).replace(**settings), method)
        for shape in dict.fromkeys(s for pair in pairs for s in pair):
            for bw in args.inter_bw:
                for lat in args.inter_lat:  # each shaped run's network, as it will be launched
                    shaped = base.replace(inter_bw=bw, inter_lat=lat, shaping=args.shaping,
                                          nodes=shape[0], gpus_per_node=shape[1])
                    _check_launchable(shaped, wall)
    _check_size(args, pairs)
    return settings, pairs


# A validation is real runs: each starts its ranks (seconds: imports, rendezvous) and trains
# its steps (an lm-tiny step takes tens of ms on 2 cores). It runs for an hour or more on
# purpose, so it is held to a day (LONG_S) rather than to experiments.sizes' default.
_RUN = Cost("to start a run's ranks", seconds=2.0)
_RUN_STEP = Cost("to train a step of a run", seconds=0.01)


def _check_size(args: argparse.Namespace, pairs: list[tuple[Shape, Shape]]) -> None:
    """Refuse a grid of runs that would take more than a day (experiments.sizes)."""
    sources = len(dict.fromkeys(source for source, _ in pairs))
    count = len(args.method) * (sources * args.recordings
                                 + len(pairs) * len(args.inter_bw) * len(args.inter_lat))
    runs = Count("--recordings", count, "runs", said=f"--recordings {args.recordings} with "
                 f"{len(args.method)} methods, {len(pairs)} shapes and "
                 f"{len(args.inter_bw) * len(args.inter_lat)} network points ({count:,} runs)")
    steps = Count("--steps", args.steps, "steps")
    check_work("the validation", [Term(_RUN, (runs,)), Term(_RUN_STEP, (runs, steps))],
               budget_s=LONG_S, budget="a day, the longest a validation is let start")


# Run settings validate-sim sets from its own flags: a --set of one would be overwritten
# (method, shaping, the grid's network) or would change what --steps and --skip-steps were
# checked against.
_OWN_FLAGS = {"method": "--method", "workload": "--workload", "steps": "--steps",
              "shaping": "--shaping", "inter_bw": "--inter-bw", "inter_lat": "--inter-lat"}


def _settings(given: list[str]) -> dict[str, Any]:
    """The --set run settings, none of which the shapes or validate-sim's own flags set."""
    settings = parse_sets(given)
    for key in ("nodes", "gpus_per_node"):
        if key in settings:
            raise ConfigError(f"--set {key} is taken from the shapes; give --shape NODESxRANKS "
                              "or --extrapolate FROM:TO instead.")
    for key, flag in _OWN_FLAGS.items():
        if key in settings:
            raise ConfigError(f"--set {key} is validate-sim's own {flag}, which sets it for "
                              f"every run; give {flag} instead.")
    return settings


def _check_lists(args: argparse.Namespace) -> None:
    """Each of --method, --inter-bw and --inter-lat lists a value once (a grid point twice is
    a run twice, and its row twice in the table)."""
    for flag, values in (("--method", args.method), ("--inter-bw", args.inter_bw),
                         ("--inter-lat", args.inter_lat)):
        if len(set(values)) < len(values):
            raise ConfigError(f"{flag} lists a value twice ({' '.join(values)}).")


def _fill_network(args: argparse.Namespace) -> None:
    """The grid's bandwidths and latencies where not given, for the shaping mode."""
    wall = args.shaping == "wall"
    if args.inter_bw is None:
        args.inter_bw = list(DEFAULT_BANDWIDTHS if wall else KERNEL_BANDWIDTHS)
    if args.inter_lat is None:  # without netem the kernel adds no latency
        latencies = DEFAULT_LATENCIES[:1] if args.extrapolate is not None else DEFAULT_LATENCIES
        args.inter_lat = list(latencies) if wall else ["0ms"]


def _check_launchable(cfg: RunConfig, wall: bool) -> None:
    """ConfigError (one sentence) if `cfg` cannot run here; kernel: privileges, before any run."""
    topology = cfg.validate().topology()
    check_spawnable(cfg.world_size)
    if not wall:
        from experiments.run.kernel import kernel_settings

        kernel_settings(topology)


def _print_table(result: Validation) -> None:
    """The comparison as a markdown table, the recordings' range beside each prediction."""
    table = result.table.copy()
    if (table["recorded"] == table["measured_shape"]).all():
        table = table.drop(columns=["measured_shape"]).rename(columns={"recorded": "shape"})
    spread = [f"{lo:.1f}-{hi:.1f}" for lo, hi in zip(table["predicted_lo_ms"],
                                                     table["predicted_hi_ms"], strict=True)]
    shown = table.assign(
        measured_ms=table["measured_ms"].map("{:.1f}".format),
        predicted_ms=table["predicted_ms"].map("{:.1f}".format),
        predicted_lo_ms=spread,
        error_pct=table["error_pct"].map("{:+.1f}%".format),
        with_own_compute_ms=table["with_own_compute_ms"].map("{:.1f}".format),
        network_error_pct=table["network_error_pct"].map("{:+.1f}%".format),
    ).drop(columns=["predicted_hi_ms"]).rename(columns={"predicted_lo_ms": "recordings_ms"})
    shown = shown.set_index("method")
    print(f"model: {result.assumed}")
    print(markdown_table(shown, index_name="method"))
