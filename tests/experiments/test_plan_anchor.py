"""The plan of lm-tiny holds, step by step, the bytes its recordings hold.

The recordings are results/standard's and results/overlap's at 2 x 2, results/quick's at
2 x 1, and the gossip runs of results/decentralized and results/decentralized-scale at 4-16
nodes of one rank (CPU gloo, no mixed precision: everything fp32); each is planned at its own
shape and knobs, with param_dtype=reduce_dtype=fp32 and gloo's algorithms (its reduce-scatter
runs as an all-reduce, which sets the wire bytes), so every collective's payload and wire
bytes, and every gossip message's peer, must be the recording's. A step right after an
evaluation is the one exception, and a known one: the evaluation's forward left the root unit
gathered, so the recording lacks that step's first all-gather (the root's).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from experiments.plan.hardware import given_compute
from experiments.plan.models import declare_model
from experiments.plan.synth import AdaOnGraph, Precision, Shape, synthesize
from flexdemo.methods import method_record

RESULTS = Path(__file__).resolve().parents[2] / "results"


def _per_step(trace: pd.DataFrame) -> pd.Series:
    """Per (step, rank): every training collective as (op, inter, bytes, sent, received, peer)."""
    rows = trace[(trace["phase"] == "train") & (trace["kind"] == "collective")]
    return rows.groupby(["step", "rank"]).apply(
        lambda g: tuple(sorted(zip(g["op"], g["inter"], g["bytes"], g["bytes_sent"],
                                   g["bytes_received"], g["peer"], strict=True))))


@pytest.mark.parametrize("unit", ["standard/units/hsdp-adamw-s0", "standard/units/flexdemo-s0",
                                  "standard/units/diloco-s0",
                                  "quick/units/hsdp-adamw-s0", "quick/units/flexdemo-s0",
                                  "quick/units/diloco-s0",
                                  "quick/units/demo-chunking=flat_topk=4-s0",
                                  "quick/units/flexdemo-decay=0.9-s0",
                                  "standard/units/demo-chunking=flat_topk=4-s0",
                                  "overlap/units/flexdemo-async-lookahead=True-s0",
                                  "overlap/units/streaming-diloco-s0",
                                  "overlap/units/flexdemo-adamw-lr=0.001-s0",
                                  "decentralized/units/gossip-nodes=4_graph=ring-s0",
                                  "decentralized/units/gossip-nodes=8_graph=torus-s0",
                                  "decentralized/units/gossip-nodes=8_graph=one-peer-exponential-s0",
                                  "decentralized-scale/units/gossip-nodes=16_graph=sites_4-s0"])
def test_plan_holds_the_recorded_bytes(unit):
    recorded_dir = RESULTS / unit
    recorded = pd.read_parquet(recorded_dir / "trace.parquet")
    config = json.loads((recorded_dir / "run.json").read_text())["config"]
    steps = int(recorded["step"].max())
    model = declare_model(config["workload"])
    record = method_record(config["method"])
    knobs, _ = record.settings({k: config[k] for k in record.takes if k in config})
    compute = given_compute([model.unit_params(u) for u in range(len(model.units))], 0.1)
    shape = Shape(int(config["nodes"]), int(config["gpus_per_node"]))  # the recording's
    planned = synthesize(record, knobs, model, shape, compute, Precision("fp32", "fp32"),
                         steps, backend="gloo")
    ours, theirs = _per_step(planned), _per_step(recorded)
    assert set(ours.index) == set(theirs.index)
    # Only FSDP2 at several ranks a node gathers the root, which an evaluation leaves gathered.
    evals = int(config["eval_every"]) if record.shards and shape.per_node > 1 else steps + 1
    root_gather = ("all_gather", False, model.unit_params(len(model.units) - 1) // 2 * 4)
    exact = 0
    for key in theirs.index:
        step = key[0]
        if step > 1 and (step - 1) % evals == 0 and shape.per_node > 1:  # 2 x 1 gathers nothing
            missing = list(ours[key])
            gathered = next(op for op in missing if op[:3] == root_gather)
            missing.remove(gathered)
            assert tuple(missing) == theirs[key], key
        else:
            assert ours[key] == theirs[key], key
            exact += 1
    assert exact >= 0.8 * len(theirs)
    if record.replicator == "diloco":  # the outer all-reduce falls on the recorded steps
        inter = recorded[(recorded["kind"] == "collective") & recorded["inter"]]
        mine = planned[(planned["kind"] == "collective") & planned["inter"]]
        assert sorted(inter["step"].unique()) == sorted(mine["step"].unique()) == [50, 100]


def test_the_plan_of_ada_on_its_recorded_graphs_holds_the_recorded_bytes():
    # A real run of ada at 16 x 1 (lm-tiny, 100 steps): each step planned as Ada on the graph
    # the run gossiped on then (its steps.parquet) holds that step's messages, peer by peer,
    # and on every measuring round (steps 11, 21, ...) the spread's all-reduce of the sampled
    # entries, sized by SampledSpread itself; on the complete graph the shard's all-reduce.
    run = RESULTS / "decentralized-emulated/traces/lm-tiny/ada"
    recorded = pd.read_parquet(run / "trace.parquet")
    config = json.loads((run / "run.json").read_text())["config"]
    graphs = pd.read_parquet(run / "steps.parquet").set_index("step")["graph"]
    assert {"complete", "exponential"} <= set(graphs)  # the graph changed during the run
    model = declare_model(config["workload"])
    record = method_record("ada")
    knobs, _ = record.settings({k: config[k] for k in record.takes if k in config})
    compute = given_compute([model.unit_params(u) for u in range(len(model.units))], 0.1)
    shape = Shape(int(config["nodes"]), int(config["gpus_per_node"]))
    planned = pd.concat([synthesize(record, AdaOnGraph(knobs, graphs[step]), model, shape,
                                    compute, Precision("fp32", "fp32"), 1, backend="gloo",
                                    first=int(step)) for step in graphs.index],
                        ignore_index=True)
    ours, theirs = _per_step(planned), _per_step(recorded)
    assert set(ours.index) == set(theirs.index)
    for key in theirs.index:
        assert ours[key] == theirs[key], key
    # The complete graph's rounds are the shard's all-reduce; the measurement's is far smaller.
    reduced = planned[(planned["op"] == "all_reduce") & planned["inter"]]
    complete = set(graphs.index[graphs == "complete"])
    mixing = reduced[reduced["step"].isin(complete) & (reduced["bytes"] > 2**20)]
    assert set(mixing["step"]) == complete
    measured = reduced.drop(mixing.index)
    assert sorted(measured["step"].unique()) == list(range(11, 101, 10))
