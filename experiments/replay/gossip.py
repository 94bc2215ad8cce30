"""Gossip schedules on a target cluster: the busiest node's peers per round, and per site.

A gossip or Ada step's cost is set by its communication graph rebuilt on the target's nodes
(`netsim.model.simulate(degrees=..., site_rounds=...)`): the busiest node paces its neighbours,
and through them every node of a connected graph; on several sites each site's messages per
round cross its uplink. `schedule` builds both from a graph per step: a recording's (`ada`
records one per step; `gossip` keeps its setting) or a declared method's (the planner). The
replay of a recording and the planner build them here, once.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import pandas as pd

from experiments.errors import ConfigError
from flexdemo.graphs import (
    averages_exactly,
    busiest_degree,
    graph_problem,
    peers,
    period,
    site_count,
    site_layout,
)
from flexdemo.methods import RECORDS
from netsim.sites import SiteRound, Sites, gossip_line, gossip_round

__all__ = ["GOSSIP_METHODS", "Degrees", "SiteRounds", "graphs_of", "recorded_schedule",
           "schedule", "schedule_lines"]

# Methods whose traffic is messages to graph neighbours.
GOSSIP_METHODS = tuple(m.name for m in RECORDS if m.gossips)

# (step, gossip round) -> peers of the busiest node, or that round's messages per site.
Degrees = Callable[[int, int], int]
SiteRounds = Callable[[int, int], SiteRound]


@lru_cache(maxsize=4096)
def _busiest_degree(graph: str, nodes: int, round_: int) -> int:
    """Peers of the busiest node of `graph` on `nodes` nodes at gossip round `round_`."""
    return busiest_degree(graph, nodes, round_ % period(graph, nodes))


def schedule(graph_at: Callable[[int], str], graphs: list[str], nodes: int,
             sites: Sites | None, refusal: str) -> tuple[Degrees, SiteRounds | None]:
    """The busiest node's peers per (step, round) of the graph `graph_at(step)` on `nodes`
    nodes, and on two or more `sites` each site's messages per (step, round) (else None).

    `graphs` are every graph `graph_at` gives; ConfigError (one sentence, `refusal` its head) if
    one cannot be built on `nodes` nodes."""
    for graph in graphs:
        problem = graph_problem(graph, nodes)
        if problem is not None:
            raise ConfigError(f"{refusal}: {problem}")

    def degrees(step: int, round_: int) -> int:
        return _busiest_degree(graph_at(step), nodes, round_)

    if sites is None or len(sites.sites) < 2:
        return degrees, None

    @lru_cache(maxsize=4096)
    def on_sites(graph: str, round_: int) -> SiteRound:
        return gossip_round(sites, lambda node: peers(graph, sites.nodes, node, round_))

    def site_rounds(step: int, round_: int) -> SiteRound:
        graph = graph_at(step)
        return on_sites(graph, round_ % period(graph, sites.nodes))

    return degrees, site_rounds


def schedule_lines(method: str, graphs: list[str], nodes: int) -> list[str]:
    """One line per graph: how it stands on `nodes` nodes (degree, period, sites)."""
    lines = []
    for graph in graphs:
        if averages_exactly(graph, nodes):
            lines.append(f"{method} graph {graph} rebuilt on {nodes} nodes: the exact average, "
                         "one all-reduce a round (as the run takes it), no messages")
            continue
        found = sorted({_busiest_degree(graph, nodes, r) for r in range(period(graph, nodes))})
        extra = (f" (one new peer a round, {period(graph, nodes)}-round period)"
                 if graph == "one-peer-exponential" else "")
        if site_count(graph) is not None:
            shape = f"{site_layout(graph, nodes)}; the busiest node, a gateway, paces a round"
        else:
            shape = f"degree {'/'.join(str(d) for d in found)}{extra}"
        lines.append(f"{method} graph {graph} rebuilt on {nodes} nodes: {shape}")
    return lines


def graphs_of(meta: dict, steps: pd.DataFrame) -> tuple[Callable[[int], str], list[str]]:
    """A gossip run's graph per step (steps.parquet's `graph` column where recorded, else the
    run's `graph` setting), and the graphs used."""
    default = meta["config"].get("graph") or "ring"
    by_step: dict[int, str] = {}
    if "graph" in steps.columns:
        by_step = {int(step): str(graph) for step, graph in zip(steps["step"], steps["graph"],
                                                                 strict=True)
                   if isinstance(graph, str) and graph}
    used = sorted(set(by_step.values()) | ({default} if len(by_step) < len(steps) else set()))
    return (lambda step: by_step.get(step, default)), used


def recorded_schedule(meta: dict, steps: pd.DataFrame, nodes: int, sites: Sites | None,
                      ) -> tuple[Degrees | None, SiteRounds | None, list[str]]:
    """A recorded gossip run's graph rebuilt on the target: its `schedule` and the lines that
    describe it; (None, None, []) for runs of other methods."""
    method = meta["config"].get("method")
    if method not in GOSSIP_METHODS:
        return None, None, []
    graph_at, used = graphs_of(meta, steps)
    degrees, site_rounds = schedule(graph_at, used, nodes, sites,
                                    f"cannot rebuild the {method} run's graph on --nodes {nodes}")
    lines = schedule_lines(method, used, nodes)
    if site_rounds is not None:
        lines += _site_line(graph_at, steps, sites, site_rounds)
    return degrees, site_rounds, lines


def _site_line(graph_at: Callable[[int], str], steps: pd.DataFrame, sites: Sites,
               site_rounds: SiteRounds) -> list[str]:
    """The line of a round's messages across sites: the first step whose graph sends any (an
    exact average, the complete graph's, is one all-reduce and sends none)."""
    messaging = [int(step) for step in steps["step"]
                 if not averages_exactly(graph_at(int(step)), sites.nodes)] or [1]
    if averages_exactly(graph_at(messaging[0]), sites.nodes):
        return []
    return [gossip_line(sites, site_rounds(messaging[0], 0))]
