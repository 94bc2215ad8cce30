"""The exact mode (fp32 values, reference arithmetic) against the reference DeMo, bit for bit.

The reference is the package itself: DeToNATION 0.5.2's ``DeToSGD`` with its
``DeMoReplicator`` (``detonation``, in the dev extra), on 3 nodes x 1 gloo rank, each rank with
its own data, both optimizers on the same model and batches (three replicas, so that a
coefficient can arrive from three senders, where the order of the mean's sum and division
shows). Every step's parameters must be equal bit for bit, on every rank.

How many steps are exact, and why: all of them. The reference arithmetic runs the package's
operations in its order on the same inputs, so each step is the same bits, and so is the next
one's input; 10 steps are checked here (100 on the 2.1M-parameter MLP of
``benchmarks/bench_demo_agreement.py``). Anything less than the same bits parts for good
within a few steps: the sign step turns a one-ulp difference in a decoded update into a whole
2 x lr where that update is near zero, or into another coefficient where two nearly tie for the
k-th place, and the next gradients then differ everywhere. The fast arithmetic (momentum in the DCT
domain, correctly rounded bases, batched products) is such a difference: on that MLP it leaves
0.03-6% of the parameters apart after 4 steps and 42-64% after 10, depending on the data, so no
tolerance holds a longer run together and none is tried. With the sign, a rounding difference
shows only once a sign flips; so the cases without it (lr 1, where both apply the decoded
update itself, p -= u) compare every bit of every update, and the fast arithmetic fails them
at the first step.

The package needs weight decay 0 (its ``detonation_weight_decay`` reads an attribute it never
sets) and one sharding rank per replica here (a group of one).
"""

import contextlib
import io

import pytest
import torch
import torch.distributed as dist

from flexdemo import DeMoKnobs, DeMoReplicator, FlexDeMo, dct_matrix
from flexdemo.dct import fft_dct_bases
from tests.dist_utils import run_ranks

detonation = pytest.importorskip("detonation", reason="the reference DeMo (pip install -e "
                                 "'.[dev]' brings detonation 0.5.2)")

TOPK, CHUNK, DECAY = 4, 8, 0.999
# Largest divisors not above 8: 8 x 8 blocks, 5 x 8, 1 x 5 (11 rows: prime), 1-D chunks of 8,
# 5 and 1 (topk clamped to 1); flattened: 768 -> 8, 960 -> 8, 220 -> 5, 48, 20, 11.
SHAPES = [(48, 16), (48,), (20, 48), (20,), (11, 20), (11,)]


def _params(flat: bool) -> list[torch.nn.Parameter]:
    # The same values either way; flat: each tensor a 1-D parameter, as FSDP1's flat shards.
    torch.manual_seed(0)
    values = [torch.randn(s) * 0.3 for s in SHAPES]
    return [torch.nn.Parameter(v.reshape(-1) if flat else v) for v in values]


def _backward(params: list[torch.nn.Parameter], step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 11, generator=g)
    for layer in range(3):
        w, b = params[2 * layer], params[2 * layer + 1]
        x = torch.nn.functional.linear(x, w.view(SHAPES[2 * layer]), b)
        x = torch.nn.functional.gelu(x) if layer < 2 else x
    for p in params:
        p.grad = None
    torch.nn.functional.mse_loss(x, y).backward()


def _package(params, lr: float, sign: bool, solo, replicas):
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its chunk sizes
        return detonation.DeToSGD(
            params, lr=lr, detonation_sign=sign, sharding_parallel_group=solo,
            replication_parallel_group=replicas,
            replicator=detonation.DeMoReplicator(compression_decay=DECAY,
                                                 compression_topk=TOPK,
                                                 compression_chunk=CHUNK))


