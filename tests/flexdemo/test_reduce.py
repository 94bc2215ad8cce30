"""hsdp-adamw's reduce_format: the low-precision gradient mean against FSDP2's, rows, bytes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import flexdemo
from flexdemo import FlexDeMo, build_optimizer, method_record
from flexdemo.replicators import ReduceReplicator
from flexdemo.replicators.reduce import RowLayout, reduce_payloads
from flexdemo.wire import CommStats
from netsim import shaping
from tests.dist_utils import TinyBlocks, inter_rows, run_ranks, shaped_world, train_step

STEPS = 4


def _expected_block(shapes: list[tuple[int, ...]], ranks: int) -> int:
    """One replica's share of every shard's rows, from the documented closed form: a matrix's
    ceil(rows / N) rows, a vector's one row of ceil(n / N), each row 1 byte an element plus a
    4-byte scale, the block rounded up to 4 bytes."""
    total = 0
    for shape in shapes:
        if math.prod(shape) == 0:
            continue
        if len(shape) >= 2:
            rows, cols = math.ceil(shape[0] / ranks), math.prod(shape[1:])
        else:
            rows, cols = 1, math.ceil(math.prod(shape) / ranks)
        total += rows * (cols + 4)
    return math.ceil(total / 4) * 4


def test_rows_of_a_matrix_stay_rows_and_a_vector_is_cut_into_one_row_a_replica():
    assert RowLayout.of((5, 3, 2), 2) == RowLayout((5, 3, 2), 3, 6)
    assert RowLayout.of((7,), 2) == RowLayout((7,), 1, 4)
    for shape in ((5, 3, 2), (7,), (1, 9)):
        lay = RowLayout.of(shape, 3)
        t = torch.randn(shape)
        rows = lay.to_rows(t, 3)
        assert rows.shape == (3 * lay.rows, lay.cols) and torch.equal(lay.from_rows(rows), t)


def test_payloads_are_the_closed_form():
    shapes = [(9, 9), (9,), (3, 9), (3,), (0,)]
    numel = sum(math.prod(s) for s in shapes)
    assert reduce_payloads(shapes, "fp32", 2) == [("all_reduce", 4 * numel)]
    assert reduce_payloads(shapes, "bf16", 2) == [("all_reduce", 2 * numel)]
    for fmt in ("fp8", "int8"):
        for ranks in (2, 3, 8):
            block = _expected_block(shapes, ranks)
            assert reduce_payloads(shapes, fmt, ranks) == [("all_to_all", ranks * block),
                                                           ("all_gather", block)]


@pytest.mark.parametrize(("fmt", "bound"), [("int8", 0.5 / 127), ("fp8", 1 / 16)])
def test_a_row_is_scaled_to_its_largest_magnitude(fmt, bound):
    rep = ReduceReplicator(reduce_format=fmt)
    rows = torch.randn(4, 50) * torch.tensor([[1e-3], [1.0], [1e3], [0.0]])
    codes, scales = rep._quantize(rows)
    assert codes.dtype == (torch.int8 if fmt == "int8" else torch.float8_e4m3fn)
    assert scales[3] == 1.0 and not codes[3].float().any()  # an all-zero row: scale 1, as torchft
    read = rep._dequantize(codes, scales)
    peak = rows.abs().amax(1, keepdim=True)
    # int8: half a step of peak / 127; e4m3: 3 mantissa bits, within 1/16 of each value.
    err = (read - rows).abs()
    limit = bound * (peak if fmt == "int8" else rows.abs()) + 1e-12
    assert (err <= limit).all(), fmt


def test_the_knob_rewires_hsdp_adamw_and_refuses_an_unknown_format():
    record = method_record("hsdp-adamw")
    assert record.takes == ("reduce_format",)
    assert record.wired({}) is record and record.wired({"reduce_format": "fp32"}) is record
    wired = record.wired({"reduce_format": "int8"})
    assert (wired.replicator, wired.inter_all_reduce) == ("reduce", False)
    with pytest.raises(ValueError) as err:
        record.wired({"reduce_format": "fp16"})
    assert str(err.value) == "reduce_format='fp16' is unknown; use one of fp32, bf16, fp8, int8."
    opt = build_optimizer("hsdp-adamw", TinyBlocks(), None, reduce_format="bf16")
    assert (type(opt.replicator), opt.base.name, opt.sign) == (ReduceReplicator, "adamw", False)
    with pytest.raises(ValueError, match="does not read base; it takes reduce_format"):
        build_optimizer("hsdp-adamw", TinyBlocks(), None, base="sign")


def test_one_replica_averages_nothing():
    grads = [torch.randn(3, 4)]
    rep = ReduceReplicator(reduce_format="int8")
    rep.setup([torch.zeros(3, 4)], None, 1)
    stats = CommStats()
    assert rep.replicate(grads, [0.1], stats)[0] is grads[0] and stats.calls == 0


# -- 2 nodes x 2 gloo ranks, FSDP2 inside the node ----------------------------------------------
def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 100 + rank)  # every rank its own data
    return torch.randn(6, 9, generator=g), torch.randn(6, 3, generator=g)


def _trajectory(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int) -> list:
    out = []
    for step in range(1, STEPS + 1):
        x, y = _batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        out.append([flexdemo.local_tensor(p).detach().clone() for p in model.parameters()])
    return out


def _check_fp32_path_is_hsdp_adamw(rank: int) -> None:
    """FSDP2 inside the node and the reduce replicator in fp32 follow FSDP2's HSDP + AdamW."""
    mesh = flexdemo.build_mesh(2, 2)
    runs = []
    for native in (True, False):
        torch.manual_seed(0)
        model = flexdemo.parallelize(TinyBlocks(), mesh, inter_all_reduce=native)
        opt = build_optimizer("hsdp-adamw", model, mesh, lr=0.01) if native else \
            FlexDeMo(model.parameters(), lr=0.01, replicator=ReduceReplicator(),
                     replication_group=flexdemo.replicate_group(mesh))
        runs.append(_trajectory(model, opt, rank))
    for s, (a, b) in enumerate(zip(*runs, strict=True), start=1):
        for x, y in zip(a, b, strict=True):
            # The same sums in another order (FSDP2 divides before and after its collectives).
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=f"rank {rank} step {s}")


