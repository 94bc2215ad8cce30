"""Which loss curve a replay at another cluster shape uses, and the rule that carries it there.

The loss at step t does not depend on the network, but it does depend on the global batch
(nodes x gpus_per_node x per-rank batch) and, for gossip, on the node count. A replay whose
global batch or node count is not its recording's therefore states which loss curve it uses:

- Several recordings of the same method and workload (`flexbench simulate RUN --loss-from
  OTHER ...`): the loss curve is the one of the recording whose global batch is nearest the
  target's (by ratio, |log(b / b_target)|; a tie goes to the one given first). The trace that
  is replayed always comes from RUN, the first run given.
- A declared rule (`--loss-scaling`) then maps that curve from its global batch b0 to the
  target's b:
  - `none`: the recording's loss per step as is. An assumption: a larger global batch
    usually reaches a loss in fewer steps, so this is pessimistic for larger clusters.
  - `linear-to-critical-batch:B`: below the critical batch B, a k-times larger global batch
    reaches the same loss in k-times fewer steps; batches above B count as B. So
    k = min(b, B) / min(b0, B), and the evaluation the recording made at step s is reached at
    step ceil(s / k). This is the piecewise-linear reading of McCandlish, Kaplan, Amodei et al.
    2018, "An Empirical Model of Large-Batch Training" (arXiv:1812.06162): steps to a loss
    follow S = S_min (1 + B_noise / B), linear in 1 / B well below the noise scale
    B_noise ~ B_crit and flat well above it. It is an assumption: B is the user's estimate
    (the paper measures it per task and it grows as the loss falls), and the rule ignores the
    curved region near B and any change of learning rate a larger batch would need.
- Gossip and Ada (methods whose record `gossips`) mix their replicas over a graph whose
  mixing slows as it grows (a ring's spectral gap falls as 1/N^2), so no batch rule holds:
  at a node count no recording has, the replay refuses a time to target (the step times still
  hold). A loss at that node count can come from an emulated run (`flexbench run --emulate
  --nodes N`, N replicas trained in one process): given with --loss-from, it lifts the refusal.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import pandas as pd

from experiments.errors import ConfigError
from experiments.io import is_emulated
from flexdemo.methods import method_record

__all__ = ["LOSS_SCALING_CHOICES", "LossCurve", "LossScaling", "Recording", "check_loss_from",
           "choose_loss_curve", "parse_loss_scaling"]

LOSS_SCALING_CHOICES = "none|linear-to-critical-batch:B"
_LINEAR = "linear-to-critical-batch"


@dataclass(frozen=True)
class LossScaling:
    """A declared rule for the loss per step at another global batch (`--loss-scaling`)."""

    name: str = "none"
    """"none" or "linear-to-critical-batch"."""
    critical_batch: int | None = None
    """B of linear-to-critical-batch, in samples per step; None for none."""

    def describe(self) -> str:
        """The rule as the flag spells it: none, or linear-to-critical-batch:B."""
        return self.name if self.critical_batch is None else f"{self.name}:{self.critical_batch}"

    def step_factor(self, recorded_batch: int, target_batch: int) -> Fraction:
        """k: how many times fewer steps the target needs than the recording to a given loss."""
        if self.critical_batch is None:
            return Fraction(1)
        cap = self.critical_batch
        return Fraction(min(target_batch, cap), min(recorded_batch, cap))


def parse_loss_scaling(text: str | None) -> LossScaling:
    """`--loss-scaling` as a LossScaling (None: none); ConfigError, one sentence, if malformed."""
    if text is None or text == "none":
        return LossScaling()
    name, _, value = text.partition(":")
    if name == _LINEAR and value.isdigit() and int(value) >= 1:
        return LossScaling(_LINEAR, int(value))
    raise ConfigError(f"--loss-scaling {text!r} is not a rule; give none or {_LINEAR}:B with "
                      f"B the critical global batch in samples, e.g. {_LINEAR}:512.")


@dataclass(frozen=True)
class Recording:
    """A recording's loss curve and the shape it was recorded at."""

    path: Path
    method: str
    workload: str
    graph: str | None
    """The gossip graph setting (None for methods that do not gossip)."""
    nodes: int
    gpus_per_node: int
    batch_size: int | None
    """Per-rank micro-batch; None where run.json does not record it (the workload's default)."""
    steps: pd.DataFrame
    """steps.parquet (step, val_loss, ...)."""
    final_val_loss: float | None
    emulated: bool = False
    """Whether the loss was computed by an emulated run (`flexbench run --emulate`)."""

    @classmethod
    def of(cls, path: Path, config: Any, meta: dict, steps: pd.DataFrame) -> Recording:
        """A run's Recording from its RunConfig, run.json and steps.parquet."""
        gossips = method_record(config.method).gossips
        return cls(Path(path), config.method, config.workload,
                   getattr(config, "graph", None) if gossips else None, config.nodes,
                   config.gpus_per_node, config.batch_size, steps, meta.get("final_val_loss"),
                   is_emulated(meta))

    @property
    def ranks(self) -> int:
        """Ranks the recording trained on: nodes x gpus_per_node."""
        return self.nodes * self.gpus_per_node

    @property
    def global_batch(self) -> int | None:
        """Samples per optimizer step over all ranks (None when the per-rank batch is unknown)."""
        return None if self.batch_size is None else self.ranks * self.batch_size

    @property
    def shape(self) -> str:
        """The cluster shape, e.g. 2 x 2 (with ", emulated" for an emulated run's loss)."""
        return f"{self.nodes} x {self.gpus_per_node}" + (", emulated" if self.emulated else "")


