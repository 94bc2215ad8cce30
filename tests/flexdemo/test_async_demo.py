"""Delayed DeMo (delay=1, flexdemo-async): the previous step's exchange; the last one drained."""

import copy
import dataclasses
import json

import pandas as pd
import pytest
import torch
import torch.distributed as dist

from experiments.cli import main
from flexdemo import DeMoReplicator, build_optimizer, method_record
from flexdemo.knobs import DeMoKnobs
from flexdemo.methods import METHODS
from flexdemo.wire import CommStats
from tests.dist_utils import run_ranks

LR, DECAY, TOPK, CHUNK = 0.01, 0.9, 5, 6
STEPS = 5


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Tanh(), torch.nn.Linear(10, 6))


def _grads(shards: list[torch.Tensor], step: int, rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)  # every rank its own gradients
    return [torch.randn(s.shape, generator=g) for s in shards]


def _backward(model: torch.nn.Module, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(8, 12, generator=g), torch.randn(8, 6, generator=g)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()


def _check_delayed_update_is_last_steps_synchronous_one(rank: int, world: int) -> None:
    # The same gradients go into a delay=0 and a delay=1 replicator: their momenta evolve alike
    # (error feedback does not depend on what is applied), so step t+1 of the delayed one must
    # apply exactly the synchronous update of step t, bit for bit.
    flexdemo_async = method_record("flexdemo-async").knobs
    settings = [
        DeMoKnobs(topk=TOPK, chunk=CHUNK, decay=DECAY, value_format="fp32"),  # 2-D blocks
        # the method's own flat, packed bf16
        dataclasses.replace(flexdemo_async, delay=0, lookahead=False),
    ]
    shards = [p.detach() for p in _model().parameters()]
    for knobs in settings:
        sync = DeMoReplicator(knobs)
        delayed = DeMoReplicator(dataclasses.replace(knobs, delay=1, lookahead=False))
        for rep in (sync, delayed):
            rep.setup(shards, None, world)
        lrs = [LR] * len(shards)
        previous = None
        for step in range(1, STEPS + 1):
            grads = _grads(shards, step, rank)
            stats, delayed_stats = CommStats(), CommStats()
            now = [u.clone() for u in sync.replicate([g.clone() for g in grads], lrs, stats)]
            applied = delayed.replicate([g.clone() for g in grads], lrs, delayed_stats)
            if previous is None:
                # Nothing has arrived at the first step: a zero update of every shape.
                assert all(u.shape == s.shape and not u.any() for u, s in zip(applied, shards,
                                                                              strict=True))
            else:
                assert all(torch.equal(a, b) for a, b in zip(applied, previous, strict=True))
            # The same bucket is posted at every step, and the momenta stay equal.
            assert delayed_stats.as_dict() == stats.as_dict() and stats.calls == 1
            assert all(torch.equal(a.delta, b.delta) for a, b in zip(sync.groups, delayed.groups,
                                                                     strict=True))
            previous = now
        # After the last step one exchange is in flight; drain waits on it and drops it.
        work = delayed.in_flight.work
        delayed.drain()
        assert delayed.in_flight is None and work.is_completed()
        delayed.drain()  # nothing left: a second drain is a no-op


def _check_optimizer_keeps_replicas_equal_and_resumes(rank: int, world: int) -> None:
    model = _model()
    start = [p.detach().clone() for p in model.parameters()]
    opt = build_optimizer("flexdemo-async", model, None, lr=LR, lookahead=False)
    _backward(model, 0, rank)
    opt.step()
    # The zero first update leaves the parameters where they started (no weight decay).
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), start, strict=True))
    assert opt.last_step_comm["calls"] == 1
    for step in range(1, 3):
        _backward(model, step, rank)
        opt.step()
    # The pending bucket is part of the state: a resumed run applies what this one applies.
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    assert saved_opt["replicator"]["in_flight"] is not None
    for step in range(3, 6):
        _backward(model, step, rank)
        opt.step()
    resumed = _model(seed=123)
    resumed.load_state_dict(saved_model)
    opt2 = build_optimizer("flexdemo-async", resumed, None, lr=LR, lookahead=False)
    opt2.load_state_dict(saved_opt)
    for step in range(3, 6):
        _backward(resumed, step, rank)
        opt2.step()
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
        # Every replica applied the same updates, the first one included.
        both = [torch.zeros_like(a) for _ in range(world)]
        dist.all_gather(both, a.detach())
        assert torch.equal(both[0], both[1])
    for o in (opt, opt2):
        o.drain()
        assert o.replicator.in_flight is None
    # A state with an exchange in flight does not load into a synchronous replicator.
    sync = build_optimizer("flexdemo", _model(), None, lr=LR)
    with pytest.raises(ValueError, match="delay=1"):
        sync.load_state_dict(saved_opt)


