"""SparseLoCo: diloco's update at density 1, chunked top-k, 2-bit codes, error feedback, bytes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from flexdemo import FlexDeMo, build_optimizer, method_record
from flexdemo.knobs import SparseLoCoKnobs
from flexdemo.replicators import DiLoCoReplicator, SparseLoCoReplicator
from flexdemo.replicators.sparseloco import SparseLayout, _quantize_2bit, sparse_payload
from tests.dist_utils import run_ranks

LR = 0.01


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # 1200, 40, 150 and 5 elements: several chunks of 64, a padded last one, short tensors.
    return torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.Tanh(), torch.nn.Linear(40, 5))


def _set_grads(params: list[torch.Tensor], step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)  # every replica its own gradients
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _expected_bucket(numels: list[int], topk: int, chunk: int, fmt: str) -> int:
    """One replica's bucket, from the documented closed form (docs/methods.md, sparseloco)."""
    total = 0
    for n in numels:
        c = min(chunk, n)
        chunks = math.ceil(n / c)
        k = min(c, max(1, math.floor(c * topk / chunk + 0.5)))
        kept = chunks * k
        width = max(1, math.ceil(math.log2(c)))
        total += math.ceil(kept / 8) * width  # indices, bit-packed in whole groups of 8
        total += {"fp32": 4 * kept, "bf16": 2 * kept,
                  "2bit": 2 * math.ceil(kept / 8) + 4 * 5}[fmt]  # codes, mean + 4 bin means
    return math.ceil(total / 4) * 4


def test_layout_cuts_chunks_and_keeps_a_share_of_short_ones():
    assert SparseLayout.of(1200, 64, 4) == SparseLayout(1200, 64, 19, 4)
    assert SparseLayout.of(40, 64, 4) == SparseLayout(40, 40, 1, 3)  # 40 * 4 / 64 = 2.5 -> 3
    assert SparseLayout.of(5, 4096, 128) == SparseLayout(5, 5, 1, 1)  # at least one
    assert SparseLayout.of(4096 * 3, 4096, 128).kept == 3 * 128  # the paper's 3.1%
    assert SparseLayout.of(100, 64, 64).kept == 2 * 64  # density 1: the padding is sent too
    shapes = [1200, 40, 150, 5]
    for fmt in ("2bit", "bf16", "fp32"):
        knobs = SparseLoCoKnobs(topk=4, chunk=64, value_format=fmt)
        assert sparse_payload(shapes, knobs) == ("all_gather",
                                                 _expected_bucket(shapes, 4, 64, fmt)), fmt


def test_two_bit_codes_read_as_their_bins_means():
    vals = torch.tensor([-3.0, -1.0, -0.9, 0.1, 0.2, 0.3, 2.0, 5.0])
    (packed, stats), read = _quantize_2bit(vals)
    assert packed.dtype == torch.uint8 and packed.numel() == 2  # 8 codes of 2 bits
    assert stats.shape == (5,) and stats[0] == vals.mean()
    # Each value reads back as the mean of the values in its bin, so the bins' means add up.
    assert torch.allclose(read.sum(), vals.sum(), atol=1e-5)
    assert len(set(read.tolist())) <= 4
    same = torch.full((6,), 0.25)
    assert torch.equal(_quantize_2bit(same)[1], same)  # no spread: every value exact


def test_one_replica_applies_its_chunks_top_k_and_keeps_the_rest():
    model = _model()
    params = list(model.parameters())
    start = [p.detach().clone() for p in params]
    opt = FlexDeMo(params, lr=LR, replicator=SparseLoCoReplicator(
        diloco_h=2, topk=4, chunk=64, value_format="fp32", error_decay=0.5))
    rep = opt.replicator
    for s in (1, 2):
        _set_grads(params, s, 0)
        opt.step()
    assert opt.last_step_comm["calls"] == 0  # one replica: nothing crosses a network
    for p, a, e, lay, p0 in zip(params, rep.anchors, rep.errors, rep.layouts, start,
                                strict=True):
        assert torch.equal(p, a)
        sent = rep._chunks(p0 - p.detach(), lay)  # outer lr 1: the step is what was sent
        kept = sent != 0
        left = rep._chunks(e, lay)
        # Per chunk, exactly its top-k moved; they left the buffer, which keeps the rest.
        assert (kept.sum(1) == lay.keep).all()
        assert not left[kept].any() and left[~kept].any()
        smallest_sent = torch.where(kept, sent.abs(), torch.inf).amin(1)
        assert (smallest_sent >= left.abs().amax(1)).all()


