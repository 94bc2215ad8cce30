"""FSDP2 overlap on replay: a scripted two-unit trace against the closed form of both modes."""

import pandas as pd
import pytest

from netsim import ReplayOptions, Topology, TraceRecorder, collective_volume, simulate
from netsim.model import OVERLAP_NOTE, has_unit_marks

# Recorded seconds: forward, backward of unit 1 (the inner block, whose backward comes first),
# backward of unit 0, the rest of the backward after unit 0's reduce was issued, the optimizer.
F, B1, B0, E, OPT = 0.010, 0.020, 0.030, 0.002, 0.004
SHARD = {1: 100_000, 0: 200_000}  # bytes of each unit's gradient shard (all-reduce payload)
EXCHANGE = 50_000  # the method's own all-gather in opt.step, after the backward


def _topology() -> Topology:
    # No latency, so each op is its bytes over its link; 2 ranks per node share the node's NIC.
    return Topology.from_strings(2, 2, "80Mbit", "0ms", intra_bw="8Gbit", intra_lat="0ms")


def scripted_trace(marks: bool = True, instant: bool = False) -> pd.DataFrame:
    """2 nodes x 2 ranks, two FSDP2 units: per unit an intra reduce-scatter (twice the shard)
    and an inter all-reduce of the shard, then an inter all-gather in opt.step; every op
    really took 1 ms (loopback) and was waited on at once, as on CPU gloo. `instant`: as
    `experiments.plan` writes a program, every op takes no time and nothing is computed after
    the last reduce, so it, the backward mark and the exchange fall at one instant."""
    topo = _topology()
    took, rest, opt = (0.0, 0.0, 0.0) if instant else (1e-3, E, OPT)
    frames = []
    for rank in range(4):
        now = [0.0]
        rec = TraceRecorder(rank, topo, clock=lambda now=now: now[0])
        node = rank // 2
        shard, rep = [2 * node, 2 * node + 1], [rank % 2, rank % 2 + 2]

        def coll(op, group, nbytes, now=now, rec=rec):
            row = rec.record_collective(op, group, topo.crosses_nodes(group), "ring", nbytes,
                                        0, 0, now[0])
            now[0] += took
            rec.complete(row, row["start_s"], now[0])

        for step in range(2):
            rec.begin_step(step)
            now[0] += F + B1
            for unit, compute in ((1, 0.0), (0, B0)):
                now[0] += compute
                if marks:
                    rec.mark_unit_backward(unit)
                coll("reduce_scatter", shard, 2 * SHARD[unit])
                coll("all_reduce", rep, SHARD[unit])
            now[0] += rest
            if marks:
                rec.mark_backward()
            now[0] += opt
            coll("all_gather", rep, EXCHANGE)
            rec.end_step(step)
        frames.append(rec.frame())
    return pd.concat(frames, ignore_index=True)


def _times():
    """Each op's modeled seconds: R (intra reduce-scatter), T (inter all-reduce), G (gather)."""
    topo = _topology()
    bw, intra = topo.inter.effective_bandwidth, topo.intra
    # Both ranks of a node run their replicate-group op at once: two equal flows on one NIC.
    inter = lambda op, n: 2 * collective_volume(op, 2, n, "ring").paced_bytes / bw  # noqa: E731
    r = {u: collective_volume("reduce_scatter", 2, 2 * n, "ring").time(intra)
         for u, n in SHARD.items()}
    t = {u: inter("all_reduce", n) for u, n in SHARD.items()}
    return r, t, inter("all_gather", EXCHANGE)


def test_recorded_overlap_is_the_serial_closed_form():
    r, t, g = _times()
    # Every op where the trace waited on it: compute and transfers add up.
    expected = F + B1 + r[1] + t[1] + B0 + r[0] + t[0] + E + OPT + g
    replay = simulate(scripted_trace(), _topology(), ReplayOptions(algorithm="ring"))
    assert replay.overlap == "recorded" and OVERLAP_NOTE not in replay.note
    assert replay.frame["step_time_s"].tolist() == pytest.approx([expected] * 2, rel=1e-9)


