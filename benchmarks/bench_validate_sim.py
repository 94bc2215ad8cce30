"""Does the model hold within ±5% in every one of several validate-sim reruns in a row?

    python benchmarks/bench_validate_sim.py --shaping wall          # same shape, 2x1 on 2 cores
    python benchmarks/bench_validate_sim.py --shaping kernel
    python benchmarks/bench_validate_sim.py --shaping wall --extrapolate \\
        --methods flexdemo hsdp-adamw diloco --set diloco_h=1       # 2x2:4x1 2x1:2x2 2x2:3x1
    python benchmarks/bench_validate_sim.py --shaping wall --recordings 1 --no-pin   # the old way

Runs `experiments.replay.validate.validate` `--reruns` times (fresh recordings and shaped runs each
time) and prints, per grid point, the measured and predicted median step times of every rerun,
the error of each, and the worst; then the goal's verdict (every point of every rerun within the
bound). These are real runs on this machine: run it on an idle one.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.config import parse_sets  # noqa: E402
from experiments.replay.validate import (  # noqa: E402
    COMPUTE_FROM,
    DEFAULT_BANDWIDTHS,
    DEFAULT_EXTRAPOLATIONS,
    DEFAULT_LATENCIES,
    JUDGED_COLUMN,
    KERNEL_BANDWIDTHS,
    default_shape,
    parse_shape,
    usable_cores,
    validate,
)
from netsim.calibration import load_calibration  # noqa: E402


def main() -> int:
    """Rerun validate-sim and print the per-point errors side by side."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shaping", choices=("wall", "kernel"), default="wall")
    p.add_argument("--methods", nargs="+", default=["flexdemo", "hsdp-adamw"])
    p.add_argument("--inter-bw", nargs="+", default=None)
    p.add_argument("--inter-lat", nargs="+", default=None)
    p.add_argument("--reruns", type=int, default=3)
    p.add_argument("--recordings", type=int, default=3)
    p.add_argument("--calibration", help="a file written by `flexbench calibrate` (default: "
                   "this machine's, found or made, as validate-sim does; 'none': no calibration)")
    p.add_argument("--shape", help="same-shape check on NODESxRANKS (default: a core per rank)")
    p.add_argument("--extrapolate", nargs="*", metavar="FROM:TO",
                   help=f"record on FROM, measure TO (alone: {' '.join(DEFAULT_EXTRAPOLATIONS)})")
    p.add_argument("--no-pin", action="store_true", help="let the scheduler place the ranks")
    p.add_argument("--compute-from", choices=COMPUTE_FROM, default=None,
                   help="what the goal judges (default: run for the same shape, recordings with "
                   "--extrapolate); both are printed")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other run setting, as for `flexbench run` (e.g. diloco_h=1)")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bound", type=float, default=0.05)
    p.add_argument("--out", help="CSV of every rerun's rows")
    p.add_argument("--keep", help="keep every rerun's runs in this folder (rerun-K/...)")
    args = p.parse_args()
    kernel = args.shaping == "kernel"
    bandwidths = args.inter_bw or list(KERNEL_BANDWIDTHS if kernel else DEFAULT_BANDWIDTHS)
    first = DEFAULT_LATENCIES[:1] if args.extrapolate is not None else DEFAULT_LATENCIES
    latencies = args.inter_lat or (["0ms"] if kernel else list(first))
    if args.extrapolate is not None:
        pairs = [tuple(parse_shape(s) for s in p.split(":"))
                 for p in (args.extrapolate or DEFAULT_EXTRAPOLATIONS)]
    else:
        shape = parse_shape(args.shape) if args.shape else default_shape(usable_cores())
        pairs = [(shape, shape)]
    calibration = None
    if args.calibration != "none":
        if args.calibration:
            calibration = load_calibration(args.calibration, args.shaping)
        else:
            from experiments.replay.calibrate import machine_calibration

            calibration, how = machine_calibration(args.shaping)
            print(f"calibration: {how}", flush=True)
    compute_from = args.compute_from or ("recordings" if args.extrapolate is not None else "run")
    settings = {**parse_sets(args.set), "pin_cores": not args.no_pin}
    tables = []
    for rerun in range(args.reruns):
        with tempfile.TemporaryDirectory(prefix="bench-validate-") as tmp:
            work = Path(args.keep) / f"rerun-{rerun + 1}" if args.keep else Path(tmp)
            result = validate(args.methods, bandwidths, latencies, workload="lm-tiny",
                              steps=args.steps, warmup=args.warmup, bound=args.bound,
                              work_dir=work, settings=settings, shaping=args.shaping,
                              recordings=args.recordings, calibration=calibration,
                              pairs=pairs, compute_from=compute_from)
        print(f"rerun {rerun + 1}: {result.assumed}", flush=True)
        tables.append(result.table.assign(rerun=rerun + 1))
    rows = pd.concat(tables, ignore_index=True)
    if args.out:
        rows.to_csv(args.out, index=False)
    point = ["method", "recorded", "measured_shape", "inter_bw", "inter_lat"]
    summary = rows.groupby(point, sort=False).agg(
        measured_ms=("measured_ms", "median"), measured_spread_ms=("measured_ms", "max"),
        measured_lo_ms=("measured_ms", "min"), predicted_ms=("predicted_ms", "median"))
    summary["measured_spread_ms"] -= summary.pop("measured_lo_ms")
    for column, short in (("error_pct", "error"), ("network_error_pct", "network")):
        wide = rows.pivot_table(index=point, columns="rerun", values=column, sort=False)
        wide.columns = [f"{short}_{c}" for c in wide.columns]
        summary = summary.join(wide)
    with pd.option_context("display.width", 250, "display.float_format", "{:.1f}".format):
        print(f"\n{args.shaping} shaping, {args.reruns} reruns, {args.recordings} recordings "
              f"each, pinned: {not args.no_pin}, bound ±{args.bound:.0%}; error_K: the "
              "recordings' prediction, network_K: each run's own compute, links modeled")
        print(summary.reset_index().to_string(index=False))
    verdict = 0
    for column, what in (("error_pct", "prediction from the recordings"),
                         ("network_error_pct", "network model alone (the run's own compute)")):
        inside = rows[column].abs() <= 100 * args.bound
        judged = column == JUDGED_COLUMN[compute_from]
        goal = f"; goal (all, every rerun): {'met' if inside.all() else 'NOT met'}"
        print(f"{what}: {int(inside.sum())} of {len(rows)} point-reruns within "
              f"±{args.bound:.0%}, median |error| {rows[column].abs().median():.1f}%"
              f"{goal if judged else ''}")
        verdict = verdict or (judged and not inside.all())
    return int(verdict)

if __name__ == "__main__":
    sys.exit(main())
