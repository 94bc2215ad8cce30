"""Gossip's point-to-point traffic: traced per message, shaped on a shared NIC, replayed by degree.

Closed form of one gossip step on a uniform network: `compute + degree * shard / bw + latency`
(the node's degree messages share its NIC each way at once; their latencies overlap).
"""

import json
import math
import time

import pandas as pd
import pytest
import simpy
import torch
import torch.distributed as dist

import flexdemo
from experiments.cli import main
from experiments.errors import ConfigError
from experiments.replay.engine import replay
from experiments.replay.gossip import recorded_schedule
from experiments.replay.recordings import read_run
from experiments.replay.target import ReplayTarget
from flexdemo import graphs
from netsim import Link, ReplayOptions, Topology, TraceRecorder, comm_per_step, shaping, simulate
from netsim.model import SharedLink
from netsim.nic import fair_share_finishes
from netsim.trace import validate_trace
from tests.dist_utils import run_ranks

SHARD = 1_000_000  # bytes of one node's shard: one message
BW = 10e6  # bytes/s: "80Mbit"
LAT = 0.01
COMPUTE = 0.1


def closed_form(degree: int) -> float:
    """One gossip step: compute, then degree messages each way sharing the NIC, one latency."""
    return COMPUTE + degree * SHARD / BW + LAT


def gossip_trace(nodes: int, graph: str, steps: int = 3, every: int = 1) -> pd.DataFrame:
    """A hand-made trace of gossip on `graph`: compute, then one send and recv per neighbour."""
    topo = Topology.from_strings(nodes, 1)
    frames = []
    for rank in range(nodes):
        now = [0.0]
        rec = TraceRecorder(rank, topo, clock=lambda now=now: now[0])
        rounds = 0
        for step in range(1, steps + 1):
            rec.begin_step(step)
            now[0] += COMPUTE
            if step % every == 0:
                rows = []
                for peer in graphs.peers(graph, nodes, rank, rounds):
                    for op in ("send", "recv"):
                        sent, received = (SHARD, 0) if op == "send" else (0, SHARD)
                        rows.append(rec.record_collective(
                            op, range(nodes), True, "direct", SHARD, sent, received, now[0],
                            peer=peer))
                for row in rows:  # waited on in order, as batch_isend_irecv's works are
                    rec.complete(row, now[0], now[0] + 0.5)
                now[0] += 0.5  # recorded wire time: the model prices it afresh
                rounds += 1
            rec.end_step(step)
        frames.append(rec.frame())
    return pd.concat(frames, ignore_index=True)


def _meta(graph: str, method: str = "gossip") -> dict:
    return {"config": {"method": method, "graph": graph}}


def _steps(n: int, graph_column: list | None = None) -> pd.DataFrame:
    steps = pd.DataFrame({"step": range(1, n + 1)})
    return steps if graph_column is None else steps.assign(graph=graph_column)


def _replay(trace: pd.DataFrame, nodes: int, graph: str, **kw) -> pd.DataFrame:
    degrees, _, _ = recorded_schedule(_meta(graph), _steps(3), nodes, None)
    return simulate(trace, Topology.from_strings(nodes, 1, "80Mbit", "10ms"),
                    ReplayOptions(degrees=degrees, **kw)).frame


# -- the processor-shared NIC, in both the shaper's batch and the model's link ---------------------
def test_fair_share_gives_concurrent_messages_equal_rates():
    assert fair_share_finishes([0.0, 0.0], [10.0, 10.0], 10.0) == [2.0, 2.0]
    assert fair_share_finishes([0.0, 0.0], [5.0, 10.0], 10.0) == pytest.approx([1.0, 1.5])
    assert fair_share_finishes([0.0, 5.0], [10.0, 10.0], 10.0) == pytest.approx([1.0, 6.0])
    assert fair_share_finishes([3.0], [0.0], 1.0) == [3.0]
    # Epoch-sized clock readings: the bytes must not vanish in rounding (this once hung).
    t0 = time.time()
    ends = fair_share_finishes([t0, t0 + 1e-5, t0 + 2e-5], [3468288.0] * 3, 12.5e6)
    assert [e - t0 for e in ends] == pytest.approx([3 * 3468288 / 12.5e6] * 3, rel=1e-4)
    with pytest.raises(ValueError, match="bandwidth"):
        fair_share_finishes([0.0], [1.0], 0.0)


