"""powersgd against PyTorch's own DDP hook (``powerSGD_hook``), its sizing and its knobs."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    powerSGD_hook,
)
from torch.nn.parallel import DistributedDataParallel

from experiments.cli import main
from experiments.config import RunConfig
from experiments.run.launch import launch
from flexdemo import FlexDeMo, method_record
from flexdemo.knobs import PowerSGDKnobs
from flexdemo.replicators import FullReplicator, PowerSGDReplicator
from flexdemo.replicators.powersgd import HookSeeds, orthonormalize, plan_powersgd
from tests.dist_utils import fsdp2_shards, run_ranks
from tests.experiments.plan_anchor import assert_plan_holds, plan_of_run

LR, WD, STEPS, START, SEED = 1e-2, 0.01, 20, 2, 7


def _model() -> nn.Module:
    # Two 40 x 40 weights (drawn one after the other, as the hook groups equal shapes), a
    # 40 x 24 one, a 6 x 40 head (compressed at rank 2, whole at 4) and 1-D biases.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40), nn.Tanh(), nn.Linear(40, 40), nn.Tanh(),
                         nn.Linear(40, 40), nn.Tanh(), nn.Linear(40, 6))


def _train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, comm: list | None = None,
           steps: range = range(1, STEPS + 1)) -> dict:
    """``steps`` on this rank's data; the parameters by name (a DDP wrapper's, unwrapped)."""
    for step in steps:
        g = torch.Generator().manual_seed(1000 * step + rank)  # every rank its own data
        x, y = torch.randn(8, 24, generator=g), torch.randn(8, 6, generator=g)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if comm is not None:
            comm.append(opt.last_step_comm)
    inner = getattr(model, "module", model)
    return {n: p.detach().clone() for n, p in inner.named_parameters()}


def _with_the_hook(rank: int, knobs: PowerSGDKnobs) -> tuple[dict, list[str]]:
    """DDP + PyTorch's powerSGD_hook + torch's AdamW: the parameters, and the bucket's order."""
    model = _model()
    names = {id(p): n for n, p in model.named_parameters()}
    ddp = DistributedDataParallel(model)
    state = PowerSGDState(None, matrix_approximation_rank=knobs.powersgd_rank,
                          start_powerSGD_iter=knobs.powersgd_start,
                          min_compression_rate=knobs.min_compression_rate,
                          use_error_feedback=knobs.error_feedback, warm_start=knobs.warm_start,
                          random_seed=knobs.seed)
    order: list[str] = []

    def hook(st: PowerSGDState, bucket):  # DDP refuses a return annotation other than its own
        # The model is far below DDP's first bucket cap: one bucket holds every gradient.
        assert bucket.index() == 0 and bucket.is_last()
        order[:] = [names[id(p)] for p in bucket.parameters()]
        return powerSGD_hook(st, bucket)

    ddp.register_comm_hook(state, hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=WD)
    return _train(ddp, opt, rank), order


def _ours(rank: int, order: list[str], replicator, comm: list | None = None) -> dict:
    """FlexDeMo with ``replicator`` and its AdamW base over the parameters in ``order``."""
    model = _model()
    named = dict(model.named_parameters())
    opt = FlexDeMo([named[n] for n in order], lr=LR, weight_decay=WD, replicator=replicator,
                   base="adamw", sign=False)
    return _train(model, opt, rank, comm)


