"""simulate(): check a recorded trace and a target topology, build programs, replay them."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pandas as pd
from tqdm import tqdm

from netsim.costs import ALGORITHM_CHOICES, P2P_OPS
from netsim.model.cluster import Cluster
from netsim.model.options import Degrees, ReplayOptions, SiteRounds
from netsim.model.programs import OVERLAPS, PHASES, Compute, Programs, build_programs, phase_compute
from netsim.sites import gossip_line, hierarchy_line
from netsim.topology import Topology
from netsim.trace import (
    BACKWARD,
    TRAIN,
    UNIT_BACKWARD,
    load_trace,
    validate_trace,
    waited_after_step,
)

__all__ = ["simulate", "simulate_each", "Replay", "ReplayOptions", "AlgorithmChoice",
           "algorithm_summary", "MODEL_NOTE", "P2P_NOTE", "OVERLAP_NOTE", "CARRY_NOTE",
           "has_unit_marks", "has_backward_marks", "PhaseCompute", "compute_phases"]

MODEL_NOTE = (
    "weak scaling: per-step compute and payload sizes as recorded; steps beyond the recording "
    "cycle through recorded steps; replicate groups span all target nodes; compute scaled by "
    "compute_scale / node_speed; jitter enters with its mean (zero)."
)
P2P_NOTE = (
    "point-to-point messages: a round of a node's messages (sent before the first is waited on) "
    "is one exchange with its neighbours, no rendezvous with other nodes: degree messages each "
    "way at once, processor-shared on the NIC's egress and ingress with the node's other "
    "traffic, one latency per message (they overlap). The graph is taken as vertex-transitive "
    "(ring, torus, exponential, complete, one-peer-exponential on a power of two): every node "
    "does the same work at the same time, so one representative node per class stands for all; "
    "on other graphs it carries the busiest node's degree (an upper bound). With several node "
    "classes (node_links, node_speed) the classes meet at every round, so the slowest paces, as "
    "in the steady state of a connected graph."
)

OVERLAP_NOTE = (
    "overlap fsdp2: each FSDP2 unit's gradient reduce-scatter and all-reduce start when its "
    "backward ends (its trace mark) and run on a reduce-scatter and an all-reduce stream, in "
    "issue order, alongside the following backward compute (taken not to slow it); the "
    "optimizer step waits for all of them; the all-gathers inside a node before the backward's "
    "end run one at a time, each after the one before it (FSDP2's all-gather stream); the "
    "methods' own exchanges keep their recorded order."
)

CARRY_NOTE = (
    "ops waited on after their step (an exchange overlapped with later steps' compute, as "
    "flexdemo-async's and streaming-diloco's): issued where recorded and waited where the "
    "trace waited, in a later step (at its start if the wait fell between steps), the link "
    "busy meanwhile, after the carried ops still in flight (one communicator runs its ops in "
    "order); one the trace waits on only after its last step (the run's drain) is due as late "
    "as the others; a replay cycling past the recording's last step ends the next step with "
    "it, and the last simulated step's are not waited on (the run's drain is off the training "
    "clock)."
)


@dataclass(frozen=True)
class AlgorithmChoice:
    """The inter-node algorithm the model assumed for one op kind, group size and layout."""

    op: str
    algorithm: str
    ranks: int
    """Ranks of the group (nodes, when one_per_node)."""
    one_per_node: bool
    min_bytes: int
    """Smallest payload per rank of the ops it priced this way."""
    max_bytes: int
    """Largest payload per rank of the ops it priced this way."""


@dataclass(frozen=True)
class PhaseCompute:
    """Compute per step in each phase (PHASES), as recorded and as replayed (phase_seconds)."""

    recorded_s: tuple[float, float]
    """Median seconds per step of the trace's busiest position, forward+backward and optimizer."""
    replayed_s: tuple[float, float]
    """The seconds replayed instead (before node speed); each phase scaled to them."""

    def scales(self) -> tuple[float, float]:
        """The factor each phase's compute is multiplied by (0 for a phase with no compute)."""
        return tuple(new / old if old > 0 else 0.0
                     for new, old in zip(self.replayed_s, self.recorded_s, strict=True))


