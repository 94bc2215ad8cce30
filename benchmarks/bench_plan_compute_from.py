"""`plan --compute-from` a run's own profile against the replay of that profile, over many runs.

Runbook (an otherwise idle machine: ranks that share cores compute unevenly, which is the
point of the second shape):
    python benchmarks/bench_plan_compute_from.py [--profiles 8] [--shapes 2x1 2x2]
    python benchmarks/bench_plan_compute_from.py --shapes 2x2 --from RUN/profile ...

For each shape (nodes x ranks per node) trains lm-tiny with hsdp-adamw `--profiles` times
(`run --profile`, 8 and 16 steps alternately, seed 0; or measures the profiles `--from` names),
imports each profile, and prints per profile and inter-node bandwidth (1 ms latency) the
planned step time over the median step of the import's replay on the plan's basis
(intra-node modeled, FSDP2's reduce streamed): the ratio
`tests/experiments/test_import_trace_own_run.py` bounds. Then, per shape and bandwidth, the
smallest, median and largest ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
from pathlib import Path

import pandas as pd

from experiments.cli import main
from experiments.config import RunConfig
from experiments.replay.engine import replay
from experiments.replay.recordings import read_run
from experiments.replay.target import ReplayTarget
from experiments.run.launch import launch

BANDWIDTHS = ("10Mbit", "100Mbit", "1Gbit", "10Gbit", "100Gbit")
LATENCY = "1ms"


def _quiet(argv: list[str]) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0, argv


def profile(root: Path, nodes: int, per_node: int, steps: int) -> Path:
    """A profiled run of lm-tiny with hsdp-adamw; its profile folder."""
    cfg = RunConfig(method="hsdp-adamw", workload="lm-tiny", nodes=nodes,
                    gpus_per_node=per_node, steps=steps, eval_every=steps, batch_size=2,
                    seed=0, profile=True)
    return launch(cfg, root / "run", timeout_s=600, quiet=True) / "profile"


def ratios(root: Path, folder: Path, nodes: int, per_node: int) -> list[float]:
    """A profile's planned over replayed step time, per bandwidth of BANDWIDTHS."""
    imported = root / "imported"
    _quiet(["import-trace", str(folder), "--gpus-per-node", str(per_node),
            "--workload", "lm-tiny", "--batch-size", "2", "--out", str(imported)])
    run = read_run(imported)
    out = []
    for bandwidth in BANDWIDTHS:
        plan = root / f"plan-{bandwidth}.csv"
        _quiet(["plan", "--model", "lm-tiny", "--method", "hsdp-adamw", "--nodes", str(nodes),
                "--gpus-per-node", str(per_node), "--compute-from", str(imported),
                "--inter-bw", bandwidth, "--inter-lat", LATENCY, "--set", "param_dtype=fp32",
                "--out", str(plan)])
        planned = float(pd.read_csv(plan)["step_time_s"].iloc[0])
        target = ReplayTarget(inter_bw=bandwidth, inter_lat=LATENCY, intra="model",
                              overlap="fsdp2")
        out.append(planned / float(replay(run, target).frame["step_time_s"].median()))
    return out


def main_() -> None:
    """Profile, import, plan and replay; print the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", type=int, default=8, help="runs per shape")
    parser.add_argument("--shapes", nargs="+", default=["2x1", "2x2"],
                        help="nodes x ranks per node")
    parser.add_argument("--from", dest="folders", nargs="+", type=Path, default=None,
                        help="profile folders of earlier runs (`run --profile`) of lm-tiny "
                             "with hsdp-adamw, all of the one shape --shapes gives, "
                             "measured instead of new runs")
    args = parser.parse_args()
    if args.folders and len(args.shapes) != 1:
        parser.error("--from takes the profiles of one shape: give --shapes once.")
    print(f"planned / replayed median step, lm-tiny hsdp-adamw, {LATENCY} latency; "
          f"bandwidths {', '.join(BANDWIDTHS)}")
    for shape in args.shapes:
        nodes, per_node = (int(x) for x in shape.split("x"))
        found = []
        count = len(args.folders) if args.folders else args.profiles
        for i in range(count):
            with tempfile.TemporaryDirectory() as tmp:
                if args.folders:
                    folder, what = args.folders[i], str(args.folders[i])
                else:
                    steps = 8 if i % 2 == 0 else 16
                    folder, what = profile(Path(tmp), nodes, per_node, steps), f"{steps} steps"
                found.append(ratios(Path(tmp), folder, nodes, per_node))
            print(f"{shape} profile {i} ({what}): "
                  + "  ".join(f"{r:.3f}" for r in found[-1]), flush=True)
        for bandwidth, column in zip(BANDWIDTHS, zip(*found, strict=True), strict=True):
            print(f"{shape} {bandwidth:>8}: min {min(column):.3f}  median "
                  f"{statistics.median(column):.3f}  max {max(column):.3f}")


if __name__ == "__main__":
    main_()
