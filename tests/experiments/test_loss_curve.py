"""Loss at other node counts, stated: which recording's curve a replay uses, the declared rule
beside every time to target and in the replay's sidecar, and gossip's refusal at an unrecorded
node count."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from experiments.cli import main
from experiments.errors import ConfigError
from experiments.replay.loss_curve import (
    LossScaling,
    Recording,
    choose_loss_curve,
    parse_loss_scaling,
)
from experiments.scoring.targets import time_to_target

ROOT = Path(__file__).resolve().parents[2]
QUICK = ROOT / "results" / "quick" / "units"
DEC = ROOT / "results" / "decentralized" / "units"
NET = ["--inter-bw", "1Gbit", "--inter-lat", "1ms"]


def _simulate(capsys, tmp_path, *argv: str) -> tuple[int, str, Path]:
    out = tmp_path / "sim.csv"
    rc = main(["simulate", *argv, *NET, "--out", str(out)])
    return rc, capsys.readouterr().out, out


def _synthetic(nodes: int, gpus: int, batch: int | None, *, path: str = "rec",
               method: str = "hsdp-adamw") -> Recording:
    steps = pd.DataFrame({"step": range(1, 101),
                          "val_loss": [4.0 - 0.02 * s if s % 10 == 0 else math.nan
                                       for s in range(1, 101)]})
    return Recording(Path(path), method, "lm-tiny", None, nodes, gpus, batch, steps, 2.0)


def test_rules_parse_and_a_bad_one_is_one_sentence():
    assert parse_loss_scaling(None) == parse_loss_scaling("none") == LossScaling()
    assert parse_loss_scaling("linear-to-critical-batch:512") == LossScaling(
        "linear-to-critical-batch", 512)
    for bad in ("linear", "linear-to-critical-batch:0", "linear-to-critical-batch:x", "sqrt"):
        with pytest.raises(ConfigError, match=r"^--loss-scaling .* is not a rule; .*\.$"):
            parse_loss_scaling(bad)


@pytest.mark.parametrize("target_nodes, critical, k", [(8, 10**6, 4), (8, 128, 2), (1, 10**6, 0.5),
                                                       (64, 256, 4)])
def test_linear_to_critical_batch_equals_its_closed_form(target_nodes, critical, k):
    # Recorded at 2 x 2 x 16 = 64 samples; the target's batch is target_nodes x 2 x 16.
    rule = LossScaling("linear-to-critical-batch", critical)
    curve = choose_loss_curve([_synthetic(2, 2, 16)], nodes=target_nodes, gpus_per_node=2,
                              rule=rule)
    b0, b = 64, target_nodes * 32
    assert float(curve.factor) == k == min(b, critical) / min(b0, critical)
    step_s = 0.25  # a constant simulated step: the closed form is ceil(s* / k) * step_s
    frame = pd.DataFrame({"step": range(1, 1001)}).assign(time_s=lambda f: f["step"] * step_s)
    points = curve.on_time_axis(frame)
    target = 3.0  # first reached at recorded step 50 (4.0 - 0.02 * 50)
    assert time_to_target(points["time_s"], points["val_loss"], target) == \
        math.ceil(50 / k) * step_s
    assert curve.steps_needed() == math.ceil(100 / k)


def test_nearest_global_batch_among_synthetic_recordings():
    recs = [_synthetic(2, 2, 16, path="a"), _synthetic(8, 1, 16, path="b"),
            _synthetic(32, 1, 16, path="c")]
    pick = {n: choose_loss_curve(recs, nodes=n, gpus_per_node=1, rule=LossScaling())
            for n in (1, 4, 6, 12, 20, 1024)}
    # Nearest by ratio: 6 is nearer 8 than 4, 20 nearer 32 (x1.6) than 8 (x2.5); ties go first.
    assert {n: c.recording.path.name for n, c in pick.items()} == {
        1: "a", 4: "a", 6: "b", 12: "b", 20: "c", 1024: "c"}
    assert all(c.trace_from == Path("a") for c in pick.values())


def test_several_recordings_pick_the_nearest_global_batch(capsys, tmp_path):
    four, eight = DEC / "ada-nodes=4-s0", DEC / "ada-nodes=8-s0"
    rc, out, csv = _simulate(capsys, tmp_path, str(four), "--loss-from", str(eight),
                             "--nodes", "8")
    assert rc == 0
    assert f"trace from {four}; loss curve from {eight} (8 x 1, global batch 128)" in out
    assert "predicted time to val_loss <= 2.5107:" in out  # ada-nodes=8-s0's own final loss
    assert "(loss curve of ada-nodes=8-s0 at 8 x 1, global batch 128; --loss-scaling none)" in out
    stored = json.loads(csv.with_suffix(".loss.json").read_text())
    assert (stored["trace_from"], stored["loss_curve_from"]) == (str(four), str(eight))
    # At 4 nodes the 4-node recording is nearest, whichever is given first.
    rc, out, _ = _simulate(capsys, tmp_path, str(eight), "--loss-from", str(four),
                           "--nodes", "4")
    assert rc == 0 and f"loss curve from {four} (4 x 1, global batch 64)" in out


def test_gossip_at_another_node_count_refuses_a_time_to_target(capsys, tmp_path):
    ring4, ring8 = DEC / "gossip-nodes=4_graph=ring-s0", DEC / "gossip-nodes=8_graph=ring-s0"
    rc, out, csv = _simulate(capsys, tmp_path, str(ring4), "--nodes", "8",
                             "--loss-scaling", "linear-to-critical-batch:512")
    assert rc == 0 and csv.exists()  # the step times still hold
    assert "predicted time to" not in out
    refusal = [line for line in out.splitlines() if line.startswith("no time to val_loss")]
    assert len(refusal) == 1 and refusal[0].endswith(
        "the recordings are at 4 nodes, not 8: give one at 8 nodes with --loss-from RUN.")
    stored = json.loads(csv.with_suffix(".loss.json").read_text())
    assert stored["refusal"] and stored["time_to_target_s"] is None
    # With a recording at 8 nodes the time is given, from that recording's curve.
    rc, out, _ = _simulate(capsys, tmp_path, str(ring4), "--nodes", "8", "--loss-from",
                           str(ring8))
    assert rc == 0 and "predicted time to val_loss" in out and "no time to" not in out
    assert f"loss curve from {ring8}" in out


def test_the_rule_is_printed_beside_the_time_and_stored(capsys, tmp_path):
    run = QUICK / "hsdp-adamw-s0"
    rc, out, csv = _simulate(capsys, tmp_path, str(run), "--nodes", "64", "--gpus-per-node",
                             "8", "--loss-scaling", "linear-to-critical-batch:512")
    assert rc == 0
    # The committed recording's own shape and batch (results/quick: 2 x 1 x 16, batch 32).
    cfg = json.loads((run / "run.json").read_text())["config"]
    nodes, gpus, steps = cfg["nodes"], cfg["gpus_per_node"], cfg["steps"]
    recorded_batch = nodes * gpus * cfg["batch_size"]
    ttt = [line for line in out.splitlines() if line.startswith("predicted time to")]
    assert len(ttt) == 1 and ttt[0].endswith(
        f"(loss curve of hsdp-adamw-s0 at {nodes} x {gpus}, global batch {recorded_batch}; "
        "--loss-scaling linear-to-critical-batch:512)")
    sidecar = csv.with_suffix(".loss.json")
    assert f"loss curve and rule stored in {sidecar}" in out
    stored = json.loads(sidecar.read_text())
    assert stored["loss_scaling"] == "linear-to-critical-batch:512"
    global_batch = 64 * 8 * cfg["batch_size"]
    assert (stored["recorded_global_batch"], stored["global_batch"]) == (recorded_batch,
                                                                         global_batch)
    k = 512 // recorded_batch  # the critical batch 512 caps the factor below 8192 / recorded
    assert stored["step_factor"] == str(k) and stored["reached"]
    # k = 512 / the recorded batch: the replay covers the curve's recorded steps in ceil(steps / k).
    assert len(pd.read_csv(csv)) == math.ceil(steps / k)
    assert stored["time_to_target_s"] == pytest.approx(float(ttt[0].split(": ")[1].split()[0]),
                                                       abs=0.005)
    # The default rule is stated too, as none.
    rc, out, _ = _simulate(capsys, tmp_path, str(run), "--nodes", "64")
    assert rc == 0 and "--loss-scaling none)" in out and "(rule none, an assumption)" in out


def test_a_same_shape_replay_states_nothing_and_writes_no_sidecar(capsys, tmp_path):
    rc, out, csv = _simulate(capsys, tmp_path, str(QUICK / "flexdemo-s0"))
    assert rc == 0 and "loss curve" not in out
    assert not csv.with_suffix(".loss.json").exists()


def test_a_loss_recording_of_another_method_is_one_sentence(capsys, tmp_path):
    rc = main(["simulate", str(DEC / "ada-nodes=4-s0"), "--loss-from",
               str(DEC / "hsdp-adamw-nodes=8-s0"), *NET, "--out", str(tmp_path / "s.csv")])
    assert rc == 2 and not (tmp_path / "s.csv").exists()
    err = capsys.readouterr().err
    assert "has method 'hsdp-adamw', not 'ada'" in err and err.count("\n") == 1


def test_a_run_without_batch_size_compares_by_ranks_but_takes_no_batch_rule():
    old = [_synthetic(4, 1, None, path="four"), _synthetic(8, 1, None, path="eight")]
    curve = choose_loss_curve(old, nodes=8, gpus_per_node=1, rule=LossScaling())
    assert curve.recording.path.name == "eight" and curve.factor == 1
    assert "global batch unknown (no batch_size in run.json)" in curve.label()
    with pytest.raises(ConfigError, match="needs each run's global batch"):
        choose_loss_curve(old, nodes=8, gpus_per_node=1,
                          rule=parse_loss_scaling("linear-to-critical-batch:64"))
    with pytest.raises(ConfigError, match="cannot be compared with the other runs'"):
        choose_loss_curve([*old, _synthetic(2, 2, 16)], nodes=8, gpus_per_node=1,
                          rule=LossScaling())
