"""Workloads: the GPU-sized lm-small on CPU, and bringing your own through `module:factory`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch

from experiments import config, sweep, workloads
from experiments.cli import main
from experiments.config import RunConfig
from experiments.errors import ConfigError
from experiments.workloads import WORKLOAD_NAMES, make_workload

ROOT = Path(__file__).resolve().parents[2]


def test_one_list_of_built_in_workloads() -> None:
    assert config.WORKLOADS == WORKLOAD_NAMES == ("lm-tiny", "lm-small", "vision-tiny")


@pytest.mark.timeout(60)
def test_lm_small_is_a_gpu_sized_gpt_that_trains_on_cpu() -> None:
    w = make_workload("lm-small")
    torch.manual_seed(0)
    model = w.model()
    params = sum(p.numel() for p in model.parameters())
    assert 20e6 <= params <= 60e6, params
    assert isinstance(model, workloads.TinyGPT) and len(model.blocks) == 12
    x, y = w.batch(1, 0, 1, seed=0)
    assert x.shape == (1, 256) and (x[:, 1:] == y[:, :-1]).all()
    # A short slice of a real batch keeps one forward/backward of 38M parameters to ~a second.
    loss = w.loss(model, (x[:, :16], y[:, :16]))
    loss.backward()
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 1.0  # near-uniform at init
    assert all(p.grad is not None for p in model.parameters())
    assert w.val_data.numel() > 1_000_000  # more text than lm-tiny's whole corpus


def _docs_example() -> str:
    """The `my_workloads.py` example of docs/workloads.md, run here as the user would run it."""
    text = (ROOT / "docs" / "workloads.md").read_text()
    match = re.search(r"```python\n(# my_workloads\.py.*?)```", text, re.S)
    assert match, "docs/workloads.md lost its bring-your-own-workload example"
    return match.group(1)


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_own_workload_runs_through_the_cli(tmp_path: Path) -> None:
    (tmp_path / "my_workloads.py").write_text(_docs_example())
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "experiments.cli", "run", "--workload",
           "my_workloads:make_workload", "--method", "flexdemo", "--nodes", "2",
           "--gpus-per-node", "1", "--steps", "2", "--eval-every", "1", "--out", str(out)]
    # The ranks are forkserver children: they find the module through PYTHONPATH as well.
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1",
           "TQDM_DISABLE": "1"}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stderr[-2000:]
    meta = json.loads((out / "run.json").read_text())
    assert meta["config"]["workload"] == "my_workloads:make_workload"
    assert meta["config"]["batch_size"] == 32  # the workload's own default
    assert meta["params"] == 16 * 64 + 64 + 64 + 1
    steps = pd.read_parquet(out / "steps.parquet")
    assert list(steps["step"]) == [1, 2] and steps["val_loss"].notna().all()
    assert (steps["inter_bytes_sent"] > 0).all()
    # simulate reads the run folder only: it replays any workload's trace.
    sim = tmp_path / "sim.csv"
    assert main(["simulate", str(out), "--inter-bw", "10Mbit", "--out", str(sim)]) == 0
    assert len(pd.read_csv(sim)) == 2


@pytest.mark.parametrize(("name", "message"), [
    ("nosuch.mod:f", "cannot import module 'nosuch.mod'"),
    ("experiments.workloads:not_there",
     "module 'experiments.workloads' has no attribute 'not_there'"),
    ("experiments.workloads:WORKLOAD_NAMES", "is a tuple, not a factory"),
    ("gpt-5", "unknown workload 'gpt-5'; choose one of lm-tiny, lm-small, vision-tiny or give"),
])
@pytest.mark.timeout(60)
def test_bad_workload_is_one_sentence_and_nothing_is_written(name, message, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "--workload", name, "--steps", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.timeout(30)
def test_what_breaks_the_protocol_is_named(tmp_path, monkeypatch) -> None:
    (tmp_path / "half_done.py").write_text(textwrap.dedent("""
        class Half:
            default_steps = 0
            default_batch_size = 8
            def model(self): ...
            def batch(self, step, rank, batch_size, seed): ...
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    expected = ("workload 'half_done:Half' returned a Half without val_batches(), loss(), "
                "default_steps, default_eval_every; a workload has model(), batch(")
    with pytest.raises(ConfigError, match=re.escape(expected)):
        make_workload("half_done:Half")
    with pytest.raises(ConfigError, match=re.escape(expected)):
        RunConfig(workload="half_done:Half").validate()  # sweeps check the same way


