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


def test_beta1_sets_the_adamw_base_first_moment_decay():
    # One replica, beta1 0: each step is torch's AdamW with betas (0, 0.999) on the raw gradient.
    flex, plain, default = _model(), _model(), _model()
    opt = build_optimizer("flexdemo-adamw", flex, None, lr=LR, beta1=0.0)
    assert opt.base.betas == (0.0, 0.999)
    ref = torch.optim.AdamW(plain.parameters(), lr=LR, betas=(0.0, 0.999))
    ref_default = torch.optim.AdamW(default.parameters(), lr=LR)  # beta1 0.9
    for step in range(4):
        for model, optimizer in ((flex, opt), (plain, ref), (default, ref_default)):
            _backward(model, step)
            optimizer.step()
    # Without beta1's averaging, the DCT round trip's rounding (relative to a chunk's largest
    # gradient) reaches a small coordinate's step directly: about 0.4% of lr per step here.
    for a, b in zip(flex.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0.0, atol=0.02 * LR)
    far = max((a - c).abs().max().item() for a, c in zip(flex.parameters(),
                                                          default.parameters(), strict=True))
    assert far > 1.0 * LR  # beta1 0.9 would have moved elsewhere


@pytest.mark.parametrize(("knobs", "words"), [
    ({"beta1": 1.0}, "beta1=1.0 must lie in [0, 1)"),
    ({"beta1": 0.0, "base": "sign"}, "sign base keeps no moments"),
])
def test_bad_beta1_is_refused_in_one_sentence(knobs: dict, words: str):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace(")", r"\)")):
        method_record("flexdemo-adamw").settings(knobs)


def test_beta1_on_a_method_whose_default_base_is_sign_is_refused():
    # flexdemo's base is its replicator's (sign): only the optimizer's builder knows it.
    with pytest.raises(ValueError, match="steps with base 'sign'"):
        build_optimizer("flexdemo", _model(), None, beta1=0.0)
    opt = build_optimizer("flexdemo", _model(), None, base="adamw", sign=False, beta1=0.5)
    assert opt.base.betas == (0.5, 0.999)


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
