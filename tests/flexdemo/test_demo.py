"""Two nodes × one rank over gloo: FlexDeMo against a plain DeMo, byte counts, checkpoints."""

import copy

import pytest
import torch
import torch.distributed as dist

from flexdemo import (
    DeMoReplicator,
    DiLoCoReplicator,
    FlexDeMo,
    RandomReplicator,
    StridingReplicator,
    build_optimizer,
    dct_matrix,
    largest_divisor_at_most,
)
from tests.dist_utils import run_ranks

LR, DECAY, TOPK, CHUNK = 0.01, 0.9, 5, 6


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    # Shapes chosen so chunk 6 gives non-square, non-power-of-two blocks: 10×12 -> 5×6, 6×10 -> 6×5.
    return torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Tanh(), torch.nn.Linear(10, 6))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 12, generator=g), torch.randn(8, 6, generator=g)


def _backward(model: torch.nn.Module, step: int, rank: int) -> None:
    x, y = _batch(step, rank)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()


def _plain_demo_step(params, deltas, world):
    """The eight DeMo steps for one tensor at a time, with dense explicit DCT matrices."""
    for p, delta in zip(params, deltas, strict=True):
        delta.mul_(DECAY).add_(p.grad, alpha=LR)
        d2 = delta.view(1, -1) if delta.dim() == 1 else delta
        rows, cols = d2.shape
        c1, c2 = largest_divisor_at_most(rows, CHUNK), largest_divisor_at_most(cols, CHUNK)
        m1, m2 = dct_matrix(c1), dct_matrix(c2)
        k = min(TOPK, c1 * c2)
        corners = [(bi * c1, bj * c2) for bi in range(rows // c1) for bj in range(cols // c2)]
        sent_idx, sent_vals = [], []
        for r, c in corners:
            block = d2[r:r + c1, c:c + c2]
            coeff = (m1 @ block @ m2.T).reshape(-1)
            idx = coeff.abs().topk(k).indices
            sparse = torch.zeros_like(coeff)
            sparse[idx] = coeff[idx]
            block -= m1.T @ sparse.view(c1, c2) @ m2
            sent_idx.append(idx)
            sent_vals.append(coeff[idx])
        # One gather per tensor keeps this reference readable and the test quick.
        all_idx = [torch.zeros(len(corners), k, dtype=torch.int64) for _ in range(world)]
        all_vals = [torch.zeros(len(corners), k) for _ in range(world)]
        dist.all_gather(all_idx, torch.stack(sent_idx))
        dist.all_gather(all_vals, torch.stack(sent_vals))
        update = torch.zeros_like(d2)
        for b, (r, c) in enumerate(corners):
            total = torch.zeros(c1 * c2)
            count = torch.zeros(c1 * c2)
            for i, v in zip(all_idx, all_vals, strict=True):
                total[i[b]] += v[b]
                count[i[b]] += 1
            mean = torch.where(count > 0, total / count.clamp_min(1), 0.0)
            update[r:r + c1, c:c + c2] = m1.T @ mean.view(c1, c2) @ m2
        p.data.add_(update.view_as(p).sign(), alpha=-LR)


def _check_matches_plain_demo(rank, world):
    # Both arithmetics against DeMo's step written out: the same math up to float rounding,
    # which this small model's 20 sign steps never amplify. (The reference arithmetic equals
    # the package itself bit for bit: test_demo_reference.py.)
    for arithmetic in ("fast", "reference"):
        ours, plain = _model(), _model()
        opt = FlexDeMo(ours.parameters(), lr=LR, replicator=DeMoReplicator(
            topk=TOPK, chunk=CHUNK, decay=DECAY, value_format="fp32", arithmetic=arithmetic))
        deltas = [torch.zeros_like(p) for p in plain.parameters()]
        for step in range(20):
            _backward(ours, step, rank)
            _backward(plain, step, rank)
            opt.step()
            with torch.no_grad():
                _plain_demo_step(list(plain.parameters()), deltas, world)
        for a, b in zip(ours.parameters(), plain.parameters(), strict=True):
            assert torch.allclose(a, b, atol=1e-5, rtol=0), (arithmetic, (a - b).abs().max())
            # And the replicas agree with each other.
            both = [torch.zeros_like(a) for _ in range(world)]
            dist.all_gather(both, a.detach())
            assert torch.equal(both[0], both[1]), arithmetic


def _check_byte_accounting(rank, world):
    # Blocks per tensor (chunk 6, topk 5): W1 10×12 -> 4 of 5×6, b1 10 -> 2 of 5,
    # W2 6×10 -> 2 of 6×5, b2 6 -> 1 of 6: 9 blocks × 5 coefficients = 45 per step.
    for dtype, bytes_per_coeff in ((torch.bfloat16, 2 + 2), (torch.float32, 2 + 4)):
        model = _model()
        opt = FlexDeMo(model.parameters(), lr=LR, compression_topk=TOPK,
                       compression_chunk=CHUNK, value_dtype=dtype)
        for step in range(3):
            _backward(model, step, rank)
            opt.step()
            n = 45 * bytes_per_coeff
            n += -n % 4  # bucket padded to 4 bytes
            assert opt.last_step_comm == {"bytes_sent": (world - 1) * n,
                                          "bytes_received": (world - 1) * n, "calls": 1}
        assert opt.comm_totals.as_dict() == {"bytes_sent": 3 * n, "bytes_received": 3 * n,
                                             "calls": 3}
    # Full replication: one all-reduce of all 196 float32 values: 2(p-1)/p · 784 bytes.
    model = _model()
    opt = FlexDeMo(model.parameters(), lr=LR, replicator="full")
    _backward(model, 0, rank)
    opt.step()
    assert opt.last_step_comm == {"bytes_sent": 784, "bytes_received": 784, "calls": 1}
    # Replicate every 2nd step, skip every 3rd: steps 2 and 4 communicate, 1, 3, 6 do not.
    model = _model()
    opt = FlexDeMo(model.parameters(), lr=LR, replicator=DeMoReplicator(
        topk=TOPK, chunk=CHUNK, replicate_every=2, skip_every=6))
    calls = []
    for step in range(6):
        _backward(model, step, rank)
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        calls.append(opt.last_step_comm["calls"])
        # The optimizer reads .grad; it must never overwrite it (e.g. by an in-place sign).
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert calls == [0, 1, 0, 1, 0, 0]


CHECKPOINT_CASES = [
    ("demo", lambda: {"compression_topk": TOPK, "compression_chunk": CHUNK}),
    ("demo", lambda: {"replicator": DeMoReplicator(replicate_every=2), "base": "adamw",
                      "sign": False}),
    # The reference arithmetic's momentum lives in parameter space, one exchange in flight.
    ("demo", lambda: {"replicator": DeMoReplicator(topk=TOPK, chunk=CHUNK, value_format="fp32",
                                                   delay=1)}),
    ("random", lambda: {"replicator": RandomReplicator(rate=0.3)}),
    ("striding", lambda: {"replicator": StridingReplicator(rate=0.3, chunk=4)}),
    ("diloco", lambda: {"replicator": DiLoCoReplicator(diloco_h=2)}),
    ("full", lambda: {}),
]


def _check_checkpoint_round_trip(rank, world):
    for replicator, make in CHECKPOINT_CASES:
        kwargs = {"replicator": replicator, **make()}
        model = _model()
        opt = FlexDeMo(model.parameters(), lr=LR, **kwargs)
        for step in range(3):
            _backward(model, step, rank)
            opt.step()
        saved_model = copy.deepcopy(model.state_dict())
        saved_opt = copy.deepcopy(opt.state_dict())
        for step in range(3, 7):
            _backward(model, step, rank)
            opt.step()
        resumed = _model(seed=123)
        resumed.load_state_dict(saved_model)
        opt2 = FlexDeMo(resumed.parameters(), lr=0.5, **{"replicator": replicator, **make()})
        opt2.load_state_dict(saved_opt)
        assert opt2.param_groups[0]["lr"] == LR
        for step in range(3, 7):
            _backward(resumed, step, rank)
            opt2.step()
        for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
            assert torch.equal(a, b), replicator
        assert opt2.comm_totals.as_dict() == opt.comm_totals.as_dict()


def _check_demo_method(rank, world):
    # The original DeMo: unsharded model, every rank a replica of the default group.
    model = _model()
    opt = build_optimizer("demo", model, None, lr=LR, topk=TOPK, chunk=CHUNK)
    _backward(model, 0, rank)
    opt.step()
    assert opt.last_step_comm["calls"] == 1 and opt.replicas == world


def _two_nodes(rank, world):
    _check_matches_plain_demo(rank, world)
    _check_byte_accounting(rank, world)
    _check_checkpoint_round_trip(rank, world)
    _check_demo_method(rank, world)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_two_nodes_one_rank_each():
    run_ranks(_two_nodes, 2)
