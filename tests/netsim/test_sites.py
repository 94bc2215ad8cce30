"""Sites: a shared uplink, hierarchical collectives in closed form, one site as flat, refusals."""

import pytest

from flexdemo import graphs
from netsim import Link, ReplayOptions, Topology, simulate
from netsim.model.cluster import Cluster
from netsim.sites import (
    Site,
    Sites,
    gossip_round,
    hierarchical_plan,
    load_sites,
    parse_sites,
    plan_time,
)
from netsim.units import parse_bandwidth
from tests.netsim.test_gossip import COMPUTE, SHARD, gossip_trace
from tests.netsim.test_model import make_trace

N_BYTES = 2_000_000


def _site(name, nodes, uplink="1Gbit", intra_bw="10Gbit", intra_lat="0ms", **kw):
    return {"name": name, "nodes": nodes, "uplink": uplink, "intra_bw": intra_bw,
            "intra_lat": intra_lat, **kw}


def _rtt(*rows):
    return {"matrix": [list(row) for row in rows]}


def _step(trace, topo):
    return simulate(trace, topo).frame["step_time_s"].iloc[0]


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("down_b", ["10Gbit", "500Mbit"])
def test_a_sites_uplink_shared_by_k_flows_gives_each_one_kth(k, down_b):
    # One node per site, k accelerators: k replicate all-reduces at once, each 2(S-1)/S n = n
    # through the site's uplink; the nodes' own links are 1000x faster, so the uplink (or the
    # slower downlink) alone sets the pace: k flows at 1/k of its rate each.
    sites = parse_sites({"site": [_site("a", 1, downlink="10Gbit", intra_bw="1Tbit"),
                                  _site("b", 1, downlink=down_b, intra_bw="1Tbit")],
                         "rtt": _rtt(["0ms", "30ms"], ["30ms", "0ms"])})
    trace = make_trace(Topology.from_strings(2, k, "1Gbit"), steps=1, compute=0.0,
                       ops=(("all_reduce", "ring", N_BYTES),))
    topo = Topology.on_sites(sites, k, Link("1Tbit", "0ms"), nic="per-accelerator")
    pace = min(parse_bandwidth("1Gbit"), parse_bandwidth(down_b))
    # A two-site ring all-reduce: 2(S-1) = 2 steps of the one-way 15 ms.
    assert _step(trace, topo) == pytest.approx(2 * 0.015 + N_BYTES / (pace / k), rel=1e-9)


THREE = {
    "site": [_site("a", 2, uplink="2Gbit", downlink="4Gbit", intra_bw="100Gbit", intra_lat="5us"),
             _site("b", 3, uplink="1Gbit", downlink="8Gbit", intra_bw="10Gbit", intra_lat="1ms"),
             _site("c", [5, 6, 7, 8], uplink="3Gbit", intra_bw="40Gbit", intra_lat="20us")],
    "rtt": _rtt(["0ms", "40ms", "90ms"], ["40ms", "0ms", "60ms"], ["90ms", "60ms", "0ms"]),
}


def _inside(sizes, bws, lats, nbytes):
    """The slowest site's in-site ring phase moving nbytes(k) per node."""
    return max((k - 1) * lat + nbytes(k) / bw for k, bw, lat in zip(sizes, bws, lats, strict=True))


