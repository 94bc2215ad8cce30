"""Mixing matrices of the gossip graphs: shape, weights, and how fast they reach consensus."""

import math

import pytest
import torch

from flexdemo.graphs import (
    GRAPHS,
    busiest_degree,
    check_graph,
    degree_of,
    fitting_graphs,
    graph_problem,
    mean_degree,
    mixing_matrix,
    peers,
    period,
    site_blocks,
    site_layout,
    torus_shape,
)

# (graph, nodes) -> the degree every node has.
DEGREES = {
    ("ring", 2): 1, ("ring", 3): 2, ("ring", 8): 2, ("torus", 4): 2, ("torus", 6): 3,
    ("torus", 9): 4,
    ("torus", 12): 4, ("exponential", 2): 1, ("exponential", 6): 4, ("exponential", 8): 5,
    ("exponential", 16): 7, ("one-peer-exponential", 8): 1, ("one-peer-exponential", 16): 1,
    ("complete", 2): 1, ("complete", 7): 6,
}


@pytest.mark.parametrize(("graph", "nodes"), sorted(DEGREES))
def test_mixing_matrix_symmetric_doubly_stochastic_with_expected_degree(graph, nodes):
    for step in range(period(graph, nodes)):
        w = mixing_matrix(graph, nodes, step)
        assert torch.allclose(w, w.T)
        assert torch.allclose(w.sum(0), torch.ones(nodes, dtype=w.dtype))
        assert torch.allclose(w.sum(1), torch.ones(nodes, dtype=w.dtype))
        assert (w >= 0).all()
        off = (w > 0).sum(1) - 1  # non-zero entries besides the diagonal
        assert off.tolist() == [DEGREES[graph, nodes]] * nodes
        for i in range(nodes):
            assert len(peers(graph, nodes, i, step)) == DEGREES[graph, nodes]


def test_non_power_of_two_one_peer_is_still_doubly_stochastic_and_connected():
    nodes = 6
    union = torch.zeros(nodes, nodes, dtype=torch.float64)
    for step in range(period("one-peer-exponential", nodes)):
        w = mixing_matrix("one-peer-exponential", nodes, step)
        assert torch.allclose(w, w.T) and torch.allclose(w.sum(1), torch.ones(nodes, dtype=w.dtype))
        assert ((w > 0).sum(1) - 1).max() <= 1  # at most one peer a step
        union += w
    reach = torch.linalg.matrix_power(union, nodes) > 0
    assert reach.all()


def _distinct(nodes):
    torch.manual_seed(0)
    return torch.randn(nodes, 5, dtype=torch.float64)


def test_complete_is_the_exact_average():
    x = _distinct(7)
    mixed = mixing_matrix("complete", 7) @ x
    assert torch.allclose(mixed, x.mean(0).expand_as(x), atol=1e-12)


def test_one_peer_exponential_reaches_the_exact_average_of_8_in_3_steps():
    x = _distinct(8)
    for step in range(2):
        x_before = x
        x = mixing_matrix("one-peer-exponential", 8, step) @ x
    assert not torch.allclose(x, x_before.mean(0).expand_as(x), atol=1e-9)  # not after 2
    x = mixing_matrix("one-peer-exponential", 8, 2) @ x
    assert torch.allclose(x, _distinct(8).mean(0).expand_as(x), atol=1e-12)


def _consensus(x):
    return (x - x.mean(0)).norm()


def test_ring_contracts_consensus_at_the_spectral_gap_rate():
    nodes = 8
    w = mixing_matrix("ring", nodes)
    # Second largest eigenvalue modulus: the asymptotic contraction per step of ||x - mean||.
    lam = sorted(torch.linalg.eigvalsh(w).abs().tolist())[-2]
    assert lam == pytest.approx((1 + 2 * math.cos(2 * math.pi / nodes)) / 3)
    x = _distinct(nodes)
    for _ in range(20):  # past the transient of the faster modes
        x = w @ x
    start = _consensus(x)
    for _ in range(20):
        x = w @ x
    rate = (_consensus(x) / start).item() ** (1 / 20)
    assert rate == pytest.approx(lam, rel=0.10)


def test_torus_takes_the_nearest_square_factorization():
    assert torus_shape(12) == (3, 4) and torus_shape(16) == (4, 4) and torus_shape(8) == (2, 4)


