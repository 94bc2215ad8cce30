"""A sweep's training time before it runs, from runs of the same workload already recorded.

    flexbench sweep experiments/configs/standard.toml --dry-run   # size and estimated time

Each pending unit's time is its steps times the seconds per step that runs of its method took
on the same workload and cluster shape in a reference sweep folder (`train_time_s` over
`steps` in each run.json: the training loop, evaluations included; process start-up and
scoring are not counted). A method the reference lacks takes the median of the others. An
emulated unit (`[emulate]`) is not estimated: the emulator records no training time. The
reference is the sweep's own folder when it holds runs, else results/quick.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from experiments.sweep.plan import Unit, unit_state
from experiments.workload_budgets import BUILTIN_BUDGETS

__all__ = ["DEFAULT_REFERENCE", "estimate_text", "seconds_per_step"]

DEFAULT_REFERENCE = Path("results") / "quick"


def seconds_per_step(reference: Path) -> dict[tuple[str, str, int, int], float]:
    """Median training seconds per step per (method, workload, nodes, ranks per node)."""
    found: dict[tuple[str, str, int, int], list[float]] = {}
    for path in sorted(reference.glob("units/*/run.json")):
        try:
            meta = json.loads(path.read_text())
            config, seconds = meta["config"], float(meta["train_time_s"])
            key = (str(config["method"]), str(config["workload"]), int(config["nodes"]),
                   int(config["gpus_per_node"]))
            found.setdefault(key, []).append(seconds / int(config["steps"]))
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
            continue  # a run without a timing is no evidence; the others still are
    return {k: statistics.median(v) for k, v in found.items()}


def estimate_text(units: list[Unit], out: Path, reference: Path | None = None) -> str:
    """One line: the units still to run and their estimated training time, with its source."""
    if reference is None:
        reference = out if any(out.glob("units/*/run.json")) else DEFAULT_REFERENCE
    pending = [u for u in units if unit_state(out, u) != "done"]
    if not pending:
        return f"every unit is done in {out}: a rerun trains nothing and only re-scores."
    rates = seconds_per_step(reference)
    total, guessed = 0.0, 0
    emulated = [u for u in pending if u.emulated]
    unsized = (f"; {len(emulated)} emulated unit(s) not estimated (the emulator records no "
               "training time)") if emulated else ""
    for unit in (u for u in pending if not u.emulated):
        timed = _unit_seconds(unit, rates, reference)
        if isinstance(timed, str):
            return f"{len(pending)} unit(s) to run; no estimate: {timed}"
        total, guessed = total + timed[0], guessed + timed[1]
    other = f"; {guessed} unit(s) of a method it lacks at the others' median" if guessed else ""
    return (f"{len(pending)} unit(s) to run, about {total / 60:.0f} min of training (seconds "
            f"per step of each method's runs in {reference}{other}; start-up and scoring not "
            f"counted, a loaded machine takes longer){unsized}.")


def _unit_seconds(unit: Unit, rates: dict, reference: Path) -> tuple[float, bool] | str:
    """A unit's training seconds and whether its method's rate was guessed, or why it can't be."""
    c = unit.config
    steps = c.steps or BUILTIN_BUDGETS.get(c.workload, (None,))[0]
    if steps is None:
        return (f"the steps of unit {unit.id} are workload {c.workload!r}'s own budget, which a "
                "dry run does not load; set run.steps to estimate.")
    shape = (c.workload, c.nodes, c.gpus_per_node)
    rate = rates.get((unit.method, *shape))
    if rate is not None:
        return rate * steps, False
    alike = [r for k, r in rates.items() if k[1:] == shape]
    if not alike:
        return (f"{str(reference)!r} holds no run of {c.workload} on "
                f"{c.nodes}x{c.gpus_per_node} to time from.")
    return statistics.median(alike) * steps, True
