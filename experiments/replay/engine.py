"""The replay library: `replay(recording, target)`, a recorded run on another network or cluster.

    replay(read_run("runs/flex"), ReplayTarget(inter_bw="1Gbit", inter_lat="20ms")).frame

The target (`experiments.replay.target.ReplayTarget`) is the run's own RunConfig with the
settings it names changed: a None keeps the run's, so a run's own node links and latency replay
unless given. Its payloads are re-sharded where the target has other ranks per node
(`experiments.replay.reshard`; Replay.payload_rules says how), or refused with a ConfigError
where they cannot be; a gossip run's graph is rebuilt on the target's nodes
(`experiments.replay.gossip`; Replay.graphs); a calibration prices every inter-node link at its
measured goodput and per-message cost. Declared compute (a scale, seconds per step, or a
profile's seconds per phase) prices intra-node collectives on the intra link and overlaps
FSDP2's reduce with the backward unless the target says otherwise; at another number of ranks
per node than the compute was measured at, the optimizer phase is scaled to the target's shard
(`experiments.replay.compute_rules`; Replay.compute_rules). Replay.basis says per part
(compute, intra-node, inter-node, overlap) what was measured and what modeled.

`flexbench simulate`, `compare`, a sweep's scoring, `report --same-compute` and `validate-sim`
all replay through `replay`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pandas as pd

from experiments.config import RunConfig
from experiments.errors import ConfigError
from experiments.replay.compute_rules import ShapeCompute, shape_compute
from experiments.replay.fsdp2_traffic import add_fsdp2_traffic, fsdp2_note
from experiments.replay.gossip import recorded_schedule
from experiments.replay.recordings import RecordedRun
from experiments.replay.reshard import MISSING_INTRA, reshard_trace, run_layout
from experiments.replay.target import ReplayTarget
from experiments.run_record import RunRecord
from experiments.sizes import Cost, Count, Term, check_work
from netsim.model import Replay, ReplayOptions, has_backward_marks, has_unit_marks, simulate
from netsim.topology import Topology

__all__ = ["GPU_INTRA", "check_replay_size", "loss_on_time_axis", "replay"]

# The intra-node link declared hardware is modeled on when the run set none: the RunConfig
# default, an NVLink-class link (per-GPU bus bandwidth of ~100 GB/s, a few us a message).
GPU_INTRA = (RunConfig.intra_bw, RunConfig.intra_lat)

# What a replay costs per item (measured on 2 cores: 10^7 nodes in 8 s and 140 MB, 10^7 ranks
# a node x 100 steps in 9 s): the bound on the nodes, ranks and steps it is asked for
# (experiments.sizes).
_NODE_BYTES = Cost("a node in the replayed topology", bytes=16)
_NODE = Cost("to replay a node", seconds=8e-7)
_RANK_STEP = Cost("to replay a rank of a node at a step", seconds=9e-9)
_NODE_PAIR = Cost("to rebuild a pair of nodes of the gossip graph", seconds=1e-7)


def replay(run: RecordedRun, target: ReplayTarget, *, steps: int | None = None,
           compute_s: float | None = None, progress: bool = False) -> Replay:
    """`run` replayed on `target`: netsim's Replay (frame [step, step_time_s, time_s], `step`
    1-based as the run's steps.parquet) with its basis lines.

    `steps`: simulated steps (default: the run's). `compute_s` (one basis for several runs:
    `ComputeBasis.same`) rescales the recorded compute so that its median per step is that many
    seconds, on the recording's CPU; the caller says so. `progress`: netsim's progress bar.
    ConfigError (one sentence) for a replay the recording cannot answer.
    """
    compute = target.compute
    if compute.profile is not None:
        compute.profile.check_fits(run.config, compute.profile_file)
    check_replay_size(run, target, steps)
    declared = compute.scale_of(run.steps)
    scale = declared
    if compute_s is not None:
        scale *= compute_s / float(run.steps["compute_s"].median())
    intra = _intra_mode(target)
    overlap = _overlap_mode(target, run)
    model = _simulate(run, target, steps, scale, intra, overlap, progress)
    return dataclasses.replace(model, basis=tuple(_basis_lines(target, run, model, intra,
                                                               declared)))


def check_replay_size(run: RecordedRun, target: ReplayTarget, steps: int | None) -> None:
    """Refuse a replay whose nodes, ranks and steps pass this machine's memory or ten minutes
    (experiments.sizes), before anything of it is built."""
    nodes = Count("--nodes", target.nodes or run.config.nodes, "nodes",
                  given=target.nodes is not None)
    per_node = Count("--gpus-per-node", target.gpus_per_node or run.config.gpus_per_node,
                     "GPUs per node", given=target.gpus_per_node is not None)
    # The steps are the recording's or what a loss curve needs, rarely the user's own --steps:
    # the refusal names a node count the user gave before them.
    replayed = Count("--steps", steps or len(run.steps), "steps", given=False)
    terms = [Term(_NODE_BYTES, (nodes,)), Term(_NODE, (nodes,)),
             Term(_RANK_STEP, (per_node, replayed))]
    if run.config.record.gossips:
        terms.append(Term(_NODE_PAIR, (nodes, nodes)))
    check_work(f"the replay of {run.path}", terms)


def _intra_mode(target: ReplayTarget) -> str:
    """The target's intra rule, or its default: modeled links when the compute is not the
    recorded CPU's (its intra-node traffic, CPU gloo loopback, would otherwise dominate a
    GPU-class step) or an intra link is given."""
    if target.intra is not None:
        return target.intra
    link_given = target.intra_bw is not None or target.intra_lat is not None
    return "model" if target.compute.declares_hardware or link_given else "recorded"


def _overlap_mode(target: ReplayTarget, run: RecordedRun) -> str:
    """The target's overlap, or its default: fsdp2 when GPU-class compute is declared and the
    recording marks where FSDP2 units' backward ends; recorded otherwise."""
    if target.overlap is not None:
        return target.overlap
    gpu = target.compute.declares_hardware
    return "fsdp2" if gpu and has_unit_marks(run.trace) else "recorded"


