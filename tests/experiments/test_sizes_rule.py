"""One rule for sizes: every count a user gives is bounded by what the machine holds or the
command finishes, checked before any work, with the estimate in the sentence.

The counts are far past any bound (10^12 nodes, a grid of 10^12 points), so the refusals do not
depend on this machine's memory or speed; each must be one line, exit 2, naming the value, the
estimate and the most that fits, and nothing may be written. Before the rule, each of these
built tensors of terabytes, looped for hours or ended in a traceback.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from experiments import cli
from experiments.errors import ConfigError
from experiments.plan.replicas import check_nodes_per_replica, divisors
from experiments.sizes import Cost, Count, Term, check_work
from experiments.sweep.plan import units_of
from experiments.sweep.spec import parse_config
from experiments.values import INT64_MAX, kind_of

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "results" / "quick" / "units" / "flexdemo-s0"
MODEL = "gpt:dim=64,layers=2,heads=4,vocab=128,ffn=128,tied=true"
PLAN = ["--step-compute", "0.1", "--inter-lat", "1ms"]
TERA = str(10**12)


def _refused(argv: list[str], capsys: pytest.CaptureFixture, tmp_path: Path) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert [p.name for p in tmp_path.iterdir()] == [], "nothing is written"
    return err


def _plan(tmp_path: Path, model: str = MODEL, nodes: str = "4", per_node: str = "2",
          bw: str = "1Gbit", method: str = "hsdp-adamw") -> list[str]:
    return ["plan", "--model", model, "--method", method, "--nodes", nodes, "--gpus-per-node",
            per_node, "--inter-bw", bw, *PLAN, "--out", str(tmp_path / "p.csv")]


# The cases: (argv, words the refusal holds).
PLAN_CASES = [
    (dict(model="gpt:dim=100000000000000000000,layers=2,heads=4,vocab=128,ffn=128"),
     ["would hold 80,000,000,000,000,000,", "parameters (8e+40)", "the planner builds "
      "layouts up to 562,949,953,421,312"]),
    (dict(model="gpt:dim=64,layers=10000000,heads=4,vocab=128,ffn=128"),
     ["with 10,000,001 FSDP2 units", "would take about", "more than --timeout 600 s",
      "FSDP2 units fit"]),
    (dict(per_node="1000000"),
     ["--gpus-per-node 1,000,000", "would hold about", "TiB", "GiB this machine has available",
      "GPUs per node fit"]),
    (dict(bw=f"1Gbit:10Gbit:{TERA}"),
     ["--inter-bw's grid of 1,000,000,000,000 points", "would hold about", "bandwidths fit"]),
    (dict(nodes=TERA),
     ["--nodes 1,000,000,000,000", "would hold about", "nodes fit"]),
    # the same kinds: a grid point count, GPUs per node and layers together with methods
    (dict(bw=f"1Gbit:10Gbit:{10**7}"), ["--inter-bw's grid of 10,000,000 points", "fit"]),
    (dict(per_node="100000"), ["--gpus-per-node 100,000", "GPUs per node fit"]),
    (dict(model="llama3-8b", bw="1Gbit:10Gbit:1000000"), ["bandwidths fit"]),
]


@pytest.mark.parametrize(("flags", "words"), PLAN_CASES, ids=[str(f) for f, _ in PLAN_CASES])
def test_plan_refuses_sizes_past_the_machine(flags, words, tmp_path, capsys):
    err = _refused(_plan(tmp_path, **flags), capsys, tmp_path)
    for word in words:
        assert word in err, err
    assert re.search(r"at most [\d,]+ ", err) or "builds layouts up to" in err, err


@pytest.mark.parametrize(("method", "extra", "words"), [
    ("hsdp-adamw", ["--steps-to-target", str(10**30)],
     "--steps-to-target must be at most 9223372036854775807"),
    ("ada", ["--ada-graphs", f"complete={10**30}"],
     "--ada-graphs complete must be at most 9223372036854775807"),
    ("hsdp-adamw", ["--gpu-memory", "1" + "0" * 400 + "GB"], "is not a size above zero"),
])
def test_plan_refuses_a_count_no_number_holds(method, extra, words, tmp_path, capsys):
    assert words in _refused(_plan(tmp_path, method=method) + extra, capsys, tmp_path)


def test_plan_refuses_a_period_it_cannot_walk(tmp_path, capsys):
    err = _refused(_plan(tmp_path, method="diloco") + ["--set", f"diloco_h={TERA}"], capsys,
                   tmp_path)
    assert "diloco's period of 1,000,000,000,000 steps" in err and "fit" in err, err


def test_nodes_per_replica_lists_a_large_counts_divisors_from_its_root(tmp_path, capsys):
    # The case: the refusal counted to 10^12 to list the divisors.
    with pytest.raises(ConfigError) as err:
        check_nodes_per_replica(7, 10**12)
    assert "use one of its 169 divisors: 1, 2, 4, 5, 8, 10, ..., " in str(err.value)
    assert str(err.value).endswith("500000000000, 1000000000000.")
    assert divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36] and divisors(7) == [1, 7]
    err_line = _refused(_plan(tmp_path, nodes=TERA) + ["--nodes-per-replica", "7"], capsys,
                        tmp_path)
    assert "does not divide --nodes 1000000000000" in err_line, err_line
    err_line = _refused(_plan(tmp_path, nodes=TERA) + ["--nodes-per-replica", "8"], capsys,
                        tmp_path)
    assert "--nodes 1,000,000,000,000: the plan would hold about" in err_line, err_line


@pytest.mark.skipif(not UNIT.is_dir(), reason="needs the committed results/quick")
@pytest.mark.parametrize(("command", "flags", "words"), [
    ("simulate", ["--nodes", TERA], ["--nodes 1,000,000,000,000", "the replay of"]),
    ("simulate", ["--gpus-per-node", TERA], ["--gpus-per-node 1,000,000,000,000"]),
    ("simulate", ["--nodes", str(10**9)], ["--nodes 1,000,000,000"]),
    ("compare", ["--nodes", TERA], ["--nodes 1,000,000,000,000"]),
    ("compare", ["--nodes", "2", TERA], ["--nodes 1,000,000,000,000"]),
    ("compare", ["--gpus-per-node", str(10**10)], ["--gpus-per-node 10,000,000,000"]),
])
def test_replays_refuse_sizes_past_the_machine(command, flags, words, tmp_path, capsys):
    out = tmp_path / "out.csv"
    assert cli.main([command, str(UNIT), "--inter-bw", "1Gbit", "--target", "3", *flags,
                     "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for word in [*words, "would", "fit."]:
        assert word in err, err
    assert not out.exists()


@pytest.mark.parametrize(("argv", "words"), [
    (["run", "--steps", str(10**15)], ["steps 1,000,000,000,000,000", "steps fit"]),
    (["run", "--nodes", TERA, "--gpus-per-node", "1"], ["nodes 1,000,000,000,000"]),
    (["run", "--emulate", "--nodes", TERA], ["nodes 1,000,000,000,000"]),
    (["run", "--emulate", "--method", "gossip", "--nodes", str(10**6), "--steps", "1"],
     ["nodes 1,000,000", "pair of nodes of the gossip graphs"]),
    (["run", "--emulate", "--batch-size", str(10**9)], ["of activations a forward",
                                                        "a smaller --batch-size"]),
    (["run", "--threads-per-rank", str(10**9)], ["threads_per_rank 1,000,000,000"]),
    (["run", "--set", f"nodes={TERA}"], ["nodes 1,000,000,000,000"]),
    (["profile-compute", "--workload", "lm-tiny", "--method", "flexdemo", "--steps",
      str(10**15)], ["steps 1,000,000,000,000,000"]),
    (["calibrate", "--payloads", "1024", TERA], ["--payloads 1,000,000,000,000",
                                                 "bytes a rank fit"]),
    (["calibrate", "--repeats", str(10**6)], ["--repeats 1,000,000", "repeats fit"]),
    (["validate-sim", "--recordings", str(10**9)], ["--recordings 1000000000", "runs fit"]),
    (["validate-sim", "--steps", TERA], ["--steps 1,000,000,000,000", "steps fit"]),
])
def test_runs_refuse_sizes_past_the_machine(argv, words, tmp_path, capsys):
    out = tmp_path / "out"
    flag = "--out" if argv[0] != "validate-sim" else "--keep"
    suffix = ".json" if argv[0] in ("profile-compute", "calibrate") else ""
    assert cli.main([*argv, flag, f"{out}{suffix}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, err
    assert list(tmp_path.iterdir()) == []


SWEEP = {"run": {"steps": 5}, "grid": {"methods": ["hsdp-adamw", "flexdemo"],
                                       "inter_bw": ["1Gbit"], "inter_lat": ["1ms"],
                                       "seeds": [0]}}


@pytest.mark.parametrize(("change", "words"), [
    ({"grid": {**SWEEP["grid"], "knobs": {"flexdemo": {
        "topk": list(range(1, 101)), "chunk": list(range(1, 101)),
        "decay": [i / 1000 for i in range(100)], "replicate_every": list(range(1, 101))}}}},
     ["the grid's 100,000,001 units", "units fit"]),
    ({"grid": {**SWEEP["grid"], "inter_bw": [f"{i}Mbit" for i in range(1, 2001)],
               "inter_lat": [f"{i}ms" for i in range(1, 2001)]}},
     ["the grid's 4,000,000 network points", "network points fit"]),
    ({"run": {"steps": 5, "nodes": 10**12}}, ["nodes 1,000,000,000,000"]),
    ({"run": {"steps": 10**15}}, ["steps 1,000,000,000,000,000"]),
])
def test_a_sweep_file_refuses_counts_past_the_machine(change, words):
    with pytest.raises(ConfigError) as err:
        units_of(parse_config({**SWEEP, **change}))
    for word in words:
        assert word in str(err.value), err.value


def _integer_flags() -> list[tuple[str, str]]:
    found = []
    for name in cli.COMMANDS:
        parser = cli.build_parser([name])
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        for action in sub.choices[name]._actions:
            kind = kind_of(action)
            if kind is not None and kind.integer and kind.high > INT64_MAX:
                found.append((name, action.option_strings[-1]))
    return found


INTEGER_FLAGS = _integer_flags()


@pytest.mark.parametrize(("command", "flag"), INTEGER_FLAGS,
                         ids=[f"{c}{f}" for c, f in INTEGER_FLAGS])
def test_no_count_passes_a_64_bit_integer(command, flag, capsys):
    argv = [command, f"{flag}={10**30}"]
    with pytest.raises(SystemExit) as stop:
        cli.build_parser(argv).parse_args(argv)
    assert stop.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {flag}: must be at most {INT64_MAX}" in last and "64-bit" in last, last


def test_the_one_check_names_the_count_the_estimate_and_the_most_that_fits():
    pairs = Count("--gpus-per-node", 1000, "GPUs per node")
    units = Count("--layers", 10, "units")
    terms = [Term(Cost("a pair", bytes=8), (units, pairs, pairs))]
    with pytest.raises(ConfigError) as err:
        check_work("the plan", terms, memory=8 * 10 * 100**2, budget_s=1.0)
    # 80 MB over 800 kB: the square's root, 1000 / 10, fits
    assert str(err.value) == ("--gpus-per-node 1,000: the plan would hold about 76.3 MiB (10 "
                              "units x 1,000 GPUs per node x 1,000 GPUs per node x 8 B a pair), "
                              "more than the 781 KiB this machine has available; at most 100 "
                              "GPUs per node fit.")
    slow = [Term(Cost("to do a thing", seconds=1.0), (Count("--things", 50, "things"),)),
            Term(Cost("to start", seconds=10.0), (Count("--starts", 1, "starts"),))]
    with pytest.raises(ConfigError, match=r"^--things 50: .* more than --timeout 30 s; at most "
                                          r"20 things fit\.$"):
        check_work("it", slow, memory=1e12, budget_s=30.0, budget="--timeout 30 s")
    check_work("it", slow, memory=1e12, budget_s=60.0)  # fits: no refusal
