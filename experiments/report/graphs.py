"""The decentralized study's figures and summary: loss against graph degree and replica variance.

    flexbench report results/decentralized   # adds these when the sweep has gossip or Ada units

Figures: final val loss against mean graph degree (a), against mean replica variance (b, log x),
and time to target per graph (c, per node count and network point, hsdp-adamw as reference).
The summary section gives Spearman rank correlations of final loss with degree and with
variance over the fixed-graph (gossip) units, per node count and pooled, with a permutation
p-value, and says whether Ada reaches the target before every fixed graph.

DBench's findings read as signs: (1) more connections, better accuracy: rho(loss, degree) < 0;
(2) accuracy is sensitive to the replicas' spread: rho(loss, variance) > 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd

from experiments.scoring import formats, intervals, targets
from flexdemo.methods import RECORDS

__all__ = ["ADAPTIVE", "PERMUTATIONS", "ada_verdicts", "correlations", "graphs_markdown",
           "has_graph_units", "plot_loss_vs_degree", "plot_loss_vs_variance",
           "plot_time_to_target_by_graph", "spearman", "unit_table"]

# The adaptive-graph method (the record that adapts its graph): compared with every fixed graph.
ADAPTIVE = next(m.name for m in RECORDS if m.adapts)
PERMUTATIONS = 10_000  # for the p-values; with a fixed seed, so the summary is reproducible
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*")


def unit_table(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per finished training unit: cluster, graph label, degree, spread, final loss.

    `label` is the gossip graph, or the method's name for units without a fixed one
    (hsdp-adamw, Ada).
    """
    cols = ["unit", "method", "variant", "seed", "nodes", "label", "graph", "graph_degree",
            "replica_variance", "consensus_distance", "final_val_loss"]
    if runs.empty or not set(cols) - {"label"} <= set(runs.columns):
        return pd.DataFrame(columns=cols)  # a sweep scored before these columns existed
    done = runs[(runs["kind"] == "train") & (runs["status"] == "done")]
    per = done.drop_duplicates("unit").copy()
    per["label"] = per["graph"].where(per["graph"].notna(), per["method"])
    return per[cols].reset_index(drop=True)


def has_graph_units(runs: pd.DataFrame) -> bool:
    """Whether the sweep trained any gossip (fixed graph) or Ada unit."""
    if "graph" not in runs.columns:
        return False
    return bool(runs["graph"].notna().any() or (runs["method"] == ADAPTIVE).any())


def spearman(x: Iterable[float], y: Iterable[float]) -> float:
    """Spearman's rank correlation (Pearson on average ranks; no scipy); NaN under 3 points."""
    frame = _finite(x, y)
    if len(frame) < 3:
        return math.nan
    ranks = frame.rank()
    if ranks["x"].nunique() < 2 or ranks["y"].nunique() < 2:
        return math.nan  # a constant has no rank order to correlate
    return float(ranks["x"].corr(ranks["y"]))


def permutation_p(x: Iterable[float], y: Iterable[float], *, seed: int = 0) -> float:
    """Two-sided p-value of Spearman's rho: how often shuffled y correlates at least as strongly."""
    frame = _finite(x, y)
    rho = spearman(frame["x"], frame["y"])
    if math.isnan(rho):
        return math.nan
    rx = frame["x"].rank().to_numpy()
    ry = frame["y"].rank().to_numpy()
    rng = np.random.default_rng(seed)
    shuffled = np.array([rng.permutation(ry) for _ in range(PERMUTATIONS)])
    rx_c = rx - rx.mean()
    sy = shuffled - shuffled.mean(axis=1, keepdims=True)
    rhos = sy @ rx_c / (np.linalg.norm(sy, axis=1) * np.linalg.norm(rx_c))
    # +1 on both sides: the observed order is one of the permutations (never a p of 0).
    return float((np.sum(np.abs(rhos) >= abs(rho) - 1e-12) + 1) / (PERMUTATIONS + 1))


