"""Streaming DiLoCo: torchft's schedule and update, the wire formats' error feedback and bytes."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from flexdemo import FlexDeMo, StreamingDiLoCoReplicator, build_optimizer, method_record
from flexdemo.knobs import StreamingDiLoCoKnobs
from flexdemo.methods import METHODS
from flexdemo.replicators.outer_wire import DenseWire, Pending, QuantizedWire
from flexdemo.replicators.streaming_diloco import fragment_numels
from flexdemo.wire import CommStats
from tests.dist_utils import run_ranks

LR = 0.01


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2),
                               torch.nn.Tanh(), torch.nn.Linear(2, 2))


def _start() -> dict:
    torch.manual_seed(0)
    return _model().state_dict()


def _set_grads(params: list[torch.Tensor], step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)  # every replica its own gradients
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _cuts(n: int, fragments: int) -> list[range]:
    # The documented rule, written out again: fragment f holds [n*f // F, n*(f+1) // F).
    return [range(n * f // fragments, n * (f + 1) // fragments) for f in range(fragments)]


# -- torchft, driven in-process: one thread per replica, a stand-in Manager ---------------------
class _Comm:
    """Averages the replicas' tensors of one allreduce call (in replica order), as a ring would."""

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self.barrier = threading.Barrier(replicas, timeout=30)
        self.slots: list[torch.Tensor | None] = [None] * replicas

    def average(self, rank: int, t: torch.Tensor) -> None:
        self.slots[rank] = t
        self.barrier.wait()
        total = self.slots[0].clone()
        for s in self.slots[1:]:
            total += s
        self.barrier.wait()  # everyone has read every slot before anyone writes its own
        t.copy_(total)
        t /= self.replicas  # torchft's Manager: SUM, then divide by the participants
        self.barrier.wait()


class _FakeManager:
    """What torchft's DiLoCo asks of a Manager, without a lighthouse: every commit succeeds."""

    _use_async_quorum = False

    def __init__(self, comm: _Comm, rank: int) -> None:
        self.comm, self.rank, self.commits = comm, rank, 0

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False):
        from torchft.work import _DummyWork

        self.comm.average(self.rank, tensor)
        return _DummyWork(tensor)

    def should_commit(self) -> bool:
        self.commits += 1  # the real Manager's step advances on every successful commit
        return True

    def current_step(self) -> int:
        return self.commits

    def start_quorum(self) -> None: ...
    def register_state_dict_fn(self, *args) -> None: ...
    def allow_state_dict_read(self) -> None: ...
    def disallow_state_dict_read(self) -> None: ...


def _torchft_replica(rank: int, comm: _Comm, knobs: StreamingDiLoCoKnobs, steps: int,
                     out: dict) -> None:
    from torchft.local_sgd import DiLoCo

    model = _model()
    model.load_state_dict(_START)
    params = list(model.parameters())
    frags = [torch.nn.ParameterList([params[i] for i in r])
             for r in _cuts(len(params), knobs.num_fragments)]
    inner = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    outers = [torch.optim.SGD(f.parameters(), lr=knobs.outer_lr, momentum=knobs.outer_momentum,
                              nesterov=True) for f in frags]
    events: list[tuple[str, int, int]] = []
    step = [0]
    history = []
    with DiLoCo(_FakeManager(comm, rank), frags, inner, outers, sync_every=knobs.sync_every,
                fragment_sync_delay=knobs.fragment_sync_delay,
                fragment_update_alpha=knobs.fragment_update_alpha) as diloco:
        for i, fragment in enumerate(diloco._fragments):
            _spy(fragment, i, step, events)
        for s in range(1, steps + 1):
            step[0] = s
            _set_grads(params, s, rank)
            inner.step()  # torchft syncs in the step's post hook
            history.append([p.detach().clone() for p in params])
    out[rank] = (history, events)


def _spy(fragment, i: int, step: list[int], events: list) -> None:
    """Log (what, step, fragment) whenever torchft prepares or performs a fragment's sync."""
    prepare, perform = fragment.prepare_sync, fragment.perform_sync

    def prepared() -> None:
        events.append(("prepare", step[0], i))
        prepare()

    def performed() -> bool:
        events.append(("apply", step[0], i))
        return perform()

    fragment.prepare_sync, fragment.perform_sync = prepared, performed


