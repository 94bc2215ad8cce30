"""The target val_loss of each unit: the baseline of its own cluster, or one shared baseline.

A sweep whose hsdp-adamw runs on one cluster shape (nodes x ranks per node) scores every unit
against that one baseline, as it always did. A sweep that runs hsdp-adamw on several shapes
(`nodes = [4, 8]` as a knob) scores each unit against the baseline of its own shape: eight nodes
see twice the data per step of four, so one pooled target would favour the larger cluster. A
unit on a shape without a baseline then has no target (and no speed-up); the sweep warns.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pandas as pd

from experiments.run_record import RunRecord
from experiments.scoring.targets import BASELINE, baseline_target_at, default_target
from experiments.sweep.plan import Unit, unit_dir, unit_state
from experiments.sweep.spec import SweepConfig

log = logging.getLogger(__name__)

__all__ = ["baseline_clusters", "diverged", "final_val_loss", "targets"]


def baseline_clusters(train: list[Unit]) -> dict[str, str | None]:
    """For each cluster of the training units: the cluster of the baseline it is scored against."""
    shapes = list(dict.fromkeys(u.cluster for u in train if u.method == BASELINE))
    if len(shapes) == 1:
        return {u.cluster: shapes[0] for u in train}
    return {u.cluster: u.cluster if u.cluster in shapes else None for u in train}


def targets(cfg: SweepConfig, out: Path, train: list[Unit]) -> dict[str | None, float]:
    """Target val_loss per baseline cluster; the key None (no baseline to compare with) is NaN."""
    compare = baseline_clusters(train)
    orphans = sorted(c for c, b in compare.items() if b is None)
    if orphans and cfg.target is None:
        log.warning("no %s runs on cluster(s) %s: their units have no target.",
                    BASELINE, ", ".join(orphans))
    found: dict[str | None, float] = {None: math.nan if cfg.target is None else cfg.target}
    several = len(set(compare.values()) - {None}) > 1
    for cluster in dict.fromkeys(b for b in compare.values() if b is not None):
        if cfg.target is not None:
            found[cluster] = cfg.target
            continue
        done = [u for u in train if u.method == BASELINE and u.cluster == cluster
                and unit_state(out, u) == "done"]
        found[cluster] = _derived(cfg, out, _not_diverged(out, done), cluster if several else None)
    return found


def _not_diverged(out: Path, done: list[Unit]) -> list[Unit]:
    """The baseline runs a target may come from: a diverged run's truncated curve never sets it."""
    kept = [u for u in done if not diverged(unit_dir(out, u))]
    if len(kept) < len(done):
        log.warning("%s diverged in %s: the target comes from the other %d run(s).",
                    BASELINE, ", ".join(u.id for u in done if u not in kept), len(kept))
    return kept


def diverged(run_dir: Path) -> bool:
    """Whether run.json says the run diverged (its loss stopped being finite)."""
    return RunRecord.load(run_dir).diverged


def _derived(cfg: SweepConfig, out: Path, done: list[Unit], cluster: str | None) -> float:
    """The target from the baseline's finished runs, by the rule the sweep names; NaN if none."""
    try:
        if cfg.target_fraction is not None:
            curves = [pd.read_parquet(unit_dir(out, u) / "steps.parquet") for u in done]
            return baseline_target_at(curves, cfg.target_fraction)
        finals = pd.DataFrame(
            [{"method": u.method, "final_val_loss": final_val_loss(unit_dir(out, u))}
             for u in done],
            columns=["method", "final_val_loss"],
        )
        return default_target(finals)
    except ValueError as err:
        where = f" (cluster {cluster})" if cluster else ""
        log.warning("%s%s Every time-to-target there is reported as not reached.", err, where)
        return math.nan


def final_val_loss(run_dir: Path) -> float:
    """run.json's final_val_loss, else the last evaluated val_loss; NaN for a diverged run."""
    record = RunRecord.load(run_dir)
    if record.diverged:
        return math.nan
    if record.final_val_loss is not None:
        return record.final_val_loss
    steps = record.steps()
    evals = steps["val_loss"].dropna()
    return float(evals.iloc[-1]) if len(evals) else math.nan