@dataclass(frozen=True)
class Replay:
    """What a replay predicts (per-step times) and what it assumed to get there."""

    frame: pd.DataFrame
    """DataFrame[step, step_time_s, time_s]: each step's duration and its cumulative end."""
    topology: Topology
    """The target the trace was replayed on (calibrated links included, where the caller did)."""
    recorded_topology: tuple[int, int]
    """(nodes, accelerators_per_node) the trace was recorded on."""
    note: str = ""
    """The extrapolation assumptions (MODEL_NOTE, plus P2P_NOTE for messages), one paragraph."""
    algorithms: tuple[AlgorithmChoice, ...] = ()
    """The inter-node algorithms assumed (`algorithm_summary` prints them)."""
    p2p_degrees: tuple[int, ...] = ()
    """Peers per node of the point-to-point rounds replayed (gossip); empty without messages."""
    graphs: tuple[str, ...] = ()
    """One line per communication graph the caller's `degrees` came from (empty if none)."""
    payload_rules: tuple[str, ...] = ()
    """One line per rule by which the caller resized the trace's payloads (empty: as recorded)."""
    compute_rules: tuple[str, ...] = ()
    """One line per rule by which the caller carried compute to the target's shape (empty: none)."""
    basis: tuple[str, ...] = ()
    """One line per part (compute, intra-node, inter-node, overlap): what the caller's replay
    measured and what it modeled (empty: everything as recorded)."""
    node_egress_bytes: float = 0.0
    """Bytes that left one node (its NICs, inter-node) over all simulated steps."""
    overlap: str = "recorded"
    """How FSDP2's reduce was replayed: "recorded" (the trace's order) or "fsdp2" (streams)."""
    phases: PhaseCompute | None = None
    """Per-phase compute, recorded and replayed, when simulate(phase_seconds=...) set it."""


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while building programs: ~10^5 typed records, and no cycles.

    Tuple subclasses stay tracked by the cyclic GC (plain tuples of numbers get untracked), so
    full collections triggered by the allocation burst would rescan them all; everything built
    here is freed by reference counting anyway.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _layout(df: pd.DataFrame) -> tuple[int, int]:
    """Recorded (nodes, accelerators_per_node), checked against the rank numbering."""
    per_node = int(df["local"].max()) + 1
    nodes = int(df["node"].max()) + 1
    if not (df["rank"] == df["node"] * per_node + df["local"]).all():
        raise ValueError(
            "trace rank/node/local columns disagree with rank = node * per_node + local; "
            "record the trace with the topology the run really had."
        )
    return nodes, per_node


def _training_rows(trace: pd.DataFrame | str | os.PathLike) -> pd.DataFrame:
    """The validated trace's training rows: evaluation and other phases are never replayed."""
    df = load_trace(trace) if isinstance(trace, (str, os.PathLike)) else validate_trace(trace)
    df = df[df["phase"] == TRAIN]
    if df.empty:
        raise ValueError('trace has no rows of phase "train"; record at least one training step.')
    return df


def _check_compute_scale(compute_scale: object) -> None:
    if (
        isinstance(compute_scale, bool)
        or not isinstance(compute_scale, (int, float))
        or not compute_scale > 0
    ):
        raise ValueError(f"compute_scale {compute_scale!r} must be a positive number.")


def has_unit_marks(trace: pd.DataFrame) -> bool:
    """Whether a trace records where FSDP2 units' backward ended (what overlap "fsdp2" needs)."""
    return _has_mark(trace, UNIT_BACKWARD)


def _has_mark(trace: pd.DataFrame, op: str) -> bool:
    return "kind" in trace.columns and bool(((trace["kind"] == "mark") & (trace["op"] == op)).any())


