"""Numbers of impossible kinds are refused where they are parsed, by one rule (experiments.values).

Every numeric flag of every `flexbench` subcommand is found by reading the parsers' actions, so
a new numeric flag that parses with a bare int or float fails here; each is fed inf, nan, 0 and
-1 through the parser in this process, and whatever its kind does not allow must exit 2 naming
the flag. The run settings, sweep keys and site files get the same values.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import shutil
from pathlib import Path

import pytest

from experiments import cli
from experiments.config import RunConfig
from experiments.errors import ConfigError
from experiments.sweep.plan import units_of
from experiments.sweep.spec import parse_config
from experiments.values import FRACTION, POSITIVE, SEED, UNIT_OPEN_LOW, Kind, kind_of
from flexdemo.methods import RECORDS
from netsim.sites import parse_sites

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "results" / "quick" / "units" / "flexdemo-s0"
BAD = ("inf", "-inf", "nan", "0", "-1")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    """Each subcommand's parser, its module's flags added."""
    out = {}
    for name in cli.COMMANDS:
        parser = cli.build_parser([name])
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        out[name] = sub.choices[name]
    return out


def unruled_numeric_flags(parser: argparse.ArgumentParser) -> list[str]:
    """Flags that parse numbers without a Kind: a bare int/float type, or a numeric default."""
    found = []
    for action in parser._actions:
        if not action.option_strings or kind_of(action) is not None:
            continue
        defaults = action.default if isinstance(action.default, list) else [action.default]
        numeric_default = any(isinstance(d, (int, float)) and not isinstance(d, bool)
                              for d in defaults)
        if action.type in (int, float) or numeric_default and action.type is None:
            found.append(action.option_strings[-1])
    return found


def _int_or_none(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


SUBPARSERS = _subparsers()
FLAGS = [(name, action.option_strings[-1], kind_of(action))
         for name, parser in SUBPARSERS.items() for action in parser._actions
         if kind_of(action) is not None]
CASES = [(name, flag, value) for name, flag, kind in FLAGS for value in BAD
         if not kind.allows(float(value) if not kind.integer else _int_or_none(value))]


def test_every_numeric_flag_of_every_subcommand_parses_by_a_kind() -> None:
    missing = {name: unruled_numeric_flags(p) for name, p in SUBPARSERS.items()}
    assert {k: v for k, v in missing.items() if v} == {}
    # The flags the issue names are among those checked; run's come from RunConfig's fields.
    names = {(n, f) for n, f, _ in FLAGS}
    for pair in [("simulate", "--compute-scale"), ("simulate", "--step-compute"),
                 ("simulate", "--target"), ("compare", "--target"), ("run", "--steps"),
                 ("run", "--nodes"), ("run", "--lr"), ("run", "--decay"), ("run", "--timeout"),
                 ("run", "--num-fragments"), ("validate-sim", "--bound"),
                 ("calibrate", "--payloads"), ("profile-compute", "--skip-steps"),
                 ("check-comm", "--tolerance")]:
        assert pair in names, pair


def test_the_finder_sees_a_bare_numeric_flag() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", type=float)
    parser.add_argument("--count", default=3)
    parser.add_argument("--ok", type=POSITIVE.arg)
    parser.add_argument("--name", default="x")
    assert unruled_numeric_flags(parser) == ["--rate", "--count"]


@pytest.mark.parametrize(("command", "flag", "value"), CASES,
                         ids=[f"{c}{f}={v}" for c, f, v in CASES])
def test_a_numeric_flag_refuses_what_its_kind_does_not_allow(
    command: str, flag: str, value: str, capsys: pytest.CaptureFixture
) -> None:
    argv = [command, f"{flag}={value}"]
    with pytest.raises(SystemExit) as stop:
        cli.build_parser(argv).parse_args(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2
    last = err.strip().splitlines()[-1]
    assert f"argument {flag}" in last and f"got '{value}'" in last, err


@pytest.mark.parametrize(("command", "flag", "kind"), FLAGS, ids=[f"{c}{f}" for c, f, _ in FLAGS])
def test_a_numeric_flag_takes_a_value_of_its_kind(command: str, flag: str, kind: Kind) -> None:
    action = next(a for a in SUBPARSERS[command]._actions if flag in a.option_strings)
    value = 1 if kind.high >= 1 and not (kind.high == 1 and kind.high_open) else 0.5
    assert action.type(str(value)) == value


@pytest.mark.parametrize("flags", [["--compute-scale", "inf"], ["--step-compute", "inf"],
                                   ["--target", "nan"], ["--steps", "0"], ["--nodes", "-1"]])
def test_simulate_refuses_the_values_of_the_issue_and_writes_nothing(
    tmp_path: Path, flags: list[str], capsys: pytest.CaptureFixture
) -> None:
    if not RUN.is_dir():
        pytest.skip("needs the committed results/quick sweep")
    out = tmp_path / "sim.csv"
    status = cli.main(["simulate", str(RUN), "--inter-bw", "1Gbit", "--out", str(out), *flags])
    err = capsys.readouterr().err.strip()
    assert status == 2 and not out.exists()
    allowed = "an integer >= 1" if flags[0] in ("--steps", "--nodes") else "a finite number > 0"
    assert err == (f"flexbench simulate: error: argument {flags[0]}: must be {allowed}, got "
                   f"'{flags[1]}'.")


def _numeric_fields() -> list[tuple[str, str, Kind]]:
    """(field, a method that reads it, its kind) of every numeric RunConfig field."""
    out = []
    for f in dataclasses.fields(RunConfig):
        if str(f.type).split(" ")[0] not in ("int", "float"):
            continue
        method = next((r.name for r in RECORDS if f.name in r.takes), "flexdemo")
        out.append((f.name, method, f.metadata.get("kind")))
    return out


FIELDS = _numeric_fields()


def test_every_numeric_run_setting_has_a_kind() -> None:
    assert [name for name, _, kind in FIELDS if kind is None] == []


@pytest.mark.parametrize(("name", "method", "kind"), FIELDS, ids=[n for n, _, _ in FIELDS])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 0, -1])
def test_a_run_setting_refuses_what_its_kind_does_not_allow(
    name: str, method: str, kind: Kind, value: float
) -> None:
    typed = int(value) if kind.integer and math.isfinite(value) else value
    if kind.allows(typed):
        return  # 0 where zero is allowed: nothing to refuse
    with pytest.raises(ConfigError, match=rf"\b{name}\b") as err:
        RunConfig(method=method, **{name: typed}).validate()
    assert "\n" not in str(err.value) and str(err.value).endswith(".")


SWEEP = {"run": {"steps": 5}, "grid": {"methods": ["hsdp-adamw"], "inter_bw": ["1Gbit"],
                                       "inter_lat": ["1ms"], "seeds": [0]}}


KEYS = {((), "timeout_s"): POSITIVE, (("target",), "val_loss"): POSITIVE,
        (("target",), "baseline_fraction"): UNIT_OPEN_LOW, (("run",), "lr"): POSITIVE,
        (("run",), "warmup"): FRACTION, (("grid",), "seeds"): SEED}


@pytest.mark.parametrize(("where", "key"), list(KEYS), ids=[k for _, k in KEYS])
@pytest.mark.parametrize("value", [math.inf, math.nan, 0.0, -1.0, 2.0, -1])
def test_a_sweep_key_refuses_an_impossible_number(where: tuple[str, ...], key: str,
                                                  value: float) -> None:
    raw = copy.deepcopy(SWEEP)
    table = raw
    for part in where:
        table = table.setdefault(part, {})
    table[key] = [value] if key == "seeds" else value
    kind = KEYS[where, key]
    if kind.allows(value):
        units_of(parse_config(raw))  # every unit built and checked, as a dry run does
        return
    with pytest.raises(ConfigError, match=rf"\b{key}\b"):
        units_of(parse_config(raw))


@pytest.mark.parametrize("value", [math.inf, math.nan, -1, -0.5])
def test_an_executor_number_must_be_finite_and_not_negative(value: float) -> None:
    raw = {**SWEEP, "executor": {"kind": "local", "timeout_min": value}}
    with pytest.raises(ConfigError, match=r"^executor\.timeout_min must be "):
        parse_config(raw)


@pytest.mark.parametrize("key", ["nodes", "cpus_per_task", "tasks_per_node"])
def test_an_executor_count_a_job_cannot_run_without_must_be_at_least_one(key: str) -> None:
    raw = {**SWEEP, "executor": {"kind": "local", key: 0}}
    with pytest.raises(ConfigError, match=rf"^executor\.{key} must be an integer >= 1, got 0\.$"):
        parse_config(raw)
    # Zeros Slurm reads as a setting: no time limit, all of the node's memory, no GPU.
    parse_config({**SWEEP, "executor": {"kind": "local", "timeout_min": 0, "mem_gb": 0,
                                        "gpus_per_node": 0}})


SITE = {"site": [{"name": "a", "nodes": 2, "uplink": "1Gbit", "downlink": "1Gbit",
                  "intra_bw": "10Gbit", "intra_lat": "1ms"}], "rtt": {"matrix": [[0]]}}


@pytest.mark.parametrize(("key", "value"), [("nodes", 0), ("nodes", -1), ("uplink", "infGbit"),
                                            ("uplink", "nanGbit"), ("uplink", "0Gbit"),
                                            ("downlink", "-1Gbit"), ("intra_lat", "infms"),
                                            ("intra_lat", "-1ms"), ("intra_bw", "nanMbit")])
def test_a_site_file_refuses_an_impossible_number(key: str, value: object) -> None:
    site = {**SITE["site"][0], key: value}
    with pytest.raises(ValueError, match=key if key != "nodes" else "no nodes|nodes"):
        parse_sites({"site": [site], "rtt": SITE["rtt"]})


@pytest.mark.parametrize("value", [math.inf, math.nan, -1.0])
def test_a_site_files_rtt_refuses_an_impossible_number(value: float) -> None:
    two = [{**SITE["site"][0], "name": n, "nodes": 1} for n in "ab"]
    with pytest.raises(ValueError, match="rtt"):
        parse_sites({"site": two, "rtt": {"matrix": [[0, value], [value, 0]]}})


def test_compare_refuses_two_workloads_as_such_not_as_one_seed(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    if not RUN.is_dir():
        pytest.skip("needs the committed results/quick sweep")
    import json

    mine, theirs = tmp_path / "tiny", tmp_path / "small"
    shutil.copytree(RUN, mine)
    shutil.copytree(RUN, theirs)
    meta = json.loads((theirs / "run.json").read_text())
    meta["config"]["workload"] = "lm-small"
    (theirs / "run.json").write_text(json.dumps(meta))
    status = cli.main(["compare", str(mine), str(theirs), "--inter-bw", "1Gbit",
                       "--target", "3"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1
    assert "trains workload 'lm-tiny'" in err and "workload 'lm-small'" in err, err
    assert "seed 0" not in err
