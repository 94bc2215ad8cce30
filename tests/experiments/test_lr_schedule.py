"""The learning-rate schedule (schedule, warmup, warmup_steps): the lr at every step, for every
method, shared by a sweep's methods unless one says otherwise, and its bad input refused."""

from __future__ import annotations

import math

import pytest

from experiments import cli
from experiments.config import METHODS, RunConfig
from experiments.errors import ConfigError
from experiments.run.schedule import lr_factor, warmup_count
from experiments.sweep.plan import load_config, units_of

TOTAL, WARM = 20, 5


def _warm_up(step: int) -> float:
    return (step + 1) / WARM


def _cosine(step: int) -> float:
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * (step - WARM) / (TOTAL - WARM)))


CLOSED_FORMS = {
    "constant": lambda s: 1.0,
    "warmup": lambda s: _warm_up(s) if s < WARM else 1.0,
    "cosine": lambda s: _warm_up(s) if s < WARM else _cosine(s),
}


@pytest.mark.parametrize("schedule", sorted(CLOSED_FORMS))
def test_the_lr_factor_at_every_step_is_the_closed_form(schedule: str) -> None:
    got = [lr_factor(s, TOTAL, schedule, WARM) for s in range(TOTAL)]
    assert got == pytest.approx([CLOSED_FORMS[schedule](s) for s in range(TOTAL)], abs=1e-12)


def test_cosine_warms_up_to_the_full_lr_and_ends_at_a_tenth() -> None:
    got = [lr_factor(s, TOTAL, "cosine", WARM) for s in range(TOTAL)]
    assert got[:WARM] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert got[WARM] == 1.0 and got[-1] == pytest.approx(0.1 + 0.45 * (1 + math.cos(
        math.pi * 14 / 15)))
    assert all(a >= b for a, b in zip(got[WARM:], got[WARM + 1:], strict=False))


def test_warmup_steps_override_the_fraction_and_zero_means_none() -> None:
    assert warmup_count(TOTAL, 0.05, None) == 1  # round(0.05 * 20) = 1
    assert warmup_count(100, 0.1, None) == 10
    assert warmup_count(100, 0.05, 30) == 30
    assert warmup_count(100, 0.05, 0) == warmup_count(100, 0.05, 1) == 1
    assert lr_factor(0, TOTAL, "cosine", warmup_count(TOTAL, 0.05, 0)) == 1.0


def test_the_training_loop_sets_the_scheduled_lr_of_every_method_before_each_step() -> None:
    torch = pytest.importorskip("torch")
    import flexdemo
    from experiments.run.train import lr_scheduler

    cfg = RunConfig(steps=TOTAL, schedule="cosine", warmup_steps=WARM, lr=1e-3).validate()
    for method in METHODS:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        # hsdp-adamw is torch's AdamW itself (it only needs a mesh for FSDP2's all-reduce).
        opt = (torch.optim.AdamW(model.parameters(), lr=cfg.lr) if method == "hsdp-adamw"
               else flexdemo.build_optimizer(method, model, None, lr=cfg.lr))
        sched = lr_scheduler(opt, cfg)
        for step in range(TOTAL):
            want = 1e-3 * CLOSED_FORMS["cosine"](step)
            assert [g["lr"] for g in opt.param_groups] == pytest.approx([want]), (method, step)
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()


def test_a_sign_step_moves_each_entry_by_the_scheduled_lr() -> None:
    # FlexDeMo reads its step's lr from the parameter group: one replica's sign step is lr.
    torch = pytest.importorskip("torch")
    import flexdemo
    from experiments.run.train import lr_scheduler

    cfg = RunConfig(steps=TOTAL, schedule="warmup", warmup_steps=WARM, lr=1e-2).validate()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = flexdemo.build_optimizer("flexdemo", model, None, lr=cfg.lr)
    sched = lr_scheduler(opt, cfg)
    for step in range(WARM + 2):
        before = model.weight.detach().clone()
        model(torch.randn(2, 4)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        moved = (model.weight.detach() - before).abs()
        assert moved.max().item() == pytest.approx(1e-2 * CLOSED_FORMS["warmup"](step), rel=1e-5)


@pytest.mark.parametrize(("settings", "said"), [
    ({"schedule": "linear"}, "unknown schedule 'linear'; choose one of constant, warmup, cosine."),
    ({"schedule": "cosine", "warmup_steps": -1}, "warmup_steps must be an integer >= 0"),
    ({"schedule": "cosine", "warmup": 0.1, "warmup_steps": 3}, "give one of them"),
    ({"schedule": "cosine", "steps": 10, "warmup_steps": 10}, "must be below steps=10"),
])
def test_bad_schedule_settings_are_one_sentence(settings: dict, said: str) -> None:
    with pytest.raises(ConfigError) as err:
        RunConfig(**settings).validate()
    assert said in str(err.value) and "\n" not in str(err.value)


@pytest.mark.timeout(60)
def test_an_unknown_schedule_on_the_command_line_exits_2_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["run", "--schedule", "linear", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown schedule 'linear'" in err, err
    assert list(tmp_path.iterdir()) == []


SWEEP = """
name = "sched"
[run]
workload = "lm-tiny"
steps = 20
schedule = "cosine"
warmup_steps = 4
[grid]
methods = ["hsdp-adamw", "flexdemo", "flexdemo-adamw", "diloco"]
inter_bw = ["1Gbit"]
inter_lat = ["1ms"]
seeds = [0]
{rest}
"""


def test_a_sweep_schedule_applies_to_every_method_unless_one_says_otherwise(tmp_path) -> None:
    path = tmp_path / "sweep.toml"
    path.write_text(SWEEP.format(rest='[grid.knobs.diloco]\nschedule = "constant"'))
    units = {u.method: u.config for u in units_of(load_config(path))}
    assert set(units) == {"hsdp-adamw", "flexdemo", "flexdemo-adamw", "diloco"}
    for method in ("hsdp-adamw", "flexdemo", "flexdemo-adamw"):
        assert (units[method].schedule, units[method].warmup_steps) == ("cosine", 4), method
    assert units["diloco"].schedule == "constant"


@pytest.mark.parametrize("rest", ["", '[grid.knobs.flexdemo]\nschedule = "linear"'])
@pytest.mark.timeout(60)
def test_an_unknown_schedule_in_a_sweep_exits_2_and_writes_nothing(tmp_path, capsys, rest):
    path = tmp_path / "sweep.toml"
    text = SWEEP.format(rest=rest)
    path.write_text(text if rest else text.replace('"cosine"', '"linear"'))
    out = tmp_path / "res"
    assert cli.main(["sweep", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown schedule 'linear'" in err, err
    assert not out.exists()
    with pytest.raises(ConfigError, match="unknown schedule 'linear'"):
        load_config(path)