def test_shared_link_weighted_flow_stands_for_equal_flows():
    env = simpy.Environment()
    link = SharedLink(env, bandwidth=1e6)
    done = {}

    def flow(name, nbytes, weight):
        yield link.transfer(nbytes, weight)
        done[name] = env.now

    env.process(flow("two", 2e6, 2))  # two 1 MB messages ...
    env.process(flow("one", 1e6, 1))  # ... and a third: each gets a third of the link
    env.run()
    assert done == {"two": pytest.approx(3.0), "one": pytest.approx(3.0)}


# -- the trace -----------------------------------------------------------------------------------
def test_messages_are_traced_one_row_each_with_their_peer():
    trace = gossip_trace(4, "ring", steps=1)
    rows = trace[(trace["rank"] == 0) & (trace["kind"] == "collective")]
    assert rows["op"].tolist() == ["send", "recv", "send", "recv"]
    assert rows["peer"].tolist() == [1, 1, 3, 3]
    older = validate_trace(trace.drop(columns="peer"))  # written before the column existed
    assert (older["peer"] == -1).all()
    # Concurrent messages count once in the step's communication time.
    assert comm_per_step(trace)["comm_s"].tolist() == [pytest.approx(0.5)]


# -- the model -----------------------------------------------------------------------------------
def test_replayed_step_is_the_closed_form_at_the_recorded_size():
    trace = gossip_trace(4, "ring")
    got = simulate(trace, Topology.from_strings(4, 1, "80Mbit", "10ms"))
    assert got.frame["step_time_s"].tolist() == pytest.approx([closed_form(2)] * 3, rel=0.01)
    assert got.p2p_degrees == (2,) and "vertex-transitive" in got.note


def test_ring_costs_the_same_at_1024_nodes_exponential_grows_with_log_n():
    ring4, ring1024 = gossip_trace(4, "ring"), gossip_trace(4, "ring")
    small = _replay(ring4, 4, "ring")["step_time_s"]
    large = _replay(ring1024, 1024, "ring")["step_time_s"]
    assert large.tolist() == pytest.approx(small.tolist(), rel=0.01)
    assert large.tolist() == pytest.approx([closed_form(2)] * 3, rel=0.01)

    expo = gossip_trace(4, "exponential")  # 3 peers on 4 nodes
    at4 = _replay(expo, 4, "exponential")["step_time_s"].iloc[-1]
    at1024 = _replay(expo, 1024, "exponential")["step_time_s"].iloc[-1]
    # 2 log2(n) - 1 peers: hops 1..512 both ways, 512 hops being the same node both ways.
    assert graphs.degree_of("exponential", 1024, 0) == 2 * 10 - 1
    assert at4 == pytest.approx(closed_form(3), rel=0.01)
    assert at1024 == pytest.approx(closed_form(19), rel=0.01)
    assert (at1024 - COMPUTE) / (at4 - COMPUTE) == pytest.approx(
        (19 * SHARD / BW + LAT) / (3 * SHARD / BW + LAT), rel=0.01)

    torus = _replay(gossip_trace(4, "torus"), 1024, "torus")["step_time_s"].iloc[-1]
    assert torus == pytest.approx(closed_form(4), rel=0.01)  # 32 x 32: four grid neighbours


def test_time_varying_and_per_step_graphs_and_replicate_every():
    # One peer a round on any node count: the busiest node has one, off powers of two too.
    for nodes in (1024, 6):
        got = _replay(gossip_trace(4, "one-peer-exponential"), nodes, "one-peer-exponential")
        assert got["step_time_s"].tolist() == pytest.approx([closed_form(1)] * 3, rel=0.01)
    # ada records its graph per step; empty entries fall back to the run's setting.
    degrees, _, lines = recorded_schedule(_meta("ring", "ada"),
                                    _steps(3, ["ring", None, "exponential"]), 1024, None)
    assert [degrees(step, 0) for step in (1, 2, 3)] == [2, 2, 19]
    assert lines == ["ada graph exponential rebuilt on 1024 nodes: degree 19",
                     "ada graph ring rebuilt on 1024 nodes: degree 2"]
    got = simulate(gossip_trace(4, "ring"), Topology.from_strings(1024, 1, "80Mbit", "10ms"),
                   ReplayOptions(degrees=degrees)).frame
    assert got["step_time_s"].tolist() == pytest.approx(
        [closed_form(2), closed_form(2), closed_form(19)], rel=0.01)
    # Gossip every other step: the steps in between are compute only.
    sparse = _replay(gossip_trace(4, "ring", steps=4, every=2), 1024, "ring")["step_time_s"]
    assert sparse.tolist() == pytest.approx([COMPUTE, closed_form(2)] * 2, rel=0.01)
    flexdemo = recorded_schedule({"config": {"method": "flexdemo"}}, _steps(3), 1024, None)
    assert flexdemo == (None, None, [])


