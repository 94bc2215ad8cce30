"""Compute profiles: `flexbench profile-compute` measures one, `simulate --compute-profile`
replays a recording with each step phase set to it, and refuses the ones that do not fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.cli import main
from experiments.config import RunConfig
from experiments.replay.compute_profile import FORMAT, load_profile
from experiments.replay.engine import replay
from experiments.replay.recordings import read_run
from experiments.replay.target import ComputeBasis, ReplayTarget
from experiments.run.launch import launch
from netsim.model import compute_phases

ROOT = Path(__file__).resolve().parents[2]
# lm-tiny, batch 16, 2x2, recorded before runs marked FSDP2 backward
RECORDED = ROOT / "results" / "quick-2026-11-30" / "units" / "hsdp-adamw-s0"

PROFILE = {
    "format": FORMAT, "workload": "lm-tiny", "method": "flexdemo", "batch_size": 16, "nodes": 2,
    "gpus_per_node": 1, "device": "cuda", "device_name": "NVIDIA H200", "backend": "nccl",
    "torch_version": "2.13.0", "measured_at": "2026-12-01T00:00:00+00:00", "steps": 20,
    "forward_backward_s": 0.004, "optimizer_s": 0.001,
}  # fmt: skip


def _write(path: Path, content: dict | str) -> Path:
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def _simulate(run_dir: Path, profile: Path, out: Path) -> int:
    return main(["simulate", str(run_dir), "--inter-bw", "1Gbit", "--compute-profile",
                 str(profile), "--out", str(out)])


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("{not json", "is not readable JSON"),
        ({"format": "something-else"}, "is not a compute profile"),
        ({k: v for k, v in PROFILE.items() if k != "optimizer_s"}, "it lacks optimizer_s"),
        ({**PROFILE, "optimizer_s": -1.0}, "optimizer_s is -1.0"),
        ({**PROFILE, "forward_backward_s": "fast"}, "forward_backward_s is 'fast'"),
        ({**PROFILE, "method": "nope"}, "method 'nope' is not one of"),
    ],
)
def test_a_damaged_profile_is_one_sentence_exit_2_and_nothing_written(tmp_path, capsys,
                                                                      content, says):
    profile = _write(tmp_path / "p.json", content)
    out = tmp_path / "sim.csv"
    assert _simulate(RECORDED, profile, out) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and err.count("\n") == 0
    assert not out.exists()


def test_a_profile_of_another_method_or_batch_is_refused(tmp_path, capsys):
    out = tmp_path / "sim.csv"
    assert _simulate(RECORDED, _write(tmp_path / "p.json", PROFILE), out) == 2
    assert "is of method 'flexdemo', and the recording's is 'hsdp-adamw'" in capsys.readouterr().err
    other = {**PROFILE, "method": "hsdp-adamw", "batch_size": 32}
    assert _simulate(RECORDED, _write(tmp_path / "q.json", other), out) == 2
    assert "is of batch_size 32, and the recording's is 16" in capsys.readouterr().err
    assert not out.exists()


def test_a_recording_without_backward_marks_is_refused(tmp_path, capsys):
    # The committed quick sweep was recorded before runs marked the backward.
    profile = _write(tmp_path / "p.json", {**PROFILE, "method": "hsdp-adamw"})
    assert _simulate(RECORDED, profile, tmp_path / "sim.csv") == 2
    assert "has no backward marks" in capsys.readouterr().err


def test_profile_compute_refuses_bad_flags_before_running(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["profile-compute", "--workload", "lm-tiny", "--method", "flexdemo", "--steps",
                 "4", "--skip-steps", "4", "--out", str(out)]) == 2
    assert "--skip-steps must be >= 0 and below --steps 4, got 4." in capsys.readouterr().err
    assert main(["profile-compute", "--workload", "lm-tiny", "--method", "flexdemo",
                 "--backend", "nccl", "--out", str(out)]) == 2  # this machine has no GPU
    assert "nccl" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_profile_then_replay_sets_each_phase(tmp_path, capsys):
    cfg = RunConfig(method="flexdemo", workload="lm-tiny", nodes=2, gpus_per_node=1, steps=6,
                    eval_every=7)
    run = read_run(launch(cfg, tmp_path / "rec", quiet=True))
    fb, opt = compute_phases(run.trace)
    assert fb > 0 and opt > 0
    as_recorded = replay(run, ReplayTarget(inter_bw="1Gbit")).frame["step_time_s"]
    # The recording's own phases replayed: every scale is 1, the replay as recorded.
    same = replay(run, ReplayTarget(inter_bw="1Gbit", compute=ComputeBasis(phases=(fb, opt))))
    assert same.phases.scales() == pytest.approx((1.0, 1.0))
    assert same.frame["step_time_s"].tolist() == pytest.approx(as_recorded.tolist(), rel=1e-9)
    # Twice each phase: the same as twice all compute.
    doubled = replay(run, ReplayTarget(inter_bw="1Gbit",
                                        compute=ComputeBasis(phases=(2 * fb, 2 * opt))))
    scaled = replay(run, ReplayTarget(inter_bw="1Gbit", compute=ComputeBasis(scale=2.0),
                                       intra="recorded", overlap="recorded"))
    assert doubled.frame["step_time_s"].tolist() == pytest.approx(
        scaled.frame["step_time_s"].tolist(), rel=1e-9)

    profile_file = tmp_path / "profile.json"
    assert main(["profile-compute", "--workload", "lm-tiny", "--method", "flexdemo", "--steps",
                 "5", "--skip-steps", "2", "--out", str(profile_file)]) == 0
    profile = load_profile(profile_file)
    assert (profile.device, profile.backend, profile.nodes, profile.steps) == ("cpu", "gloo", 2, 3)
    assert [p.name for p in tmp_path.iterdir()].count("profile.json") == 1  # its run is gone
    capsys.readouterr()
    assert _simulate(run.path, profile_file, tmp_path / "sim.csv") == 0
    printed = capsys.readouterr().out
    assert "compute: profiled on" in printed and "intra-node: none" in printed
    assert (tmp_path / "sim.csv").exists()
