"""Figures and tables from a sweep's results folder (also what the notebooks call).

    flexbench report results/quick    # -> results/quick/figures/*.{png,svg} and summary.md
    flexbench report results/quick --same-compute all   # every table on one compute basis

Figures: validation loss against (simulated or measured) wall-clock per method at every network
point; time-to-target against bandwidth (log-log) with the speed-up over hsdp-adamw; bytes per
step per method; bytes against loss; who is first in each bandwidth x latency cell, and where
each method overtakes hsdp-adamw (`crossover.py`; `experiments.replay.on_basis` replays units
between grid points).
A sweep with gossip or Ada units adds `graphs.py`'s
loss against graph degree and replica variance, and time to target per graph. Every file is
written atomically.

The simulated times are the sweep's: each unit on its own recorded compute. `--same-compute
method|all` replays them on one basis first, as `flexbench compare --same-compute` does
(`experiments.replay.on_basis`), and says so in summary.md, in the figures' titles, in
speedups.parquet's `same_compute` column and in compute_basis.json.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from experiments.errors import ConfigError
from experiments.io import check_output_folder, read_json, run_digest, write_atomic
from experiments.replay import on_basis
from experiments.replay.target import SAME_COMPUTE
from experiments.report import crossover, graphs, metrics, step_times, validation
from experiments.run_record import RunRecord
from experiments.scoring import intervals, targets
from experiments.scoring.speedups import speedups, sweep_speedups

__all__ = [
    "Results",
    "configure",
    "load_results",
    "results_folder",
    "main",
    "frontier_table",
    "plot_bytes_per_step",
    "plot_frontier",
    "plot_loss_vs_time",
    "plot_time_to_target",
    "write_report",
]

FIGURE_FORMATS = ("png", "svg")


@dataclass
class Results:
    """A sweep's runs.parquet, steps.parquet and sweep.json, read once."""

    path: Path
    runs: pd.DataFrame
    steps: pd.DataFrame
    meta: dict[str, Any] = field(default_factory=dict)
    basis: str | None = None
    """The compute basis the simulated rows were replayed on, for figure titles (None: each
    unit's own recorded compute, as the sweep scored them)."""

    def titled(self, text: str) -> str:
        """A figure's title with the compute basis, where not the units' own."""
        return text if self.basis is None else f"{text}\n{self.basis}"

    @property
    def name(self) -> str:
        """The sweep's name (from sweep.json, else the folder name)."""
        return str(self.meta.get("name", self.path.name))

    @property
    def target(self) -> float:
        """The target val_loss the sweep scored against (NaN if it could not be set)."""
        values = self.runs["target_val_loss"].dropna()
        return float(values.iloc[0]) if len(values) else math.nan

    def targets(self) -> list[float]:
        """Every distinct finite target (one per baseline cluster when the sweep has several)."""
        values = self.runs["target_val_loss"].dropna()
        return [float(v) for v in dict.fromkeys(values) if math.isfinite(v)]

    def variants(self) -> list[str]:
        """Method variants in the order the sweep lists them."""
        return list(dict.fromkeys(self.runs["variant"]))

    def palette(self) -> dict[str, Any]:
        """One colour per variant, the same in every figure."""
        import seaborn as sns

        names = self.variants()
        # tab10 repeats itself past ten variants (a graph study has a dozen); tab20 does not.
        scheme = "tab10" if len(names) <= 10 else "tab20" if len(names) <= 20 else "husl"
        return dict(zip(names, sns.color_palette(scheme, max(len(names), 1)), strict=False))


def results_folder() -> Path:
    """The sweep folder the notebooks read: FLEXBENCH_RESULTS, else the committed quick sweep.

    A relative FLEXBENCH_RESULTS is taken from where the user started Jupyter (the shell's PWD),
    not from notebooks/, where the kernel runs.
    """
    given = os.environ.get("FLEXBENCH_RESULTS")
    if not given:
        return Path(__file__).resolve().parents[2] / "results" / "quick"
    path = Path(given).expanduser()
    return path if path.is_absolute() else Path(os.environ.get("PWD", os.getcwd())) / path