def test_other_node_counts_need_the_graph_and_the_graph_must_fit():
    with pytest.raises(ValueError, match="point-to-point messages recorded on 4 nodes"):
        simulate(gossip_trace(4, "ring"), Topology.from_strings(16, 1))
    with pytest.raises(ConfigError, match=r"--nodes 1021: graph='torus' .* prime"):
        recorded_schedule(_meta("torus"), _steps(3), 1021, None)


def test_slow_node_links_pace_the_gossip_step():
    topo = Topology.from_strings(16, 1, "80Mbit", "10ms", node_links=["3=40Mbit,10ms"])
    degrees, _, _ = recorded_schedule(_meta("ring"), _steps(3), 16, None)
    got = simulate(gossip_trace(4, "ring"), topo,
                   ReplayOptions(degrees=degrees)).frame["step_time_s"]
    assert got.iloc[-1] == pytest.approx(COMPUTE + 2 * SHARD / (BW / 2) + LAT, rel=0.01)


# -- flexbench simulate on a recorded gossip run -------------------------------------------------
def _fake_run(folder, graph: str) -> None:
    folder.mkdir()
    config = {"method": "gossip", "graph": graph, "nodes": 4, "gpus_per_node": 1,
              "intra_bw": "100GB/s", "intra_lat": "5us", "node_links": []}
    (folder / "run.json").write_text(json.dumps({"config": config, "final_val_loss": None}))
    pd.DataFrame({"step": [1, 2, 3], "val_loss": [math.nan] * 3,
                  "compute_s": [COMPUTE] * 3}).to_parquet(folder / "steps.parquet")
    gossip_trace(4, graph).to_parquet(folder / "trace.parquet")


def test_cli_prints_the_rebuilt_graph_and_refuses_one_that_does_not_fit(tmp_path, capsys):
    _fake_run(tmp_path / "torus", "torus")
    out = tmp_path / "sim.csv"
    argv = ["simulate", str(tmp_path / "torus"), "--inter-bw", "80Mbit", "--inter-lat", "10ms",
            "--out", str(out)]
    assert main([*argv, "--nodes", "1024"]) == 0
    assert "gossip graph torus rebuilt on 1024 nodes: degree 4" in capsys.readouterr().out
    assert pd.read_csv(out)["step_time_s"].tolist() == pytest.approx([closed_form(4)] * 3,
                                                                      rel=0.01)
    out.unlink()
    assert main([*argv, "--nodes", "1021"]) == 2
    err = capsys.readouterr().err
    assert "graph='torus' needs a node count with a 2-D factorization" in err
    assert err.count("\n") == 1 and not out.exists()
    sim = replay(read_run(tmp_path / "torus"), ReplayTarget(inter_bw="80Mbit", inter_lat="10ms"))
    assert sim.graphs == ("gossip graph torus rebuilt on 4 nodes: degree 2",)
    assert sim.p2p_degrees == (2,) and sim.frame["step"].tolist() == [1, 2, 3]