def _set_grads(model: torch.nn.Module, step: int, rank: int) -> None:
    # Gradients that do not depend on the parameters: the momenta of every variant then agree.
    for p, g in zip(model.parameters(), _grads(list(model.parameters()), step, rank),
                    strict=True):
        p.grad = g


def _check_lookahead_is_the_synchronous_path_plus_its_own_step(rank: int, world: int) -> None:
    # With the same gradients the momenta, and so the means, are the synchronous method's:
    # after step t the look-ahead replica sits at the synchronous parameters of step t - 1
    # moved by one sign step of its own top-k; the drain leaves the synchronous ones.
    sync_model, ahead_model = _model(), _model()
    sync = build_optimizer("flexdemo", sync_model, None, lr=LR)
    ahead = build_optimizer("flexdemo-async", ahead_model, None, lr=LR, lookahead=True)
    before = [p.detach().clone() for p in sync_model.parameters()]
    for step in range(1, STEPS + 1):
        for model, opt in ((sync_model, sync), (ahead_model, ahead)):
            _set_grads(model, step, rank)
            opt.step()
        own = ahead.replicator.in_flight.ahead.signs
        for p, b, o in zip(ahead_model.parameters(), before, own, strict=True):
            assert torch.allclose(p, b - LR * o, atol=1e-6)
        before = [p.detach().clone() for p in sync_model.parameters()]
        assert ahead.last_step_comm == sync.last_step_comm
    ahead.drain()
    for a, b in zip(ahead_model.parameters(), sync_model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
        both = [torch.zeros_like(a) for _ in range(world)]
        dist.all_gather(both, a.detach())
        # The replicas end equal up to float rounding: taking one's own step back rounds
        # differently on each (their means are bit-equal, so nothing amplifies it).
        assert torch.allclose(both[0], both[1], rtol=0, atol=1e-6)
    # Resuming mid-run applies what the uninterrupted run applies.
    model = _model()
    opt = build_optimizer("flexdemo-async", model, None, lr=LR, lookahead=True)
    for step in range(1, 3):
        _set_grads(model, step, rank)
        opt.step()
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    resumed = _model(seed=123)
    resumed.load_state_dict(saved_model)
    opt2 = build_optimizer("flexdemo-async", resumed, None, lr=LR, lookahead=True)
    opt2.load_state_dict(saved_opt)
    for m, o in ((model, opt), (resumed, opt2)):
        for step in range(3, 5):
            _set_grads(m, step, rank)
            o.step()
        o.drain()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters(),
                                                 strict=True))


