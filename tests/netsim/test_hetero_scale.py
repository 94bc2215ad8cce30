"""Hundreds of nodes, each with a link of its own: one class per speed predicts as one per link."""

import dataclasses

import pandas as pd
import pytest

from experiments.replay.gossip import recorded_schedule
from netsim import Link, ReplayOptions, Topology, collective_time, simulate
from netsim.model.cluster import Cluster
from tests.netsim.test_carry import delayed_trace
from tests.netsim.test_gossip import gossip_trace
from tests.netsim.test_model import hsdp_trace, make_trace
from tests.netsim.test_overlap import scripted_trace

NODES = 300


def distinct_links(nodes: int, first: float = 20.0) -> list[str]:
    """Every node its own link: bandwidths first..~2*first Mbit/s shuffled, latencies 1..13 ms."""
    return [f"{k}={first + (k * 37 % nodes) * first / nodes:.6f}Mbit,{1 + k % 13}ms"
            for k in range(nodes)]


def _topology(nodes: int, per_node: int, **kw) -> Topology:
    return Topology.from_strings(nodes, per_node, "1Gbit", "1ms", intra_bw="8Gbit",
                                 node_links=distinct_links(nodes), **kw)


def _both_ways(monkeypatch, trace: pd.DataFrame, topo: Topology, **kw) -> tuple[list, list]:
    """Step end times with one class per speed, and with one per distinct link (the old way)."""
    merged = simulate(trace, topo, ReplayOptions(**kw)).frame["time_s"].tolist()
    monkeypatch.setattr(Cluster, "_class_per_link", True)
    per_link = simulate(trace, topo, ReplayOptions(**kw)).frame["time_s"].tolist()
    return merged, per_link


def _two_speeds(nodes: int) -> list[float]:
    return [0.8 if k % 5 == 2 else 1.0 for k in range(nodes)]


# Each case loads the NICs differently: two replicate groups per node on one NIC at once (HSDP),
# per-accelerator NICs, two node speeds, FSDP2's streams overlapping ops, carried ops, gossip.
CASES = {
    "hsdp-shared-nic": lambda: (hsdp_trace(steps=3), _topology(NODES, 2), {}),
    "hsdp-per-accelerator": lambda: (hsdp_trace(steps=3),
                                     _topology(NODES, 2, nic="per-accelerator"), {}),
    "two-speeds": lambda: (hsdp_trace(steps=3),
                           _topology(NODES, 2, node_speed=_two_speeds(NODES)), {}),
    "fsdp2-streams": lambda: (scripted_trace(), _topology(NODES, 2, node_speed=_two_speeds(NODES)),
                              {"overlap": "fsdp2"}),
    "carried": lambda: (delayed_trace(50_000), _topology(NODES, 1), {"steps": 6}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_class_per_speed_predicts_what_a_class_per_link_does(monkeypatch, case):
    trace, topo, kw = CASES[case]()
    merged, per_link = _both_ways(monkeypatch, trace, topo, **kw)
    assert merged == pytest.approx(per_link, rel=1e-9, abs=0)
    assert len({link for _, link in topo.node_links}) == NODES  # each node its own link
    # The links matter: on the uniform 1 Gbit/s links the same replay is faster.
    uniform = dataclasses.replace(topo, node_links=())
    fast = simulate(trace, uniform, ReplayOptions(**kw)).frame["time_s"]
    assert merged[-1] > 1.05 * fast.iloc[-1]


def test_gossip_with_distinct_links_predicts_as_a_class_per_link(monkeypatch):
    nodes = 64  # messages use the ingress too; speeds differ, so classes still meet each round
    degrees, _, _ = recorded_schedule({"config": {"method": "gossip", "graph": "exponential"}},
                                pd.DataFrame({"step": range(1, 4)}), nodes, None)
    topo = Topology.from_strings(nodes, 1, "80Mbit", "10ms", node_links=distinct_links(nodes),
                                 node_speed=_two_speeds(nodes))
    merged, per_link = _both_ways(monkeypatch, gossip_trace(4, "exponential"), topo,
                                  degrees=degrees)
    assert merged == pytest.approx(per_link, rel=1e-9, abs=0)
    fast = simulate(gossip_trace(4, "exponential"), dataclasses.replace(topo, node_links=()),
                    ReplayOptions(degrees=degrees)).frame["time_s"]
    assert merged[-1] > 1.05 * fast.iloc[-1]


def test_nodes_of_one_speed_form_one_class_at_their_slowest_link():
    topo = _topology(NODES, 2, node_speed=_two_speeds(NODES))
    speeds, links = Cluster._node_classes(topo)
    assert speeds == [0.8, 1.0]
    for speed, link in zip(speeds, links, strict=True):
        members = [topo.node_link(k) for k in range(NODES) if topo.node_speed[k] == speed]
        assert link.effective_bandwidth == min(m.effective_bandwidth for m in members)
    assert len(Cluster._node_classes(topo, per_link=True)[0]) == NODES


@pytest.mark.parametrize("per_node", [1, 2])
def test_a_groups_pace_is_the_closed_form_on_its_slowest_members_link(per_node):
    topo = _topology(NODES, per_node)
    nbytes = 200_000
    trace = make_trace(Topology.from_strings(2, per_node), steps=1, compute=0.0,
                       ops=(("all_reduce", "ring", nbytes),))
    got = simulate(trace, topo, ReplayOptions(algorithm="ring")).frame["step_time_s"].iloc[0]
    links = [topo.node_link(k) for k in range(NODES)]
    slowest = Link(min(link.bandwidth for link in links), max(link.latency for link in links))
    assert slowest == topo.inter_link() and slowest.latency == pytest.approx(0.013)
    # The ring's latency steps at the largest latency, its bytes at the slowest bandwidth; with
    # one NIC per node, the node's per_node replicate groups share it.
    one = collective_time("all_reduce", NODES, nbytes, slowest, "ring")
    latency = one - collective_time("all_reduce", NODES, nbytes, Link(slowest.bandwidth), "ring")
    assert got == pytest.approx(latency + per_node * (one - latency), rel=1e-9)