# -- real gloo ranks, shaped ---------------------------------------------------------------------
def _late_sender_and_shared_nic(rank: int, world: int, out: str) -> None:
    topo = Topology.from_strings(3, 1, "80Mbit", "10ms")
    rec = TraceRecorder(rank, topo)
    shaper = shaping.install(topo, "virtual", rec, run_dir=out)
    try:
        group = dist.new_group([0, 1, 2], backend=shaping.BACKEND)
        x = torch.ones(SHARD // 4)
        rec.begin_step(1)  # rank 0 sends to 1 and 2 at once: half the rate for each
        if rank == 0:
            ops = [dist.P2POp(dist.isend, x, group=group, group_peer=p) for p in (1, 2)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        else:
            dist.recv(torch.empty_like(x), group=group, group_src=0)
        rec.end_step(1)
        rec.begin_step(2)  # rank 1 sends 0.3 s late: rank 0's receive starts then
        if rank == 1:
            time.sleep(0.3)
            dist.send(x, group=group, group_dst=0)
        elif rank == 0:
            dist.recv(torch.empty_like(x), group=group, group_src=1)
        rec.end_step(2)
        # Each rank's times count from its own start: shift them onto the shared wall clock.
        frames = [None] * world
        dist.all_gather_object(frames, rec.frame().assign(
            start_s=lambda f: f["start_s"] + shaper.t0, end_s=lambda f: f["end_s"] + shaper.t0))
    finally:
        shaping.uninstall()
    if rank == 0:
        trace = pd.concat(frames, ignore_index=True)
        rows = trace[trace["kind"] == "collective"].set_index(["step", "rank", "op", "peer"])
        sends = rows.loc[[(1, 0, "send", 1), (1, 0, "send", 2)]]
        ends = sends["start_s"] + sends["modeled_s"]
        # Half the rate each: the two end together, up to the microseconds between their issues
        # (the first had the NIC alone until then), and the pair takes twice one's time.
        stagger = sends["start_s"].max() - sends["start_s"].min()
        assert ends.max() - ends.min() <= stagger + 1e-6
        assert ends.max() - sends["start_s"].min() == pytest.approx(2 * SHARD / BW + LAT,
                                                                    rel=0.01)
        # A receive is paced by its own NIC (the sender's other messages are not visible to it).
        assert rows.loc[(1, 2, "recv", 0), "modeled_s"] == pytest.approx(SHARD / BW + LAT,
                                                                         rel=0.01)
        sent = rows.loc[(2, 1, "send", 0), "start_s"]
        got = rows.loc[(2, 0, "recv", 1), "end_s"]
        assert got >= sent + SHARD / BW + LAT - 1e-3


@pytest.mark.dist
@pytest.mark.timing
@pytest.mark.timeout(120)
def test_shaped_messages_share_the_nic_and_wait_for_a_late_sender(tmp_path):
    run_ranks(_late_sender_and_shared_nic, 3, str(tmp_path))


def _wall_gossip(rank: int, world: int, out: str) -> None:
    topo = Topology(nodes=world, accelerators_per_node=1, intra=Link("100Gbit"),
                    inter=Link("80Mbit", "10ms"))
    rec = TraceRecorder(rank, topo)
    shaping.install(topo, "wall", rec, run_dir=out)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(500, 500, bias=False)  # 1 MB of float32: the node's message
        mesh = flexdemo.build_mesh(world, 1, backend=shaping.BACKEND)
        flexdemo.parallelize(model, mesh,
                             inter_all_reduce=flexdemo.method_record("gossip").inter_all_reduce)
        opt = flexdemo.build_optimizer("gossip", model, mesh, lr=0.01, graph="ring")
        for step in range(1, 4):
            rec.begin_step(step)
            opt.zero_grad()
            model(torch.randn(4, 500)).square().mean().backward()
            opt.step()
            rec.end_step(step)
        frames = [None] * world
        dist.all_gather_object(frames, rec.frame())
    finally:
        shaping.uninstall()
    if rank == 0:
        trace = pd.concat(frames, ignore_index=True)
        measured = comm_per_step(trace)["comm_s"]
        messages = trace[trace["kind"] == "collective"].groupby(["step", "rank"])
        per_rank = messages["end_s"].max() - messages["start_s"].min()
        degrees, _, _ = recorded_schedule(_meta("ring"), _steps(3), world, None)
        # Compute scaled to nothing: the model's step is its communication alone.
        model = simulate(trace, topo,
                         ReplayOptions(degrees=degrees, compute_scale=1e-9)).frame["step_time_s"]
        modeled = 2 * SHARD / BW + LAT
        seen = (modeled, measured.tolist(), per_rank.tolist(), model.tolist())
        assert model.tolist() == pytest.approx([modeled] * 3, rel=0.01), seen
        # A behaviour check, not a speed test: the wall never beats the model (a loaded machine
        # may add to it: a late peer, a slow first step, so no upper bound on wall time).
        assert (measured >= 0.95 * modeled).all() and (per_rank >= 0.95 * modeled).all(), seen
        # What the shaper held each message to: between one message alone on the NIC and two
        # sharing it all the way (issues a few ms apart share it for part of the time).
        held = trace.loc[trace["op"].isin(["send", "recv"]), "modeled_s"]
        assert len(held) == 3 * world * 2 * 2  # steps x ranks x 2 neighbours x (send, recv)
        assert held.between(SHARD / BW + LAT - 1e-6, modeled + 1e-6).all(), held.tolist()


@pytest.mark.dist
@pytest.mark.timing
@pytest.mark.timeout(180)
def test_wall_shaped_gossip_on_4_nodes_matches_the_model(tmp_path):
    run_ranks(_wall_gossip, 4, str(tmp_path))
