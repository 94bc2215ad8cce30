"""Emulated runs against real ones: steps per second side by side, and equal losses at N nodes.

    python benchmarks/bench_emulate.py [--nodes 4 16] [--methods hsdp-adamw gossip] \\
        [--workload vision-tiny] [--steps 20]
    python benchmarks/bench_emulate.py --scale 256 --scale-steps 5 [--workload vision-tiny]
    python benchmarks/bench_emulate.py --scale 64 --scale-steps 5 --workload lm-tiny \\
        --target-steps 100

For each node count and method it trains the same settings (N nodes x 1 rank, fixed seed) twice:
a real run (N gloo processes, `experiments.run.launch`) and an emulated one (N threads of this
process, `experiments.run.emulate`), and prints

- real steps/s: steps over run.json's train_time_s (the training clock, evaluations excluded),
  and over the whole launch (process start-up and evaluations included);
- emulated steps/s over the whole call (start-up and evaluations included: it times nothing
  itself);
- the largest relative difference of loss, val_loss and replica_variance per step between them
  (the emulator's claim: under 1e-5).

`--scale N` trains only the emulated run of N replicas for `--scale-steps` steps and prints its
seconds a step (after the first, which builds every replica), the time `--target-steps` would
take at that rate plus the start-up, and the process's peak memory (ru_maxrss), beside the memory
estimate the emulator refuses by. Run it on an otherwise idle machine; the figures depend on it.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.config import RunConfig
from experiments.run.emulate import emulate, estimate_bytes, inbox_peers, replica_size
from experiments.run.launch import launch
from experiments.workloads import make_workload

KNOBS = {"diloco": {"diloco_h": 5}, "streaming-diloco": {"sync_every": 6},
         "gossip": {"graph": "exponential"}, "ada": {"ada_every": 5}}


def _config(method: str, nodes: int, workload: str, steps: int) -> RunConfig:
    return RunConfig(method=method, nodes=nodes, gpus_per_node=1, workload=workload,
                     steps=steps, eval_every=5, seed=3, **KNOBS.get(method, {}))


def _largest_difference(real: pd.DataFrame, emulated: pd.DataFrame) -> float:
    """The largest relative difference of the loss columns per step (NaN where both are NaN)."""
    worst = 0.0
    for column in ("loss", "val_loss", "replica_variance"):
        a, b = real[column].to_numpy(), emulated[column].to_numpy()
        both = ~np.isnan(a)
        if (np.isnan(b) != ~both).any():
            return float("inf")
        scale = np.maximum(np.abs(a[both]), 1e-30)
        worst = max(worst, float((np.abs(a[both] - b[both]) / scale).max(initial=0.0)))
    return worst


def compare(nodes: list[int], methods: list[str], workload: str, steps: int) -> None:
    """Print the side-by-side table for every node count and method."""
    print(f"{workload}, {steps} steps, N nodes x 1 rank, seed 3")
    print(f"{'nodes':>5} {'method':<18} {'real steps/s (train)':>21} {'real steps/s (all)':>19} "
          f"{'emulated steps/s (all)':>23} {'max rel diff':>13}")
    for n in nodes:
        for method in methods:
            cfg = _config(method, n, workload, steps)
            work = Path(tempfile.mkdtemp(prefix="bench-emulate-"))
            try:
                t0 = time.perf_counter()
                real = launch(cfg, work / "real", timeout_s=900, quiet=True)
                real_all = steps / (time.perf_counter() - t0)
                train = json.loads((real / "run.json").read_text())["train_time_s"]
                t0 = time.perf_counter()
                emulated = emulate(cfg, work / "emulated", timeout_s=900, quiet=True)
                emulated_all = steps / (time.perf_counter() - t0)
                diff = _largest_difference(pd.read_parquet(real / "steps.parquet"),
                                           pd.read_parquet(emulated / "steps.parquet"))
            finally:
                shutil.rmtree(work, ignore_errors=True)
            print(f"{n:>5} {method:<18} {steps / train:>21.2f} {real_all:>19.2f} "
                  f"{emulated_all:>23.2f} {diff:>13.1e}", flush=True)


def scale(nodes: int, workload: str, steps: int, target_steps: int) -> None:
    """Seconds a step and peak memory of an emulated run of `nodes` replicas."""
    built = make_workload(workload)
    params, activations = replica_size(built, built.default_batch_size)
    timings = []
    for n_steps in (1, steps):
        work = Path(tempfile.mkdtemp(prefix="bench-emulate-"))
        try:
            cfg = _config("gossip", nodes, workload, n_steps).replace(eval_every=n_steps)
            t0 = time.perf_counter()
            emulate(cfg, work / "emulated", timeout_s=1800, quiet=True)
            timings.append(time.perf_counter() - t0)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    per_step = (timings[1] - timings[0]) / (steps - 1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cfg = _config("gossip", nodes, workload, steps)
    estimate = estimate_bytes(nodes, params, activations, inbox_peers(cfg)) / 2**30
    print(f"{workload}, gossip (exponential), {nodes} emulated replicas: 1 step {timings[0]:.1f} s "
          f"(start-up included), {steps} steps {timings[1]:.1f} s -> {per_step:.2f} s a step; "
          f"{target_steps} steps ~ {timings[0] + (target_steps - 1) * per_step:.0f} s; peak memory "
          f"{peak / 2**30:.2f} GiB (the emulator's estimate {estimate:.2f} GiB)")


def main() -> None:
    """Parse the flags and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--methods", nargs="+", default=["hsdp-adamw", "gossip"])
    parser.add_argument("--workload", default="vision-tiny")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--scale", type=int, default=None, metavar="N")
    parser.add_argument("--scale-steps", type=int, default=5)
    parser.add_argument("--target-steps", type=int, default=200,
                        help="the run length --scale projects the time of")
    args = parser.parse_args()
    if args.scale is not None:
        scale(args.scale, args.workload, max(2, args.scale_steps), args.target_steps)
    else:
        compare(args.nodes, args.methods, args.workload, args.steps)


if __name__ == "__main__":
    main()