def _check_formats(rank: int) -> None:
    """Recorded bytes per step equal the closed form; every replica reads the same mean."""
    for fmt in ("bf16", "fp8", "int8"):
        recorder, model, mesh, opt = shaped_world(rank, 2, 2, "hsdp-adamw", reduce_format=fmt)
        try:
            shapes = [tuple(flexdemo.local_tensor(p).shape) for p in model.parameters()]
            if fmt == "bf16":
                numel = sum(math.prod(s) for s in shapes)
                want, calls = 2 * numel, 1  # ring all-reduce on 2 nodes: the bf16 payload once
            else:
                want, calls = _expected_block(shapes, 2) * 2, 2  # all-to-all + all-gather
            for step in range(1, STEPS + 1):
                train_step(model, opt, recorder, rank, step)
                rows = inter_rows(recorder, step)
                ops = ["all_reduce"] if fmt == "bf16" else ["all_to_all", "all_gather"]
                assert rows["op"].tolist() == ops, (fmt, rows["op"].tolist())
                assert rows["bytes_sent"].sum() == want and rows["bytes_received"].sum() == want
                assert opt.last_step_comm == {"bytes_sent": want, "bytes_received": want,
                                              "calls": calls}
            variance, _ = flexdemo.replica_spread(model.parameters(),
                                                  flexdemo.replicate_group(mesh))
            assert variance == 0.0, fmt  # the replicas decoded the same mean: still identical
        finally:
            shaping.uninstall()


def _check_means(rank: int, world: int) -> None:
    """On 4 replicas (shares padded: 5 rows, 7 elements), each format reads the fp32 mean to
    within its roundings, the same on every replica."""
    g = torch.Generator().manual_seed(rank)
    grads = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g) * 100,
             torch.zeros(2, 2), torch.randn(0, 4)]
    exact, peaks = [t.clone() for t in grads], []
    for t in exact:
        dist.all_reduce(t)
        t /= world
    for t in grads:  # the largest magnitude any replica sends of each tensor
        peak = torch.tensor(t.abs().max().item() if t.numel() else 0.0)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        peaks.append(peak.item())
    # bf16: a ring sums in bf16 (a rounding of at most 2^-8 of a partial sum per hop); fp8 and
    # int8: two roundings (the replicas' rows, then their mean), each within 1/16 of a value
    # (e4m3) or half a step of a row's largest magnitude / 127 (int8).
    bounds = {"bf16": world * 2**-8, "fp8": 2 / 16, "int8": 1.01 / 127}
    for fmt, bound in bounds.items():
        rep = ReduceReplicator(reduce_format=fmt)
        rep.setup([torch.empty_like(t) for t in grads], None, world)
        mean = rep.replicate(grads, [0.1] * len(grads), CommStats())
        for m, e, t, peak in zip(mean, exact, grads, peaks, strict=True):
            assert m.shape == t.shape and (m - e).abs().le(bound * peak).all(), fmt
            both = [torch.empty_like(m) for _ in range(world)]
            dist.all_gather(both, m)
            assert all(torch.equal(b, both[0]) for b in both), fmt


def _two_nodes(rank: int, world: int) -> None:
    _check_means(rank, world)
    _check_fp32_path_is_hsdp_adamw(rank)
    _check_formats(rank)
    dist.barrier()


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_fp32_path_equals_hsdp_adamw_and_formats_send_their_closed_form():
    run_ranks(_two_nodes, 4)
