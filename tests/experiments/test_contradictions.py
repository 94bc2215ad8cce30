"""Contradictions are refused, in one sentence naming the run, file or flag, before any work.

Each case here was once accepted: a key given twice (the later won), a setting a method cannot
honour at the planned shape (accepted by `plan`, refused by `run`), a table missing its one
required key (read as no table), a folder half there (its figures drawn from what was left),
a flag that applies to nothing (recorded, unused), a negative value read as a flag, and a
message that did not say which run or file. All run in this process; nothing is trained.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from experiments.cli import main
from experiments.config import ConfigError, RunConfig, parse_sets

ROOT = Path(__file__).resolve().parents[2]
QUICK = ROOT / "results" / "quick"
UNITS = QUICK / "units"
RECORDED = UNITS / "flexdemo-s0"
QUICK_TOML = ROOT / "experiments" / "configs" / "quick.toml"
pytestmark = pytest.mark.skipif(not (QUICK / "runs.parquet").exists(),
                                reason="needs the committed results/quick sweep")

PLAN = ["plan", "--gpus-per-node", "1", "--step-compute", "0.1"]
NET = ["--inter-bw", "1Gbit", "--inter-lat", "1ms"]


def _plan(tmp_path: Path, *flags: str, model: str = "lm-tiny") -> list[str]:
    """`flexbench plan` of `model` on 1 GPU a node, 0.1 s a step, writing tmp_path/p.csv."""
    return [*PLAN, "--model", model, *flags, "--out", str(tmp_path / "p.csv")]


def _refused(capsys: pytest.CaptureFixture, argv: list[str], *words: str) -> str:
    """Run flexbench; it must exit 2 with one line holding every one of `words`."""
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words), err
    return err


def _copy(tmp_path: Path, *units: str) -> list[Path]:
    """Copies of results/quick's units, to edit."""
    copies = []
    for unit in units:
        copies.append(tmp_path / unit)
        shutil.copytree(UNITS / unit, copies[-1])
    return copies


def _edit_config(run: Path, **changes: object) -> None:
    meta = json.loads((run / "run.json").read_text())
    meta["config"].update(changes)
    (run / "run.json").write_text(json.dumps(meta))


# -- a key given twice ---------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_gpt_size_given_twice_is_refused_naming_it(tmp_path, capsys):
    gpt = "gpt:dim=64,layers=2,heads=4,vocab=256,ffn=128,dim=128"
    _refused(capsys, _plan(tmp_path, "--method", "hsdp-adamw", "--nodes", "2", *NET, model=gpt),
             "gives dim twice")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["plan", "run", "sweep", "validate-sim"])
def test_a_set_key_given_twice_with_two_values_is_refused(tmp_path, capsys, command):
    argv = {
        "plan": _plan(tmp_path, "--method", "flexdemo", "--nodes", "2", *NET, "--set", "topk=8",
                      "--set", "topk=16"),
        "run": ["run", "--out", str(tmp_path / "r"), "--set", "topk=8", "--set", "topk=16"],
        "sweep": ["sweep", str(QUICK_TOML), "--out", str(tmp_path / "s"), "--dry-run",
                  "--set", "run.topk=8", "--set", "run.topk=16"],
        "validate-sim": ["validate-sim", "--out", str(tmp_path / "v.csv"), "--set", "topk=8",
                         "--set", "topk=16"],
    }[command]
    _refused(capsys, argv, "topk", "twice")
    assert list(tmp_path.iterdir()) == []


