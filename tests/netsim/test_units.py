"""Units, links, topologies and the alpha-beta formulas of netsim."""

import math

import pytest

from netsim import (
    Link,
    Topology,
    collective_time,
    collective_volume,
    hierarchical_all_reduce_time,
    parse_bandwidth,
    parse_latency,
    point_to_point_time,
    ring_all_gather_time,
    ring_all_reduce_time,
    ring_reduce_scatter_time,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("100Mbit", 12.5e6),
        ("1Gbit", 125e6),
        ("1Gbit/s", 125e6),
        ("1Gbps", 125e6),
        ("100mbit", 12.5e6),
        ("25GB/s", 25e9),
        ("10MiB/s", 10 * 2**20),
        (1000, 1000.0),
    ],
)
def test_parse_bandwidth(text, expected):
    assert parse_bandwidth(text) == pytest.approx(expected)


@pytest.mark.parametrize(
    "text, expected",
    [("10ms", 0.01), ("200us", 200e-6), ("1.5s", 1.5), ("0", 0.0), (0.25, 0.25), ("3ns", 3e-9)],
)
def test_parse_latency(text, expected):
    assert parse_latency(text) == pytest.approx(expected)


@pytest.mark.parametrize("bad", ["0Mbit", "-1Gbit", "5furlongs", "fast", "", None, True, "1Gbit/h"])
def test_bad_bandwidth_names_the_value(bad):
    with pytest.raises(ValueError, match="bandwidth"):
        parse_bandwidth(bad)


@pytest.mark.parametrize("bad", ["-1ms", "3min", "soon", -0.5])
def test_bad_latency_names_the_value(bad):
    with pytest.raises(ValueError, match="latency"):
        parse_latency(bad)


def test_link_normalises_strings_and_validates():
    link = Link("8Mbit", "10ms", jitter="1ms", loss=0.5)
    assert link.bandwidth == 1e6 and link.latency == 0.01 and link.jitter == 0.001
    assert link.effective_bandwidth == 0.5e6
    # Lost packets are resent: 1 MB at half the goodput takes 2 s after the latency.
    assert collective_volume("send", 2, 1e6).time(link) == pytest.approx(0.01 + 2.0)
    with pytest.raises(ValueError, match="loss"):
        Link("1Gbit", "1ms", loss=1.0)
    with pytest.raises(ValueError, match="loss"):
        Link("1Gbit", "1ms", loss=-0.1)
    with pytest.raises(ValueError, match="bandwidth"):
        Link(0, "1ms")
    with pytest.raises(ValueError, match="latency"):
        Link("1Gbit", "-2ms")


def test_topology_layout_and_validation():
    topo = Topology.from_strings(3, 4, "100Mbit", "10ms", node_speed=[1, 1, 0.5])
    assert topo.world_size == 12
    assert topo.node_of(5) == 1 and topo.local_of(5) == 1
    assert topo.crosses_nodes([1, 5, 9]) and not topo.crosses_nodes([4, 5, 6])
    assert topo.link_for([0, 4]) is topo.inter and topo.link_for([0, 1]) is topo.intra
    assert topo.node_speed[topo.node_of(9)] == 0.5
    with pytest.raises(ValueError, match="node_speed has 2 entries"):
        Topology.from_strings(3, 4, node_speed=[1, 1])
    with pytest.raises(ValueError, match="nic"):
        Topology.from_strings(2, 2, nic="per-socket")
    with pytest.raises(ValueError, match="nodes"):
        Topology.from_strings(0, 2)
    with pytest.raises(ValueError, match="rank 12"):
        topo.node_of(12)


def test_closed_forms():
    link = Link("8Mbit", "10ms")  # a = 0.01 s, b = 1e-6 s/byte
    a, b, n = 0.01, 1e-6, 1e6
    for p in (2, 4, 8):
        assert ring_all_reduce_time(p, n, link) == pytest.approx(
            2 * (p - 1) * a + 2 * (p - 1) / p * n * b
        )
        assert ring_all_gather_time(p, n, link) == pytest.approx((p - 1) * a + (p - 1) / p * n * b)
        assert ring_reduce_scatter_time(p, n, link) == pytest.approx(
            (p - 1) * a + (p - 1) / p * n * b
        )
        # The generic entry point agrees; all-gather takes input bytes (n_out = p * n_in).
        assert collective_time("all_reduce", p, n, link) == pytest.approx(
            ring_all_reduce_time(p, n, link)
        )
        assert collective_time("all_gather", p, n / p, link) == pytest.approx(
            ring_all_gather_time(p, n, link)
        )
        assert collective_time("reduce_scatter", p, n, link, "ring") == pytest.approx(
            ring_reduce_scatter_time(p, n, link)
        )
        # gloo's reduce_scatter_tensor really runs an all-reduce.
        assert collective_time("reduce_scatter", p, n, link, "allreduce") == pytest.approx(
            ring_all_reduce_time(p, n, link)
        )
    assert point_to_point_time(n, link) == pytest.approx(a + n * b)
    assert collective_time("send", 2, n, link) == pytest.approx(a + n * b)


def test_hierarchical_all_reduce():
    intra, inter = Link("800Mbit", "0"), Link("8Mbit", "10ms")
    nodes, g, n = 4, 2, 1e6
    expected_intra = 2 * ((g - 1) / g * n / 1e8)
    inter_shared = 2 * (nodes - 1) * 0.01 + 2 * (nodes - 1) / nodes * n * 1e-6  # NIC carries all n
    got = hierarchical_all_reduce_time(nodes, g, n, intra, inter, nic="per-node")
    assert got == pytest.approx(expected_intra + inter_shared)
    own = hierarchical_all_reduce_time(nodes, g, n, intra, inter, nic="per-accelerator")
    assert own == pytest.approx(expected_intra + ring_all_reduce_time(nodes, n / g, inter))


def test_wire_bytes_per_rank():
    p, n = 4, 1000
    v = collective_volume("all_gather", p, n)
    assert (v.bytes_sent, v.bytes_received) == ((p - 1) * n, (p - 1) * n)
    v = collective_volume("all_reduce", p, n)
    assert v.bytes_sent == pytest.approx(2 * (p - 1) / p * n)
    v = collective_volume("reduce_scatter", p, n, "ring")
    assert v.bytes_sent == pytest.approx((p - 1) / p * n)
    v = collective_volume("reduce_scatter", p, n, "allreduce")
    assert v.bytes_sent == pytest.approx(2 * (p - 1) / p * n)
    assert collective_volume("all_reduce", 1, n).bytes_sent == 0
    with pytest.raises(ValueError, match="op 'allreduce'"):
        collective_volume("allreduce", p, n)
    assert math.isclose(collective_volume("broadcast", p, n, is_root=True).bytes_received, 0.0)