def load_results(path: Path | str) -> Results:
    """Read a sweep folder; ValueError with what to run if it holds no results."""
    path = Path(path)
    runs_path = path / "runs.parquet"
    if not runs_path.is_file():
        raise ValueError(f"{str(path)!r} holds no runs.parquet; run `flexbench sweep` first.")
    # A sweep writes all three; a folder missing one is half there, and its figures would be
    # drawn without a word from what is left.
    for name in ("steps.parquet", "sweep.json"):
        if not (path / name).is_file():
            raise ValueError(f"{str(path)!r} holds runs.parquet but no {name}; run `flexbench "
                             "sweep CONFIG --out` on this folder again to re-score it.")
    runs = _parquet(runs_path)
    steps = _parquet(path / "steps.parquet")
    meta = read_json(path / "sweep.json", "sweep record")
    _check_units(path, runs)
    return Results(path, runs, steps, meta if isinstance(meta, dict) else {})


def _parquet(path: Path) -> pd.DataFrame:
    """A sweep's table (ValueError naming the file when it cannot be read)."""
    try:
        return pd.read_parquet(path)
    except (OSError, ValueError) as err:  # pyarrow's errors derive from these two
        raise ValueError(f"cannot read {str(path)!r}: {err}") from None


def _check_units(path: Path, runs: pd.DataFrame) -> None:
    """Refuse results whose runs are gone, half there or changed since the sweep scored them
    (ValueError).

    Older sweeps have no `run_digest` column: their runs are checked to exist, whole, only.
    """
    scored = runs[runs["status"] == "done"]
    digests = scored.get("run_digest", pd.Series(None, index=scored.index))
    for unit, digest in dict(zip(scored["unit"], digests, strict=True)).items():
        run_dir = path / "units" / str(unit)
        missing = RunRecord.missing_file(run_dir)
        if missing not in (None, "run.json"):  # half there: a sweep would refuse it too
            raise ValueError(f"unit {unit!r} of {str(path)!r} lacks its {missing} since the "
                             f"sweep scored it; remove {str(run_dir)!r} and run `flexbench "
                             "sweep CONFIG --out` on this folder again to train and re-score it.")
        if missing == "run.json":
            problem = "is gone from units/"
        elif isinstance(digest, str) and run_digest(run_dir) != digest:
            problem = "has changed"
        else:
            continue
        raise ValueError(f"unit {unit!r} of {str(path)!r} {problem} since the sweep scored it; "
                         "run `flexbench sweep CONFIG --out` on this folder again to re-score.")


def _networks(
    runs: pd.DataFrame, *, grid_only: bool = True
) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """Bandwidths and latencies (of the grid, or of every timed point), sorted by value."""
    sim = runs[(runs["source"] == "sim") & (runs["on_grid"] | (not grid_only))]
    bws = sim.drop_duplicates("inter_bw").sort_values("inter_bw_bps")
    lats = sim.drop_duplicates("inter_lat").sort_values("inter_lat_s")
    return (list(zip(bws["inter_bw"], bws["inter_bw_bps"], strict=True)),
            list(zip(lats["inter_lat"], lats["inter_lat_s"], strict=True)))


