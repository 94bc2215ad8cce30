"""How far the replay's loss rule (`--loss-scaling`) is from emulated loss curves at 64 nodes.

Run from the repository root: python results/loss-at-64/check_rule.py
It reads run.sh's units only. Per method and target val_loss: the steps the 64-node runs need,
measured, beside what each rule predicts from the 4- and the 16-node runs of the same seed.
A unit's steps to a target are where its val_loss curve first reaches it, linearly interpolated
between the two evaluations around the crossing (evaluations are 10 steps apart). A rule's
prediction is the recording's steps over the rule's k (`LossCurve.factor`, the replay's own code),
without the replay's rounding up to a whole step.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from experiments.replay.loss_curve import LossCurve, LossScaling, Recording
from experiments.replay.recordings import read_loss_run

HERE = Path(__file__).resolve().parent
METHODS = ("hsdp-adamw", "flexdemo", "demo", "diloco")
SEEDS = (0, 1, 2)
SOURCES = (4, 16)
TARGET_NODES = 64
TARGET_AT = (20, 60)
"""Targets: the 4-node runs' median val_loss at these steps."""
RULES = (LossScaling(), LossScaling("linear-to-critical-batch", 512),
         LossScaling("linear-to-critical-batch", 2048))


def recording(method: str, nodes: int, seed: int) -> Recording:
    """The unit of method at nodes and seed as a replay reads a --loss-from run."""
    run = read_loss_run(HERE / "units" / f"{method}-nodes={nodes}-s{seed}")
    return Recording.of(run.path, run.config, run.meta, run.steps)


def steps_to(rec: Recording, target: float) -> float:
    """The step at which rec's val_loss first reaches target, interpolated (inf: never)."""
    evals = rec.steps.loc[rec.steps["val_loss"].notna(), ["step", "val_loss"]]
    before_step, before_loss = 0.0, math.inf
    for step, loss in zip(evals["step"], evals["val_loss"], strict=True):
        if loss <= target:
            if math.isinf(before_loss):
                return float(step)
            share = (before_loss - target) / (before_loss - loss)
            return before_step + share * (step - before_step)
        before_step, before_loss = float(step), float(loss)
    return math.inf


def val_loss_at(rec: Recording, step: int) -> float:
    """rec's val_loss at an evaluated step."""
    row = rec.steps.loc[rec.steps["step"] == step, "val_loss"]
    return float(row.iloc[0])


def fmt_range(values: list[float]) -> str:
    """Median [min-max] of ratios, or a sentence where a run never reached the target."""
    if any(math.isinf(v) or math.isnan(v) for v in values):
        return "n/a (a run did not reach the target)"
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def main() -> None:
    """Print one table a method: target, source, rule, predicted and measured steps, ratio."""
    print(f"vision-tiny, one rank a node, per-rank batch 32 (global batch 32 x nodes), 200 "
          f"steps, seeds {', '.join(map(str, SEEDS))}; ratio: predicted / measured steps at "
          f"{TARGET_NODES} nodes, median [min-max] over the seeds, seed s predicted from seed s")
    for method in METHODS:
        runs = {(n, s): recording(method, n, s) for n in (*SOURCES, TARGET_NODES) for s in SEEDS}
        print(f"\n{method}:")
        print("| target val_loss | from | rule | k | predicted steps | measured steps | ratio |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for at in TARGET_AT:
            target = statistics.median(val_loss_at(runs[4, s], at) for s in SEEDS)
            measured = [steps_to(runs[TARGET_NODES, s], target) for s in SEEDS]
            for nodes in SOURCES:
                seen: set[float] = set()
                for rule in RULES:
                    first = runs[nodes, SEEDS[0]]
                    curve = LossCurve(first, first.path, rule, TARGET_NODES, 1,
                                      TARGET_NODES * first.batch_size)
                    k = curve.factor
                    if k in seen:  # B at or below the recording's batch: the same k as none
                        continue
                    seen.add(k)
                    predicted = [steps_to(runs[nodes, s], target) / float(k) for s in SEEDS]
                    ratios = [p / m for p, m in zip(predicted, measured, strict=True)]
                    print(f"| {target:.4f} (4 nodes at step {at}) | {nodes} nodes | "
                          f"{rule.describe()} | {float(k):g} | "
                          f"{statistics.median(predicted):.1f} | "
                          f"{statistics.median(measured):.1f} | {fmt_range(ratios)} |")


if __name__ == "__main__":
    main()