def test_a_hierarchical_all_reduce_equals_its_closed_form():
    sites = parse_sites(THREE)
    sizes, n = [2, 3, 4], float(N_BYTES)
    bws = [100e9 / 8, 10e9 / 8, 40e9 / 8]
    lats = [5e-6, 1e-3, 20e-6]
    ups, downs = [2e9 / 8, 1e9 / 8, 3e9 / 8], [4e9 / 8, 8e9 / 8, 3e9 / 8]
    inside = _inside(sizes, bws, lats, lambda k: (k - 1) / k * n)  # reduce-scatter = all-gather
    moved = 2 * 2 / 3 * n  # ring all-reduce over S = 3 sites
    across = 2 * 2 * (90e-3 / 2) + max(
        max(moved / up, moved / down, moved / k / bw)
        for k, bw, up, down in zip(sizes, bws, ups, downs, strict=True))
    expected = inside + across + inside
    assert plan_time(hierarchical_plan("all_reduce", n, sites), sites) == pytest.approx(expected)
    trace = make_trace(Topology.from_strings(2, 1, "1Gbit"), steps=1, compute=0.0,
                       ops=(("all_reduce", "ring", N_BYTES),))
    replay = simulate(trace, Topology.on_sites(sites, 1, Link("100GB/s")))
    assert replay.frame["step_time_s"].iloc[0] == pytest.approx(expected, rel=1e-9)
    assert [(a.op, a.algorithm, a.ranks) for a in replay.algorithms] == [
        ("all_reduce", "hierarchical", 9)]
    assert "ring across 3 sites" in replay.note


def test_a_hierarchical_all_gather_equals_its_closed_form():
    sites = parse_sites(THREE)
    sizes, n, total = [2, 3, 4], float(N_BYTES), 9
    bws, lats = [100e9 / 8, 10e9 / 8, 40e9 / 8], [5e-6, 1e-3, 20e-6]
    ups, downs = [2e9 / 8, 1e9 / 8, 3e9 / 8], [4e9 / 8, 8e9 / 8, 3e9 / 8]
    gather = _inside(sizes, bws, lats, lambda k: (k - 1) * n)
    # Ring of site blocks: site s forwards all but its successor's block, receives the others'.
    sent = [(total - sizes[(s + 1) % 3]) * n for s in range(3)]
    got = [(total - k) * n for k in sizes]
    across = 2 * (90e-3 / 2) + max(max(u / up, d / down, u / k / bw) for u, d, up, down, k, bw
                                   in zip(sent, got, ups, downs, sizes, bws, strict=True))
    share = max((k - 1) * lat + (k - 1) / k * d / bw
                for k, bw, lat, d in zip(sizes, bws, lats, got, strict=True))
    expected = gather + across + share
    trace = make_trace(Topology.from_strings(2, 1, "1Gbit"), steps=1, compute=0.0,
                       ops=(("all_gather", "ring", N_BYTES),))
    got_s = _step(trace, Topology.on_sites(sites, 1, Link("100GB/s")))
    assert got_s == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("run", ["hsdp-adamw-s0", "flexdemo-s0", "diloco-s0"])
def test_one_site_replays_exactly_as_the_flat_topology(run):
    trace = f"results/quick/units/{run}/trace.parquet"
    sites = parse_sites({"site": [_site("only", 12, uplink="1Mbit", intra_bw="3Gbit",
                                        intra_lat="2ms")]})
    intra = Link("100GB/s", "5us")
    on_sites = simulate(trace, Topology.on_sites(sites, 4, intra),
                        ReplayOptions(steps=60, intra="model",
                        compute_scale=0.05))
    flat = simulate(trace, Topology(12, 4, intra, Link("3Gbit", "2ms")), ReplayOptions(steps=60,
                    intra="model", compute_scale=0.05))
    assert on_sites.frame["time_s"].tolist() == pytest.approx(flat.frame["time_s"].tolist(),
                                                               rel=1e-9, abs=0)
    # The one site's uplink (1 Mbit/s) carries nothing: two sites of 6 are far slower (60
    # steps: diloco syncs every 50).
    two = parse_sites({"site": [_site("a", 6, uplink="1Gbit", intra_bw="3Gbit", intra_lat="2ms"),
                                _site("b", 6, uplink="1Gbit", intra_bw="3Gbit", intra_lat="2ms")],
                       "rtt": _rtt(["0ms", "40ms"], ["40ms", "0ms"])})
    split = simulate(trace, Topology.on_sites(two, 4, intra), ReplayOptions(steps=60, intra="model",
                     compute_scale=0.05))
    assert split.frame["time_s"].iloc[-1] > 1.05 * flat.frame["time_s"].iloc[-1]


