"""One rule for user code: a factory (plan's model, run's and sweep's workload) runs under the
command's --timeout, and anything escaping it but an interrupt, `sys.exit` included, is the
factory's failure, named with the user's file and line: exit 2, nothing written. A factory that
never returns is stopped at the timeout in one sentence (exit 1, as `flexbench run`'s timeout).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from experiments import cli
from experiments.deadline import run_deadline, users_call
from experiments.errors import ConfigError

PLAN = ["--method", "hsdp-adamw", "--nodes", "2", "--gpus-per-node", "1", "--step-compute", "0.1",
        "--inter-bw", "1Gbit", "--inter-lat", "1ms"]

FACTORIES = textwrap.dedent('''
    import sys
    import time

    from torch import nn


    def exits_zero():
        sys.exit(0)


    def exits_three():
        raise SystemExit(3)


    def raises():
        return nn.Linear(2, 2) + 1


    def sleeps():
        time.sleep(3600)


    def spins():
        x = 0
        while True:
            x += 1


    def swallows():
        while True:
            try:
                time.sleep(3600)
            except Exception:
                pass


    class _Workload:
        default_steps = default_batch_size = default_eval_every = 1

        def model(self):
            sys.exit(0)  # in model()

        batch = val_batches = loss = model


    def workload_exits_in_model():
        return _Workload()
''')


@pytest.fixture
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request) -> tuple[str, Path]:
    """A module of factories of its own name (imports are cached per name), on sys.path."""
    name = f"user_factories_{abs(hash(request.node.nodeid)) % 10**8}"
    path = tmp_path / "code" / f"{name}.py"
    path.parent.mkdir()
    path.write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(path.parent))
    return name, path


def _line(path: Path, text: str) -> int:
    return 1 + next(i for i, line in enumerate(path.read_text().splitlines()) if text in line)


def _body(path: Path, function: str) -> range:
    """The lines of `function`'s body in `path`."""
    lines = path.read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(f"def {function}("))
    last = next((i for i in range(first + 1, len(lines))
                 if lines[i].startswith(("def ", "class "))), len(lines))
    return range(first + 2, last + 1)


def _one_line(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(("factory", "said", "text"), [
    ("exits_zero", "the factory called sys.exit(0)", "sys.exit(0)"),
    ("exits_three", "the factory called sys.exit(3)", "raise SystemExit(3)"),
    ("raises", "the factory raised TypeError: unsupported operand", "nn.Linear(2, 2) + 1"),
])
def test_a_model_factory_that_escapes_is_its_failure_at_its_line(factory, said, text, module,
                                                                 tmp_path, capsys):
    name, path = module
    out = tmp_path / "plan.csv"
    # Before the rule, sys.exit(0) in the factory made the plan exit 0 with nothing written.
    assert cli.main(["plan", "--model", f"{name}:{factory}", *PLAN, "--out", str(out)]) == 2
    err = _one_line(capsys)
    assert f"--model '{name}:{factory}': {said}" in err, err
    assert f"at {path}:{_line(path, text)}" in err, err
    assert not out.exists()


@pytest.mark.parametrize("factory", ["sleeps", "spins", "swallows"])
@pytest.mark.timeout(60)
def test_a_model_factory_that_never_returns_is_stopped_at_the_plans_timeout(
        factory, module, tmp_path, capsys):
    name, path = module
    out = tmp_path / "plan.csv"
    assert cli.main(["plan", "--model", f"{name}:{factory}", *PLAN, "--timeout", "1",
                     "--out", str(out)]) == 1
    err = _one_line(capsys)
    assert err.startswith(f"flexbench plan: failed: --model '{name}:{factory}': its factory did "
                          "not return within the plan's timeout of 1 s (it was still running at "
                          f"{path}:"), err
    assert err.endswith("); the plan was stopped and nothing was written."), err
    assert int(err.split(f"{path}:")[1].split(")")[0]) in _body(path, factory), err
    assert not out.exists()


def test_a_model_module_that_exits_on_import_is_refused(tmp_path, monkeypatch, capsys):
    (tmp_path / "exits_on_import.py").write_text("import sys\n\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "plan.csv"
    assert cli.main(["plan", "--model", "exits_on_import:build", *PLAN, "--out", str(out)]) == 2
    err = _one_line(capsys)
    assert "importing 'exits_on_import' called sys.exit(0) at " in err, err
    assert f"{tmp_path / 'exits_on_import.py'}:3" in err and not out.exists()


@pytest.mark.parametrize(("argv", "factory", "said", "text"), [
    (["run", "--steps", "1"], "exits_zero", "the factory called sys.exit(0)", "sys.exit(0)"),
    (["run", "--emulate", "--nodes", "2", "--steps", "1"], "exits_zero",
     "the factory called sys.exit(0)", "sys.exit(0)"),
    (["run", "--steps", "1"], "workload_exits_in_model", "calling it called sys.exit(0)",
     "# in model()"),
    (["profile-compute", "--method", "flexdemo"], "exits_three",
     "the factory called sys.exit(3)", "raise SystemExit(3)"),
])
def test_a_workload_factory_that_exits_is_its_failure_not_the_commands_exit(
        argv, factory, said, text, module, tmp_path, capsys):
    name, path = module
    out = tmp_path / ("out.json" if argv[0] == "profile-compute" else "run")
    assert cli.main([*argv, "--workload", f"{name}:{factory}", "--out", str(out)]) == 2
    err = _one_line(capsys)
    assert f"workload '{name}:{factory}': {said}" in err, err
    assert f"at {path}:{_line(path, text)}" in err, err
    assert not out.exists()


@pytest.mark.timeout(60)
def test_a_sweep_stops_a_hanging_workload_at_its_timeout(module, tmp_path, capsys):
    name, path = module
    config = tmp_path / "hangs.toml"
    config.write_text(textwrap.dedent(f'''
        timeout_s = 1
        [run]
        workload = "{name}:spins"
        steps = 1
        [grid]
        methods = ["hsdp-adamw"]
        inter_bw = ["1Gbit"]
        inter_lat = ["1ms"]
        seeds = [0]
    '''))
    out = tmp_path / "sweep"
    assert cli.main(["sweep", str(config), "--out", str(out)]) == 1
    err = _one_line(capsys)
    assert (f"flexbench sweep: failed: workload '{name}:spins': its factory did not return "
            "within the sweep's timeout of 1 s") in err, err
    assert int(err.split(f"{path}:")[1].split(")")[0]) in _body(path, "spins"), err
    assert not out.exists()


def test_an_interrupt_in_user_code_stays_an_interrupt():
    def interrupted() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        users_call("the factory", interrupted)
    with run_deadline(5.0, command="plan", stopped=""), pytest.raises(ConfigError) as err:
        users_call("the factory", lambda: exit(0))
    assert str(err.value).startswith("the factory called sys.exit(0)")
