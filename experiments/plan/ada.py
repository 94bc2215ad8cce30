"""Ada in a plan: gossip on each graph of a stated schedule, weighted by its steps there.

Ada picks its graph from the replica spread it measures while training, which a declared model
does not have. The schedule is therefore stated (`--ada-graphs`): the steps spent on each graph
of Ada's ladder, as given (`complete=80,exponential=20`) or as a run of Ada recorded them (the
`graph` column of its steps.parquet, real or emulated, on as many replicas as the plan's). Each
graph is planned as Ada runs on it (`experiments.plan.synth.AdaOnGraph`: gossip's messages plus
Ada's measurement every `ada_every` rounds); a step's time and bytes are the means weighted by
the steps, the memory the largest graph's. Moving between graphs costs nothing more: Ada's rule
reads a measurement every replica holds alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from experiments.errors import ConfigError
from experiments.plan.plan import MethodPlan
from experiments.plan.synth import AdaOnGraph
from experiments.run_record import RunRecord
from experiments.values import POSITIVE_INT
from flexdemo.graphs import graph_ladder
from flexdemo.knobs import AdaKnobs

__all__ = ["GraphSchedule", "graph_schedule", "plan_ada"]


@dataclass(frozen=True)
class GraphSchedule:
    """Steps Ada spends on each graph, and where the figures come from."""

    steps: dict[str, int]
    source: str

    def line(self) -> str:
        """The assumption printed with Ada's figures."""
        total = sum(self.steps.values())
        parts = ", ".join(f"{graph} {count} ({count / total:.0%})"
                          for graph, count in self.steps.items())
        return (f"ada: steps on each graph {parts}, from {self.source}; step time and bytes "
                "are those graphs' plans weighted by their steps, memory the largest of them; "
                "a change of graph costs nothing more")


def graph_schedule(text: str | None, replicas: int, model: str) -> GraphSchedule:
    """`--ada-graphs`: GRAPH=STEPS[,GRAPH=STEPS...], or the folder of a run of Ada that trained
    --model `model` on `replicas` nodes (ConfigError otherwise)."""
    if text is None:
        raise ConfigError("--method ada picks its graph from the replica spread it measures "
                          "while training, which a declared model does not have; give the "
                          "steps it spends on each graph as --ada-graphs complete=80,"
                          "exponential=20, or a run of ada on as many replicas as its folder "
                          "(--ada-graphs RUN).")
    ladder = graph_ladder(replicas)
    if Path(text).is_dir() or "=" not in text:  # a run's folder name may hold "="
        steps = _recorded(Path(text), replicas, model)
        source = f"the run {text} ({sum(steps.values())} steps)"
    else:
        steps = _given(text)
        source = "--ada-graphs, as given"
    outside = [graph for graph in steps if graph not in ladder]
    if outside:
        raise ConfigError(f"--ada-graphs names {', '.join(outside)}, not on Ada's ladder at "
                          f"{replicas} replicas ({', '.join(ladder) or 'none: one replica'}).")
    return GraphSchedule(steps, source)


def _given(text: str) -> dict[str, int]:
    """GRAPH=STEPS pairs, each graph once, each a whole number of steps >= 1."""
    steps: dict[str, int] = {}
    for part in text.split(","):
        graph, _, count = part.strip().partition("=")
        if not count.isdigit() or int(count) < 1 or not graph:
            raise ConfigError(f"--ada-graphs {text!r}: {part.strip()!r} must be GRAPH=STEPS, "
                              "with a whole number of steps >= 1.")
        if graph in steps:
            raise ConfigError(f"--ada-graphs {text!r} names {graph} twice.")
        steps[graph] = POSITIVE_INT.check(f"--ada-graphs {graph}", int(count))
    return steps


def _recorded(run: Path, replicas: int, model: str) -> dict[str, int]:
    """The steps a run of Ada spent on each graph, in the order it first took them."""
    meta, table = run / "run.json", run / "steps.parquet"
    if not (meta.is_file() or table.is_file()):
        raise ConfigError(f"--ada-graphs {run} is neither GRAPH=STEPS pairs nor a run folder "
                          "(no run.json and steps.parquet there).")
    missing = next((f.name for f in (meta, table) if not f.is_file()), None)
    if missing is not None:
        raise ConfigError(f"--ada-graphs {run} is not a finished run: {missing} is missing.")
    config = RunRecord.load(run, "--ada-graphs run record").config
    if config.get("method") != "ada":
        raise ConfigError(f"--ada-graphs {run} is a run of {config.get('method')!r}, not ada; "
                          "give a run of ada.")
    if config.get("workload") != model:
        raise ConfigError(f"--ada-graphs {run} trained workload {config.get('workload')!r}, "
                          f"not --model {model!r}: its graphs follow that model's spread; "
                          "state the steps on each graph as GRAPH=STEPS pairs instead.")
    if config.get("nodes") != replicas:
        raise ConfigError(f"--ada-graphs {run} ran on {config.get('nodes')} nodes, and Ada's "
                          f"graphs follow the node count; the plan has {replicas} replicas.")
    steps = pd.read_parquet(table)
    graphs = steps["graph"].dropna() if "graph" in steps.columns else pd.Series([])
    if graphs.empty:
        raise ConfigError(f"--ada-graphs {run} records no graph per step.")
    return {str(graph): int(count) for graph, count in graphs.value_counts(sort=False).items()}


def plan_ada(knobs: AdaKnobs, schedule: GraphSchedule,
             plan_on: Callable[[AdaOnGraph], MethodPlan]) -> MethodPlan:
    """Ada's plan: `plan_on` (the method's plan on one graph) for each graph of `schedule`,
    weighted by the steps it spends there (module docstring)."""
    plans = {graph: plan_on(AdaOnGraph(knobs, graph)) for graph in schedule.steps}
    total = sum(schedule.steps.values())
    shares = {graph: count / total for graph, count in schedule.steps.items()}
    first = next(iter(plans.values()))
    points = []
    for i, point in enumerate(first.points):
        mine = [(shares[g], p.points[i]) for g, p in plans.items()]
        points.append(dataclasses.replace(
            point, step_time_s=sum(w * q.step_time_s for w, q in mine),
            bytes_per_node_step=sum(w * q.bytes_per_node_step for w, q in mine)))
    notes = [schedule.line()]
    for p in plans.values():
        notes += [note for note in p.notes if note not in notes]
    return dataclasses.replace(
        first, points=points, notes=notes,
        memory=max((p.memory for p in plans.values()), key=lambda m: m.total),
        peak_exchange_bytes=max(p.peak_exchange_bytes for p in plans.values()))