def test_the_example_site_file_parses_to_bytes_and_seconds():
    sites = load_sites("experiments/topologies/sites.toml")
    assert [len(site.nodes) for site in sites.sites] == [8, 8]
    assert sites.site_of() == [0] * 8 + [1] * 8
    assert sites.sites[1].uplink == pytest.approx(5e9 / 8)
    assert sites.sites[0].intra_bw == pytest.approx(100e9 / 8)
    assert sites.rtt[0][1] == pytest.approx(0.040)
    assert sites.ring_latency() == pytest.approx(0.020)


TWO_RTT = _rtt(["0ms", "40ms"], ["40ms", "0ms"])


@pytest.mark.parametrize("data, message", [
    ({"site": [_site("a", 2), _site("b", 2)], "rtt": _rtt(["0ms", "40ms"])},
     "must be square"),
    ({"site": [_site("a", 2), _site("b", 2)], "rtt": _rtt(["0ms", "40ms", "1ms"],
                                                          ["40ms", "0ms", "1ms"])},
     "must be square"),
    ({"site": [_site("a", 2), _site("b", 2)], "rtt": _rtt(["0ms", "40ms"], ["30ms", "0ms"])},
     "not symmetric"),
    ({"site": [_site("a", 2), _site("b", 2)], "rtt": _rtt(["1ms", "40ms"], ["40ms", "0ms"])},
     "diagonal must be 0"),
    ({"site": [_site("a", [0, 1]), _site("b", [1, 2])], "rtt": TWO_RTT}, "node 1 is in two"),
    ({"site": [_site("a", 2), _site("b", [])], "rtt": TWO_RTT}, "'b' has no nodes"),
    ({"site": [_site("a", 0), _site("b", 2)], "rtt": TWO_RTT}, "'a' has no nodes"),
    ({"site": [_site("a", [0, 1]), _site("b", [3])], "rtt": TWO_RTT}, "node 2 is in none"),
    ({"site": [_site("a", 2, uplink="5Gbat"), _site("b", 2)], "rtt": TWO_RTT},
     "'a' uplink: bandwidth '5Gbat' has an unknown unit"),
    ({"site": [_site("a", 2, intra_lat="4 parsecs"), _site("b", 2)], "rtt": TWO_RTT},
     "'a' intra_lat"),
    ({"site": [_site("a", 2), _site("b", 2)], "rtt": _rtt(["0ms", "40mz"], ["40ms", "0ms"])},
     "rtt matrix: latency '40mz'"),
    ({"site": [_site("a", 2), _site("b", 2)]}, "needs an [rtt] table"),
    ({"site": [_site("a", 2), _site("a", 2)], "rtt": TWO_RTT}, "given twice"),
    ({"site": [{**_site("a", 2), "uplinks": "1Gbit"}]}, "unknown key 'uplinks'"),
])
def test_bad_site_files_are_refused_in_one_sentence(data, message):
    with pytest.raises(ValueError, match=None) as err:
        parse_sites(data)
    assert message in str(err.value)
    assert str(err.value).count(". ") == 0  # one sentence


def test_a_trace_the_site_model_cannot_place_is_refused():
    sites = parse_sites({"site": [_site("a", 1), _site("b", 1)], "rtt": TWO_RTT})
    recorded = Topology.from_strings(2, 1, "1Gbit")
    trace = make_trace(recorded, steps=1, compute=0.0, ops=(("broadcast", "pipeline", 1000),))
    with pytest.raises(ValueError, match="cannot place on sites"):
        simulate(trace, Topology.on_sites(sites, 1, Link("100GB/s")))
    with pytest.raises(ValueError, match="sites hold 2 nodes but the topology has 3"):
        Topology(3, 1, Link("100GB/s"), Link("1Gbit"), sites=sites)


