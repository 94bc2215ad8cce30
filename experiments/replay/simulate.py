"""`flexbench simulate`: replay a run's communication trace on another network with netsim's model.

    flexbench simulate runs/flex --inter-bw 1Gbit --inter-lat 20ms --out sim.csv
    flexbench simulate runs/flex --inter-bw 10Gbit --nodes 64 --gpus-per-node 8 --steps 100 \\
        --compute-scale 0.05 --out h100.csv
    flexbench simulate runs/flex --inter-bw 1Gbit --node-link 1=100Mbit,20ms --out slow-site.csv
    flexbench simulate runs/flex --topology experiments/topologies/sites.toml --gpus-per-node 8 \\
        --compute-scale 0.05 --out sites.csv

`--topology F.toml` replays on sites (netsim.sites: nodes, a shared uplink and downlink per
site, links inside, RTTs between sites) instead of --inter-bw/--inter-lat/--node-link; the node
count is the file's, and collectives across sites run hierarchically (the assumption printed).

For synchronous schemes the loss at step t does not depend on the network, so the run's loss
curve placed on the simulated time axis predicts the time to reach a target loss.

At another node count or global batch the loss curve is stated, never assumed silently
(`experiments.replay.loss_curve`): `--loss-from RUN` (repeatable) adds recordings at other node
counts and the one with the nearest global batch gives the curve (the trace is always the first
run's); `--loss-scaling none|linear-to-critical-batch:B` maps it to the target's global batch;
the rule is printed beside the time to target and stored in OUT's sidecar `.loss.json`. Gossip
and Ada replays at a node count no recording has give no time to target.

    flexbench simulate runs/ada-4 --loss-from runs/ada-8 --nodes 8 --inter-bw 1Gbit --out a.csv
    flexbench simulate runs/flex --nodes 64 --loss-scaling linear-to-critical-batch:512 \
        --inter-bw 10Gbit --out f.csv

Another --gpus-per-node re-shards the run's payloads (experiments.replay.reshard); declared
compute (--compute-scale, --step-compute, or a GPU's --compute-profile from `flexbench
profile-compute`, which sets each step phase's compute to its measured seconds) prices the
intra-node collectives on an NVLink-class link unless told otherwise (--intra, --intra-bw,
--intra-lat); the output then says per part (compute, intra-node, inter-node) what was measured
and what modeled. `--overlap fsdp2` (the default with declared compute, when the recording marks
FSDP2's units) replays each unit's gradient reduce alongside the next unit's backward, as a
GPU's communication streams run it; `--overlap recorded` keeps the trace's order (serial on CPU
gloo).

Gossip runs (method gossip, or ada, whose graph steps.parquet records per step) are replayed on
their communication graph rebuilt at the target node count: each node exchanges with its
neighbours there, so a step costs what the graph's degree costs, whatever the node count. A site
graph (sites:S) is rebuilt on S sites of the target's nodes, the busiest node (a gateway) setting
each round's pace; with --topology its sites must be the file's (RunConfig.topology()).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import pandas as pd

from experiments.config import (
    RunConfig,
    check_algorithm_on_sites,
    is_plugin,
    load_site_file,
    method_of,
)
from experiments.errors import ConfigError
from experiments.io import check_output_file, is_emulated, read_json, write_atomic
from experiments.replay.compute_profile import ComputeProfile, load_profile
from experiments.replay.compute_rules import ShapeCompute, shape_compute
from experiments.replay.fsdp2_traffic import add_fsdp2_traffic, fsdp2_note
from experiments.replay.loss_curve import (
    LOSS_SCALING_CHOICES,
    LossCurve,
    LossScaling,
    Recording,
    choose_loss_curve,
    parse_loss_scaling,
)
from experiments.replay.reshard import MISSING_INTRA, reshard_trace, run_layout
from experiments.report.metrics import time_to_target
from experiments.values import POSITIVE, POSITIVE_INT
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
from netsim.calibration import Calibration, load_calibration
from netsim.costs import ALGORITHM_CHOICES
from netsim.model import Replay, algorithm_summary, has_backward_marks, has_unit_marks, simulate
from netsim.model.programs import OVERLAPS
from netsim.sites import SiteRound, Sites, gossip_line, gossip_round, hierarchy_line
from netsim.topology import Topology
from netsim.units import format_bandwidth, parse_node_link

log = logging.getLogger(__name__)

MAX_STEPS = 1_000_000  # a replayed step costs ~0.1-1 ms of model time: this is minutes already

__all__ = ["RecordedRun", "ReplaySettings", "add_replay_arguments", "check_replay_arguments",
           "check_loss_from", "configure", "declared_compute_scale", "gossip_degrees",
           "gossip_site_rounds",
           "loss_on_time_axis", "main", "read_loss_run", "read_run",
           "replay_settings", "replay_with",
           "simulate_run"]

# The intra-node link a declared accelerator profile is modeled on when the run set none: the
# RunConfig default, an NVLink-class link (per-GPU bus bandwidth of ~100 GB/s, a few us a message).
GPU_INTRA = (RunConfig.intra_bw, RunConfig.intra_lat)

# Methods whose traffic is messages to graph neighbours.
GOSSIP_METHODS = tuple(m.name for m in RECORDS if m.gossips)


@dataclass(frozen=True)
class RecordedRun:
    """A finished run as a replay reads it, once: run.json, its RunConfig, steps and trace."""

    path: Path
    meta: dict
    """run.json as written."""
    config: RunConfig
    """run.json's config rebuilt as a RunConfig (settings this version lacks are left out)."""
    steps: pd.DataFrame
    """steps.parquet."""
    trace: pd.DataFrame | None
    """trace.parquet as read (the model validates it and keeps the training phase); None for a
    run read as a loss curve only (`read_loss_run`)."""


