"""Emulated runs (`flexbench run --emulate`) against real gloo runs, and what refuses them.

Each method family's emulated loss, validation loss and replica variance per step equal a real
run's of the same settings (4 nodes x 1 rank, vision-tiny, fixed seed) to 1e-5 relative.
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
from experiments.run.emulate import emulate
from experiments.run.launch import launch

STEPS = 20
RTOL = 1e-5
# One method a family, with knobs that make its exchange happen within STEPS steps.
FAMILIES = {
    "hsdp-adamw": {},  # the gradient mean (FSDP2's all-reduce)
    "flexdemo": {},  # DCT top-k, all-gather and decode
    "streaming-diloco": {"sync_every": 6},  # outer steps, per fragment
    "striding": {},  # partial replication
    "gossip": {"graph": "exponential"},  # messages to graph neighbours
    "ada": {"ada_every": 5},  # gossip whose graph changes
}


def _config(method: str, nodes: int = 4) -> RunConfig:
    return RunConfig(method=method, nodes=nodes, gpus_per_node=1, workload="vision-tiny",
                     steps=STEPS, eval_every=5, seed=3, **FAMILIES[method])


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """The real gloo run of a method at 4 nodes x 1, made once per module."""
    made: dict[str, Path] = {}

    def run(method: str) -> Path:
        if method not in made:
            out = tmp_path_factory.mktemp("real") / method
            made[method] = launch(_config(method), out, timeout_s=200, quiet=True)
        return made[method]

    return run


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("method", list(FAMILIES))
def test_emulated_loss_equals_a_real_run(tmp_path, real_run, method):
    cfg = _config(method)
    real = pd.read_parquet(real_run(method) / "steps.parquet")
    out = emulate(cfg, tmp_path / "emulated", timeout_s=200, quiet=True)
    emulated = pd.read_parquet(out / "steps.parquet")
    assert list(emulated["step"]) == list(real["step"])
    for column in ("loss", "val_loss", "replica_variance", "consensus_distance"):
        np.testing.assert_allclose(emulated[column], real[column], rtol=RTOL, atol=0,
                                   equal_nan=True, err_msg=column)
    assert emulated["val_loss"].notna().sum() == STEPS // 5
    assert emulated["wall_time_s"].isna().all() and emulated["compute_s"].isna().all()
    assert not (out / "trace.parquet").exists()
    meta = json.loads((out / "run.json").read_text())
    assert meta["executor"] == "emulated" and meta["emulated"]["ranks_per_node"] == 1
    assert meta["train_time_s"] is None and meta["inter_bytes_per_step"] is None


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--method", "flexdemo-async"], "does not cover method 'flexdemo-async'"),
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
