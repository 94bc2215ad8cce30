"""The link a traced job's own collectives ran at: an alpha-beta fit of their durations.

Each collective's duration is taken as netsim prices it, latency steps x latency + the busier
direction's wire bytes / bandwidth (netsim.costs), and the two unknowns are fitted by least
squares over the traced collectives of one kind of link (inter-node where the job spans nodes,
else intra-node). A collective traced on several ranks counts once, at its shortest span: the
others hold their wait for a late peer. The fit says at what network the trace replays as
traced (`flexbench simulate RUN --inter-bw ... --inter-lat ...`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from experiments.traces.job import Job
from netsim.costs import collective_volume, default_algorithm
from netsim.units import format_bandwidth

__all__ = ["FittedLink", "fit_link"]


@dataclass(frozen=True)
class FittedLink:
    """A link's bandwidth (bytes/s) and latency (s a step), and what it was fitted to."""

    bandwidth: float
    latency: float
    ops: int
    inter: bool

    @property
    def rate(self) -> str:
        """The bandwidth as a flag takes it ("12.5Gbit")."""
        return f"{self.bandwidth * 8 / 1e9:.6g}Gbit"

    @property
    def delay(self) -> str:
        """The latency as a flag takes it ("12.5us")."""
        return f"{self.latency * 1e6:.6g}us"

    def describe(self) -> str:
        """The fit in words, with the flags that replay on it."""
        flags = (f"--inter-bw {self.rate} --inter-lat {self.delay}" if self.inter else
                 f"--intra model --intra-bw {self.rate} --intra-lat {self.delay}")
        return (f"{format_bandwidth(self.bandwidth)} and {self.latency * 1e6:.3g} us a latency "
                f"step, fitted to {self.ops} {'inter' if self.inter else 'intra'}-node "
                f"collectives (replay on it: {flags})")


def fit_link(job: Job) -> FittedLink | None:
    """The least-squares link of the job's collectives (None: fewer than two to fit)."""
    inter = job.nodes > 1
    backend = "nccl" if "nccl" in job.backend else "gloo"
    g = job.gpus_per_node
    spans: dict[tuple, float] = {}
    shape: dict[tuple, tuple[int, float]] = {}
    for tl in job.timelines:
        seen: dict[tuple, int] = defaultdict(int)
        for c in sorted(tl.collectives, key=lambda c: c.start):
            crosses = len({r // g for r in c.ranks}) > 1
            if crosses != inter or len(c.ranks) < 2:
                continue
            key = (c.ranks, c.step, c.op, seen[(c.ranks, c.step, c.op)])
            seen[(c.ranks, c.step, c.op)] += 1
            spans[key] = min(spans.get(key, np.inf), c.end - c.start)
            volume = collective_volume(c.op, len(c.ranks), c.nbytes,
                                       default_algorithm(c.op, backend))
            shape[key] = (volume.latency_steps, max(volume.bytes_sent, volume.bytes_received))
    if len(spans) < 2:
        return None
    keys = list(spans)
    a = np.array([[shape[k][0], shape[k][1]] for k in keys], dtype=float)
    t = np.array([spans[k] for k in keys])
    (latency, inverse), *_ = np.linalg.lstsq(a, t, rcond=None)
    if inverse <= 0 or latency < 0:  # a fit off the physical: bytes alone set the pace
        latency, inverse = 0.0, t.sum() / a[:, 1].sum()
    return FittedLink(float(1 / inverse), float(latency), len(keys), inter)
