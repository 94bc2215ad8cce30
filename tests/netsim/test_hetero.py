"""Heterogeneous links: per-node bandwidth and latency in the topology, model, shaping and CLI."""

import json
import os
import re
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.distributed as dist

from experiments.cli import main
from experiments.config import RunConfig
from experiments.errors import ConfigError
from netsim import (
    Link,
    ReplayOptions,
    Topology,
    TraceRecorder,
    collective_time,
    kernel,
    shaping,
    simulate,
)
from netsim.kernel_probe import measure_goodput
from netsim.topology import parse_node_links
from netsim.trace import compute_outside_collectives
from netsim.units import parse_bandwidth, parse_node_link
from tests.dist_utils import init_loopback, spawn
from tests.netsim.test_model import make_trace
from tests.timing import assert_link_goodput

FAST, SLOW = "80Mbit", "20Mbit"  # 10 MB/s and 2.5 MB/s


# -- topology and parsing ---------------------------------------------------------------------
def test_node_link_specs_parse_in_one_place():
    assert parse_node_link("3=100Mbit,20ms") == (3, 12.5e6, 0.02)
    assert parse_node_link(" 1 = 1Gbit ") == (1, 125e6, None)
    inter = Link("1Gbit", "5ms", jitter="1ms", loss=0.01)
    links = parse_node_links(["1=100Mbit"], 2, inter)
    # No latency given: the uniform one; jitter and loss always the uniform link's.
    assert links == {1: Link("100Mbit", "5ms", jitter="1ms", loss=0.01)}


