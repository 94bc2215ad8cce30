"""Per-unit columns of runs.parquet: the cluster, the graph and what gossip did to the replicas.

    nodes, gpus_per_node, cluster   the unit's shape ("8x1"), from its config
    graph                 the gossip graph (None for methods that do not gossip over a fixed one)
    graph_degree          peers a node mixes with per step: the mean degree at the unit's node
                          count of the graph each step mixed on (steps' `graph` column,
                          `flexdemo.graphs.mean_degree`; the complete graph's round is one
                          all-reduce, its degree n - 1 all the same); a run without that column
                          counts the sends of trace.parquet (NaN when it sent nothing point to
                          point)
    replica_variance, consensus_distance   mean over the run's evaluations (steps.parquet)
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd

from experiments.sweep.plan import Unit
from flexdemo.methods import RECORDS
from netsim.trace import TRAIN

__all__ = ["GRAPH_METHODS", "SPREAD_COLUMNS", "graph_label", "graphs_degree", "mean_degree",
           "run_columns", "unit_columns"]

# Methods whose `graph` setting says who talks to whom (those that read the graph knob); Ada's
# adaptive graph joins when merged.
GRAPH_METHODS = tuple(m.name for m in RECORDS if "graph" in m.takes)

SPREAD_COLUMNS = ("replica_variance", "consensus_distance")


def graph_label(unit: Unit) -> str | None:
    """The unit's gossip graph, or None when its method has no fixed graph."""
    return unit.config.knob_values()["graph"] if unit.method in GRAPH_METHODS else None


def unit_columns(unit: Unit) -> dict[str, Any]:
    """The columns known from the unit's config alone (also for units that never finished)."""
    return {"nodes": unit.config.nodes, "gpus_per_node": unit.config.gpus_per_node,
            "cluster": unit.cluster, "graph": graph_label(unit), "emulated": unit.emulated,
            "recorded_unit": unit.recorded.id if unit.recorded else None}


def run_columns(run_dir: Path, steps: pd.DataFrame, nodes: int) -> dict[str, float]:
    """The columns measured from a finished run of `nodes` nodes: mean graph degree and mean
    replica spread."""
    degree = graphs_degree(steps, nodes)
    if math.isnan(degree):  # no graph column: an older run, or a method without a graph
        degree = mean_degree(run_dir / "trace.parquet", len(steps))
    out = {"graph_degree": degree}
    for col in SPREAD_COLUMNS:
        values = steps[col].dropna() if col in steps.columns else pd.Series(dtype=float)
        out[col] = float(values.mean()) if len(values) else math.nan
    return out


def graphs_degree(steps: pd.DataFrame, nodes: int) -> float:
    """The mean degree at `nodes` of the graph each step mixed on (steps' `graph`); NaN if none."""
    from flexdemo.graphs import mean_degree as graph_degree

    graphs = steps["graph"].dropna() if "graph" in steps.columns else pd.Series(dtype=str)
    if graphs.empty:
        return math.nan
    degrees = {g: graph_degree(g, nodes) for g in graphs.unique()}
    return float(graphs.map(degrees).mean())


def mean_degree(trace_path: Path, steps: int) -> float:
    """Inter-node sends per rank per training step, over every step and rank; NaN if none.

    Gossip sends once to each peer of the round, so this is the degree of the graph it used,
    averaged over time-varying schedules (and, for Ada, over its adapted graphs). Collectives
    such as all-reduce have no degree and give NaN.
    """
    try:
        trace = pd.read_parquet(trace_path, columns=["rank", "op", "inter", "phase"])
    except (OSError, ValueError, KeyError):  # older or hand-made traces lack these columns
        return math.nan
    train = trace[trace["phase"] == TRAIN]
    sends = train[(train["op"] == "send") & train["inter"].astype(bool)]
    ranks = train["rank"].nunique()
    if sends.empty or steps <= 0 or ranks == 0:
        return math.nan
    return len(sends) / (steps * ranks)
