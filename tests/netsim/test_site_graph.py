"""The site graph (sites:S) replayed: on a flat network and on sites at 1,024 nodes, each step
equal to its closed form; a site file whose sites are not the graph's, and a node count S does
not divide, refused in one sentence with exit 2 and nothing written."""

import json
import math

import pandas as pd
import pytest

from experiments.cli import main
from experiments.replay.engine import replay
from experiments.replay.recordings import read_run
from experiments.replay.target import ReplayTarget
from tests.netsim.test_gossip import BW, COMPUTE, LAT, SHARD, closed_form, gossip_trace

# 4 sites of 256 around the gateway ring 0-1-2-3-0. The RTTs of the pairs that are not
# neighbours on the ring (0-2, 1-3) are large: no message of the site graph pays them.
UPLINKS = ("100Mbit", "100Mbit", "50Mbit", "400Mbit")
RTT = [[0, 20, 200, 10], [20, 0, 40, 300], [200, 40, 0, 60], [10, 300, 60, 0]]


def _site_file(path, nodes=256, count=4):
    text = "".join(f'[[site]]\nname = "s{s}"\nnodes = {nodes}\nuplink = "{UPLINKS[s]}"\n'
                   'intra_bw = "1Gbit"\nintra_lat = "5us"\n\n' for s in range(count))
    rows = ", ".join("[" + ", ".join(f'"{RTT[a][b]}ms"' for b in range(count)) + "]"
                     for a in range(count))
    path.write_text(text + f"[rtt]\nmatrix = [{rows}]\n")
    return path


def _fake_run(folder, graph="sites:4", nodes=16):
    folder.mkdir()
    config = {"method": "gossip", "graph": graph, "nodes": nodes, "gpus_per_node": 1,
              "intra_bw": "100GB/s", "intra_lat": "5us", "node_links": []}
    (folder / "run.json").write_text(json.dumps({"config": config, "final_val_loss": None}))
    pd.DataFrame({"step": [1, 2, 3], "val_loss": [math.nan] * 3,
                  "compute_s": [COMPUTE] * 3}).to_parquet(folder / "steps.parquet")
    gossip_trace(nodes, graph).to_parquet(folder / "trace.parquet")
    return folder