@pytest.mark.parametrize("spec, words", [
    ("3=1Gbit", "names node 3, outside this topology's nodes 0..2"),
    ("x=1Gbit", "does not parse; write it as NODE=BANDWIDTH[,LATENCY]"),
    ("1=fast", "does not parse: bandwidth 'fast'"),
    ("1=1Gbit,2parsecs", "does not parse: latency '2parsecs'"),
    ("1=1Gbit,1ms,3", "does not parse"),
    ("1", "does not parse"),
])
def test_bad_node_links_fail_with_one_sentence(spec, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        Topology.from_strings(3, 1, node_links=[spec])
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        RunConfig(nodes=3, node_links=[spec]).validate()


def test_bad_node_link_containers_and_duplicates():
    with pytest.raises(ValueError, match="gives node 1 a second link"):
        Topology.from_strings(3, 1, node_links=["1=1Gbit", "1=2Gbit"])
    with pytest.raises(ConfigError, match="must be a list of"):
        RunConfig(node_links={"1": "1Gbit"}).validate()  # a TOML table is not the syntax
    with pytest.raises(ValueError, match="node 2 is outside this topology's nodes 0..1"):
        Topology(2, 1, Link("1Gbit"), Link("1Gbit"), node_links={2: Link("1Mbit")})


def test_link_for_takes_the_slowest_member_and_the_largest_latency():
    topo = Topology.from_strings(3, 2, FAST, "10ms", node_links=[f"2={SLOW},30ms", "1=1Gbit,1ms"])
    assert topo.node_link(0) is topo.inter
    assert topo.link_for([0, 2]) == Link(FAST, "10ms")  # nodes 0 and 1: 80 Mbit, 10 ms paces
    assert topo.link_for([0, 2, 4]) == Link(SLOW, "30ms")
    assert topo.link_for([2, 3]) is topo.intra
    assert topo.inter_link() == Link(SLOW, "30ms")
    assert topo.describe_node_links() == ["1=1Gbit,1ms", "2=20Mbit,30ms"]
    uniform = Topology.from_strings(3, 2, FAST, "10ms")
    assert uniform.link_for([0, 2, 4]) is uniform.inter and uniform.node_links == ()


# -- the model ----------------------------------------------------------------------------------
@pytest.mark.parametrize("per_node", [1, 2])
@pytest.mark.parametrize("op", ["all_reduce", "all_gather"])
def test_slow_node_paces_a_ring_in_the_model_as_the_closed_form(op, per_node):
    topo = Topology.from_strings(4, per_node, FAST, "10ms", node_links=[f"2={SLOW},30ms"])
    trace = make_trace(topo, steps=1, compute=0.0, ops=((op, "ring", 2_000_000),))
    got = simulate(trace, topo, ReplayOptions(algorithm="ring")).frame["step_time_s"].iloc[0]
    # Closed form on the slowest link's bandwidth and the path's largest latency; with one NIC
    # per node, the node's per_node replicate groups move their bytes through it together.
    slowest = Link(SLOW, "30ms")
    one = collective_time(op, 4, 2_000_000, slowest, "ring")
    latency = one - collective_time(op, 4, 2_000_000, Link(SLOW, 0), "ring")
    expected = latency + per_node * (one - latency)
    assert got == pytest.approx(expected, rel=0.01)
    uniform_slow = Topology.from_strings(4, per_node, SLOW, "30ms")
    assert got == pytest.approx(simulate(trace, uniform_slow,
                                         ReplayOptions(algorithm="ring")).frame["step_time_s"]
                                .iloc[0], rel=1e-9)


def test_straggler_and_slow_link_on_different_nodes_both_count():
    base = Topology.from_strings(4, 1, FAST, "10ms")
    both = Topology.from_strings(4, 1, FAST, "10ms", node_speed=[0.5, 1, 1, 1],
                                 node_links=[f"3={SLOW},20ms"])
    trace = make_trace(base, steps=2, compute=0.1)
    comm = collective_time("all_reduce", 4, 1e6, Link(SLOW, "20ms"), "ring")
    # Node 0 computes 0.1 / 0.5 s; node 3's link then paces the all-reduce.
    step = simulate(trace, both, ReplayOptions(algorithm="ring")).frame["step_time_s"].iloc[1]
    assert step == pytest.approx(0.2 + comm, rel=1e-6)


def test_a_fast_node_link_changes_nothing_when_another_node_is_slower():
    topo = Topology.from_strings(2, 1, SLOW, "10ms", node_links=["0=10Gbit,1ms"])
    trace = make_trace(topo, steps=1, compute=0.0)
    got = simulate(trace, topo, ReplayOptions(algorithm="ring")).frame["step_time_s"].iloc[0]
    assert got == pytest.approx(collective_time("all_reduce", 2, 1e6, Link(SLOW, "10ms")),
                                rel=1e-9)


# -- virtual shaping of real gloo groups ---------------------------------------------------------

def _three_nodes(rank: int, world: int, store: str, out: str) -> None:
    init_loopback(rank, world, store)
    topo = Topology.from_strings(3, 1, FAST, "10ms", node_links=[f"2={SLOW},30ms"])
    rec = TraceRecorder(rank)
    shaping.install(topo, "virtual", rec, run_dir=out)
    everyone = dist.new_group([0, 1, 2], backend=shaping.BACKEND)
    fast_pair = dist.new_group([0, 1], backend=shaping.BACKEND)
    x = torch.ones(250_000)  # 1 MB
    rec.begin_step(0)
    dist.all_reduce(x, group=everyone)
    rec.end_step(0)
    rec.begin_step(1)
    if rank < 2:
        dist.all_reduce(x, group=fast_pair)
    rec.end_step(1)
    frame = rec.frame().query("kind == 'collective'")
    result = {"modeled": frame["modeled_s"].tolist(), "value": x[0].item()}
    frames = [None] * world
    dist.all_gather_object(frames, rec.frame())
    # The model puts every inter-node group across all nodes, so it replays the step whose
    # group spans them all (it would pace the pair by node 2 too: conservative).
    trace = pd.concat(frames).query("step == 0")
    result["predicted"] = simulate(trace, topo).frame["time_s"].iloc[-1]
    result["compute"] = compute_outside_collectives(trace).sum()
    result["clock"] = shaping.clock()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    shaping.teardown()


@pytest.mark.dist
@pytest.mark.timing
@pytest.mark.timeout(120)
def test_virtual_shaping_runs_a_ring_at_the_slow_nodes_pace(tmp_path):
    spawn(_three_nodes, (3, str(tmp_path / "store"), str(tmp_path)), 3)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    slow = collective_time("all_reduce", 3, 1e6, Link(SLOW, "30ms"))  # 0.653 s
    fast = collective_time("all_reduce", 2, 1e6, Link(FAST, "10ms"))  # 0.12 s
    for rank, res in enumerate(results):
        # The virtual clock is exact: the 3-node ring takes the slow link's time...
        assert res["modeled"][0] == pytest.approx(slow, rel=1e-6)
        # ...and the pair that leaves node 2 out runs at the fast link.
        if rank < 2:
            assert res["modeled"][1] == pytest.approx(fast, rel=1e-6)
            assert res["value"] == 6.0
        assert res["clock"] >= slow
    # The model, replaying the shaped run's trace, sees the same slow ring, after the little
    # compute the trace recorded around it (longer on a loaded machine, so it is read, not
    # assumed). A model pacing the ring by the fast link would be 0.5 s short.
    assert results[0]["predicted"] == pytest.approx(slow + results[0]["compute"], abs=0.01)


# -- the command line: bad input, nothing written; simulate replays and overrides ------------------
def _flexbench(capsys, *args: str) -> tuple[int, str, str]:
    """Run the CLI in this process: exit status, stdout, stderr."""
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("link, words", [
    ("2=10Mbit", "names node 2, outside this topology's nodes 0..1"),
    ("1=10Mbit,soon", "does not parse: latency 'soon'"),
])
def test_flexbench_run_refuses_a_bad_node_link(tmp_path, capsys, link, words):
    out = tmp_path / "run"
    code, _, err = _flexbench(capsys, "run", "--nodes", "2", "--gpus-per-node", "1", "--steps",
                              "1", "--shaping", "virtual", "--inter-bw", "100Mbit",
                              "--node-link", link, "--out", str(out))
    assert code != 0
    assert words in err and err.strip().count("\n") == 0, err
    assert not out.exists() and not list(tmp_path.glob(".run.partial-*"))


def _fake_run(folder: Path, node_links: list[str]) -> Path:
    """A finished 3 nodes x 1 run: run.json, steps.parquet and a trace of 1 MB all-reduces."""
    folder.mkdir()
    cfg = RunConfig(nodes=3, gpus_per_node=1, node_links=node_links).validate().to_dict()
    meta = {"config": cfg, "final_val_loss": None}
    (folder / "run.json").write_text(json.dumps(meta))
    trace = make_trace(Topology.from_strings(3, 1), steps=3, compute=0.01)
    trace.to_parquet(folder / "trace.parquet")
    pd.DataFrame({"step": [1, 2, 3], "val_loss": [float("nan")] * 3,
                  "compute_s": [0.01] * 3}).to_parquet(folder / "steps.parquet")
    return folder


def _total(csv: Path) -> float:
    return float(pd.read_csv(csv)["time_s"].iloc[-1])


def test_a_replay_of_many_node_links_lists_three_and_the_slowest(tmp_path, capsys):
    plain = _fake_run(tmp_path / "plain", [])
    links = [arg for k in range(12) for arg in ("--node-link", f"{k}={k + 1}Gbit,{k + 1}ms")]
    code, out, err = _flexbench(capsys, "simulate", str(plain), "--inter-bw", FAST, "--nodes",
                                "12", *links, "--out", str(tmp_path / "many.csv"))
    assert code == 0, err
    assert ("node links 0=1Gbit,1ms, 1=2Gbit,2ms, 2=3Gbit,3ms, ... 12 in all, slowest 1Gbit, "
            "largest latency 12ms)") in out, out


def test_flexbench_simulate_replays_and_overrides_node_links(tmp_path, capsys):
    plain = _fake_run(tmp_path / "plain", [])
    slow = _fake_run(tmp_path / "slow", [f"1={SLOW},30ms"])
    base = ["--inter-bw", FAST, "--inter-lat", "10ms", "--algorithm", "ring"]
    assert _flexbench(capsys, "simulate", str(plain), *base, "--out",
                      str(tmp_path / "a.csv"))[0] == 0
    # The run's own node links are replayed...
    code, out, _ = _flexbench(capsys, "simulate", str(slow), *base, "--out",
                              str(tmp_path / "b.csv"))
    assert code == 0 and "node links 1=20Mbit,30ms" in out, out
    # ...and --node-link asks "what if": here node 2 sits behind the slow link instead.
    code, _, err = _flexbench(capsys, "simulate", str(plain), *base, "--node-link",
                              f"2={SLOW},30ms", "--out", str(tmp_path / "c.csv"))
    assert code == 0, err
    ring = collective_time("all_reduce", 3, 1e6, Link(SLOW, "30ms"))
    assert _total(tmp_path / "b.csv") == pytest.approx(3 * (0.01 + ring), rel=0.01)
    assert _total(tmp_path / "c.csv") == pytest.approx(_total(tmp_path / "b.csv"), rel=1e-9)
    assert _total(tmp_path / "a.csv") < 0.5 * _total(tmp_path / "b.csv")
    for link, words in (("3=1Gbit", "names node 3, outside this topology's nodes 0..2"),
                        ("1:1Gbit", "does not parse")):
        out_csv = tmp_path / f"bad-{link[0]}.csv"
        code, _, err = _flexbench(capsys, "simulate", str(plain), *base, "--node-link", link,
                                  "--out", str(out_csv))
        assert code != 0 and words in err, err
        assert err.strip().count("\n") == 0 and not out_csv.exists()


# -- kernel shaping: each node's tbf at its own rate ----------------------------------------------
_REASON = kernel.unavailable_reason()
needs_kernel = pytest.mark.skipif(_REASON is not None, reason=f"kernel shaping: {_REASON}")


def _rates(net: kernel.KernelNetwork) -> dict[str, str]:
    """The tbf rate tc reports on each node's eth0 and on its hub port."""
    out = {}
    for node in range(net.nodes):
        for ns, dev, key in ((net.namespace(node), kernel.INTERFACE, f"n{node}"),
                             (net.hub, f"v{node}", f"v{node}")):
            shown = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev],
                                   capture_output=True, text=True, check=True).stdout
            out[key] = re.search(r"tbf .*?rate (\S+)", shown).group(1)
    return out