def _check_overlap(overlap: object, df: pd.DataFrame) -> None:
    if overlap not in OVERLAPS:
        raise ValueError(f"overlap {overlap!r} is not known; use one of {', '.join(OVERLAPS)}.")
    if overlap == "fsdp2" and not has_unit_marks(df):
        raise ValueError(
            'overlap "fsdp2" needs a trace with FSDP2 backward marks, and this one has none '
            "(recorded before runs marked them, or by a method without FSDP2 sharding); replay "
            'it with overlap "recorded", or record it again.'
        )


def compute_phases(trace: pd.DataFrame | str | os.PathLike) -> tuple[float, float]:
    """Median compute seconds per step of each phase (PHASES) of a trace's busiest position.

    What simulate(phase_seconds=...) scales: the gaps in which a rank was not blocked on a
    collective, split at the "backward" mark (ValueError without marks).
    """
    df = _training_rows(trace)
    if not has_backward_marks(df):
        raise ValueError('the trace has no "backward" marks to split its steps into phases '
                         "(recorded before runs marked them); record it again.")
    nodes, per_node = _layout(df)
    placeholder = Topology.from_strings(nodes, per_node, "1Gbit")  # links do not matter here
    with _gc_paused():
        return phase_compute(build_programs(df, placeholder))


def _phase_note(phases: PhaseCompute, how: str, scales: tuple[float, float] | None) -> str:
    """The note's clause for a replay whose compute per phase was set (phase_seconds) or scaled
    (phase_scale: `scales`)."""
    fb, opt = phases.scales() if scales is None else scales
    return (f"compute per phase {how}: forward+backward x{fb:.4g}, optimizer "
            f"x{opt:.4g} of the recording's (its busiest position's median per step), every "
            "gap of a phase alike.")


def _check_waits_in_their_step(df: pd.DataFrame) -> bool:
    """Whether ops are waited on after their step (carried); ValueError for such a message.

    Collectives a method overlaps with the next step (flexdemo-async) are carried into the step
    that waits for them (CARRY_NOTE). A gossip round is one exchange inside its step; messages
    waited on later are refused rather than replayed as something they were not.
    """
    coll = df[df["kind"] == "collective"]
    late = waited_after_step(coll, df[df["kind"] == "step"])
    messages = late & coll["op"].isin(P2P_OPS).to_numpy()
    if messages.any():
        op = coll[messages].iloc[0]
        raise ValueError(
            f"the trace's {op['op']} of step {int(op['step'])} (rank {int(op['rank'])}) was "
            "waited on after its step ended; the model replays a round of messages within its "
            "step and carries only collectives into a later one, so it refuses such a trace."
        )
    return bool(late.any())


def has_backward_marks(trace: pd.DataFrame) -> bool:
    """Whether a trace marks where each step's backward returned (runs since marks were added)."""
    return _has_mark(trace, BACKWARD)


def _check_phase_scale(phase_scale: object, phase_seconds: object, df: pd.DataFrame) -> None:
    if phase_scale is None:
        return
    if (not isinstance(phase_scale, (tuple, list)) or len(phase_scale) != len(PHASES)
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                       and np.isfinite(v) and v > 0 for v in phase_scale)):
        raise ValueError(f"phase_scale {phase_scale!r} must be {len(PHASES)} finite factors > 0, "
                         f"one per phase ({', '.join(PHASES)}).")
    if phase_seconds is not None:
        raise ValueError("phase_seconds sets each phase's compute itself; give phase_scale or "
                         "phase_seconds, not both.")
    if not has_backward_marks(df):
        raise ValueError('phase_scale needs the trace\'s "backward" marks, which split a step '
                         "into its phases, and this trace has none (recorded before runs marked "
                         "them); record it again.")


def _check_phase_seconds(phase_seconds: object, compute_scale: float, df: pd.DataFrame) -> None:
    if phase_seconds is None:
        return
    if (not isinstance(phase_seconds, (tuple, list)) or len(phase_seconds) != len(PHASES)
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                       and np.isfinite(v) and v >= 0 for v in phase_seconds)):
        raise ValueError(f"phase_seconds {phase_seconds!r} must be {len(PHASES)} finite seconds "
                         f">= 0, one per phase ({', '.join(PHASES)}).")
    if compute_scale != 1.0:
        raise ValueError(f"phase_seconds sets the compute itself; compute_scale must be 1, got "
                         f"{compute_scale!r} (give one or the other).")
    if not has_backward_marks(df):
        raise ValueError('phase_seconds needs the trace\'s "backward" marks, which split a step '
                         "into its phases, and this trace has none (recorded before runs marked "
                         "them); record it again.")