def _simulate(run: RecordedRun, target: ReplayTarget, steps: int | None, compute_scale: float,
              intra: str, overlap: str, progress: bool) -> Replay:
    """The model's replay of `run` on the target's cluster, payloads and compute carried to it."""
    config = run.config.replace(**_target_network(target))
    phase_seconds = target.compute.phase_seconds
    _check_replay(run, config, overlap, phase_seconds)
    topology = config.topology()
    if target.calibration is not None:
        topology = target.calibration.topology(topology)
    degrees, site_rounds, graphs = recorded_schedule(run.meta, run.steps, topology.nodes,
                                                     topology.sites)
    units = _units(run, config)
    trace, rules = _resharded(run, config, units, topology)
    shape = _shape_compute(run, config, units, phase_seconds, target.compute.measured_at)
    if phase_seconds is not None and shape.phase_scale is not None:
        phase_seconds = tuple(s * f for s, f in zip(phase_seconds, shape.phase_scale, strict=True))
    options = ReplayOptions(
        steps=steps, compute_scale=compute_scale, intra=intra, algorithm=target.algorithm,
        overlap=overlap, degrees=degrees, site_rounds=site_rounds,
        payloads=_payload_clause(run, rules), phase_seconds=phase_seconds,
        phase_scale=shape.phase_scale if phase_seconds is None else None, progress=progress)
    model = simulate(trace, topology, options)
    note = model.note if target.calibration is None else \
        f"{model.note} Links {target.calibration.describe()}."
    return dataclasses.replace(
        model, frame=model.frame.assign(step=range(1, len(model.frame) + 1)), note=note,
        graphs=tuple(graphs) if model.p2p_degrees else (), payload_rules=rules,
        compute_rules=shape.notes,
    )  # fmt: skip