def read_run(run_dir: Path | str) -> RecordedRun:
    """A finished run's run.json, steps.parquet and trace.parquet (ConfigError if one is bad)."""
    run_dir = Path(run_dir)
    meta = _read(run_dir, "run.json", _read_meta)
    if isinstance(meta, dict) and is_emulated(meta):
        raise ConfigError(f"{str(run_dir)!r} is an emulated run, which measured no step times "
                          "and has no trace to replay; use it as a loss curve (--loss-from) "
                          "beside a real run's trace.")
    steps = _read(run_dir, "steps.parquet", pd.read_parquet)
    if not (run_dir / "trace.parquet").exists():
        raise ConfigError(f"{str(run_dir)!r} has no trace.parquet to replay.")
    trace = _read(run_dir, "trace.parquet", pd.read_parquet)
    return RecordedRun(run_dir, meta, _recorded_config(run_dir, meta), steps, trace)


def read_loss_run(run_dir: Path | str) -> RecordedRun:
    """A finished run's run.json and steps.parquet, real or emulated (trace None): a loss curve."""
    run_dir = Path(run_dir)
    meta = _read(run_dir, "run.json", _read_meta)
    steps = _read(run_dir, "steps.parquet", pd.read_parquet)
    return RecordedRun(run_dir, meta, _recorded_config(run_dir, meta), steps, None)


def _read(run_dir: Path, name: str, reader: Callable[[Path], Any]) -> Any:
    """`reader(run_dir / name)`, a missing or unreadable file as one ConfigError sentence."""
    if not (run_dir / name).is_file():
        raise ConfigError(f"{str(run_dir)!r} is not a finished run: {name} is missing.")
    try:
        return reader(run_dir / name)
    except ConfigError:
        raise
    except (OSError, ValueError) as err:  # pyarrow's errors derive from these two
        raise ConfigError(f"cannot read {str(run_dir / name)!r}: {err}") from None


def _read_meta(path: Path) -> Any:
    """A run.json (a JSON error, or a key given twice, named with the file)."""
    return read_json(path, "run record")


def _recorded_config(run_dir: Path, meta: Any) -> RunConfig:
    """run.json's config as a RunConfig: settings an older version had, and knobs the method
    does not read (older runs listed every knob for every method), are left out."""
    recorded = meta.get("config") if isinstance(meta, dict) else None
    if not isinstance(recorded, dict):
        raise ConfigError(f"{str(run_dir / 'run.json')!r} has no config table; is it a run?")
    names = {f.name for f in dataclasses.fields(RunConfig)}
    try:
        method = recorded.get("method")
        names |= set(method_of(method).takes) if is_plugin(method) else set()  # its own knobs
        return RunConfig.from_stored({k: v for k, v in recorded.items()
                                      if k in names}).check_numbers()
    except ConfigError as err:  # among several runs, which one
        raise ConfigError(f"{str(run_dir / 'run.json')!r}: {err}") from None


@lru_cache(maxsize=4096)
def _busiest_degree(graph: str, nodes: int, round_: int) -> int:
    """Peers of the busiest node of `graph` on `nodes` nodes at gossip round `round_`."""
    # The busiest node paces its neighbours, and through them every node of a connected graph.
    return busiest_degree(graph, nodes, round_ % period(graph, nodes))


def gossip_degrees(
    meta: dict, steps: pd.DataFrame, nodes: int
) -> tuple[Callable[[int, int], int] | None, list[str]]:
    """The gossip graph of a run rebuilt on `nodes` nodes: peers per (step, round), and a summary.

    The graph is the run's `graph` setting, or per step steps.parquet's `graph` column where a
    run recorded one (method ada; empty entries fall back to the setting). (None, []) for runs
    of other methods. ConfigError (one sentence) if a graph cannot be built on `nodes` nodes.
    """
    method = meta["config"].get("method")
    if method not in GOSSIP_METHODS:
        return None, []
    graph_at, used = _graphs_of(meta, steps)
    for graph in used:
        problem = graph_problem(graph, nodes)
        if problem is not None:
            raise ConfigError(f"cannot rebuild the {method} run's graph on --nodes {nodes}: "
                              f"{problem}")

    def degrees(step: int, round_: int) -> int:
        return _busiest_degree(graph_at(step), nodes, round_)

    lines = []
    for graph in used:
        if averages_exactly(graph, nodes):
            lines.append(f"{method} graph {graph} rebuilt on {nodes} nodes: the exact average, "
                         "one all-reduce a round (as the run takes it), no messages")
            continue
        found = sorted({_busiest_degree(graph, nodes, r) for r in range(period(graph, nodes))})
        degree = "/".join(str(d) for d in found)
        extra = (f" (one new peer a round, {period(graph, nodes)}-round period)"
                 if graph == "one-peer-exponential" else "")
        if site_count(graph) is not None:
            degree = f"{site_layout(graph, nodes)}; the busiest node, a gateway, paces a round"
        else:
            degree = f"degree {degree}{extra}"
        lines.append(f"{method} graph {graph} rebuilt on {nodes} nodes: {degree}")
    return degrees, lines


