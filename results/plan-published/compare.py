"""Print Tables 4 and 1 of arXiv 2501.18512 beside the plans of their inputs (run.sh's CSVs).

Run from the repository root: python results/plan-published/compare.py
Table 4, per model size, method and compute-utilization target: the paper's Gbit/s, the plan's
lowest grid point reaching the target (and its interpolated figure), and how many grid steps
apart they are on the 50-point log grid from 0.1 to 1000 Gbit/s that both use. The variants
(*-after-step: the outer sync posted after the optimizer step; streaming-contiguous: each
fragment one run) are set against the paper's row they vary. Table 1 (the 1B model, hours of
training with unlimited bandwidth and with 1 Gbit/s): the paper's ratio of the two, which is
the compute utilization at 1 Gbit/s, beside the plan's at 1 Gbit/s.

Two readings of Table 4: as printed (a figure is the lowest grid point reaching the target)
and one grid step lower (a figure is the highest grid point not yet reaching it, so the lowest
reaching is the next one up). `agreement()` counts the figures within one grid step under
each; `equal_layer_fit()` fits each reading's Data-Parallel and Vanilla DiLoCo figures with a
model of equal layers and prints the bytes that fit as a fraction of the plan's.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

HERE = Path(__file__).resolve().parent
TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)
GRID = (0.1, 1000.0, 50)  # Gbit/s: lowest, highest, points (log-spaced)
BACKWARD = 2 / 3  # the backward's share of a step, as the plans split --step-compute
# A plan's variant, and the paper's row it is set against.
VARIANTS = {"diloco": ["diloco-after-step"],
            "streaming": ["streaming-after-step", "streaming-contiguous"]}


def grid_index(gbit: float) -> float:
    """Position of a rate on the grid (0 at 0.1 Gbit/s, 49 at 1000 Gbit/s)."""
    low, high, points = GRID
    return math.log10(gbit / low) / math.log10(high / low) * (points - 1)


def first_reaching(frame: pd.DataFrame, target: float) -> tuple[float | None, float | None]:
    """(lowest grid point whose CU reaches target, interpolated rate), in Gbit/s."""
    frame = frame.sort_values("inter_bw_bps")
    gbit = frame["inter_bw_bps"].to_numpy() * 8 / 1e9
    cu = frame["compute_utilization"].to_numpy()
    above = [i for i, c in enumerate(cu) if c >= target]
    if not above:
        return None, None
    i = above[0]
    if i == 0:
        return gbit[0], gbit[0]
    share = (target - cu[i - 1]) / (cu[i] - cu[i - 1])
    lo, hi = math.log(gbit[i - 1]), math.log(gbit[i])
    return gbit[i], math.exp(lo + share * (hi - lo))


def paper_index(row: pd.Series, target: float, shift: int) -> int:
    """The grid index of Table 4's lowest point reaching `target` in `row`: its figure's
    (`shift` 0, as printed) or the next one up (`shift` 1, the figure read one step lower)."""
    return round(grid_index(row[f"cu{round(target * 100)}"])) + shift


def grid_point(index: int) -> float:
    """The grid's rate at an index, in Gbit/s."""
    low, high, points = GRID
    return low * (high / low) ** (index / (points - 1))


def main() -> None:
    """Print Table 4 beside the plans, the agreement under both readings, the fit, Table 1."""
    table4()
    agreement()
    equal_layer_fit()
    table1()


def table4() -> None:
    """One markdown table per model size: Gbit/s needed, the paper's beside the plan's."""
    paper = pd.read_csv(HERE / "paper_table4.csv")
    for size, rows in paper.groupby("size", sort=False):
        first = rows.iloc[0]
        print(f"\n{size.upper()} ({first['layers']} layers, step {first['step_time_s']} s): "
              "Gbit/s for a compute utilization of; paper / plan grid point (interpolated) "
              "[grid steps apart]\n")
        print("| method | " + " | ".join(f"{t:.0%}" for t in TARGETS) + " |")
        print("| --- |" + " --- |" * len(TARGETS))
        for _, row in rows.iterrows():
            for name in [row["method"], *VARIANTS.get(row["method"], [])]:
                print(f"| {name} | " + " | ".join(_cells(row, size, name)) + " |")


def _cells(row: pd.Series, size: str, name: str) -> list[str]:
    """The paper's figure beside the plan `name`'s, one cell per target."""
    ours = pd.read_csv(HERE / f"{size}-{name}.csv")
    cells = []
    for target in TARGETS:
        theirs = row[f"cu{round(target * 100)}"]
        point, interpolated = first_reaching(ours, target)
        if point is None:
            cells.append(f"{theirs} / not reached")
            continue
        steps = round(grid_index(point) - grid_index(theirs))
        cells.append(f"{theirs} / {point:.3g} ({interpolated:.3g}) [{steps:+d}]")
    return cells


def steps_apart(shift: int) -> list[tuple[str, str, float, int | None]]:
    """(size, method, target, plan's grid steps above the paper's lowest reaching point) per
    figure of Table 4, None where the plan never reaches the target; `shift` 0 reads a figure
    as printed, 1 as the highest grid point not reaching the target."""
    paper = pd.read_csv(HERE / "paper_table4.csv")
    out = []
    for _, row in paper.iterrows():
        ours = pd.read_csv(HERE / f"{row['size']}-{row['method']}.csv")
        for target in TARGETS:
            point, _ = first_reaching(ours, target)
            theirs = paper_index(row, target, shift)
            steps = None if point is None else round(grid_index(point)) - theirs
            out.append((row["size"], row["method"], target, steps))
    return out


def within_one_step(shift: int) -> int:
    """How many of Table 4's figures the plan lands within one grid step of, read by `shift`."""
    return sum(steps is not None and abs(steps) <= 1 for *_, steps in steps_apart(shift))