def _target_network(target: ReplayTarget) -> dict[str, Any]:
    """The run settings a target changes: those it gives; with a site file, no recorded links
    kept; a flat target of a run recorded on sites leaves them."""
    given = {
        "inter_bw": target.inter_bw, "inter_lat": target.inter_lat, "nodes": target.nodes,
        "gpus_per_node": target.gpus_per_node, "intra_bw": target.intra_bw,
        "intra_lat": target.intra_lat, "topology_file": target.topology,
        "node_links": None if target.node_links is None else list(target.node_links),
    }
    given = {k: v for k, v in given.items() if v is not None}
    if given.get("inter_bw") is not None and "topology_file" not in given:
        given["topology_file"] = None  # a flat target: a run recorded on sites leaves them
    if given.get("topology_file") is not None:
        # The sites set every link between nodes: the run's own recorded ones are not kept.
        given = {"inter_bw": None, "inter_lat": "0ms", "node_links": [], **given}
    return given


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


def _no_marks_reason(run: RecordedRun) -> str:
    """Why a recording has no FSDP2 backward marks, in a few words."""
    if not run.config.record.shards:
        return f"{run.config.method} does not shard with FSDP2"
    return "recorded before runs marked them; record it again"


def _payload_clause(run: RecordedRun, rules: tuple[str, ...]) -> str | None:
    """How the replay sized its payloads, for the model's note (None: as recorded, said there)."""
    if not rules:
        return None
    verb = "re-sharded" if _shards(run) else "as recorded"
    return f"{verb} ({'; '.join(rules)})"


def _shards(run: RecordedRun) -> bool:
    """Whether the run's payloads are FSDP2 shards (an imported DDP job's are not)."""
    return RunRecord(run.path, run.meta).shards


def _units(run: RecordedRun, target: RunConfig) -> tuple[list, str] | None:
    """The run's FSDP2 layout and its source where the target has other ranks per node (else
    None: nothing is resized)."""
    if target.gpus_per_node == run.config.gpus_per_node or not _shards(run):
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
    if not _shards(run):  # an imported DDP job: every rank holds the whole model
        return run.trace, (f"{str(run.path)!r} shards nothing (DDP: every rank a whole "
                           f"replica): payloads as recorded at {g_new} ranks per node",)
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
    if layout is None and measured_g != target.gpus_per_node and _shards(run):
        layout = run_layout(run.meta, run.config)
    units = layout[0] if layout is not None else None
    marks = phase_seconds is not None or has_backward_marks(run.trace)
    return shape_compute(run.config, units, measured_g, target, marks, what)


def _shows_basis(target: ReplayTarget, model: Replay, intra: str) -> bool:
    """Whether any part of the replay is other than as recorded (then each part is named)."""
    return (target.compute.declares_hardware or intra == "model" or bool(model.payload_rules)
            or model.overlap == "fsdp2" or model.phases is not None
            or bool(model.compute_rules))


def _basis_lines(target: ReplayTarget, run: RecordedRun, model: Replay, intra: str,
                 scale: float) -> list[str]:
    """A line per part (compute, intra-node, inter-node, overlap): measured or modeled, on what.

    Empty for a replay that takes compute, intra-node traffic, payloads and order as recorded."""
    if not _shows_basis(target, model, intra):
        return []
    lines = (_profile_lines(target, model) if target.compute.profile is not None
             else [_compute_line(target, run, scale)])
    lines += [f"  {rule}" for rule in model.compute_rules]
    lines += [f"intra-node: {_intra_line(target, run, model, intra)}",
              f"inter-node: modeled on {target.network}; {_payloads(run, model)}"]
    lines += [f"  {rule}" for rule in model.payload_rules]
    return lines + [_overlap_line(target, run, model.overlap)]


def _intra_line(target: ReplayTarget, run: RecordedRun, model: Replay, intra: str) -> str:
    """The intra-node part of the basis: none, modeled on which link, or as recorded."""
    link = model.topology.intra
    if model.topology.accelerators_per_node == 1:
        return "none (one rank per node: its intra-node collectives are groups of one)"
    if intra == "model":
        default = (target.intra_bw is None and target.intra_lat is None
                   and (run.config.intra_bw, run.config.intra_lat) == GPU_INTRA)
        return (f"modeled on {link.bandwidth * 8 / 1e9:.4g} Gbit/s "
                f"({link.bandwidth / 1e9:.4g} GB/s), {link.latency * 1e6:.3g} us "
                f"a message{' (NVLink-class default)' if default else ''}")
    info = RunRecord(run.path, run.meta).imported
    line = ("measured: recorded durations (the recording's CPU gloo)" if info is None else
            f"measured: traced durations ({info.get('backend')} on {info.get('device')})")
    if model.payload_rules and _shards(run):
        # Durations, not bytes, are replayed: the resized intra-node payloads need a link.
        line += (f", as at {run.config.gpus_per_node} ranks per node (--intra model "
                 "prices the re-sharded ones)")
    return line