def _scaled_phases(programs: Programs, phases: PhaseCompute,
                   scales: tuple[float, float] | None = None) -> Programs:
    """The programs with each phase's compute multiplied by `scales` (default: PhaseCompute's)."""
    old = phases.recorded_s
    if scales is None and any(o == 0 and n > 0 for o, n in zip(old, phases.replayed_s,
                                                               strict=True)):
        name = PHASES[next(i for i, o in enumerate(old) if o == 0)]
        raise ValueError(f"the trace has no {name} compute to scale to the seconds given; "
                         "replay it with compute_scale instead.")
    scales = phases.scales() if scales is None else scales
    by_slot = {
        slot: [Compute(item.seconds * scales[item.phase], item.phase)
               if type(item) is Compute else item for item in program]
        for slot, program in programs.by_slot.items()
    }  # fmt: skip
    return programs._replace(by_slot=by_slot)


def _with_phases(programs: Programs, phase_seconds: tuple[float, float] | None,
                 phase_scale: tuple[float, float] | None,
                 ) -> tuple[Programs, PhaseCompute | None, str]:
    """The programs with each phase's compute set (phase_seconds) or scaled (phase_scale), the
    PhaseCompute behind it (None: neither given) and how, for the note."""
    if phase_seconds is not None:
        phases = PhaseCompute(phase_compute(programs), tuple(map(float, phase_seconds)))
        return _scaled_phases(programs, phases), phases, "set by phase_seconds"
    if phase_scale is not None:
        measured = phase_compute(programs)
        phases = PhaseCompute(measured, tuple(float(s) * m for s, m in
                                              zip(phase_scale, measured, strict=True)))
        return _scaled_phases(programs, phases, phase_scale), phases, "scaled by phase_scale"
    return programs, None, ""


def _check_steps_and_intra(n_steps: object, steps: object, intra: str) -> None:
    if isinstance(n_steps, bool) or not isinstance(n_steps, (int, np.integer)) or n_steps < 1:
        raise ValueError(f"steps {steps!r} must be a positive integer or None.")
    if intra not in ("model", "recorded"):
        raise ValueError(f'intra {intra!r} is not known; use "model" or "recorded".')