def test_the_same_set_twice_is_one_setting_and_two_are_refused():
    assert parse_sets(["steps=5", " steps = 5"]) == {"steps": 5}
    with pytest.raises(ConfigError, match="--set gives steps twice, steps=5 and steps=6"):
        parse_sets(["steps=5", "steps=6"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("flags", "words"), [
    (["--nodes", "2", "--set", "nodes=3"], ("--nodes 2", "--set nodes=3", "two values")),
    (["--inter-lat", "5ms", "--inter-lat", "10ms"], ("argument --inter-lat", "given twice")),
])
def test_run_refuses_one_setting_given_two_values_on_its_command_line(tmp_path, capsys, flags,
                                                                     words):
    _refused(capsys, ["run", "--out", str(tmp_path / "r"), *flags], *words)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_a_switch_given_both_ways_is_refused(tmp_path, capsys):
    _refused(capsys, ["run", "--out", str(tmp_path / "r"), "--pin-cores", "--no-pin-cores"],
             "--pin-cores/--no-pin-cores", "given both ways")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_any_flag_given_twice_with_two_values_is_refused(tmp_path, capsys):
    _refused(capsys, ["compare", str(RECORDED), "--inter-bw", "1Gbit", "--inter-bw", "2Gbit"],
             "argument --inter-bw: given twice, 1Gbit and 2Gbit")
    _refused(capsys, _plan(tmp_path, "--method", "hsdp-adamw", "--nodes", "2", *NET, "--model",
                           "lm-small"),
             "argument --model: given twice, lm-tiny and lm-small")
    assert list(tmp_path.iterdir()) == []


def _json_with_a_key_twice(path: Path, body: dict) -> Path:
    text = json.dumps(body)
    path.write_text(text[:-1] + ', "format": "again"}')
    return path


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", ["compute profile", "calibration", "baseline", "model config",
                                  "run record"])
def test_a_json_file_giving_a_key_twice_is_refused_naming_file_and_key(tmp_path, capsys, what):
    twice = _json_with_a_key_twice(tmp_path / "given.json", {"format": "x", "a": 1})
    out = tmp_path / "out.csv"
    sim = ["simulate", str(RECORDED), "--inter-bw", "1Gbit", "--out", str(out)]
    argv = {
        "compute profile": [*sim, "--compute-profile", str(twice)],
        "calibration": [*sim, "--calibration", str(twice)],
        "baseline": ["check-comm", "--baseline", str(twice)],
        "model config": _plan(tmp_path, "--method", "hsdp-adamw", "--nodes", "2", *NET,
                              model=str(twice)),
    }.get(what)
    key = "format"
    if argv is None:  # a run whose run.json gives a key twice
        (run,) = _copy(tmp_path, "flexdemo-s0")
        meta = json.loads((run / "run.json").read_text())
        (run / "run.json").write_text(json.dumps(meta)[:-1] + ', "status": "done"}')
        twice, key = run / "run.json", "status"
        argv = ["simulate", str(run), "--inter-bw", "1Gbit", "--out", str(out)]
    _refused(capsys, argv, repr(str(twice)), f"gives the key {key!r} twice")
    assert not out.exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("flags", "words"), [
    (["plan", "--method", "hsdp-adamw", "--nodes", "2", "--inter-lat", "1ms", "--inter-bw",
      "1Gbit", "1Gbit"], ("--inter-bw lists a value twice",)),
    (["plan", "--method", "hsdp-adamw", "diloco", "--nodes", "2", *NET, "--steps-to-target",
      "10", "diloco=5"], ("gives diloco 10 and 5 steps",)),
    (["plan", "--method", "diloco", "--nodes", "2", *NET, "--target", "3", "--steps-from",
      str(UNITS / "diloco-s0"), str(UNITS / "diloco-s0") + "/"],
     ("--steps-from lists a run twice",)),
    (["validate-sim", "--method", "flexdemo", "flexdemo"], ("--method lists a value twice",)),
    (["validate-sim", "--extrapolate", "2x2:4x1", "2x2:4x1"],
     ("--extrapolate lists a pair twice",)),
    (["check-comm", "--method", "flexdemo", "flexdemo"], ("--method lists a method twice",)),
    (["calibrate", "--payloads", "4096", "4096"], ("--payloads lists a value twice",)),
    (["simulate", str(RECORDED), "--inter-bw", "1Gbit", "--loss-from", str(RECORDED)],
     ("--loss-from", "given already, as a run replayed")),
    (["compare", str(UNITS / "hsdp-adamw-s0"), str(RECORDED), "--inter-bw", "1Gbit",
      "--loss-from", str(RECORDED)], ("--loss-from", "given already, as a run replayed")),
])
def test_a_list_flag_giving_one_thing_twice_is_refused(tmp_path, capsys, flags, words):
    argv = _plan(tmp_path, *flags[1:]) if flags[0] == "plan" else flags
    if flags[0] in ("calibrate", "simulate", "compare"):
        argv = [*argv, "--out", str(tmp_path / "out.json")]
    _refused(capsys, argv, *words)
    assert list(tmp_path.iterdir()) == []