@pytest.mark.parametrize(("graph", "nodes", "words"), [
    ("star", 4, "graph='star' is unknown; use one of ring, torus"),
    ("ring", 1, "needs at least 2 nodes, got nodes=1"),
    ("torus", 3, "needs at least 4 nodes"),
    ("torus", 7, "nodes=7 is prime; on 7 nodes use one of ring, exponential, "
                 "one-peer-exponential, complete"),
    ("complete", 1, "needs at least 2 nodes"),
])
def test_bad_graph_is_one_clear_sentence(graph, nodes, words):
    with pytest.raises(ValueError) as err:
        check_graph(graph, nodes)
    assert words in str(err.value)
    assert str(err.value).count(". ") == 0 and str(err.value).endswith(".")


def test_every_graph_fits_some_node_count():
    assert set(fitting_graphs(8)) == set(GRAPHS)


# -- sites:S: exponential inside each site, a ring of gateways (each site's first node) across --
def test_site_graph_peers_and_metropolis_hastings_weights_in_closed_form():
    # 16 nodes in 4 sites of 4: inside, the exponential graph of 4 is complete (degree 3); the
    # gateways 0, 4, 8, 12 also talk to the gateways of the sites before and after (degree 5).
    assert peers("sites:4", 16, 0) == [1, 2, 3, 4, 12]
    assert peers("sites:4", 16, 5) == [4, 6, 7]
    assert peers("sites:4", 16, 8) == [4, 9, 10, 11, 12]
    w = mixing_matrix("sites:4", 16)
    assert torch.allclose(w, w.T) and (w >= 0).all()
    assert torch.allclose(w.sum(1), torch.ones(16, dtype=w.dtype))
    assert torch.allclose(w.sum(0), torch.ones(16, dtype=w.dtype))
    # w_ij = 1 / (1 + max(d_i, d_j)): 1/6 at a gateway (degree 5), 1/4 between two others.
    assert w[0, 4] == pytest.approx(1 / 6) and w[0, 12] == pytest.approx(1 / 6)
    assert w[0, 1] == pytest.approx(1 / 6) and w[5, 6] == pytest.approx(1 / 4)
    assert w[0, 0] == pytest.approx(1 - 5 / 6) and w[5, 5] == pytest.approx(1 - 1 / 6 - 2 / 4)
    assert w[1, 4] == 0 and w[0, 8] == 0  # no other edge leaves a site; no chord of the ring
    assert busiest_degree("sites:4", 16) == 5 and mean_degree("sites:4", 16) == 3.5


def test_site_graph_on_two_sites_and_large_sites():
    # Two sites: the gateway ring is one edge; sites of 8: exponential of 8 (degree 5).
    assert peers("sites:2", 16, 0) == [1, 2, 4, 6, 7, 8]
    assert peers("sites:2", 16, 9) == [8, 10, 11, 13, 15]
    assert busiest_degree("sites:2", 16) == 6
    # 1,024 nodes in 4 sites of 256: 2 log2(256) - 1 = 15 inside, 17 at a gateway; only the
    # gateways' 8 edge ends leave their site.
    site_of = [k // 256 for k in range(1024)]
    crossing = sum(site_of[j] != site_of[k] for k in range(1024) for j in peers("sites:4", 1024, k))
    assert crossing == 8 and busiest_degree("sites:4", 1024) == 17
    assert degree_of("sites:4", 1024, 1) == 15
    assert [list(b) for b in site_blocks("sites:2", 4)] == [[0, 1], [2, 3]]
    assert "4 sites of 256 nodes, exponential inside (degree 15)" in site_layout("sites:4", 1024)


def test_site_graph_reaches_consensus():
    x = _distinct(16)
    w = mixing_matrix("sites:4", 16)
    for _ in range(400):
        x = w @ x
    assert torch.allclose(x, _distinct(16).mean(0).expand_as(x), atol=1e-9)


@pytest.mark.parametrize(("graph", "nodes", "words"), [
    ("sites:3", 16, "graph='sites:3' needs 3 equal sites of consecutive nodes, but nodes=16 is "
                    "not a multiple of 3; use a node count that 3 divides."),
    ("sites:1", 4, "graph='sites:1' needs a whole number of sites >= 2 after 'sites:'"),
    ("sites:x", 4, "graph='sites:x' needs a whole number of sites >= 2 after 'sites:'"),
    ("sites", 4, "graph='sites' needs a whole number of sites >= 2"),
    ("site:4", 4, "graph='site:4' is unknown; use one of ring, torus, exponential, "
                  "one-peer-exponential, complete, or sites:S."),
])
def test_bad_site_graph_is_one_clear_sentence(graph, nodes, words):
    with pytest.raises(ValueError) as err:
        check_graph(graph, nodes)
    assert words in str(err.value)
    assert str(err.value).count(". ") == 0 and str(err.value).endswith(".")
    assert graph_problem(graph, nodes) == str(err.value)
