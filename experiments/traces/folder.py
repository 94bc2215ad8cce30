"""An imported job as a run folder: run.json (marked imported), steps.parquet, trace.parquet.

The folder is read as any recording is (`RunRecord.load`, `read_run`), so `simulate` and `compare`
replay it with the same rules. run.json's `imported` says where it came from and what the
import inferred; its `config` is a RunConfig of the traced shape, the method hsdp-adamw (every
gradient reduced across nodes each step) unless --method names another.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import pandas as pd

from experiments.config import RunConfig
from experiments.io import provenance
from experiments.traces.job import Job
from experiments.traces.units import PHASES
from netsim.trace import comm_per_step

__all__ = ["IMPORTED", "imported_meta", "steps_table", "write_imported"]

IMPORTED = "imported"
"""run.json's `executor` of an imported trace."""


def steps_table(job: Job, trace: pd.DataFrame) -> pd.DataFrame:
    """One row a step, as a recording's steps.parquet: its time (the slowest rank's span), its
    communication per node, and its compute; the timeline's busy part beside it (busy_s)."""
    spans = trace[trace["kind"] == "step"]
    step_s = (spans["end_s"] - spans["start_s"]).groupby(spans["step"]).max()
    busy = pd.Series({k + 1: max(_busy_in(tl, k) for tl in job.timelines)
                      for k in range(len(job.steps))})
    steps = pd.DataFrame({"step": step_s.index.astype("int64"),
                          "profiler_step": job.steps,
                          "wall_time_s": step_s.cumsum().to_numpy(),
                          "loss": math.nan, "val_loss": math.nan, "replica_variance": math.nan,
                          "consensus_distance": math.nan, "graph": None})
    comm = comm_per_step(trace)
    steps = steps.merge(comm, on="step", how="left").fillna(
        {c: 0.0 for c in comm.columns if c != "step"})
    for col in ("inter_bytes_sent", "inter_bytes_received", "intra_bytes"):
        steps[col] = steps[col] / job.nodes  # per node, as a recording's
    steps["compute_s"] = (step_s.to_numpy() - steps["comm_s"]).clip(lower=0.0)
    steps["busy_s"] = busy.reindex(steps["step"]).to_numpy()
    steps["graph"] = steps["graph"].astype("object")
    return steps


def _busy_in(tl, k: int) -> float:
    """Seconds the rank's timeline ran something other than a collective within step k."""
    _, begin, end = tl.steps[k]
    return sum(max(0.0, min(b, end) - max(a, begin)) for a, b in tl.busy)


def _layout(job: Job, workload: str) -> list | None:
    """FSDP2 units as flat tensors of G x their all-gathered shard, where the trace names its
    units (None: a built-in workload's model gives the exact one, or none is known)."""
    from experiments.workloads import WORKLOAD_NAMES

    if workload in WORKLOAD_NAMES:
        return None
    tl = job.timelines[0]
    shard: dict[str, int] = {}
    for c in tl.collectives:
        if c.op == "all_gather" and c.gathered_unit is not None:
            shard.setdefault(c.gathered_unit, c.elements)
    if not tl.units or set(shard) != set(tl.units):
        return None
    return [[[shard[name] * job.gpus_per_node]] for name in tl.units]


def imported_meta(job: Job, trace: pd.DataFrame, steps: pd.DataFrame, method: str,
                  workload: str, batch_size: int | None = None) -> dict[str, Any]:
    """run.json of the imported job: a recording's entries, and `imported` saying what it is."""
    backend = "nccl" if "nccl" in job.backend else "gloo"
    cfg = RunConfig(method=method, workload=workload, nodes=job.nodes,
                    gpus_per_node=job.gpus_per_node, steps=len(job.steps), backend=backend,
                    batch_size=batch_size)
    shards = bool((trace["op"] == "reduce_scatter").any())
    layout = _layout(job, workload) if shards else None
    inferred = list(job.inferred) + _inferred(job, shards, layout, workload, method)
    return {
        "config": cfg.to_dict(), "world_size": job.world, "params": None, "layout": layout,
        "status": "done", "diverged_step": None, "final_val_loss": None,
        "train_time_s": float(steps["wall_time_s"].iloc[-1]),
        "inter_bytes_per_step": float(steps["inter_bytes_sent"].mean()),
        "intra_bytes_per_step": float(steps["intra_bytes"].mean()),
        "executor": IMPORTED,
        IMPORTED: {
            "files": [str(tl.source.path) for tl in job.timelines],
            "ranks_traced": [tl.rank for tl in job.timelines],
            "ranks_alike": {str(r): s for r, s in sorted(job.alike.items())},
            "device": job.device, "backend": job.backend,
            "timeline": "device" if job.timelines[0].device else "host",
            "shards": shards, "units": job.timelines[0].units,
            "profiler_steps": job.steps, "inferred": inferred,
            "unit_compute": _unit_compute(job),
            "left_out": _left_out(job),
        },
        **provenance(),
    }