def _same_every_step(rank, world, ours, theirs, opt, ref, steps, case):
    for step in range(steps):
        _backward(ours, step, rank)
        _backward(theirs, step, rank)
        opt.step()
        ref.step()
        for n, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert torch.equal(a.detach().reshape(-1), b.detach().reshape(-1)), (
                f"{case}: step {step + 1}, tensor {n} {tuple(a.shape)}: "
                f"{int((a.reshape(-1) != b.reshape(-1)).sum())} elements differ, "
                f"by up to {float((a.reshape(-1) - b.reshape(-1)).abs().max()):.3g}")
    for a in ours if world > 1 else ():  # the replicas took the same steps
        both = [torch.zeros_like(a) for _ in range(world)]
        dist.all_gather(both, a.detach())
        assert all(torch.equal(both[0], other) for other in both[1:]), case


def _cases(rank, world):
    solos = [dist.new_group([r]) for r in range(world)]
    everyone = dist.group.WORLD
    # The reference call with fp32 values, as a user of the package would spell it.
    ours = _params(flat=False)
    opt = FlexDeMo(ours, lr=1e-3, compression_topk=TOPK, compression_chunk=CHUNK,
                   compression_decay=DECAY, weight_decay=0.0, sign=True, replicator="demo",
                   value_dtype=torch.float32)
    theirs = _params(flat=False)
    _same_every_step(rank, world, ours, theirs, opt, _package(theirs, 1e-3, True, solos[rank],
                                                             everyone), 10, "sign, lr 1e-3")
    # Without the sign at lr 1 every bit of each decoded update reaches the parameters.
    for chunking in ("block", "flat"):
        ours = _params(flat=False)
        opt = FlexDeMo(ours, lr=1.0, sign=False, replicator=DeMoReplicator(
            topk=TOPK, chunk=CHUNK, decay=DECAY, value_dtype=torch.float32, chunking=chunking))
        theirs = _params(flat=chunking == "flat")
        _same_every_step(rank, world, ours, theirs, opt,
                         _package(theirs, 1.0, False, solos[rank], everyone), 10,
                         f"no sign, lr 1, {chunking} chunking")
    # One replica: the whole momentum is the update, nothing crosses a network.
    ours = _params(flat=False)
    opt = FlexDeMo(ours, lr=1.0, sign=False, replication_group=solos[rank],
                   replicator=DeMoReplicator(topk=TOPK, chunk=CHUNK, decay=DECAY,
                                             value_format="fp32"))
    theirs = _params(flat=False)
    _same_every_step(rank, 1, ours, theirs, opt,
                     _package(theirs, 1.0, False, solos[rank], solos[rank]), 3, "one replica")


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_exact_mode_equals_the_package_bit_for_bit():
    run_ranks(_cases, 3)


def test_the_fft_bases_are_the_packages():
    # Rounded as the package rounds them: off the correctly rounded cosines by a few ulps.
    for n in (1, 2, 5, 8, 11, 64):
        probe = [{"params": [torch.zeros(n, requires_grad=True)]}]
        with contextlib.redirect_stdout(io.StringIO()):
            transform = detonation.util.DCTTransform(probe, n)
        forward, inverse = fft_dct_bases(n)
        assert torch.equal(forward, transform.f_dict[n]), n
        assert torch.equal(inverse, transform.b_dict[n]), n
        assert torch.allclose(forward, dct_matrix(n).T, atol=1e-6, rtol=0)
    assert not torch.equal(fft_dct_bases(64)[0], dct_matrix(64).T)


def test_fp32_values_take_the_reference_arithmetic():
    assert DeMoKnobs(value_format="fp32").arithmetic_used == "reference"
    assert DeMoKnobs(value_format="fp32", arithmetic="fast").arithmetic_used == "fast"
    for fmt in ("bf16", "fp32-packed", "bf16-packed", "int8"):
        assert DeMoKnobs(value_format=fmt).arithmetic_used == "fast", fmt
    assert DeMoKnobs(value_format="int8", arithmetic="reference").arithmetic_used == "reference"
    opt = FlexDeMo([torch.nn.Parameter(torch.zeros(8, 8))], compression_topk=4,
                   compression_chunk=8, value_dtype=torch.float32)
    assert opt.replicator.knobs.arithmetic_used == "reference"
    with pytest.raises(ValueError, match="arithmetic='exact' is unknown; use one of fast, "
                                         "reference"):
        DeMoKnobs(arithmetic="exact")
