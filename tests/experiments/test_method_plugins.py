"""A method of the user's own, `module.path:factory`, through every command as a user runs it:
its knobs set, recorded and read back, and every refusal one sentence naming its file."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from experiments import check_comm, cli, sweep
from experiments.config import RunConfig, method_of
from experiments.errors import ConfigError, RunFailed
from experiments.replay.compare import _variant

ROOT = Path(__file__).resolve().parents[2]
_FRESH = itertools.count()


def _docs_example() -> str:
    """The `mymethods.py` of docs/methods.md, "Writing your own method"."""
    text = (ROOT / "docs" / "methods.md").read_text()
    match = re.search(r"```python\n(# mymethods\.py.*?)```", text, re.S)
    assert match, "docs/methods.md lost its own-method example"
    return match.group(1)


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> tuple[str, Path]:
    """``text`` as a new module of its own name on sys.path: (its spec ``NAME:make``, file)."""
    name = f"own_method_{next(_FRESH)}_{tmp_path.name.replace('-', '_')}"
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{name}:make", path


def test_a_plug_in_knob_is_set_recorded_flat_and_labels_its_variant(tmp_path, monkeypatch):
    spec, _ = _module(tmp_path, monkeypatch, _docs_example())
    cfg = RunConfig.from_dict({"method": spec, "momentum": "0.5", "nodes": 2}).validate()
    assert cfg.plugin_knobs == {"momentum": 0.5} and cfg.given_knobs() == {"momentum": 0.5}
    stored = cfg.to_dict()  # run.json's config: the knob beside the built-in ones
    assert stored["momentum"] == 0.5 and "plugin_knobs" not in stored
    assert RunConfig.from_dict(json.loads(json.dumps(stored))) == cfg
    assert RunConfig.from_stored(stored).knob_values()["momentum"] == 0.5
    assert _variant(stored, spec) == f"{spec}[momentum=0.5]"
    plain = RunConfig.from_dict({"method": spec}).validate().to_dict()
    assert _variant({**plain, "momentum": 0.9}, spec) == spec  # its default: no label
    # A built-in run's record keeps its layout: no key of the plug-in's.
    assert set(RunConfig().to_dict()) == set(RunConfig.from_dict({}).to_dict())
    assert "plugin_knobs" not in RunConfig().to_dict()


_BAD_RUNS = [
    (["--set", "momentum=1.5"], "momentum must be a number in [0, 1), got 1.5."),
    (["--set", "momentum=abc"], "momentum must be of type float, got 'abc'."),
    (["--set", "momentum=nan"], "momentum must be a number in [0, 1), got nan."),
    (["--topk", "8"], "does not read topk; it takes momentum, base, sign, beta1."),
    (["--set", "momentun=0.5"], "unknown run setting 'momentun'"),
    (["--nodes", "200"], "vote sums int8 signs: at most 127 nodes, got 200."),
]


@pytest.mark.parametrize(("flags", "words"), _BAD_RUNS)
@pytest.mark.timeout(60)
def test_a_bad_knob_of_a_plug_in_is_refused_before_anything_is_written(
        flags, words, tmp_path, monkeypatch, capsys):
    spec, _ = _module(tmp_path, monkeypatch, _docs_example())
    out = tmp_path / "run"
    assert cli.main(["run", "--method", spec, *flags, "--steps", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1, err
    assert not out.exists()


@pytest.mark.timeout(60)
def test_a_module_that_is_not_there_is_refused_by_run_and_by_compare(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["run", "--method", "gone_methods:make", "--steps", "1", "--out",
                     str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("flexbench run: error: method 'gone_methods:make': cannot import module "
                   "'gone_methods' (No module named 'gone_methods'); install it or put its "
                   "folder on PYTHONPATH.")
    assert not out.exists()
    # A recorded run of a plug-in replays only where its module imports, as it ran.
    run = tmp_path / "copied"
    shutil.copytree(ROOT / "results" / "quick" / "units" / "diloco-s0", run)
    meta = json.loads((run / "run.json").read_text())
    meta["config"]["method"] = "gone_methods:make"
    (run / "run.json").write_text(json.dumps(meta))
    assert cli.main(["compare", str(run), "--inter-bw", "1Gbit", "--inter-lat", "1ms",
                     "--target", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(run / "run.json") in err, err
    assert "cannot import module 'gone_methods'" in err, err


_HEAD = '''
from dataclasses import dataclass, field

from experiments.values import FRACTION
from flexdemo import Knobs, Method, Replicator


@dataclass(frozen=True)
class MineKnobs(Knobs):
    {knob}


class Mine(Replicator):
    knobs_type = MineKnobs

    def replicate(self, grads, lrs, stats):
        return [g * self.{name} for g in self._all_reduce_mean(grads, stats)]


def make():
    {make}
'''


@pytest.mark.parametrize(("knob", "name", "make", "words"), [
    ("steps: int = 3", "steps", 'return Method("m", Mine, MineKnobs())',
     "knob 'steps' of MineKnobs is named as the run setting steps, which --set steps would set "
     "instead; rename the knob."),
    ("topk: float = 0.5", "topk", 'return Method("m", Mine, MineKnobs())',
     "knob 'topk' of MineKnobs is declared float, but topk is a built-in knob of type int"),
    ('scale: float = field(default=0.5, metadata={"kind": "fraction"})', "scale",
     'return Method("m", Mine, MineKnobs())', "has metadata kind 'fraction'; give an "
     "experiments.values kind"),
    ('scale: float = field(default=1.5, metadata={"kind": FRACTION})', "scale",
     'return Method("m", Mine, MineKnobs())',
     "its default scale must be a number in [0, 1), got 1.5."),
    ("decay: float = 1.5", "decay", 'return Method("m", Mine, MineKnobs())',
     "its default decay must be a number in [0, 1), got 1.5."),
    ("scale: float = 0.5", "scale", 'return Method("m", Mine, MineKnobs(), lr=float("inf"))',
     "its lr=inf must be a finite number > 0."),
    ("scale: float = 0.5", "scale", "return {}[0]",
     "its factory ({file}:20) raised KeyError: 0 at {file}:21."),
])
@pytest.mark.timeout(60)
def test_a_plug_in_that_cannot_run_is_one_sentence_naming_its_file(
        knob, name, make, words, tmp_path, monkeypatch, capsys):
    spec, path = _module(tmp_path, monkeypatch, _HEAD.format(knob=knob, name=name, make=make))
    out = tmp_path / "run"
    assert cli.main(["run", "--method", spec, "--steps", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err, err
    assert words.format(file=path) in err, err
    assert not out.exists()


def test_a_knob_named_as_a_built_in_one_is_that_knob(tmp_path, monkeypatch):
    """One name, one meaning: a plug-in's decay is the run's decay field, of its kind."""
    spec, _ = _module(tmp_path, monkeypatch, _HEAD.format(knob="decay: float = 0.9",
                                                          name="decay", make='return Method('
                                                          '"m", Mine, MineKnobs())'))
    cfg = RunConfig.from_dict({"method": spec, "decay": "0.5"}).validate()
    assert cfg.decay == 0.5 and cfg.plugin_knobs == {} and cfg.knob_values()["decay"] == 0.5
    with pytest.raises(ConfigError, match=r"^decay must be a number in \[0, 1\), got 1\.5\.$"):
        RunConfig.from_dict({"method": spec, "decay": "1.5"}).validate()


_HANGS = '''
import time


def make():
    time.sleep(3600)
'''


@pytest.mark.timeout(60)
def test_a_factory_that_never_returns_is_ended_by_the_runs_deadline(tmp_path, monkeypatch):
    from experiments.deadline import run_deadline

    spec, path = _module(tmp_path, monkeypatch, _HANGS)
    with run_deadline(0.5), pytest.raises(RunFailed) as err:
        method_of(spec)
    message = str(err.value)
    assert message.startswith(f"method '{spec}': importing its module and calling its factory "
                              "did not return within the run's timeout of 0.5 s (it was still "
                              f"running at {path}:6)"), message


@pytest.mark.timeout(60)
def test_a_sweep_takes_a_plug_in_its_knobs_table_and_refuses_its_knob_in_run(
        tmp_path, monkeypatch):
    spec, _ = _module(tmp_path, monkeypatch, _docs_example())
    config = tmp_path / "s.toml"
    config.write_text(f'''
[run]
nodes = 2
gpus_per_node = 1
steps = 2

[grid]
methods = ["{spec}", "hsdp-adamw"]
inter_bw = ["10Mbit"]
inter_lat = ["1ms"]
seeds = [0]

[grid.knobs."{spec}"]
momentum = [0.8, 0.5]
''')
    units = sweep.units_of(sweep.load_config(config))
    mine = [u for u in units if u.method == spec]
    assert [u.config.plugin_knobs for u in mine] == [{"momentum": 0.8}, {"momentum": 0.5}]
    assert mine[0].id == f"{spec.replace(':', '_')}-momentum=0.8-s0"
    with pytest.raises(ConfigError, match=rf"^run\.momentum is a knob of {spec} alone; give it "
                                          rf'in \[grid\.knobs\."{spec}"\]\.$'):
        sweep.load_config(config, ["run.momentum=0.7"])
    with pytest.raises(ConfigError, match=rf"grid\.knobs\.{spec}\.momentun is not a run "
                                          rf"setting; known: .*, and {spec}'s knobs\.$"):
        sweep.load_config(config, [f'grid.knobs."{spec}".momentun=[0.7]'])


@pytest.mark.timeout(60)
def test_check_comm_measures_a_plug_in_the_baseline_does_not_hold(tmp_path, monkeypatch,
                                                                    capsys):
    spec, path = _module(tmp_path, monkeypatch, _docs_example())
    asked: list[list[str]] = []

    def measure(methods, settings):
        asked.append(list(methods))
        return {m: {"inter_bytes_sent": 1.0, "inter_bytes_received": 1.0, "inter_calls": 1.0,
                    "intra_bytes": 0.0} for m in methods}

    monkeypatch.setattr(check_comm, "measure", measure)
    baseline = str(ROOT / "results" / "baselines" / "comm_volume.json")
    assert cli.main(["check-comm", "--baseline", baseline, "--method", spec]) == 0
    assert asked == [[spec]]
    assert f"not in the baseline, measured only: {spec}" in capsys.readouterr().out
    (tmp_path / "broken.py").write_text("def make():\n    return None\n")
    assert cli.main(["check-comm", "--baseline", baseline, "--method", "broken:make"]) == 2
    assert "broken.py" in capsys.readouterr().err and asked == [[spec]]


def _flexbench(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=400)


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_the_documented_method_runs_through_every_command_from_outside_the_repository(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/methods.md's mymethods.py in a folder of its own, on PYTHONPATH as the docs say:
    run, a sweep, compare against hsdp-adamw, run --emulate and plan."""
    (tmp_path / "mymethods.py").write_text(_docs_example())
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1",
           "TQDM_DISABLE": "1"}
    tiny = ["--workload", "lm-tiny", "--nodes", "2", "--gpus-per-node", "1", "--steps", "3",
            "--eval-every", "1"]
    done = _flexbench(["run", "--method", "mymethods:make", "--set", "momentum=0.8", *tiny,
                       "--out", "vote"], tmp_path, env)
    assert done.returncode == 0, done.stderr[-2000:]
    meta = json.loads((tmp_path / "vote" / "run.json").read_text())
    assert meta["config"]["method"] == "mymethods:make" and meta["config"]["momentum"] == 0.8
    steps = pd.read_parquet(tmp_path / "vote" / "steps.parquet")
    # One int8 vote an entry, all-reduced between 2 nodes: the model's parameter count a step.
    assert (steps["inter_bytes_sent"] == meta["params"]).all()

    (tmp_path / "s.toml").write_text('''
name = "own"
timeout_s = 300
[run]
workload = "lm-tiny"
nodes = 2
gpus_per_node = 1
steps = 3
eval_every = 1
[grid]
methods = ["mymethods:make", "hsdp-adamw"]
inter_bw = ["10Mbit"]
inter_lat = ["1ms"]
seeds = [0]
[grid.knobs."mymethods:make"]
momentum = [0.5]
''')
    done = _flexbench(["sweep", "s.toml", "--out", "sw"], tmp_path, env)
    assert done.returncode == 0, done.stderr[-2000:]
    runs = pd.read_parquet(tmp_path / "sw" / "runs.parquet")
    assert set(runs["variant"]) == {"mymethods:make[momentum=0.5]", "hsdp-adamw"}
    assert set(runs["status"]) == {"done"}

    # compare and plan read the module in this process, as from the same PYTHONPATH.
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    hsdp = tmp_path / "sw" / "units" / "hsdp-adamw-s0"
    assert cli.main(["compare", "vote", str(hsdp), "--inter-bw", "10Mbit", "--inter-lat", "1ms",
                     "--out", "cmp.json"]) == 0
    ranked = json.loads((tmp_path / "cmp.json").read_text())["ranking"]
    assert {r["variant"] for r in ranked} == {"mymethods:make[momentum=0.8]", "hsdp-adamw"}

    done = _flexbench(["run", "--emulate", "--method", "mymethods:make", "--nodes", "3",
                       "--steps", "2", "--eval-every", "1", "--out", "em"], tmp_path, env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "mymethods:make is a plug-in" in done.stdout
    assert json.loads((tmp_path / "em" / "run.json").read_text())["config"]["nodes"] == 3

    # The planner plans it from the program its replicator writes: a byte an entry, every step.
    assert cli.main(["plan", "--model", "lm-tiny", "--method", "mymethods:make", "--nodes", "4",
                     "--gpus-per-node", "1", "--step-compute", "0.1", "--inter-bw", "1Gbit",
                     "--inter-lat", "1ms", "--out", "plan.csv"]) == 0
    row = pd.read_csv(tmp_path / "plan.csv").set_index("method").loc["mymethods:make"]
    assert row["bytes_per_node_step"] == pytest.approx(2 * 3 / 4 * meta["params"], rel=1e-9)


def test_plan_refuses_a_plug_in_whose_replicator_writes_no_program(tmp_path, monkeypatch, capsys):
    spec, path = _module(tmp_path, monkeypatch, _HEAD.format(
        knob="scale: float = 0.5", name="scale", make='return Method("m", Mine, MineKnobs())'))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["plan", "--model", "lm-tiny", "--method", spec, "--nodes", "2",
                     "--gpus-per-node", "1", "--step-compute", "0.1", "--inter-bw", "1Gbit",
                     "--inter-lat", "1ms", "--out", "plan.csv"]) == 2
    assert not (tmp_path / "plan.csv").exists()
    assert capsys.readouterr().err.strip() == (
        f"flexbench plan: error: --method {spec}: its replicator Mine ({path}) writes no program "
        "for the planner (Replicator.program); the planner plans the built-in methods and "
        "plug-ins whose replicator has one.")
