"""`sync_in_backward`: DiLoCo's and Streaming DiLoCo's outer sync started unit by unit in the
backward. The bytes are the same as after the step; only when each piece starts moves."""

from __future__ import annotations

import pandas as pd
import pytest

from experiments.plan.hardware import given_compute
from experiments.plan.models import declare_model
from experiments.plan.plan import plan_method
from experiments.plan.synth import Precision, Shape, synthesize
from flexdemo.methods import method_record
from netsim import Link, Topology
from netsim.costs import ring_all_reduce_time
from netsim.trace import BACKWARD

MODEL = "gpt:dim=256,layers=4,heads=4,vocab=1000,ffn=1024,tied=false"
NODES = 4
GBIT = 1e9 / 8
CASES = [("diloco", {"diloco_h": 4}),
         ("streaming-diloco", {"sync_every": 8, "num_fragments": 2, "fragment_sync_delay": 1,
                               "outer_format": "bf16"}),
         ("streaming-diloco", {"sync_every": 8, "num_fragments": 4, "fragment_sync_delay": 0,
                               "outer_format": "4bit", "fragment_cut": "elements"}),
         ("streaming-diloco", {"sync_every": 8, "num_fragments": 2, "fragment_sync_delay": 0,
                               "fragment_cut": "elements", "fragment_runs": 2})]


def _trace(method: str, knobs: dict, in_backward: bool, steps: int = 8) -> pd.DataFrame:
    model = declare_model(MODEL)
    record = method_record(method)
    settings, _ = record.settings(knobs)
    compute = given_compute([model.unit_params(u) for u in range(len(model.units))], 0.5)
    return synthesize(record, settings, model, Shape(2, 2), compute, Precision(), steps,
                      sync_in_backward=in_backward)


def _inter(trace: pd.DataFrame) -> pd.DataFrame:
    return trace[(trace["kind"] == "collective") & trace["inter"]]


@pytest.mark.parametrize(("method", "knobs"), CASES)
def test_the_sync_sends_the_same_bytes_in_pieces(method, knobs):
    after, early = _trace(method, knobs, False), _trace(method, knobs, True)
    per_step = [_inter(t).groupby(["rank", "step", "op"])[["bytes", "bytes_sent"]].sum()
                for t in (after, early)]
    pd.testing.assert_frame_equal(*per_step)
    # Split: more than one piece a sync, every one of them posted before the backward's end.
    assert len(_inter(early)) > len(_inter(after)) > 0
    for (rank, step), rows in early.groupby(["rank", "step"]):
        mark = rows.index[(rows["kind"] == "mark") & (rows["op"] == BACKWARD)]
        if rows["inter"].any() and len(mark):
            assert (_inter(rows).index < mark[0]).all(), (rank, step)


def _plan(method: str, in_backward: bool, **knobs):
    model = declare_model(MODEL)
    record = method_record(method)
    settings, _ = record.settings(knobs)
    step_s = 0.5
    compute = given_compute([model.unit_params(u) for u in range(len(model.units))], step_s)
    topology = Topology(NODES, 1, Link(100e9, 0.0), Link(GBIT / 10, 0.0))
    plan = plan_method(record, settings, model, [topology], ["x"], compute, Precision(),
                       algorithm="ring", sync_in_backward=in_backward)
    return model, compute, plan


def test_diloco_starts_its_sync_after_the_first_blocks_backward():
    # On a slow link the sync is the step's critical path from its first piece on: it starts
    # after the forward, the root's backward and the last block's (the first reduced), so the
    # backward of blocks 0..2 is hidden behind it.
    h = 10
    model, compute, early = _plan("diloco", True, diloco_h=h)
    _, _, after = _plan("diloco", False, diloco_h=h)
    outer = ring_all_reduce_time(NODES, model.params * 4, Link(GBIT / 10, 0.0))
    step_s = compute.total_s
    root = len(model.units) - 1
    first = sum(compute.forward_s) + compute.backward_s[root] + compute.backward_s[root - 1]
    assert outer > step_s
    assert after.points[0].step_time_s == pytest.approx(step_s + outer / h, rel=1e-3)
    assert early.points[0].step_time_s == pytest.approx(
        ((h - 1) * step_s + first + outer) / h, rel=1e-3)
    assert early.peak_exchange_bytes == after.peak_exchange_bytes > 0
    assert early.frame().iloc[0]["bytes_per_node_step"] == pytest.approx(
        after.frame().iloc[0]["bytes_per_node_step"])


def test_streaming_peak_bytes_are_a_whole_fragment_either_way():
    knobs = {"sync_every": 8, "num_fragments": 4, "fragment_sync_delay": 1,
             "fragment_cut": "elements"}
    _, _, early = _plan("streaming-diloco", True, **knobs)
    _, _, after = _plan("streaming-diloco", False, **knobs)
    assert early.peak_exchange_bytes == after.peak_exchange_bytes > 0