# -- a setting the method cannot honour at that shape --------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("method", "nodes", "per_replica", "extra"), [
    ("gossip", 1, 1, []),
    ("gossip", 2, 1, ["--set", "graph=torus"]),
    ("gossip", 4, 4, []),
    ("ada", 1, 1, ["--ada-graphs", "complete=10"]),
])
def test_plan_refuses_what_run_refuses_at_that_shape(tmp_path, capsys, method, nodes,
                                                     per_replica, extra):
    knobs = dict(item.split("=") for item in extra[1::2] if "graph=" in item)
    with pytest.raises(ConfigError) as run_says:  # `run` at the plan's replicas
        RunConfig(method=method, nodes=nodes // per_replica, **knobs).validate()
    _refused(capsys, _plan(tmp_path, "--method", method, "--nodes", str(nodes),
                           "--nodes-per-replica", str(per_replica), *NET, *extra),
             f"--method {method} on {nodes // per_replica} replica(s)", str(run_says.value))
    assert list(tmp_path.iterdir()) == []


# -- a table without its required key ------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("table", "words"), [
    ("[emulate]\n", ("[emulate]", "has no nodes")),
    ("[target]\n", ("[target]", "neither val_loss nor baseline_fraction")),
])
def test_a_sweep_table_without_its_required_key_is_refused_naming_file(tmp_path, capsys, table,
                                                                      words):
    text = QUICK_TOML.read_text()
    text = text[:text.index("[target]")]  # quick.toml's own [target], then the one tested
    config = tmp_path / "s.toml"
    config.write_text(text.replace("gpus_per_node = 2", "gpus_per_node = 1") + table)
    _refused(capsys, ["sweep", str(config), "--dry-run", "--out", str(tmp_path / "out")],
             repr(str(config)), *words)
    assert not (tmp_path / "out").exists()


# -- inputs half there ---------------------------------------------------------------------


def _sweep_copy(tmp_path: Path, *, units: bool) -> Path:
    """results/quick's tables (and its units), without its figures and summary."""
    copy = tmp_path / "quick"
    copy.mkdir()
    for name in ("runs.parquet", "steps.parquet", "sweep.json"):
        shutil.copy(QUICK / name, copy / name)
    if units:
        shutil.copytree(UNITS, copy / "units")
        shutil.copytree(QUICK / "sim", copy / "sim")
    return copy


@pytest.mark.timeout(60)
@pytest.mark.parametrize("gone", ["steps.parquet", "sweep.json"])
def test_report_of_a_sweep_missing_a_table_is_refused_naming_it(tmp_path, capsys, gone):
    sweep = _sweep_copy(tmp_path, units=False)
    (sweep / gone).unlink()
    _refused(capsys, ["report", str(sweep)], f"holds runs.parquet but no {gone}")
    assert sorted(p.name for p in sweep.iterdir()) == sorted(
        {"runs.parquet", "steps.parquet", "sweep.json"} - {gone})


@pytest.mark.timeout(120)
def test_a_unit_missing_its_steps_is_refused_by_report_and_by_a_resumed_sweep(tmp_path, capsys):
    sweep = _sweep_copy(tmp_path, units=True)
    (sweep / "units" / "diloco-s0" / "steps.parquet").unlink()
    before = (sweep / "sweep.json").read_bytes()
    _refused(capsys, ["report", str(sweep)], "unit 'diloco-s0'", "lacks its steps.parquet")
    assert not (sweep / "figures").exists() and not (sweep / "summary.md").exists()
    _refused(capsys, ["sweep", str(QUICK_TOML), "--out", str(sweep)], "unit diloco-s0",
             "its steps.parquet is not")
    assert (sweep / "sweep.json").read_bytes() == before
    assert not (sweep / "units" / "diloco-s0" / "steps.parquet").exists()


