"""Collective algorithm choice in the model (ring, tree, Bruck) and stragglers setting the pace."""

import re
from pathlib import Path

import pytest

from experiments.cli import main
from netsim import Link, ReplayOptions, Topology, simulate
from netsim.costs import (
    BRUCK_EFFICIENCY,
    TREE_EFFICIENCY,
    choose_algorithm,
    collective_volume,
    ring_all_gather_time,
    ring_all_reduce_time,
)
from netsim.model import AlgorithmChoice, algorithm_summary
from tests.netsim.test_model import make_trace

ROOT = Path(__file__).resolve().parents[2]
HSDP_RUN = ROOT / "results" / "quick" / "units" / "hsdp-adamw-s0"


def tree_all_reduce_time(p: int, n: float, link: Link) -> float:
    """Tree all-reduce closed form: 2 floor(log2 p) hops, 2n at 0.92 of the goodput."""
    hops = 2 * (p.bit_length() - 1)
    return hops * link.latency + 2 * n / (TREE_EFFICIENCY * link.effective_bandwidth)


def bruck_all_gather_time(p: int, n: float, link: Link) -> float:
    """Bruck all-gather closed form: ceil(log2 p) rounds, (p-1)n at 0.75 of the goodput."""
    rounds = (p - 1).bit_length()
    return rounds * link.latency + (p - 1) * n / (BRUCK_EFFICIENCY * link.effective_bandwidth)


WAN = Link("10Gbit", "1ms")


@pytest.mark.parametrize("p", [16, 64, 1024])
def test_tree_is_chosen_at_many_nodes_for_small_messages(p):
    assert choose_algorithm("all_reduce", p, 400_000, WAN) == "tree"
    assert choose_algorithm("all_gather", p, 20_000, WAN) == "bruck"
    assert choose_algorithm("reduce_scatter", p, 20_000, WAN) == "bruck"


@pytest.mark.parametrize("p", [2, 3, 4])
def test_ring_is_chosen_for_large_messages_on_few_nodes(p):
    assert choose_algorithm("all_reduce", p, 500_000_000, WAN) == "ring"
    assert choose_algorithm("all_gather", p, 100_000_000, WAN) == "ring"


@pytest.mark.parametrize("nbytes", [0, 1, 10_000, 10**6, 10**9])
def test_two_nodes_always_take_the_ring(nbytes):
    # Same hop count (2 and 1), and the log-depth algorithms move more or slower bytes.
    assert choose_algorithm("all_reduce", 2, nbytes, WAN) == "ring"
    assert choose_algorithm("all_gather", 2, nbytes, WAN) == "ring"


def test_auto_is_the_cheaper_closed_form():
    for p in (3, 8, 12, 100, 1024):
        for n in (1e3, 1e5, 1e7, 1e9):
            ring = ring_all_reduce_time(p, n, WAN)
            tree = tree_all_reduce_time(p, n, WAN)
            picked = collective_volume(
                "all_reduce", p, n, choose_algorithm("all_reduce", p, n, WAN)
            ).time(WAN)
            assert picked == pytest.approx(min(ring, tree), rel=1e-9)


def test_forced_algorithms_and_what_keeps_its_own():
    assert choose_algorithm("all_reduce", 1024, 1e3, WAN, mode="ring") == "ring"
    assert choose_algorithm("all_reduce", 3, 1e9, WAN, mode="tree") == "tree"
    assert choose_algorithm("all_gather", 3, 1e9, WAN, mode="tree") == "bruck"
    # NCCL offers its log-depth all-gather (PAT) only with one rank per node.
    assert choose_algorithm("all_gather", 1024, 1e3, WAN, one_per_node=False) == "ring"
    # Gloo's reduce-scatter is an all-reduce, broadcasts pipeline: neither has an alternative.
    assert choose_algorithm("reduce_scatter", 64, 1e3, WAN, "allreduce", "tree") == "allreduce"
    assert choose_algorithm("broadcast", 64, 1e3, WAN, "pipeline", "tree") == "pipeline"
    with pytest.raises(ValueError, match="algorithm 'fast' is not known"):
        choose_algorithm("all_reduce", 4, 1e3, WAN, mode="fast")
    with pytest.raises(ValueError, match="bruck an all_gather"):
        collective_volume("all_reduce", 4, 1e3, "bruck")


