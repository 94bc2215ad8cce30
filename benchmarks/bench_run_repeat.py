"""How far apart are identical shaped runs? The floor under validate-sim's ±5% goal.

    python benchmarks/bench_run_repeat.py --shaping kernel --shape 2x2 --inter-bw 200Mbit \\
        --methods flexdemo hsdp-adamw diloco --set diloco_h=1 --repeats 5

Runs the same shaped run (method, shape, link, seed, pinned as validate-sim pins) `--repeats`
times in a row and prints, per method, each run's median step time, its deviation from the median
over the runs, and its compute (the slowest rank's time outside collectives, median over steps).
A prediction is one number: where identical runs spread wider than twice the bound, no prediction
can fall within the bound of every one of them. These are real runs: run it on an idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.config import RunConfig, parse_sets, shared_for  # noqa: E402
from experiments.replay.validate import median_step_time, parse_shape  # noqa: E402
from experiments.run.launch import launch  # noqa: E402
from netsim.trace import compute_outside_collectives  # noqa: E402


def main() -> int:
    """Repeat each method's run and print the spread of its step times beside the bound."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shaping", choices=("wall", "kernel"), default="kernel")
    p.add_argument("--shape", default="2x2", help="NODESxRANKS")
    p.add_argument("--methods", nargs="+", default=["flexdemo", "hsdp-adamw"])
    p.add_argument("--inter-bw", default="200Mbit")
    p.add_argument("--inter-lat", default="0ms")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bound", type=float, default=0.05)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other run setting, as for `flexbench run` (e.g. diloco_h=1)")
    args = p.parse_args()
    nodes, per_node = parse_shape(args.shape)
    base = {**RunConfig(workload="lm-tiny", steps=args.steps, eval_every=args.steps + 1,
                        pin_cores=True).to_dict(), **parse_sets(args.set)}
    print(f"{args.shaping} shaping, {args.shape}, {args.inter_bw} / {args.inter_lat}, "
          f"{args.steps} steps (median after {args.warmup}), pinned, {args.repeats} runs each, "
          f"back to back", flush=True)
    worst = 0.0
    with tempfile.TemporaryDirectory(prefix="bench-repeat-") as tmp:
        for method in args.methods:
            cfg = RunConfig.from_dict(shared_for(method, {
                **base, "method": method, "nodes": nodes, "gpus_per_node": per_node,
                "shaping": args.shaping, "inter_bw": args.inter_bw, "inter_lat": args.inter_lat}))
            steps, computes = [], []
            for k in range(args.repeats):
                out = launch(cfg, Path(tmp) / f"{method}-{k}", quiet=True)
                ends = pd.read_parquet(out / "steps.parquet")["wall_time_s"]
                steps.append(median_step_time(ends, args.warmup))
                compute = compute_outside_collectives(pd.read_parquet(out / "trace.parquet"))
                computes.append(float(compute[compute.index >= args.warmup].median()))
            mid = statistics.median(steps)
            devs = [100 * (s / mid - 1) for s in steps]
            spread = 100 * (max(steps) / min(steps) - 1)
            worst = max(worst, spread)
            print(f"\n{method}: step time per run (ms) and its deviation from the runs' median "
                  f"{mid * 1e3:.1f} ms; compute outside collectives (ms)")
            for k, (s, d, c) in enumerate(zip(steps, devs, computes, strict=True)):
                print(f"  run {k + 1}: {s * 1e3:7.1f}  {d:+6.1f}%   compute {c * 1e3:6.1f}")
            verdict = ("a prediction could sit within the bound of every run"
                       if spread <= 200 * args.bound
                       else "no single prediction is within the bound of every run")
            print(f"  spread max/min {spread:.1f}% against the bound's width "
                  f"{200 * args.bound:.0f}% (±{100 * args.bound:.0f}%): {verdict}")
    print(f"\nwidest spread {worst:.1f}% (bound ±{100 * args.bound:.0f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