def test_a_site_graph_step_on_1024_flat_nodes_is_its_gateways_closed_form(tmp_path, capsys):
    # 4 sites of 256: exponential inside (15 peers), a gateway 2 more. Every message shares the
    # node's NIC; the gateway, the busiest node, ends the lock-step round.
    run = _fake_run(tmp_path / "run")
    out = tmp_path / "flat.csv"
    assert main(["simulate", str(run), "--nodes", "1024", "--inter-bw", "80Mbit",
                 "--inter-lat", "10ms", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert ("gossip graph sites:4 rebuilt on 1024 nodes: 4 sites of 256 nodes, exponential "
            "inside (degree 15)") in printed
    assert "degree 17 at the 4 gateways, 15 elsewhere" in printed
    assert BW == 10e6 and LAT == 0.01
    assert pd.read_csv(out)["step_time_s"].tolist() == pytest.approx([closed_form(17)] * 3,
                                                                      rel=1e-9)


def test_a_site_graph_step_on_1024_nodes_in_4_sites_is_its_closed_form(tmp_path, capsys):
    # Per site: the gateway's 17 messages on its 1 Gbit/s link inside the site, the 2 that leave
    # (to the gateways before and after) on the site's uplink and, arriving, its downlink (=
    # uplink here), then the one-way latency to the farther neighbour site on the ring.
    run = _fake_run(tmp_path / "run")
    sites = _site_file(tmp_path / "sites.toml")
    sim = replay(read_run(run), ReplayTarget(topology=str(sites), nodes=1024))
    up = [12.5e6, 12.5e6, 6.25e6, 50e6]  # bytes/s
    inside = 17 * SHARD / 1.25e8
    neighbour_rtt = [max(RTT[s][(s - 1) % 4], RTT[s][(s + 1) % 4]) / 1e3 for s in range(4)]
    site_s = [max(inside, 2 * SHARD / up[s]) + neighbour_rtt[s] / 2 for s in range(4)]
    assert site_s == pytest.approx([0.17, 0.18, 0.35, 0.166])
    assert sim.frame["step_time_s"].tolist() == pytest.approx([COMPUTE + max(site_s)] * 3,
                                                              rel=1e-9)
    assert sim.p2p_degrees == (17,)
    assert any("first round: 8 messages cross sites" in line for line in sim.graphs)


@pytest.mark.parametrize(("case", "words"), [
    ("two sites", "graph='sites:4' puts the nodes in 4 sites of 256 consecutive nodes, but "
                  "topology_file"),
    ("nodes", "cannot rebuild the gossip run's graph on --nodes 1022: graph='sites:4' needs 4 "
              "equal sites of consecutive nodes, but nodes=1022 is not a multiple of 4"),
])
def test_a_site_graph_that_does_not_fit_is_refused_in_one_sentence(tmp_path, capsys, case,
                                                                   words):
    run = _fake_run(tmp_path / "run")
    out = tmp_path / "out" / "sim.csv"
    out.parent.mkdir()
    network = (["--topology", str(_site_file(tmp_path / "two.toml", nodes=512, count=2))]
               if case == "two sites" else
               ["--nodes", "1022", "--inter-bw", "80Mbit", "--inter-lat", "10ms"])
    assert main(["simulate", str(run), *network, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1
    if case == "two sites":
        assert "has 2 sites (s0 0-511, s1 512-1023); give graph=sites:2" in err
    assert list(out.parent.iterdir()) == []


def test_a_run_refuses_a_site_graph_its_sites_or_node_count_do_not_fit(tmp_path, capsys):
    sites = _site_file(tmp_path / "sites.toml", nodes=2, count=2)
    base = ["run", "--method", "gossip", "--workload", "lm-tiny", "--steps", "2"]
    cases = [(["--graph", "sites:3", "--nodes", "4"], "nodes=4 is not a multiple of 3"),
             (["--graph", "sites:1", "--nodes", "4"], "needs a whole number of sites >= 2"),
             (["--graph", "sites:4", "--nodes", "4", "--topology", str(sites), "--shaping",
               "virtual"], "give graph=sites:2 or a site file of 4 such sites.")]
    for flags, words in cases:
        out = tmp_path / "run"
        assert main([*base, *flags, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err
        assert not out.exists()


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_site_graph_run_on_2_sites_of_4_gloo_ranks_replays_on_its_sites(tmp_path, capsys):
    # sites:2 on 2 sites of 2 nodes, shaped on the virtual clock: gateways 0 and 2 send to 2
    # peers a step (their site's other node and the other gateway), nodes 1 and 3 to 1.
    sites = tmp_path / "two.toml"
    sites.write_text("".join(f'[[site]]\nname = "{name}"\nnodes = 2\nuplink = "100Mbit"\n'
                             'intra_bw = "1Gbit"\n\n' for name in "ab")
                     + '[rtt]\nmatrix = [["0ms", "20ms"], ["20ms", "0ms"]]\n')
    out = tmp_path / "run"
    assert main(["run", "--method", "gossip", "--graph", "sites:2", "--nodes", "4",
                 "--gpus-per-node", "1", "--topology", str(sites), "--shaping", "virtual",
                 "--workload", "vision-tiny", "--steps", "3", "--eval-every", "3",
                 "--out", str(out)]) == 0
    trace = pd.read_parquet(out / "trace.parquet")
    sends = trace[(trace["op"] == "send") & (trace["phase"] == "train")]
    per_rank = sends.groupby("rank").size().to_dict()
    assert per_rank == {0: 6, 1: 3, 2: 6, 3: 3}  # 3 steps x degree 2, 1, 2, 1
    assert set(zip(sends["rank"], sends["peer"], strict=True)) == {
        (0, 1), (0, 2), (1, 0), (2, 3), (2, 0), (3, 2)}
    capsys.readouterr()
    assert main(["simulate", str(out), "--topology", str(sites), "--out",
                 str(tmp_path / "sim.csv")]) == 0
    printed = capsys.readouterr().out
    assert "gossip graph sites:2 rebuilt on 4 nodes: 2 sites of 2 nodes" in printed
    assert "first round: 2 messages cross sites" in printed
