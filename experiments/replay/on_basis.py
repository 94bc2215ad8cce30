"""`flexbench report --same-compute method|all`: a sweep's simulated rows replayed on one basis.

    flexbench report results/quick --same-compute all

A sweep times each unit on its own recorded compute, so the machine's load while one unit
trained enters its time. With --same-compute every finished training unit is replayed at every
simulated network point of the sweep (grid and validation points) exactly as
`flexbench compare SWEEP --inter-bw BW --inter-lat LAT --same-compute MODE` replays it: the
same `ReplayTarget` and `Question`, the basis `compare.compute_basis` (method: each method's
median recorded compute per step over its seeds; all: one median over every unit) and each run
scored by `compare.score`, so at a grid point the report and compare give the same times.

The replayed rows take the place of the sweep's simulated rows in every time-to-target table,
speed-up, "first to the target", crossover bandwidth (whose extra replays are compare's too),
figure and speedups.parquet; runs.parquet keeps what the sweep scored, and compute_basis.json
beside summary.md records the basis used. The validation table stays on each unit's recorded
compute: it checks the model against shaped runs, which ran on their own compute. A unit that
failed or diverged is a miss and is not replayed (as in compare): its curve is not drawn.
Refused (one sentence, before anything is written): a sweep whose units were trained on several
cluster shapes or are scored against several targets (compare ranks one cluster on one target),
or that has no target (its baseline never finished).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from experiments.errors import ConfigError
from experiments.logs import progress
from experiments.replay import compare
from experiments.replay.engine import replay
from experiments.replay.recordings import read_run
from experiments.replay.target import ComputeBasis, ReplayTarget
from experiments.scoring import intervals, step_noise
from experiments.scoring.crossings import TimeAt
from experiments.scoring.targets import time_to_target
from netsim.units import format_bandwidth

__all__ = ["BASIS_FILE", "OnBasis", "recorded_unit_time", "replay_on_basis", "run_axis"]

BASIS_FILE = "compute_basis.json"



@dataclass(frozen=True)
class OnBasis:
    """A sweep's simulated rows replayed on one compute basis, and the basis they stand on."""

    mode: str
    """--same-compute's value: method or all."""
    sentence: str
    """compare's basis sentence ("compute basis: one compute per step for every run, ...")."""
    per_variant: dict[str, float]
    """The compute per step (s) each variant's units were replayed at."""
    runs: pd.DataFrame
    """runs.parquet with every finished simulated row's times from the replay on the basis."""
    steps: pd.DataFrame
    """steps.parquet with the simulated rows' time axes from the same replays."""
    unit_time: Callable[[str, str, float], TimeAt]
    """(unit, latency, target) -> that unit's time to target at any bandwidth, on the basis."""

    @property
    def summary_line(self) -> str:
        """The "Compute basis:" line printed beside each of summary.md's tables."""
        return (f"Compute basis: `--same-compute {self.mode}`, "
                f"{self.sentence.removeprefix('compute basis: ')} (replayed as `flexbench "
                f"compare SWEEP --inter-bw BW --inter-lat LAT --same-compute {self.mode}` does).")

    @property
    def label(self) -> str:
        """A few words for a figure's title: the mode and the compute per step."""
        values = sorted(set(self.per_variant.values()))
        if self.mode == "all":
            return (f"compute basis: --same-compute all (one compute per step for every unit, "
                    f"{values[0]:.4g} s)")
        span = f"{values[0]:.4g}" + (f"–{values[-1]:.4g}" if len(values) > 1 else "")
        return (f"compute basis: --same-compute method (each method's median recorded compute "
                f"per step, {span} s)")

    def record(self) -> dict[str, Any]:
        """compute_basis.json: the mode, the sentence and each variant's compute per step."""
        return {"same_compute": self.mode, "compute_basis": self.sentence,
                "compute_per_step_s": self.per_variant,
                "applies_to": ["summary.md", "speedups.parquet", "figures/"],
                "not_to": ["runs.parquet", "steps.parquet", "the validation table"]}


def _cell(bw: str, lat: str, mode: str) -> ReplayTarget:
    """The target of `flexbench compare SWEEP --inter-bw BW --inter-lat LAT --same-compute
    MODE`."""
    return ReplayTarget(inter_bw=bw, inter_lat=lat, compute=ComputeBasis(same=mode))


def _check_one_cluster(path: str, runs: pd.DataFrame) -> None:
    """ConfigError for a sweep compare cannot rank as one: several shapes or targets, or none."""
    train = runs[runs["kind"] == "train"].drop_duplicates("unit")
    shapes = sorted({f"{n}x{g}" for n, g in zip(train["nodes"], train["gpus_per_node"],
                                                strict=True)}) \
        if {"nodes", "gpus_per_node"} <= set(train.columns) else []
    targets = list(dict.fromkeys(runs["target_val_loss"].dropna()))
    if not targets:  # compare would derive one; the report's tables stand on the sweep's
        raise ConfigError(f"--same-compute scores against the sweep's own target, and {path!r} "
                          "has none (its baseline never finished): report it without "
                          "--same-compute.")
    if len(shapes) > 1 or len(targets) > 1:
        what = (f"trains on {len(shapes)} cluster shapes ({', '.join(shapes)})" if len(shapes) > 1
                else f"scores against {len(targets)} targets")
        raise ConfigError(f"--same-compute replays one cluster's units on one target, as "
                          f"`flexbench compare` ranks them; {path!r} {what}: report it without "
                          "--same-compute, or compare each cluster's unit folders.")


