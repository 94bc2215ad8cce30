"""DeMo's exchange sizing: the pure plan and the replicator's own layout are one computation."""

from __future__ import annotations

import pytest
import torch

from flexdemo.knobs import DeMoKnobs
from flexdemo.methods import FLEXDEMO_KNOBS
from flexdemo.replicators.demo import DeMoReplicator, plan_exchange

SHAPES = [(64,), (192, 128), (192,), (100, 7), (0,)]


@pytest.mark.parametrize("knobs", [DeMoKnobs(), FLEXDEMO_KNOBS,
                                   DeMoKnobs(value_format="int8", chunk=16, topk=3),
                                   DeMoKnobs(exchange="dense-mean")])
def test_plan_matches_the_replicator_setup(knobs):
    params = [torch.zeros(s) for s in SHAPES]
    rep = DeMoReplicator(knobs)
    rep.setup(params, None, 4)
    plan = plan_exchange(SHAPES, [torch.float32] * len(SHAPES), knobs, 4)
    assert plan.bucket_bytes == rep.bucket_bytes
    assert plan.dense_bytes == rep.dense_bytes
    assert plan.dense == rep.dense
    assert [g.num_blocks for g in rep.groups] == [
        sum(layout.num_blocks for _, layout in members) for _, members in plan.groups]
    assert plan.op == ("all_reduce" if rep.dense else "all_gather")


def test_auto_picks_dense_where_it_moves_fewer_bytes():
    shapes, dtypes = [(4096, 4096)], [torch.float32]
    few = plan_exchange(shapes, dtypes, DeMoKnobs(exchange="auto", topk=2048), 2)
    many = plan_exchange(shapes, dtypes, DeMoKnobs(exchange="auto", topk=2048), 64)
    assert (few.op, many.op) == ("all_gather", "all_reduce")
    assert many.payload_bytes == 4096 * 4096 * 2 * 2  # bf16 sums and counts


@pytest.mark.parametrize(("cut", "runs"), [("parameters", 1), ("elements", 1), ("elements", 3)])
def test_fragment_sizes_are_the_replicator_s(cut, runs):
    from flexdemo.knobs import StreamingDiLoCoKnobs
    from flexdemo.replicators.streaming_diloco import (
        StreamingDiLoCoReplicator,
        fragment_numels,
        fragment_pieces,
    )

    knobs = StreamingDiLoCoKnobs(num_fragments=3, sync_every=6, fragment_cut=cut,
                                 fragment_runs=runs)
    params = [torch.zeros(s) for s in SHAPES]
    rep = StreamingDiLoCoReplicator(knobs)
    rep.setup(params, None, 2)
    sizes = [p.numel() for p in params]
    assert fragment_numels(sizes, 3, cut, runs) == [sum(n) for n in rep.numels]
    assert fragment_pieces(sizes, 3, cut, runs) == rep.pieces


@pytest.mark.parametrize(("outer_format", "op", "nbytes"), [
    ("fp32", "all_reduce", 4000), ("bf16", "all_reduce", 2000),
    ("int8", "all_gather", 1004), ("4bit", "all_gather", 504)])
def test_outer_wire_payload_is_what_encode_packs(outer_format, op, nbytes):
    from flexdemo.replicators.outer_wire import make_outer_wire

    wire = make_outer_wire(outer_format)
    payload, _ = wire.encode(torch.randn(1000))
    assert wire.payload(1000) == (op, nbytes)
    assert payload.numel() * payload.element_size() == nbytes
