"""A finished run as a replay reads it: its record, RunConfig, steps and trace, read once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from experiments.config import RunConfig
from experiments.run_record import RunRecord

__all__ = ["RecordedRun", "read_loss_run", "read_run"]


@dataclass(frozen=True)
class RecordedRun:
    """A finished run as a replay reads it, once: run.json, its RunConfig, steps and trace."""

    path: Path
    meta: dict
    """run.json as written."""
    config: RunConfig
    """run.json's config rebuilt as a RunConfig (settings this version lacks are left out)."""
    steps: pd.DataFrame
    """steps.parquet."""
    trace: pd.DataFrame | None
    """trace.parquet as read (the model validates it and keeps the training phase); None for a
    run read as a loss curve only (`read_loss_run`)."""


def read_run(run_dir: Path | str) -> RecordedRun:
    """A finished run's run.json, steps.parquet and trace.parquet (ConfigError if one is bad)."""
    record = RunRecord.load(run_dir)
    trace = record.trace()  # an emulated run has none: refused first, in its own words
    return RecordedRun(record.path, record.meta, record.run_config(), record.steps(), trace)


def read_loss_run(run_dir: Path | str) -> RecordedRun:
    """A finished run's run.json and steps.parquet, real or emulated (trace None): a loss curve."""
    record = RunRecord.load(run_dir)
    return RecordedRun(record.path, record.meta, record.run_config(), record.steps(), None)
