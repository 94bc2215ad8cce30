"""Method knobs from the command line to the replicator: one mapping, refused where not read."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

import flexdemo
from experiments.cli import main
from experiments.config import (
    KNOBS,
    ConfigError,
    RunConfig,
    add_run_arguments,
    run_arguments,
    shared_for,
)

ROOT = Path(__file__).resolve().parents[2]


def _from_flags(argv: list[str]) -> RunConfig:
    """The RunConfig `flexbench run` builds from these flags (no TOML, no --set)."""
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    return RunConfig.from_dict(run_arguments(parser.parse_args(argv))).validate()


def _optimizer(cfg: RunConfig) -> torch.optim.Optimizer:
    """The optimizer a rank builds from `cfg` (train._build's call), on one unsharded replica."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Linear(10, 6))
    return flexdemo.build_optimizer(cfg.method, model, None, lr=cfg.lr,
                                    weight_decay=cfg.weight_decay, seed=cfg.seed,
                                    **cfg.given_knobs())


def test_every_knob_a_method_reads_is_a_flag_and_reaches_its_replicator():
    assert set(KNOBS) == {k for m in flexdemo.RECORDS for k in m.takes}
    opt = _optimizer(_from_flags(["--method", "random", "--rate", "0.3", "--skip-every", "3",
                                  "--base", "adamw", "--seed", "7"]))
    rep = opt.replicator
    assert (rep.rate, rep.skip_every, rep.seed, opt.base.name) == (0.3, 3, 7, "adamw")
    opt = _optimizer(_from_flags(["--method", "striding", "--rate", "0.5", "--chunk", "8",
                                  "--fold-skipped", "--replicate-every", "2"]))
    rep = opt.replicator
    assert (rep.rate, rep.chunk, rep.fold_skipped, rep.replicate_every) == (0.5, 8, True, 2)
    assert [rep.replicates_on(s) for s in (1, 2)] == [False, True]
    opt = _optimizer(_from_flags(["--method", "ada", "--nodes", "4", "--ada-sample", "64"]))
    assert (opt.replicator.ada_sample, opt.replicator.seed) == (64, 0)  # the run's seed


def test_flags_left_out_take_the_methods_defaults():
    cfg = _from_flags(["--method", "flexdemo"])
    assert cfg.given_knobs() == {}
    assert _optimizer(cfg).replicator.knobs == flexdemo.method_record("flexdemo").knobs
    values = cfg.knob_values()
    assert (values["topk"], values["chunking"], values["value_format"]) == (4, "flat",
                                                                          "bf16-packed")


@pytest.mark.parametrize(("flags", "words"), [
    (["--method", "hsdp-adamw", "--topk", "8"],
     "method 'hsdp-adamw' does not read topk; it takes reduce_format."),
    (["--method", "diloco", "--graph", "ring", "--no-sign"],
     "method 'diloco' does not read graph, sign; it takes diloco_h, outer_lr, outer_momentum, "
     "outer_format, base, beta1."),
    (["--method", "demo", "--rate", "0.5"], "method 'demo' does not read rate; it takes "
                                            "replicate_every, skip_every, decay"),
])
def test_a_knob_the_method_does_not_read_is_one_sentence_exit_2(tmp_path, capsys, flags, words):
    out = tmp_path / "run"
    assert main(["run", "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and words in err, err
    assert not out.exists()


def test_settings_shared_by_methods_apply_where_read():
    shared = {"method": "hsdp-adamw", "topk": 8, "diloco_h": 4, "steps": 3}
    assert shared_for("hsdp-adamw", shared) == {"method": "hsdp-adamw", "steps": 3}
    assert shared_for("diloco", shared)["diloco_h"] == 4
    with pytest.raises(ConfigError, match="^method 'hsdp-adamw' does not read diloco_h, topk"):
        RunConfig.from_dict(shared).validate()


def test_every_stored_run_reads_back_with_the_knobs_it_ran_with():
    runs = sorted(ROOT.glob("results/*/units/*/run.json"))
    assert runs
    for path in runs:
        stored = json.loads(path.read_text())["config"]
        cfg = RunConfig.from_stored(stored).validate()  # old runs list every knob: not refused
        for name, value in cfg.knob_values().items():
            if name in stored and stored[name] is not None:
                assert value == stored[name], (path, name)


# -- sparseloco, local-sgd, diloco's outer_format, hsdp-adamw's reduce_format --------------------
@pytest.mark.parametrize(("flags", "words"), [
    (["--method", "sparseloco", "--topk", "5000"],
     "topk=5000 is more than chunk=4096: sparseloco keeps topk of every chunk, a density "
     "topk/chunk in (0, 1]; use topk <= 4096."),
    (["--method", "sparseloco", "--topk", "0"], "argument --topk: must be an integer >= 1"),
    (["--method", "sparseloco", "--diloco-h", "-2"],
     "argument --diloco-h: must be an integer >= 1, got '-2'."),
    (["--method", "sparseloco", "--error-decay", "1.5"],
     "argument --error-decay: must be a number in [0, 1], got '1.5'."),
    (["--method", "sparseloco", "--value-format", "int3"],
     "value_format='int3' is unknown for sparseloco; use one of 2bit, bf16, fp32."),
    (["--method", "hsdp-adamw", "--reduce-format", "fp16"],
     "reduce_format='fp16' is unknown; use one of fp32, bf16, fp8, int8."),
    (["--method", "local-sgd", "--outer-format", "3bit"],
     "outer_format='3bit' is unknown; use one of fp32, bf16, int8, 4bit."),
    (["--method", "diloco", "--reduce-format", "int8"],
     "method 'diloco' does not read reduce_format;"),
])
def test_an_impossible_value_of_a_new_knob_is_one_sentence_exit_2(tmp_path, capsys, flags,
                                                                   words):
    out = tmp_path / "run"
    assert main(["run", "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and words in err, err
    assert not out.exists()


def test_the_new_knobs_reach_their_replicators():
    opt = _optimizer(_from_flags(["--method", "sparseloco", "--topk", "64", "--chunk", "1024",
                                  "--error-decay", "0.5", "--value-format", "bf16"]))
    rep = opt.replicator
    assert (rep.topk, rep.chunk, rep.error_decay, rep.value_format) == (64, 1024, 0.5, "bf16")
    opt = _optimizer(_from_flags(["--method", "diloco", "--outer-format", "4bit"]))
    assert opt.replicator.wire.name == "4bit"
    opt = _optimizer(_from_flags(["--method", "hsdp-adamw", "--reduce-format", "fp8"]))
    assert (opt.replicator.name, opt.replicator.reduce_format) == ("reduce", "fp8")