@pytest.mark.parametrize(("knobs", "words"), [
    ({"topk": 0}, "topk=0 must be a positive integer."),
    ({"topk": 5000}, "topk=5000 is more than chunk=4096: sparseloco keeps topk of every chunk, "
                     "a density topk/chunk in (0, 1]; use topk <= 4096."),
    ({"chunk": 0}, "chunk=0 must be a positive integer."),
    ({"diloco_h": -3}, "diloco_h=-3 must be a positive integer."),
    ({"error_decay": 1.5}, "error_decay=1.5 must lie in [0, 1]."),
    ({"value_format": "int3"}, "value_format='int3' is unknown for sparseloco; use one of 2bit, "
                               "bf16, fp32."),
    ({"outer_lr": 0}, "outer_lr=0 must be a number > 0."),
])
def test_bad_knobs_are_one_sentence(knobs, words):
    with pytest.raises(ValueError) as err:
        method_record("sparseloco").settings(knobs)
    assert str(err.value) == words


def test_record_reads_diloco_h_and_steps_with_adamw():
    record = method_record("sparseloco")
    assert record.takes == ("diloco_h", "outer_lr", "topk", "chunk", "error_decay",
                            "value_format", "base", "beta1")
    opt = build_optimizer("sparseloco", _model(), None)
    assert (opt.base.name, opt.sign) == ("adamw", False)
    assert [opt.replicator.replicates_on(s) for s in (14, 15, 30)] == [False, True, True]
    assert record.knobs.topk / record.knobs.chunk == 128 / 4096


# -- two gloo ranks ----------------------------------------------------------------------------
def _trajectory(opt: FlexDeMo, params: list[torch.Tensor], rank: int, steps: int) -> list:
    history = []
    for s in range(1, steps + 1):
        _set_grads(params, s, rank)
        opt.step()
        history.append([p.detach().clone() for p in params])
    return history


def _check_density_one_is_diloco(rank: int) -> None:
    runs = {}
    for name in ("diloco", "sparseloco", "sparse"):
        model = _model()
        params = list(model.parameters())
        if name == "diloco":
            rep = DiLoCoReplicator(diloco_h=3, outer_lr=0.7, outer_momentum=0.0)
        else:  # everything sent in fp32, or the top 4 of every 64 in 2 bits
            full = name == "sparseloco"
            rep = SparseLoCoReplicator(diloco_h=3, outer_lr=0.7, chunk=64,
                                       topk=64 if full else 4,
                                       value_format="fp32" if full else "2bit")
        runs[name] = _trajectory(FlexDeMo(params, lr=LR, replicator=rep), params, rank, 9)
    for s, (a, b, c) in enumerate(zip(runs["diloco"], runs["sparseloco"], runs["sparse"],
                                      strict=True), start=1):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y), (rank, s)  # bit for bit
        if s % 3 == 0:
            assert any(not torch.equal(x, z) for x, z in zip(a, c, strict=True)), s


def _check_bytes_and_replicas(rank: int, world: int) -> None:
    for fmt in ("2bit", "bf16", "fp32"):
        model = _model()
        params = list(model.parameters())
        opt = FlexDeMo(params, lr=LR, replicator=SparseLoCoReplicator(
            diloco_h=2, topk=4, chunk=64, value_format=fmt))
        for s in range(1, 5):
            _set_grads(params, s, rank)
            opt.step()
            sync = s % 2 == 0
            want = (world - 1) * _expected_bucket([p.numel() for p in params], 4, 64, fmt) \
                if sync else 0
            assert opt.last_step_comm == {"bytes_sent": want, "bytes_received": want,
                                          "calls": int(sync)}, (fmt, s)
            if sync:  # every replica moved to the same parameters
                for p in params:
                    both = [torch.empty_like(p) for _ in range(world)]
                    dist.all_gather(both, p.detach())
                    assert torch.equal(both[0], both[1]), (fmt, s)


def _two_ranks(rank: int, world: int) -> None:
    _check_density_one_is_diloco(rank)
    _check_bytes_and_replicas(rank, world)


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_density_one_is_diloco_bit_for_bit_and_bytes_are_the_closed_form():
    run_ranks(_two_ranks, 2)
