"""topk-ef against Deep Gradient Compression written out densely, its sizing and its knobs."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch
import torch.distributed as dist
from torch import nn

from experiments.cli import main
from experiments.config import RunConfig
from experiments.run.launch import launch
from flexdemo import FlexDeMo, method_record
from flexdemo.knobs import TopKKnobs
from flexdemo.replicators import TopKReplicator
from flexdemo.replicators.topk import plan_topk, topk_count
from tests.dist_utils import fsdp2_shards, run_ranks
from tests.experiments.plan_anchor import assert_plan_holds, plan_of_run

LR, STEPS, DENSITY, DECAY = 0.05, 12, 0.05, 0.9


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 30), nn.Tanh(), nn.Linear(30, 5))


def _grads(model: nn.Module, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)  # every rank its own data
    x, y = torch.randn(8, 20, generator=g), torch.randn(8, 5, generator=g)
    nn.functional.mse_loss(model(x), y).backward()


def _dgc(rank: int, world: int) -> dict:
    """The paper's algorithm with momentum correction and factor masking, dense and per tensor:
    u = m u + g, v = v + u, the top-k of |v| sent and zeroed in u and v, the sum of every
    replica's sparse v (all-gathered dense) over the replicas, w -= lr * that."""
    model = _model()
    params = list(model.parameters())
    u = [torch.zeros(p.numel()) for p in params]
    v = [torch.zeros(p.numel()) for p in params]
    for step in range(1, STEPS + 1):
        _grads(model, rank, step)
        with torch.no_grad():
            for p, ui, vi in zip(params, u, v, strict=True):
                ui.mul_(DECAY).add_(p.grad.reshape(-1))
                vi.add_(ui)
                sent = torch.topk(vi.abs(), math.ceil(DENSITY * p.numel())).indices
                sparse = torch.zeros_like(vi)
                sparse[sent] = vi[sent]
                vi[sent] = 0.0
                ui[sent] = 0.0
                every = [torch.zeros_like(sparse) for _ in range(world)]
                dist.all_gather(every, sparse)
                p -= LR * (sum(every) / world).view_as(p)
        model.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _closed_form_bucket(shapes: list[tuple[int, ...]], density: float = DENSITY) -> int:
    """docs/methods.md's bucket in fp32-packed: per tensor k = ceil(density numel) fp32 values
    and k indices of ceil(log2(numel)) bits in whole groups of 8, the sum padded to 4 bytes."""
    total = 0
    for shape in shapes:
        numel = math.prod(shape)
        k = math.ceil(density * numel)
        total += 4 * k + math.ceil(k / 8) * math.ceil(math.log2(numel))
    return -(-total // 4) * 4


def _against_dgc(rank: int, world: int) -> None:
    want = _dgc(rank, world)
    for value_format in ("fp32-packed", "fp32"):
        model = _model()
        rep = TopKReplicator(density=DENSITY, decay=DECAY, value_format=value_format)
        opt = FlexDeMo(model.parameters(), lr=LR, replicator=rep)  # its SGD step by default
        for step in range(1, STEPS + 1):
            _grads(model, rank, step)
            opt.step()
            opt.zero_grad()
            if value_format == "fp32-packed":
                bucket = _closed_form_bucket([tuple(p.shape) for p in model.parameters()])
                sent = (world - 1) * bucket  # a ring all-gather: every other rank's bucket
                assert opt.last_step_comm == {"bytes_sent": sent, "bytes_received": sent,
                                              "calls": 1}, step
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), want[name], rtol=1e-6, atol=1e-7)
    # What the comparison would catch: the dense reference moved away from the start.
    start = dict(_model().named_parameters())
    assert all((want[n] - start[n]).abs().max() > 1e-3 for n in want)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_equals_deep_gradient_compression_written_out_and_sends_its_closed_form():
    run_ranks(_against_dgc, 2)


