"""Gossip on real gloo ranks with FSDP2 inside the node, and the replica-variance measurement.

4 ranks: 2 nodes x 2 and 4 nodes x 1. The replication group is made with netsim's counting
backend, as a run makes it, so the bytes per step are read from netsim's trace.
"""

import pytest
import torch
import torch.distributed as dist

import flexdemo
from flexdemo import graphs
from flexdemo.wire import CommStats, all_reduce_bytes
from netsim import shaping
from tests.dist_utils import inter_rows, run_ranks, shaped_world, train_step

STEPS = 3


def _shard_bytes(model) -> int:
    return sum(flexdemo.local_tensor(p).numel() * 4 for p in model.parameters())


def _direct_spread(model, nodes: int, per_node: int) -> tuple[float, float]:
    """The metric from every rank's gathered shards: node vectors stacked, variance per entry."""
    local = torch.cat([flexdemo.local_tensor(p).detach().reshape(-1).double()
                       for p in model.parameters()])
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    # Node k's vector is its ranks' shards in order; entries line up across nodes.
    x = torch.stack([torch.cat(gathered[k * per_node:(k + 1) * per_node]) for k in range(nodes)])
    mean = x.mean(0)
    variance = x.var(0, unbiased=False).mean().item()
    distance = ((x - mean).square().sum(1).mean().sqrt() / mean.norm()).item()
    return variance, distance