def _graphs_of(meta: dict, steps: pd.DataFrame) -> tuple[Callable[[int], str], list[str]]:
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


def gossip_site_rounds(meta: dict, steps: pd.DataFrame, sites: Sites | None,
                       ) -> tuple[Callable[[int, int], SiteRound] | None, list[str]]:
    """A gossip run's graph rebuilt on several sites' nodes, numbered site by site: each
    site's messages per (step, round), and a line saying so; (None, []) otherwise."""
    if (meta["config"].get("method") not in GOSSIP_METHODS or sites is None
            or len(sites.sites) < 2):
        return None, []
    graph_at, _ = _graphs_of(meta, steps)

    @lru_cache(maxsize=4096)
    def on_sites(graph: str, round_: int) -> SiteRound:
        return gossip_round(sites, lambda node: peers(graph, sites.nodes, node, round_))

    def site_rounds(step: int, round_: int) -> SiteRound:
        graph = graph_at(step)
        return on_sites(graph, round_ % period(graph, sites.nodes))

    # The note's round: the first step's whose graph sends messages (an exact average, the
    # complete graph's, is one all-reduce and sends none).
    messaging = [int(step) for step in steps["step"]
                 if not averages_exactly(graph_at(int(step)), sites.nodes)] or [1]
    if averages_exactly(graph_at(messaging[0]), sites.nodes):
        return site_rounds, []
    return site_rounds, [gossip_line(sites, site_rounds(messaging[0], 0))]


def simulate_run(
    run: RecordedRun | Path | str,
    *,
    steps: int | None = None,
    compute_scale: float = 1.0,
    intra: str = "recorded",
    algorithm: str = "auto",
    calibration: Calibration | None = None,
    overlap: str = "recorded",
    progress: bool = False,
    phase_seconds: tuple[float, float] | None = None,
    phases_at: int | None = None,
    **network: Any,
) -> Replay:
    """A recorded run replayed on another network: its Replay, frame [step, step_time_s, time_s].

    The target is the run's own RunConfig with `network` changed: RunConfig settings such as
    inter_bw and inter_lat (required: the run's own bandwidth may be unset), nodes,
    gpus_per_node, node_links, intra_bw; a None value keeps the run's, so the run's own
    node_links replay unless given. `step` is 1-based like the run's steps.parquet; `steps`
    (simulated steps) defaults to the run's. Intra-node collectives keep their recorded
    durations (real runs never shape them) unless `intra="model"` prices them on the intra link.
    Another gpus_per_node re-shards every sharded payload (experiments.replay.reshard;
    Replay.payload_rules says how), or refuses with a ConfigError where it cannot.
    `algorithm` picks the inter-node collective algorithms (netsim.model.simulate).
    `calibration` (from `flexbench calibrate`) prices every inter-node link at its measured
    goodput and per-message cost, and the note says so. Gossip runs replay their graph rebuilt
    on the target nodes (`gossip_degrees`; Replay.graphs describes it). `overlap` "fsdp2"
    replays FSDP2's per-unit reduce alongside the next unit's backward (netsim.model.simulate);
    a recording without FSDP2 backward marks refuses it with a ConfigError. `progress` shows
    netsim's progress bar over the simulated steps (a long replay on a terminal).
    `phase_seconds` (a ComputeProfile's) sets each step phase's compute (netsim.model.simulate);
    a recording without "backward" marks refuses it with a ConfigError. At another gpus_per_node
    than the compute was measured at (the run's, or `phases_at` for `phase_seconds`), the
    optimizer phase is scaled to the target's shard (experiments.replay.compute_rules);
    Replay.compute_rules says what was assumed.
    """
    run = run if isinstance(run, RecordedRun) else read_run(run)
    target = run.config.replace(**_target_network(network))
    _check_replay(run, target, overlap, phase_seconds)
    topology = target.topology()
    if calibration is not None:
        topology = calibration.topology(topology)
    degrees, graphs = gossip_degrees(run.meta, run.steps, topology.nodes)
    site_rounds, site_lines = gossip_site_rounds(run.meta, run.steps, topology.sites)
    units = _units(run, target)
    trace, rules = _resharded(run, target, units, topology)
    shape = _shape_compute(run, target, units, phase_seconds, phases_at)
    if phase_seconds is not None and shape.phase_scale is not None:
        phase_seconds = tuple(s * f for s, f in zip(phase_seconds, shape.phase_scale, strict=True))
    replay = simulate(
        trace, topology, steps=steps, compute_scale=compute_scale, intra=intra,
        algorithm=algorithm, degrees=degrees,
        payloads=_payload_clause(run, rules), overlap=overlap, progress=progress,
        phase_seconds=phase_seconds,
        phase_scale=shape.phase_scale if phase_seconds is None else None,
        site_rounds=site_rounds,
    )  # fmt: skip
    note = replay.note if calibration is None else f"{replay.note} Links {calibration.describe()}."
    return dataclasses.replace(
        replay, frame=replay.frame.assign(step=range(1, len(replay.frame) + 1)), note=note,
        graphs=tuple(graphs + site_lines) if replay.p2p_degrees else (), payload_rules=rules,
        compute_rules=shape.notes,
    )  # fmt: skip


