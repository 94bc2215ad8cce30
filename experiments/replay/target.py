"""Where and how a recording is replayed: one typed, checked `ReplayTarget`, built once.

    target = ReplayTarget(inter_bw="1Gbit", inter_lat="20ms", nodes=16, gpus_per_node=8,
                          compute=ComputeBasis(scale=0.05))
    replay(read_run("runs/flex"), target)          # experiments.replay.engine

A target names the network (a flat one: bandwidth, latency, per-node links; or a TOML file of
sites), the cluster shape (nodes, GPUs per node), what a step's compute stands on (the
recording's, scaled, declared seconds, a measured profile, or one basis for every run), how
intra-node collectives and FSDP2's reduce are replayed, the collective algorithms, a link
calibration and the loss rule at another global batch. A setting left None keeps the
recording's own (its network, its shape). Every command's flags become one
(`experiments.replay.flags.target_from_flags`); a sweep or a report builds one from its network
points. Bad values are refused when it is built, in one sentence naming the flag.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import pandas as pd

from experiments.config import RunConfig, check_algorithm_on_sites, load_site_file
from experiments.errors import ConfigError
from experiments.replay.compute_profile import ComputeProfile
from experiments.replay.loss_curve import LossScaling
from netsim.calibration import Calibration
from netsim.costs import ALGORITHM_CHOICES
from netsim.model.programs import OVERLAPS
from netsim.units import parse_node_link

__all__ = ["INTRA_MODES", "SAME_COMPUTE", "ComputeBasis", "ReplayTarget"]

INTRA_MODES = ("recorded", "model")
SAME_COMPUTE = ("method", "all")


def _positive(flag: str, value: float | None) -> None:
    if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)
                                  and value > 0):
        raise ConfigError(f"{flag} must be a positive number, got {value}.")


@dataclass(frozen=True)
class ComputeBasis:
    """What each replayed step's compute stands on: the recording's (scaled), declared seconds
    per step, seconds per phase (a measured profile), or one basis for every compared run."""

    scale: float | None = None
    """--compute-scale: the recorded compute x this (0.05: accelerators 20x faster)."""
    step_s: float | None = None
    """--step-compute: seconds of compute per step on the target's accelerators."""
    profile: ComputeProfile | None = None
    """--compute-profile: each phase's seconds measured by `flexbench profile-compute`."""
    profile_file: str | None = None
    """Where `profile` was read from, for its sentences."""
    phases: tuple[float, float] | None = None
    """Seconds per step of forward+backward and of the optimizer, given without a profile."""
    phases_at: int | None = None
    """Ranks per node `phases` were measured at (None: the target's)."""
    same: str | None = None
    """--same-compute: every run of a method (method) or every run (all) at one median
    recorded compute per step; resolved per run by the comparison (`replay(compute_s=...)`)."""

    def __post_init__(self) -> None:
        _positive("--compute-scale", self.scale)
        _positive("--step-compute", self.step_s)
        declared = [name for name, value in (("--step-compute", self.step_s),
                                             ("--compute-profile", self.profile),
                                             ("phases", self.phases)) if value is not None]
        if self.scale is not None:
            declared.insert(0, "--compute-scale")
        if len(declared) > 1:
            raise ConfigError(f"{declared[0]} and {declared[1]} both set the target's compute; "
                              "give one of them.")
        if self.phases is not None and not all(
                isinstance(s, (int, float)) and math.isfinite(s) and s >= 0 for s in self.phases):
            raise ConfigError(f"phases must be two finite seconds >= 0, got {self.phases}.")
        if self.same is not None and self.same not in SAME_COMPUTE:
            raise ConfigError(f"--same-compute {self.same!r} is not one of "
                              f"{', '.join(SAME_COMPUTE)}.")
        for flag, value in (("--compute-profile", self.profile), ("--step-compute", self.step_s)):
            if self.same is not None and value is not None:
                raise ConfigError(f"--same-compute {self.same} rescales the recorded compute, "
                                  f"and {flag} already sets every run's; give one of the two.")

    @property
    def phase_seconds(self) -> tuple[float, float] | None:
        """Seconds per step of each phase (a profile's or given), else None."""
        return self.profile.phase_seconds if self.profile is not None else self.phases

    @property
    def measured_at(self) -> int | None:
        """Ranks per node the phase seconds were measured at (None: the target's)."""
        return self.profile.gpus_per_node if self.profile is not None else self.phases_at

    @property
    def declares_hardware(self) -> bool:
        """Whether compute other than the recording CPU's is declared (a GPU's profile is)."""
        return (self.scale is not None or self.step_s is not None
                or (self.profile is not None and self.profile.gpu_class))

    def scale_of(self, steps: pd.DataFrame) -> float:
        """The factor on a run's recorded compute: --compute-scale, or --step-compute over the
        run's median compute per step (1 when neither is declared)."""
        if self.step_s is None:
            return self.scale or 1.0
        recorded = float(steps["compute_s"].median())
        return self.step_s / recorded if recorded > 0 else 1.0