def plot_loss_vs_time(res: Results):
    """Validation loss against wall-clock, one panel per bandwidth (columns) and latency (rows)."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    bws, lats = _networks(res.runs, grid_only=False)
    evals = res.steps.dropna(subset=["val_loss"]) if len(res.steps) else res.steps
    fig, axes = plt.subplots(len(lats), len(bws), figsize=(3.6 * len(bws), 3.0 * len(lats)),
                             sharey=True, squeeze=False)
    palette = res.palette()
    for i, (lat, _) in enumerate(lats):
        for j, (bw, _) in enumerate(bws):
            ax = axes[i][j]
            here = evals[(evals["inter_bw"] == bw) & (evals["inter_lat"] == lat)] \
                if len(evals) else evals
            _loss_panel(ax, here, res, palette, legend=(i == 0 and j == len(bws) - 1))
            _log_x(ax)
            ax.set_title(f"{bw} / {lat}", fontsize=9)
            ax.set_xlabel("wall-clock (s)" if i == len(lats) - 1 else "")
            ax.set_ylabel("validation loss" if j == 0 else "")
    legend_ax = axes[0][len(bws) - 1]
    if legend_ax.get_legend() is not None:
        sns.move_legend(legend_ax, "upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8,
                        title=None)
    fig.suptitle(res.titled(f"{res.name}: validation loss vs wall-clock (simulated; dashed = "
                            f"measured, dotted = target)"), fontsize=10)
    fig.tight_layout()
    return fig


def _loss_panel(ax, here: pd.DataFrame, res: Results, palette: dict, legend: bool) -> None:
    """One network's panel: simulated curves, measured ones dashed, the targets dotted."""
    import seaborn as sns

    sim = here[here["source"] == "sim"] if len(here) else here
    if len(sim):
        sns.lineplot(data=sim, x="time_s", y="val_loss", hue="variant", units="seed",
                     estimator=None, palette=palette, ax=ax, linewidth=1.2, alpha=0.85,
                     legend=legend)
    measured = here[here["source"] == "measured"] if len(here) else here
    for (variant, seed), curve in measured.groupby(["variant", "seed"]) \
            if len(measured) else []:
        ax.plot(curve["time_s"], curve["val_loss"], linestyle="--", marker="o",
                markersize=3, color=palette.get(variant, "black"),
                label=f"{variant} s{seed} measured")
    if not len(here):
        ax.text(0.5, 0.5, "not timed here", ha="center", va="center",
                transform=ax.transAxes, color="grey")
    for target in res.targets():
        ax.axhline(target, color="grey", linewidth=0.8, linestyle=":")


def plot_time_to_target(res: Results):
    """Time-to-target vs bandwidth (log-log, top) and speed-up over hsdp-adamw (bottom)."""
    import matplotlib.pyplot as plt

    _, lats = _networks(res.runs)
    sim = res.runs[(res.runs["source"] == "sim") & res.runs["on_grid"]]
    table = speedups(sim, by=("network", "inter_bw_bps", "inter_lat"))
    fig, axes = plt.subplots(2, len(lats), figsize=(4.5 * len(lats), 6.5), sharex=True,
                             squeeze=False)
    palette = res.palette()
    for j, (lat, _) in enumerate(lats):
        here = table[table["inter_lat"] == lat]
        for variant, rows in here.groupby("variant", sort=False):
            rows = rows.sort_values("inter_bw_bps")
            x = rows["inter_bw_bps"] * 8  # bits/s reads more naturally on a network axis
            finite = rows["ttt_median_s"].map(math.isfinite)
            low = (rows["ttt_median_s"] - rows["ttt_low_s"]).where(finite, 0)
            high = (rows["ttt_high_s"] - rows["ttt_median_s"]).where(finite, 0)
            high = high.where(high.map(math.isfinite), 0)
            axes[0][j].errorbar(x[finite], rows["ttt_median_s"][finite],
                                yerr=[low[finite], high[finite]], marker="o", capsize=3,
                                color=palette[variant], label=variant)
            # 0 (never reached) and inf (baseline never reached) have no place on a log axis.
            def shown(col: str, rows: pd.DataFrame = rows) -> pd.Series:
                return rows[col].where(rows[col].map(lambda v: 0 < v < math.inf))

            axes[1][j].plot(x, shown("speedup_median"), marker="o", color=palette[variant],
                            label=variant)
            axes[1][j].fill_between(x, shown("speedup_low"), shown("speedup_high"),
                                    color=palette[variant], alpha=0.15)
        axes[0][j].set(title=f"latency {lat}", ylabel="time to target (s)" if j == 0 else "")
        axes[1][j].axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
        axes[1][j].set(xlabel="inter-node bandwidth (bit/s)",
                       ylabel=f"speed-up vs {targets.BASELINE}" if j == 0 else "")
        for ax in (axes[0][j], axes[1][j]):
            _log_x(ax)
            _log_y_plain(ax)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="center right", fontsize=8)
    kinds = set(table["ttt_interval"]) | set(table["speedup_interval"])
    bracket = ("95% bootstrap interval" if kinds == {"bootstrap"} else
               "min–max (2 seeds: a range, not an interval)" if "bootstrap" not in kinds else
               "interval from 3 seeds, range below")
    if intervals.SAMPLES_COLUMN in sim:
        bracket += ", widened by step-time variation"
    fig.suptitle(res.titled(f"{res.name}: time to val_loss {metrics.target_text(res.runs)} "
                            f"(median over seeds, {bracket}; speed-up paired by seed; not "
                            "reached = not drawn)"), fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.85, 1))
    return fig