def replay_on_basis(path: str, runs: pd.DataFrame, steps: pd.DataFrame, mode: str, *,
                    noise: bool = False) -> OnBasis:
    """Every finished simulated row of a sweep replayed on the --same-compute `mode` basis;
    `noise`: with each run's resampled step times (--step-noise).

    ConfigError (one sentence) for a sweep compare would refuse; nothing is written here.
    """
    _check_one_cluster(path, runs)
    sim = runs[runs["source"] == "sim"]
    points = sim.drop_duplicates("network")
    if points.empty:
        raise ConfigError(f"{path!r} has no simulated rows to replay on a compute basis; run "
                          "`flexbench sweep` on it first.")
    cells = {net: _cell(bw, lat, mode) for net, bw, lat in
             zip(points["network"], points["inter_bw"], points["inter_lat"], strict=True)}
    question = compare.Question((Path(path),), step_noise=noise)
    given = compare.gather(question, next(iter(cells.values())))
    found = {c.path.name: (c, r) for c, r in given.runs}

    def scored(cell: ReplayTarget, unit: str, noise: bool | None = None) -> compare.Scored:
        c, run = found[unit]
        return compare.score(cell, given, c, run, noise=noise)

    times, finals, samples, axes = [], [], [], {}
    for row in progress(runs.itertuples(index=False), total=len(runs),
                        desc=f"report: replay on --same-compute {mode}", unit="row"):
        ttt = float(row.time_to_target_s)
        final, resampled = float(row.final_time_s), np.full(step_noise.RESAMPLES, ttt)
        if row.source == "sim" and row.status == "done" and row.unit in found:
            result = scored(cells[row.network], str(row.unit))
            ttt, resampled = result.time_to_target_s, result.samples
            if result.axis is not None:
                axes[row.unit, row.network] = result.axis
                final = _final_time(result.axis, steps, str(row.unit), str(row.network))
        times.append(ttt)
        finals.append(final)
        samples.append(resampled)
    replayed = runs.assign(time_to_target_s=times, final_time_s=finals,
                           reached=[math.isfinite(t) for t in times])
    if noise:
        replayed[intervals.SAMPLES_COLUMN] = samples
    memo: dict[tuple[str, str, float], float] = {}

    def unit_time(unit: str, lat: str, target: float) -> TimeAt:
        """A unit's time to target at any bandwidth on the basis (memoised per bandwidth)."""
        del target  # the sweep's one target (`_check_one_cluster`), which compare scores on

        def at(bw: float) -> float:
            if (unit, lat, bw) not in memo:
                cell = _cell(format_bandwidth(bw), lat, mode)
                memo[unit, lat, bw] = scored(cell, unit, noise=False).time_to_target_s
            return memo[unit, lat, bw]

        return at

    return OnBasis(mode, given.basis_text, dict(given.bases), replayed,
                   _steps_on(steps, axes), unit_time)


def _final_time(axis: pd.DataFrame, steps: pd.DataFrame, unit: str, network: str) -> float:
    """The replayed time at the unit's last recorded step (as the sweep's final_time_s)."""
    if len(steps):
        mine = steps[(steps["unit"] == unit) & (steps["network"] == network)
                     & (steps["source"] == "sim")]
        if len(mine):
            at = axis.loc[axis["step"] == mine["step"].max(), "time_s"]
            if len(at):
                return float(at.iloc[0])
    return float(axis["time_s"].iloc[-1])


def _steps_on(steps: pd.DataFrame, axes: dict[tuple[str, str], pd.DataFrame]) -> pd.DataFrame:
    """steps.parquet with each simulated (unit, network)'s time axis from its replay; the
    simulated rows of a unit not replayed (failed, diverged) are left out."""
    if steps.empty:
        return steps
    parts = [steps[steps["source"] != "sim"]]
    for (unit, network), part in steps[steps["source"] == "sim"].groupby(
            ["unit", "network"], sort=False):
        axis = axes.get((unit, network))
        if axis is None:
            continue
        timed = part.drop(columns=["time_s", "step_time_s"], errors="ignore").merge(
            axis[["step", "step_time_s", "time_s"]], on="step", how="left")
        parts.append(timed[part.columns])
    return pd.concat(parts, ignore_index=True)


def recorded_unit_time(out: Path, unit: str, latency: str, target: float) -> TimeAt:
    """A sweep unit's time to target at any bandwidth, replayed on its recorded compute
    (memoised per bandwidth): what the report's crossover bandwidths refine between grid points.
    """
    run = read_run(Path(out) / "units" / unit)
    evals = run.steps.loc[run.steps["val_loss"].notna(), ["step", "val_loss"]]
    memo: dict[float, float] = {}

    def time_at(bw: float) -> float:
        if bw not in memo:
            frame = replay(run, ReplayTarget(inter_bw=format_bandwidth(bw),
                                             inter_lat=latency)).frame
            points = evals.merge(frame[["step", "time_s"]], on="step")
            memo[bw] = time_to_target(points["time_s"], points["val_loss"], target)
        return memo[bw]

    return time_at


def run_axis(run_dir: Path, *, inter_bw: str, inter_lat: str) -> pd.DataFrame:
    """A run's replayed time axis on a flat network, on its own recorded compute (the shaped
    runs' own-compute check, `experiments.report.validation`)."""
    return replay(read_run(run_dir), ReplayTarget(inter_bw=inter_bw, inter_lat=inter_lat)).frame