def _payloads(run: RecordedRun, model: Replay) -> str:
    """How the inter-node payloads were sized: as recorded, or re-sharded (rules below)."""
    if not model.payload_rules:
        return "payloads as recorded"
    verb = "re-sharded to" if _shards(run) else "as recorded at"
    return f"payloads {verb} {model.topology.accelerators_per_node} ranks per node (below)"


def _profile_lines(target: ReplayTarget, model: Replay) -> list[str]:
    """The compute line of a profiled replay: each phase recorded, profiled, and the caveats."""
    profile = target.compute.profile
    recorded, scales = model.phases.recorded_s, model.phases.scales()
    line = (f"compute: {profile.describe()}; the recording's {recorded[0] * 1e3:.4g} ms + "
            f"{recorded[1] * 1e3:.4g} ms per step outside its collectives scaled x{scales[0]:.4g} "
            f"and x{scales[1]:.4g}")
    caveats = profile.caveats(model.topology.nodes)
    return [line, *(f"  {caveat}" for caveat in caveats)]


def _compute_line(target: ReplayTarget, run: RecordedRun, scale: float) -> str:
    """The basis line of declared or recorded compute (a profile's is `_profile_lines`)."""
    recorded = float(run.steps["compute_s"].median())
    if target.compute.step_s is not None:
        return (f"compute: declared: {target.compute.step_s:.4g} s per step, x{scale:.4g} of "
                f"{_measured_on(run)} ({recorded:.4g} s per step outside inter-node calls)")
    if target.compute.scale is not None:
        return (f"compute: declared: x{scale:.4g} of {_measured_on(run)} ({recorded:.4g} s per "
                "step outside inter-node calls)")
    return (f"compute: measured on {_measured_on(run)} ({recorded:.4g} s per step outside "
            "inter-node calls)")


def _overlap_line(target: ReplayTarget, run: RecordedRun, overlap: str) -> str:
    """The basis line naming the overlap mode replayed, and why where it is the default."""
    if overlap == "fsdp2":
        return ("overlap: fsdp2 (modeled): each FSDP2 unit's gradient reduce starts when its "
                "backward ends and runs alongside the next unit's backward, as on a GPU's "
                "communication streams; the optimizer step waits for it; the method's own "
                "exchanges as recorded")
    if target.overlap is None and target.compute.declares_hardware:
        return ("overlap: recorded (serial, as on the recording's CPU gloo), not the GPU-class "
                f"default fsdp2: {str(run.path)!r} has no FSDP2 backward marks "
                f"({_no_marks_reason(run)})")
    if RunRecord(run.path, run.meta).imported is not None:
        return "overlap: recorded (the trace's order: each collective where the traced job ran it)"
    return "overlap: recorded (the trace's order: FSDP2's reduce serial, as on CPU gloo)"


def _measured_on(run: RecordedRun) -> str:
    """Where the run's compute was measured: the recording's CPU, or an imported trace's device."""
    info = RunRecord(run.path, run.meta).imported
    if info is None:
        return "the recording's CPU"
    return f"the traced {info.get('device', 'device')} ({info.get('timeline', 'its')} timeline)"



def loss_on_time_axis(steps: pd.DataFrame, frame: pd.DataFrame) -> pd.DataFrame:
    """The run's evaluations with the simulated time at which each step ends (frame: a Replay's)."""
    evals = steps.loc[steps["val_loss"].notna(), ["step", "val_loss"]]
    return evals.merge(frame[["step", "time_s"]], on="step", how="inner")
