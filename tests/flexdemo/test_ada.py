"""Ada: the rung follows a scripted spread; real gloo ranks agree on the graph and count alike."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
import torch.distributed as dist

import flexdemo
from experiments.cli import main
from flexdemo import AdaReplicator, graph_ladder
from flexdemo.graphs import fitting_graphs, mean_degree
from flexdemo.replicators.ada import AdaRule
from flexdemo.replicators.sampled_spread import SampledSpread
from netsim import shaping
from tests.dist_utils import inter_rows, run_ranks, shaped_world, train_step

HIGH, LOW = 0.1, 0.01


def _ticks(rule: AdaRule, measured_at: dict[int, float], rounds: int) -> tuple[list[int], list]:
    """The rung of every round, and the rounds at which the rule asked for a measurement."""
    asked: list[int] = []

    def measure_at(r: int):
        def measure() -> float:
            asked.append(r)
            return measured_at[r]
        return measure

    return [rule.tick(r, measure_at(r)) for r in range(rounds)], asked


def test_rule_follows_a_scripted_spread_with_hysteresis_and_clamps():
    rule = AdaRule(rungs=3, every=2, high=HIGH, low=LOW)
    script = {
        2: 0.005,   # below low: sparser, 2 -> 1
        4: 0.05,    # inside the band: stay on 1
        6: 0.001,   # below low: 1 -> 0
        8: 0.0,     # below low again: clamped at the sparsest
        10: 0.2,    # above high: 0 -> 1
        12: 0.5,    # above high: 1 -> 2
        14: 0.5,    # above high again: clamped at the densest
        16: HIGH,   # exactly on a threshold is inside the band
        18: LOW,
    }
    rungs, asked = _ticks(rule, script, 20)
    assert asked == sorted(script)  # measured every 2 rounds, never at round 0
    expected = [2, 2, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2]
    assert rungs == expected
    changed = [r for r in range(1, 20) if rungs[r] != rungs[r - 1]]
    assert all(r % 2 == 0 for r in changed)  # at most one move per measuring round
    assert rule.last_spread == LOW


def test_rule_starts_densest_and_holds_on_nan():
    rule = AdaRule(rungs=5, every=1, high=HIGH, low=LOW)
    assert rule.rung == 4
    assert rule.decide(math.nan) == 4
    assert [rule.decide(0.0) for _ in range(6)] == [3, 2, 1, 0, 0, 0]


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"ada_every": 0}, "ada_every=0 must be a positive integer."),
    ({"ada_high": 0.01, "ada_low": 0.1}, "ada_low=0.1 and ada_high=0.01 must be finite numbers "
                                         "with 0 <= ada_low < ada_high."),
    ({"ada_low": -1.0}, "ada_low=-1.0"),
    ({"ada_high": math.inf}, "ada_high=inf"),
    ({"ada_sample": 0}, "ada_sample=0 must be a positive integer."),
])
def test_bad_knobs_are_one_sentence(kwargs, words):
    with pytest.raises(ValueError) as err:
        AdaReplicator(**kwargs)
    assert words in str(err.value) and str(err.value).count(". ") == 0


def test_ladder_runs_from_sparse_to_dense_and_drops_equal_costs():
    assert graph_ladder(1) == []
    assert graph_ladder(2) == ["complete"]
    assert graph_ladder(4) == ["one-peer-exponential", "ring", "complete"]
    assert graph_ladder(8) == ["one-peer-exponential", "ring", "torus", "exponential", "complete"]
    for nodes in range(2, 17):
        ladder = graph_ladder(nodes)
        costs = [mean_degree(g, nodes) for g in ladder]
        assert costs == sorted(set(costs)), nodes  # strictly costlier, rung by rung
        assert set(ladder) <= set(fitting_graphs(nodes)) and costs[-1] == nodes - 1


def test_state_restores_rung_and_rounds_and_refuses_a_foreign_one():
    rep = AdaReplicator()
    rep.ladder, rep.rule = graph_ladder(4), AdaRule(3)  # as setup() leaves it on 4 nodes
    rep.load_state_dict({"rounds": 7, "rung": 0})
    assert (rep.rounds, rep.graph, rep.state_dict()) == (7, "one-peer-exponential",
                                                         {"rounds": 7, "rung": 0})
    with pytest.raises(ValueError, match="rung=4 is outside this ladder of 3 graphs"):
        rep.load_state_dict({"rounds": 7, "rung": 4})


def test_sample_is_seeded_inside_the_shard_and_whole_when_small():
    params = [torch.randn(50, 40), torch.randn(7), torch.randn(300)]
    a, b = SampledSpread(params, sample=500, seed=3), SampledSpread(params, sample=500, seed=3)
    assert all(torch.equal(i, j) for i, j in zip(a.index, b.index, strict=True))
    assert 0 < a.entries <= 500
    assert all(int(i.max()) < p.numel() for i, p in zip(a.index, params, strict=True) if len(i))
    whole = SampledSpread(params, sample=10_000)
    flat = torch.cat([p.reshape(-1) for p in params]).double()
    assert torch.equal(whole.values(params), flat)


# --- real ranks --------------------------------------------------------------------------


def _step(model, opt, recorder, rank: int, step: int) -> dict[str, int]:
    """One training step on this rank's own data; netsim's inter-node record of it."""
    train_step(model, opt, recorder, rank, step)
    rows = inter_rows(recorder, step)
    return {"bytes_sent": int(rows["bytes_sent"].sum()),
            "bytes_received": int(rows["bytes_received"].sum()), "calls": len(rows)}


def _agreed(value) -> bool:
    """Whether every rank of the world holds the same ``value`` (NaN equal to NaN)."""
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, repr(value))
    return all(v == seen[0] for v in seen)


def _walk_the_ladder(rank, world):
    # Far above any spread: every measurement says "sparser" until the thresholds change.
    recorder, model, mesh, opt = shaped_world(rank, 4, 1, "ada", ada_every=2, ada_low=1e6,
                                              ada_high=2e6)
    rep = opt.replicator
    try:
        graphs, calls = [], []
        for step in range(1, 15):
            if step == 8:  # from here every measurement says "denser"
                rep.rule.low, rep.rule.high = 0.0, 1e-12
            recorded = _step(model, opt, recorder, rank, step)
            assert opt.last_step_comm == recorded, step  # gossip and measurement alike
            assert _agreed((rep.graph, rep.rule.last_spread)), step
            graphs.append(rep.graph)
            calls.append(recorded["calls"])
        top, mid, low = "complete", "ring", "one-peer-exponential"
        # Rounds 0-1 (steps 1-2) on the top, a move every 2 rounds, clamped at both ends.
        assert graphs == [top, top, mid, mid, low, low, low, low, mid, mid, top, top, top, top]
        # A send and a receive per peer, the complete graph one all-reduce; a measuring round
        # (steps 3, 5, ...) adds one all-reduce.
        exchanges = {top: 1, mid: 2 * 2, low: 2 * 1}
        assert calls == [exchanges[g] + (step % 2 == 1 and step > 1)
                         for step, g in enumerate(graphs, start=1)]
    finally:
        shaping.uninstall()


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_ada_on_4_nodes_walks_the_ladder_and_all_ranks_agree():
    run_ranks(_walk_the_ladder, 4)


def _agree_inside_the_node(rank, world):
    recorder, model, mesh, opt = shaped_world(rank, 2, 2, "ada", ada_every=1)
    rep = opt.replicator
    try:
        for step in range(1, 4):
            recorded = _step(model, opt, recorder, rank, step)
            assert opt.last_step_comm == recorded, step
            # Measured before mixing: the same nonzero number on all four ranks.
            assert rep.rule.last_spread > 0 or step == 1
            assert _agreed(rep.rule.last_spread)
        shards = [flexdemo.local_tensor(p) for p in model.parameters()]
        with torch.no_grad():  # the nodes' replicas apart again (the complete graph joined them)
            g = torch.Generator().manual_seed(rank // 2)
            for shard in shards:
                shard.add_(torch.randn(shard.shape, generator=g), alpha=0.01)
        measured = rep.probe.measure(shards, rep.group, rep.ranks, rep.node_group,
                                     flexdemo.CommStats())
        # The two ranks of a node hold different shards; the sum over both is the model's metric.
        _, distance = flexdemo.replica_spread(model.parameters(), flexdemo.replicate_group(mesh))
        assert rep.node_group is not None and distance > 1e-3
        assert measured == pytest.approx(distance, rel=1e-9) and _agreed(measured)
    finally:
        shaping.uninstall()


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_ada_on_2_nodes_of_2_ranks_measures_the_whole_model_on_every_rank():
    run_ranks(_agree_inside_the_node, 4)


@pytest.mark.dist
@pytest.mark.timeout(200)
def test_flexbench_run_ada_writes_the_graph_column(tmp_path):
    out = tmp_path / "ada"
    argv = ["run", "--method", "ada", "--nodes", "4", "--gpus-per-node", "1", "--workload",
            "vision-tiny", "--steps", "4", "--eval-every", "4", "--ada-every", "1",
            "--ada-low", "1e6", "--ada-high", "2e6", "--out", str(out)]
    assert main(argv) == 0
    steps = pd.read_parquet(out / "steps.parquet")
    assert steps["graph"].tolist() == ["complete", "ring", "one-peer-exponential",
                                       "one-peer-exponential"]
    # Busiest rank: one all-reduce on complete, then 2 + 2 or 1 + 1 messages, plus a measurement.
    assert steps["inter_calls"].tolist() == [1, 2 * 2 + 1, 2 + 1, 2 + 1]


@pytest.mark.parametrize(("flags", "words"), [
    (["--method", "ada", "--nodes", "1"], "ada needs at least 2 nodes"),
    (["--method", "ada", "--ada-low", "0.2", "--ada-high", "0.1"],
     "ada_low=0.2 and ada_high=0.1 must be finite numbers with 0 <= ada_low < ada_high."),
    (["--method", "ada", "--ada-every", "0"], "argument --ada-every: must be an integer >= 1"),
    (["--method", "ada", "--graph", "ring"], "method 'ada' does not read graph; it takes"),
])
def test_bad_ada_settings_are_one_sentence_and_write_nothing(tmp_path, capsys, flags, words):
    assert main(["run", "--out", str(tmp_path / "run"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and words in err, err
    assert list(tmp_path.iterdir()) == []
