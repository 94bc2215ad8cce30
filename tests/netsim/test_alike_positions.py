"""A node's alike positions replayed as one weighted process predict what one each does."""

from __future__ import annotations

import pytest

from experiments.plan.hardware import StepCompute
from experiments.plan.models import declare_model
from experiments.plan.synth import Precision, Shape, synthesize
from flexdemo.methods import method_record
from netsim import Topology
from netsim.model import ReplayOptions, simulate_each
from netsim.model.cluster import Cluster

MODEL = "gpt:dim=64,layers=3,heads=4,vocab=256,ffn=128,tied=false"
RUN = Cluster.run


def _trace(method: str, per_node: int, **knobs: object):
    model = declare_model(MODEL)
    record = method_record(method)
    settings, _ = record.settings(knobs)
    units = len(model.units)
    compute = StepCompute(tuple(0.001 * (u + 1) for u in range(units)),
                          tuple(0.002 * (u + 1) for u in range(units)), 0.0005, "test")
    steps = 3 if method == "streaming-diloco" else 2
    return synthesize(record, settings, model, Shape(2, per_node), compute, Precision(), steps,
                      replicas=4)


def _replays(trace, merge: bool, monkeypatch: pytest.MonkeyPatch, weights: list[int]):
    monkeypatch.setattr(Cluster, "_merge_alike", merge)

    def run(self, *args, **kwargs):
        weights.append(self.weight)
        return RUN(self, *args, **kwargs)

    monkeypatch.setattr(Cluster, "run", run)
    networks = [Topology.from_strings(4, 4, bw, "2ms") for bw in ("50Mbit", "1Gbit", "40Gbit")]
    return simulate_each(trace, networks, ReplayOptions(overlap="fsdp2"))


@pytest.mark.parametrize(("method", "knobs"), [
    ("hsdp-adamw", {}),
    ("flexdemo-async", {}),
    ("diloco", {"diloco_h": 1}),
    ("streaming-diloco", {"num_fragments": 2, "sync_every": 4, "fragment_sync_delay": 1}),
])
def test_one_process_per_node_predicts_what_one_per_position_does(monkeypatch, method, knobs):
    trace = _trace(method, 4, **knobs)
    merged_weights: list[int] = []
    merged = _replays(trace, True, monkeypatch, merged_weights)
    apart_weights: list[int] = []
    apart = _replays(trace, False, monkeypatch, apart_weights)
    assert set(merged_weights) == {4} and set(apart_weights) == {1}
    for one, each in zip(merged, apart, strict=True):
        assert one.frame.equals(each.frame)  # the same floats, bit for bit
        assert one.node_egress_bytes == pytest.approx(each.node_egress_bytes, rel=1e-12)
        assert one.algorithms == each.algorithms


def test_positions_with_other_programs_run_apart(monkeypatch):
    # Three ranks a node cut a 64-row parameter unevenly: the last rank's payloads differ.
    trace = _trace("flexdemo", 3)
    weights: list[int] = []
    _replays(trace, True, monkeypatch, weights)
    assert set(weights) == {1}
