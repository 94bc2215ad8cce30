"""A replica spanning K nodes (`--nodes-per-replica`): shards, periods and bytes by hand."""

from __future__ import annotations

import dataclasses

import pytest

from experiments.cli import main
from experiments.plan.hardware import given_compute
from experiments.plan.models import declare_model
from experiments.plan.plan import memory, plan_method
from experiments.plan.replicas import replica_topology
from experiments.plan.synth import Precision
from flexdemo.methods import method_record
from netsim import Link, Topology
from netsim.costs import ring_all_reduce_time

MODEL = "gpt:dim=256,layers=4,heads=4,vocab=1000,ffn=1024,tied=false"
GBIT = 1e9 / 8
NODES, K = 8, 2


def _plan(method: str, step_s: float, bandwidth: float, k: int = K, **knobs):
    model = declare_model(MODEL)
    record = method_record(method)
    settings, _ = record.settings(knobs)
    compute = given_compute([model.unit_params(u) for u in range(len(model.units))], step_s)
    topology = replica_topology(Topology(NODES, 1, Link(100e9, 0.0), Link(bandwidth, 0.0)), k)
    plan = plan_method(record, settings, model, [topology], ["x"], compute, Precision(),
                       algorithm="ring", nodes_per_replica=k)
    return model, plan


