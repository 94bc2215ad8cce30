"""The SimPy cluster model: closed-form agreement, bandwidth sharing, stragglers, bad input."""

from dataclasses import FrozenInstanceError, replace

import pandas as pd
import pytest
import simpy

from netsim import (
    Link,
    SharedLink,
    Topology,
    TraceRecorder,
    collective_time,
    collective_volume,
    ring_all_gather_time,
    ring_all_reduce_time,
    ring_nic_share,
    simulate,
)
from netsim.model import MODEL_NOTE, AlgorithmChoice, Replay, ReplayOptions
from netsim.trace import comm_per_step, load_trace


def make_trace(topo, steps=2, compute=0.05, ops=(("all_reduce", "ring", 1_000_000),), groups=None):
    """A combined trace where every rank computes, then runs each op on its replicate group.

    `compute`: seconds per step, or a function of (rank, step) giving them.
    """
    g = topo.accelerators_per_node
    frames = []
    for rank in range(topo.world_size):
        now = [0.0]
        rec = TraceRecorder(rank, topo, clock=lambda now=now: now[0])
        group = groups(rank) if groups else [rank % g + k * g for k in range(topo.nodes)]
        for step in range(steps):
            rec.begin_step(step)
            now[0] += compute(rank, step) if callable(compute) else compute
            for op, algorithm, nbytes in ops:
                t = now[0]
                row = rec.record_collective(
                    op, group, topo.crosses_nodes(group), algorithm, nbytes, 0, 0, t
                )
                now[0] += 0.001  # the real (fast, loopback) op
                rec.complete(row, t, now[0])
            rec.end_step(step)
        frames.append(rec.frame())
    return pd.concat(frames, ignore_index=True)


@pytest.mark.parametrize("nodes", [2, 4])
def test_the_slowest_recorded_node_sets_each_steps_pace(nodes):
    # Node 0 is slow at step 0, node 1 at step 1: a synchronous step waits for the slower one,
    # also when the recording is replayed on more nodes (a median node would be 25% too fast).
    recorded = Topology.from_strings(2, 1, "80Mbit", "0ms")
    slow = {(0, 0): 0.10, (1, 1): 0.12}
    trace = make_trace(recorded, steps=2, compute=lambda rank, step: slow.get((rank, step), 0.05),
                       ops=(("all_reduce", "ring", 1_000_000),))
    target = Topology.from_strings(nodes, 1, "80Mbit", "0ms")
    got = simulate(trace, target, ReplayOptions(algorithm="ring")).frame["step_time_s"].tolist()
    op = collective_time("all_reduce", nodes, 1_000_000, target.inter, "ring")
    assert got == pytest.approx([0.10 + op, 0.12 + op], rel=1e-6)


@pytest.mark.parametrize("nodes", [2, 4, 16])
@pytest.mark.parametrize(
    "op, algorithm",
    [
        ("all_reduce", "ring"),
        ("all_gather", "ring"),
        ("reduce_scatter", "ring"),
        ("reduce_scatter", "allreduce"),
        ("all_to_all", "ring"),
    ],
)
def test_single_collective_matches_closed_form(nodes, op, algorithm):
    topo = Topology.from_strings(nodes, 1, "80Mbit", "10ms")
    trace = make_trace(topo, steps=1, compute=0.0, ops=((op, algorithm, 2_000_000),))
    # The recorded algorithm's closed form: "auto" would pick the tree or Bruck at 16 nodes.
    got = simulate(trace, topo, ReplayOptions(algorithm="ring")).frame["step_time_s"].iloc[0]
    expected = collective_time(op, nodes, 2_000_000, topo.inter, algorithm)
    assert got == pytest.approx(expected, rel=0.01)
    if op == "all_reduce":
        assert got == pytest.approx(ring_all_reduce_time(nodes, 2_000_000, topo.inter), rel=0.01)
    if op == "all_gather":
        assert got == pytest.approx(
            ring_all_gather_time(nodes, nodes * 2_000_000, topo.inter), rel=0.01
        )


