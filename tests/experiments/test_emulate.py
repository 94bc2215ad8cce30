"""Emulated runs (`flexbench run --emulate`) against real gloo runs, and what refuses them.

Each replicator's emulated loss, validation loss and replica variance per step equal a real
run's of the same settings (2 or 4 nodes x 1 rank, vision-tiny, fixed seed) to 1e-5 relative.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from experiments.cli import main
from experiments.config import RunConfig
from experiments.run import emulate as emulate_module
from experiments.run.emulate import emulate, emulation_problem
from experiments.run.launch import launch
from flexdemo.methods import RECORDS, Method

STEPS = 20
RTOL = 1e-5
# One case a replicator (and DeMo's delayed exchange), with knobs that make its exchange happen
# within its steps: (method, knobs, nodes, steps). The ones added since the first six run on 2
# nodes for 10 steps, which keeps their real runs cheap.
CASES = {
    "hsdp-adamw": ("hsdp-adamw", {}, 4, STEPS),  # the gradient mean (FSDP2's all-reduce)
    "flexdemo": ("flexdemo", {}, 4, STEPS),  # DCT top-k, all-gather and decode
    "streaming-diloco": ("streaming-diloco", {"sync_every": 6}, 4, STEPS),  # per fragment
    "striding": ("striding", {}, 4, STEPS),  # partial replication
    "gossip": ("gossip", {"graph": "exponential"}, 4, STEPS),  # messages to graph neighbours
    "ada": ("ada", {"ada_every": 5}, 4, STEPS),  # gossip whose graph changes
    "flexdemo-async": ("flexdemo-async", {}, 2, 10),  # the exchange carried a step
    "powersgd": ("powersgd", {"powersgd_start": 4}, 2, 10),  # whole, then P and Q
    "topk-ef": ("topk-ef", {}, 2, 10),  # a sparse all-gather every step
    "sparseloco": ("sparseloco", {"diloco_h": 4}, 2, 10),  # a sparse outer sync
    "local-sgd": ("local-sgd", {"diloco_h": 4}, 2, 10),  # parameter averaging
    "diloco-int8": ("diloco", {"diloco_h": 4, "outer_format": "int8"}, 2, 10),  # codes gathered
    "hsdp-adamw-int8": ("hsdp-adamw", {"reduce_format": "int8"}, 2, 10),  # all-to-all rows
}


def _config(case: str) -> RunConfig:
    method, knobs, nodes, steps = CASES[case]
    return RunConfig(method=method, nodes=nodes, gpus_per_node=1, workload="vision-tiny",
                     steps=steps, eval_every=5, seed=3, **knobs)


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """The real gloo run of a case, made once per module."""
    made: dict[str, Path] = {}

    def run(case: str) -> Path:
        if case not in made:
            out = tmp_path_factory.mktemp("real") / case
            made[case] = launch(_config(case), out, timeout_s=200, quiet=True)
        return made[case]

    return run


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", list(CASES))
def test_emulated_loss_equals_a_real_run(tmp_path, real_run, case):
    cfg = _config(case)
    real = pd.read_parquet(real_run(case) / "steps.parquet")
    out = emulate(cfg, tmp_path / "emulated", timeout_s=200, quiet=True)
    emulated = pd.read_parquet(out / "steps.parquet")
    assert list(emulated["step"]) == list(real["step"])
    for column in ("loss", "val_loss", "replica_variance", "consensus_distance"):
        np.testing.assert_allclose(emulated[column], real[column], rtol=RTOL, atol=0,
                                   equal_nan=True, err_msg=column)
    assert emulated["val_loss"].notna().sum() == cfg.steps // 5
    assert emulated["wall_time_s"].isna().all() and emulated["compute_s"].isna().all()
    assert not (out / "trace.parquet").exists()
    meta = json.loads((out / "run.json").read_text())
    assert meta["executor"] == "emulated" and meta["emulated"]["ranks_per_node"] == 1
    assert meta["train_time_s"] is None and meta["inter_bytes_per_step"] is None


def test_every_method_with_a_program_emulates_and_one_without_is_one_sentence():
    assert all(emulation_problem(record) is None for record in RECORDS)
    said = emulation_problem(Method("full-sync", "full"))
    assert said == ("--emulate does not cover method 'full-sync': its replicator FullReplicator "
                    "writes no program (Replicator.program), so the collectives it runs are "
                    "not known.")


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--gpus-per-node", "2"], "give --gpus-per-node 1"),
        (["--shaping", "wall", "--inter-bw", "1Gbit"], "leave it off"),
        (["--nodes", "200000"], "GiB available; give fewer --nodes"),
    ],
)
def test_bad_emulated_runs_are_one_sentence_and_write_nothing(tmp_path, capsys, flags, words):
    out = tmp_path / "run"
    assert main(["run", "--emulate", "--workload", "vision-tiny", "--out", str(out),
                 *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and words in err, err
    assert list(tmp_path.iterdir()) == []


def test_gossips_receive_buffers_count_in_the_memory_estimate(tmp_path, capsys, monkeypatch):
    # Every replica holds a receive buffer a peer of its exchange window: on 256 nodes the
    # exponential graph's 15 peers, the ring's 2; the complete graph all-reduces and holds none
    # (its 255 messages at once once went out of memory unrefused). With memory for the ring
    # and a little more, exponential is refused.
    ring = RunConfig(method="gossip", graph="ring", nodes=256, gpus_per_node=1,
                     workload="vision-tiny")
    monkeypatch.setattr(emulate_module, "_available_bytes", lambda: 2**50)
    _, ring_need = emulate_module.check_emulated(ring)
    _, wide_need = emulate_module.check_emulated(ring.replace(graph="exponential"))
    _, complete_need = emulate_module.check_emulated(ring.replace(graph="complete"))
    params = 151_306  # vision-tiny's
    assert wide_need - ring_need == 256 * (15 - 2) * 4 * params
    assert ring_need - complete_need == 256 * 2 * 4 * params
    assert emulate_module.inbox_peers(ring) == 2
    assert emulate_module.inbox_peers(ring.replace(graph="complete")) == 0
    assert emulate_module.inbox_peers(ring.replace(graph="exponential", nodes=64)) == 11
    assert emulate_module.inbox_peers(ring.replace(method="ada", graph=None)) == 15
    assert emulate_module.inbox_peers(ring.replace(method="hsdp-adamw", graph=None)) == 0
    monkeypatch.setattr(emulate_module, "_available_bytes", lambda: ring_need + 2**30)
    out = tmp_path / "run"
    assert main(["run", "--emulate", "--method", "gossip", "--graph", "exponential", "--nodes",
                 "256", "--workload", "vision-tiny", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "15 peers' messages at once" in err and "or a sparser graph" in err, err
    assert not out.exists()


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_an_emulated_loss_lifts_gossips_refusal_and_is_never_a_trace(tmp_path, real_run, capsys):
    real = real_run("gossip")
    assert main(["run", "--emulate", "--method", "gossip", "--graph", "exponential",
                 "--nodes", "8", "--workload", "vision-tiny", "--steps", str(STEPS),
                 "--eval-every", "5", "--seed", "3", "--out", str(tmp_path / "e8")]) == 0
    common = ["--nodes", "8", "--gpus-per-node", "1", "--inter-bw", "1Gbit", "--target", "5"]
    assert main(["simulate", str(real), *common, "--out", str(tmp_path / "a.csv")]) == 0
    assert "no time to val_loss" in capsys.readouterr().out
    assert main(["simulate", str(real), "--loss-from", str(tmp_path / "e8"), *common,
                 "--out", str(tmp_path / "b.csv")]) == 0
    said = capsys.readouterr().out
    assert "predicted time to val_loss" in said and "8 x 1, emulated" in said
    assert main(["simulate", str(tmp_path / "e8"), "--inter-bw", "1Gbit",
                 "--out", str(tmp_path / "c.csv")]) == 2
    err = capsys.readouterr().err.strip()
    assert "is an emulated run" in err and err.count("\n") == 0


@pytest.mark.timeout(120)
def test_an_earlier_emulated_run_is_freed_before_memory_is_measured(tmp_path, monkeypatch):
    # A sweep runs its emulated units one after another in one process. The replicas of one
    # sit in reference cycles after it; measured before they are collected (and their pages
    # trimmed), the next unit would see less memory than the machine has (2.1 GiB less after
    # 64 replicas of vision-tiny on the complete graph).
    import gc

    live = []

    def available() -> int:
        # type(), not isinstance: a deprecated torch alias warns when its __class__ is read
        live.append(sum(issubclass(type(o), torch.nn.Module) for o in gc.get_objects()))
        return 2**50

    monkeypatch.setattr(emulate_module, "_available_bytes", available)
    cfg = RunConfig(method="gossip", graph="ring", nodes=8, gpus_per_node=1,
                    workload="vision-tiny", steps=2, eval_every=2)
    gc.disable()  # only the emulator's own collection may free the cycles
    try:
        emulate_module.emulate(cfg, tmp_path / "first", quiet=True)
        emulate_module.emulate(cfg, tmp_path / "second", quiet=True)
    finally:
        gc.enable()
    assert live[1] == live[0], live