@pytest.mark.timeout(60)
def test_plan_refuses_a_recording_missing_its_steps(tmp_path, capsys):
    (diloco,) = _copy(tmp_path, "diloco-s0")
    (diloco / "steps.parquet").unlink()
    _refused(capsys, _plan(tmp_path, "--method", "diloco", "--nodes", "2", *NET, "--steps-from",
                           str(diloco), "--target", "3"),
             f"--steps-from {str(diloco)!r} is not a finished run: steps.parquet is missing")
    assert not (tmp_path / "p.csv").exists()


@pytest.mark.timeout(120)
def test_a_run_record_without_its_final_loss_is_named_not_read_as_no_baseline(tmp_path, capsys):
    runs = _copy(tmp_path, "hsdp-adamw-s0", "hsdp-adamw-s1", "flexdemo-s0")
    for run in runs[:2]:
        meta = json.loads((run / "run.json").read_text())
        del meta["final_val_loss"]
        (run / "run.json").write_text(json.dumps(meta))
    _refused(capsys, ["compare", *map(str, runs), "--inter-bw", "1Gbit"],
             "no hsdp-adamw run records a final val_loss", str(runs[0]), str(runs[1]))
    assert main(["simulate", str(runs[0]), "--inter-bw", "1Gbit", "--out",
                 str(tmp_path / "s.csv")]) == 0
    assert (f"no time to target: {str(runs[0] / 'run.json')!r} records no final val_loss"
            in capsys.readouterr().out)


# -- flags that apply to nothing -----------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags", [
    ["--inter-bw", "1Gbit", "--inter-lat", "5ms"],
    ["--node-link", "1=1Gbit"],
    ["--intra-bw", "1GB/s"],
    ["--set", "intra_lat=1us"],
    ["--pin-cores"],
    ["--threads-per-rank", "2"],
])
def test_an_emulated_run_refuses_settings_it_would_record_without_using(tmp_path, capsys,
                                                                       flags):
    named = [f for f in flags if f.startswith("--") and f != "--set"] or ["--intra-lat"]
    _refused(capsys, ["run", "--emulate", "--out", str(tmp_path / "e"), *flags],
             "--emulate", "would be recorded without being used", *named)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags", [["--warmup-steps", "3"], ["--set", "warmup=0.2", "--emulate"]])
def test_a_warm_up_given_to_a_constant_schedule_is_refused(tmp_path, capsys, flags):
    flag = "--warmup-steps" if "--warmup-steps" in flags else "--warmup"
    _refused(capsys, ["run", "--out", str(tmp_path / "r"), *flags], f"{flag} sets the warm-up",
             "schedule is constant")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("argv", "words"), [
    (["sweep", str(QUICK_TOML), "--estimate-from", str(QUICK)], ("--estimate-from", "--dry-run")),
    (["check-comm", "--update", "--tolerance", "0.05"], ("--tolerance 0.05", "--update")),
    (["plan", "--method", "hsdp-adamw", "--nodes", "2", *NET, "--set", "sync_in_backward=false"],
     ("sync_in_backward=false", "plans none of them")),
])
def test_a_flag_that_applies_to_nothing_is_refused(tmp_path, capsys, argv, words):
    if argv[0] == "plan":
        argv = _plan(tmp_path, *argv[1:])
    else:
        where = "--out" if argv[0] == "sweep" else "--baseline"
        argv = [*argv, where, str(tmp_path / "out")]
    _refused(capsys, argv, *words)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["simulate", "plan"])
def test_an_algorithm_across_sites_that_are_hierarchical_is_refused(tmp_path, capsys, command):
    sites = ROOT / "experiments" / "topologies" / "sites.toml"  # 2 sites
    argv = {"simulate": ["simulate", str(RECORDED), "--out", str(tmp_path / "s.csv")],
            "plan": _plan(tmp_path, "--method", "hsdp-adamw", "--nodes", "16")}[command]
    _refused(capsys, [*argv, "--topology", str(sites), "--algorithm", "ring"],
             "--algorithm ring", "hierarchical")
    assert list(tmp_path.iterdir()) == []


