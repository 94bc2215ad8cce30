"""Two nodes x one rank over gloo: flat chunking against a plain 1-D DeMo, compact formats."""

import pytest
import torch
import torch.distributed as dist

from flexdemo import (
    VALUE_FORMATS,
    DeMoReplicator,
    FlexDeMo,
    RandomReplicator,
    all_reduce_bytes,
    dct_matrix,
    largest_divisor_at_most,
)
from tests.dist_utils import run_ranks

LR, DECAY, TOPK, CHUNK = 0.01, 0.9, 3, 8


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    # Flattened sizes 120, 10, 60, 6 give chunks of 8, 5, 6, 6: neither rows nor columns.
    return torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Tanh(), torch.nn.Linear(10, 6))


def _backward(model: torch.nn.Module, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(8, 12, generator=g), torch.randn(8, 6, generator=g)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()


def _plain_flat_demo_step(params, deltas, world):
    """DeMo on 1-D chunks of each flattened tensor, one tensor at a time, dense DCT matrices."""
    for p, delta in zip(params, deltas, strict=True):
        delta.mul_(DECAY).add_(p.grad.reshape(-1), alpha=LR)
        c = largest_divisor_at_most(delta.numel(), CHUNK)
        m = dct_matrix(c)
        chunks = delta.view(-1, c)
        coeff = chunks @ m.T  # row r: the DCT of chunk r
        k = min(TOPK, c)
        idx = coeff.abs().topk(k, dim=1).indices
        vals = coeff.gather(1, idx)
        chunks -= torch.zeros_like(coeff).scatter_(1, idx, vals) @ m
        all_idx = [torch.zeros_like(idx) for _ in range(world)]
        all_vals = [torch.zeros_like(vals) for _ in range(world)]
        dist.all_gather(all_idx, idx)
        dist.all_gather(all_vals, vals)
        total = torch.zeros_like(coeff)
        count = torch.zeros_like(coeff)
        for i, v in zip(all_idx, all_vals, strict=True):
            total.scatter_add_(1, i, v)
            count.scatter_add_(1, i, torch.ones_like(v))
        mean = torch.where(count > 0, total / count.clamp_min(1), 0.0)
        p.data.add_((mean @ m).view_as(p).sign(), alpha=-LR)


def _check_flat_matches_plain(rank, world):
    # Both arithmetics, to float rounding (the reference one equals the package bit for bit:
    # test_demo_reference.py).
    for arithmetic in ("fast", "reference"):
        ours, plain = _model(), _model()
        opt = FlexDeMo(ours.parameters(), lr=LR, replicator=DeMoReplicator(
            topk=TOPK, chunk=CHUNK, decay=DECAY, value_format="fp32", chunking="flat",
            arithmetic=arithmetic))
        deltas = [torch.zeros(p.numel()) for p in plain.parameters()]
        for step in range(20):
            _backward(ours, step, rank)
            _backward(plain, step, rank)
            opt.step()
            with torch.no_grad():
                _plain_flat_demo_step(list(plain.parameters()), deltas, world)
        for a, b in zip(ours.parameters(), plain.parameters(), strict=True):
            assert torch.allclose(a, b, atol=1e-5, rtol=0), (arithmetic, (a - b).abs().max())


def _check_formats(rank, world):
    # Flat, topk 3: 2 chunks of 5, 11 of 6, 15 of 8 -> 6, 33, 45 coefficients at 3-bit indices.
    sign_bytes = (3 + 1 + 4) + (15 + 5 + 22) + (18 + 6 + 30)
    for fmt in VALUE_FORMATS:
        model = _model()
        opt = FlexDeMo(model.parameters(), lr=LR, replicator=DeMoReplicator(
            topk=TOPK, chunk=CHUNK, decay=DECAY, value_format=fmt, chunking="flat"))
        for step in range(5):
            _backward(model, step, rank)
            opt.step()
            n = opt.replicator.bucket_bytes
            assert opt.last_step_comm == {"bytes_sent": (world - 1) * n,
                                          "bytes_received": (world - 1) * n, "calls": 1}
        if fmt == "sign":
            assert n == sign_bytes
        for p in model.parameters():  # every replica decoded the same update
            both = [torch.zeros_like(p) for _ in range(world)]
            dist.all_gather(both, p.detach())
            assert torch.equal(both[0], both[1]), fmt


def _check_random_1d_rate(rank, world):
    param = torch.nn.Parameter(torch.zeros(400))
    opt = FlexDeMo([param], lr=LR, replicator=RandomReplicator(rate=0.25))
    param.grad = torch.randn(400)
    opt.step()
    # 100 of the 400 float32 elements, all-reduced.
    n = all_reduce_bytes(100 * 4, world)
    assert opt.last_step_comm == {"bytes_sent": n, "bytes_received": n, "calls": 1}


def _two_nodes(rank, world):
    _check_flat_matches_plain(rank, world)
    _check_formats(rank, world)
    _check_random_1d_rate(rank, world)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_two_nodes_flat_and_compact_formats():
    run_ranks(_two_nodes, 2)