def _resumed(rank: int, order: list[str], knobs: PowerSGDKnobs) -> dict:
    """Half the steps, the state saved, then the rest on a fresh model and optimizer."""
    def build():
        model = _model()
        named = dict(model.named_parameters())
        return model, FlexDeMo([named[n] for n in order], lr=LR, weight_decay=WD,
                               replicator=PowerSGDReplicator(knobs), base="adamw", sign=False)

    first, opt = build()
    _train(first, opt, rank, steps=range(1, STEPS // 2 + 1))
    second, resumed = build()
    second.load_state_dict(first.state_dict())
    resumed.load_state_dict(opt.state_dict())
    return _train(second, resumed, rank, steps=range(STEPS // 2 + 1, STEPS + 1))


def _relative(a: dict, b: dict) -> float:
    return max(((a[n] - b[n]).norm() / b[n].norm()).item() for n in b)


def _closed_form_bytes(shapes: list[tuple[int, ...]], rank: int, step: int, start: int = START,
                       rate: float = 2.0) -> int:
    """docs/methods.md's bytes per rank and step on 2 nodes (a ring all-reduce over 2 ranks
    sends each payload once): every shard whole up to the start, then 4 (n + m) r for each
    n x m matrix worth compressing ((n + m) r rate < n m) and 4 numel for the rest."""
    if step <= start:
        return sum(4 * math.prod(s) for s in shapes)
    total = 0
    for shape in shapes:
        n, m = shape[0], math.prod(shape[1:])
        r = min(n, m, rank)
        total += 4 * (n + m) * r if len(shape) > 1 and (n + m) * r * rate < n * m \
            else 4 * n * m
    return total


CASES = [PowerSGDKnobs(powersgd_rank=r, powersgd_start=START, seed=SEED) for r in (2, 4)]
# Gram-Schmidt at rank 2, QR at 4; fresh random Qs every step without warm start.
CASES.append(PowerSGDKnobs(powersgd_rank=2, powersgd_start=START, seed=SEED, warm_start=False,
                           error_feedback=False))


def _against_the_hook(rank: int, world: int) -> None:
    exact = None
    for knobs in CASES:
        theirs, order = _with_the_hook(rank, knobs)
        comm: list = []
        ours = _ours(rank, order, PowerSGDReplicator(knobs), comm)
        assert _relative(ours, theirs) < 1e-5, knobs
        # What the comparison would catch: the exact mean under the same AdamW is far away.
        exact = exact or _ours(rank, order, FullReplicator())
        assert _relative(exact, theirs) > 1e-2, knobs
        shapes = [tuple(dict(_model().named_parameters())[n].shape) for n in order]
        for step, stats in enumerate(comm, start=1):
            want = _closed_form_bytes(shapes, knobs.powersgd_rank, step)
            assert stats["bytes_sent"] == stats["bytes_received"] == want, (knobs, step)
            assert stats["calls"] == (1 if step <= START else 3), (knobs, step)
        # A resumed run goes on with the errors, Qs and seeds it left (no fresh draw).
        assert all(torch.equal(a, ours[n]) for n, a in _resumed(rank, order, knobs).items())


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_equals_ddp_with_pytorchs_powersgd_hook_and_sends_its_closed_form():
    run_ranks(_against_the_hook, 2)


def test_the_seeds_of_the_random_qs_are_numpys_as_the_hook_draws_them():
    for seed in (0, 7, 2**32 - 1):
        numpy_rng = np.random.RandomState(seed)
        ours = HookSeeds(seed)
        assert [ours.next() for _ in range(40)] == [numpy_rng.randint(1_000_000_000)
                                                   for _ in range(40)]
    fresh = HookSeeds(7)
    assert HookSeeds(7, drawn=3).next() == [fresh.next() for _ in range(4)][-1]


@pytest.mark.parametrize("rank", [1, 2, 5])
def test_orthonormalize_gives_orthonormal_columns_and_keeps_a_zero_column_zero(rank):
    m = torch.randn(9, rank, generator=torch.Generator().manual_seed(rank))
    orthonormalize(m)
    assert torch.allclose(m.T @ m, torch.eye(rank), atol=1e-6)
    zero = torch.zeros(6, 2)
    orthonormalize(zero)
    assert torch.equal(zero, torch.zeros(6, 2))


def test_the_plan_compresses_what_the_hook_compresses_grouped_by_shape():
    shapes = [(40, 24), (40,), (40, 40), (6, 40), (40, 40), (), (0, 9), (4, 3, 8)]
    plan = plan_powersgd(shapes, PowerSGDKnobs(powersgd_rank=2))
    # (6, 40): (46) * 2 * 2 = 184 < 240; (4, 24) at rank 2: 112 > 96; 1-D, 0-D, empty: whole.
    assert plan.compressed == ((0, 40, 24, 2), (2, 40, 40, 2), (4, 40, 40, 2), (3, 6, 40, 2))
    assert plan.whole == (1, 5, 6, 7)
    assert (plan.whole_numel, plan.p_numel, plan.q_numel) == (40 + 1 + 0 + 96,
                                                               2 * (40 + 40 + 40 + 6),
                                                               2 * (24 + 40 + 40 + 40))
    assert plan.payloads(10) == [("all_reduce", 4 * sum(int(np.prod(s)) for s in shapes))]
    assert plan.payloads(11) == [("all_reduce", 4 * 137), ("all_reduce", 4 * 252),
                                 ("all_reduce", 4 * 288)]
    # Ring all-reduce over 4 replicas: each rank sends 2 (N - 1) / N of each payload.
    assert plan.step_bytes(11, 4) == (4 * 137 * 6) // 4 + (4 * 252 * 6) // 4 + (4 * 288 * 6) // 4
    assert plan_powersgd(shapes, PowerSGDKnobs(min_compression_rate=100)).compressed == ()


@pytest.mark.parametrize(("knobs", "words"), [
    ({"powersgd_rank": 0}, "powersgd_rank=0 must be a positive integer."),
    ({"powersgd_rank": -2}, "powersgd_rank=-2 must be a positive integer."),
    ({"powersgd_rank": 2.5}, "powersgd_rank=2.5 must be a positive integer."),
    ({"powersgd_start": -1}, "powersgd_start=-1 must be an integer >= 0."),
    ({"min_compression_rate": 0.5}, "min_compression_rate=0.5 must be a finite number >= 1 "
                                    "(the compressed size at most the tensor's)."),
    ({"warm_start": "yes"}, "warm_start='yes' must be true or false."),
])
def test_an_impossible_knob_is_one_sentence_from_the_schema(knobs, words):
    for make in (lambda: PowerSGDKnobs(**knobs), lambda: PowerSGDReplicator(**knobs),
                 lambda: method_record("powersgd").settings(knobs)):
        with pytest.raises(ValueError) as err:
            make()
        assert str(err.value) == words


@pytest.mark.parametrize(("argv", "words"), [
    (["--set", "powersgd_rank=0"], "powersgd_rank=0 must be a positive integer."),
    (["--powersgd-rank", "1.5"], "argument --powersgd-rank: must be an integer >= 1, got '1.5'."),
])
def test_a_bad_rank_on_the_command_line_exits_2_and_writes_nothing(tmp_path, capsys, argv,
                                                                    words):
    out = tmp_path / "run"
    assert main(["run", "--method", "powersgd", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(words) and err.count("\n") == 0, err
    assert not out.exists()


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_trains_lm_tiny_on_2x2_with_the_loss_falling_and_sends_its_closed_form(tmp_path):
    cfg = RunConfig(method="powersgd", workload="lm-tiny", nodes=2, gpus_per_node=2, steps=12,
                    batch_size=4, eval_every=1000, powersgd_start=4)
    out = launch(cfg, tmp_path / "run", timeout_s=240, quiet=True)
    steps = pd.read_parquet(out / "steps.parquet")
    loss = steps["loss"].tolist()
    assert sum(loss[-3:]) < sum(loss[:3]) - 1.5, loss  # 5.6 at the start
    layout = json.loads((out / "run.json").read_text())["layout"]
    rank = method_record("powersgd").knobs.powersgd_rank
    for step, sent in zip(steps["step"], steps["inter_bytes_sent"], strict=True):
        # netsim's count of the tensors sent, per node: the node's two ranks' shards.
        want = sum(_closed_form_bytes(fsdp2_shards(layout, 2, i), rank, step, start=4)
                   for i in range(2))
        assert sent == want, step
    assert steps["inter_calls"].tolist() == [1] * 4 + [3] * 8
    # Its plan: the method's program at the run's shape holds every step's collectives
    # (whole, then P and Q), rank by rank.
    assert assert_plan_holds(*plan_of_run(out)) == 12 * 4