@pytest.mark.timeout(30)
def test_the_protocol_accepts_a_built_in_through_its_import_path() -> None:
    # The factory protocol is what the built-ins follow too (the same loss on the same batch).
    builtin = make_workload("vision-tiny")
    via_path = make_workload("experiments.workloads:_vision_tiny")
    RunConfig(workload="experiments.workloads:_vision_tiny").validate()
    # A sweep takes the same import path in its [run] table (here as an override).
    cfg = sweep.load_config(ROOT / "experiments" / "configs" / "quick.toml",
                            ["run.workload=experiments.workloads:_vision_tiny"])
    assert {u.config.workload for u in sweep.units_of(cfg)} == {
        "experiments.workloads:_vision_tiny"}
    batch = builtin.batch(2, 1, 4, seed=0)
    torch.manual_seed(0)
    model = builtin.model()
    assert builtin.loss(model, batch).item() == via_path.loss(model, batch).item()


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_an_error_in_the_users_own_code_names_their_file_and_line(tmp_path: Path) -> None:
    # The docs' workload, whose batches fail from step 2 on inside the ranks.
    source = _docs_example() + textwrap.dedent('''

        class Failing(Regression):
            def batch(self, step, rank, batch_size, seed):
                if step >= 1:
                    raise RuntimeError("boom in my loss")
                return super().batch(step, rank, batch_size, seed)


        def failing_workload():
            return Failing()
    ''')
    (tmp_path / "my_workloads.py").write_text(source)
    line = 1 + next(i for i, text in enumerate(source.splitlines()) if "raise RuntimeError" in text)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "experiments.cli", "run", "--workload",
           "my_workloads:failing_workload", "--method", "hsdp-adamw", "--nodes", "2",
           "--gpus-per-node", "1", "--steps", "3", "--eval-every", "100", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1",
           "TQDM_DISABLE": "1"}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=220)
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    log = tmp_path / "run.error.log"
    assert "RuntimeError: boom in my loss" in last, last
    assert f"at {tmp_path / 'my_workloads.py'}:{line}" in last, last
    assert str(log) in last and "Traceback" in log.read_text()
    assert not out.exists()


@pytest.mark.parametrize(("body", "words"), [
    ("x = 1\nraise ValueError('bad constant')\n", "importing 'broken_wl' raised ValueError: bad "
     "constant at {path}:2."),
    ("def f(:\n", "importing 'broken_wl' raised SyntaxError"),
    ("import nosuchdependency_xyz\n", "importing 'broken_wl' raised ModuleNotFoundError"),
    ("def make():\n    return 1 / 0\n", "the factory raised ZeroDivisionError: division by zero "
     "at {path}:2."),
])
@pytest.mark.timeout(60)
def test_a_workload_module_that_fails_shows_its_own_file_and_line(body, words, tmp_path,
                                                                  monkeypatch, capsys):
    path = tmp_path / "broken_wl.py"
    path.write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["run", "--workload", "broken_wl:make", "--steps", "1",
                 "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert words.format(path=path) in err and len(err.splitlines()) == 1, err
    if "SyntaxError" in words or "ModuleNotFound" in words:
        assert f"at {path}:1" in err


@pytest.mark.parametrize(("body", "words"), [
    ("class W(Regression):\n    def model(self):\n        return 'a model'\n",
     "model() returned a str; it must return a torch.nn.Module."),
    ("class W(Regression):\n    def batch(self, step, rank, batch_size, seed):\n"
     "        return super().batch(step, rank, batch_size, seed)[0]\n",
     "batch() returned a Tensor; it must return a tuple of tensors"),
])
@pytest.mark.timeout(60)
def test_a_workload_returning_the_wrong_types_is_refused_before_any_rank(body, words, tmp_path,
                                                                         monkeypatch, capsys):
    module = f"typed_wl_{abs(hash(words)) % 10**8}"  # a module of its own: imports are cached
    (tmp_path / f"{module}.py").write_text(_docs_example() + "\n\n" + body
                                           + "\n\ndef make():\n    return W()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["run", "--workload", f"{module}:make", "--steps", "1",
                 "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1, err


_HANGING = textwrap.dedent('''
    import time


    class Hangs:
        default_steps = default_batch_size = default_eval_every = 1

        def model(self):
            {model}

        def batch(self, step, rank, batch_size, seed):
            raise AssertionError("not reached")

        val_batches = loss = batch


    def make():
        {factory}
        return Hangs()
''')


@pytest.mark.parametrize(("hangs", "named"), [("factory", "its factory"),
                                               ("model", "its model()")])
@pytest.mark.timeout(60)
def test_a_hanging_workload_call_is_ended_by_the_deadline(tmp_path, monkeypatch, hangs, named):
    from experiments.deadline import run_deadline
    from experiments.errors import RunFailed

    module = f"hangs_in_{hangs}"
    body = {"factory": "pass", "model": "return None", hangs: "time.sleep(3600)"}
    (tmp_path / f"{module}.py").write_text(_HANGING.format(**body))
    monkeypatch.syspath_prepend(str(tmp_path))
    with run_deadline(0.5), pytest.raises(RunFailed) as err:
        workloads.check_workload(f"{module}:make")
    message = str(err.value)
    assert message.startswith(f"workload '{module}:make': {named} did not return within the "
                              "run's timeout of 0.5 s (it was still running at ")
    assert f"{module}.py:" in message and "\n" not in message


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_run_timeout_ends_a_hanging_factory_before_any_rank(tmp_path: Path) -> None:
    (tmp_path / "sleepy.py").write_text(_HANGING.format(factory="time.sleep(3600)",
                                                        model="return None"))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "experiments.cli", "run", "--workload", "sleepy:make",
           "--timeout", "3", "--steps", "1", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "TQDM_DISABLE": "1"}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "workload 'sleepy:make': its factory did not return within the run's timeout of 3 s" \
        in done.stderr
    assert "sleepy.py:" in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()