def simulate(
    trace: pd.DataFrame | str | os.PathLike,
    topology: Topology,
    options: ReplayOptions | None = None,
) -> Replay:
    """Predict per-step times of a recorded run on `topology`, with the assumptions made (Replay).

    Args:
        trace: combined trace of all ranks (DataFrame or path to trace.parquet); only its
            "train" phase is replayed.
        topology: target cluster; may have more nodes/accelerators than the recording.
        options: every other choice (ReplayOptions; None: its defaults), field by field:
            steps: steps to simulate (default: the recorded number); more cycle the recorded ones.
            compute_scale: multiplies every compute interval (0.5 = accelerators twice as fast).
            intra: "model" times intra-node collectives on topology.intra; "recorded" keeps their
                recorded durations as seen by each op's last-arriving member (real runs never shape
                intra-node groups, so validating a model against a shaped run wants "recorded").
            algorithm: inter-node collective algorithms. "auto" picks ring or the log-depth one
                (tree all-reduce, Bruck all-gather) by their alpha-beta time as NCCL's tuner does;
                "ring" keeps the recorded algorithms; "tree" forces the log-depth ones.
                Replay.algorithms lists what was assumed (`algorithm_summary` prints it).
            degrees: for traces with point-to-point messages (gossip), the peers each node has on
                the target, given (recorded step number, gossip round); None keeps the recorded
                messages, which only fits the recorded node count. Replay.p2p_degrees lists
                those replayed.
            payloads: how the caller sized the trace's payloads for the target (a resized trace,
                such as re-sharded); None: as recorded. It replaces that clause of the note.
            overlap: "recorded" replays every op where the trace waited on it (on CPU gloo FSDP2's
                reduce is serial); "fsdp2" overlaps each unit's gradient reduce with the following
                backward as a GPU's communication streams do (OVERLAP_NOTE); it needs the trace's
                FSDP2 marks (ValueError without them).
            progress: show a progress bar over the simulated steps on stderr, once the replay has
                run for 2 s (a short one shows none) and only on a terminal.
            phase_seconds: compute per step of each phase (PHASES: forward+backward up to the
                trace's "backward" mark, then the optimizer step), such as a profile measured on
                the target's accelerator: each phase's gaps are scaled so that the busiest
                position's median per step is these seconds (compute_scale must then be 1; node
                speed still divides). Replay.phases holds both; needs the trace's "backward" marks.
            phase_scale: a factor per phase (PHASES order) multiplying its compute on top of
                compute_scale, such as the optimizer step's on a smaller shard; Replay.phases holds
                the recorded and scaled seconds (before compute_scale); needs the "backward" marks.
            site_rounds: for traces with messages replayed on several sites (topology.sites), each
                site's messages of a round, given (recorded step number, gossip round): a
                netsim.sites.SiteRound, such as gossip_round(sites, the graph's peers); the note
                adds gossip_line.
    """
    return simulate_each(trace, [topology], options)[0]


def simulate_each(
    trace: pd.DataFrame | str | os.PathLike,
    topologies: Iterable[Topology],
    options: ReplayOptions | None = None,
) -> list[Replay]:
    """`simulate` on each topology in turn, the trace checked and its programs built once.

    The programs depend on the trace and its recorded shape alone, so a grid of networks (a
    planner's bandwidths) pays for them once. Arguments as `simulate`'s.
    """
    o = _checked_options(options)
    topologies = list(topologies)
    if not topologies:
        raise ValueError("topologies is empty; give at least one netsim.Topology.")
    for topology in topologies:
        if not isinstance(topology, Topology):
            raise ValueError(f"topology {topology!r} must be a netsim.Topology.")
    df = _training_rows(trace)
    _check_overlap(o.overlap, df)
    nodes, per_node = _layout(df)
    carries = _check_waits_in_their_step(df)
    _check_phase_seconds(o.phase_seconds, o.compute_scale, df)
    _check_phase_scale(o.phase_scale, o.phase_seconds, df)
    first = topologies[0]
    with _gc_paused():
        # Programs read the recorded shape only (which rank is where), never its links.
        programs = build_programs(df, Topology(nodes, per_node, first.intra, first.inter),
                                  o.overlap)
        programs, phases, how = _with_phases(programs, o.phase_seconds, o.phase_scale)
    n_steps = programs.n_steps if o.steps is None else o.steps
    _check_steps_and_intra(n_steps, o.steps, o.intra)
    p2p = any(spec.scope == "p2p" for spec in programs.specs)
    for topology in topologies:
        _check_peers(p2p, o.degrees, nodes, topology)
    replays = []
    compiled: dict = {}  # compiled programs by what they depend on (Cluster._compile_key)
    for topology in topologies:
        recorded = Topology(nodes, per_node, topology.intra, topology.inter)
        with _gc_paused():
            cluster = Cluster(topology, recorded, programs, o, compiled)
        times = np.asarray(_run(cluster, int(n_steps), o.progress), dtype=float)
        frame = pd.DataFrame(
            {
                "step": np.arange(len(times), dtype=np.int64),
                "step_time_s": np.diff(times, prepend=0.0),
                "time_s": times,
            }
        )
        replays.append(Replay(
            frame=frame, topology=topology, recorded_topology=(nodes, per_node),
            note=_model_note(o.payloads) + (" " + P2P_NOTE if p2p else "")
            + (" " + OVERLAP_NOTE if o.overlap == "fsdp2" else "")
            + (" " + CARRY_NOTE if carries else "")
            + (" " + _phase_note(phases, how, o.phase_scale) if phases is not None else "")
            + _sites_note(topology, o.site_rounds if p2p else None, df),
            algorithms=tuple(
                AlgorithmChoice(op, algo, p, alone, min(sizes), max(sizes))
                for (op, algo, p, alone), sizes in sorted(cluster.choices.items())
            ),
            p2p_degrees=tuple(sorted(cluster.p2p_degrees)),
            node_egress_bytes=cluster.node_egress_bytes, overlap=o.overlap, phases=phases,
        ))  # fmt: skip
    return replays