def _gossip(rank, world, per_node, graph_names):
    nodes = world // per_node
    for graph in graph_names:
        recorder, model, mesh, opt = shaped_world(rank, nodes, per_node, "gossip", graph=graph)
        try:
            for step in range(1, STEPS + 1):
                degree = opt.replicator.degree()
                train_step(model, opt, recorder, rank, step)
                rows = inter_rows(recorder, step)
                if graphs.averages_exactly(graph, nodes, step - 1):
                    # Every other node a peer (complete; exponential on 4; anything on 2): the
                    # round's uniform weights are the mean, taken with one all-reduce.
                    assert degree == 0 and rows["op"].tolist() == ["all_reduce"], graph
                    expected = all_reduce_bytes(_shard_bytes(model), nodes)
                    calls = 1
                else:
                    assert set(rows["op"]) == {"send", "recv"}, (graph, rows["op"].tolist())
                    # One message each way per neighbour, of this rank's whole shard.
                    assert degree == graphs.degree_of(graph, nodes, rank // per_node, step - 1)
                    expected, calls = degree * _shard_bytes(model), 2 * degree
                assert rows["bytes_sent"].sum() == expected, (graph, step)
                assert rows["bytes_received"].sum() == expected, (graph, step)
                assert opt.last_step_comm == {"bytes_sent": expected,
                                              "bytes_received": expected, "calls": calls}
            spread = flexdemo.replica_spread(model.parameters(), flexdemo.replicate_group(mesh))
            direct = _direct_spread(model, nodes, per_node)
            assert spread == pytest.approx(direct, rel=1e-9, abs=1e-15), graph
            if graphs.averages_exactly(graph, nodes, STEPS - 1):
                assert spread[0] < 1e-14, graph
            else:
                assert spread[0] > 1e-8  # replicas on their own data drift apart
        finally:
            shaping.uninstall()


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_gossip_on_4_nodes_of_1_rank_every_graph():
    run_ranks(_gossip, 4, 1, ["ring", "torus", "exponential", "one-peer-exponential",
                              "complete"])


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_gossip_on_2_sites_of_2_nodes_mixes_by_the_site_graph():
    # sites:2 on 4 nodes: {0, 1} and {2, 3}; gateways 0 and 2 join the sites (degree 2), 1 and 3
    # talk to their gateway alone (degree 1).
    assert [graphs.degree_of("sites:2", 4, k) for k in range(4)] == [2, 1, 2, 1]
    run_ranks(_gossip, 4, 1, ["sites:2"])
    run_ranks(_mixes_by_the_matrix, 4, "sites:2")


def _mixes_by_the_matrix(rank, world, graph, receive_limit=None):
    """A gossip round replaces node i's parameters by row i of W applied to all the replicas."""
    if receive_limit is not None:
        from flexdemo.replicators import gossip

        gossip.RECEIVE_LIMIT = receive_limit  # this rank's process only
    _, _, _, opt = shaped_world(rank, world, 1, "gossip", graph=graph)
    try:
        values = [float((k + 1) ** 2) for k in range(world)]  # one distinct value per node
        params = [torch.full((5,), values[rank], dtype=torch.float64)]
        opt.replicator.after_update(params, CommStats())
        expected = (graphs.mixing_matrix(graph, world)[rank]
                    @ torch.tensor(values, dtype=torch.float64)).item()
        assert params[0].tolist() == pytest.approx([expected] * 5, rel=1e-12)
    finally:
        shaping.uninstall()


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_a_round_in_windows_of_peers_still_mixes_by_the_matrix(monkeypatch):
    # With at most 2 peers at once, the exponential graph on 6 nodes (4 peers, not the
    # complete graph) goes in two windows: the 2 nodes at ring distance 1, then the 2 at 2.
    from flexdemo.replicators import gossip

    monkeypatch.setattr(gossip, "RECEIVE_LIMIT", 2)
    assert graphs.peers("exponential", 6, 0) == [1, 2, 4, 5]
    assert gossip.exchange_windows([1, 2, 4, 5], 6, 0) == [[1, 5], [2, 4]]
    run_ranks(_mixes_by_the_matrix, 6, "exponential", 2)


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_the_complete_graph_is_one_all_reduce_that_mixes_by_the_matrix():
    # Its uniform weights make the round the mean: one all-reduce, the matrix's row all the same.
    assert graphs.averages_exactly("complete", 4) and graphs.averages_exactly("exponential", 4)
    assert not graphs.averages_exactly("exponential", 6)
    assert not graphs.averages_exactly("one-peer-exponential", 4, 1)
    run_ranks(_mixes_by_the_matrix, 4, "complete")


@pytest.mark.parametrize("graph", ["complete", "exponential", "sites:4", "torus", "ring"])
@pytest.mark.parametrize("limit", [64, 8])
def test_ranks_taking_their_windows_in_order_all_finish(graph, limit, monkeypatch):
    # The strictest schedule (NCCL's: a rank posts its next window only when its current one
    # is done, and a window is done only when every peer in it is at the window holding the
    # pair) must finish on every graph: no ranks wait on each other in a cycle.
    from flexdemo.replicators import gossip

    monkeypatch.setattr(gossip, "RECEIVE_LIMIT", limit)
    nodes = 256
    windows = {node: gossip.exchange_windows(graphs.peers(graph, nodes, node), nodes, node)
               for node in range(nodes)}
    for node, mine in windows.items():
        assert sorted(p for w in mine for p in w) == sorted(graphs.peers(graph, nodes, node))
        assert all(0 < len(w) <= limit for w in mine)
        # A round with no more peers than the limit is as before: every message in flight.
        assert (len(mine) == 1) == (len(graphs.peers(graph, nodes, node)) <= limit)
    at = dict.fromkeys(windows, 0)
    while any(at[n] < len(windows[n]) for n in windows):
        ready = [n for n in windows if at[n] < len(windows[n])
                 and all(at[p] < len(windows[p]) and n in windows[p][at[p]]
                         for p in windows[n][at[n]])]
        assert ready, f"{graph}: windows wait on each other in a cycle"
        for n in ready:
            at[n] += 1
    if graph == "complete" and limit == 64:  # distances 1-32, 33-64, 65-96, 97-128
        assert [len(w) for w in windows[0]] == [64, 64, 64, 63]


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_gossip_on_2_nodes_of_2_ranks_shards_inside_the_node():
    run_ranks(_gossip, 4, 2, ["ring", "complete"])


def _centralized(rank, world):
    for method in ("hsdp-adamw", "flexdemo"):
        recorder, model, mesh, opt = shaped_world(rank, 2, 2, method)
        try:
            for step in range(1, STEPS + 1):
                train_step(model, opt, recorder, rank, step)
            variance, distance = flexdemo.replica_spread(model.parameters(),
                                                         flexdemo.replicate_group(mesh))
            assert variance < 1e-20 and distance < 1e-9, (method, variance, distance)
        finally:
            shaping.uninstall()


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_centralized_methods_read_zero_replica_variance():
    run_ranks(_centralized, 4)
