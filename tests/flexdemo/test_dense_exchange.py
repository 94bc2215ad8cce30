"""DeMo's dense exchange (exchange=dense or auto): a bf16 all-reduce of the shard's coefficients.

bf16 keeps 8 significant bits, so each rounding of a partial sum is off by at most 2^-8 of its
magnitude (round to nearest): a sum over N replicas, however the all-reduce orders it, is within
(N-1) * 2^-8 * sum(|v|) of the exact one. That bound (divided by N, as the mean is) is the
tolerance the dense mean is held to against the exact mean of what the replicas sent.
"""

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist

from experiments.cli import main
from experiments.replay.recordings import read_run
from experiments.replay.reshard import run_layout, shard_elements
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
                                         "dense, dense-mean, auto."):
        DeMoKnobs(exchange="ring")


def test_methods_keep_the_all_gather_by_default():
    for name in ("flexdemo", "flexdemo-async", "flexdemo-adamw", "demo"):
        assert method_record(name).knobs.exchange == "allgather"


@pytest.mark.parametrize("ranks", [2, 8, 23, 24, 25, 46, 47, 256])
def test_auto_picks_the_closed_form_choice(ranks):
    # One 64 x 64 weight in flat chunks of 64, top 4: per chunk 4 bf16 values (8 bytes) and
    # 4 indices of 6 bits (3 bytes): 64 x 11 = 704 bytes; dense: 4096 bf16 = 8192 bytes, and
    # dense-mean twice that (a count beside each value). A ring all-reduce moves 2(N-1)/N x its
    # bytes, the all-gather (N-1) x 704: dense is cheaper from N = 24 on, dense-mean (auto's
    # dense side) from N = 47 on.
    rep = DeMoReplicator(dataclasses.replace(FLEXDEMO, exchange="dense"))
    rep.setup([torch.zeros(64, 64)], None, ranks)
    assert (rep.bucket_bytes, rep.dense_bytes) == (704, 8192)
    assert dense_is_cheaper(704, 8192, ranks) == (ranks >= 24)
    auto = DeMoReplicator(dataclasses.replace(FLEXDEMO, exchange="auto"))
    auto.setup([torch.zeros(64, 64)], None, ranks)
    assert (auto.bucket_bytes, auto.dense_bytes) == (704, 16384)
    assert auto.dense == (ranks >= 47)
    assert auto.dense == dense_is_cheaper(704, 16384, ranks)
    assert auto.dense == (all_reduce_bytes(16384, ranks) < (ranks - 1) * 704)


def _exact_and_bound(rep: DeMoReplicator, picked, wire, world: int):
    """The exact mean of what the replicas sent (over N, or over each coefficient's senders
    for dense-mean) and the bf16 sums' error bound, from every replica's own dense vector."""
    values = torch.zeros(rep.dense_numel, dtype=torch.float64)
    sent = torch.zeros(rep.dense_numel, dtype=torch.float64)
    for (idx, _), (_, read), g, start in zip(picked, wire, rep.groups, rep.dense_offsets,
                                             strict=True):
        n = g.num_blocks * g.c1 * g.c2
        values[start:start + n].view(g.num_blocks, -1).scatter_(1, idx, read.double())
        sent[start:start + n].view(g.num_blocks, -1).scatter_(1, idx, 1.0)
    stacked = []
    for own in (values, sent):
        every = [torch.zeros_like(own) for _ in range(world)]
        dist.all_gather(every, own)
        stacked.append(torch.stack(every))
    divisor = stacked[1].sum(0).clamp(min=1.0) if rep.counted else float(world)
    bound = (world - 1) * BF16_ROUNDOFF * stacked[0].abs().sum(0) / divisor
    return stacked[0].sum(0) / divisor, bound


def _post(rep: DeMoReplicator, grads, lrs, world: int):
    """One dense step up to the all-reduce, by its parts: (picked, wire, pending)."""
    rep.decay_and_add([g.clone() for g in grads], lrs)
    picked = rep.dct_topk()
    wire = rep.to_dense_wire(picked, rep.to_wire(picked))
    rep.remove_sent(picked, wire)
    stats = CommStats()
    pending = rep.all_reduce_dense(picked, wire, stats)
    sent = all_reduce_bytes(rep.dense_bytes, world)
    assert stats.as_dict() == {"bytes_sent": sent, "bytes_received": sent, "calls": 1}
    return picked, wire, pending


