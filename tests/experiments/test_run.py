"""`flexbench run`, `simulate` and the run config: bad input, real 2 nodes x 2 runs, torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from experiments.cli import main
from experiments.config import RunConfig, parse_sets
from experiments.errors import ConfigError
from experiments.run.launch import launch
from experiments.workloads import make_workload

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--topk", "0"], "topk"),
        (["--chunk", "-3"], "chunk"),
        (["--decay", "1.0"], "decay"),
        (["--decay", "-0.1"], "decay"),
        (["--nodes", "0"], "nodes"),
        (["--gpus-per-node", "0"], "argument --gpus-per-node: must be an integer >= 1"),
        (["--method", "adam"], "method"),
        (["--workload", "imagenet"], "workload"),
        (["--shaping", "wall"], "inter_bw"),
        (["--inter-bw", "0Mbit", "--shaping", "wall"], "bandwidth"),
        (["--inter-bw", "1Gbit", "--inter-lat=-1ms"], "latency"),
        (["--inter-bw", "12 parsecs"], "bandwidth"),
        (["--set", "steps"], "key=value"),
        (["--set", "colour=blue"], "colour"),
        (["--method", "gossip", "--set", "graph=star"], "graph='star' is unknown"),
        (["--method", "gossip", "--graph", "torus", "--nodes", "2"],
         "needs at least 4 nodes, got nodes=2"),
        (["--method", "gossip", "--graph", "torus", "--nodes", "5"],
         "nodes=5 is prime; on 5 nodes use one of ring, exponential, one-peer-exponential"),
    ],
)
def test_bad_input_is_one_sentence_and_writes_nothing(tmp_path, capsys, flags, words):
    out = tmp_path / "run"
    assert main(["run", "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and words in err, err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_existing_output_folder_is_refused(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["run", "--out", str(tmp_path), "--steps", "1"]) == 2
    assert "already holds files" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_torchrun_world_size_must_divide_by_nodes(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ConfigError, match="world size 3 is not divisible by --nodes 2"):
        launch(RunConfig(nodes=2), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_overrides_and_coercion():
    assert parse_sets(["steps=5", " lr = 0.01 "]) == {"steps": 5, "lr": 0.01}
    cfg = RunConfig().replace(steps="5", lr="0.01", sign="false", inter_bw="none")
    assert (cfg.steps, cfg.lr, cfg.sign, cfg.inter_bw) == (5, 0.01, False, None)
    with pytest.raises(ConfigError, match="steps must be of type"):
        RunConfig().replace(steps="five")


def test_workloads_are_deterministic_and_rank_specific():
    w = make_workload("lm-tiny")
    a, b = w.batch(3, 0, 4, seed=0), w.batch(3, 0, 4, seed=0)
    assert all((x == y).all() for x, y in zip(a, b, strict=True))
    other = w.batch(3, 1, 4, seed=0)
    assert not (a[0] == other[0]).all()
    x, y = a
    assert x.shape == (4, 64) and (x[:, 1:] == y[:, :-1]).all()  # targets are shifted inputs
    digits = make_workload("vision-tiny")
    images, labels = digits.batch(0, 0, 8, seed=0)
    assert images.shape == (8, 1, 8, 8) and labels.max() <= 9 and images.max() <= 1.0


def _run(tmp_path: Path, method: str, **kw) -> tuple[pd.DataFrame, dict]:
    cfg = RunConfig(method=method, workload="vision-tiny", steps=STEPS, eval_every=2, **kw)
    out = launch(cfg, tmp_path / method, timeout_s=240, quiet=True)
    return pd.read_parquet(out / "steps.parquet"), json.loads((out / "run.json").read_text())


@pytest.mark.dist
@pytest.mark.timeout(400)
def test_real_runs_write_results_and_count_inter_node_bytes(tmp_path):
    flex, flex_meta = _run(tmp_path, "flexdemo")
    hsdp, hsdp_meta = _run(tmp_path, "hsdp-adamw")
    for steps in (flex, hsdp):
        assert list(steps["step"]) == list(range(1, STEPS + 1))
        assert steps["wall_time_s"].is_monotonic_increasing
        assert steps["val_loss"].notna().sum() == STEPS // 2
        assert (steps["intra_bytes"] > 0).all()
        assert steps["graph"].isna().all()  # no gossip graph
    # FSDP2's inter-node all-reduce of fp32 gradient shards: each node's two ranks together send
    # the whole model once per step (ring all-reduce over 2 nodes sends n per rank).
    params = hsdp_meta["params"]
    assert hsdp["inter_bytes_sent"].tolist() == [4.0 * params] * STEPS
    assert (hsdp["inter_calls"] > 0).all()
    # FlexDeMo: one bucketed all-gather per step per rank, a small fraction of the bytes.
    assert flex["inter_calls"].tolist() == [1] * STEPS
    assert flex["inter_bytes_sent"].max() < hsdp["inter_bytes_sent"].min() / 10
    assert flex_meta["config"]["method"] == "flexdemo" and flex_meta["git_commit"] is not None
    # Replica variance is measured at evaluations only; synchronous replicas read ~0.
    for steps in (flex, hsdp):
        evaluated = steps["val_loss"].notna()
        assert steps["replica_variance"].notna().equals(evaluated)
        assert (steps.loc[evaluated, "replica_variance"] < 1e-20).all()
        assert (steps.loc[evaluated, "consensus_distance"] < 1e-9).all()
    trace = pd.read_parquet(tmp_path / "flexdemo" / "trace.parquet")
    assert sorted(trace["rank"].unique()) == [0, 1, 2, 3]
    assert (trace["step"] > 0).all()  # evaluation traffic is left out

    sim_csv = tmp_path / "sim.csv"
    argv = ["simulate", str(tmp_path / "hsdp-adamw"), "--inter-bw", "10Mbit", "--inter-lat",
            "20ms", "--out", str(sim_csv)]
    assert main(argv) == 0
    sim = pd.read_csv(sim_csv)
    assert list(sim["step"]) == list(range(1, STEPS + 1))
    # At 10 Mbit/s, moving the whole model across the link takes at least bytes * 8 / 1e7 s.
    assert sim["step_time_s"].min() >= 4.0 * params * 8 / 10e6


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_demo_method_runs_unsharded_over_all_ranks(tmp_path):
    steps, meta = _run(tmp_path, "demo")
    assert meta["config"]["method"] == "demo"
    assert (steps["inter_bytes_sent"] > 0).all()
    assert (steps["intra_bytes"] == 0).all() or (steps["intra_bytes"] > 0).all()


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_gossip_run_sends_degree_times_the_model_and_logs_replica_variance(tmp_path):
    steps, meta = _run(tmp_path, "gossip", nodes=4, gpus_per_node=1, graph="ring")
    assert meta["config"]["graph"] == "ring"
    assert steps["graph"].tolist() == ["ring"] * STEPS
    # One rank per node holds the whole fp32 model and sends it to its 2 ring neighbours.
    assert steps["inter_bytes_sent"].tolist() == [2 * 4.0 * meta["params"]] * STEPS
    assert steps["inter_bytes_received"].tolist() == [2 * 4.0 * meta["params"]] * STEPS
    assert steps["inter_calls"].tolist() == [4] * STEPS  # busiest rank: 2 sends, 2 receives
    evaluated = steps.dropna(subset=["val_loss"])
    assert (evaluated["replica_variance"] > 0).all() and (evaluated["consensus_distance"] > 0).all()
    trace = pd.read_parquet(tmp_path / "gossip" / "trace.parquet")
    assert set(trace.loc[trace["kind"] == "collective", "op"]) <= {"send", "recv", "all_gather",
                                                                   "reduce_scatter"}


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_same_entry_point_under_torchrun(tmp_path):
    out = tmp_path / "tr"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "experiments.cli", "run", "--nodes", "2", "--method", "flexdemo",
           "--workload", "vision-tiny", "--steps", "2", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-2000:]
    meta = json.loads((out / "run.json").read_text())
    assert meta["config"]["gpus_per_node"] == 2 and meta["world_size"] == 4
    assert "wrote" in done.stdout


def test_every_run_setting_is_a_documented_flag():
    import argparse
    import dataclasses

    from experiments.config import add_run_arguments, field_help, run_arguments

    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    docs = field_help(RunConfig)
    for f in dataclasses.fields(RunConfig):
        if f.name != "extra":
            assert docs.get(f.name), f"{f.name} has no docstring"
    args = parser.parse_args(["--gpus-per-node", "3", "--no-sign", "--stall-timeout", "5"])
    assert run_arguments(args) == {"gpus_per_node": 3, "sign": False, "stall_timeout": 5.0}


def test_results_written_atomically_are_readable_by_others(tmp_path, monkeypatch):
    from experiments import io

    monkeypatch.setattr(io, "_UMASK", 0o022)
    io.write_atomic(tmp_path / "summary.md", "x")
    # As open() makes a file under umask 022 (mkstemp alone makes it 0600).
    assert (tmp_path / "summary.md").stat().st_mode & 0o777 == 0o644


def test_two_runs_into_one_folder_the_second_is_refused(tmp_path):
    out = tmp_path / "run"
    other = subprocess.Popen(["sleep", "60"])  # stands for a live launcher building OUT
    try:
        (tmp_path / f".run.partial-{other.pid}").mkdir()
        with pytest.raises(ConfigError, match=f"another run \\(pid {other.pid}\\) is writing"):
            launch(RunConfig(steps=1), out)
    finally:
        other.kill()
        other.wait()
    assert not out.exists()


def test_the_watchdog_names_a_stopped_rank_though_a_waiting_peer_fell_silent_first(
        tmp_path, monkeypatch):
    from experiments.run import watchdog

    clock = [1000.0]
    monkeypatch.setattr(watchdog.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(watchdog, "_stopped", lambda pid: pid == 222)  # rank 1 got SIGSTOP
    paths = [tmp_path / f"progress-{r}" for r in range(2)]

    def beat(rank: int, pid: int, step: int) -> None:
        paths[rank].write_text(f"{pid} {step} {step + 1}\n")

    dog = watchdog.Watchdog(paths, stall_s=10.0)
    beat(0, 111, 2)
    beat(1, 222, 2)
    dog.check()
    clock[0] += 0.5
    beat(1, 222, 3)  # rank 1 finishes step 3, then stops; rank 0 waits on it in step 4
    dog.check()
    clock[0] = 1010.3  # rank 0 silent 10.3 s, rank 1 9.8 s: only the waiting peer is past 10 s
    with pytest.raises(watchdog.RankStalled, match="rank 1 made no progress for 10 s"):
        dog.check()


def test_the_watchdog_allows_start_up_longer_than_a_step(tmp_path, monkeypatch):
    from experiments.run import watchdog

    clock = [1000.0]
    monkeypatch.setattr(watchdog.time, "monotonic", lambda: clock[0])
    beats = [watchdog.Heartbeat(tmp_path / f"progress-{r}") for r in range(2)]
    dog = watchdog.Watchdog([tmp_path / f"progress-{r}" for r in range(2)], stall_s=10.0)
    dog.check()
    clock[0] += 60.0  # both still building their model: longer than a step may take
    dog.check()
    beats[0].beat(1)
    beats[1].beat(1)
    dog.check()
    clock[0] += 5.0
    beats[0].beat(2)
    dog.check()
    clock[0] += 6.0  # rank 1 silent 11 s after its first step
    with pytest.raises(watchdog.RankStalled, match="rank 1 made no progress for 10 s"):
        dog.check()
    fresh = watchdog.Watchdog([tmp_path / "progress-9"], stall_s=10.0)
    watchdog.Heartbeat(tmp_path / "progress-9")
    fresh.check()
    clock[0] += watchdog.STARTUP_S + 1  # but start-up is bounded too
    with pytest.raises(watchdog.RankStalled, match="before its first step"):
        fresh.check()