def _inferred(job: Job, shards: bool, layout: list | None, workload: str,
              method: str) -> list[str]:
    """What the import took rather than read, beyond the groups (`assign_groups`)."""
    lines = []
    shapes = sum(1 for tl in job.timelines for c in tl.collectives if "elements" in c.inferred)
    if shapes:
        lines.append(f"element counts and types of {shapes} collectives: from their c10d ops' "
                     "input shapes (the backend wrote no record_param_comms)")
    if job.alike:
        which = (f"rank {_ranks(job.alike)} was" if len(job.alike) == 1 else
                 f"ranks {_ranks(job.alike)} were")
        lines.append(f"{which} not traced: each taken as alike to the traced rank of its local "
                     "index (or the first traced rank), its groups moved to its node and local "
                     "index")
    if job.timelines[0].device:
        where = ("the device's: compute kernels and copies, and the gaps where it waits on the "
                 "host; a collective from its NCCL kernel's start to its end, waited on where "
                 "the device last ran something before it ended (not at all if busy then)")
    elif all(tl.waits_named for tl in job.timelines):
        where = ("the host's: a collective from its issue to the end of the backend's work, "
                 "waited on during the trace's wait event in progress when it ended")
    else:
        where = ("the host's: a collective from its issue to the end of the backend's work, "
                 "waited on where the host last ran an op before it ended (Python between ops "
                 "reads as waiting: the trace holds no wait events)")
    lines.append(f"timeline: {where}")
    kind = "FSDP2 (it reduce-scatters)" if shards else "DDP (it all-reduces, shards nothing)"
    lines.append(f"parallelism: {kind}; replayed as a recording of the method {method}")
    if shards and layout is not None:
        lines.append("FSDP2 layout: each unit one flat tensor of G x its all-gathered shard (the "
                     "trace holds no parameter shapes; at another GPUs per node FSDP2's "
                     "per-parameter padding is not reproduced)")
    elif shards and workload == "imported":
        lines.append("FSDP2 layout: none (the trace names no FSDP2 units): replays at other GPUs "
                     "per node are refused")
    return lines


def _unit_compute(job: Job) -> dict[str, list[float]] | None:
    """Per FSDP2 unit its forward, backward, backward-tail and backward-end compute seconds
    a step (`units.PHASES`), the slowest rank's."""
    found = [tl.unit_seconds for tl in job.timelines if tl.unit_seconds is not None]
    if not found:
        return None
    slowest = {phase: [max(seconds[phase][u] for seconds in found)
                       for u in range(len(found[0][phase]))] for phase in PHASES}
    # The slowest rank's tail and end may be others': never more than the backward they are
    # parts of, the end first (it is the later part).
    slowest["backward_end"] = [min(e, b) for e, b in zip(slowest["backward_end"],
                                                         slowest["backward"], strict=True)]
    slowest["backward_tail"] = [min(t, b - e) for t, b, e in zip(
        slowest["backward_tail"], slowest["backward"], slowest["backward_end"], strict=True)]
    return slowest


def _ranks(alike: dict[int, int]) -> str:
    ranks = sorted(alike)
    return f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) and \
        len(ranks) > 2 else ", ".join(map(str, ranks))


def _left_out(job: Job) -> dict[str, int]:
    out: dict[str, int] = {}
    for tl in job.timelines:
        for what, n in tl.dropped.items():
            out[what] = out.get(what, 0) + n
    return out


def write_imported(job: Job, out: Path, method: str = "hsdp-adamw", workload: str = "imported",
                   batch_size: int | None = None) -> dict[str, Any]:
    """The run folder at `out` (built beside it, then renamed: a failure leaves nothing)."""
    trace = job.trace()
    steps = steps_table(job, trace)
    meta = imported_meta(job, trace, steps, method, workload, batch_size)
    out = Path(out)
    work = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        work.mkdir(parents=True)
        trace.to_parquet(work / "trace.parquet", index=False)
        steps.to_parquet(work / "steps.parquet", index=False)
        (work / "run.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
        if out.exists():
            out.rmdir()  # empty: checked before
        os.replace(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return meta