def _finite(x: Iterable[float], y: Iterable[float]) -> pd.DataFrame:
    frame = pd.DataFrame({"x": list(x), "y": list(y)}, dtype=float)
    return frame.replace([np.inf, -np.inf], np.nan).dropna()


def correlations(units: pd.DataFrame) -> pd.DataFrame:
    """Spearman rho (and p) of final loss with degree and with variance, per node count + pooled.

    Over the fixed-graph units only: hsdp-adamw has no graph and Ada's is the thing compared.
    """
    fixed = units[units["graph"].notna()]
    groups = [(f"{n} nodes", fixed[fixed["nodes"] == n]) for n in sorted(fixed["nodes"].unique())]
    if len(groups) > 1:
        groups.append(("pooled", fixed))
    rows = []
    for name, part in groups:
        row: dict[str, Any] = {"units": name, "n": len(part)}
        for col, key in (("graph_degree", "degree"), ("replica_variance", "variance")):
            row[f"rho(loss, {key})"] = spearman(part["final_val_loss"], part[col])
            row[f"p ({key})"] = permutation_p(part["final_val_loss"], part[col])
        rows.append(row)
    return pd.DataFrame(rows)


def ada_verdicts(runs: pd.DataFrame) -> list[str]:
    """One line per network point and node count: does Ada reach the target before every graph?"""
    sim = runs[(runs["source"] == "sim") & runs["on_grid"] & (runs["kind"] == "train")]
    if not (sim["method"] == ADAPTIVE).any():
        return [f"No `{ADAPTIVE}` units in this sweep: nothing to compare with the fixed graphs."]
    lines = []
    medians = sim.groupby(["network", "nodes", "method", "graph"], dropna=False,
                          sort=False)["time_to_target_s"].median().reset_index()
    for (network, nodes), part in medians.groupby(["network", "nodes"], sort=False):
        ada = part.loc[part["method"] == ADAPTIVE, "time_to_target_s"]
        fixed = part[part["graph"].notna()]
        if ada.empty or fixed.empty:
            continue
        mine = float(ada.iloc[0])
        best = fixed.loc[fixed["time_to_target_s"].idxmin()]
        wins = math.isfinite(mine) and bool((fixed["time_to_target_s"] > mine).all())
        here = sim[(sim["network"] == network) & (sim["nodes"] == nodes)]
        lines.append(f"- {network}, {nodes} nodes: {'yes' if wins else 'no'} — "
                     f"{ADAPTIVE} {formats.format_seconds(mine)}, best fixed graph "
                     f"{best['graph']} {formats.format_seconds(float(best['time_to_target_s']))}"
                     f"{_against_best(here, best['graph'])}")
    return lines


def _against_best(here: pd.DataFrame, graph: str) -> str:
    """' (ring's time / ada's: 1.10× [1.02–1.19], tie)': the margin over seeds and its verdict."""
    if "seed" not in here.columns:
        return ""

    def by_seed(part: pd.DataFrame) -> dict:
        return dict(zip(part["seed"], part["time_to_target_s"].astype(float), strict=True))

    ada = here[here["method"] == ADAPTIVE]
    fixed = here[(here["graph"] == graph) & (here["method"] != ADAPTIVE)]
    margin, _ = intervals.ratio_interval(by_seed(fixed), by_seed(ada))
    if math.isnan(margin.median):
        return ""
    verdict = intervals.separation(intervals.median_interval(ada["time_to_target_s"]),
                                   intervals.median_interval(fixed["time_to_target_s"]), margin)
    return (f" ({graph}'s time / {ADAPTIVE}'s: {formats.format_speedup_interval(margin)}, "
            f"{verdict})")