def _checked_options(options: ReplayOptions | None) -> ReplayOptions:
    """The options (None: the defaults), their trace-free values checked (ValueError)."""
    options = ReplayOptions() if options is None else options
    if not isinstance(options, ReplayOptions):
        raise ValueError(f"options {options!r} must be a netsim.model.ReplayOptions.")
    _check_compute_scale(options.compute_scale)
    if options.algorithm not in ALGORITHM_CHOICES:
        raise ValueError(f"algorithm {options.algorithm!r} is not known; use one of "
                         f"{', '.join(ALGORITHM_CHOICES)}.")
    return options


def _check_peers(p2p: bool, degrees: Degrees | None, nodes: int, topology: Topology) -> None:
    """ValueError for messages replayed on another node count without the graph's degrees."""
    on_sites = topology.sites is not None and len(topology.sites.sites) > 1
    if p2p and degrees is None and topology.nodes != nodes and not on_sites:
        raise ValueError(
            f"the trace has point-to-point messages recorded on {nodes} nodes, whose peers on "
            f"{topology.nodes} nodes are unknown; pass degrees= (peers per node there), as "
            f"flexbench simulate does from the run's gossip graph."
        )


def _sites_note(topology: Topology, site_rounds: SiteRounds | None, df: pd.DataFrame) -> str:
    """The note's clauses for a replay on sites (collectives, and the first round of gossip's
    messages: its exact-average rounds, the complete graph's, are an all-reduce instead)."""
    sites = topology.sites
    if sites is None:
        return ""
    note = f" {hierarchy_line(sites)}."
    if site_rounds is not None and len(sites.sites) > 1:
        first = int(df.loc[df["op"] == "send", "step"].min())
        note += f" {gossip_line(sites, site_rounds(first, 0))}."
    return note


def _run(cluster: Cluster, n_steps: int, progress: bool) -> list[float]:
    """``cluster.run(n_steps)``, with a progress bar when asked (stdout stays the caller's)."""
    if not progress:
        return cluster.run(n_steps)
    # delay: a replay that ends within 2 s prints nothing; disable=None: nothing off a terminal,
    # so piped and logged output is what it was without the bar.
    with tqdm(total=n_steps, desc="simulate", unit="step", delay=2, file=sys.stderr,
              disable=None, leave=False) as bar:
        return cluster.run(n_steps, on_step=bar.update)


def _model_note(payloads: str | None) -> str:
    """MODEL_NOTE, its payload clause replaced where the caller resized the payloads."""
    if payloads is None:
        return MODEL_NOTE
    return MODEL_NOTE.replace("weak scaling: per-step compute and payload sizes as recorded",
                              f"per-step compute as recorded; payloads {payloads}")


def algorithm_summary(algorithms: Iterable[AlgorithmChoice]) -> list[str]:
    """One line per inter-node op kind: the algorithm the model assumed, ranks and message sizes."""
    lines = []
    for entry in algorithms:
        low, high = f"{entry.min_bytes / 1e6:.3g}", f"{entry.max_bytes / 1e6:.3g}"
        size = f"{low} MB" if low == high else f"{low}-{high} MB"
        ranks = f"{entry.ranks:,} {'nodes' if entry.one_per_node else 'ranks'}"
        lines.append(f"{entry.op}: {entry.algorithm} ({ranks}, {size} per rank)")
    return lines
