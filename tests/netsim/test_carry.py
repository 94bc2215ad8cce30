"""Ops carried into a later step (flexdemo-async's exchange): scripted traces, closed forms."""

import pandas as pd
import pytest

from netsim import ReplayOptions, Topology, TraceRecorder, collective_volume, simulate
from netsim.model import CARRY_NOTE
from netsim.model.programs import build_programs, carried_id

C, D = 0.020, 0.004  # recorded seconds: forward+backward before the exchange, decode after it
SLOWER = 0.001  # one node computes this much longer, a different node every other step
STEPS = 5


def _topology(bw: str) -> Topology:
    # 1 rank per node and no latency: an all-gather is its bytes over the link, one flow.
    return Topology.from_strings(2, 1, bw, "0ms")


def _transfer(nbytes: int, bw: str) -> float:
    link = _topology(bw).inter
    return collective_volume("all_gather", 2, nbytes, "ring").paced_bytes / link.effective_bandwidth


def delayed_trace(nbytes: int, delay: int = 1) -> pd.DataFrame:
    """2 nodes x 1: each step computes, posts an all-gather, waits for the one posted `delay`
    steps before (on loopback it is long done), then decodes; the last ones are drained
    after the last step."""
    topo = _topology("1Gbit")
    frames = []
    for rank in range(2):
        now = [0.0]
        rec = TraceRecorder(rank, topo, clock=lambda now=now: now[0])
        posted = []
        for step in range(STEPS):
            rec.begin_step(step)
            rec.mark_backward()
            now[0] += C + (SLOWER if (step + rank) % 2 else 0.0)
            posted.append(rec.record_collective("all_gather", [0, 1], True, "ring", nbytes, 0, 0,
                                                now[0]))
            if step >= delay:
                rec.complete(posted[step - delay], now[0], now[0])
            now[0] += D
            rec.end_step(step)
        for row in posted[-delay:]:
            now[0] += 0.001
            rec.complete(row, now[0], now[0])
        frames.append(rec.frame())
    return pd.concat(frames, ignore_index=True)


def test_carried_ops_are_issued_in_their_step_and_waited_in_the_next():
    trace = delayed_trace(10_000)
    topo = _topology("1Gbit")
    programs = build_programs(trace, Topology(2, 1, topo.intra, topo.inter))
    assert programs.carried == {carried_id(s, 0): 1 for s in range(STEPS)}
    for s in range(STEPS):
        ops = [(type(item).__name__, item.op) for item in programs.by_slot[(0, s)]
               if type(item).__name__ in ("Issue", "Wait")]
        waits = [("Wait", carried_id(s - 1, 0))] if s else []
        assert ops == [("Issue", carried_id(s, 0))] + waits


def test_a_slow_link_sets_the_step_to_its_transfer_and_a_fast_one_is_hidden():
    slow = 50_000
    t = _transfer(slow, "10Mbit")
    assert t > C + SLOWER + D  # the link is the bottleneck
    replay = simulate(delayed_trace(slow), _topology("10Mbit"))
    # Step 0 waits for nothing; after it the one communicator sends back to back, and each
    # step ends D after the previous step's exchange arrives: one transfer per step. The last
    # step's exchange is drained off the clock.
    expected = [C + SLOWER + D] + [t] * (STEPS - 1)
    assert replay.frame["step_time_s"].tolist() == pytest.approx(expected, rel=1e-9)
    assert CARRY_NOTE in replay.note
    # A link fast enough for the exchange to finish within the next step's compute: hidden.
    fast = simulate(delayed_trace(slow), _topology("10Gbit"))
    assert fast.frame["step_time_s"].tolist() == pytest.approx([C + SLOWER + D] * STEPS,
                                                               rel=1e-9)


def test_an_exchange_waited_two_steps_later_overlaps_two_steps():
    nbytes = 50_000
    t = _transfer(nbytes, "10Mbit")
    replay = simulate(delayed_trace(nbytes, delay=2), _topology("10Mbit"))
    # Steps 0 and 1 wait for nothing; step s >= 2 waits, once its compute is done, for the
    # exchange of step s - 2, which (back to back from the first issue at C + SLOWER) arrives
    # at C + SLOWER + (s - 1) t; the two exchanges posted last are drained off the clock.
    ends = [C + SLOWER + D]
    for s in range(1, STEPS):
        arrived = C + SLOWER + (s - 1) * t if s >= 2 else 0.0
        ends.append(max(ends[-1] + C + SLOWER, arrived) + D)
    assert replay.frame["time_s"].tolist() == pytest.approx(ends, rel=1e-9)
    assert ends[3] - ends[2] > C + SLOWER + D  # some waits blocked: the closed form is tested


def test_a_cycled_replay_ends_the_step_after_the_drained_exchange_with_it():
    nbytes = 50_000
    # Cycling into recorded step 0 (which waits for nothing): the exchange posted by the last
    # recorded step ends the next step instead; every step is still at least its compute.
    cycled = simulate(delayed_trace(nbytes), _topology("10Mbit"), ReplayOptions(steps=3 * STEPS))
    t = _transfer(nbytes, "10Mbit")
    assert cycled.frame["time_s"].iloc[-1] == pytest.approx(C + SLOWER + (3 * STEPS - 1) * t + D,
                                                            rel=1e-9)


def test_sync_replay_of_the_same_exchange_pays_it_every_step():
    # The same trace waited at once (the synchronous method): each step adds the transfer.
    trace = delayed_trace(50_000)
    coll = trace["kind"] == "collective"
    trace.loc[coll, "wait_s"] = trace.loc[coll, "start_s"]
    trace.loc[coll, "end_s"] = trace.loc[coll, "start_s"]
    replay = simulate(trace, _topology("10Mbit"))
    t = _transfer(50_000, "10Mbit")
    assert CARRY_NOTE not in replay.note
    assert replay.frame["step_time_s"].tolist() == pytest.approx([C + SLOWER + t + D] * STEPS,
                                                                 rel=1e-9)
