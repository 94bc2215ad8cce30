"""Print Tables 4 and 1 of arXiv 2501.18512 beside the plans of their inputs (run.sh's CSVs).

Run from the repository root: python results/plan-published/compare.py
Table 4, per model size, method and compute-utilization target: the paper's Gbit/s, the plan's
lowest grid point reaching the target (and its interpolated figure), and how many grid steps
apart they are on the 50-point log grid from 0.1 to 1000 Gbit/s that both use. The variants
(*-after-step: the outer sync posted after the optimizer step; streaming-contiguous: each
fragment one run) are set against the paper's row they vary. Table 1 (the 1B model, hours of
training with unlimited bandwidth and with 1 Gbit/s): the paper's ratio of the two, which is
the compute utilization at 1 Gbit/s, beside the plan's at 1 Gbit/s.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

HERE = Path(__file__).resolve().parent
TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)
GRID = (0.1, 1000.0, 50)  # Gbit/s: lowest, highest, points (log-spaced)
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


def main() -> None:
    """Print one markdown table per model size of Table 4, then Table 1's."""
    table4()
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
