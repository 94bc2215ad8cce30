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