def _two_ranks(rank: int, world: int) -> None:
    _check_delayed_update_is_last_steps_synchronous_one(rank, world)
    _check_optimizer_keeps_replicas_equal_and_resumes(rank, world)
    _check_lookahead_is_the_synchronous_path_plus_its_own_step(rank, world)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_delayed_demo_on_two_ranks():
    run_ranks(_two_ranks, 2)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_run_trace_waits_each_all_gather_in_the_next_step(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "--method", "flexdemo-async", "--nodes", "2", "--gpus-per-node", "1",
                 "--steps", "3", "--workload", "lm-tiny", "--out", str(out)]) == 0
    assert json.loads((out / "run.json").read_text())["config"]["delay"] == 1
    trace = pd.read_parquet(out / "trace.parquet")
    for rank, rows in trace.groupby("rank"):
        spans = rows[rows["kind"] == "step"].set_index("step")
        gathers = rows[(rows["kind"] == "collective") & rows["inter"]
                       & (rows["op"] == "all_gather") & (rows["phase"] == "train")]
        assert sorted(gathers["step"]) == [1, 2, 3], rank
        for _, op in gathers.iterrows():
            step = op["step"]
            assert spans.loc[step, "start_s"] <= op["start_s"] <= spans.loc[step, "end_s"]
            assert op["end_s"] >= op["wait_s"] > spans.loc[step, "end_s"]  # not in its own step
            if step < 3:
                assert op["wait_s"] <= spans.loc[step + 1, "end_s"]  # ... but in the next
            # The last one is drained after the loop (its wait follows the last step's end).
    steps = pd.read_parquet(out / "steps.parquet")
    assert steps["inter_calls"].tolist() == [1, 1, 1]
    # The overlapped issue-to-wait time is not communication time: compute is left over.
    assert (steps["compute_s"] > 0).all(), steps[["comm_s", "compute_s"]]
    # The model carries each exchange into the step that waits for it (CARRY_NOTE): at
    # 200 kbit/s a step then takes about one transfer, not compute plus transfer (a link that
    # slow keeps the transfer above twice the compute even on a loaded machine).
    capsys.readouterr()
    assert main(["simulate", str(out), "--inter-bw", "200kbit", "--inter-lat", "0ms", "--out",
                 str(tmp_path / "sim.csv")]) == 0
    said = capsys.readouterr()
    assert "waited on after their step" in said.out + said.err
    replayed = pd.read_csv(tmp_path / "sim.csv")
    transfer = gathers["bytes"].iloc[0] * 8 / 200e3  # one exchange over 200 kbit/s (2 x 1)
    compute = steps["compute_s"].median()
    assert transfer > 2 * compute  # the link, not compute, sets the step
    assert replayed["step_time_s"].iloc[-1] < transfer + compute / 2


def test_lookahead_needs_delay_one_and_the_sign_step():
    with pytest.raises(ValueError, match=r"^lookahead=true needs delay=1 .*\.$"):
        DeMoKnobs(lookahead=True)
    with pytest.raises(ValueError, match=r"^lookahead=true needs the sign step .*\.$"):
        build_optimizer("flexdemo-async", _model(), None, lookahead=True, base="adamw",
                        sign=False)


def test_delay_other_than_zero_or_one_is_one_sentence():
    for bad in (2, -1, True, 0.5):
        with pytest.raises(ValueError, match=r"^delay=.* must be 0 .* or 1 .*\.$") as err:
            DeMoKnobs(delay=bad)
        assert str(err.value).count(". ") == 0
    assert DeMoKnobs().delay == 0 and method_record("flexdemo").knobs.delay == 0


def test_flexdemo_async_is_flexdemo_with_delay_one_listed_after_it():
    assert METHODS.index("flexdemo-async") == METHODS.index("flexdemo") + 1
    assert method_record("flexdemo-async").knobs == dataclasses.replace(
        method_record("flexdemo").knobs, delay=1, lookahead=True)


def test_run_with_delay_two_exits_2_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "--method", "flexdemo-async", "--delay", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "delay=2" in err, err
    assert list(tmp_path.iterdir()) == []


def test_comm_per_step_counts_an_op_waited_in_the_next_step_there():
    from netsim import Topology, TraceRecorder
    from netsim.trace import comm_per_step

    clock = iter([0.0, 1.0, 1.0, 2.0])  # begin/end of step 1, then of step 2
    rec = TraceRecorder(0, Topology.from_strings(2, 1), clock=lambda: next(clock))
    rec.begin_step(1)
    sync = rec.record_collective("all_reduce", [0, 1], True, "ring", 8, 8, 8, 0.1)
    rec.complete(sync, 0.1, 0.3)  # waited on at once: issue to return counts, as before
    late = rec.record_collective("all_gather", [0, 1], True, "ring", 10, 10, 10, 0.9)
    rec.end_step(1)
    rec.begin_step(2)
    rec.complete(late, 1.5, 1.7)  # waited on in step 2: only its 0.2 s blocked there
    drained = rec.record_collective("all_gather", [0, 1], True, "ring", 10, 10, 10, 1.9)
    rec.end_step(2)
    rec.complete(drained, 2.5, 2.6)  # drained after the last step: no step's time
    per_step = comm_per_step(rec.frame())
    assert per_step["comm_s"].tolist() == pytest.approx([0.2, 0.2])
    assert per_step["inter_calls"].tolist() == [2, 1]  # calls and bytes stay where issued
    assert per_step["inter_bytes_sent"].tolist() == [18.0, 10.0]