@dataclass(frozen=True)
class ReplayTarget:
    """One network and cluster to replay recordings on, and the rules the replay follows."""

    inter_bw: str | None = None
    """Inter-node bandwidth, e.g. 1Gbit (None: the recording's own, or `topology`'s)."""
    inter_lat: str | None = None
    """Inter-node latency, e.g. 20ms (None: the recording's own)."""
    topology: str | None = None
    """A TOML file of sites instead of inter_bw/inter_lat/node_links; it sets the nodes."""
    node_links: tuple[str, ...] | None = None
    """NODE=BW[,LAT] links of their own (None: the recording's own node links)."""
    nodes: int | None = None
    """Nodes to replay on (None: the recording's, or the site file's)."""
    gpus_per_node: int | None = None
    """Ranks per node (None: the recording's); another count re-shards the payloads."""
    compute: ComputeBasis = field(default_factory=ComputeBasis)
    intra: str | None = None
    """Intra-node collectives: recorded durations or modeled on the intra link (None: model
    when compute other than the recording CPU's is declared, else recorded)."""
    intra_bw: str | None = None
    intra_lat: str | None = None
    overlap: str | None = None
    """FSDP2's per-unit reduce: recorded order or fsdp2 streams (None: fsdp2 with GPU-class
    compute and a recording with FSDP2 marks, else recorded)."""
    algorithm: str = "auto"
    calibration: Calibration | None = None
    """Links priced at a `flexbench calibrate` fit's goodput and per-message cost."""
    calibration_file: str | None = None
    loss_rule: LossScaling = field(default_factory=LossScaling)
    """The loss per step at another global batch (--loss-scaling)."""

    def __post_init__(self) -> None:
        if self.topology is not None:
            self._check_sites()
        elif self.inter_bw is not None:
            # Parsed as a run's settings are, in the same words, so a bad one fails here.
            RunConfig(inter_bw=self.inter_bw, inter_lat=self.inter_lat or "0ms").topology()
        for spec in self.node_links or ():
            parse_node_link(spec)
        check_algorithm_on_sites(self.algorithm, self.topology)
        for flag, value in (("--nodes", self.nodes), ("--gpus-per-node", self.gpus_per_node)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ConfigError(f"{flag} must be a whole number >= 1, got {value}.")
        for flag, value, allowed in (("--intra", self.intra, INTRA_MODES),
                                     ("--overlap", self.overlap, OVERLAPS),
                                     ("--algorithm", self.algorithm, ALGORITHM_CHOICES)):
            if value is not None and value not in allowed:
                raise ConfigError(f"{flag} {value!r} is not one of {', '.join(allowed)}.")

    def _check_sites(self) -> None:
        """A site file sets every link between nodes, and the node count."""
        if self.inter_bw is not None:
            raise ConfigError("give the target's network as --inter-bw (with --inter-lat, "
                              "--node-link) or as --topology FILE of sites, one of the two.")
        if self.calibration is not None:
            raise ConfigError("--calibration fits flat inter-node links; replaying --topology's "
                              "sites with it is not built (drop one of them).")
        if self.inter_lat is not None or self.node_links:
            flag = "--inter-lat" if self.inter_lat is not None else "--node-link"
            raise ConfigError(f"--topology sets every link between nodes; {flag} has no place "
                              "beside it (drop one of them).")
        if self.nodes is None:
            object.__setattr__(self, "nodes", load_site_file(self.topology).nodes)

    def at(self, **changes: object) -> ReplayTarget:
        """This target with some settings changed (a cell of a map), checked again."""
        return dataclasses.replace(self, **changes)

    @property
    def network(self) -> str:
        """The network in a few words: 'the sites of F', or 'BW, LAT' (the recording's where
        this target keeps it)."""
        if self.topology is not None:
            return f"the sites of {self.topology}"
        bandwidth = self.inter_bw or "the recording's bandwidth"
        latency = self.inter_lat or "the recording's latency"
        return f"{bandwidth}, {latency}"