def _check_dense_mean_and_momenta(rank: int, world: int) -> None:
    # The all-gather, dense and dense-mean fed the same gradients: their momenta (what each
    # rank kept after subtracting what it sent) stay bit-equal, since with bf16 values all
    # three send the same rounded top-k; the dense means are the exact ones to bf16 rounding.
    shards = _shards()
    lrs = [LR] * len(shards)
    for same_ranking in (True, False):
        gather, dense, counted = (
            DeMoReplicator(dataclasses.replace(FLEXDEMO, chunk=8, exchange=x))
            for x in ("allgather", "dense", "dense-mean"))
        for rep in (gather, dense, counted):
            rep.setup(shards, None, world)
        assert (gather.dense, dense.dense, counted.dense) == (False, True, True)
        assert counted.dense_bytes == 2 * dense.dense_bytes == 4 * sum(s.numel() for s in shards)
        for step in range(1, STEPS + 1):
            grads = _grads(shards, step, rank, same_ranking)
            gathered = gather.replicate([g.clone() for g in grads], lrs, CommStats())
            for rep in (dense, counted):
                picked, wire, pending = _post(rep, grads, lrs, world)
                for a, b in zip(gather.groups, rep.groups, strict=True):
                    assert torch.equal(a.delta, b.delta), (rep.exchange, same_ranking, step)
                exact, bound = _exact_and_bound(rep, picked, wire, world)
                pending.work.wait()
                got = torch.cat([c.reshape(-1) for c in rep.dense_coefficients(
                    pending.gathered, world)]).double()
                assert ((got - exact).abs() <= bound + 1e-12).all(), (rep.exchange, step)
                if rep.counted or same_ranking:
                    # DeMo's mean over the senders: dense-mean's always; dense's where every
                    # replica sent every coefficient that was sent. The two decoded updates
                    # then agree to the bf16 sums' rounding (the inverse DCT is orthonormal:
                    # it keeps the error's norm).
                    decoded = rep.decode_mean(pending)
                    err = torch.cat([(a - b).reshape(-1) for a, b in zip(decoded, gathered,
                                                                        strict=True)]).norm()
                    assert err <= bound.norm() + 1e-6, (rep.exchange, step)


def _check_optimizer_replicas_equal(rank: int, world: int) -> None:
    # Through FlexDeMo (sign step), synchronous and look-ahead: every replica applies the same
    # all-reduced sum, so replicas that start equal stay bit-equal (synchronous) or equal up to
    # the look-ahead's rounding once drained.
    for knobs in (dataclasses.replace(FLEXDEMO, chunk=8, exchange="dense"),
                  dataclasses.replace(FLEXDEMO, chunk=8, exchange="dense-mean"),
                  dataclasses.replace(method_record("flexdemo-async").knobs, chunk=8,
                                      exchange="dense-mean")):
        model = _model()
        opt = FlexDeMo(model.parameters(), lr=LR, replicator=DeMoReplicator(knobs))
        for step in range(1, STEPS + 1):
            _set_grads(model, step, rank)
            opt.step()
        opt.drain()
        for p in model.parameters():
            every = [torch.zeros_like(p) for _ in range(world)]
            dist.all_gather(every, p.detach())
            tol = 0.0 if knobs.delay == 0 else 1e-6
            assert all(torch.allclose(e, every[0], rtol=0, atol=tol) for e in every), knobs.delay


def _set_grads(model: torch.nn.Module, step: int, rank: int) -> None:
    for p, g in zip(model.parameters(), _grads(list(model.parameters()), step, rank, False),
                    strict=True):
        p.grad = g


def _check_resume_with_a_dense_exchange_in_flight(rank: int, world: int) -> None:
    # delay=1: the all-reduced dense vector in flight is part of the state; a resumed run
    # applies exactly what the uninterrupted one applies.
    knobs = dataclasses.replace(method_record("flexdemo-async").knobs, chunk=8,
                                exchange="dense-mean")
    model = _model()
    opt = FlexDeMo(model.parameters(), lr=LR, replicator=DeMoReplicator(knobs))
    for step in range(1, 3):
        _set_grads(model, step, rank)
        opt.step()
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    assert saved_opt["replicator"]["in_flight"].dtype == torch.bfloat16
    resumed = _model(seed=123)
    resumed.load_state_dict(saved_model)
    opt2 = FlexDeMo(resumed.parameters(), lr=LR, replicator=DeMoReplicator(knobs))
    opt2.load_state_dict(saved_opt)
    for m, o in ((model, opt), (resumed, opt2)):
        for step in range(3, 5):
            _set_grads(m, step, rank)
            o.step()
        o.drain()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters(),
                                                 strict=True))
    # The state of a dense exchange does not load into an all-gathering replicator.
    gather = FlexDeMo(_model().parameters(), lr=LR, replicator=DeMoReplicator(
        dataclasses.replace(knobs, exchange="allgather")))
    with pytest.raises(ValueError, match="same parameters, replicas and exchange"):
        gather.load_state_dict(saved_opt)


