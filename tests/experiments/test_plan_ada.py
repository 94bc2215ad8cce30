"""Ada in a plan: gossip on each stated graph plus its measurements, weighted by the steps."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from experiments.cli import main
from experiments.plan.ada import GraphSchedule, plan_ada
from experiments.plan.hardware import given_compute
from experiments.plan.models import declare_model
from experiments.plan.plan import plan_method
from experiments.plan.synth import AdaOnGraph, Precision, local_shard_shapes
from flexdemo.methods import method_record
from flexdemo.replicators.ada import sampled_entries
from netsim import Link, Topology
from netsim.costs import ring_all_reduce_time

MODEL = "gpt:dim=256,layers=4,heads=4,vocab=1000,ffn=1024,tied=false"
NODES = 8
LINK = Link(1e9 / 8, 0.01)


def _plan(method: str, knobs: object):
    model = declare_model(MODEL)
    compute = given_compute([model.unit_params(u) for u in range(len(model.units))], 0.2)
    topology = Topology(NODES, 1, Link(100e9, 0.0), LINK)
    return plan_method(method_record(method), knobs, model, [topology], ["x"], compute,
                       Precision(), algorithm="ring")


@pytest.mark.parametrize("graph", ["ring", "complete"])
def test_ada_on_a_graph_is_gossip_there_plus_a_measurement_every_ada_every_rounds(graph):
    # Every 10th round first all-reduces the sampled entries and their sum of squares
    # (float64) over the 8 replicas, blocking, then 1 us of arithmetic: a tenth of that a step.
    ada = method_record("ada").settings({})[0]
    on_graph = _plan("ada", AdaOnGraph(ada, graph))
    gossip = _plan("gossip", method_record("gossip").settings({"graph": graph})[0])
    model = declare_model(MODEL)
    entries = sampled_entries(local_shard_shapes(model, 1, 0), ada.ada_sample, ada.seed)
    measure = ring_all_reduce_time(NODES, (entries + 1) * 8, LINK) + 1e-6
    assert on_graph.period == ada.ada_every
    assert on_graph.points[0].step_time_s == pytest.approx(
        gossip.points[0].step_time_s + measure / ada.ada_every, rel=1e-9)
    extra = 2 * (NODES - 1) / NODES * (entries + 1) * 8 / ada.ada_every
    assert on_graph.points[0].bytes_per_node_step == pytest.approx(
        gossip.points[0].bytes_per_node_step + extra, rel=1e-9)


def test_ada_is_its_graphs_plans_weighted_by_the_steps_on_each():
    ada = method_record("ada").settings({})[0]
    schedule = GraphSchedule({"complete": 30, "ring": 70}, "as given")
    plan = plan_ada(ada, schedule, lambda knobs: _plan("ada", knobs))
    dense, sparse = (_plan("ada", AdaOnGraph(ada, g)) for g in ("complete", "ring"))
    assert plan.points[0].step_time_s == pytest.approx(
        0.3 * dense.points[0].step_time_s + 0.7 * sparse.points[0].step_time_s, rel=1e-12)
    # The largest graph's memory: the ring's two inboxes; the complete graph all-reduces.
    assert plan.memory == sparse.memory and sparse.memory.total > dense.memory.total
    assert plan.notes[0].startswith("ada: steps on each graph complete 30 (30%), ring 70 (70%)")


BASE = ["plan", "--model", "lm-tiny", "--nodes", "8", "--gpus-per-node", "1", "--inter-lat",
        "1ms", "--inter-bw", "1Gbit", "--step-compute", "0.1", "--method", "ada"]


def _run(tmp_path, name: str, method: str, nodes: int, workload: str = "lm-tiny"):
    run = tmp_path / name
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"config": {"method": method, "nodes": nodes,
                                                         "workload": workload}}))
    pd.DataFrame({"step": [1, 2, 3], "graph": ["complete", "complete", "ring"]}).to_parquet(
        run / "steps.parquet")
    return str(run)


def test_a_recorded_schedule_is_planned_and_named(tmp_path, capsys):
    run = _run(tmp_path, "ada-nodes=8-s0", "ada", 8)
    assert main([*BASE, "--ada-graphs", run, "--out", str(tmp_path / "p.csv")]) == 0
    out = capsys.readouterr().out
    assert f"complete 2 (67%), ring 1 (33%), from the run {run} (3 steps)" in out


@pytest.mark.parametrize(("extra", "words"), [
    ([], "--method ada picks its graph from the replica spread it measures"),
    (["--ada-graphs", "complete=80,star=20"],
     "--ada-graphs names star, not on Ada's ladder at 8 replicas (one-peer-exponential, ring, "
     "torus, exponential, complete)."),
    (["--ada-graphs", "complete=0"], "'complete=0' must be GRAPH=STEPS"),
    (["--ada-graphs", "ring=1,ring=2"], "names ring twice"),
    (["--ada-graphs", "RUN:gossip:8"], "is a run of 'gossip', not ada"),
    (["--ada-graphs", "RUN:ada:16"], "ran on 16 nodes, and Ada's graphs follow the node count"),
    (["--ada-graphs", "RUN:ada:8:vision-tiny"], "trained workload 'vision-tiny', not --model"),
    (["--ada-graphs", "nowhere"], "--ada-graphs nowhere is neither GRAPH=STEPS pairs nor a run"),
])
def test_a_schedule_that_cannot_be_planned_is_refused(tmp_path, capsys, extra, words):
    if extra and extra[1].startswith("RUN:"):
        _, method, nodes, *workload = extra[1].split(":")
        extra = ["--ada-graphs", _run(tmp_path, "r", method, int(nodes), *workload)]
    out = tmp_path / "out"
    out.mkdir()
    assert main([*BASE, *extra, "--out", str(out / "p.csv")]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1
    assert list(out.iterdir()) == []


def test_ada_graphs_without_ada_is_refused(tmp_path, capsys):
    args = [a if a != "ada" else "gossip" for a in BASE]
    assert main([*args, "--ada-graphs", "ring=1", "--out", str(tmp_path / "p.csv")]) == 2
    assert "--method does not plan ada" in capsys.readouterr().err
