"""The plan against closed forms: ring all-reduces, DiLoCo's period, what overlap leaves exposed."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from experiments.errors import ConfigError
from experiments.plan.hardware import given_compute
from experiments.plan.models import declare_model
from experiments.plan.plan import bandwidth_needed, plan_method
from experiments.plan.synth import Precision
from flexdemo.methods import method_record
from netsim import Link, Topology
from netsim.costs import ring_all_reduce_time

MODEL = "gpt:dim=256,layers=4,heads=4,vocab=1000,ffn=1024,tied=false"
NODES = 4
GBIT = 1e9 / 8


def _plan(method: str, step_s: float, bandwidth: float, precision: Precision | None = None,
          **knobs):
    return _plan_record(method_record(method), step_s, bandwidth, precision, **knobs)


def _plan_record(record, step_s: float, bandwidth: float, precision: Precision | None = None,
                 **knobs):
    precision = precision or Precision()
    model = declare_model(MODEL)
    settings, _ = record.settings(knobs)
    compute = given_compute([model.unit_params(u) for u in range(len(model.units))], step_s)
    topology = Topology(NODES, 1, Link(100e9, 0.0), Link(bandwidth, 0.0))
    plan = plan_method(record, settings, model, [topology], ["x"], compute, precision,
                       algorithm="ring")
    return model, plan


@pytest.mark.parametrize(("reduce_dtype", "itemsize"), [("fp32", 4), ("bf16", 2)])
def test_network_bound_data_parallel_step_is_the_ring_all_reduce(reduce_dtype, itemsize):
    model, plan = _plan("hsdp-adamw", 1e-6, GBIT, Precision("bf16", reduce_dtype))
    link = Link(GBIT, 0.0)
    expected = ring_all_reduce_time(NODES, model.params * itemsize, link)
    assert plan.points[0].step_time_s == pytest.approx(expected, rel=1e-3)
    assert plan.points[0].bytes_per_node_step == pytest.approx(
        2 * (NODES - 1) / NODES * model.params * itemsize, rel=1e-6)


def test_diloco_exposes_one_outer_all_reduce_every_h_steps():
    h, step_s = 10, 0.5
    model, plan = _plan("diloco", step_s, GBIT, diloco_h=h)
    outer = ring_all_reduce_time(NODES, model.params * 4, Link(GBIT, 0.0))
    assert (plan.period, plan.exchanges_per_period) == (h, 1)
    assert plan.points[0].step_time_s == pytest.approx(step_s + outer / h, rel=1e-3)
    row = plan.frame().iloc[0]
    assert row["bytes_per_node_round"] == pytest.approx(
        2 * (NODES - 1) / NODES * model.params * 4, rel=1e-6)
    assert row["bytes_per_node_step"] == pytest.approx(row["bytes_per_node_round"] / h)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "4bit"])
def test_diloco_plans_its_outer_format(fmt):
    model, plan = _plan("diloco", 0.5, GBIT, diloco_h=10, outer_format=fmt)
    row = plan.frame().iloc[0]
    n = model.params  # one rank a node: its shard is the whole model
    if fmt == "bf16":  # a ring all-reduce of 2-byte values
        expected = 2 * (NODES - 1) / NODES * n * 2
    else:  # an all-gather of the codes (1 byte, or 4 bits in whole groups of 8) and a scale
        codes = n if fmt == "int8" else -(-n // 8) * 4
        expected = (NODES - 1) * -(-(codes + 4) // 4) * 4
    assert row["bytes_per_node_round"] == pytest.approx(expected, rel=1e-9)


def _shapes(model) -> list[tuple[int, ...]]:
    """Every parameter's shape: at one GPU a node a rank's shards are the whole tensors."""
    return [tuple(s) or (1,) for s in model.shapes]


def _ring(payload: int) -> float:
    """Bytes a node sends in a ring all-reduce of `payload` bytes over NODES nodes."""
    return 2 * (NODES - 1) / NODES * payload


@pytest.mark.parametrize("start", [0, 10])
def test_powersgd_exposes_three_all_reduces_of_its_factors_after_the_backward(start):
    step_s, link = 0.5, Link(GBIT, 0.0)
    model, plan = _plan("powersgd", step_s, GBIT, powersgd_start=start)
    whole = p = q = 0  # docs/methods.md: rank r = min(n, m, 4) where (n + m) r 2 < n m
    for shape in _shapes(model):
        n, m = shape[0], math.prod(shape[1:])
        r = min(n, m, 4)
        if len(shape) > 1 and (n + m) * r * 2 < n * m:
            p, q = p + n * r, q + m * r
        else:
            whole += n * m
    assert 0 < whole and 0 < p and 0 < q and (whole + p + q) * 4 < model.params
    payloads = [4 * whole, 4 * p, 4 * q]
    assert plan.points[0].bytes_per_node_step == pytest.approx(_ring(sum(payloads)), rel=1e-9)
    # The three run one after another after the backward (FSDP2's inter-node reduction off).
    exposed = sum(ring_all_reduce_time(NODES, b, link) for b in payloads)
    assert plan.points[0].step_time_s == pytest.approx(step_s + exposed, rel=1e-3)
    said = [n for n in plan.notes if n.startswith("powersgd: its first")]
    assert len(said) == (1 if start else 0)
    assert not start or f"from step {start + 1}" in said[0]


def test_topk_ef_all_gathers_its_bucket_every_step():
    model, plan = _plan("topk-ef", 0.5, GBIT)
    bucket = 0  # docs/methods.md: fp32-packed values and ceil(log2 numel)-bit indices
    for shape in _shapes(model):
        numel = math.prod(shape)
        k = math.ceil(0.01 * numel)
        bucket += 4 * k + math.ceil(k / 8) * math.ceil(math.log2(numel))
    bucket = -(-bucket // 4) * 4
    assert (plan.period, plan.exchanges_per_period) == (1, 1)
    assert plan.points[0].bytes_per_node_step == pytest.approx((NODES - 1) * bucket, rel=1e-9)


def test_sparseloco_all_gathers_its_sparse_bucket_every_h_steps():
    h = 15
    model, plan = _plan("sparseloco", 0.5, GBIT, diloco_h=h)
    total = 0  # docs/methods.md's S, at topk 128 of chunk 4096 in 2bit
    for shape in _shapes(model):
        n = math.prod(shape)
        c = min(4096, n)
        chunks = math.ceil(n / c)
        k = min(c, max(1, math.floor(c * 128 / 4096 + 0.5)))
        width = max(1, math.ceil(math.log2(c)))
        total += math.ceil(chunks * k * width / 8) + 2 * math.ceil(chunks * k / 8) + 20
    bucket = 4 * math.ceil(total / 4)
    assert (plan.period, plan.exchanges_per_period) == (h, 1)
    row = plan.frame().iloc[0]
    assert row["bytes_per_node_round"] == pytest.approx((NODES - 1) * bucket, rel=1e-9)


def test_local_sgd_is_diloco_s_all_reduce_and_holds_only_its_anchor():
    model, plan = _plan("local-sgd", 0.5, GBIT, diloco_h=10)
    _, diloco = _plan("diloco", 0.5, GBIT, diloco_h=10)
    assert (plan.period, plan.exchanges_per_period) == (10, 1)
    row = plan.frame().iloc[0]
    assert row["bytes_per_node_round"] == pytest.approx(_ring(4 * model.params), rel=1e-9)
    assert plan.points[0].step_time_s == diloco.points[0].step_time_s
    # diloco keeps an outer momentum beside its anchor; SGD at momentum 0 keeps none.
    assert (plan.memory.replicator, diloco.memory.replicator) == (4 * model.params,
                                                                   8 * model.params)


def test_hsdp_adamw_in_bf16_all_reduces_half_the_bytes_after_the_backward():
    step_s = 0.5
    model, plan = _plan("hsdp-adamw", step_s, GBIT, reduce_format="bf16")
    assert plan.points[0].bytes_per_node_step == pytest.approx(_ring(2 * model.params),
                                                               rel=1e-9)
    # One bucket in the optimizer step: nothing of it hides behind the backward.
    exposed = ring_all_reduce_time(NODES, 2 * model.params, Link(GBIT, 0.0))
    assert plan.points[0].step_time_s == pytest.approx(step_s + exposed, rel=1e-3)
    assert plan.memory.optimizer == 8 * model.params  # still AdamW


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_hsdp_adamw_in_scaled_rows_sends_an_all_to_all_and_an_all_gather(fmt):
    model, plan = _plan("hsdp-adamw", 0.5, GBIT, reduce_format=fmt)
    rows = 0  # docs/methods.md's B: r_t rows of c_t one-byte codes and a 4-byte scale each
    for shape in _shapes(model):
        if len(shape) > 1:
            r, c = math.ceil(shape[0] / NODES), math.prod(shape[1:])
        else:
            r, c = 1, math.ceil(shape[0] / NODES)
        rows += r * (c + 4)
    block = 4 * math.ceil(rows / 4)
    assert plan.points[0].bytes_per_node_step == pytest.approx(2 * (NODES - 1) * block,
                                                               rel=1e-9)


def test_a_method_whose_replicator_writes_no_program_is_refused_in_one_sentence():
    from flexdemo.methods import Method

    with pytest.raises(ConfigError) as err:
        _plan_record(Method("full-sync", "full"), 0.5, GBIT)
    said = str(err.value)
    assert "has no program for the planner" in said and "FullReplicator" in said
    assert said.count(". ") == 0 and said.endswith(".")


def test_full_overlap_leaves_the_last_units_reduction_exposed():
    # Every block's all-reduce hides behind the next block's backward, but block 0's and the
    # root's come after the last backward compute: the optimizer waits for both.
    step_s = 2.0
    model, plan = _plan("hsdp-adamw", step_s, 100 * GBIT)
    link = Link(100 * GBIT, 0.0)
    blocks, root = model.unit_params(0), model.unit_params(len(model.units) - 1)
    backward_per_block = step_s * 2 / 3 * blocks / model.params
    assert ring_all_reduce_time(NODES, blocks * 4, link) < backward_per_block
    exposed = (ring_all_reduce_time(NODES, blocks * 4, link)
               + ring_all_reduce_time(NODES, root * 4, link))
    cu = plan.compute_s / plan.points[0].step_time_s
    assert cu == pytest.approx(step_s / (step_s + exposed), rel=1e-3)


def test_bandwidth_needed_says_how_it_was_found():
    frame = pd.DataFrame({"inter_bw_bps": [1.0, 10.0, 100.0],
                          "compute_utilization": [0.2, 0.6, 0.9]})
    bps, how = bandwidth_needed(frame, 0.8)
    assert how == "interpolated" and 10 < bps < 100
    assert bandwidth_needed(frame, 0.6) == (10.0, "grid point")
    assert bandwidth_needed(frame, 0.1)[1] == "at or below the grid's lowest bandwidth"
    assert bandwidth_needed(frame, 0.95) == (None, "not reached (at most 90.0% on this grid)")


def test_streaming_diloco_without_delay_exposes_its_fragments_all_reduces():
    step_s, every = 0.5, 12
    model, plan = _plan("streaming-diloco", step_s, GBIT, sync_every=every, num_fragments=4,
                        fragment_sync_delay=0, fragment_cut="elements")
    outer = ring_all_reduce_time(NODES, model.params * 4, Link(GBIT, 0.0))
    assert (plan.period, plan.exchanges_per_period) == (every, 4)
    assert plan.points[0].step_time_s == pytest.approx(step_s + outer / every, rel=1e-3)


def test_streaming_diloco_peak_bytes_are_a_fragment_of_diloco_s():
    _, diloco = _plan("diloco", 0.5, GBIT)
    _, streaming = _plan("streaming-diloco", 0.5, GBIT, num_fragments=5, sync_every=50,
                         fragment_cut="elements")
    assert diloco.peak_exchange_bytes // 5 - 4 <= streaming.peak_exchange_bytes
    assert streaming.peak_exchange_bytes <= diloco.peak_exchange_bytes // 5 + 4


def test_streaming_diloco_hides_a_sync_that_fits_its_delay():
    # Each fragment's all-reduce takes less than the tau = 2 steps of compute it overlaps.
    model, plan = _plan("streaming-diloco", 0.5, 100 * GBIT, sync_every=12, num_fragments=4,
                        fragment_sync_delay=2)
    _, quiet = _plan("diloco", 0.5, 100 * GBIT, diloco_h=10**6)  # never syncs in a window
    one = ring_all_reduce_time(NODES, model.params * 4 // 4, Link(100 * GBIT, 0.0))
    assert one < 2 * 0.5
    assert plan.points[0].step_time_s == pytest.approx(quiet.points[0].step_time_s, rel=1e-3)


def test_memory_parts_by_hand():
    from experiments.plan.models import padded_shard_elements
    from experiments.plan.plan import memory

    model = declare_model(MODEL)
    shard = sum(padded_shard_elements(s, 8) for unit in model.units for s in unit)
    precision = Precision()
    hsdp = memory(method_record("hsdp-adamw"), None, model, 8, NODES, precision)
    assert (hsdp.params, hsdp.grads, hsdp.optimizer, hsdp.replicator) == (
        4 * shard, 4 * shard, 8 * shard, 0)
    block, root = model.unit_params(0), model.unit_params(len(model.units) - 1)
    assert hsdp.working == (root + 2 * block) * 2 + block * 4  # bf16 gathered, fp32 gradient
    record = method_record("diloco")
    diloco = memory(record, record.settings({})[0], model, 8, NODES, precision)
    assert diloco.replicator == 8 * shard and diloco.optimizer == 8 * shard
    record = method_record("flexdemo")
    flex = memory(record, record.settings({})[0], model, 8, NODES, precision)
    assert flex.optimizer == 0  # the sign step keeps no moments
    assert flex.replicator > 4 * shard  # the momentum, plus every replica's bucket
    for name in ("random", "striding"):  # delta and the update it returns (flexdemo/partial.py)
        record = method_record(name)
        assert memory(record, record.settings({})[0], model, 8, NODES,
                      precision).replicator == 2 * 4 * shard, name
    record = method_record("gossip")
    for graph, degree in (("ring", 2), ("complete", 0)):
        # The flat copy it sends and one inbox per neighbour (flexdemo/replicators/gossip.py);
        # the complete graph all-reduces the flat copy and holds no inbox.
        gossip = memory(record, record.settings({"graph": graph})[0], model, 8, NODES, precision)
        assert gossip.replicator == (1 + degree) * 4 * shard, graph
    wide = memory(record, record.settings({"graph": "complete"})[0], model, 8, 256, precision)
    assert wide.replicator == 4 * shard
    wide = memory(record, record.settings({"graph": "exponential"})[0], model, 8, 256, precision)
    assert wide.replicator == (1 + 15) * 4 * shard  # 2^k hops both ways, 128 once


def test_streaming_diloco_one_step_delay_hides_a_sync_shorter_than_a_step():
    # At 1 Gbit/s each fragment's all-reduce (about 10 ms here) is exposed without a delay and
    # hidden behind the next step's 0.5 s of compute with fragment_sync_delay=1.
    knobs = {"sync_every": 12, "num_fragments": 4, "fragment_cut": "elements"}
    model, exposed = _plan("streaming-diloco", 0.5, GBIT, fragment_sync_delay=0, **knobs)
    _, hidden = _plan("streaming-diloco", 0.5, GBIT, fragment_sync_delay=1, **knobs)
    _, quiet = _plan("diloco", 0.5, GBIT, diloco_h=10**6)
    one = ring_all_reduce_time(NODES, model.params * 4 // 4, Link(GBIT, 0.0))
    assert 0.005 < one < 0.5
    assert exposed.points[0].step_time_s == pytest.approx(
        quiet.points[0].step_time_s + 4 * one / 12, rel=1e-3)
    assert hidden.points[0].step_time_s == pytest.approx(quiet.points[0].step_time_s, rel=1e-4)
