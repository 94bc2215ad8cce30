"""Each FSDP2 unit's forward and backward compute, from the module names FSDP2 writes in a trace.

FSDP2 annotates its hooks with the unit's module name: a unit's forward runs from the end of
`FSDP::pre_forward (UNIT)` to the start of `FSDP::post_forward (UNIT)`, its backward from the
end of `FSDP::pre_backward (UNIT)` to the start of its first `FSDP::post_backward_*`. The root's
spans hold the blocks', so each piece of work counts for the innermost unit whose span holds
it: a host op where it ran (CPU traces), a GPU kernel where it was launched (GPU traces), its
own busy seconds in either case. Per unit the median over the traced steps is kept, the
slowest rank's.
"""

from __future__ import annotations

import re
import statistics

from experiments.traces.chrome import Event

__all__ = ["unit_compute"]

_HOOK = re.compile(r"^FSDP::(pre_forward|post_forward|pre_backward|post_backward_\w+)"
                   r"(?: \((.*)\))?$")


def _spans(host: list[Event]) -> list[tuple[float, float, str, str]]:
    """(begin, end, unit, "forward" | "backward") of every unit's compute span, host times."""
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


def _innermost(spans: list[tuple[float, float, str, str]], t: float) -> tuple[str, str] | None:
    """The unit and phase of the shortest span holding host time t."""
    holding = [s for s in spans if s[0] <= t <= s[1]]
    if not holding:
        return None
    _, _, unit, phase = min(holding, key=lambda s: s[1] - s[0])
    return unit, phase


def unit_compute(host: list[Event], work: list[tuple[float, float]],
                 steps: list[tuple[int, float, float]],
                 units: list[str]) -> dict[str, list[float]] | None:
    """Per unit (the recording's order) its forward and backward seconds, median over steps;
    `work` holds (host time it was issued or ran, busy seconds). None without FSDP2 names."""
    spans = sorted(_spans(host))
    if not spans or not units:
        return None
    per_step = [_one_step(spans, work, begin, end, units) for _, begin, end in steps]
    return {phase: [statistics.median(seconds[(u, phase)] for seconds in per_step)
                    for u in units] for phase in ("forward", "backward")}


def _one_step(spans: list, work: list[tuple[float, float]], begin: float, end: float,
              units: list[str]) -> dict[tuple[str, str], float]:
    """(unit, phase) -> busy seconds of one step [begin, end]."""
    seconds = {(u, p): 0.0 for u in units for p in ("forward", "backward")}
    own = [s for s in spans if begin <= s[0] <= end]  # the step's own spans
    for t, busy in work:
        where = _innermost(own, t) if begin <= t <= end else None
        if where in seconds:
            seconds[where] += busy
    return seconds
