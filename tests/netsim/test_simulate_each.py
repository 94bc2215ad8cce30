"""simulate_each: one trace on several networks is simulate on each, its programs built once."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from netsim import Topology
from netsim.model import ReplayOptions, simulate, simulate_each

TRACE = Path(__file__).resolve().parents[2] / "results/quick/units/hsdp-adamw-s0/trace.parquet"


def test_each_network_replays_as_simulate_does():
    trace = pd.read_parquet(TRACE)
    trace = trace[trace["step"] <= 4]
    networks = [Topology.from_strings(4, 2, bw, "1ms") for bw in ("10Mbit", "1Gbit")]
    each = simulate_each(trace, networks, ReplayOptions(overlap="fsdp2"))
    for replay, topology in zip(each, networks, strict=True):
        alone = simulate(trace, topology, ReplayOptions(overlap="fsdp2"))
        pd.testing.assert_frame_equal(replay.frame, alone.frame)
        assert replay.node_egress_bytes == alone.node_egress_bytes
        assert replay.note == alone.note and replay.topology is topology
    assert each[0].frame["step_time_s"].sum() > each[1].frame["step_time_s"].sum()


def test_no_network_is_refused():
    with pytest.raises(ValueError, match="topologies is empty"):
        simulate_each(pd.read_parquet(TRACE), [])