@dataclass(frozen=True)
class LossCurve:
    """The loss curve a replay uses: its recording, the rule, and whether it may time a target."""

    recording: Recording
    trace_from: Path
    rule: LossScaling
    nodes: int
    """Target node count."""
    gpus_per_node: int
    """Target ranks per node."""
    global_batch: int | None
    """The target's global batch: its ranks times the traced run's per-rank batch (or None)."""
    refusal: str | None = None
    """Why no time to target is given (gossip at a node count no recording has), else None."""

    @property
    def factor(self) -> Fraction:
        """k of the rule from the recording's global batch to the target's."""
        if self.recording.global_batch is None or self.global_batch is None:
            return Fraction(1)  # only rule none is allowed then (choose_loss_curve)
        return self.rule.step_factor(self.recording.global_batch, self.global_batch)

    @property
    def stated(self) -> bool:
        """Whether the replay must say which curve it uses (another shape, recording or rule)."""
        rec = self.recording
        return (rec.path != self.trace_from or self.rule.critical_batch is not None
                or (rec.nodes, rec.ranks, rec.global_batch)
                != (self.nodes, self.nodes * self.gpus_per_node, self.global_batch))

    def target_step(self, step: int) -> int:
        """The target step at which the recording's step `step` loss is reached: ceil(s / k)."""
        k = self.factor
        return -(-step * k.denominator // k.numerator)

    def steps_needed(self) -> int | None:
        """Steps the replay needs to cover the recording's curve (None: the trace's own)."""
        if not self.stated:
            return None
        return self.target_step(int(self.recording.steps["step"].max()))

    def on_time_axis(self, frame: pd.DataFrame) -> pd.DataFrame:
        """The recording's evaluations at their target steps, with the frame's time there."""
        steps = self.recording.steps
        evals = steps.loc[steps["val_loss"].notna(), ["step", "val_loss"]]
        evals = evals.assign(step=[self.target_step(int(s)) for s in evals["step"]])
        return evals.merge(frame[["step", "time_s"]], on="step", how="inner")

    def label(self) -> str:
        """What goes beside a time to target: the rule and the recording's shape and batch."""
        rec = self.recording
        return (f"loss curve of {rec.path.name} at {rec.shape}, {_batch(rec.global_batch)}; "
                f"--loss-scaling {self.rule.describe()}")

    def summary(self) -> str:
        """One sentence on where the trace and the loss curve came from and how it was mapped."""
        rec = self.recording
        if self.refusal is not None:
            how = f"not used ({rec.method} has no recording at {self.nodes} nodes)"
        elif self.rule.critical_batch is None or self.factor == 1:
            same = (rec.ranks, rec.global_batch) == (self.nodes * self.gpus_per_node,
                                                     self.global_batch)
            how = ("its loss per step as recorded" if same else
                   f"its loss per step as recorded (rule {self.rule.describe()}, an assumption)")
        else:
            how = (f"its step s reached at step ceil(s / {_fmt(self.factor)}) (rule "
                   f"{self.rule.describe()}, an assumption)")
        return (f"trace from {self.trace_from}; loss curve from {rec.path} ({rec.shape}, "
                f"{_batch(rec.global_batch)}) for {self.nodes} x {self.gpus_per_node} "
                f"({_batch(self.global_batch)}): {how}")

    def record(self) -> dict[str, Any]:
        """What the replay stores beside its CSV: where each part came from and the rule."""
        rec = self.recording
        return {"trace_from": str(self.trace_from), "loss_curve_from": str(rec.path),
                "loss_scaling": self.rule.describe(), "recorded_nodes": rec.nodes,
                "recorded_gpus_per_node": rec.gpus_per_node,
                "recorded_global_batch": rec.global_batch, "nodes": self.nodes,
                "gpus_per_node": self.gpus_per_node, "global_batch": self.global_batch,
                "step_factor": _fmt(self.factor), "refusal": self.refusal,
                "loss_curve_emulated": rec.emulated,
                "summary": self.summary()}


def _batch(global_batch: int | None) -> str:
    """"global batch N", or that run.json does not say."""
    return ("global batch unknown (no batch_size in run.json)" if global_batch is None
            else f"global batch {global_batch}")


def _fmt(k: Fraction) -> str:
    return str(k.numerator) if k.denominator == 1 else f"{k.numerator}/{k.denominator}"


def choose_loss_curve(recordings: list[Recording], *, nodes: int, gpus_per_node: int,
                      rule: LossScaling) -> LossCurve:
    """The loss curve of the recording nearest the target's global batch (the first is the trace).

    All recordings must share the first one's method, workload (and gossip graph); ConfigError,
    one sentence, if not. For gossiping methods only recordings at the target node count count,
    and with none the LossCurve carries a refusal instead of a time to target.
    """
    first = recordings[0]
    for other in recordings[1:]:
        _check_same_training(first, other)
    _check_batches_known(recordings, rule)
    gossips = method_record(first.method).gossips
    pool = [r for r in recordings if r.nodes == nodes] if gossips else recordings
    # An imported profiler trace measured no loss: a curve that has one is taken before it.
    measured = [r for r in pool if r.steps["val_loss"].notna().any()]
    pool = measured or pool
    refusal = None
    if not pool:
        have = ", ".join(str(n) for n in sorted({r.nodes for r in recordings}))
        refusal = (f"the loss of {first.method} depends on its node count (a larger graph "
                   f"mixes more slowly) and the recordings are at {have} nodes, not {nodes}: "
                   f"give one at {nodes} nodes with --loss-from RUN.")
        pool = recordings
    target = None if first.batch_size is None else nodes * gpus_per_node * first.batch_size
    best = min(pool, key=lambda r: _distance(r, nodes * gpus_per_node, target))  # ties: first
    return LossCurve(best, first.path, rule, nodes, gpus_per_node, target, refusal)


def _distance(rec: Recording, ranks: int, target: int | None) -> float:
    """How far a recording's global batch is from the target's, as |log ratio|."""
    if target is None or rec.global_batch is None:  # one shared, unknown per-rank batch
        return abs(math.log(rec.ranks / ranks))
    return abs(math.log(rec.global_batch / target))


def _check_batches_known(recordings: list[Recording], rule: LossScaling) -> None:
    """ConfigError where a run without batch_size would have to be compared or scaled."""
    unknown = [r for r in recordings if r.batch_size is None]
    if not unknown:
        return
    if rule.critical_batch is not None:
        raise ConfigError(f"--loss-scaling {rule.describe()} needs each run's global batch, and "
                          f"{str(unknown[0].path)!r} records no batch_size in run.json.")
    if len({r.batch_size for r in recordings}) > 1:
        raise ConfigError(f"{str(unknown[0].path)!r} records no batch_size in run.json, so its "
                          "global batch cannot be compared with the other runs'.")


def _check_same_training(first: Recording, other: Recording) -> None:
    """ConfigError unless `other` trains what `first` does (method, workload, gossip graph)."""
    for what, mine, theirs in (("method", first.method, other.method),
                               ("workload", first.workload, other.workload),
                               ("graph", first.graph, other.graph)):
        if mine != theirs:
            raise ConfigError(f"--loss-from {str(other.path)!r} has {what} {theirs!r}, not "
                              f"{mine!r} as {str(first.path)!r}; a loss curve must come from a "
                              "run of the same method, workload and graph.")


def check_loss_from(paths: Iterable[Path | str], replayed: Iterable[Path | str]) -> None:
    """ConfigError for a --loss-from run given twice, or one already replayed (its own curve
    is among the candidates already): a second copy of a curve is no second recording."""
    seen = {Path(p).resolve(): "a run replayed" for p in replayed}
    for path in paths:
        if Path(path).resolve() in seen:
            raise ConfigError(f"--loss-from {str(path)!r} is given already, as "
                              f"{seen[Path(path).resolve()]}; its loss curve is a candidate "
                              "once.")
        seen[Path(path).resolve()] = "--loss-from"