def test_fsdp2_overlap_is_the_two_stream_closed_form():
    r, t, g = _times()
    # Unit k's reduce-scatter starts when its backward ends and after the previous one (the
    # reduce-scatter stream); its all-reduce after it and after the previous all-reduce (the
    # all-reduce stream); compute never waits for them until the backward ends.
    t1 = F + B1  # unit 1's backward ends
    rs1 = t1 + r[1]
    ar1 = rs1 + t[1]
    t0 = t1 + B0  # unit 0's backward ends (compute did not wait for unit 1's reduce)
    rs0 = max(t0, rs1) + r[0]
    ar0 = max(rs0, ar1) + t[0]
    backward = max(t0 + E, ar0)  # the optimizer step waits for every reduce
    expected = backward + OPT + g  # the method's exchange stays serial
    assert B0 > r[1] + t[1] and t0 + E < ar0  # the numbers exercise both sides of the maxima
    replay = simulate(scripted_trace(), _topology(),
                      ReplayOptions(algorithm="ring", overlap="fsdp2"))
    assert replay.overlap == "fsdp2" and OVERLAP_NOTE in replay.note
    assert replay.frame["step_time_s"].tolist() == pytest.approx([expected] * 2, rel=1e-9)


def test_an_exchange_at_the_backward_marks_instant_follows_every_reduce():
    # The optimizer step needs every gradient: an exchange issued at the mark's own time (no
    # time between them on the trace's clock) starts after the last streamed reduce, not
    # beside it.
    r, t, g = _times()
    t1, t0 = F + B1, F + B1 + B0
    rs1 = t1 + r[1]
    ar1 = rs1 + t[1]
    rs0 = max(t0, rs1) + r[0]
    backward = max(rs0, ar1) + t[0]
    replay = simulate(scripted_trace(instant=True), _topology(), ReplayOptions(algorithm="ring",
                      overlap="fsdp2"))
    assert replay.frame["step_time_s"].tolist() == pytest.approx([backward + g] * 2, rel=1e-9)


GATHER = (400_000, 300_000, 200_000)  # bytes of three units' all-gathers, in forward order
C = (0.0001, 0.00015, 0.0003)  # each unit's forward compute: shorter than the next all-gather


def prefetch_trace() -> pd.DataFrame:
    """2 nodes x 2 ranks, a forward as `experiments.plan` writes it: unit 0's all-gather waited
    on at once; each next unit's all-gather issued at the instant the one before it is waited
    on (FSDP2's prefetch) and waited on when that unit's compute ends; ops take no time."""
    topo = _topology()
    frames = []
    for rank in range(4):
        now = [0.0]
        rec = TraceRecorder(rank, topo, clock=lambda now=now: now[0])
        node = rank // 2
        shard = [2 * node, 2 * node + 1]

        def issue(nbytes, now=now, rec=rec, shard=shard):
            return rec.record_collective("all_gather", shard, False, "ring", nbytes, 0, 0, now[0])

        for step in range(2):
            rec.begin_step(step)
            first = issue(GATHER[0])
            rec.complete(first, now[0], now[0])
            for unit, seconds in enumerate(C):
                ahead = issue(GATHER[unit + 1]) if unit + 1 < len(GATHER) else None
                now[0] += seconds
                if ahead is not None:
                    rec.complete(ahead, now[0], now[0])
            rec.mark_unit_backward(0)
            rec.mark_backward()
            rec.end_step(step)
        frames.append(rec.frame())
    return pd.concat(frames, ignore_index=True)


def test_fsdp2_all_gathers_run_one_at_a_time():
    # FSDP2's all-gather stream runs them in order: a prefetch issued as the previous one is
    # waited on starts when it ends. Each prefetch outlasts the compute it hides behind, so the
    # forward is the all-gathers end to end, then the last unit's compute.
    intra = _topology().intra
    g = [collective_volume("all_gather", 2, n, "ring").time(intra) for n in GATHER]
    assert all(g[k + 1] > C[k] for k in range(len(C) - 1))
    expected = sum(g) + C[-1]
    replay = simulate(prefetch_trace(), _topology(),
                      ReplayOptions(algorithm="ring", overlap="fsdp2"))
    assert replay.frame["step_time_s"].tolist() == pytest.approx([expected] * 2, rel=1e-9)


