"""`compare --step-noise`: closed forms of the step-time block bootstrap and of widening."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from experiments.scoring import intervals, step_noise


def _axis(compute: np.ndarray, comm_s: float) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A replay's frame (compute + a fixed link time per step) and an evaluation every 5 steps
    whose loss falls by 0.1 each: the target 2.0 is first met at step 49."""
    steps = np.arange(compute.size)
    frame = pd.DataFrame({"step": steps, "time_s": np.cumsum(compute + comm_s)})
    evals = frame[frame["step"] % 5 == 4]
    points = evals.assign(val_loss=3.0 - 0.1 * (evals["step"] + 1) / 5)
    return frame, points[["step", "val_loss", "time_s"]]


def test_a_block_as_long_as_the_recording_draws_it_unchanged() -> None:
    values = np.arange(30.0)
    drawn = step_noise.block_resample(values, 30, 30, np.random.default_rng(1), 5)
    assert (drawn == values).all()
    short = step_noise.block_resample(values, 7, 3, np.random.default_rng(1), 50)
    assert short.shape == (50, 7)
    # Each block is 3 consecutive recorded steps.
    assert (np.diff(short[:, :3], axis=1) == 1).all()
    assert (np.diff(short[:, 3:6], axis=1) == 1).all()


def test_constant_compute_gives_no_spread() -> None:
    frame, points = _axis(np.full(100, 0.2), 0.05)
    samples = step_noise.time_to_target_samples(frame, points, 2.0, np.full(100, 0.2), 1.0,
                                                name="r")
    assert samples == pytest.approx(np.full(step_noise.RESAMPLES, 50 * 0.25), rel=1e-12)


def test_resampled_times_have_the_closed_form_mean_and_spread() -> None:
    # i.i.d. compute: a sum of k block-drawn steps has mean k x mean and sd sigma x sqrt(k).
    compute = 0.2 + 0.03 * np.random.default_rng(7).standard_normal(400)
    frame, points = _axis(compute, 0.05)
    k = 50  # steps 0..49, the step evaluated at the target
    scale = 0.5
    samples = step_noise.time_to_target_samples(frame, points, 2.0, compute, scale, name="r",
                                                resamples=4000, block=1)
    recorded = float(frame["time_s"].iloc[k - 1])
    mean = recorded + scale * (k * compute.mean() - compute[:k].sum())
    sigma = scale * compute.std() * math.sqrt(k)
    assert samples.mean() == pytest.approx(mean, abs=0.1 * sigma)
    assert samples.std() == pytest.approx(sigma, rel=0.06)
    blocks = step_noise.time_to_target_samples(frame, points, 2.0, compute, scale, name="r",
                                               resamples=4000)
    assert blocks.std() == pytest.approx(sigma, rel=0.15)  # blocks of i.i.d. steps: the same


def test_a_run_that_never_reaches_the_target_is_inf_in_every_resample() -> None:
    compute = np.linspace(0.1, 0.3, 100)
    frame, points = _axis(compute, 0.0)
    assert np.isinf(step_noise.time_to_target_samples(frame, points, 0.5, compute, 1.0,
                                                      name="r")).all()


def test_widened_holds_the_seed_bracket_and_the_resampled_one() -> None:
    samples = [np.linspace(9.0, 11.0, 401)]
    one = intervals.widened(intervals.median_interval([10.0]), samples)
    assert (one.kind, one.median) == ("resampled", 10.0)
    assert (one.low, one.high) == pytest.approx((9.05, 10.95))  # 2.5% and 97.5% of the samples
    assert "step-time resamples" in intervals.interval_note({one.kind})
    two = intervals.widened(intervals.median_interval([10.0, 12.0]),
                            [np.linspace(9.0, 11.0, 401), np.linspace(11.5, 12.5, 401)])
    assert (two.kind, two.low, two.high) == ("range", pytest.approx(9.05), pytest.approx(12.475))
    five = [np.full(50, t) for t in (10.0, 11.0, 12.0, 13.0, 14.0)]
    seeds = intervals.median_interval([10.0, 11.0, 12.0, 13.0, 14.0])
    same = intervals.widened(seeds, five)  # no step-time spread: the seed interval itself
    assert (same.low, same.high, same.kind) == (seeds.low, seeds.high, "bootstrap")
    noisy = intervals.widened(seeds, [s + np.linspace(-3, 3, 50) for s in five])
    assert noisy.low < seeds.low and noisy.high > seeds.high and noisy.median == seeds.median
