"""Time to target over a run's recorded step-time variation: a block bootstrap of its compute.

A replay lays each step's recorded compute (scaled) on the time axis in the order the run
recorded it, so one unlucky stretch of load moves that run's time to target. Here the recorded
compute per step (`steps.parquet` `compute_s`, every recorded step: those after the target are
draws of the same machine too) is resampled in blocks of BLOCK_STEPS consecutive
steps (a moving-block bootstrap: a load burst a few steps long stays together) and swapped in
for the recorded sequence: each resample is a time axis the same run could have had. The swap is
additive, step by step: a step's modeled communication stays as replayed and is taken as serial
with its compute (where a replay overlaps them, a slower compute would hide part of the link,
so the bracket is, if anything, too wide). The step at which the target is reached is the
recording's in every resample (the loss curve is not resampled), so only the time moves.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pandas as pd

__all__ = ["BLOCK_STEPS", "RESAMPLES", "block_resample", "note", "time_to_target_samples"]

BLOCK_STEPS = 10
RESAMPLES = 200


def note() -> str:
    """The sentence printed beside a table whose brackets include the step-time variation."""
    return (f"Time-to-target brackets include each run's recorded step-time variation: its "
            f"compute per step resampled in blocks of {BLOCK_STEPS} steps ({RESAMPLES} "
            "resamples, fixed seed per run) and swapped for the recorded sequence, taken as "
            "serial with the modeled communication; speed-ups stay paired over seeds only.")


def block_resample(values: np.ndarray, length: int, block: int,
                   rng: np.random.Generator, resamples: int) -> np.ndarray:
    """(resamples x length) draws of `values` as runs of `block` consecutive entries."""
    n = values.size
    block = max(1, min(block, n))
    blocks = math.ceil(length / block)
    starts = rng.integers(0, n - block + 1, size=(resamples, blocks))
    index = (starts[:, :, None] + np.arange(block)[None, None, :]).reshape(resamples, -1)
    return values[index[:, :length]]


def time_to_target_samples(frame: pd.DataFrame, points: pd.DataFrame, target: float,
                           compute_s: np.ndarray, scale: float, *, name: str,
                           resamples: int = RESAMPLES, block: int = BLOCK_STEPS) -> np.ndarray:
    """A run's time to target under `resamples` block-bootstrapped compute sequences.

    `frame` is the replay's [step, time_s] in step order, `points` its evaluations on that axis
    [step, val_loss, time_s], `compute_s` the recorded compute per step in step order (a replay
    longer than the recording cycles through it, as the model does) and `scale` what the replay
    multiplied it by. `name` (the run's folder) seeds the draws: the same run resamples alike.
    A run that never reaches the target is inf in every resample.
    """
    hit = np.flatnonzero(points["val_loss"].to_numpy(dtype=float) <= target)
    if not hit.size:
        return np.full(resamples, math.inf)
    first = points.iloc[int(hit[0])]
    position = int(np.flatnonzero(frame["step"].to_numpy() == first["step"])[0])
    steps = position + 1  # every step up to and including the one evaluated at the target
    used = compute_s[np.arange(steps) % compute_s.size]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    drawn = block_resample(compute_s, steps, block, rng, resamples)
    return float(first["time_s"]) + scale * (drawn - used[None, :]).sum(axis=1)