def _check_replay(run: RecordedRun, target: RunConfig, overlap: str,
                  phase_seconds: tuple[float, float] | None) -> None:
    """ConfigError (one sentence) for a replay the recording cannot answer."""
    if target.inter_bw is None and target.topology_file is None:
        raise ConfigError("a replay needs the target's inter-node bandwidth; give inter_bw "
                          "(--inter-bw), such as 1Gbit.")
    if run.config.nodes == 1 and target.nodes > 1:
        raise ConfigError(f"{str(run.path)!r} was recorded on 1 node: it has no inter-node "
                          f"traffic to replay on {target.nodes} nodes; replay a recording of 2 "
                          "or more nodes.")
    if overlap == "fsdp2" and not has_unit_marks(run.trace):
        raise ConfigError(f"--overlap fsdp2 needs FSDP2 backward marks, and {str(run.path)!r} "
                          f"has none ({_no_marks_reason(run)}); use --overlap recorded.")
    if phase_seconds is not None and not has_backward_marks(run.trace):
        raise ConfigError(f"a compute profile replaces each step phase's compute, and "
                          f"{str(run.path)!r} has no backward marks to split its steps at "
                          "(recorded before runs marked them); record it again.")


def _target_network(network: dict[str, Any]) -> dict[str, Any]:
    """The settings a replay changes: those given; with a site file, no recorded links kept."""
    given = {k: v for k, v in network.items() if v is not None}
    if given.get("inter_bw") is not None and "topology_file" not in given:
        given["topology_file"] = None  # a flat target: a run recorded on sites leaves them
    if given.get("topology_file") is not None:
        # The sites set every link between nodes: the run's own recorded ones are not kept.
        given = {"inter_bw": None, "inter_lat": "0ms", "node_links": [], **given}
    return given


def _no_marks_reason(run: RecordedRun) -> str:
    """Why a recording has no FSDP2 backward marks, in a few words."""
    if not run.config.record.shards:
        return f"{run.config.method} does not shard with FSDP2"
    return "recorded before runs marked them; record it again"


def _payload_clause(run: RecordedRun, rules: tuple[str, ...]) -> str | None:
    """How the replay sized its payloads, for the model's note (None: as recorded, said there)."""
    if not rules:
        return None
    verb = "re-sharded" if run.config.record.shards else "as recorded"
    return f"{verb} ({'; '.join(rules)})"


def _units(run: RecordedRun, target: RunConfig) -> tuple[list, str] | None:
    """The run's FSDP2 layout and its source where the target has other ranks per node (else
    None: nothing is resized)."""
    if target.gpus_per_node == run.config.gpus_per_node or not run.config.record.shards:
        return None
    return run_layout(run.meta, run.config)


def _resharded(run: RecordedRun, target: RunConfig, layout: tuple[list, str] | None,
               topology: Topology) -> tuple[pd.DataFrame, tuple[str, ...]]:
    """The run's trace with its payloads re-sharded for the target's ranks per node, and the
    rules applied (none, and the trace as recorded, when the ranks per node are the run's).

    A recording of one rank per node with FSDP2 marks gets the intra-node traffic of the
    target's shards added first (experiments.replay.fsdp2_traffic), timed on its intra link."""
    g_new = target.gpus_per_node
    if g_new == run.config.gpus_per_node:
        return run.trace, ()
    trace, added = run.trace, None
    if (run.config.gpus_per_node == 1 and layout is not None and has_unit_marks(trace)):
        # Only an explicit nccl run is known to have had nccl's ring reduce-scatter; gloo's is an
        # all-reduce (twice the bytes), the conservative reading of "auto".
        backend = "nccl" if run.config.backend == "nccl" else "gloo"
        trace = add_fsdp2_traffic(trace, layout[0], g_new, topology.intra, backend)
        added = fsdp2_note(g_new, topology.intra)
    resized = reshard_trace(trace, run.config, layout, g_new)
    notes = resized.notes
    if added is not None:
        notes = tuple(note for note in notes if not note.startswith(MISSING_INTRA)) + (added,)
    return resized.trace, notes


def _shape_compute(run: RecordedRun, target: RunConfig, layout: tuple[list, str] | None,
                   phase_seconds: tuple[float, float] | None,
                   phases_at: int | None) -> ShapeCompute:
    """How the compute replayed carries to the target's shape (compute_rules), and why."""
    measured_g = run.config.gpus_per_node
    what = "recorded"
    if phase_seconds is not None:
        measured_g, what = phases_at or target.gpus_per_node, "profiled"
    if layout is None and measured_g != target.gpus_per_node and run.config.record.shards:
        layout = run_layout(run.meta, run.config)
    units = layout[0] if layout is not None else None
    marks = phase_seconds is not None or has_backward_marks(run.trace)
    return shape_compute(run.config, units, measured_g, target, marks, what)