def _log_x(ax) -> None:
    """Log x axis with labels on decades only (minor labels collide on short ranges)."""
    from matplotlib.ticker import NullFormatter

    if not _has_positive_data(ax):
        return  # nothing finite to draw (e.g. no run reached the target): keep a linear axis
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())


def _has_positive_data(ax) -> bool:
    """Whether the axes hold any finite positive point a log scale could show."""
    import numpy as np

    for line in ax.get_lines():
        if line.get_transform() is not ax.transData:
            continue  # reference lines (axhline) span the axes, they are not data
        x, y = (np.asarray(v, dtype=float) for v in line.get_data())
        ok = np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)
        if ok.any():
            return True
    return False


def _log_y_plain(ax) -> None:
    """Log y axis labelled 1, 2, 5, 10, ... in plain numbers (ratios and seconds read better)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    if not _has_positive_data(ax):
        return
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def plot_bytes_per_step(res: Results):
    """Inter-node and intra-node bytes per step (per node) for every method variant."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    done = res.runs[(res.runs["status"] == "done") & (res.runs["kind"] == "train")]
    per = done.drop_duplicates(subset=["unit"])
    long = per.melt(id_vars=["variant", "seed"],
                    value_vars=["inter_bytes_per_step", "intra_bytes_per_step"],
                    var_name="link", value_name="bytes")
    long["link"] = long["link"].map({"inter_bytes_per_step": "inter-node",
                                     "intra_bytes_per_step": "intra-node"})
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(res.variants())), 3.8))
    if len(long):
        sns.barplot(data=long, x="variant", y="bytes", hue="link", ax=ax,
                    order=[v for v in res.variants() if v in set(long["variant"])],
                    estimator="median", errorbar=("pi", 100))
        ax.set_yscale("log")
        sns.move_legend(ax, "upper left", bbox_to_anchor=(1.01, 1.0), title=None)
    ax.set(xlabel="", ylabel="bytes per step per node",
           title=f"{res.name}: communication per optimizer step")
    ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    return fig


def frontier_table(res: Results) -> pd.DataFrame:
    """Per trained variant: median inter-node bytes per step and final val_loss over seeds."""
    done = res.runs[(res.runs["status"] == "done") & (res.runs["kind"] == "train")]
    per = done.drop_duplicates(subset=["unit"])
    table = per.groupby("variant", sort=False).agg(
        method=("method", "first"),
        inter_bytes_per_step=("inter_bytes_per_step", "median"),
        final_val_loss=("final_val_loss", "median"),
        seeds=("seed", "nunique"),
    ).reset_index()
    table["pareto"] = metrics.pareto_front(table["inter_bytes_per_step"],
                                           table["final_val_loss"])
    return table


