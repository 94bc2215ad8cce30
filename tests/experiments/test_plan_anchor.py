"""The plan of lm-tiny holds, step by step, the bytes its recordings hold.

The recordings are results/standard's and results/overlap's at 2 x 2, results/quick's at
2 x 1, and the gossip runs of results/decentralized and results/decentralized-scale at 4-16
nodes of one rank; each is planned at its own shape and knobs and must hold every collective
the recording holds (`tests/experiments/plan_anchor.py`). The methods added since are held
against the runs their own tests record (test_run_compressed_methods.py, test_powersgd.py,
test_topk.py).
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
from tests.experiments.plan_anchor import assert_plan_holds, per_step, plan_of_run

RESULTS = Path(__file__).resolve().parents[2] / "results"


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
    recorded, planned, config = plan_of_run(RESULTS / unit)
    exact = assert_plan_holds(recorded, planned, config)
    assert exact >= 0.8 * len(per_step(recorded))
    if method_record(config["method"]).replicator == "diloco":  # on the recorded steps
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
    ours, theirs = per_step(planned), per_step(recorded)
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