def test_the_bucket_holds_ceil_density_numel_entries_of_every_shard():
    assert [topk_count(0.07, 100), topk_count(0.01, 64), topk_count(1.0, 9),
            topk_count(0.5, 0)] == [7, 1, 9, 0]
    shapes = [(300, 400), (400,), (0, 7), (3,)]
    plan = plan_topk(shapes, TopKKnobs(density=0.01, value_format="fp32-packed"))
    assert plan.members == ((0, 120000, 1200), (1, 400, 4), (3, 3, 1))
    # 120000 entries need 17-bit indices; 400 need 9; 3 need 2.
    assert plan.bucket_bytes == -(-(4 * 1200 + 150 * 17 + 4 * 4 + 1 * 9 + 4 * 1 + 1 * 2) // 4) * 4
    assert plan.step_bytes(4) == 3 * plan.bucket_bytes
    bf16 = plan_topk(shapes, TopKKnobs(density=0.01, value_format="bf16"))
    # int32 indices above 65536 entries, int16 below.
    assert bf16.bucket_bytes == 2 * 1200 + 4 * 1200 + 2 * 4 + 2 * 4 + 2 * 1 + 2 * 1


def test_what_the_format_rounds_stays_in_the_velocity_and_sent_momentum_is_masked():
    torch.manual_seed(0)
    model = nn.Linear(16, 8, bias=False)
    rep = TopKReplicator(density=0.25, decay=0.5, value_format="int8")
    opt = FlexDeMo(model.parameters(), lr=0.1, replicator=rep)  # one replica: no group
    model(torch.randn(4, 16)).pow(2).sum().backward()
    grad = model.weight.grad.clone().reshape(-1)
    before = model.weight.detach().clone()
    opt.step()
    update = (before - model.weight.detach()).reshape(-1) / 0.1
    sent = torch.zeros(128, dtype=torch.bool)
    sent[grad.abs().topk(32).indices] = True
    assert torch.equal(update[~sent], torch.zeros(96))
    # v = u = grad at the first step: v keeps grad - what int8 read, u is zero where sent.
    torch.testing.assert_close(rep.v[0][sent] + update[sent], grad[sent])
    assert rep.v[0][sent].abs().max() > 0 and torch.equal(rep.u[0][sent], torch.zeros(32))
    assert torch.equal(rep.v[0][~sent], grad[~sent]) and torch.equal(rep.u[0][~sent], grad[~sent])


@pytest.mark.parametrize(("density", "words"), [
    (0, "density=0 must lie in (0, 1]."),
    (-0.1, "density=-0.1 must lie in (0, 1]."),
    (1.5, "density=1.5 must lie in (0, 1]."),
    ("0.1", "density='0.1' must lie in (0, 1]."),
])
def test_an_impossible_density_is_one_sentence_from_the_schema(density, words):
    for make in (lambda: TopKKnobs(density=density), lambda: TopKReplicator(density=density),
                 lambda: method_record("topk-ef").settings({"density": density})):
        with pytest.raises(ValueError) as err:
            make()
        assert str(err.value) == words


@pytest.mark.parametrize(("argv", "words"), [
    (["--set", "density=1.5"], "density=1.5 must lie in (0, 1]."),
    (["--density", "0"], "argument --density: must be a number in (0, 1], got '0'."),
])
def test_a_bad_density_on_the_command_line_exits_2_and_writes_nothing(tmp_path, capsys, argv,
                                                                      words):
    out = tmp_path / "run"
    assert main(["run", "--method", "topk-ef", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(words) and err.count("\n") == 0, err
    assert not out.exists()


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_trains_lm_tiny_on_2x2_with_the_loss_falling_and_sends_its_closed_form(tmp_path):
    cfg = RunConfig(method="topk-ef", workload="lm-tiny", nodes=2, gpus_per_node=2, steps=12,
                    batch_size=4, eval_every=1000)
    out = launch(cfg, tmp_path / "run", timeout_s=240, quiet=True)
    steps = pd.read_parquet(out / "steps.parquet")
    loss = steps["loss"].tolist()
    assert sum(loss[-3:]) < sum(loss[:3]) - 1.5, loss  # 5.6 at the start
    layout = json.loads((out / "run.json").read_text())["layout"]
    assert method_record("topk-ef").knobs.density == 0.01
    # netsim's count of the tensors sent, per node: on 2 nodes each rank sends its bucket once.
    want = sum(_closed_form_bucket(fsdp2_shards(layout, 2, i), 0.01) for i in range(2))
    assert steps["inter_bytes_sent"].tolist() == [want] * 12
    assert steps["inter_calls"].tolist() == [1] * 12
    # Its plan: the method's program at the run's shape holds every step's all-gather.
    assert assert_plan_holds(*plan_of_run(out)) == 12 * 4