def test_ten_thousand_nodes_on_three_sites_replay_as_six_processes_per_position():
    # A model process per (site, speed): 10^4 nodes of two speeds on 3 sites are 6 classes, so
    # the replay costs what 6 nodes do; the step still equals the plan's closed form.
    sites = parse_sites({"site": [_site("a", 4000), _site("b", 3000, uplink="2Gbit"),
                                  _site("c", 3000, intra_lat="10us")],
                         "rtt": _rtt(["0ms", "80ms", "150ms"], ["80ms", "0ms", "200ms"],
                                     ["150ms", "200ms", "0ms"])})
    speeds = [0.5 if k % 7 == 0 else 1.0 for k in range(10_000)]
    topo = Topology.on_sites(sites, 1, Link("100GB/s"), node_speed=speeds)
    classes, links, site_of = Cluster._site_classes(topo)
    assert (classes, site_of) == ([0.5, 1.0] * 3, [0, 0, 1, 1, 2, 2])
    assert [link.bandwidth for link in links] == [10e9 / 8] * 6
    trace = make_trace(Topology.from_strings(2, 1, "1Gbit"), steps=2, compute=0.1,
                       ops=(("all_reduce", "ring", N_BYTES),))
    got = simulate(trace, topo).frame["step_time_s"].tolist()
    op = plan_time(hierarchical_plan("all_reduce", N_BYTES, sites), sites)
    assert got == pytest.approx([0.1 / 0.5 + op] * 2, rel=1e-9)  # the slow nodes pace it


def test_sites_built_in_python_are_checked_like_a_file():
    site = Site("a", [0, 1], "1Gbit", 250e6, "10Gbit", "5us")
    assert (site.nodes, site.uplink, site.downlink) == ((0, 1), 125e6, 250e6)
    assert site.intra_lat == pytest.approx(5e-6)
    with pytest.raises(ValueError, match="site 'a' uplink: bandwidth"):
        Site("a", [0], "fast", "1Gbit", "10Gbit", 0.0)
    with pytest.raises(ValueError, match="holds -0.01; give zero or positive finite seconds"):
        Sites((site, Site("b", [2], "1Gbit", "1Gbit", "1Gbit", 0.0)),
              ((0.0, -0.01), (-0.01, 0.0)))
    sites = Sites((site,), ((0.0,),))
    assert sites.site_index(1) == 0 and sites.flat_view() == (10e9 / 8, site.intra_lat)


def test_a_calibration_refuses_sites_rather_than_drop_them():
    from netsim.calibration import Calibration

    sites = parse_sites({"site": [_site("a", 1), _site("b", 1)], "rtt": TWO_RTT})
    calibration = Calibration(shaping="wall", goodput=0.9, per_message_s=0.0)
    with pytest.raises(ValueError, match="replaying sites with one is not built"):
        calibration.topology(Topology.on_sites(sites, 1, Link("100GB/s")))


@pytest.mark.parametrize("graph, remote", [("ring", 2), ("complete", 16)])
def test_a_gossip_round_on_sites_equals_its_closed_form(graph, remote):
    # 8 nodes numbered site by site (a: 0-3, b: 4-7). Ring: 3-4 and 7-0 cross, 2 messages
    # each way per site; complete: 4 x 4. The slower uplink (b's, 40 Mbit/s) paces the round.
    sites = parse_sites({"site": [_site("a", 4, uplink="80Mbit", downlink="160Mbit"),
                                  _site("b", 4, uplink="40Mbit", downlink="160Mbit")],
                         "rtt": _rtt(["0ms", "30ms"], ["30ms", "0ms"])})

    def rounds(step, r):
        return gossip_round(sites, lambda k: graphs.peers(graph, 8, k, r))

    assert rounds(1, 0).remote == (remote, remote)
    replay = simulate(gossip_trace(4, "ring"), Topology.on_sites(sites, 1, Link("100GB/s")),
                      ReplayOptions(site_rounds=rounds))
    peers = len(graphs.peers(graph, 8, 0))
    site_b = max(remote * SHARD / 5e6, remote * SHARD / 20e6, peers * SHARD / (10e9 / 8))
    expected = COMPUTE + site_b + 0.015
    assert replay.frame["step_time_s"].tolist() == pytest.approx([expected] * 3, rel=1e-9)
    assert "messages cross sites" in replay.note
    with pytest.raises(ValueError, match="pass site_rounds="):
        simulate(gossip_trace(4, "ring"), Topology.on_sites(sites, 1, Link("100GB/s")))
