"""Each FSDP2 unit's forward and backward compute, from the module names FSDP2 writes in a trace.

FSDP2 annotates its hooks with the unit's module name: a unit's forward runs from the end of
`FSDP::pre_forward (UNIT)` to the start of `FSDP::post_forward (UNIT)`, its backward from the
end of `FSDP::pre_backward (UNIT)` to the start of its first `FSDP::post_backward_*`. Each piece
of compute (on a GPU trace a kernel, where it was launched, its seconds on the device; on a CPU
trace the host's time not spent waiting on a collective, as its replay counts compute, cut at
these boundaries) counts for the unit whose compute a plan places at that moment
(`experiments.plan.synth`: the root's backward, then each block's followed by its reduction,
then the rest of the root's):

- inside a unit's span and no span nested in it: that unit;
- in the root's backward before the first block's: the root;
- after a block's backward, up to the issue of its last gradient reduction (its gradients
  copied into the reduce-scatter's buffer, the reduce-scatter waited on): that block;
- after that, before the next block's backward: the next block (it hides the reduction);
- after the last block's reduction was issued, up to the issue of the root's own (the
  embedding's gradient, the root's post-backward): the root's backward tail, which a plan
  computes after every block's;
- after the root's last reduction was issued, up to the optimizer step's start (the step's
  "backward" mark: the rest of FSDP2's post-backward, the loop's work before `opt.step`): the
  backward's end, which a plan computes while the last reductions run.

Per unit the median over the traced steps is kept, the slowest rank's.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence

from experiments.traces.chrome import Event

__all__ = ["PHASES", "boundaries", "unit_compute"]

PHASES = ("forward", "backward", "backward_tail", "backward_end")
"""What `unit_compute` gives per unit: its forward, its whole backward, the part of that
backward computed after every unit nested in it (the root's; 0 for a block), and the part
after its own reduction was issued, before the optimizer step (the root's; 0 for a block)."""

_HOOK = re.compile(r"^FSDP::(pre_forward|post_forward|pre_backward|post_backward_\w+)"
                   r"(?: \((.*)\))?$")

Span = tuple[float, float, str, str]  # (begin, end, unit, "forward" | "backward")


def _spans(host: list[Event]) -> list[Span]:
    """Every unit's compute span, host times."""
    opened: dict[tuple[str, str], float] = {}
    spans = []
    for e in sorted(host, key=lambda e: e.start):
        m = _HOOK.match(e.name)
        if not m:
            continue
        hook, unit = m.group(1), m.group(2) or ""
        if hook in ("pre_forward", "pre_backward"):
            opened[(unit, hook[4:])] = e.end
        else:
            phase = "forward" if hook == "post_forward" else "backward"
            begin = opened.pop((unit, phase), None)
            if begin is not None and e.start > begin:
                spans.append((begin, e.start, unit, phase))
    return spans


def boundaries(host: list[Event]) -> list[float]:
    """Host times at which a unit's span begins or ends (with the reductions' issues, where
    the unit a moment counts for may change)."""
    return sorted({t for s in _spans(host) for t in s[:2]})


def _counts_for(spans: list[Span], issued: list[tuple[float, str]], t: float,
                optimizer: float | None = None) -> tuple[str, str] | None:
    """The unit and phase (of PHASES) host time t counts for (module docstring); `optimizer`:
    when the step's optimizer step began (None: it has none)."""
    holding = [s for s in spans if s[0] <= t <= s[1]]
    if not holding:
        return _post_backward(spans, issued, t, optimizer)
    begin, end, unit, phase = min(holding, key=lambda s: s[1] - s[0])
    inner = sorted(s for s in spans if s[3] == phase and begin <= s[0] and s[1] <= end
                   and s[2] != unit)
    if phase == "forward" or not inner or t < inner[0][0]:
        return unit, phase
    return _between(inner, issued, unit, t)


def _between(inner: list[Span], issued: list[tuple[float, str]], outer: str,
             t: float) -> tuple[str, str]:
    """Host time t in `outer`'s backward after the first of the backward spans `inner` to it."""
    last = max((s for s in inner if s[1] < t), key=lambda s: s[1])
    reduced = _reduced(issued, last)
    if reduced is None or t <= reduced:
        return last[2], "backward"
    following = [s for s in inner if s[0] > t]
    return (following[0][2], "backward") if following else (outer, "backward_tail")


def _reduced(issued: list[tuple[float, str]], span: Span) -> float | None:
    """When the last gradient reduction of `span`'s unit after it was issued (None: none)."""
    return max((r for r, u in issued if u == span[2] and r >= span[1]), default=None)


def _post_backward(spans: list[Span], issued: list[tuple[float, str]], t: float,
                   optimizer: float | None) -> tuple[str, str] | None:
    """Host time t outside every span: the post-backward of the unit whose backward ended last
    before it, up to the issue of that unit's last reduction; after the last backward's, up to
    the optimizer step, the backward's end (None: outside them)."""
    ended = [s for s in spans if s[3] == "backward" and s[1] < t]
    if not ended:
        return None
    last = max(ended, key=lambda s: s[1])
    reduced = _reduced(issued, last)
    if reduced is None:
        return None
    if t > reduced:
        return _backward_end(spans, last, t, optimizer)
    holds = any(s[2] != last[2] and last[0] <= s[0] and s[1] <= last[1] for s in ended)
    return last[2], "backward_tail" if holds else "backward"


def _backward_end(spans: list[Span], last: Span, t: float,
                  optimizer: float | None) -> tuple[str, str] | None:
    """Host time t after `last`'s reduction was issued: the backward's end if no backward
    follows and the optimizer step has not begun (None: neither)."""
    later = any(s[3] == "backward" and s[0] > t for s in spans)
    if optimizer is None or t >= optimizer or later:
        return None
    return last[2], "backward_end"


def unit_compute(host: list[Event], work: list[tuple[float, float]],
                 steps: list[tuple[int, float, float]], units: list[str],
                 issued: list[tuple[float, str]],
                 optimizer: Sequence[float] = ()) -> dict[str, list[float]] | None:
    """Per phase of PHASES, per unit (the recording's order) its seconds, median over steps;
    `work` holds (host time it was issued or ran, seconds), `issued` (host time, unit) of each
    gradient reduction, `optimizer` the host times optimizer steps began. None without FSDP2
    names."""
    spans = sorted(_spans(host))
    if not spans or not units:
        return None
    per_step = [_one_step(spans, issued, optimizer, work, begin, end, units)
                for _, begin, end in steps]
    found = {phase: [statistics.median(seconds[(u, phase)] for seconds in per_step)
                     for u in units] for phase in PHASES}
    found["backward"] = [b + t + e for b, t, e in zip(
        found["backward"], found["backward_tail"], found["backward_end"], strict=True)]
    return found


def _one_step(spans: list[Span], issued: list[tuple[float, str]], optimizer: Sequence[float],
              work: list[tuple[float, float]], begin: float, end: float,
              units: list[str]) -> dict[tuple[str, str], float]:
    """(unit, phase) -> seconds of one step [begin, end] (the tail and end apart)."""
    seconds = {(u, p): 0.0 for u in units for p in PHASES}
    own = [s for s in spans if begin <= s[0] <= end]  # the step's own spans
    own_issued = [(t, u) for t, u in issued if begin <= t <= end]
    opt = min((t for t in optimizer if begin <= t <= end), default=None)
    for t, busy in work:
        where = _counts_for(own, own_issued, t, opt) if begin <= t <= end else None
        if where in seconds:
            seconds[where] += busy
    return seconds
