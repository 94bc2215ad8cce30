"""A step's compute measured in a run: a recording's or an imported trace's, for `plan`.

`plan --compute-from RUN` plans on the compute RUN measured instead of the 6·N·tokens rule:
its compute per step as its own replay counts it, with every collective taking no time (the
median replayed step: between each pair of collectives the slowest rank's compute, so ranks
that computed unevenly count as a synchronous step waits for them; FSDP2's reduce streamed, as
the plan replays it, where RUN marks its units), split into forward+backward
and optimizer at the "backward" mark in the busiest position's proportion
(`netsim.model.compute_phases`). A planned program's ranks all compute alike, and this is the
compute that makes them step as RUN's did. Per FSDP2 unit, an imported trace's own module
names give each unit's forward and backward share, and the parts of the root's backward
computed after the blocks' and after its own reduction was issued
(`experiments.traces.units`); a recording, which marks where a unit's backward ends but not
where its forward does, is split by the rule
(forward 1/3, backward 2/3, by the units' parameters). The plan's compute line says which.
"""

from __future__ import annotations

import dataclasses

from experiments.errors import ConfigError
from experiments.plan.hardware import StepCompute, given_compute
from experiments.run_record import RunRecord
from experiments.workloads import WORKLOAD_NAMES
from netsim.model import compute_phases

__all__ = ["measured_compute"]


def measured_compute(path: str, unit_params: list[int], gpus_per_node: int,
                     model: str) -> StepCompute:
    """The compute per step RUN measured, per unit of the planned model (ConfigError, one
    sentence, for a run of another model or shape, or one without the marks it needs)."""
    record = RunRecord.load(path, "--compute-from run")
    config = record.run_config()
    flag = f"--compute-from {path}"
    if record.workload in WORKLOAD_NAMES and record.workload != model:
        raise ConfigError(f"{flag} trained workload {record.workload!r}, not --model {model!r}; "
                          "give a run of the model you plan.")
    if config.gpus_per_node != gpus_per_node:
        raise ConfigError(f"{flag} ran {config.gpus_per_node} ranks per node, not "
                          f"--gpus-per-node {gpus_per_node}; a rank's compute depends on its "
                          "shard, so give a run of the planned shape.")
    try:
        forward_backward, optimizer = compute_phases(record.trace())
        critical = _critical_path(path)
    except ValueError:
        raise ConfigError(f"{flag} has no backward marks to tell its forward+backward from its "
                          "optimizer step (a trace without an Optimizer.step annotation, or "
                          "a recording made before runs marked them).") from None
    where = "imported trace" if record.imported is not None else "recording"
    scale = critical / (forward_backward + optimizer)
    said = (f"compute: measured in {path} ({where}): {critical:.4g} s a step, its own replay's "
            f"median step with collectives taking no time (x{scale:.3g} the busiest rank's own "
            "compute: its ranks computed unevenly between collectives), split "
            f"{forward_backward * scale:.4g} s forward+backward and {optimizer * scale:.4g} s "
            "optimizer as that rank's")
    forward_backward, optimizer = forward_backward * scale, optimizer * scale
    shares = _unit_shares(record, len(unit_params), flag)
    if shares is None:
        compute = given_compute(unit_params, forward_backward, optimizer)
        return dataclasses.replace(compute, rule=f"{said}; per unit split by the rule (forward "
                                   "1/3, backward 2/3, by the units' parameters): the run marks "
                                   "no unit's forward")
    forward, backward, tail, end = shares
    total = sum(forward) + sum(backward)
    return StepCompute(tuple(forward_backward * f / total for f in forward),
                       tuple(forward_backward * b / total for b in backward), optimizer,
                       f"{said}; per unit as the trace's FSDP2 module names share it (each "
                       "unit's forward and backward compute; the root's backward after the "
                       "blocks' and after its own reduction apart)",
                       root_tail_s=forward_backward * tail / total,
                       root_end_s=forward_backward * end / total)


# A link on which a collective takes no time to speak of.
_FREE = "1000Tbit"


def _critical_path(path: str) -> float:
    """RUN's median step replayed with free links: its compute as a synchronous step spends it
    (FSDP2's reduce streamed where RUN marks its units, as the plan replays it: a rank then
    waits for the others at the all-gathers and the backward's end, not at every reduction)."""
    from experiments.replay.engine import replay
    from experiments.replay.recordings import read_run
    from experiments.replay.target import ReplayTarget
    from netsim.model import has_unit_marks

    run = read_run(path)
    free = ReplayTarget(inter_bw=_FREE, inter_lat="0ms", intra="model", intra_bw=_FREE,
                        intra_lat="0us",
                        overlap="fsdp2" if has_unit_marks(run.trace) else "recorded")
    return float(replay(run, free).frame["step_time_s"].median())


def _unit_shares(record: RunRecord, units: int,
                 flag: str) -> tuple[list[float], list[float], float, float] | None:
    """An imported trace's forward and backward seconds per unit, and the root's backward
    after the blocks' and after its own reduction (None: it names no unit)."""
    info = record.imported or {}
    measured = info.get("unit_compute")
    if not measured or sum(measured["forward"]) + sum(measured["backward"]) <= 0:
        return None
    if len(measured["forward"]) != units:
        raise ConfigError(f"{flag} names {len(measured['forward'])} FSDP2 units and --model "
                          f"has {units}; give a trace of the model you plan.")
    # An import written before the tail or end was measured has none: the root's backward
    # runs first.
    tail = measured.get("backward_tail", [0.0] * units)[-1]
    end = measured.get("backward_end", [0.0] * units)[-1]
    return list(measured["forward"]), list(measured["backward"]), tail, end