@pytest.mark.parametrize("nodes", [4, 12, 16])
@pytest.mark.parametrize("mode", ["auto", "ring", "tree"])
def test_model_matches_the_chosen_closed_form(nodes, mode):
    topo = Topology.from_strings(nodes, 1, "80Mbit", "10ms")
    ops = (("all_reduce", "ring", 2_000_000), ("all_gather", "ring", 200_000))
    trace = make_trace(topo, steps=1, compute=0.0, ops=ops)
    out = simulate(trace, topo, ReplayOptions(algorithm=mode))
    link = topo.inter
    reduce = {
        "ring": ring_all_reduce_time(nodes, 2e6, link),
        "tree": tree_all_reduce_time(nodes, 2e6, link),
    }
    gather = {
        "ring": ring_all_gather_time(nodes, nodes * 2e5, link),
        "bruck": bruck_all_gather_time(nodes, 2e5, link),
    }
    picked = {choice.op: choice.algorithm for choice in out.algorithms}
    if mode == "auto":
        assert reduce[picked["all_reduce"]] == min(reduce.values())
        assert gather[picked["all_gather"]] == min(gather.values())
    else:
        assert picked == {
            "all_reduce": mode,
            "all_gather": "ring" if mode == "ring" else "bruck",
        }
    expected = reduce[picked["all_reduce"]] + gather[picked["all_gather"]]
    assert out.frame["step_time_s"].iloc[0] == pytest.approx(expected, rel=0.01)


def test_bad_algorithm_fails_clearly():
    topo = Topology.from_strings(2, 1, "80Mbit", "10ms")
    with pytest.raises(ValueError, match="algorithm 'nccl' is not known; use one of auto, ring"):
        simulate(make_trace(topo, steps=1), topo, ReplayOptions(algorithm="nccl"))


@pytest.mark.parametrize("mode", ["auto", "ring", "tree"])
@pytest.mark.parametrize("speeds", [[1, 1, 1, 1, 1, 1, 1, 0.25], [0.5, 1, 1, 0.2, 1, 1, 1, 1]])
def test_the_slowest_node_sets_the_pace_of_a_collective(mode, speeds):
    # Heterogeneous nodes: every member of a ring (or tree) waits for the last to arrive, so the
    # step is the slowest node's compute plus the collective's closed form.
    topo = Topology.from_strings(8, 1, "80Mbit", "10ms", node_speed=speeds)
    trace = make_trace(topo, steps=3, compute=0.1)
    out = simulate(trace, topo, ReplayOptions(algorithm=mode))
    algorithm = out.algorithms[0].algorithm
    comm = collective_volume("all_reduce", 8, 1e6, algorithm).time(topo.inter)
    closed = {
        "ring": ring_all_reduce_time(8, 1e6, topo.inter),
        "tree": tree_all_reduce_time(8, 1e6, topo.inter),
    }
    assert comm == pytest.approx(closed[algorithm], rel=1e-9)
    expected = 0.1 / min(speeds) + comm
    assert out.frame["step_time_s"].tolist() == pytest.approx([expected] * 3, rel=0.01)


def test_simulate_command_prints_the_assumed_algorithm(tmp_path, capsys):
    argv = ["simulate", str(HSDP_RUN), "--inter-bw", "10Gbit", "--inter-lat", "1ms",
            "--nodes", "1024", "--steps", "2", "--out", str(tmp_path / "auto.csv")]  # fmt: skip
    assert main(argv) == 0
    # The per-rank sizes are those of the committed recording's shards (2 x 1: whole tensors).
    assert re.search(r"all_reduce: tree \(1,024 nodes, [0-9.]+-[0-9.]+ MB per rank\)",
                     capsys.readouterr().out)
    argv[-1] = str(tmp_path / "ring.csv")
    assert main([*argv, "--algorithm", "ring"]) == 0
    assert "all_reduce: ring (1,024 nodes" in capsys.readouterr().out


def test_summary_names_ranks_for_groups_spanning_several_per_node():
    lines = algorithm_summary(
        [AlgorithmChoice(op="all_gather", algorithm="ring", ranks=8192, one_per_node=False,
                         min_bytes=40_704, max_bytes=40_704)]  # fmt: skip
    )
    assert lines == ["all_gather: ring (8,192 ranks, 0.0407 MB per rank)"]