@pytest.mark.dist
@pytest.mark.timing
@needs_kernel
@pytest.mark.timeout(150)
def test_kernel_links_run_at_each_nodes_own_rate_and_a_ring_at_the_slowest():
    net = kernel.KernelNetwork(2, kernel.TcSettings(parse_bandwidth("40Mbit")),
                               node_settings={1: kernel.TcSettings(parse_bandwidth("10Mbit"))})
    with net:
        assert _rates(net) == {"n0": "40Mbit", "v0": "40Mbit", "n1": "10Mbit", "v1": "10Mbit"}
    assert net.namespaces[0] not in kernel.our_namespaces()
    # A real gloo all-reduce between the two namespaces moves at node 1's 10 Mbit/s.
    result = measure_goodput(parse_bandwidth("40Mbit"), payload=1 << 20, repeats=3, nodes=2,
                             node_rates={1: parse_bandwidth("10Mbit")}, timeout_s=120)
    assert_link_goodput(result)
    assert [n for n in kernel.our_namespaces() if int(n.split("-")[1]) == os.getpid()] == []


# has_netem() makes a namespace, so it is only asked where namespaces can be made.
_NETEM = _REASON is None and kernel.has_netem()


@pytest.mark.skipif(_REASON is not None or _NETEM,
                    reason=f"refusal of node latency: kernel shaping {_REASON or 'has netem'}")
def test_kernel_mode_refuses_a_node_latency_without_netem(tmp_path, capsys):
    out = tmp_path / "run"
    before = set(kernel.our_namespaces())
    code, _, err = _flexbench(capsys, "run", "--nodes", "2", "--gpus-per-node", "1", "--steps",
                              "1", "--shaping", "kernel", "--inter-bw", "20Mbit",
                              "--node-link", "1=10Mbit,20ms", "--out", str(out))
    assert code != 0 and "node 1 has latency 20 ms, which needs the kernel's netem" in err, err
    assert err.strip().count("\n") == 0
    assert not out.exists() and not list(tmp_path.glob(".run.partial-*"))
    assert set(kernel.our_namespaces()) <= before
