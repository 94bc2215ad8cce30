"""`flexbench plan` end to end: its outputs, and its refusals (one sentence, exit 2, no file)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from experiments.cli import main
from experiments.plan.command import parse_bandwidths

ROOT = Path(__file__).resolve().parents[2]
MODEL = "gpt:dim=128,layers=2,heads=4,vocab=512,ffn=256,tied=true"
BASE = ["plan", "--model", MODEL, "--nodes", "4", "--gpus-per-node", "2",
        "--inter-lat", "1ms"]


def _plan(tmp_path, name: str, *extra: str) -> int:
    return main([*BASE, "--out", str(tmp_path / name), *extra])


def test_csv_has_a_row_per_method_and_bandwidth(tmp_path, capsys):
    code = _plan(tmp_path, "p.csv", "--method", "hsdp-adamw", "flexdemo", "diloco",
                 "--gpu", "h100", "--batch", "1", "--seq", "256",
                 "--inter-bw", "10Mbit:10Gbit:4", "--set", "diloco_h=20")
    assert code == 0
    frame = pd.read_csv(tmp_path / "p.csv")
    assert len(frame) == 3 * 4
    for column in ("method", "inter_bw", "step_time_s", "compute_utilization",
                   "bytes_per_node_step", "memory_per_gpu_bytes"):
        assert column in frame.columns
    assert set(frame["method"]) == {"hsdp-adamw", "flexdemo", "diloco"}
    # More bandwidth never slows a step; utilization stays a fraction.
    for _, rows in frame.groupby("method"):
        times = rows.sort_values("inter_bw_bps")["step_time_s"].to_numpy()
        assert (times[1:] <= times[:-1] * (1 + 1e-9)).all()
    assert frame["compute_utilization"].between(0, 1).all()
    assert (frame[frame["method"] == "diloco"]["period_steps"] == 20).all()
    out = capsys.readouterr().out
    assert "bandwidth needed for a compute utilization of" in out
    assert "6 x N x tokens" in out and "diloco_h=20" in out


def test_json_and_figure(tmp_path):
    common = ["--method", "flexdemo-async", "--step-compute", "0.05", "--inter-bw", "1Gbit",
              "10Gbit"]
    assert _plan(tmp_path, "p.json", *common) == 0
    doc = json.loads((tmp_path / "p.json").read_text())
    assert len(doc["rows"]) == 2 and len(doc["bandwidth_needed"]) == 5
    assert any("as given (--step-compute)" in line for line in doc["assumptions"])
    assert _plan(tmp_path, "p.png", *common) == 0
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_above_the_gpu_is_flagged(tmp_path, capsys):
    assert _plan(tmp_path, "p.csv", "--method", "hsdp-adamw", "--step-compute", "1",
                 "--inter-bw", "1Gbit", "--gpu-memory", "1GB") == 0
    assert "above the GPU's" not in capsys.readouterr().out  # a small model fits 1 GB
    assert not pd.read_csv(tmp_path / "p.csv")["memory_over"].any()
    assert _plan(tmp_path, "q.csv", "--method", "hsdp-adamw", "--step-compute", "1",
                 "--inter-bw", "1Gbit", "--gpu-memory", "0.000001GB") == 0
    assert pd.read_csv(tmp_path / "q.csv")["memory_over"].all()


@pytest.mark.parametrize(("extra", "words"), [
    (["--gpu", "v100", "--batch", "1", "--seq", "8"], "--gpu 'v100' is unknown"),
    (["--gpu", "h100", "--batch", "1", "--seq", "8", "--mfu", "0"],
     "--mfu: must be a number in (0, 1], got '0'"),
    (["--gpu", "h100", "--batch", "1", "--seq", "8", "--mfu", "-1"],
     "--mfu: must be a number in (0, 1], got '-1'"),
    (["--gpu", "h100", "--batch", "1", "--seq", "8", "--gpu-memory", "0GB"],
     "--gpu-memory '0GB' is not a size above zero"),
    (["--gpu", "h100"], "needs --batch and --seq"),
    (["--step-compute", "1", "--inter-bw", "1Tbit:1Gbit:5"], "A below B"),
    (["--step-compute", "1", "--inter-bw", "1Gbit:1Tbit:1"], "COUNT '1'"),
    (["--step-compute", "1", "--set", "nosuch=1"], "no planned method reads it"),
    (["--step-compute", "1", "--set", "topk=0"], "topk"),
    (["--step-compute", "1", "--set", "param_dtype=fp8"], "param_dtype='fp8'"),
    (["--step-compute", "-2"], "--step-compute: must be a finite number > 0"),
    (["--step-compute", "1", "--method", "streaming-diloco", "--set", "num_fragments=40",
      "--set", "sync_every=80"], "num_fragments=40 is more than the"),
    (["--step-compute", "1", "--method", "diloco", "--set", "sync_in_backward=maybe"],
     "sync_in_backward='maybe' must be true or false"),
    (["--step-compute", "1", "--method", "hsdp-adamw", "--set", "sync_in_backward=true"],
     "--method plans none of them"),
])
def test_bad_input_is_one_sentence_and_writes_nothing(tmp_path, capsys, extra, words):
    argv = [] if "--method" in extra else ["--method", "flexdemo"]
    if "--inter-bw" not in extra:
        argv += ["--inter-bw", "1Gbit"]
    assert _plan(tmp_path, "p.csv", *argv, *extra) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("argv", "words"), [
    (["--model", "llama9"], "--model 'llama9' is unknown"),
    (["--model", "tests.experiments.plan_factories:on_cpu"], "not on the meta device"),
    (["--method", "ada"], "picks its graph from the replica spread"),
    (["--out", "plan.txt"], "must end in .csv, .json, .png"),
])
def test_bad_models_methods_and_outputs_are_refused(tmp_path, capsys, argv, words):
    base = {"--model": MODEL, "--method": "flexdemo", "--out": str(tmp_path / "p.csv")}
    for flag, value in zip(argv[::2], argv[1::2], strict=True):
        base[flag] = value if flag != "--out" else str(tmp_path / value)
    args = ["plan", "--nodes", "2", "--gpus-per-node", "2", "--inter-lat", "1ms",
            "--inter-bw", "1Gbit", "--step-compute", "1"]
    for flag, value in base.items():
        args += [flag, value]
    assert main(args) == 2
    assert words in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_site_file_is_the_network(tmp_path, capsys):
    sites = ROOT / "experiments/topologies/sites.toml"  # 2 sites of 8 nodes
    args = ["plan", "--model", MODEL, "--method", "hsdp-adamw", "diloco", "--nodes", "16",
            "--gpus-per-node", "2", "--step-compute", "0.1", "--topology", str(sites)]
    assert main([*args, "--out", str(tmp_path / "s.csv")]) == 0
    frame = pd.read_csv(tmp_path / "s.csv")
    assert list(frame["inter_bw"]) == ["sites:sites.toml"] * 2
    out = capsys.readouterr().out
    assert "hierarchical" in out and "no bandwidth grid" in out
    args[args.index("16")] = "4"
    assert main([*args, "--out", str(tmp_path / "t.csv")]) == 2
    assert "holds 16 nodes but --nodes is 4" in capsys.readouterr().err
    assert main([*args, "--inter-lat", "1ms", "--out", str(tmp_path / "t.csv")]) == 2
    assert "leave out --inter-bw and --inter-lat" in capsys.readouterr().err
    assert not (tmp_path / "t.csv").exists()


def _profile(path: Path, workload: str = "lm-tiny", gpus_per_node: int = 2) -> Path:
    from experiments.replay.compute_profile import FORMAT

    path.write_text(json.dumps({
        "format": FORMAT, "workload": workload, "method": "flexdemo", "batch_size": 16,
        "nodes": 1, "gpus_per_node": gpus_per_node, "device": "cuda", "device_name": "H100",
        "backend": "nccl", "torch_version": "2.13", "measured_at": "2026-12-01", "steps": 20,
        "forward_backward_s": 0.3, "optimizer_s": 0.05}))
    return path


def test_a_compute_profile_sets_the_compute(tmp_path, capsys):
    profile = _profile(tmp_path / "profile.json")
    args = ["plan", "--model", "lm-tiny", "--method", "flexdemo", "--nodes", "2",
            "--gpus-per-node", "2", "--inter-bw", "1Gbit", "--inter-lat", "1ms",
            "--compute-profile", str(profile)]
    assert main([*args, "--out", str(tmp_path / "p.csv")]) == 0
    assert pd.read_csv(tmp_path / "p.csv")["compute_s"].iloc[0] == pytest.approx(0.35)
    assert "measured for flexdemo (profiled on H100" in capsys.readouterr().out
    other = _profile(tmp_path / "other.json", workload="lm-small")
    args[args.index(str(profile))] = str(other)
    assert main([*args, "--out", str(tmp_path / "q.csv")]) == 2
    assert "not on --model 'lm-tiny'" in capsys.readouterr().err
    assert not (tmp_path / "q.csv").exists()


def test_bandwidth_ranges_are_log_spaced():
    rates = parse_bandwidths(["1Gbit:100Gbit:3", "5Gbit"])
    assert rates == pytest.approx([1e9 / 8, 5e9 / 8, 10e9 / 8, 100e9 / 8])


def test_every_planned_method_plans(tmp_path, capsys):
    args = ["plan", "--model", MODEL, "--method", "demo", "random", "striding", "gossip", "none",
            "--nodes", "8", "--gpus-per-node", "2", "--step-compute", "0.05", "--inter-lat", "1ms",
            "--inter-bw", "10Mbit", "1Gbit", "--set", "graph=torus",
            "--out", str(tmp_path / "p.csv")]
    assert main(args) == 0
    frame = pd.read_csv(tmp_path / "p.csv").set_index(["method", "inter_bw"])
    assert frame.loc[("none", "10Mbit"), "bytes_per_node_step"] == 0
    for method in ("demo", "random", "striding", "gossip"):
        slow, fast = frame.loc[(method, "10Mbit")], frame.loc[(method, "1Gbit")]
        assert slow["bytes_per_node_step"] > 0
        assert slow["step_time_s"] > fast["step_time_s"]
    out = capsys.readouterr().out
    assert "gossip: graph torus on 8 replicas, the busiest one's 3 neighbours" in out  # 2 x 4
    assert "demo: no sharding: every GPU holds the whole model and is a replica" in out


def test_gossip_and_spanning_replicas_on_a_site_file(tmp_path, capsys):
    sites = ROOT / "experiments/topologies/sites.toml"  # 2 sites of 8 nodes
    args = ["plan", "--model", MODEL, "--method", "gossip", "diloco", "--nodes", "16",
            "--gpus-per-node", "2", "--step-compute", "0.1", "--topology", str(sites),
            "--set", "graph=sites:2", "--nodes-per-replica", "2",
            "--out", str(tmp_path / "s.csv")]
    assert main(args) == 0
    assert len(pd.read_csv(tmp_path / "s.csv")) == 2
    out = capsys.readouterr().out
    assert "replicas: 8 of 2 nodes each" in out and "its site's link between nodes" in out
    args[args.index("2", args.index("--nodes-per-replica"))] = "16"
    assert main([*args[:-1], str(tmp_path / "t.csv")]) == 2
    assert "does not divide site" in capsys.readouterr().err


@pytest.mark.dist
def test_a_reader_that_leaves_early_ends_the_command_without_a_traceback(tmp_path):
    # `flexbench plan ... | head`: the pipe closes before the plan is printed; the command
    # stops with 141, as a writer killed by SIGPIPE does, and prints no traceback.

    command = [sys.executable, "-m", "experiments.cli", "plan", "--model", "lm-tiny",
               "--method", "gossip", "hsdp-adamw", "--nodes", "4", "--gpus-per-node", "1",
               "--step-compute", "0.1", "--inter-bw", "0.1Gbit:10Gbit:20", "--inter-lat", "1ms",
               "--out", str(tmp_path / "p.csv")]
    writer = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    writer.stdout.close()  # the reader leaves while the command still starts
    _, err = writer.communicate(timeout=120)
    assert writer.returncode == 141, err.decode()
    assert b"Traceback" not in err