def graphs_markdown(runs: pd.DataFrame) -> str:
    """The summary.md section: per-graph table, rank correlations and Ada's verdicts."""
    units = unit_table(runs)
    if units.empty:
        return ""
    table = units.groupby(["nodes", "label"], sort=False).agg(
        degree=("graph_degree", "median"), variance=("replica_variance", "median"),
        consensus=("consensus_distance", "median"), loss=("final_val_loss", "median"),
        seeds=("seed", "nunique"),
    )
    table.index = [f"{n} nodes · {label}" for n, label in table.index]
    shown = pd.DataFrame({
        "mean degree": table["degree"].map(lambda v: "-" if pd.isna(v) else f"{v:.2f}"),
        "mean replica variance": table["variance"].map(lambda v: f"{v:.2e}"),
        "mean consensus distance": table["consensus"].map(lambda v: f"{v:.2e}"),
        "final val_loss (median)": table["loss"].map(lambda v: f"{v:.4f}"),
        "seeds": table["seeds"],
    }, index=table.index)
    corr = correlations(units)
    if corr.empty:  # e.g. an Ada-only sweep: no fixed graphs to correlate over
        corr_text = "No gossip units finished: nothing to correlate.\n"
    else:
        corr_shown = corr.set_index("units").map(
            lambda v: "-" if pd.isna(v) else f"{v:.3g}" if isinstance(v, float) else str(v))
        corr_text = formats.markdown_table(corr_shown, index_name="units") + "\n"
    return "\n".join([
        "### Decentralized: graphs, replica spread and final loss\n",
        "Means over each run's steps (degree: peers a node mixes with, its graph's) and "
        "evaluations (replica variance, consensus distance); medians over seeds. hsdp-adamw "
        "all-reduces every step "
        "(no graph; variance 0).\n",
        formats.markdown_table(shown, index_name="cluster · graph") + "\n",
        "### Rank correlations (Spearman, over the gossip units)\n",
        "DBench's findings hold here if rho(loss, degree) < 0 (more peers, lower loss) and "
        f"rho(loss, variance) > 0. p: two-sided permutation test ({PERMUTATIONS:,} shuffles). "
        "Pooled mixes node counts, whose losses differ by cluster size.\n",
        corr_text,
        f"### Does {ADAPTIVE} reach the target before every fixed graph?\n",
        *ada_verdicts(runs),
        "",
    ])


def _node_colours(nodes: Iterable[int]) -> dict[int, Any]:
    import seaborn as sns

    counts = sorted(set(int(n) for n in nodes))
    return dict(zip(counts, sns.color_palette("deep", max(len(counts), 1)), strict=False))


def _graph_markers(labels: Iterable[str]) -> dict[str, str]:
    names = list(dict.fromkeys(labels))
    return {name: MARKERS[i % len(MARKERS)] for i, name in enumerate(names)}


def plot_loss_vs_degree(res) -> Any:
    """Final val loss against mean graph degree: colour = node count, marker = graph.

    hsdp-adamw has no graph; its all-reduce reaches every node, so it is drawn at n - 1.
    """
    import matplotlib.pyplot as plt

    units = unit_table(res.runs)
    units = units.assign(x=units["graph_degree"].where(
        units["graph_degree"].notna() | (units["method"] != targets.BASELINE),
        units["nodes"] - 1))
    return _scatter(units, "x", res, _graph_markers(units["label"]),
                    xlabel="mean graph degree (peers per step)",
                    title="final val loss against graph degree (hsdp-adamw drawn at n−1)",
                    log_x=False, plt=plt)


def plot_loss_vs_variance(res) -> Any:
    """Final val loss against mean replica variance (log x): colour = node count, marker = graph.

    hsdp-adamw's replicas are identical (variance 0, off a log axis): dashed lines instead.
    """
    import matplotlib.pyplot as plt

    units = unit_table(res.runs)
    # Markers from every unit, so that a graph has the same marker as in the degree figure.
    fig = _scatter(units[units["method"] != targets.BASELINE], "replica_variance", res,
                   _graph_markers(units["label"]), xlabel="mean replica variance (log)",
                   log_x=True, plt=plt,
                   title="final val loss against replica variance (dashed: hsdp-adamw)")
    ax = fig.axes[0]
    colours = _node_colours(units["nodes"])
    base = units[units["method"] == targets.BASELINE]
    for nodes, part in base.groupby("nodes"):
        ax.axhline(float(part["final_val_loss"].median()), color=colours[int(nodes)],
                   linestyle="--", linewidth=1)
    return fig