def test_marks_change_nothing_when_replayed_as_recorded():
    plain = simulate(scripted_trace(marks=False), _topology(), ReplayOptions(algorithm="ring"))
    marked = simulate(scripted_trace(), _topology(),
                      ReplayOptions(algorithm="ring", overlap="recorded"))
    assert plain.frame.equals(marked.frame) and plain.note == marked.note


def test_fsdp2_overlap_without_marks_or_unknown_mode_is_refused():
    trace = scripted_trace(marks=False)
    assert not has_unit_marks(trace) and has_unit_marks(scripted_trace())
    with pytest.raises(ValueError, match='overlap "fsdp2" needs a trace with FSDP2 backward'):
        simulate(trace, _topology(), ReplayOptions(overlap="fsdp2"))
    with pytest.raises(ValueError, match="overlap 'gpu' is not known"):
        simulate(trace, _topology(), ReplayOptions(overlap="gpu"))


def test_old_traces_without_the_unit_column_still_load():
    trace = scripted_trace(marks=False).drop(columns=["unit"])
    assert simulate(trace, _topology()).frame["step_time_s"].iloc[0] > 0


def test_phase_seconds_scale_each_phase_to_the_given_seconds():
    r, t, g = _times()
    fb, opt = 0.003, 0.0005  # forward+backward and optimizer compute per step, as if profiled
    replay = simulate(scripted_trace(), _topology(),
                      ReplayOptions(algorithm="ring", phase_seconds=(fb, opt)))
    # Recorded: F + B1 + B0 + E before the backward mark, OPT after it; each scaled on its own.
    assert replay.phases.recorded_s == pytest.approx((F + B1 + B0 + E, OPT))
    assert replay.phases.scales() == pytest.approx((fb / (F + B1 + B0 + E), opt / OPT))
    expected = fb + r[1] + t[1] + r[0] + t[0] + opt + g
    assert replay.frame["step_time_s"].tolist() == pytest.approx([expected] * 2, rel=1e-9)


def test_phase_seconds_refused_without_backward_marks_or_beside_a_compute_scale():
    with pytest.raises(ValueError, match='"backward" marks'):
        simulate(scripted_trace(marks=False), _topology(),
                 ReplayOptions(phase_seconds=(0.001, 0.001)))
    with pytest.raises(ValueError, match="compute_scale must be 1"):
        simulate(scripted_trace(), _topology(),
                 ReplayOptions(compute_scale=0.5, phase_seconds=(0.001, 0.001)))
    with pytest.raises(ValueError, match="finite seconds"):
        simulate(scripted_trace(), _topology(), ReplayOptions(phase_seconds=(0.001, -1.0)))


def test_phase_scale_multiplies_each_phase_on_top_of_compute_scale():
    r, t, g = _times()
    replay = simulate(scripted_trace(), _topology(),
                      ReplayOptions(algorithm="ring", compute_scale=0.5,
                      phase_scale=(1.0, 0.25)))
    # The optimizer phase (OPT) is a quarter as long, then every compute gap halved.
    expected = 0.5 * (F + B1 + B0 + E) + 0.5 * 0.25 * OPT + r[1] + t[1] + r[0] + t[0] + g
    assert replay.frame["step_time_s"].tolist() == pytest.approx([expected] * 2, rel=1e-9)
    assert replay.phases.replayed_s == pytest.approx((F + B1 + B0 + E, 0.25 * OPT))
    assert "scaled by phase_scale: forward+backward x1, optimizer x0.25" in replay.note


def test_phase_scale_refused_without_marks_beside_phase_seconds_or_not_positive():
    with pytest.raises(ValueError, match='phase_scale needs the trace\'s "backward" marks'):
        simulate(scripted_trace(marks=False), _topology(), ReplayOptions(phase_scale=(1.0, 0.5)))
    with pytest.raises(ValueError, match="not both"):
        simulate(scripted_trace(), _topology(), ReplayOptions(phase_seconds=(0.001, 0.001),
                 phase_scale=(1.0, 0.5)))
    with pytest.raises(ValueError, match="finite factors > 0"):
        simulate(scripted_trace(), _topology(), ReplayOptions(phase_scale=(1.0, 0.0)))
