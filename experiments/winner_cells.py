"""The cells of a winner map: per network point, the method first to the target, its margin over
the runner-up and the verdict, a tie hatched. The report's crossover map (bandwidth x latency)
and compare's node map (nodes x bandwidth) draw theirs with `draw_cells`."""

from __future__ import annotations

import re

import pandas as pd

from experiments.scoring import ranking

__all__ = ["draw_cells"]


def draw_cells(ax, first: pd.DataFrame, x: tuple[str, list], y: tuple[str, list],
               palette: dict) -> None:
    """A coloured cell per `ranking.winners` row at (x column's value, y column's value), with
    the winner, its margin over the runner-up and the verdict; a tie hatched. `x` and `y` are
    (column, the values in axis order); a row without a first (nothing timed) stays blank."""
    from matplotlib.patches import Rectangle

    (x_key, xs), (y_key, ys) = x, y
    for _, row in first.iterrows():
        i, j = xs.index(row[x_key]), ys.index(row[y_key])
        if not isinstance(row["first"], str):
            ax.text(i + 0.5, j + 0.5, "no method\ntimed", ha="center", va="center",
                    fontsize=6.5, color="grey")
            continue
        tie = row["verdict"] == "tie"
        ax.add_patch(Rectangle((i, j), 1, 1, facecolor=palette.get(row["first"], "white"),
                               alpha=0.55, hatch="//" if tie else None, edgecolor="white"))
        runner_up = (f"\nvs {_short(row['runner_up'])}" if isinstance(row["runner_up"], str)
                     else "")
        ax.text(i + 0.5, j + 0.5, f"{_short(row['first'])}\n{ranking.margin_text(row)}"
                f"{runner_up}\n{row['verdict']}", ha="center", va="center", fontsize=6.5,
                wrap=True)
    ax.set(xlim=(0, len(xs)), ylim=(0, len(ys)))


def _short(variant: str) -> str:
    """'demo[chunking=flat,topk=4]' -> 'demo[flat,4]': a cell has little room."""
    return re.sub(r"\w+=", "", variant)
