"""What a shaped link really delivers: a goodput factor and a per-message cost, fitted once.

The alpha-beta model prices a collective as `latency_steps * latency + wire_bytes / bandwidth`.
A real transfer through a shaped link pays more: TCP and framing leave a fraction `goodput` of
the rate to the payload, and every message costs a fixed `per_message_s` (a round of handshakes
in gloo, the shaper's own arrival exchange, the wake-up after a sleep). `flexbench calibrate`
times real collectives of several sizes over shaped links and fits both numbers by least squares
on relative error:

    measured_s ~= latency_steps * (latency + per_message_s) + wire_bytes / (goodput * bandwidth)

The model then runs on calibrated links (`Calibration.link`): the bandwidth times `goodput`, the
latency plus `per_message_s`. The fit is made once per shaping mode and machine and written to a
small JSON file; it is never tuned per validation point.

Where the samples time an op kind at two sizes or more, that op gets a fit of its own too
(`Calibration.ops`): under kernel shaping gloo's all-gather took 1.2-1.5x its link time where
its all-reduce took 1.0-1.1x, which one goodput cannot fit. With `per_op` the model prices
each op of a calibrated kind with its own pair (`Topology.op_costs`, relative to the shared
link); off by default, since on our kernel checks the fits did not beat the shared one.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from netsim.topology import Link, Topology

__all__ = ["Calibration", "Sample", "fit_calibration", "load_calibration"]

_FORMAT = "netsim-calibration/1"


@dataclass(frozen=True)
class Sample:
    """One timed collective: its alpha-beta terms at the configured link and the median time."""

    op: str
    payload_bytes: int
    rate_bps: float
    latency_s: float
    latency_steps: int
    wire_bytes: float
    measured_s: float

    def predicted(self, goodput: float = 1.0, per_message_s: float = 0.0) -> float:
        """The alpha-beta time of this collective on the calibrated link."""
        steps = self.latency_steps * (self.latency_s + per_message_s)
        return steps + self.wire_bytes / (goodput * self.rate_bps)


def _check_fit(goodput: float, per_message_s: float, what: str) -> None:
    if not (math.isfinite(goodput) and 0 < goodput <= 1.5):
        raise ValueError(f"{what} goodput {goodput!r} must be in (0, 1.5].")
    if not (math.isfinite(per_message_s) and abs(per_message_s) < 1.0):
        raise ValueError(f"{what} per_message_s {per_message_s!r} must be a finite number of "
                         "seconds below 1.")


@dataclass(frozen=True)
class Calibration:
    """A shaping mode's fitted goodput factor and per-message cost, with the samples behind it.

    `ops` maps an op kind ("all_gather") to its own (goodput, per_message_s), fitted on its
    samples alone; the model prices an op kind with its own pair only with `per_op` (else, and
    for a kind not in `ops`, with the shared pair). Off by default: on this project's 2-core VM
    the per-op fits moved all-gather-bound kernel points closer and all-reduce-bound ones
    further (docs/cost-model.md).
    """

    shaping: str
    goodput: float
    per_message_s: float
    samples: tuple[Sample, ...] = field(default=())
    made: str = ""  # when and where, for the reader of the file
    machine: str = ""  # the machine it was fitted on (experiments.replay.calibrate.this_machine)
    ops: tuple[tuple[str, float, float], ...] = field(default=())
    per_op: bool = False

    def __post_init__(self) -> None:
        _check_fit(self.goodput, self.per_message_s, "calibration")
        for op, goodput, per_message_s in self.ops:
            _check_fit(goodput, per_message_s, f"calibration {op}")

    def op_costs(self) -> tuple[tuple[str, float, float], ...]:
        """Per calibrated op kind: (op, bandwidth factor, latency per hop added, which may be
        negative) on top of the shared calibrated link, so that the op runs at its own goodput
        and per-message cost (the model keeps a hop's latency at 0 or more)."""
        if not self.per_op:
            return ()
        return tuple((op, goodput / self.goodput, per_message_s - self.per_message_s)
                     for op, goodput, per_message_s in self.ops)

    def link(self, link: Link) -> Link:
        """`link` as the model prices it: goodput times its rate, its latency plus the cost."""
        # A negative fitted cost (a link whose bucket starts full) never makes a latency negative.
        latency = max(0.0, link.latency + self.per_message_s)
        return Link(link.bandwidth * self.goodput, latency, jitter=link.jitter, loss=link.loss)

    def topology(self, topology: Topology) -> Topology:
        """`topology` with every inter-node link calibrated (intra-node links are never shaped).

        ValueError for a topology of sites: a calibration fits one flat link, not a site's
        uplink, downlink and inside links.
        """
        if topology.sites is not None:
            raise ValueError("a calibration fits flat inter-node links; replaying sites with one "
                             "is not built (drop the calibration or the sites).")
        links = {node: self.link(link) for node, link in topology.node_links}
        return Topology(topology.nodes, topology.accelerators_per_node, topology.intra,
                        self.link(topology.inter), nic=topology.nic,
                        node_speed=topology.node_speed, node_links=links,
                        op_costs=self.op_costs())

    def describe(self) -> str:
        """One line saying what the model assumes, for command output and notes."""
        own = "; ".join(f"{op} {goodput:.1%}, {per_message_s * 1e3:+.2f} ms"
                        for op, goodput, per_message_s in self.ops)
        return (f"calibrated for {self.shaping} shaping: goodput {self.goodput:.1%} of the rate, "
                f"{self.per_message_s * 1e3:+.2f} ms per message"
                f"{' (per op kind, ' + self._ops_state() + ': ' + own + ')' if own else ''}"
                f"{' (' + self.made + ')' if self.made else ''}")

    def _ops_state(self) -> str:
        return "applied" if self.per_op else "fitted, not applied (--per-op applies them)"

    def fit_for(self, op: str) -> tuple[float, float]:
        """(goodput, per_message_s) the model prices `op` with."""
        own = {o: (g, m) for o, g, m in self.ops} if self.per_op else {}
        return own.get(op, (self.goodput, self.per_message_s))

    def max_error(self) -> float:
        """Largest relative error of the fit over its own samples (each op at its own pair)."""
        return max((abs(s.predicted(*self.fit_for(s.op)) / s.measured_s - 1)
                    for s in self.samples), default=0.0)

    def save(self, path: str | os.PathLike) -> None:
        """Write the calibration as JSON (the caller picks an atomic writer if it needs one)."""
        Path(path).write_text(self.to_json())

    def to_json(self) -> str:
        """The file's text."""
        body = {"format": _FORMAT, "shaping": self.shaping, "goodput": self.goodput,
                "per_message_s": self.per_message_s, "made": self.made, "machine": self.machine,
                "ops": {op: {"goodput": g, "per_message_s": m} for op, g, m in self.ops},
                "per_op": self.per_op,
                "max_fit_error": self.max_error(), "samples": [asdict(s) for s in self.samples]}
        return json.dumps(body, indent=1) + "\n"


def _fit(samples: list[Sample]) -> tuple[float, float]:
    """(goodput, per_message_s) by least squares on relative error; ValueError if none fits.

    Unknowns a = per_message_s and b = 1 / goodput in
    measured - steps * latency = steps * a + (wire / rate) * b, each row divided by measured.
    """
    rows = np.array([[s.latency_steps, s.wire_bytes / s.rate_bps] for s in samples], dtype=float)
    target = np.array([s.measured_s - s.latency_steps * s.latency_s for s in samples])
    weight = 1.0 / np.array([s.measured_s for s in samples])
    (per_message, inverse_goodput), *_ = np.linalg.lstsq(rows * weight[:, None], target * weight,
                                                         rcond=None)
    if not inverse_goodput > 0:
        raise ValueError("the calibration samples do not grow with message size; time larger "
                         "messages (a few hundred kB or more at the chosen rates).")
    if 1.0 / inverse_goodput > 1.5:
        # Shaped links are never faster than their rate; a slope this flat means the small
        # messages were stretched (a busy machine) or the links were not shaped at all.
        raise ValueError(f"the calibration samples imply {1.0 / inverse_goodput:.3g} times the "
                         "configured rate: the small messages took too long against the large "
                         "ones (a busy machine while timing) or the links were not shaped as "
                         "configured; time again on an idle machine or with larger messages.")
    return float(1.0 / inverse_goodput), float(per_message)


def fit_calibration(samples: list[Sample], shaping: str, made: str = "",
                    machine: str = "", per_op: bool = False) -> Calibration:
    """The shared goodput and per-message cost over all `samples`, and a pair per op kind
    timed at two sizes or more (an op whose own samples fit no pair keeps the shared one);
    `per_op`: the model prices each such kind with its own pair."""
    if len(samples) < 2:
        raise ValueError(f"a calibration needs at least 2 samples, got {len(samples)}.")
    goodput, per_message = _fit(samples)
    ops = []
    for op in sorted({s.op for s in samples}):
        own = [s for s in samples if s.op == op]
        if len({s.wire_bytes / s.rate_bps for s in own}) < 2:
            continue
        try:
            fitted = _fit(own)
            _check_fit(*fitted, f"calibration {op}")
        except ValueError:
            continue  # too few or too noisy to fit alone: the shared pair prices it
        ops.append((op, *fitted))
    return Calibration(shaping, goodput, per_message, tuple(samples), made, machine, tuple(ops),
                       per_op)


def _once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict; KeyError for a key given twice (json keeps the last)."""
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise KeyError(key)
        found[key] = value
    return found


def load_calibration(path: str | os.PathLike, shaping: str | None = None) -> Calibration:
    """Read a file written by `flexbench calibrate`; ValueError (one sentence) if it is not one.

    With `shaping`, the file must have been fitted under that shaping mode.
    """
    where = str(path)
    try:
        body = json.loads(Path(path).read_text(), object_pairs_hook=_once_each)
    except FileNotFoundError:
        raise ValueError(f"calibration file {where!r} does not exist; write one with "
                         "`flexbench calibrate --out FILE`.") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"calibration file {where!r} cannot be read as JSON ({err}); write "
                         "one with `flexbench calibrate --out FILE`.") from None
    except KeyError as err:
        raise ValueError(f"calibration file {where!r} gives the key {err.args[0]!r} twice in "
                         "one object; keep one.") from None
    if not isinstance(body, dict) or body.get("format") != _FORMAT:
        raise ValueError(f"calibration file {where!r} is not a {_FORMAT} file; write one with "
                         "`flexbench calibrate --out FILE`.")
    try:
        samples = tuple(Sample(**s) for s in body.get("samples", []))
        if "ops" in body:
            ops = tuple((str(op), float(fit["goodput"]), float(fit["per_message_s"]))
                        for op, fit in (body["ops"] or {}).items())
        else:  # written before fits per op kind: fit them on the samples it kept
            ops = fit_calibration(list(samples), "any").ops if len(samples) > 1 else ()
        found = Calibration(str(body["shaping"]), float(body["goodput"]),
                            float(body["per_message_s"]), samples, str(body.get("made", "")),
                            str(body.get("machine", "")), ops, bool(body.get("per_op", False)))
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"calibration file {where!r} is damaged ({err}); write it again with "
                         "`flexbench calibrate --out FILE`.") from None
    if shaping is not None and found.shaping != shaping:
        raise ValueError(f"calibration file {where!r} was fitted under {found.shaping} shaping, "
                         f"not {shaping}; calibrate with `flexbench calibrate --shaping "
                         f"{shaping}`.")
    return found