def test_a_replica_of_k_nodes_is_one_node_of_k_times_the_gpus_and_nics():
    topology = replica_topology(Topology(NODES, 4, Link(100e9, 5e-6), Link(GBIT, 1e-3)), K)
    assert (topology.nodes, topology.accelerators_per_node) == (NODES // K, 4 * K)
    assert topology.inter.bandwidth == K * GBIT
    # The FSDP2 ring across a replica's nodes is paced by the link between them, whose NICs
    # it shares with the exchange.
    assert (topology.intra.bandwidth, topology.intra.latency) == (GBIT, 1e-3)
    assert topology.node_span == K


def _step_time(method: str, topology: Topology, **knobs) -> float:
    model = declare_model(MODEL)
    record = method_record(method)
    settings, _ = record.settings(knobs)
    compute = given_compute([model.unit_params(u) for u in range(len(model.units))], 0.05)
    plan = plan_method(record, settings, model, [topology], ["x"], compute, Precision(),
                       algorithm="ring", nodes_per_replica=K)
    return plan.points[0].step_time_s


@pytest.mark.parametrize("method", ["none", "hsdp-adamw"])
def test_fsdp2_between_a_replicas_nodes_shares_their_links(method):
    # On a slow link between nodes, a unit's all-gather prefetched during the backward, the
    # reduce-scatters, and (hsdp-adamw) each unit's gradient all-reduce overlap in time: on
    # shared NICs they slow each other, so the step is longer than with FSDP2's traffic on a
    # link of its own (what the plan priced before the NICs were shared).
    topology = replica_topology(Topology(NODES, 1, Link(100e9, 0.0), Link(GBIT / 10, 0.0)), K)
    shared = _step_time(method, topology)
    apart = _step_time(method, dataclasses.replace(topology, node_span=1))
    assert shared > apart * 1.1


def test_memory_divides_over_k_times_g_shards():
    model = declare_model(MODEL)
    record = method_record("diloco")
    knobs = record.settings({})[0]
    spanning = memory(record, knobs, model, K * 2, NODES // K, Precision())
    wide = memory(record, knobs, model, K * 2, NODES, Precision())
    alone = memory(record, knobs, model, 2, NODES, Precision())
    assert spanning == wide  # only the shard count sets the memory
    assert spanning.params == pytest.approx(alone.params / K, rel=1e-3)


@pytest.mark.parametrize("method", ["diloco", "streaming-diloco"])
def test_periodic_methods_pay_their_syncs_over_a_whole_period(method):
    # Every sync is an all-reduce between the NODES / K replicas, of each GPU's shard, over the
    # K nodes' links side by side; its cost is spread over the whole period (H steps, or one
    # full fragment cycle), whatever the step the sync falls on. It starts after FSDP2's last
    # reduce-scatter, which the 1 Gbit/s link between a replica's nodes leaves exposed: the
    # inner step it follows needs every gradient.
    h, step_s = 12, 0.5
    knobs = ({"diloco_h": h} if method == "diloco" else
             {"sync_every": h, "num_fragments": 4, "fragment_sync_delay": 0,
              "fragment_cut": "elements"})
    model, plan = _plan(method, step_s, GBIT, **knobs)
    _, quiet = _plan("diloco", step_s, GBIT, diloco_h=10**6)
    outer = ring_all_reduce_time(NODES // K, model.params * 4, Link(K * GBIT, 0.0))
    assert plan.period == h
    assert plan.points[0].step_time_s == pytest.approx(quiet.points[0].step_time_s + outer / h,
                                                       rel=2e-3)
    # Per node: a replica's sync over its K nodes.
    row = plan.frame().iloc[0]
    replicas = NODES // K
    per_round = 2 * (replicas - 1) / replicas * model.params * 4 / K
    assert row["bytes_per_node_step"] * h == pytest.approx(per_round, rel=2e-3)


def test_fsdp2_across_nodes_costs_the_link_between_them():
    # No exchange at all: one node a replica (one GPU) runs FSDP2 on nothing; two nodes a
    # replica all-gather and reduce-scatter across the 1 Gbit/s link, which the step exposes.
    _, one = _plan("none", 0.5, GBIT, k=1)
    _, two = _plan("none", 0.5, GBIT, k=2)
    assert one.points[0].step_time_s == pytest.approx(0.5, rel=1e-6)
    assert two.points[0].step_time_s > 0.5 + 1e-3
    _, hsdp = _plan("hsdp-adamw", 0.5, GBIT, k=2)
    _, alone = _plan("hsdp-adamw", 0.5, GBIT, k=1)
    # Per node: the all-reduce between 4 replicas of half shards instead of 8 of whole ones.
    assert hsdp.points[0].bytes_per_node_step < alone.points[0].bytes_per_node_step


BASE = ["plan", "--model", MODEL, "--nodes", "6", "--gpus-per-node", "2", "--inter-lat", "1ms",
        "--inter-bw", "1Gbit", "--step-compute", "0.1"]


@pytest.mark.parametrize(("extra", "words"), [
    (["--method", "diloco", "--nodes-per-replica", "4"],
     "--nodes-per-replica 4 does not divide --nodes 6 into whole replicas; use one of 1, 2, 3, 6."),
    (["--method", "demo", "--nodes-per-replica", "2"], "--method demo shards nothing"),
    (["--method", "diloco", "--nodes-per-replica", "0"],
     "argument --nodes-per-replica: must be an integer >= 1, got '0'."),
])
def test_a_k_that_does_not_cut_the_nodes_is_refused(tmp_path, capsys, extra, words):
    assert main([*BASE, *extra, "--out", str(tmp_path / "p.csv")]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_a_replica_spanning_nodes_is_planned_and_says_so(tmp_path, capsys):
    assert main([*BASE, "--method", "hsdp-adamw", "streaming-diloco", "--nodes-per-replica", "3",
                 "--set", "num_fragments=2", "--out", str(tmp_path / "p.csv")]) == 0
    out = capsys.readouterr().out
    assert "replicas: 2 of 3 nodes each, FSDP2 over 6 GPUs" in out


def test_every_method_names_the_algorithm_of_its_exchange_even_when_few_steps_send_it(
        tmp_path, capsys):
    # diloco's first replayed step sends nothing (1 in diloco_h steps does); the algorithm its
    # outer all-reduce was priced with is still printed.
    assert main([*BASE, "--method", "hsdp-adamw", "diloco", "--set", "diloco_h=10",
                 "--out", str(tmp_path / "p.csv")]) == 0
    out = capsys.readouterr().out
    assert "diloco: inter-node algorithm all_reduce: ring (6 nodes," in out
