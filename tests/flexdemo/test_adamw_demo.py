"""flexdemo-adamw: DeMo replication under an AdamW step (the decoded mean as its gradient)."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch

from experiments.cli import main
from flexdemo import METHODS, build_optimizer, method_record
from flexdemo.bases import AdamWBase

LR = 1e-3


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 3))


def _backward(model: torch.nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(5, 8, generator=gen), torch.randn(5, 3, generator=gen)
    model.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()


def test_flexdemo_adamw_is_flexdemo_with_an_adamw_base_and_no_sign():
    assert METHODS.index("flexdemo-adamw") == METHODS.index("flexdemo-async") + 1
    record = method_record("flexdemo-adamw")
    assert record.knobs == method_record("flexdemo").knobs
    values = record.resolved({})
    assert (values["base"], values["sign"]) == ("adamw", False)
    # A run's own base and sign still win over the method's defaults.
    assert record.resolved({"sign": True})["sign"] is True
    assert method_record("flexdemo").resolved({})["base"] is None  # the replicator's: sign


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_on_one_rank_its_step_is_adamw_fed_the_decoded_update(weight_decay: float):
    # One replica: DeMo's decoded update is the whole momentum, lr * grad (cleared each step),
    # so with lr divided out (AdamWBase.apply) each step is torch's AdamW on the raw gradient.
    flex, plain = _model(), _model()
    opt = build_optimizer("flexdemo-adamw", flex, None, lr=LR, weight_decay=weight_decay)
    assert isinstance(opt.base, AdamWBase) and opt.sign is False
    ref = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=weight_decay)
    for step in range(4):
        for model, optimizer in ((flex, opt), (plain, ref)):
            _backward(model, step)
            optimizer.step()
        for a, b in zip(flex.parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_adamw_base_takes_an_lr_carrying_update_in_gradient_units():
    shard = torch.zeros(4)
    grad = torch.tensor([1e-3, -2e-4, 5e-5, 0.0])
    carried, plain = AdamWBase([shard], (0.9, 0.999), 1e-8), AdamWBase([shard], (0.9, 0.999), 1e-8)
    a, b = shard.clone(), shard.clone()
    carried.apply([a], [LR * grad], [LR], [0.0], carries_lr=True)
    plain.apply([b], [grad.clone()], [LR], [0.0])
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(carried.exp_avg[0], plain.exp_avg[0])


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_flexbench_run_trains_flexdemo_adamw_on_a_schedule(tmp_path):
    out = tmp_path / "run"
    assert main(["run", "--method", "flexdemo-adamw", "--nodes", "2", "--gpus-per-node", "1",
                 "--steps", "4", "--workload", "lm-tiny", "--schedule", "cosine",
                 "--warmup-steps", "2", "--out", str(out)]) == 0
    config = json.loads((out / "run.json").read_text())["config"]
    assert (config["base"], config["sign"], config["warmup_steps"]) == ("adamw", False, 2)
    steps = pd.read_parquet(out / "steps.parquet")
    assert all(math.isfinite(x) for x in steps["loss"]) and (steps["inter_calls"] == 1).all()