def plot_frontier(res: Results):
    """Inter-node bytes per step (log x) against final val_loss; the Pareto front is marked."""
    import matplotlib.pyplot as plt

    table = frontier_table(res)
    fig, ax = plt.subplots(figsize=(7.0, 4.6))
    methods = list(dict.fromkeys(table["method"]))
    # tab10 repeats itself past ten methods (zip would drop the rest); tab20 does not.
    colours = dict(zip(methods, plt.get_cmap("tab10" if len(methods) <= 10 else "tab20").colors,
                       strict=False))
    for _, row in table.iterrows():
        # A method that sends nothing still gets a place on a log axis: one byte.
        x = max(row["inter_bytes_per_step"], 1.0)
        ax.scatter(x, row["final_val_loss"], s=60 if row["pareto"] else 25,
                   color=colours[row["method"]], edgecolor="black" if row["pareto"] else "none",
                   zorder=3, label=row["method"])
        # "flexdemo[chunking=flat,topk=4]" -> "flexdemo[flat,4]": the legend names the knobs.
        label = re.sub(r"\w+=", "", row["variant"])
        ax.annotate(label, (x, row["final_val_loss"]), fontsize=6,
                    xytext=(3, 3), textcoords="offset points")
    front = table[table["pareto"]].sort_values("inter_bytes_per_step")
    if len(front):
        ax.step(front["inter_bytes_per_step"].clip(lower=1.0), front["final_val_loss"],
                where="post", color="black", linewidth=1, zorder=2)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=False))
    ax.legend(unique.values(), unique.keys(), fontsize=7, loc="lower left")
    ax.set_xscale("log")
    knobs = sorted({k for v in table["variant"] for k in re.findall(r"(\w+)=", v)})
    if knobs:
        ax.text(0.99, 0.99, "labels: [" + ", ".join(knobs) + "]", transform=ax.transAxes,
                ha="right", va="top", fontsize=7)
    ax.set(xlabel="inter-node bytes per step per node (log)", ylabel="final validation loss",
           title=f"{res.name}: bytes against loss (Pareto front in black)")
    fig.tight_layout()
    return fig