def _scatter(units: pd.DataFrame, x: str, res, markers: dict[str, str], *, xlabel: str,
             title: str, log_x: bool, plt) -> Any:
    """One point per unit; a legend of node counts (colour) and graphs (marker)."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import NullFormatter

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    colours = _node_colours(units["nodes"])
    shown = units[units[x].map(lambda v: pd.notna(v) and math.isfinite(v) and (v > 0 or not
                                                                                log_x))]
    for _, row in shown.iterrows():
        ax.scatter(row[x], row["final_val_loss"], color=colours[int(row["nodes"])],
                   marker=markers[row["label"]], s=40, alpha=0.85, edgecolor="black",
                   linewidth=0.4, zorder=3)
    if log_x and len(shown):
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels collide on short ranges
    handles = [Line2D([], [], linestyle="", marker="o", color=c, label=f"{n} nodes")
               for n, c in colours.items()]
    handles += [Line2D([], [], linestyle="", marker=m, color="grey", label=g)
                for g, m in markers.items() if g in set(shown["label"])]
    if handles:
        ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if shown.empty:
        ax.text(0.5, 0.5, "no finished units", ha="center", va="center", transform=ax.transAxes,
                color="grey")
    ax.set(xlabel=xlabel, ylabel="final validation loss", title=f"{res.name}: {title}")
    ax.title.set_fontsize(9)
    fig.tight_layout()
    return fig


def plot_time_to_target_by_graph(res) -> Any:
    """Time to target per graph: bars per node count, one panel per network point.

    Median over seeds, whiskers min-max; a graph that never reaches the target gets no bar and
    an 'n/r' mark. hsdp-adamw stands first as the reference.
    """
    import matplotlib.pyplot as plt

    sim = res.runs[(res.runs["source"] == "sim") & res.runs["on_grid"]
                   & (res.runs["kind"] == "train")]
    sim = sim.assign(label=sim["graph"].where(sim["graph"].notna(), sim["method"]))
    labels = list(dict.fromkeys([*([targets.BASELINE] if (sim["method"] == targets.BASELINE)
                                   .any() else []), *sim["label"]]))
    nets = sim.drop_duplicates("network").sort_values(["inter_lat_s", "inter_bw_bps"])
    colours = _node_colours(sim["nodes"])
    fig, axes = plt.subplots(1, max(len(nets), 1), figsize=(4.8 * max(len(nets), 1), 4.0),
                             squeeze=False)  # own y per panel: bandwidths differ tenfold
    width = 0.8 / max(len(colours), 1)
    for ax, network in zip(axes[0], nets["network"], strict=False):
        here = sim[sim["network"] == network]
        stats = here.groupby(["label", "nodes"])["time_to_target_s"].agg(
            ["median", "min", "max"])
        for k, (nodes, colour) in enumerate(colours.items()):
            for i, label in enumerate(labels):
                if (label, nodes) not in stats.index:
                    continue
                med, low, high = stats.loc[(label, nodes)]
                x = i + (k - (len(colours) - 1) / 2) * width
                if not math.isfinite(med):
                    ax.text(x, 0, "n/r", ha="center", va="bottom", fontsize=6, color=colour,
                            rotation=90, transform=ax.get_xaxis_transform())
                    continue
                top = high - med if math.isfinite(high) else 0.0
                ax.bar(x, med, width=width, color=colour, yerr=[[med - low], [top]],
                       capsize=2, edgecolor="black" if label == targets.BASELINE else "none")
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=7)
        ax.set_title(network, fontsize=9)
    axes[0][0].set_ylabel("time to target (s, simulated)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, label=f"{n} nodes")
               for n, c in colours.items()]
    if handles:
        fig.legend(handles=handles, loc="center right", fontsize=8)
    fig.suptitle(f"{res.name}: time to the target of each node count (median, min–max over "
                 f"seeds; n/r = not reached)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.88, 1))
    return fig