def _torchft(knobs: StreamingDiLoCoKnobs, steps: int, replicas: int) -> dict:
    comm, out = _Comm(replicas), {}
    threads = [threading.Thread(target=_torchft_replica, args=(r, comm, knobs, steps, out))
               for r in range(replicas)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert set(out) == set(range(replicas)), "a torchft replica failed"
    return out


_START = _start()

# (name, knobs, steps) compared step for step: plain DiLoCo, then streaming with tau and alpha.
REFERENCE = [
    ("diloco", StreamingDiLoCoKnobs(sync_every=3, num_fragments=1, fragment_sync_delay=0), 9),
    ("two-fragments-tau1", StreamingDiLoCoKnobs(sync_every=4, num_fragments=2,
                                                fragment_sync_delay=1), 8),
    ("three-fragments-tau1-alpha", StreamingDiLoCoKnobs(
        sync_every=6, num_fragments=3, fragment_sync_delay=1, fragment_update_alpha=0.25), 12),
]


def _ours_on_rank(rank: int, world: int, out: str) -> None:
    for name, knobs, steps in REFERENCE:
        model = _model()
        model.load_state_dict(_START)
        opt = FlexDeMo(model.parameters(), lr=LR, replicator=StreamingDiLoCoReplicator(knobs))
        history = []
        for s in range(1, steps + 1):
            _set_grads(list(model.parameters()), s, rank)
            opt.step()
            history.append([p.detach().clone() for p in model.parameters()])
        opt.drain()
        torch.save(history, Path(out) / f"{name}-{rank}.pt")


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_equals_torchft_diloco_step_for_step(tmp_path):
    pytest.importorskip("torchft", reason="the reference is torchft's DiLoCo (pip install "
                                          "torchft==0.2.0, in the dev extra)")
    run_ranks(_ours_on_rank, 2, str(tmp_path))  # ours: 2 gloo ranks
    for name, knobs, steps in REFERENCE:
        theirs = _torchft(knobs, steps, 2)  # torchft: 2 threads, the stand-in Manager
        for rank in range(2):
            ours = torch.load(tmp_path / f"{name}-{rank}.pt")
            for s, (a, b) in enumerate(zip(ours, theirs[rank][0], strict=True), start=1):
                for x, y in zip(a, b, strict=True):
                    torch.testing.assert_close(x, y, atol=1e-6, rtol=0,
                                               msg=f"{name}, rank {rank}, step {s}")


# -- the schedule --------------------------------------------------------------------------------
SCHEDULES = [(6, 3, 1), (8, 4, 0), (12, 3, 3), (10, 2, 4), (5, 1, 2)]


def _our_events(knobs: StreamingDiLoCoKnobs, steps: int) -> list[tuple[str, int, int]]:
    """What our replicator prepares and applies in a one-replica run, step by step."""
    model = _model()
    opt = FlexDeMo(model.parameters(), lr=LR, replicator=StreamingDiLoCoReplicator(knobs))
    rep, events, step = opt.replicator, [], [0]
    prepare, apply = rep.prepare, rep.apply

    def prepared(f, params, stats):
        events.append(("prepare", step[0], f))
        return prepare(f, params, stats)

    def applied(f, params):
        events.append(("apply", step[0], f))
        apply(f, params)

    rep.prepare, rep.apply = prepared, applied
    for s in range(1, steps + 1):
        step[0] = s
        _set_grads(list(model.parameters()), s, 0)
        opt.step()
    return events


@pytest.mark.parametrize(("sync_every", "fragments", "tau"), SCHEDULES)
def test_fragment_schedule_equals_torchft(sync_every, fragments, tau):
    pytest.importorskip("torchft", reason="the reference is torchft's DiLoCo")
    knobs = StreamingDiLoCoKnobs(sync_every=sync_every, num_fragments=fragments,
                                 fragment_sync_delay=tau)
    steps = 2 * sync_every + 3
    theirs = _torchft(knobs, steps, 1)[0][1]
    assert _our_events(knobs, steps) == theirs
    # Every fragment syncs once per sync_every steps, at its own offset (f + 1) * period.
    rep = StreamingDiLoCoReplicator(knobs)
    period = sync_every // fragments
    for f in range(fragments):
        applied = [s for s in range(1, steps + 1) if rep.fragment_applied_on(s) == f]
        assert applied == list(range((f + 1) * period, steps + 1, sync_every))
        prepared = [s for s in range(1, steps + 1) if rep.fragment_prepared_on(s) == f]
        assert prepared == [s - tau for s in range((f + 1) * period, steps + tau + 1,
                                                   sync_every)]


def test_schedule_without_torchft():
    rep = StreamingDiLoCoReplicator(sync_every=6, num_fragments=3, fragment_sync_delay=1)
    table = [(rep.fragment_prepared_on(s), rep.fragment_applied_on(s)) for s in range(1, 8)]
    assert table == [(0, None), (None, 0), (1, None), (None, 1), (2, None), (None, 2),
                     (0, None)]
    assert [rep.replicates_on(s) for s in range(1, 7)] == [True] * 6
    rep = StreamingDiLoCoReplicator(sync_every=8, num_fragments=2, fragment_sync_delay=0)
    assert [s for s in range(1, 17) if rep.replicates_on(s)] == [4, 8, 12, 16]


def test_fragments_are_contiguous_runs_of_whole_parameters():
    params = [p.detach() for p in _model().parameters()]  # 6 tensors
    rep = StreamingDiLoCoReplicator(sync_every=8, num_fragments=4)
    rep.setup(params, None, 1)
    assert rep.fragments == [range(0, 1), range(1, 3), range(3, 4), range(4, 6)]
    assert rep.fragments == _cuts(6, 4)


def test_element_cut_sends_equal_bytes_and_splits_a_parameter():
    params = [p.detach() for p in _model().parameters()]  # 12, 3, 6, 2, 4, 2 elements: 29
    rep = StreamingDiLoCoReplicator(sync_every=8, num_fragments=2, fragment_cut="elements")
    rep.setup(params, None, 1)
    # 29 elements in two: [0, 14) and [14, 29); the cut falls inside the third parameter
    assert rep.pieces == [[(0, 0, 12), (1, 0, 2)], [(1, 2, 3), (2, 0, 6), (3, 0, 2), (4, 0, 4),
                                                     (5, 0, 2)]]
    assert [sum(rep.numels[f]) for f in range(2)] == [14, 15]


def test_strided_runs_spread_each_fragment_over_the_model():
    params = [p.detach() for p in _model().parameters()]  # 12, 3, 6, 2, 4, 2 elements: 29
    rep = StreamingDiLoCoReplicator(sync_every=8, num_fragments=2, fragment_cut="elements",
                                    fragment_runs=2)
    rep.setup(params, None, 1)
    # 4 runs [0, 7) [7, 14) [14, 21) [21, 29): fragment 0 the first and third, 1 the others
    assert rep.pieces == [[(0, 0, 7), (1, 2, 3), (2, 0, 6)],
                          [(0, 7, 12), (1, 0, 2), (3, 0, 2), (4, 0, 4), (5, 0, 2)]]
    assert fragment_numels([p.numel() for p in params], 2, "elements", 2) == [14, 15]
    assert rep.fragments == [[0, 1, 2], [0, 1, 3, 4, 5]]  # the parameters each one touches


@pytest.mark.parametrize(("runs", "first"), [(1, range(0, 7)), (2, [*range(0, 3), *range(7, 10)])])
def test_element_cut_moves_each_element_with_its_own_fragment(runs, first):
    """A fragment's first sync (alpha 0) moves its elements by Nesterov's first step, the rest not.

    First step of torch's Nesterov SGD on g = anchor - local: buffer g, so the anchor moves by
    lr (1 + momentum) g; with lr 0.5 and momentum 0.5: 0.25 anchor + 0.75 local. 14 elements:
    fragment 0 holds the first 7, or with two runs a fragment [0, 3) and [7, 10).
    """
    torch.manual_seed(3)
    params = [torch.randn(3, 3), torch.randn(5)]
    rep = StreamingDiLoCoReplicator(sync_every=2, num_fragments=2, fragment_sync_delay=0,
                                    outer_lr=0.5, outer_momentum=0.5, fragment_cut="elements",
                                    fragment_runs=runs)
    rep.setup(params, None, 1)
    flat = lambda: torch.cat([p.reshape(-1) for p in params])  # noqa: E731
    anchor = flat().clone()
    in_frag0 = torch.zeros(14, dtype=torch.bool)
    in_frag0[list(first)] = True
    for frag in (in_frag0, ~in_frag0):  # step 1 syncs fragment 0, step 2 fragment 1
        for p in params:
            p.add_(torch.randn(p.shape))  # an inner step
        before = flat().clone()
        rep.replicate([], [], CommStats())
        rep.after_update(params, CommStats())
        after = flat()
        assert torch.allclose(after[frag], 0.25 * anchor[frag] + 0.75 * before[frag], atol=1e-6)
        assert torch.equal(after[~frag], before[~frag])  # the other fragment did not sync
        anchor[frag] = after[frag]


def test_element_cut_on_parameter_boundaries_equals_the_parameter_cut():
    def run(cut: str) -> list[torch.Tensor]:
        torch.manual_seed(5)
        model = torch.nn.Sequential(torch.nn.Linear(3, 3, bias=False),
                                    torch.nn.Linear(3, 3, bias=False))  # 9 + 9: cuts agree
        opt = build_optimizer("streaming-diloco", model, None, lr=LR, sync_every=2,
                              num_fragments=2, fragment_sync_delay=0, fragment_cut=cut)
        for s in range(1, 6):
            _set_grads(list(model.parameters()), s, 0)
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    for ours, theirs in zip(run("elements"), run("parameters"), strict=True):
        assert torch.equal(ours, theirs)


# -- bad input: one sentence each -----------------------------------------------------------------
@pytest.mark.parametrize(("knobs", "words"), [
    ({"sync_every": 0}, "sync_every=0 must be a positive integer."),
    ({"num_fragments": 0}, "num_fragments=0 must be a positive integer."),
    ({"sync_every": 5, "num_fragments": 2},
     "sync_every=5 must be a multiple of num_fragments=2, since one fragment syncs every "
     "sync_every / num_fragments steps."),
    ({"sync_every": 8, "num_fragments": 2, "fragment_sync_delay": 4},
     "fragment_sync_delay=4 must be below sync_every / num_fragments = 4, so that a sync lands "
     "before the next one is posted."),
    ({"fragment_sync_delay": 50},
     "fragment_sync_delay=50 must be below sync_every / num_fragments = 25, so that a sync "
     "lands before the next one is posted."),
    ({"fragment_sync_delay": -1}, "fragment_sync_delay=-1 must be an integer >= 0."),
    ({"fragment_update_alpha": 1.5}, "fragment_update_alpha=1.5 must lie in [0, 1]."),
    ({"fragment_update_alpha": -0.1}, "fragment_update_alpha=-0.1 must lie in [0, 1]."),
    ({"outer_format": "int4"},
     "outer_format='int4' is unknown; use one of fp32, bf16, int8, 4bit."),
    ({"outer_lr": 0}, "outer_lr=0 must be a number > 0."),
    ({"outer_momentum": 1.0}, "outer_momentum=1.0 must lie in [0, 1)."),
    ({"fragment_cut": "blocks"},
     "fragment_cut='blocks' is unknown; use one of parameters, elements."),
    ({"fragment_runs": 0}, "fragment_runs=0 must be a positive integer."),
    ({"fragment_runs": 3},
     "fragment_runs=3 strides equal runs of elements, so it needs fragment_cut='elements' "
     "(not 'parameters')."),
])
def test_bad_knobs_are_one_sentence(knobs, words):
    with pytest.raises(ValueError) as err:
        StreamingDiLoCoReplicator(**knobs)
    assert str(err.value) == words
    with pytest.raises(ValueError, match="^" + re.escape(words) + "$"):
        build_optimizer("streaming-diloco", _model(), None, **knobs)


def test_more_fragments_than_parameters_is_refused_at_setup():
    rep = StreamingDiLoCoReplicator(sync_every=14, num_fragments=7)  # fine until it sees params
    with pytest.raises(ValueError, match=r"^num_fragments=7 is more than the 6 parameter tensors "
                                         r"handed in; fragments are runs of whole parameters, so "
                                         r"use num_fragments <= 6 \(or "
                                         r"fragment_cut='elements'\)\.$"):
        FlexDeMo(_model().parameters(), lr=LR, replicator=rep)


def test_method_record_follows_diloco_and_takes_no_sign():
    assert METHODS.index("streaming-diloco") == METHODS.index("diloco") + 1
    record = method_record("streaming-diloco")
    assert record.knobs == StreamingDiLoCoKnobs() and not record.takes_sign
    opt = build_optimizer("streaming-diloco", _model(), None)
    assert (opt.base.name, opt.sign) == ("adamw", False)
    k = opt.replicator.knobs
    assert (k.sync_every, k.num_fragments, k.fragment_sync_delay, k.fragment_update_alpha,
            k.outer_lr, k.outer_momentum, k.outer_format) == (50, 2, 1, 0.0, 0.7, 0.9, "fp32")


# -- the wire: error feedback --------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["int8", "4bit"])
def test_quantized_codes_decode_to_what_the_sender_reads(fmt):
    wire = QuantizedWire(fmt, 8 if fmt == "int8" else 4)
    x = torch.randn(37, generator=torch.Generator().manual_seed(3))
    payload, read = wire.encode(x)
    scale = x.abs().max()
    assert (read - x).abs().max() <= scale / wire.levels / 2 + 1e-6  # round to nearest level
    # Two replicas that sent the same payload average to exactly what the sender read.
    assert torch.equal(wire._mean(payload.repeat(2), 2, x.numel()), read)
    # 37 int8 codes or 5 groups of 8 4-bit codes (20 bytes), a 4-byte scale, 4-byte aligned.
    assert payload.numel() == {"int8": 44, "4bit": 24}[fmt]


def _fake_post(wire, got: list):
    """A stand-in for the collective: every replica sent what this one did."""
    def post(payload, numel, group, ranks, stats):
        if isinstance(wire, QuantizedWire):
            mean = wire._mean(payload.repeat(ranks), ranks, numel)
        else:
            mean = payload.float()
        got.append(mean.clone())
        return Pending.done(mean)
    return post


@pytest.mark.parametrize("fmt", ["bf16", "int8", "4bit"])
def test_rounding_error_is_carried_into_the_next_sync(fmt):
    params = [p.detach().clone() for p in _model().parameters()]
    rep = StreamingDiLoCoReplicator(sync_every=1, num_fragments=1, fragment_sync_delay=0,
                                    outer_format=fmt)
    rep.setup(params, None, 2)  # two replicas, so that the format applies
    got, encoded = [], []
    rep.wire.post = _fake_post(rep.wire, got)
    encode = rep.wire.encode

    def spy(x):
        payload, read = encode(x)
        encoded.append((x.clone(), read.clone()))
        return payload, read

    rep.wire.encode = spy
    g = torch.Generator().manual_seed(5)
    pseudo_total = torch.zeros(sum(p.numel() for p in params))
    residual = torch.zeros_like(pseudo_total)
    for step in range(1, 9):
        for p in params:
            p.sub_(0.01 * torch.randn(p.shape, generator=g))  # an inner step
        pseudo = torch.cat([(a - p).reshape(-1) for a, p in zip(rep.anchors[0], params,
                                                                    strict=True)])
        rep.replicate([], [], CommStats())
        rep.after_update(params, CommStats())
        sent, read = encoded[-1]
        # What was sent is this sync's pseudo-gradient plus what rounding lost last time ...
        torch.testing.assert_close(sent, pseudo + residual, atol=1e-7, rtol=0)
        residual = sent - read
        # ... and what it loses now stays with this replica for the next one.
        torch.testing.assert_close(rep.residuals[0], residual, atol=0, rtol=0)
        assert residual.abs().max() > 0, step
        assert torch.equal(got[-1], read)  # the outer step ran on what the receivers read
        pseudo_total += pseudo
    # Nothing is lost for good: all that was read plus what is still carried is all there was.
    torch.testing.assert_close(sum(got) + rep.residuals[0], pseudo_total, atol=1e-5, rtol=0)


def test_fp32_carries_nothing_and_one_replica_rounds_nothing():
    params = [p.detach().clone() for p in _model().parameters()]
    assert StreamingDiLoCoReplicator(outer_format="fp32").wire.lossy is False
    rep = StreamingDiLoCoReplicator(sync_every=1, num_fragments=1, fragment_sync_delay=0,
                                    outer_format="4bit")
    rep.setup(params, None, 1)
    for p in params:
        p.sub_(0.1)
    pending = rep.prepare(0, params, CommStats())
    assert pending.work is None and not rep.residuals[0].any()
    torch.testing.assert_close(pending.mean(), torch.full_like(pending.mean(), 0.1))
    assert isinstance(StreamingDiLoCoReplicator(outer_format="bf16").wire, DenseWire)


# -- two gloo ranks: bytes, replicas, drain, resume -----------------------------------------------
def _expected_bytes(fmt: str, numel: int, ranks: int) -> int:
    """Per-rank bytes of one fragment's sync, from the formats' definition."""
    if fmt in ("fp32", "bf16"):
        return 2 * (ranks - 1) * numel * (4 if fmt == "fp32" else 2) // ranks  # ring all-reduce
    codes = numel if fmt == "int8" else -(-numel // 8) * 4  # 4-bit: whole groups of 8 codes
    return (ranks - 1) * (-(-(codes + 4) // 4) * 4)  # all-gather of codes + fp32 scale, aligned


def _check_bytes_and_replicas(rank: int, world: int) -> None:
    for fmt in ("fp32", "bf16", "int8", "4bit"):
        model = _model()
        model.load_state_dict(_START)
        params = list(model.parameters())
        opt = FlexDeMo(params, lr=LR, replicator=StreamingDiLoCoReplicator(
            sync_every=4, num_fragments=2, fragment_sync_delay=1, outer_format=fmt))
        rep = opt.replicator
        for s in range(1, 9):
            _set_grads(params, s, rank)
            opt.step()
            prepared, applied = rep.fragment_prepared_on(s), rep.fragment_applied_on(s)
            want = 0 if prepared is None else _expected_bytes(
                fmt, sum(params[i].numel() for i in rep.fragments[prepared]), world)
            assert opt.last_step_comm == {"bytes_sent": want, "bytes_received": want,
                                          "calls": int(prepared is not None)}, (fmt, s)
            if applied is not None:
                # alpha = 0: the fragment that just synced is the same on every replica.
                for i in rep.fragments[applied]:
                    both = [torch.empty_like(params[i]) for _ in range(world)]
                    dist.all_gather(both, params[i].detach())
                    assert torch.equal(both[0], both[1]), (fmt, s, i)
        opt.drain()


def _check_drain_and_resume(rank: int, world: int) -> None:
    knobs = StreamingDiLoCoKnobs(sync_every=4, num_fragments=2, fragment_sync_delay=1,
                                 outer_format="int8")

    def run(model, opt, steps):
        for s in steps:
            _set_grads(list(model.parameters()), s, rank)
            opt.step()

    model = _model()
    model.load_state_dict(_START)
    opt = FlexDeMo(model.parameters(), lr=LR, replicator=StreamingDiLoCoReplicator(knobs))
    run(model, opt, range(1, 4))  # step 3 posts fragment 1's sync: in flight now
    assert list(opt.replicator.in_flight) == [1]
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved = opt.state_dict()
    assert list(saved["replicator"]["in_flight"]) == [1] and saved["replicator"]["steps"] == 3
    run(model, opt, range(4, 8))
    resumed = _model()
    resumed.load_state_dict(saved_model)
    opt2 = FlexDeMo(resumed.parameters(), lr=LR, replicator=StreamingDiLoCoReplicator(knobs))
    opt2.load_state_dict(saved)
    run(resumed, opt2, range(4, 8))
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    # Step 7 posted fragment 1's sync again; drain waits on it and drops it, never applied.
    pending = opt.replicator.in_flight[1]
    work = pending.work
    before = [p.detach().clone() for p in model.parameters()]
    opt.drain()
    assert opt.replicator.in_flight == {} and work.is_completed()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    opt.drain()  # nothing left: a no-op
    opt2.drain()


def _two_ranks(rank: int, world: int) -> None:
    _check_bytes_and_replicas(rank, world)
    _check_drain_and_resume(rank, world)


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_bytes_replicas_drain_and_resume_on_two_ranks():
    run_ranks(_two_ranks, 2)


def test_state_saved_over_other_fragments_is_refused():
    opt = build_optimizer("streaming-diloco", _model(), None, sync_every=4, num_fragments=2)
    state = opt.state_dict()
    other = build_optimizer("streaming-diloco", _model(), None, sync_every=4, num_fragments=1)
    with pytest.raises(ValueError, match=r"^state holds 2 fragments but this replicator has 1; "):
        other.load_state_dict(state)