def test_replay_is_a_typed_frozen_result():
    topo = Topology.from_strings(2, 1, "80Mbit", "10ms")
    got = simulate(make_trace(topo, steps=2), topo, ReplayOptions(algorithm="ring"))
    assert isinstance(got, Replay) and got.frame.attrs == {}  # nothing rides on the frame
    assert list(got.frame.columns) == ["step", "step_time_s", "time_s"]
    assert got.topology is topo and got.recorded_topology == (2, 1)
    assert got.algorithms == (AlgorithmChoice("all_reduce", "ring", 2, True, 10**6, 10**6),)
    assert got.note == MODEL_NOTE and got.p2p_degrees == () and got.graphs == ()
    with pytest.raises(FrozenInstanceError):
        got.note = "changed"  # type: ignore[misc]


def test_model_replays_compute_and_extrapolates_steps_and_nodes():
    topo = Topology.from_strings(2, 1, "80Mbit", "10ms")
    trace = make_trace(topo, steps=3, compute=0.05)
    out = simulate(trace, topo).frame
    per_step = 0.05 + ring_all_reduce_time(2, 1e6, topo.inter)
    assert list(out.columns) == ["step", "step_time_s", "time_s"]
    assert out["step_time_s"].tolist() == pytest.approx([per_step] * 3, rel=1e-6)
    assert out["time_s"].iloc[-1] == pytest.approx(3 * per_step, rel=1e-6)
    big = Topology.from_strings(8, 1, "80Mbit", "10ms")
    longer = simulate(trace, big, ReplayOptions(steps=10, compute_scale=0.5, algorithm="ring"))
    assert len(longer.frame) == 10
    assert longer.frame["step_time_s"].iloc[-1] == pytest.approx(
        0.025 + ring_all_reduce_time(8, 1e6, big.inter)
    )
    assert "weak scaling" in longer.note


def test_traffic_outside_the_step_span_is_left_out():
    topo = Topology.from_strings(2, 1, "80Mbit", "10ms")
    trace = make_trace(topo, steps=2)
    late = trace[(trace["kind"] == "collective") & (trace["step"] == 0)].copy()
    late[["start_s", "wait_s", "end_s"]] += 100.0  # e.g. evaluation traffic labeled step 0
    late["seq"] += 1000
    with_eval = pd.concat([trace, late], ignore_index=True)
    pd.testing.assert_frame_equal(simulate(with_eval, topo).frame, simulate(trace, topo).frame)


def test_shared_link_gives_two_concurrent_flows_half_each():
    env = simpy.Environment()
    link = SharedLink(env, bandwidth=1e6)
    done = {}

    def flow(name, nbytes, delay):
        yield env.timeout(delay)
        yield link.transfer(nbytes)
        done[name] = env.now

    env.process(flow("a", 1e6, 0.0))
    env.process(flow("b", 1e6, 0.0))
    env.process(flow("c", 0.5e6, 10.0))  # alone later: full rate
    env.run()
    assert done["a"] == pytest.approx(2.0) and done["b"] == pytest.approx(2.0)
    assert done["c"] == pytest.approx(10.5)


def test_shared_link_late_joiner_slows_the_first_flow():
    env = simpy.Environment()
    link = SharedLink(env, bandwidth=1e6)
    done = {}

    def flow(name, nbytes, delay):
        yield env.timeout(delay)
        yield link.transfer(nbytes)
        done[name] = env.now

    env.process(flow("a", 1e6, 0.0))
    env.process(flow("b", 0.25e6, 0.5))  # shares from t=0.5: both at 0.5 MB/s
    env.run()
    assert done["b"] == pytest.approx(1.0)
    assert done["a"] == pytest.approx(1.25)