def write_report(path: Path | str, *, step_noise: bool = False,
                 same_compute: str | None = None) -> list[Path]:
    """Write every figure (PNG and SVG) into <path>/figures, the tables into summary.md, and
    speedups.parquet again from runs.parquet.

    `step_noise` widens every time-to-target bracket, and the tie/clear verdicts with it, by
    each unit's recorded step-time variation (`step_times`); speedups.parquet stays over seeds.
    `same_compute` (method or all) replays the simulated rows on that compute basis first
    (`experiments.replay.on_basis`), as `flexbench compare --same-compute` does, and writes the
    basis to compute_basis.json; without it a compute_basis.json of an earlier report is
    removed.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    res = load_results(path)
    _check_outputs(res.path)
    if "own_compute_final_s" not in res.runs and (res.runs["source"] == "measured").any():
        # scored before it was recorded
        res.runs = validation.own_compute(res.path, res.runs, on_basis.run_axis)
    recorded, onto = res.runs, None
    if same_compute is not None:  # every replay before anything is written: refusals first
        onto = on_basis.replay_on_basis(str(res.path), res.runs, res.steps, same_compute,
                                        noise=step_noise)
        res.runs, res.steps, res.basis = onto.runs, onto.steps, onto.label
    elif step_noise:  # checked before anything is written: a unit without compute_s is refused
        res.runs = step_times.with_step_noise(res.runs, res.steps)
    basis_line = metrics.COMPUTE_BASIS if onto is None else onto.summary_line
    written: list[Path] = []
    figures = {"loss_vs_wallclock": plot_loss_vs_time, "time_to_target": plot_time_to_target,
               "bytes_per_step": plot_bytes_per_step, "frontier": plot_frontier}
    unit_time = (functools.partial(on_basis.recorded_unit_time, res.path) if onto is None
                 else onto.unit_time)
    crossings = crossover.crossover_table(res, unit_time)
    figures["crossover_map"] = lambda res: crossover.plot_crossover_map(res, crossings)
    has_graphs = graphs.has_graph_units(res.runs)
    if has_graphs:
        figures.update(loss_vs_degree=graphs.plot_loss_vs_degree,
                       loss_vs_variance=graphs.plot_loss_vs_variance,
                       time_to_target_by_graph=graphs.plot_time_to_target_by_graph)
    for name, draw in figures.items():
        fig = draw(res)
        for fmt in FIGURE_FORMATS:
            buf = io.BytesIO()
            fig.savefig(buf, format=fmt, dpi=130, bbox_inches="tight")
            target = res.path / "figures" / f"{name}.{fmt}"
            write_atomic(target, buf.getvalue())
            written.append(target)
        plt.close(fig)
    summary = res.path / "summary.md"
    table_text = metrics.summary_markdown(res.runs, basis=basis_line,
                                          recorded=None if onto is None else recorded)
    text = f"## Sweep `{res.name}`\n\n{table_text}"
    text += (f"\n### Where each method overtakes {targets.BASELINE} (crossover bandwidth)\n\n"
             f"{basis_line}\n\n{crossover.crossover_markdown(crossings)}\n")
    if has_graphs:
        text += "\n" + graphs.graphs_markdown(res.runs)
    write_atomic(summary, text)
    written.append(summary)
    # speedups.parquet is derived from runs.parquet alone: rewritten so that an older sweep's
    # file carries the current columns (paired speed-ups with their brackets).
    buffer = io.BytesIO()
    seeds_only = res.runs.drop(columns=intervals.SAMPLES_COLUMN, errors="ignore")
    table = sweep_speedups(seeds_only)
    if onto is not None:  # the table says which basis its times stand on
        table = table.assign(same_compute=onto.mode)
    table.to_parquet(buffer, index=False)
    write_atomic(res.path / "speedups.parquet", buffer.getvalue())
    written.append(res.path / "speedups.parquet")
    basis_file = res.path / on_basis.BASIS_FILE
    if onto is not None:
        write_atomic(basis_file, json.dumps(onto.record(), indent=2) + "\n")
        written.append(basis_file)
    else:  # an earlier --same-compute report's basis would describe tables no longer there
        basis_file.unlink(missing_ok=True)
    return written


def _check_outputs(folder: Path) -> None:
    """What the report writes into the sweep's folder can be written (ConfigError, one
    sentence, before any figure is drawn): the folder, figures/ in it, and its files."""
    check_output_folder(folder, what="the sweep folder the report writes into",
                        must_be_empty=False)
    check_output_folder(folder / "figures", what="the report's figures folder",
                        must_be_empty=False)
    for name in ("summary.md", "speedups.parquet", on_basis.BASIS_FILE):
        if (folder / name).is_dir():
            raise ConfigError(f"the report's file {str(folder / name)!r} is a folder; move it "
                              "away to write the report.")


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of `flexbench report`."""
    parser.add_argument("results", type=Path, help="a sweep's output folder, e.g. results/quick")
    parser.add_argument("--step-noise", action="store_true",
                        help="widen each time-to-target bracket (and decide tie or clear on it) "
                        "by the units' recorded step-time variation (a block bootstrap of each "
                        "unit's compute per step, as `flexbench compare --step-noise`)")
    parser.add_argument("--same-compute", choices=SAME_COMPUTE, default=None,
                        help="replay every simulated row on one compute basis, as `flexbench "
                        "compare --same-compute`: each method's median recorded compute per "
                        "step over its seeds (method), or one for every unit (all); default: "
                        "each unit's own, as the sweep scored it")


def main(args: argparse.Namespace) -> int:
    """Run `flexbench report`."""
    for path in write_report(args.results, step_noise=args.step_noise,
                             same_compute=args.same_compute):
        print(path)
    return 0