def loss_on_time_axis(steps: pd.DataFrame, frame: pd.DataFrame) -> pd.DataFrame:
    """The run's evaluations with the simulated time at which each step ends (frame: a Replay's)."""
    evals = steps.loc[steps["val_loss"].notna(), ["step", "val_loss"]]
    return evals.merge(frame[["step", "time_s"]], on="step", how="inner")


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of `flexbench simulate`."""
    parser.add_argument("run_dir", help="a folder written by `flexbench run`")
    add_replay_arguments(parser)
    parser.add_argument("--steps", type=POSITIVE_INT.arg,
                        help="steps to simulate (default: the run's; at another shape, as "
                        "many as the loss curve used needs)")
    parser.add_argument("--target", type=POSITIVE.arg,
                        help="target validation loss (default: the final one of the run whose "
                        "loss curve is used)")
    parser.add_argument("--loss-from", action="append", default=None, metavar="RUN",
                        help="another recording of the same method and workload, e.g. at another "
                        "node count; repeatable; the loss curve comes from the run (RUN_DIR "
                        "included) whose global batch is nearest the target's, the trace from "
                        "RUN_DIR")
    parser.add_argument("--out", required=True, help="CSV file for the per-step times")


def add_replay_arguments(parser: argparse.ArgumentParser, *, grid: bool = False) -> None:
    """The target network, cluster, compute and loss-rule flags of a replay (simulate, compare).

    `grid`: --inter-bw and --nodes take one value or several (compare's map over their cells).
    """
    several = {"nargs": "+"} if grid else {}
    parser.add_argument("--inter-bw", **several,
                        help="inter-node bandwidth, e.g. 1Gbit (or --topology)"
                        + ("; several: a map over them" if grid else ""))
    parser.add_argument("--inter-lat", default=None, help="inter-node latency, e.g. 20ms "
                        "(default 0ms)")
    parser.add_argument("--topology", default=None, metavar="FILE",
                        help="a TOML file of sites (uplink, downlink, links inside, RTT matrix; "
                        "experiments/topologies/sites.toml) instead of --inter-bw/--inter-lat/"
                        "--node-link; the node count is the file's")
    parser.add_argument("--nodes", type=POSITIVE_INT.arg, **several,
                        help="nodes to simulate (default: the run's)"
                        + ("; several: a map over them" if grid else ""))
    parser.add_argument("--gpus-per-node", type=POSITIVE_INT.arg,
                        help="ranks per node (default: the run's)")
    speed = parser.add_mutually_exclusive_group()
    speed.add_argument("--compute-scale", type=POSITIVE.arg, default=None,
                       help="multiply recorded compute time (0.05: accelerators 20x faster)")
    speed.add_argument("--step-compute", type=POSITIVE.arg, default=None, metavar="SECONDS",
                       help="compute time per step on the target accelerators")
    speed.add_argument("--compute-profile", default=None, metavar="FILE",
                       help="per-phase compute measured by `flexbench profile-compute` on the "
                       "target's device (same workload, method and batch): forward+backward and "
                       "optimizer each scaled to it; a GPU profile declares GPU-class hardware "
                       "(intra-node links modeled, overlap fsdp2 by default)")
    parser.add_argument("--intra", choices=("recorded", "model"), default=None,
                        help="intra-node collectives: recorded durations, or priced on the "
                        "intra link (default: model when --compute-scale or --step-compute "
                        "declares other hardware, else recorded)")
    parser.add_argument("--intra-bw", default=None,
                        help="modeled intra-node link bandwidth (default: the run's intra_bw, "
                        f"{GPU_INTRA[0]} unless set: NVLink-class)")
    parser.add_argument("--intra-lat", default=None,
                        help=f"modeled intra-node link latency (default: the run's intra_lat, "
                        f"{GPU_INTRA[1]} unless set)")
    parser.add_argument("--overlap", choices=OVERLAPS, default=None,
                        help="FSDP2's per-unit gradient reduce: recorded (the trace's order, "
                        "serial on CPU gloo) or fsdp2 (alongside the next unit's backward, as "
                        "on a GPU's communication streams; needs a recording with FSDP2 "
                        "backward marks); default: fsdp2 when --compute-scale or --step-compute "
                        "declares GPU-class compute and the recording has marks, else recorded")
    parser.add_argument("--algorithm", choices=ALGORITHM_CHOICES, default="auto",
                        help="inter-node collective algorithms: auto picks ring or tree (Bruck "
                        "for all-gathers) by predicted time as NCCL's tuner does; ring or tree "
                        "forces one (default: auto)")
    parser.add_argument("--node-link", action="append", default=None, metavar="NODE=BW[,LAT]",
                        help="give node NODE a link of its own, e.g. 1=100Mbit,20ms (latency "
                        "defaults to --inter-lat); repeatable; replaces the run's own node links, "
                        "which are replayed when none is given")
    parser.add_argument("--calibration", metavar="FILE",
                        help="price links at the goodput and per-message cost measured by "
                        "`flexbench calibrate` (default: the configured rate, no extra cost)")
    parser.add_argument("--loss-scaling", default=None, metavar=LOSS_SCALING_CHOICES,
                        help="rule for the loss per step at another global batch: none (as "
                        "recorded, the default) or linear-to-critical-batch:B (k-times the batch, "
                        "k-times fewer steps, up to batch B; McCandlish et al. 2018); an "
                        "assumption, printed and stored with the replay")


def main(args: argparse.Namespace) -> int:
    """Run `flexbench simulate`."""
    out = _check_arguments(args)
    settings = replay_settings(args)
    run = read_run(args.run_dir)
    if args.topology is not None and args.nodes is None:
        args.nodes = load_site_file(args.topology).nodes
    curve = _loss_curve(args, run, settings.rule)
    sidecar = check_output_file(out.with_suffix(".loss.json"), what="the loss sidecar",
                                reads=[args.run_dir, *(args.loss_from or ())]) \
        if curve.stated else None
    replay, basis = replay_with(
        args, run, settings,
        steps=args.steps if args.steps is not None else curve.steps_needed(), progress=True)
    write_atomic(out, replay.frame.to_csv(index=False))
    _print_replay(args, run, replay, out, settings.calibration)
    for line in basis:
        print(f"  {line}")
    _print_time_to_target(args.target, curve, replay, sidecar)
    return 0


@dataclass(frozen=True)
class ReplaySettings:
    """What a replay's flags load once for every run it replays: loss rule, calibration, profile."""

    rule: LossScaling
    calibration: Calibration | None
    profile: ComputeProfile | None


def replay_settings(args: argparse.Namespace) -> ReplaySettings:
    """The loss rule, calibration and compute profile the flags name (ConfigError if bad)."""
    return ReplaySettings(
        rule=parse_loss_scaling(args.loss_scaling),
        calibration=load_calibration(args.calibration) if args.calibration else None,
        profile=load_profile(args.compute_profile) if args.compute_profile else None,
    )


def replay_with(args: argparse.Namespace, run: RecordedRun, settings: ReplaySettings, *,
                steps: int | None = None, progress: bool = False,
                compute_s: float | None = None) -> tuple[Replay, list[str]]:
    """`run` replayed on the network and hardware the flags describe, and its basis lines.

    The basis lines say per part (compute, intra-node, inter-node, overlap) what was measured
    and what modeled; none when everything is as recorded. `compute_s` (compare's
    --same-compute) rescales the recorded compute so that its median per step is that many
    seconds, on the recording's CPU (no other hardware declared); the caller says so.
    """
    profile = settings.profile
    if profile is not None:
        profile.check_fits(run.config, args.compute_profile)
    declared = declared_compute_scale(args, run.steps)
    scale = declared
    if compute_s is not None:
        scale *= compute_s / float(run.steps["compute_s"].median())
    intra = _intra_mode(args, profile)
    overlap = _overlap_mode(args, run, profile)
    replay = simulate_run(
        run, inter_bw=args.inter_bw, nodes=args.nodes, topology_file=args.topology,
        inter_lat=args.inter_lat or ("0ms" if args.topology is None else None),
        gpus_per_node=args.gpus_per_node, node_links=args.node_link, steps=steps,
        compute_scale=scale, intra=intra, algorithm=args.algorithm,
        calibration=settings.calibration, intra_bw=args.intra_bw, intra_lat=args.intra_lat,
        overlap=overlap, progress=progress,
        phase_seconds=profile.phase_seconds if profile else None,
        phases_at=profile.gpus_per_node if profile else None,
    )  # fmt: skip
    if declared != 1.0:
        # Debug only: the basis lines below print it once per answer, and compare replays
        # every run through here (it once printed this line once per run).
        log.debug("compute scaled by %.4g relative to the recording machine", declared)
    return replay, _basis_lines(args, run, replay, intra, declared, profile)


def _loss_curve(args: argparse.Namespace, run: RecordedRun, rule: LossScaling) -> LossCurve:
    """The loss curve the replay uses among RUN_DIR and the --loss-from recordings."""
    runs = [run, *(read_loss_run(path) for path in args.loss_from or ())]
    return choose_loss_curve(
        [Recording.of(r.path, r.config, r.meta, r.steps) for r in runs],
        nodes=args.nodes or run.config.nodes,
        gpus_per_node=args.gpus_per_node or run.config.gpus_per_node, rule=rule,
    )  # fmt: skip


def _check_arguments(args: argparse.Namespace) -> Path:
    """The --out file, after checking the numeric flags (ConfigError, one sentence)."""
    out = check_output_file(args.out, what="--out", reads=[args.run_dir, *(args.loss_from or ())])
    check_replay_arguments(args)
    check_loss_from(args.loss_from or [], [args.run_dir])
    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {args.steps}.")
    if args.steps is not None and args.steps > MAX_STEPS:
        raise ConfigError(f"--steps {args.steps} is more than a replay runs here (at most "
                          f"{MAX_STEPS:,}: hours of model time); replay fewer steps, the time "
                          "axis grows linearly beyond the recording.")
    return out


def check_loss_from(paths: list[str], replayed: list[Path | str]) -> None:
    """ConfigError for a --loss-from run given twice, or one already replayed (its own curve
    is among the candidates already): a second copy of a curve is no second recording."""
    seen = {Path(p).resolve(): "a run replayed" for p in replayed}
    for path in paths:
        if Path(path).resolve() in seen:
            raise ConfigError(f"--loss-from {path!r} is given already, as "
                              f"{seen[Path(path).resolve()]}; its loss curve is a candidate "
                              "once.")
        seen[Path(path).resolve()] = "--loss-from"


def check_replay_arguments(args: argparse.Namespace) -> None:
    """The replay flags' values, before anything is read or written (ConfigError, one sentence).

    The network strings are parsed here too (as RunConfig parses them, in the same words), so a
    bad one is refused before any run is read."""
    _check_network(args)
    if args.topology is None:
        RunConfig(inter_bw=args.inter_bw, inter_lat=args.inter_lat or "0ms").topology()
    for spec in args.node_link or ():
        parse_node_link(spec)
    if args.target is not None and not (math.isfinite(args.target) and args.target > 0):
        raise ConfigError(f"--target must be a finite loss > 0, got {args.target}.")
    for name in ("nodes", "gpus_per_node"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}.")
    for name in ("compute_scale", "step_compute"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive number, got {value}.")


def _check_network(args: argparse.Namespace) -> None:
    """One target network: --inter-bw (with --inter-lat, --node-link) or --topology."""
    if (args.inter_bw is None) == (args.topology is None):
        raise ConfigError("give the target's network as --inter-bw (with --inter-lat, "
                          "--node-link) or as --topology FILE of sites, one of the two.")
    if args.topology is not None and args.calibration is not None:
        raise ConfigError("--calibration fits flat inter-node links; replaying --topology's "
                          "sites with it is not built (drop one of them).")
    if args.topology is not None and (args.inter_lat is not None or args.node_link):
        flag = "--inter-lat" if args.inter_lat is not None else "--node-link"
        raise ConfigError(f"--topology sets every link between nodes; {flag} has no place "
                          "beside it (drop one of them).")
    check_algorithm_on_sites(args.algorithm, args.topology)


def _declares_hardware(args: argparse.Namespace, profile: ComputeProfile | None = None) -> bool:
    """Whether the flags declare compute other than the recorded CPU's (a GPU's profile does)."""
    return (args.compute_scale is not None or args.step_compute is not None
            or (profile is not None and profile.gpu_class))


def _intra_mode(args: argparse.Namespace, profile: ComputeProfile | None = None) -> str:
    """--intra, or its default: modeled links when the compute is not the recorded CPU's (its
    intra-node traffic, CPU gloo loopback, would otherwise dominate a GPU-class step)."""
    link_given = args.intra_bw is not None or args.intra_lat is not None
    if args.intra == "recorded" and link_given:
        flag = "--intra-bw" if args.intra_bw is not None else "--intra-lat"
        raise ConfigError(f"{flag} prices modeled intra-node links; it has no effect with "
                          "--intra recorded (drop one of them).")
    if args.intra is not None:
        return args.intra
    return "model" if _declares_hardware(args, profile) or link_given else "recorded"


def _overlap_mode(args: argparse.Namespace, run: RecordedRun,
                  profile: ComputeProfile | None = None) -> str:
    """--overlap, or its default: fsdp2 when GPU-class compute is declared and the recording
    marks where FSDP2 units' backward ends; recorded otherwise (the basis lines say why)."""
    if args.overlap is not None:
        return args.overlap
    gpu = _declares_hardware(args, profile)
    return "fsdp2" if gpu and has_unit_marks(run.trace) else "recorded"


def _overlap_line(args: argparse.Namespace, run: RecordedRun, overlap: str,
                  declared: bool) -> str:
    """The basis line naming the overlap mode replayed, and why where it is the default."""
    if overlap == "fsdp2":
        return ("overlap: fsdp2 (modeled): each FSDP2 unit's gradient reduce starts when its "
                "backward ends and runs alongside the next unit's backward, as on a GPU's "
                "communication streams; the optimizer step waits for it; the method's own "
                "exchanges as recorded")
    if args.overlap is None and declared:
        return ("overlap: recorded (serial, as on the recording's CPU gloo), not the GPU-class "
                f"default fsdp2: {str(run.path)!r} has no FSDP2 backward marks "
                f"({_no_marks_reason(run)})")
    return "overlap: recorded (the trace's order: FSDP2's reduce serial, as on CPU gloo)"


def _shows_basis(args: argparse.Namespace, replay: Replay, intra: str) -> bool:
    """Whether any part of the replay is other than as recorded (then each part is named)."""
    return (_declares_hardware(args) or intra == "model" or bool(replay.payload_rules)
            or replay.overlap == "fsdp2" or replay.phases is not None
            or bool(replay.compute_rules))


def _profile_lines(profile: ComputeProfile, replay: Replay) -> list[str]:
    """The compute line of a profiled replay: each phase recorded, profiled, and the caveats."""
    recorded, scales = replay.phases.recorded_s, replay.phases.scales()
    line = (f"compute: {profile.describe()}; the recording's {recorded[0] * 1e3:.4g} ms + "
            f"{recorded[1] * 1e3:.4g} ms per step outside its collectives scaled x{scales[0]:.4g} "
            f"and x{scales[1]:.4g}")
    topology = replay.topology
    caveats = profile.caveats(topology.nodes)
    return [line, *(f"  {caveat}" for caveat in caveats)]


def _compute_line(args: argparse.Namespace, run: RecordedRun, scale: float) -> str:
    """The basis line of declared or recorded compute (a profile's is `_profile_lines`)."""
    recorded = float(run.steps["compute_s"].median())
    if args.step_compute is not None:
        return (f"compute: declared: {args.step_compute:.4g} s per step, x{scale:.4g} of the "
                f"recording's CPU ({recorded:.4g} s per step outside inter-node calls)")
    if args.compute_scale is not None:
        return (f"compute: declared: x{scale:.4g} of the recording's CPU ({recorded:.4g} s per "
                "step outside inter-node calls)")
    return (f"compute: measured on the recording's CPU ({recorded:.4g} s per step outside "
            "inter-node calls)")


def _basis_lines(args: argparse.Namespace, run: RecordedRun, replay: Replay, intra: str,
                 scale: float, profile: ComputeProfile | None = None) -> list[str]:
    """A line per part (compute, intra-node, inter-node, overlap): measured or modeled, on what.

    Empty for a replay that takes compute, intra-node traffic, payloads and order as recorded."""
    if not _shows_basis(args, replay, intra):
        return []
    intra_link = replay.topology.intra
    if replay.topology.accelerators_per_node == 1:
        intra_line = "none (one rank per node: its intra-node collectives are groups of one)"
    elif intra == "model":
        default = (args.intra_bw is None and args.intra_lat is None
                   and (run.config.intra_bw, run.config.intra_lat) == GPU_INTRA)
        intra_line = (f"modeled on {intra_link.bandwidth * 8 / 1e9:.4g} Gbit/s "
                      f"({intra_link.bandwidth / 1e9:.4g} GB/s), {intra_link.latency * 1e6:.3g} us "
                      f"a message{' (NVLink-class default)' if default else ''}")
    else:
        intra_line = "measured: recorded durations (the recording's CPU gloo)"
        if replay.payload_rules and run.config.record.shards:
            # Durations, not bytes, are replayed: the resized intra-node payloads need a link.
            intra_line += (f", as at {run.config.gpus_per_node} ranks per node (--intra model "
                           "prices the re-sharded ones)")
    payloads = "payloads as recorded"
    if replay.payload_rules:
        verb = "re-sharded to" if run.config.record.shards else "as recorded at"
        payloads = f"payloads {verb} {replay.topology.accelerators_per_node} ranks per node (below)"
    lines = _profile_lines(profile, replay) if profile else [_compute_line(args, run, scale)]
    lines += [f"  {rule}" for rule in replay.compute_rules]
    lines += [f"intra-node: {intra_line}",
              f"inter-node: modeled on {_network(args)}; {payloads}"]
    lines += [f"  {rule}" for rule in replay.payload_rules]
    return lines + [_overlap_line(args, run, replay.overlap, _declares_hardware(args, profile))]


def declared_compute_scale(args: argparse.Namespace, steps: pd.DataFrame) -> float:
    """--compute-scale, or --step-compute over the run's median compute per step."""
    if args.step_compute is None:
        return args.compute_scale or 1.0
    recorded = float(steps["compute_s"].median())
    return args.step_compute / recorded if recorded > 0 else 1.0


_LISTED_LINKS = 8  # node links a replay's summary line lists one by one


def _print_replay(args: argparse.Namespace, run: RecordedRun, replay: Replay, out: Path,
                  calibration: Calibration | None) -> None:
    """What was simulated, on which network, and what the model assumed to get there."""
    frame, topology = replay.frame, replay.topology
    links = topology.describe_node_links()
    if len(links) > _LISTED_LINKS:  # 10^4 of them would make a line of 200 kB
        slowest = topology.inter_link()
        links = [*links[:3], f"... {len(links):,} in all, slowest "
                 f"{format_bandwidth(slowest.bandwidth)}, largest latency "
                 f"{slowest.latency * 1e3:g}ms"]
    print(f"simulated {len(frame)} steps of {run.config.method} on "
          f"{topology.nodes} nodes x {topology.accelerators_per_node} "
          f"{'on' if args.topology else 'at'} {_network(args)}"
          f"{' (node links ' + ', '.join(links) + ')' if links else ''}: total "
          f"{frame['time_s'].iloc[-1]:.2f} s, median step "
          f"{frame['step_time_s'].median() * 1e3:.1f} ms -> {out}")
    sites = ([*topology.sites.describe(), hierarchy_line(topology.sites)]
             if topology.sites is not None else [])
    for line in [*sites, *replay.graphs, *algorithm_summary(replay.algorithms)]:
        print(f"  {line}")
    if calibration is not None:
        print(f"  links {calibration.describe()}")
    if replay.note:
        log.info("model: %s", replay.note)


def _network(args: argparse.Namespace) -> str:
    """The target network as the flags gave it, in a few words."""
    if args.topology is not None:
        return f"the sites of {args.topology}"
    return f"{args.inter_bw}, {args.inter_lat or '0ms'}"


def _print_time_to_target(target: float | None, curve: LossCurve, replay: Replay,
                          sidecar: Path | None) -> None:
    """The loss curve on the simulated time axis: when it reaches the target, and which curve.

    A replay at another shape (`curve.stated`) prints where its trace and curve came from, the
    rule beside the time, and stores both in `sidecar`.
    """
    if target is None:
        target = curve.recording.final_val_loss
    if target is not None and isinstance(target, float) and math.isnan(target):
        target = None
    if curve.stated:
        print(f"  {curve.summary()}")
    ttt = None
    if target is None:
        print(f"no time to target: {str(curve.recording.path / 'run.json')!r} records no final "
              "val_loss to take as the target; give --target")
    elif curve.refusal is not None:
        print(f"no time to val_loss <= {target:.4f}: {curve.refusal}")
    else:
        points = curve.on_time_axis(replay.frame)
        ttt = time_to_target(points["time_s"], points["val_loss"], float(target))
        when = "not reached" if math.isinf(ttt) else f"{ttt:.2f} s"
        label = f" ({curve.label()})" if curve.stated else ""
        print(f"predicted time to val_loss <= {target:.4f}: {when}{label}")
    if sidecar is not None:
        stored = {**curve.record(), "target_val_loss": target,
                  "time_to_target_s": None if ttt is None or math.isinf(ttt) else ttt,
                  "reached": ttt is not None and math.isfinite(ttt)}
        write_atomic(sidecar, json.dumps(stored, indent=2) + "\n")
        print(f"  loss curve and rule stored in {sidecar}")