def test_per_node_nic_is_shared_by_the_nodes_accelerators():
    shared = Topology.from_strings(2, 2, "80Mbit", "0ms", nic="per-node")
    own = Topology.from_strings(2, 2, "80Mbit", "0ms", nic="per-accelerator")
    trace = make_trace(shared, steps=1, compute=0.0)
    t_shared = simulate(trace, shared).frame["step_time_s"].iloc[0]
    t_own = simulate(trace, own).frame["step_time_s"].iloc[0]
    assert t_own == pytest.approx(1e6 / 1e7, rel=0.01)  # 2(p-1)/p * n / bw with p = 2
    assert t_shared == pytest.approx(2 * t_own, rel=0.01)  # two replicate groups, one NIC


def test_straggler_node_slows_every_step():
    fast = Topology.from_strings(4, 1, "80Mbit", "10ms")
    slow = Topology.from_strings(4, 1, "80Mbit", "10ms", node_speed=[1, 1, 1, 0.25])
    trace = make_trace(fast, steps=2, compute=0.1)
    comm = ring_all_reduce_time(4, 1e6, fast.inter)
    assert simulate(trace, fast).frame["step_time_s"].iloc[1] == pytest.approx(0.1 + comm, rel=1e-6)
    # The collective waits for the slowest node: its compute takes 0.1 / 0.25 = 0.4 s.
    assert simulate(trace, slow).frame["step_time_s"].iloc[1] == pytest.approx(0.4 + comm, rel=1e-6)