# -- messages that say what is wrong -------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("argv", "words"), [
    (["run", "--inter-bw", "1Gbit", "--inter-lat", "-5ms"], ("inter_lat '-5ms'",)),
    (["simulate", str(RECORDED), "--inter-bw", "1Gbit", "--inter-lat", "-5ms"],
     ("inter_lat '-5ms'",)),
    (["compare", str(RECORDED), "--inter-bw", "-1Gbit"], ("inter_bw '-1Gbit'",)),
    (["validate-sim", "--inter-lat", "-5ms"], ("inter_lat '-5ms'",)),
    ([*PLAN, "--model", "lm-tiny", "--method", "hsdp-adamw", "--nodes", "2", "--inter-bw",
      "1Gbit", "--inter-lat", "-5ms"], ("argument --inter-lat", "'-5ms'")),
    ([*PLAN, "--model", "lm-tiny", "--method", "hsdp-adamw", "--nodes", "2", "--inter-lat", "1ms",
      "--inter-bw", "-1Gbit:1Gbit:3"], ("argument --inter-bw", "'-1Gbit'")),
    (["calibrate", "--rates", "-1Gbit"], ("argument --rates", "'-1Gbit'")),
    (["simulate", str(RECORDED), "--inter-bw", "1Gbit", "--step-compute", "-1e-3"],
     ("argument --step-compute", "'-1e-3'")),
    (["run", "--lr", "-inf"], ("argument --lr", "'-inf'")),
])
def test_a_negative_value_is_read_as_a_value_and_refused_by_its_check(tmp_path, capsys, argv,
                                                                    words):
    err = _refused(capsys, [*argv, "--out", str(tmp_path / "out.csv")], *words)
    assert "expected one argument" not in err and "expected at least one" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("change", "said"), [
    ({"topk": "many"}, "topk must be of type int"),
    ({"nodes": 0}, "nodes must be an integer >= 1, got 0"),
    ({"lr": -1.0}, "lr must be a finite number > 0"),
])
def test_a_bad_value_in_one_of_many_runs_names_that_run(tmp_path, capsys, change, said):
    runs = _copy(tmp_path, "hsdp-adamw-s0", "hsdp-adamw-s1", "flexdemo-s0", "flexdemo-s1")
    _edit_config(runs[3], **change)
    where = repr(str(runs[3] / "run.json"))
    out = tmp_path / "cmp.json"
    _refused(capsys, ["compare", *map(str, runs), "--inter-bw", "1Gbit", "--out", str(out)],
             where, said)
    _refused(capsys, ["simulate", str(runs[3]), "--inter-bw", "1Gbit", "--out", str(out)],
             where, said)
    assert not out.exists()


@pytest.mark.timeout(60)
def test_a_json_error_names_the_file_with_its_line_and_column(tmp_path, capsys):
    runs = _copy(tmp_path, "hsdp-adamw-s0", "diloco-s0")
    (runs[1] / "run.json").write_text('{"config": {"method": "diloco",}}\n')
    broken = repr(str(runs[1] / "run.json"))
    out = tmp_path / "o.csv"
    _refused(capsys, ["compare", *map(str, runs), "--inter-bw", "1Gbit", "--out", str(out)],
             broken, "line 1, column 32")
    _refused(capsys, _plan(tmp_path, "--method", "diloco", "--nodes", "2", *NET, "--steps-from",
                           str(runs[1]), "--target", "3"),
             broken, "line 1, column 32")
    baseline = tmp_path / "baseline.json"
    baseline.write_text('{"methods": {}\n')
    _refused(capsys, ["check-comm", "--baseline", str(baseline)], repr(str(baseline)),
             "line 2, column 1")
    assert not out.exists()


@pytest.mark.timeout(60)
def test_a_same_shape_extrapolation_is_refused(capsys):
    _refused(capsys, ["validate-sim", "--extrapolate", "2x2:2x2"], "'2x2:2x2'",
             "not an extrapolation", "--shape 2x2")
