"""Time to target for a plan: a stated number of steps times the planned step time.

The plan models no loss, so the steps come from a stated source only: `--steps-to-target N`
(every method) or `M=N` (per method), or recordings of the planned workload (`--steps-from
RUN ...` with `--target LOSS`): the first step at which a recording's validation loss reaches
the target, at the recording's own global batch (no loss scaling), the median over a method's
recordings. Without a source the plan says what is missing and gives no number.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from experiments.errors import ConfigError
from experiments.run_record import RunRecord
from experiments.values import POSITIVE_INT

__all__ = ["MISSING", "StepsSource", "steps_source"]

MISSING = ("time to target: not planned, as no steps are stated (give --steps-to-target N, or "
           "--steps-from RUN with --target LOSS); the loss of a declared model is not modeled")


@dataclass(frozen=True)
class StepsSource:
    """Steps to the target per method, and where each figure comes from."""

    steps: dict[str, float]
    sources: dict[str, str]

    def line(self, method: str) -> str:
        """The assumption printed beside a method's time to target."""
        if method not in self.steps:
            return (f"time to target of {method}: not planned, as no source states its steps "
                    "(give it --steps-to-target or a recording in --steps-from)")
        return (f"time to target of {method}: {self.steps[method]:g} steps "
                f"({self.sources[method]}) x the planned step time")


def _given(values: list[str], methods: list[str]) -> StepsSource:
    """--steps-to-target N (every method) or M=N per method."""
    steps: dict[str, float] = {}
    for value in values:
        method, sep, count = value.rpartition("=")
        if not count.isdigit() or int(count) < 1:
            raise ConfigError(f"--steps-to-target {value!r} must be a whole number of steps >= 1, "
                              "or METHOD=N.")
        if sep and method not in methods:
            raise ConfigError(f"--steps-to-target {value!r} names {method!r}, which is not "
                              f"planned; name one of {', '.join(methods)}.")
        POSITIVE_INT.check("--steps-to-target", int(count))  # a count, as every count is
        for m in [method] if sep else methods:
            if steps.setdefault(m, float(count)) != float(count):
                raise ConfigError(f"--steps-to-target gives {m} {steps[m]:g} and {count} steps; "
                                  "give each method one count.")
    return StepsSource(steps, {m: "--steps-to-target, as given" for m in steps})


def _reached(run: Path, target: float) -> int | None:
    """The first step at which the run's validation loss is at or below `target`."""
    frame = pd.read_parquet(run / "steps.parquet", columns=["step", "val_loss"])
    frame = frame[frame["val_loss"].notna()]
    hit = frame[frame["val_loss"] <= target]
    return None if hit.empty else int(hit["step"].iloc[0])


def _recorded(runs: list[str], target: float | None, model: str,
              methods: list[str]) -> StepsSource:
    """The steps each planned method's recordings took to reach `target`."""
    if target is None or not (math.isfinite(target) and target > 0):
        raise ConfigError("--steps-from needs --target LOSS, a finite validation loss > 0, to "
                          "count the steps to.")
    found: dict[str, list[int]] = {}
    if len(set(map(_same, runs))) < len(runs):
        raise ConfigError(f"--steps-from lists a run twice ({' '.join(runs)}); each recording "
                          "counts once in its method's median.")
    for text in runs:
        run = Path(text)
        config = _config(run, text)
        if config.get("workload") != model:
            raise ConfigError(f"--steps-from {text!r} trained workload "
                              f"{config.get('workload')!r}, not --model {model!r}: its steps "
                              "say nothing of this model; give recordings of the planned model.")
        method = config.get("method")
        if method not in methods:
            raise ConfigError(f"--steps-from {text!r} is a run of {method!r}, which is not "
                              f"planned; plan it or leave the run out.")
        step = _reached(run, target)
        if step is None:
            raise ConfigError(f"--steps-from {text!r} never reaches --target {target:g} "
                              "(its validation loss stays above it); give a target it reaches.")
        found.setdefault(method, []).append(step)
    steps = {m: float(statistics.median(v)) for m, v in found.items()}
    sources = {m: (f"val_loss <= {target:g} first reached at step "
                   f"{'/'.join(map(str, v))} in {len(v)} recording(s), the median; at the "
                   "recordings' own global batch, no loss scaling") for m, v in found.items()}
    return StepsSource(steps, sources)


def _same(text: str) -> Path:
    """A run folder as one path, however it is spelled."""
    return Path(text).resolve()


def _config(run: Path, text: str) -> dict:
    """A --steps-from run's recorded config, once its run.json and steps.parquet are there."""
    if not (run / "run.json").is_file():
        raise ConfigError(f"--steps-from {text!r} is not a run folder (no run.json there).")
    record = RunRecord.load(run, "--steps-from run record")
    if not record.has("steps.parquet"):
        raise ConfigError(f"--steps-from {text!r} is not a finished run: steps.parquet is "
                          "missing.")
    return record.config


def steps_source(given: list[str] | None, runs: list[str] | None, target: float | None,
                 model: str, methods: list[str]) -> StepsSource | None:
    """The stated steps to target (ConfigError, one sentence, on a bad source); None: none."""
    if given and runs:
        raise ConfigError("--steps-to-target and --steps-from both state the steps; give one.")
    if target is not None and not runs:
        raise ConfigError("--target counts steps on recordings; give them as --steps-from RUN.")
    if given:
        return _given(given, methods)
    if runs:
        return _recorded(runs, target, model, methods)
    return None