def test_bad_traces_and_topologies_fail_clearly(tmp_path):
    topo = Topology.from_strings(2, 1, "80Mbit", "10ms")
    trace = make_trace(topo, steps=1)
    with pytest.raises(ValueError, match="missing the columns"):
        simulate(trace.drop(columns=["bytes"]), topo)
    with pytest.raises(ValueError, match="no rows"):
        simulate(trace.iloc[:0], topo)
    with pytest.raises(ValueError, match="does not exist"):
        simulate(tmp_path / "nope.parquet", topo)
    corrupt = tmp_path / "trace.parquet"
    corrupt.write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="not readable parquet"):
        simulate(corrupt, topo)
    with pytest.raises(ValueError, match="unknown kinds"):
        simulate(trace.assign(kind="lunch"), topo)
    with pytest.raises(ValueError, match="end_s is before"):
        simulate(trace.assign(end_s=trace["start_s"] - 1.0), topo)
    with pytest.raises(ValueError, match="steps"):
        simulate(trace, topo, ReplayOptions(steps=0))
    with pytest.raises(ValueError, match="compute_scale"):
        simulate(trace, topo, ReplayOptions(compute_scale=-1))
    with pytest.raises(ValueError, match="topology"):
        simulate(trace, "2x1")
    # Only one node's rows: its all-reduces name a partner the trace does not hold.
    with pytest.raises(ValueError, match="every rank"):
        simulate(trace[trace["rank"] == 0], topo)
    pairs = make_trace(
        Topology.from_strings(1, 4), steps=1, groups=lambda r: [r // 2 * 2, r // 2 * 2 + 1]
    )
    with pytest.raises(ValueError, match="intra-node groups of 2 ranks"):
        simulate(pairs, Topology.from_strings(4, 1))


def test_frame_round_trips_and_sums_per_step(tmp_path):
    rec = TraceRecorder(0, Topology.from_strings(2, 1))
    rec.begin_step(0)
    rec.record_collective("all_reduce", [0, 1], True, "ring", 10, 10, 10, 0.0, 0.1, 0.05)
    rec.end_step(0)
    rec.frame().to_parquet(tmp_path / "trace.parquet", index=False)  # as runs write it
    back = load_trace(tmp_path / "trace.parquet")
    assert back["group"].tolist() == ["0,1", ""] and back["inter"].tolist() == [True, False]
    assert comm_per_step(rec.frame()).to_dict("records") == [
        {
            "step": 0,
            "inter_bytes_sent": 10.0,
            "inter_bytes_received": 10.0,
            "inter_calls": 1,
            "intra_bytes": 0.0,
            "comm_s": pytest.approx(0.1),
        }
    ]


def test_comm_per_step_sums_bytes_over_ranks_and_takes_the_busiest_rank():
    topo = Topology.from_strings(2, 2)
    frames = []
    for rank in range(4):
        now = [0.0]
        rec = TraceRecorder(rank, topo, clock=lambda now=now: now[0])
        rec.begin_step(0)
        for _ in range(1 + rank):  # rank r runs r + 1 inter-node all-reduces of 0.5 s each
            rec.record_collective("all_reduce", [rank % 2, rank % 2 + 2], True, "ring", 8, 8, 6,
                                  now[0], now[0] + 0.5)
            now[0] += 0.5
        rec.record_collective("all_reduce", [rank // 2 * 2, rank // 2 * 2 + 1], False, "ring",
                              4, 4, 4, now[0], now[0])
        rec.end_step(0)
        rec.set_phase("eval")
        rec.record_collective("all_reduce", [0, 1, 2, 3], True, "ring", 99, 99, 99, now[0])
        frames.append(rec.frame())
    trace = pd.concat(frames, ignore_index=True)
    got = comm_per_step(trace).to_dict("records")
    assert got == [{"step": 0, "inter_bytes_sent": 8.0 * 10, "inter_bytes_received": 6.0 * 10,
                    "inter_calls": 4, "intra_bytes": 16.0, "comm_s": 2.0}]
    # A trace older than the phase column: step 0 was evaluation, later steps training.
    legacy = trace[trace["phase"] == "train"].assign(step=1).drop(columns="phase")
    assert comm_per_step(legacy)["inter_calls"].tolist() == [4]
    assert comm_per_step(trace.iloc[:0]).empty

def test_world_group_sends_one_ring_edge_per_node_through_the_nic():
    topo = Topology.from_strings(2, 2, "80Mbit", "0ms")
    trace = make_trace(topo, steps=1, compute=0.0, groups=lambda r: [0, 1, 2, 3])
    got = simulate(trace, topo).frame["step_time_s"].iloc[0]
    # Ring over 4 ranks: each node has one crossing edge carrying 2(p-1)/p * n.
    assert got == pytest.approx(2 * 3 / 4 * 1e6 / 1e7, rel=0.01)
    pairs = make_trace(topo, steps=1, compute=0.0, groups=lambda r: [0, 1, 2] if r < 3 else [3])
    got = simulate(pairs[pairs["rank"] < 3], Topology.from_strings(2, 2, "80Mbit", "0ms")).frame
    # Group {0, 1, 2}: 2 crossing edges over 2 nodes, one per node: 2(p-1)/p * n once.
    assert got["step_time_s"].iloc[0] == pytest.approx(2 * 2 / 3 * 1e6 / 1e7, rel=0.01)


def test_intra_ops_use_the_intra_link_or_their_recorded_time():
    topo = Topology.from_strings(1, 2, "80Mbit", "10ms", intra_bw="8Gbit", intra_lat="0")
    frames = []
    for rank in range(2):
        rec = TraceRecorder(rank, topo, clock=lambda: 0.0)
        rec.begin_step(0)
        row = rec.record_collective("all_reduce", [0, 1], False, "ring", 1_000_000, 0, 0, 0.01)
        rec.complete(row, 0.01, 0.03)  # really took 20 ms (unshaped loopback)
        rec.clock = lambda: 0.04
        rec.end_step(0)
        frames.append(rec.frame())
    trace = pd.concat(frames, ignore_index=True)
    modeled = simulate(trace, topo).frame["step_time_s"].iloc[0]
    assert modeled == pytest.approx(0.02 + 1e6 / 1e9, rel=1e-6)  # 20 ms compute + 1 ms on 1 GB/s
    recorded = simulate(trace, topo, ReplayOptions(intra="recorded")).frame["step_time_s"].iloc[0]
    assert recorded == pytest.approx(0.04, rel=1e-6)
    with pytest.raises(ValueError, match="intra 'fast'"):
        simulate(trace, topo, ReplayOptions(intra="fast"))


@pytest.mark.parametrize("intra", ["recorded", "model"])
def test_intra_node_ops_vanish_at_one_accelerator_per_node(intra):
    # 2 nodes x 2: each rank computes 50 ms, runs a 20 ms intra-node all-gather, then the
    # inter-node all-reduce. As 4 nodes x 1 the node's group is one rank: a collective of one
    # moves nothing, so the step is the compute and the all-reduce alone (the all-gather's
    # 20 ms neither kept as a delay nor turned into compute).
    recorded = Topology.from_strings(2, 2, "80Mbit", "0ms", intra_bw="8Gbit", intra_lat="0")
    frames = []
    for rank in range(4):
        now = [0.0]
        rec = TraceRecorder(rank, recorded, clock=lambda now=now: now[0])
        rec.begin_step(0)
        now[0] = 0.05
        node = [rank // 2 * 2, rank // 2 * 2 + 1]
        row = rec.record_collective("all_gather", node, False, "ring", 1_000_000, 0, 0, 0.05)
        rec.complete(row, 0.05, 0.07)
        replicas = [rank % 2, rank % 2 + 2]
        row = rec.record_collective("all_reduce", replicas, True, "ring", 1_000_000, 0, 0, 0.07)
        now[0] = 0.071
        rec.complete(row, 0.07, 0.071)
        rec.end_step(0)
        frames.append(rec.frame())
    trace = pd.concat(frames, ignore_index=True)
    target = Topology.from_strings(4, 1, "80Mbit", "0ms")
    got = simulate(trace, target,
                   ReplayOptions(intra=intra, algorithm="ring")).frame["step_time_s"].iloc[0]
    op = collective_time("all_reduce", 4, 1_000_000, target.inter, "ring")
    assert got == pytest.approx(0.05 + op, rel=1e-6)


def hsdp_trace(late=1.5, shards=(262_400, 36_992, 2_580, 640), steps=4):
    """2 nodes x 2 HSDP trace: per layer intra all-gather and reduce-scatter, then an inter
    all-reduce of the shard; local-0 ranks start `late` seconds after their node peers, so the
    peers' first intra op records that wait (as the startup skew of a real run does)."""
    topo = Topology.from_strings(2, 2)
    frames = []
    for rank in range(4):
        now = [late if rank % 2 == 0 else 0.0]
        rec = TraceRecorder(rank, topo, clock=lambda now=now: now[0])
        node = rank // 2
        shard, rep = [2 * node, 2 * node + 1], [rank % 2, rank % 2 + 2]

        def coll(op, group, nbytes, until, now=now, rec=rec):
            inter = topo.crosses_nodes(group)
            row = rec.record_collective(op, group, inter, "ring", nbytes, 0, 0, now[0])
            now[0] = max(now[0], until)  # a real collective returns once its last member came
            rec.complete(row, now[0], now[0])

        for step in range(steps):
            rec.begin_step(step)
            for layer, nbytes in enumerate(shards):
                # Members leave an intra op together, 0.1 ms after the last one came.
                base = late + step + layer * 0.01
                if step or layer:
                    now[0] = max(now[0], base)  # compute up to the layer's all-gather
                coll("all_gather", shard, nbytes, base + 1e-4)
                now[0] += 1e-3  # compute
                coll("reduce_scatter", shard, 2 * nbytes, base + 1.2e-3)
                coll("all_reduce", rep, nbytes, now[0] + 1e-3)
            rec.end_step(step)
        frames.append(rec.frame())
    return pd.concat(frames, ignore_index=True)


@pytest.mark.parametrize("intra", ["recorded", "model"])
def test_two_replicate_groups_per_node_never_beat_the_shared_nic(intra):
    # HSDP, 2 ranks per node: replicate groups {0,2} and {1,3} each all-reduce their shard over
    # p = 2, i.e. each rank puts n bytes on the wire and node 0's one NIC carries 2n per step.
    trace = hsdp_trace()
    topo = Topology(2, 2, Link(1e11, 5e-6), Link(1.25e6, 0.0))
    bound = 2 * sum((262_400, 36_992, 2_580, 640)) / 1.25e6  # 0.484 s
    got = simulate(trace, topo, ReplayOptions(intra=intra, compute_scale=1e-3)).frame["step_time_s"]
    # A recorded intra op that waited 1.5 s for a late peer must not let the other position run
    # a step ahead and use the NIC alone: every step pays the whole NIC bound, and barely more.
    assert (got >= bound * (1 - 1e-9)).all(), got.tolist()
    assert (got <= bound * 1.01).all(), got.tolist()


def test_world_group_all_gather_puts_a_rings_bytes_on_each_nic():
    # DeMo-style: one all-gather over all 4 ranks of 2 nodes. The ring 0-1-2-3-0 crosses nodes on
    # 1->2 and 3->0, so each node's NIC sends and receives one edge's (p-1) * n bytes.
    topo = Topology.from_strings(2, 2, "80Mbit", "0ms")
    n = 500_000
    trace = make_trace(
        topo, steps=1, compute=0.0, ops=(("all_gather", "ring", n),), groups=lambda r: [0, 1, 2, 3]
    )
    nic_bytes = 3 * n
    for nic in ("per-node", "per-accelerator"):
        got = simulate(trace, replace(topo, nic=nic)).frame["step_time_s"].iloc[0]
        assert got == pytest.approx(nic_bytes / 1e7, rel=0.01)
    # Shaping books each rank's wire bytes times the ring's share; a node's two ranks together
    # must book exactly the crossing edge's bytes.
    share = ring_nic_share([0, 1, 2, 3], topo)
    assert 2 * share * collective_volume("all_gather", 4, n).bytes_sent == nic_bytes


def test_eval_phase_is_recorded_apart_and_never_replayed(tmp_path):
    topo = Topology.from_strings(2, 1, "80Mbit", "0ms")
    trace = make_trace(topo, steps=2)
    frames = []
    for rank in range(2):
        now = [10.0]
        rec = TraceRecorder(rank, topo, clock=lambda now=now: now[0])
        rec.begin_step(1)
        rec.end_step(1)
        rec.set_phase("eval")  # evaluation after step 1: same step number, its own phase
        row = rec.record_collective("all_reduce", [0, 1], True, "ring", 8, 8, 8, now[0])
        rec.complete(row, now[0], now[0] + 5.0)
        frames.append(rec.frame().query("phase == 'eval'"))
        # Training figures leave eval out: step 1 ran no training collective.
        assert comm_per_step(rec.frame()).set_index("step").loc[1, "inter_calls"] == 0
    with_eval = pd.concat([trace, *frames], ignore_index=True)
    assert set(with_eval["phase"]) == {"train", "eval"}
    expected = simulate(trace, topo).frame
    pd.testing.assert_frame_equal(simulate(with_eval, topo).frame, expected)
    # Traces written before the phase column labelled evaluation traffic as step 0.
    legacy = pd.concat(
        [trace.assign(step=trace["step"] + 1), *(f.assign(step=0) for f in frames)]
    ).drop(columns="phase")
    legacy.to_parquet(tmp_path / "trace.parquet")
    back = load_trace(tmp_path / "trace.parquet")
    assert (back.loc[back["step"] == 0, "phase"] == "eval").all()
    assert (back.loc[back["step"] > 0, "phase"] == "train").all()
    assert simulate(back, topo).frame["time_s"].tolist() == expected["time_s"].tolist()
    with pytest.raises(ValueError, match="phase"):
        TraceRecorder(0).set_phase("")


class _Bar:
    """A stand-in for tqdm that remembers what the replay told it."""

    made: list["_Bar"] = []

    def __init__(self, total, **kwargs):
        self.total, self.kwargs, self.n = total, kwargs, 0
        _Bar.made.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n=1):
        self.n += n


def test_a_replay_with_progress_counts_every_simulated_step(monkeypatch):
    import sys

    import netsim.model.replay as replay

    monkeypatch.setattr(replay, "tqdm", _Bar)
    _Bar.made.clear()
    topo = Topology.from_strings(4, 2, "80Mbit", "10ms")
    trace = make_trace(Topology.from_strings(2, 2, "80Mbit", "10ms"), steps=3)
    plain = simulate(trace, topo, ReplayOptions(steps=25))
    assert not _Bar.made  # no bar unless asked
    shown = simulate(trace, topo, ReplayOptions(steps=25, progress=True))
    (bar,) = _Bar.made
    assert bar.total == bar.n == 25  # every step once, however many processes replay it
    assert bar.kwargs["delay"] == 2 and bar.kwargs["file"] is sys.stderr
    pd.testing.assert_frame_equal(shown.frame, plain.frame)


def _concurrent_trace(ag_bytes: int, ar_bytes: int) -> pd.DataFrame:
    """2 nodes x 2: every rank issues an intra-node all-gather and an inter-node all-reduce at
    once after 10 ms of compute, then waits for both."""
    topo = Topology.from_strings(2, 2)
    frames = []
    for rank in range(4):
        rec = TraceRecorder(rank, topo, clock=lambda: 0.0)
        rec.begin_step(0)
        node, rep = [rank // 2 * 2, rank // 2 * 2 + 1], [rank % 2, rank % 2 + 2]
        gather = rec.record_collective("all_gather", node, False, "ring", ag_bytes, 0, 0, 0.01)
        reduce = rec.record_collective("all_reduce", rep, True, "ring", ar_bytes, 0, 0, 0.01)
        rec.complete(gather, 0.01, 0.01)
        rec.complete(reduce, 0.01, 0.01)
        rec.clock = lambda: 0.01
        rec.end_step(0)
        frames.append(rec.frame())
    return pd.concat(frames, ignore_index=True)


def test_a_node_standing_for_two_shares_their_nics_between_its_intra_and_inter_ops():
    # Each target node stands for 2 nodes of 1 GPU (node_span=2): its "intra" ring crosses
    # both of their 1 MB/s NICs once, and each GPU's all-reduce leaves through its own node's
    # NIC. Per real node the two flows share 1 MB/s: the step is compute + (X_ag + X_ar) / B
    # (the smaller flow at half the link until done, the other alone after), against
    # max(X_ag, X_ar) / B when the intra-node ring has a link of its own.
    b = 1e6
    trace = _concurrent_trace(500_000, 1_000_000)
    x_ag = collective_volume("all_gather", 2, 500_000, "ring").paced_bytes
    x_ar = collective_volume("all_reduce", 2, 1_000_000, "ring").paced_bytes
    assert x_ag < x_ar  # the gather ends first; the hand formula holds either way
    spanning = Topology(2, 2, Link(b, 0.0), Link(2 * b, 0.0), node_span=2)
    got = simulate(trace, spanning, ReplayOptions(algorithm="ring")).frame["step_time_s"].iloc[0]
    assert got == pytest.approx(0.01 + (x_ag + x_ar) / b, rel=1e-9)
    apart = simulate(trace, replace(spanning, node_span=1), ReplayOptions(algorithm="ring")).frame
    assert apart["step_time_s"].iloc[0] == pytest.approx(0.01 + max(x_ag, x_ar) / b, rel=1e-9)
    # A ring paced by a slower hop inside the node keeps that pace.
    slow = replace(spanning, intra=Link(b / 10, 0.0))
    got = simulate(trace, slow, ReplayOptions(algorithm="ring")).frame["step_time_s"].iloc[0]
    assert got == pytest.approx(0.01 + 10 * x_ag / b, rel=1e-9)
    with pytest.raises(ValueError, match="node_span 2 .* takes nic 'per-node'"):
        replace(spanning, nic="per-accelerator")
