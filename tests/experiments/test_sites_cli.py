"""`--topology F.toml`: a site file becomes the run's network in RunConfig.topology(); flexbench
simulate replays on it, prints the sites and the hierarchical assumption, and refuses bad files
and clashing flags with one sentence and exit 2, writing nothing."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd
import pytest

from experiments.cli import main
from experiments.config import RunConfig
from experiments.errors import ConfigError
from experiments.replay.engine import replay
from experiments.replay.recordings import read_run
from experiments.replay.target import ReplayTarget
from experiments.run import kernel as kernel_launch
from netsim.kernel import KernelShapingError

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "results" / "quick" / "units" / "hsdp-adamw-s0"
SITES = ROOT / "experiments" / "topologies" / "sites.toml"

GOOD = """
[[site]]
name = "a"
nodes = 2
uplink = "1Gbit"
intra_bw = "10Gbit"

[[site]]
name = "b"
nodes = [2, 3]
uplink = "1Gbit"
downlink = "2Gbit"
intra_bw = "10Gbit"

[rtt]
matrix = [["0ms", "{rtt}"], ["40ms", "0ms"]]
"""


def test_a_site_file_is_the_runs_network_built_in_one_place(tmp_path):
    path = tmp_path / "sites.toml"
    path.write_text(GOOD.format(rtt="40ms"))
    topo = RunConfig(nodes=4, gpus_per_node=2, topology_file=str(path)).topology()
    assert topo.sites is not None and topo.sites.site_of() == [0, 0, 1, 1]
    assert topo.sites.sites[1].downlink == pytest.approx(2e9 / 8)
    assert topo.inter.bandwidth == pytest.approx(1e9 / 8)  # the slowest uplink or downlink
    with pytest.raises(ConfigError, match="holds 4 nodes but nodes is 3; give nodes = 4"):
        RunConfig(nodes=3, topology_file=str(path)).topology()
    with pytest.raises(ConfigError, match="leave out inter_bw, inter_lat and node_links"):
        RunConfig(nodes=4, inter_bw="1Gbit", topology_file=str(path)).topology()
    for shaping in ("wall", "virtual", "kernel"):
        RunConfig(nodes=4, topology_file=str(path), shaping=shaping).validate()


def test_kernel_shaping_lays_site_rates_and_refuses_their_latency(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_launch, "check_privileges", lambda: None)
    path = tmp_path / "sites.toml"
    path.write_text(GOOD.format(rtt="40ms"))
    topo = RunConfig(nodes=4, topology_file=str(path), shaping="kernel").topology()
    with pytest.raises(KernelShapingError, match="lays their rates only, and the site file "
                                                 "gives an rtt of 40 ms"):
        kernel_launch.kernel_settings(topo)
    path.write_text(GOOD.format(rtt="40ms").replace("40ms", "0ms"))
    topo = RunConfig(nodes=4, topology_file=str(path), shaping="kernel").topology()
    settings = kernel_launch.kernel_settings(topo)
    nodes = kernel_launch.kernel_node_settings(topo, settings)
    assert {k: s.rate_bps for k, s in nodes.items()} == {k: 10e9 / 8 for k in range(4)}
    sites = kernel_launch.kernel_sites(topo, settings)
    assert [(s.nodes, s.up.rate_bps, s.down.rate_bps) for s in sites] == [
        ((0, 1), 1e9 / 8, 1e9 / 8), ((2, 3), 1e9 / 8, 2e9 / 8)]


def test_simulate_on_the_example_sites_prints_them_and_the_assumption(tmp_path, capsys):
    out = tmp_path / "sim.csv"
    assert main(["simulate", str(RECORDED), "--topology", str(SITES), "--gpus-per-node", "8",
                 "--steps", "3", "--compute-scale", "0.05", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"on 16 nodes x 8 on the sites of {SITES}" in printed
    assert "site east: 8 nodes, uplink 5Gbit, downlink 5Gbit, inside 100Gbit, 5 us" in printed
    assert "rtt east-west: 40 ms (one-way 20 ms)" in printed
    assert "ring across 2 sites over their uplinks/downlinks" in printed
    assert "all_reduce: hierarchical (16 nodes," in printed
    assert out.exists()


@pytest.mark.parametrize("case, message", [
    ("asymmetric", "the rtt matrix is not symmetric: 'a' to 'b' is 30 ms but back 40 ms."),
    ("missing", "cannot be read"),
    ("both", "give the target's network as --inter-bw"),
    ("neither", "give the target's network as --inter-bw"),
    ("latency", "--inter-lat has no place beside it"),
    ("nodes", "holds 4 nodes but nodes is 5; give nodes = 4."),
    ("calibration", "--calibration fits flat inter-node links"),
])
def test_bad_topologies_exit_2_in_one_sentence_and_write_nothing(tmp_path, capsys, case,
                                                                 message):
    site_file = tmp_path / "sites.toml"
    site_file.write_text(GOOD.format(rtt="30ms" if case == "asymmetric" else "40ms"))
    out = tmp_path / "out" / "sim.csv"
    out.parent.mkdir()
    network = {"asymmetric": ["--topology", str(site_file)],
               "missing": ["--topology", str(tmp_path / "none.toml")],
               "both": ["--topology", str(site_file), "--inter-bw", "1Gbit"],
               "neither": [],
               "latency": ["--topology", str(site_file), "--inter-lat", "5ms"],
               "nodes": ["--topology", str(site_file), "--nodes", "5"],
               "calibration": ["--topology", str(site_file), "--calibration",
                               str(tmp_path / "cal.json")]}[case]
    assert main(["simulate", str(RECORDED), *network, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flexbench simulate: error: ") and message in err
    assert err.count("\n") == 1
    assert list(out.parent.iterdir()) == []


def test_a_run_recorded_on_sites_replays_flat_when_given_a_bandwidth(tmp_path):
    path = tmp_path / "sites.toml"
    path.write_text(GOOD.format(rtt="40ms"))
    run = read_run(RECORDED)
    on_sites = dataclasses.replace(run, config=run.config.replace(topology_file=str(path),
                                                                  nodes=4))
    again = replay(on_sites, ReplayTarget(), steps=2)  # nothing given: its own sites replay
    assert again.topology.sites is not None and again.topology.nodes == 4
    flat = replay(on_sites, ReplayTarget(inter_bw="1Gbit", nodes=2), steps=2)
    assert flat.topology.sites is None and flat.topology.inter.bandwidth == pytest.approx(1.25e8)


def test_a_sweep_refuses_a_site_file_in_its_run_table(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["sweep", str(ROOT / "experiments/configs/quick.toml"), "--out", str(out),
                 "--set", f"run.topology_file={SITES}"]) == 2
    err = capsys.readouterr().err
    assert "sites are not built into sweeps" in err and err.count("\n") == 1
    assert not out.exists()


GOSSIP = ROOT / "results" / "decentralized" / "units"


def test_gossip_replays_on_1024_nodes_in_four_sites_by_its_graph(tmp_path, capsys):
    path = tmp_path / "sites.toml"
    path.write_text("".join(f'[[site]]\nname = "{name}"\nnodes = 256\nuplink = "2Gbit"\n'
                            'intra_bw = "100Gbit"\n\n' for name in "abcd")
                    + "[rtt]\nmatrix = [" + ", ".join(
                        "[" + ", ".join('"0ms"' if i == j else '"100ms"' for j in range(4)) + "]"
                        for i in range(4)) + "]\n")
    medians = {}
    for graph in ("ring", "exponential"):
        out = tmp_path / f"{graph}.csv"
        run = GOSSIP / f"gossip-nodes=8_graph={graph}-s0"
        assert main(["simulate", str(run), "--topology", str(path), "--steps", "3",
                     "--out", str(out)]) == 0
        printed = capsys.readouterr().out
        assert "on 1024 nodes x 1 on the sites of" in printed
        assert "gossip on 4 sites: the graph's nodes numbered site by site" in printed
        medians[graph] = pd.read_csv(out)["step_time_s"].median()
    # The ring crosses sites on 8 edges, the exponential graph on thousands: the 2 Gbit/s
    # uplinks make its step far longer.
    assert medians["exponential"] > 10 * medians["ring"]