def agreement() -> None:
    """The figures within one grid step, and the others, under both readings of Table 4."""
    print("\nTable 4's figures within one grid step of the plan's:")
    for shift, reading in ((0, "as printed"), (1, "one grid step lower")):
        figures = steps_apart(shift)
        others = ", ".join(f"{size} {method} {target:.0%} "
                           f"({'not reached' if steps is None else f'{steps:+d}'})"
                           for size, method, target, steps in figures
                           if steps is None or abs(steps) > 1)
        print(f"- read {reading}: {within_one_step(shift)} of {len(figures)}; "
              f"not: {others or 'none'}")


def equal_layer_cu(gbit: np.ndarray, rate: float, layers: int, step_s: float,
                   period: int) -> np.ndarray:
    """Compute utilization of `period` steps whose one sync of `gbit` is cut into `layers`
    equal shares, each sent on one link after its layer's backward (`BACKWARD` of the step,
    in equal parts), the shares one after another."""
    backward = step_s * BACKWARD / layers
    share = gbit / layers / rate
    exposed = np.maximum(share, layers * share - (layers - 1) * backward)
    return period * step_s / (period * step_s + exposed)


def equal_layer_factors(shift: int) -> tuple[int, int, float, float, list[str]]:
    """Table 4 read by `shift` (as in `steps_apart`): how many of its Data-Parallel and Vanilla
    DiLoCo figures the equal-layer model reproduces at best with one factor on each figure's
    plan's bytes, of how many; the lowest and highest such factor; the figures missed."""
    paper = pd.read_csv(HERE / "paper_table4.csv")
    factors = np.linspace(0.5, 1.5, 100001)
    fits, names = [], []
    for _, row in paper[paper["method"].isin(["data-parallel", "diloco"])].iterrows():
        ours = pd.read_csv(HERE / f"{row['size']}-{row['method']}.csv").iloc[0]
        gbit = factors * ours["bytes_per_node_round"] * 8 / 1e9
        period = int(ours["period_steps"])
        for target in TARGETS:
            index = paper_index(row, target, shift)
            cu = [equal_layer_cu(gbit, grid_point(i), row["layers"], row["step_time_s"], period)
                  for i in (index, index - 1)]
            fits.append((cu[0] >= target) & (cu[1] < target))
            names.append(f"{row['size']} {row['method']} {target:.0%}")
    fits = np.array(fits)
    count = fits.sum(axis=0)
    best = factors[count == count.max()]
    column = int(np.argmax(count))
    missed = [n for n, fit in zip(names, fits[:, column], strict=True) if not fit]
    return int(count.max()), len(names), float(best.min()), float(best.max()), missed


def table1_factors() -> tuple[float, float]:
    """The factors on the plan's 1B bytes that Table 1's Data-Parallel hours at 1 Gbit/s put
    in a step in the equal-layer model, lowest and highest over its token budgets."""
    paper = pd.read_csv(HERE / "paper_table4.csv")
    row = paper[(paper["size"] == "1b") & (paper["method"] == "data-parallel")].iloc[0]
    ours = pd.read_csv(HERE / "1b-data-parallel.csv").iloc[0]
    hours = pd.read_csv(HERE / "paper_table1.csv").query("method == 'data-parallel'")
    exposed = (hours["hours_1gbit"] / hours["hours_unlimited"] - 1) * row["step_time_s"]
    # Network-bound: every layer's share queues behind the one before, so the exposed time
    # is the whole sync less all but one layer's backward.
    gbit = exposed + (row["layers"] - 1) * row["step_time_s"] * BACKWARD / row["layers"]
    fitted = gbit / (ours["bytes_per_node_round"] * 8 / 1e9)
    return float(fitted.min()), float(fitted.max())


def equal_layer_fit() -> None:
    """Print the equal-layer model's fit of Table 4 under both readings, and of Table 1."""
    print("\nEqual layers (each layer's share of the sync sent after its backward, one link): "
          "factors on the plan's bytes that reproduce the most Data-Parallel and Vanilla "
          "DiLoCo figures")
    for shift, reading in ((0, "as printed"), (1, "one grid step lower")):
        count, total, low, high, missed = equal_layer_factors(shift)
        print(f"- read {reading}: {count} of {total} figures at {low:.3f}-{high:.3f} x the "
              f"plan's bytes; not: {', '.join(missed) or 'none'}")
    low, high = table1_factors()
    print(f"- Table 1's 1B Data-Parallel hours at 1 Gbit/s: {low:.3f}-{high:.3f} x the plan's "
          "bytes")


def table1() -> None:
    """The 1B model at 1 Gbit/s: compute utilization, the paper's (from its hours) and ours."""
    paper = pd.read_csv(HERE / "paper_table1.csv")
    print("\n1B at 1 Gbit/s (Table 1): compute utilization = hours with unlimited bandwidth / "
          "hours with 1 Gbit/s; paper per token budget / plan\n")
    print("| method | compute utilization: paper (25B, 100B, 250B tokens) / plan | "
          "time over compute: paper / plan |")
    print("| --- | --- | --- |")
    for method, rows in paper.groupby("method", sort=False):
        ratio = rows["hours_1gbit"] / rows["hours_unlimited"]
        ours = pd.read_csv(HERE / f"1b-{method}-1gbit.csv").iloc[0]
        print(f"| {method} | {', '.join(f'{1 / r:.1%}' for r in ratio)} / "
              f"{ours['compute_utilization']:.1%} | {', '.join(f'{r:.4g}' for r in ratio)} / "
              f"{ours['step_time_s'] / ours['compute_s']:.4g} |")

if __name__ == "__main__":
    main()
