"""What a plan must hold of a recorded run: every training step's collectives, rank by rank.

The run is planned at its own shape and knobs (lm-tiny or another built-in workload, CPU gloo,
no mixed precision: everything fp32), with param_dtype=reduce_dtype=fp32 and gloo's algorithms
(its reduce-scatter runs as an all-reduce, which sets the wire bytes), so every collective's op
kind, payload and wire bytes, and every message's peer, must be the recording's. A step right
after an evaluation is the one exception, and a known one: the evaluation's forward left the
root unit gathered, so the recording lacks that step's first all-gather (the root's).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from experiments.plan.hardware import given_compute
from experiments.plan.models import declare_model
from experiments.plan.synth import Precision, Shape, synthesize
from flexdemo.methods import method_record


def per_step(trace: pd.DataFrame) -> pd.Series:
    """Per (step, rank): every training collective as (op, inter, bytes, sent, received, peer)."""
    rows = trace[(trace["phase"] == "train") & (trace["kind"] == "collective")]
    return rows.groupby(["step", "rank"]).apply(
        lambda g: tuple(sorted(zip(g["op"], g["inter"], g["bytes"], g["bytes_sent"],
                                   g["bytes_received"], g["peer"], strict=True))))


def plan_of_run(run: Path) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """(the recorded trace, the plan's trace of the same steps, the run's config)."""
    recorded = pd.read_parquet(run / "trace.parquet")
    config = json.loads((run / "run.json").read_text())["config"]
    model = declare_model(config["workload"])
    record = method_record(config["method"])
    knobs, _ = record.settings({k: config[k] for k in record.takes if k in config})
    compute = given_compute([model.unit_params(u) for u in range(len(model.units))], 0.1)
    shape = Shape(int(config["nodes"]), int(config["gpus_per_node"]))  # the recording's
    planned = synthesize(record, knobs, model, shape, compute, Precision("fp32", "fp32"),
                         int(recorded["step"].max()), backend="gloo")
    return recorded, planned, config


def assert_plan_holds(recorded: pd.DataFrame, planned: pd.DataFrame, config: dict) -> int:
    """Assert the plan holds the recording's collectives step by step (module docstring); the
    number of (step, rank) pairs that match with nothing left out."""
    model = declare_model(config["workload"])
    record = method_record(config["method"])
    ours, theirs = per_step(planned), per_step(recorded)
    assert set(ours.index) == set(theirs.index)
    shards = record.shards and int(config["gpus_per_node"]) > 1
    # Only FSDP2 at several ranks a node gathers the root, which an evaluation leaves gathered.
    evals = int(config["eval_every"]) if shards else int(recorded["step"].max()) + 1
    root_gather = ("all_gather", False, model.unit_params(len(model.units) - 1) // 2 * 4)
    exact = 0
    for key in theirs.index:
        step = key[0]
        if step > 1 and (step - 1) % evals == 0:
            missing = list(ours[key])
            gathered = next(op for op in missing if op[:3] == root_gather)
            missing.remove(gathered)
            assert tuple(missing) == theirs[key], key
        else:
            assert ours[key] == theirs[key], key
            exact += 1
    return exact
