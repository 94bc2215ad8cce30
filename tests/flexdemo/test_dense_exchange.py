"""DeMo's dense exchange (exchange=dense or auto): a bf16 all-reduce of the shard's coefficients.

bf16 keeps 8 significant bits, so each rounding of a partial sum is off by at most 2^-8 of its
magnitude (round to nearest): a sum over N replicas, however the all-reduce orders it, is within
(N-1) * 2^-8 * sum(|v|) of the exact one. That bound (divided by N, as the mean is) is the
tolerance the dense mean is held to against the exact mean of what the replicas sent.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from flexdemo import DeMoReplicator, FlexDeMo, method_record
from flexdemo.knobs import DeMoKnobs
from flexdemo.wire import CommStats, all_reduce_bytes, dense_is_cheaper
from netsim import Link, Topology, TraceRecorder, shaping
from tests.dist_utils import run_ranks

LR, STEPS = 0.01, 4
BF16_ROUNDOFF = 2.0 ** -8
# flexdemo's own exchange settings (flat chunks of 64, top 4, bf16 values, 6-bit indices).
FLEXDEMO = method_record("flexdemo").knobs


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))


def _shards() -> list[torch.Tensor]:
    return [p.detach() for p in _model().parameters()]


def _grads(shards: list[torch.Tensor], step: int, rank: int, same_ranking: bool):
    g = torch.Generator().manual_seed(1000 * step + (0 if same_ranking else rank))
    grads = [torch.randn(s.shape, generator=g) for s in shards]
    # Scaling by a power of two commutes with every rounding (fp32 and bf16), so each rank's
    # momentum, residual included, is its scale times rank 0's: every rank picks the same
    # coefficients at every step, with different values.
    return [x * 2.0 ** rank for x in grads] if same_ranking else grads


def test_unknown_exchange_is_refused_in_one_sentence():
    with pytest.raises(ValueError, match="exchange='ring' is unknown; use one of allgather, "
                                         "dense, auto."):
        DeMoKnobs(exchange="ring")


def test_methods_keep_the_all_gather_by_default():
    for name in ("flexdemo", "flexdemo-async", "flexdemo-adamw", "demo"):
        assert method_record(name).knobs.exchange == "allgather"


@pytest.mark.parametrize("ranks", [2, 8, 23, 24, 25, 1024])
def test_auto_picks_the_closed_form_choice(ranks):
    # One 64 x 64 weight in flat chunks of 64, top 4: per chunk 4 bf16 values (8 bytes) and
    # 4 indices of 6 bits (3 bytes): 64 x 11 = 704 bytes; dense: 4096 bf16 = 8192 bytes. A ring
    # all-reduce moves 2(N-1)/N x 8192, the all-gather (N-1) x 704: dense from N = 24 on.
    rep = DeMoReplicator(dataclasses.replace(FLEXDEMO, exchange="auto"))
    rep.setup([torch.zeros(64, 64)], None, ranks)
    assert (rep.bucket_bytes, rep.dense_bytes) == (704, 8192)
    assert rep.dense == (ranks >= 24)
    assert rep.dense == dense_is_cheaper(704, 8192, ranks)
    assert rep.dense == (all_reduce_bytes(8192, ranks) < (ranks - 1) * 704)


def _exact_mean_and_bound(own: torch.Tensor, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact mean of every replica's sent vector, and the bf16 sum's error bound over N."""
    every = [torch.zeros_like(own, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(every, own.to(torch.float64))
    stacked = torch.stack(every)
    bound = (world - 1) * BF16_ROUNDOFF * stacked.abs().sum(0) / world
    return stacked.sum(0) / world, bound


def _own_dense(rep: DeMoReplicator, picked, wire) -> torch.Tensor:
    """This rank's sent values scattered into zeros, as the dense exchange lays them out."""
    own = torch.zeros(rep.dense_numel, dtype=torch.float32)
    for (idx, _), (_, sent), g, start in zip(picked, wire, rep.groups, rep.dense_offsets,
                                             strict=True):
        own[start:start + g.num_blocks * g.c1 * g.c2].view(g.num_blocks, -1).scatter_(
            1, idx, sent.float())
    return own


def _check_dense_mean_and_momenta(rank: int, world: int) -> None:
    # Two replicators fed the same gradients, all-gather and dense: their momenta (what each
    # rank kept after subtracting what it sent) stay bit-equal, since with bf16 values both
    # send the same rounded top-k.
    shards = _shards()
    lrs = [LR] * len(shards)
    for same_ranking in (True, False):
        gather, dense = (DeMoReplicator(dataclasses.replace(FLEXDEMO, chunk=8, exchange=x))
                         for x in ("allgather", "dense"))
        for rep in (gather, dense):
            rep.setup(shards, None, world)
        assert not gather.dense and dense.dense
        for step in range(1, STEPS + 1):
            grads = _grads(shards, step, rank, same_ranking)
            gathered = gather.replicate([g.clone() for g in grads], lrs, CommStats())
            dense.decay_and_add([g.clone() for g in grads], lrs)
            picked = dense.dct_topk()
            wire = dense.to_dense_wire(picked, dense.to_wire(picked))
            dense.remove_sent(picked, wire)
            stats = CommStats()
            pending = dense.all_reduce_dense(picked, wire, stats)
            assert stats.as_dict() == {"bytes_sent": all_reduce_bytes(dense.dense_bytes, world),
                                       "bytes_received": all_reduce_bytes(dense.dense_bytes,
                                                                          world), "calls": 1}
            for a, b in zip(gather.groups, dense.groups, strict=True):
                assert torch.equal(a.delta, b.delta), (same_ranking, step)
            exact, bound = _exact_mean_and_bound(_own_dense(dense, picked, wire), world)
            pending.work.wait()
            got = torch.cat([c.reshape(-1) for c in dense.dense_coefficients(pending.gathered,
                                                                             world)])
            assert ((got.double() - exact).abs() <= bound + 1e-12).all(), (same_ranking, step)
            if same_ranking:
                # Every replica sent every coefficient that was sent: DeMo's mean over the
                # senders is the mean over N, so the two decoded updates agree, to the bf16
                # sum's rounding (the inverse DCT is orthonormal: it keeps the error's norm).
                decoded = dense.decode_mean(pending)
                err = torch.cat([(a - b).reshape(-1) for a, b in zip(decoded, gathered,
                                                                    strict=True)]).norm()
                assert err <= bound.norm() + 1e-6, step


def _check_optimizer_replicas_equal(rank: int, world: int) -> None:
    # Through FlexDeMo (sign step), synchronous and look-ahead: every replica applies the same
    # all-reduced sum, so replicas that start equal stay bit-equal (synchronous) or equal up to
    # the look-ahead's rounding once drained.
    for knobs in (dataclasses.replace(FLEXDEMO, chunk=8, exchange="dense"),
                  dataclasses.replace(method_record("flexdemo-async").knobs, chunk=8,
                                      exchange="dense")):
        model = _model()
        opt = FlexDeMo(model.parameters(), lr=LR, replicator=DeMoReplicator(knobs))
        for step in range(1, STEPS + 1):
            for p, g in zip(model.parameters(), _grads(list(model.parameters()), step, rank,
                                                       False), strict=True):
                p.grad = g
            opt.step()
        opt.drain()
        for p in model.parameters():
            every = [torch.zeros_like(p) for _ in range(world)]
            dist.all_gather(every, p.detach())
            tol = 0.0 if knobs.delay == 0 else 1e-6
            assert all(torch.allclose(e, every[0], rtol=0, atol=tol) for e in every), knobs.delay


def _check_bytes_equal_netsim_trace(rank: int, world: int) -> None:
    # The replication group counted by netsim from the tensors actually sent (as a run makes
    # it): each step's one all-reduce of the whole dense vector, 2(N-1)/N x its bf16 bytes.
    recorder = TraceRecorder(rank)
    shaping.install(Topology(nodes=world, accelerators_per_node=1, intra=Link("100Gbit"),
                             inter=Link("1Gbit")), mode="off", recorder=recorder)
    try:
        group = dist.new_group(list(range(world)), backend=shaping.BACKEND)
        model = _model()
        numel = sum(p.numel() for p in model.parameters())
        # auto at top 4 of 8: a chunk's bucket is 4 x 2 + 12 bits = 10 bytes, its dense 16, and
        # 2 x 16 < N x 10 from N = 4 on; at 2 ranks auto stays with the all-gather.
        opt = FlexDeMo(model.parameters(), lr=LR, replication_group=group,
                       replicator=DeMoReplicator(dataclasses.replace(FLEXDEMO, chunk=8,
                                                                     exchange="auto")))
        assert opt.replicator.dense == (world >= 4)
        for step in range(1, STEPS + 1):
            for p, g in zip(model.parameters(), _grads(list(model.parameters()), step, rank,
                                                       False), strict=True):
                p.grad = g
            recorder.begin_step(step)
            opt.step()
            recorder.end_step(step)
            trace = recorder.frame()
            rows = trace[(trace["step"] == step) & (trace["kind"] == "collective")
                         & trace["inter"]]
            assert list(rows["op"]) == ["all_reduce" if world >= 4 else "all_gather"]
            recorded = {"bytes_sent": int(rows["bytes_sent"].sum()),
                        "bytes_received": int(rows["bytes_received"].sum()), "calls": len(rows)}
            assert opt.last_step_comm == recorded, step
            if world >= 4:
                assert int(rows["bytes"].iloc[0]) == 2 * numel
                assert recorded["bytes_sent"] == 2 * (world - 1) * 2 * numel // world
    finally:
        shaping.uninstall()


def _ranks(rank: int, world: int) -> None:
    _check_dense_mean_and_momenta(rank, world)
    _check_optimizer_replicas_equal(rank, world)
    _check_bytes_equal_netsim_trace(rank, world)


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 4])
def test_dense_exchange_on_gloo_ranks(world):
    run_ranks(_ranks, world)