def _check_bytes_equal_netsim_trace(rank: int, world: int) -> None:
    # The replication group counted by netsim from the tensors actually sent (as a run makes
    # it): each step's one all-reduce of the whole dense vector, 2(N-1)/N x its bf16 bytes.
    recorder = TraceRecorder(rank)
    shaping.install(Topology(nodes=world, accelerators_per_node=1, intra=Link("100Gbit"),
                             inter=Link("1Gbit")), mode="off", recorder=recorder)
    # auto at top 7 of 8: a chunk's bucket is 7 x 2 bytes + 21 bits, 1,380 bytes for the
    # model's 83 chunks; dense-mean 4 bytes per element, 2,656: 2 x 2,656 < N x 1,380 from
    # N = 4 on, so auto all-gathers on 2 ranks and all-reduces on 4.
    cases = [("dense", 4, 2, True), ("dense-mean", 4, 4, True), ("auto", 7, 4, world >= 4)]
    try:
        group = dist.new_group(list(range(world)), backend=shaping.BACKEND)
        step = 0
        for exchange, topk, per_element, reduces in cases:
            model = _model()
            numel = sum(p.numel() for p in model.parameters())
            knobs = dataclasses.replace(FLEXDEMO, chunk=8, topk=topk, exchange=exchange)
            opt = FlexDeMo(model.parameters(), lr=LR, replication_group=group,
                           replicator=DeMoReplicator(knobs))
            assert opt.replicator.dense == reduces, exchange
            for _ in range(STEPS):
                step += 1
                _set_grads(model, step, rank)
                recorder.begin_step(step)
                opt.step()
                recorder.end_step(step)
                trace = recorder.frame()
                rows = trace[(trace["step"] == step) & (trace["kind"] == "collective")
                             & trace["inter"]]
                assert list(rows["op"]) == ["all_reduce" if reduces else "all_gather"]
                recorded = {"bytes_sent": int(rows["bytes_sent"].sum()),
                            "bytes_received": int(rows["bytes_received"].sum()),
                            "calls": len(rows)}
                assert opt.last_step_comm == recorded, (exchange, step)
                if reduces:
                    assert int(rows["bytes"].iloc[0]) == per_element * numel
                    assert recorded["bytes_sent"] == (
                        2 * (world - 1) * per_element * numel // world)
    finally:
        shaping.uninstall()


def _ranks(rank: int, world: int) -> None:
    _check_dense_mean_and_momenta(rank, world)
    _check_optimizer_replicas_equal(rank, world)
    _check_resume_with_a_dense_exchange_in_flight(rank, world)
    _check_bytes_equal_netsim_trace(rank, world)


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 4])
def test_dense_exchange_on_gloo_ranks(world):
    run_ranks(_ranks, world)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_dense_run_records_its_all_reduce_and_simulate_replays_it(tmp_path, capsys):
    # 2 nodes x 2 ranks, 2 steps: one inter-node all-reduce per rank and step of 2 bytes per
    # element of the rank's shard; simulate replays it at 64 nodes re-sharded to 4 per node,
    # exactly (the all-reduce rule), as a tree all-reduce.
    out = tmp_path / "run"
    assert main(["run", "--method", "flexdemo", "--exchange", "dense", "--nodes", "2",
                 "--gpus-per-node", "2", "--steps", "2", "--workload", "lm-tiny", "--out",
                 str(out)]) == 0
    run = read_run(out)
    assert run.config.exchange == "dense"
    units, _ = run_layout(run.meta, run.config)
    shard = sum(shard_elements(s, 2) for unit in units for s in unit)
    trace = run.trace
    rows = trace[(trace["kind"] == "collective") & trace["inter"] & (trace["phase"] == "train")]
    assert set(rows["op"]) == {"all_reduce"} and len(rows) == 4 * 2
    assert set(rows["bytes"]) == {2 * shard}
    capsys.readouterr()
    assert main(["simulate", str(out), "--inter-bw", "10Gbit", "--inter-lat", "1ms", "--nodes",
                 "64", "--gpus-per-node", "4", "--compute-scale", "0.05", "--out",
                 str(tmp_path / "s.csv")]) == 0
    printed = capsys.readouterr().out
    assert "all_reduce: tree (64 nodes" in printed
    assert "exact: inter-node all_reduce" in printed and "approximate" not in printed


@pytest.mark.parametrize("exchange", ["dense-mean", "auto"])
def test_a_count_of_senders_beyond_bf16s_exact_integers_is_refused(exchange):
    # A ring adds one rank at a time: a bf16 count of ones stops at 256, so 257 replicas would
    # divide by a wrong count; dense (a sum over N) has no count and runs.
    rep = DeMoReplicator(dataclasses.replace(FLEXDEMO, exchange=exchange))
    with pytest.raises(ValueError, match="exact only up to 256 replicas, and this group has "
                                         "257; use exchange 'dense'"):
        rep.setup([torch.zeros(64, 64)], None, 257)
    dense = DeMoReplicator(dataclasses.replace(FLEXDEMO, exchange="dense"))
    dense.setup([torch.zeros(64, 64)], None, 257)
    assert dense.dense and not dense.counted
