"""One network value: `RunConfig.topology()` is where a run's unit strings become bytes/s and
seconds, and what training, kernel launch, simulate, validate-sim and sweeps take."""

from __future__ import annotations

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
from netsim import Link
from netsim.model import Replay

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "results" / "quick" / "units" / "flexdemo-s0"
BAD = "12 parsecs"


def test_topology_is_the_runs_network_in_bytes_and_seconds():
    cfg = RunConfig(nodes=3, gpus_per_node=2, inter_bw="100Mbit", inter_lat="5ms",
                    node_links=["2=50Mbit"], intra_bw="25GB/s", intra_lat="5us")
    topo = cfg.topology()
    assert (topo.nodes, topo.accelerators_per_node) == (3, 2)
    assert topo.inter == Link(12.5e6, 0.005) and topo.intra == Link(25e9, "5us")
    assert topo.node_links == ((2, Link(6.25e6, 0.005)),)  # its latency defaults to inter_lat
    # Unshaped: a placeholder inter link at the intra bandwidth labels the traffic.
    unshaped = RunConfig(inter_lat="1ms").topology()
    assert unshaped.inter == Link(unshaped.intra.bandwidth, 0.001)


@pytest.mark.parametrize("field, flag", [("inter_bw", "--inter-bw"), ("intra_bw", "--intra-bw"),
                                         ("inter_lat", "--inter-lat")])
def test_a_bad_unit_names_its_setting(tmp_path, capsys, field, flag):
    with pytest.raises(ConfigError, match=f"^{field} '{BAD}' does not parse: "):
        RunConfig(**{field: BAD}).topology()
    shaped = [] if flag == "--inter-bw" else ["--inter-bw", "1Gbit"]  # a flag twice is refused
    assert main(["run", "--out", str(tmp_path / "run"), *shaped, flag, BAD]) == 2
    assert capsys.readouterr().err.startswith(f"flexbench run: error: {field} '{BAD}' ")


def test_a_bad_unit_is_refused_with_the_same_sentence_by_run_simulate_and_sweep(tmp_path, capsys):
    with pytest.raises(ConfigError) as info:
        RunConfig(inter_bw=BAD).topology()
    sentence = str(info.value)
    assert sentence.startswith(f"inter_bw '{BAD}' does not parse: bandwidth '{BAD}' ")
    commands = {
        "run": ["run", "--out", str(tmp_path / "run"), "--inter-bw", BAD],
        "simulate": ["simulate", str(RECORDED), "--inter-bw", BAD, "--out",
                     str(tmp_path / "sim.csv")],
        "sweep": ["sweep", str(ROOT / "experiments/configs/quick.toml"), "--out",
                  str(tmp_path / "sweep"), "--set", f"grid.inter_bw=['{BAD}']"],
        "validate-sim": ["validate-sim", "--inter-bw", BAD, "--keep", str(tmp_path / "v")],
        "compare": ["compare", str(RECORDED), "--inter-bw", BAD, "--out",
                    str(tmp_path / "cmp.json")],
    }
    for name, argv in commands.items():
        assert main(argv) == 2, name
        err = capsys.readouterr().err
        assert err == f"flexbench {name}: error: {sentence}\n", err
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


def test_a_replay_is_the_recorded_config_with_the_targets_overrides():
    run = read_run(RECORDED)
    assert run.config == RunConfig.from_stored(run.meta["config"])
    replayed = replay(run, ReplayTarget(inter_bw="1Gbit", inter_lat="1ms", nodes=4), steps=3)
    assert isinstance(replayed, Replay)
    want = run.config.replace(inter_bw="1Gbit", inter_lat="1ms", nodes=4).topology()
    recorded = (run.config.nodes, run.config.gpus_per_node)
    assert replayed.topology == want and replayed.recorded_topology == recorded
    assert replayed.frame["step"].tolist() == [1, 2, 3]
    assert replayed.algorithms and "weak scaling" in replayed.note and replayed.graphs == ()
    with pytest.raises(ConfigError, match="needs the target's inter-node bandwidth"):
        # The recorded run was unshaped: it has no bandwidth to replay at.
        replay(run, ReplayTarget())


def test_simulate_reads_each_file_of_the_run_once(tmp_path, capsys, monkeypatch):
    reads: list[str] = []
    real = pd.read_parquet

    def counted(path, *args, **kwargs):
        reads.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(pd, "read_parquet", counted)
    assert main(["simulate", str(RECORDED), "--inter-bw", "1Gbit", "--step-compute", "0.01",
                 "--out", str(tmp_path / "sim.csv")]) == 0
    assert sorted(reads) == ["steps.parquet", "trace.parquet"]
    cfg = read_run(RECORDED).config  # the committed recording's own shape
    assert (f"simulated {cfg.steps} steps of flexdemo on {cfg.nodes} nodes x {cfg.gpus_per_node} "
            "at 1Gbit, 0ms") in capsys.readouterr().out


def test_kernel_settings_come_from_the_topology(monkeypatch):
    monkeypatch.setattr(kernel_launch, "check_privileges", lambda: None)
    monkeypatch.setattr(kernel_launch, "has_netem", lambda: True)
    topo = RunConfig(inter_bw="100Mbit", inter_lat="5ms", node_links=["1=50Mbit,2ms"],
                     shaping="kernel").topology()
    settings = kernel_launch.kernel_settings(topo)
    assert (settings.rate_bps, settings.delay_s) == (12.5e6, 0.005)
    node = kernel_launch.kernel_node_settings(topo, settings)
    assert list(node) == [1]
    assert (node[1].rate_bps, node[1].delay_s, node[1].mtu) == (6.25e6, 0.002, settings.mtu)
    monkeypatch.setattr(kernel_launch, "has_netem", lambda: False)
    with pytest.raises(ValueError, match="inter_lat '5ms' needs the kernel's netem qdisc"):
        kernel_launch.kernel_settings(topo)
