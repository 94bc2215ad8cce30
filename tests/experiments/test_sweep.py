"""Sweep config parsing, unit planning, resumption, failures and aggregation (fake runs)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from experiments.replay.target import ReplayTarget  # noqa: E402
from tests.experiments.sweep_fakes import (
    COMPUTE_S,
    EVAL_EVERY,
    FAKE_BYTES,
    ensure_units_module,
    fake_launch,
    fake_loss,
    fake_simulate,
)

ensure_units_module()

from experiments import cli, sweep  # noqa: E402
from experiments.config import ConfigError  # noqa: E402
from netsim.model import Replay  # noqa: E402

CONFIG = """
name = "t"
timeout_s = 30

[run]
workload = "lm-tiny"
nodes = 2
gpus_per_node = 1
steps = 20

[grid]
methods = ["hsdp-adamw", "flexdemo", "diloco"]
inter_bw = ["10Mbit", "1Gbit"]
inter_lat = ["1ms", "20ms"]
seeds = [0, 1]

[grid.knobs.diloco]
diloco_h = [5, 10]

[[validate]]
method = "flexdemo"
inter_bw = "100Mbit"
inter_lat = "1ms"
"""


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "t.toml"
    path.write_text(CONFIG)
    return path


@pytest.fixture
def calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "calls.txt"
    monkeypatch.setenv("FAKE_CALLS", str(path))
    return path


def _launched(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


@pytest.mark.timeout(30)
def test_units_cover_the_grid_once_per_method_knob_and_seed(config_file: Path) -> None:
    cfg = sweep.load_config(config_file)
    units = sweep.units_of(cfg)
    train = [u for u in units if u.kind == "train"]
    # hsdp-adamw 2 seeds + flexdemo 2 seeds + diloco 2 knobs x 2 seeds, then one validation.
    assert len(train) == 8
    assert [u.kind for u in units].count("validate") == 1
    assert len({u.id for u in units}) == len(units)
    assert all(u.config.shaping == "off" and u.config.inter_bw is None for u in train)
    assert {u.config.diloco_h for u in train if u.method == "diloco"} == {5, 10}
    check = units[-1]
    assert check.config.shaping == "wall" and check.config.inter_bw == "100Mbit"
    assert check.seed == 0 and check.method == "flexdemo"
    assert len(cfg.networks) == 4
    assert cfg.networks[0].link.bandwidth == pytest.approx(10e6 / 8)


@pytest.mark.timeout(30)
def test_a_variant_adds_units_and_leaves_the_plain_methods_as_they_were(
    config_file: Path,
) -> None:
    plain = sweep.units_of(sweep.load_config(config_file))
    cfg = sweep.load_config(config_file, ["grid.variants=[{method='flexdemo', decay=0.9}]"])
    units = sweep.units_of(cfg)
    added = [u for u in units if u.id not in {p.id for p in plain}]
    assert [u.id for u in added] == ["flexdemo-decay=0.9-s0", "flexdemo-decay=0.9-s1"]
    assert {u.variant for u in added} == {"flexdemo[decay=0.9]"}
    assert {u.config.decay for u in added} == {0.9}
    assert [u.id for u in units if u not in added] == [p.id for p in plain]
    assert all(u.config.decay is None for u in units if u.method == "flexdemo" and u not in added)
    # the variant's units sit beside their method's, so tables list them together
    ids = [u.id for u in units]
    assert ids.index("flexdemo-decay=0.9-s0") == ids.index("flexdemo-s1") + 1


@pytest.mark.timeout(30)
def test_set_overrides_use_toml_values_and_dotted_keys(config_file: Path) -> None:
    cfg = sweep.load_config(config_file, ["grid.seeds=[3]", "run.steps=7", "target.val_loss=2.5",
                                          "run.workload=vision-tiny"])
    assert cfg.seeds == [3]
    assert cfg.target == 2.5
    units = sweep.units_of(cfg)
    assert {u.config.steps for u in units} == {7}
    assert {u.config.workload for u in units} == {"vision-tiny"}
    assert {u.seed for u in units} == {3}
    assert cfg.fingerprint() != sweep.load_config(config_file).fingerprint()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("grid.methods=['sgd']", "unknown method 'sgd'"),
        ("run.workload=resnet", "unknown workload 'resnet'"),
        ("grid.methods=[]", "grid.methods is empty"),
        ("grid.seeds=[]", "grid.seeds is empty"),
        ("grid.inter_bw=['fast']", "inter_bw 'fast' does not parse"),
        ("grid.inter_lat=['soon']", "inter_lat 'soon' does not parse"),
        ("target.val_loss=low", "target.val_loss must be a finite number > 0, got 'low'"),
        ("target.baseline_fraction=1.5", "baseline_fraction must be a number in (0, 1]"),
        ("run.method=demo", "run.method is set per unit"),
        ("run.stepz=3", "unknown run setting 'stepz'"),
        ("grid.knobs.sgd.topk=[8]", "unknown method 'sgd'"),
        ("grid.knobs.flexdemo.topkk=[8]", "topkk is not a run setting"),
        ("grid.methods=['flexdemo', 'diloco']", "add 'hsdp-adamw' to grid.methods"),
        ("grid.variants={method='flexdemo'}", "grid.variants must be a list"),
        ("grid.variants=[{method='demo', decay=0.9}]",
         "grid.variants[0].method must be one of grid.methods"),
        ("grid.variants=[{method='flexdemo'}]", "sets nothing but the method"),
        ("grid.variants=[{method='flexdemo', decayy=0.9}]", "decayy is not a run setting"),
        ("grid.variants=[{method='flexdemo', decay=[0.9, 0.8]}]", "decay must be one value"),
        ("grid.variants=[{method='hsdp-adamw', decay=0.9}]", "'hsdp-adamw' does not read decay"),
        ("grid.variants=[{method='diloco', diloco_h=5}]", "two units share the id"),
    ],
)
def test_bad_input_names_the_value(config_file: Path, override: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        sweep.load_config(config_file, [override])
    assert needle in str(info.value)


@pytest.mark.timeout(30)
def test_bad_input_through_cli_exits_2_and_writes_nothing(
    config_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "res"
    code = cli.main(["sweep", str(config_file), "--out", str(out), "--set", "grid.inter_bw=['x']"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "inter_bw 'x' does not parse" in err[0]
    assert not out.exists()


@pytest.mark.timeout(30)
def test_validate_entry_must_match_a_trained_unit(config_file: Path) -> None:
    text = config_file.read_text().replace('inter_lat = "1ms"\n"""', "") + "seed = 9\n"
    config_file.write_text(text)
    with pytest.raises(ConfigError, match="no trained unit for flexdemo seed 9"):
        sweep.load_config(config_file)


def _run(cfg_path: Path, out: Path, **kw: object) -> pd.DataFrame:
    cfg = sweep.load_config(cfg_path)
    return sweep.run_sweep(cfg, out, launcher=fake_launch, simulator=fake_simulate,
                           progress=False, **kw)


@pytest.mark.timeout(60)
def test_sweep_times_every_unit_on_every_point_and_scores_against_hsdp(
    config_file: Path, tmp_path: Path, calls: Path
) -> None:
    out = tmp_path / "res"
    runs = _run(config_file, out)
    assert len(_launched(calls)) == 9
    sim = runs[runs["source"] == "sim"]
    # 8 trained units x 4 grid points, plus flexdemo seed 0 at the validation point.
    assert len(sim) == 8 * 4 + 1
    assert len(runs[runs["source"] == "measured"]) == 1
    assert set(runs["status"]) == {"done"}
    # Default target: median of hsdp-adamw's final val_loss over seeds, plus 2%.
    finals = [fake_loss("hsdp-adamw", s, 20) for s in (0, 1)]
    target = (sum(finals) / 2) * 1.02
    assert runs["target_val_loss"].iloc[0] == pytest.approx(target)
    # flexdemo seed 0 at 10Mbit / 1ms, by hand: first evaluation at or under the target.
    step = next(s for s in range(EVAL_EVERY, 21, EVAL_EVERY)
                if fake_loss("flexdemo", 0, s) <= target)
    per_step = COMPUTE_S + FAKE_BYTES["flexdemo"] / (10e6 / 8) + 3 * 1e-3
    row = sim[(sim["variant"] == "flexdemo") & (sim["seed"] == 0)
              & (sim["network"] == "10Mbit / 1ms")]
    assert row["time_to_target_s"].item() == pytest.approx(step * per_step)
    assert row["reached"].item()
    assert row["inter_bytes_per_step"].item() == FAKE_BYTES["flexdemo"]
    # The diloco knob shows up as its own variant.
    assert {"diloco[diloco_h=5]", "diloco[diloco_h=10]"} <= set(runs["variant"])
    steps = pd.read_parquet(out / "steps.parquet")
    assert {"time_s", "network", "source", "variant", "val_loss"} <= set(steps.columns)
    assert len(steps) == (8 * 4 + 1 + 1) * 20
    meta = json.loads((out / "sweep.json").read_text())
    assert meta["name"] == "t" and set(meta["units"].values()) == {"done"}
    assert "versions" in meta and "git_commit" in meta
    assert pd.read_parquet(out / "runs.parquet").shape == runs.shape
    table = pd.read_parquet(out / "speedups.parquet").set_index(["source", "network", "variant"])
    fast = table.loc[("sim", "1Gbit / 1ms", "flexdemo")]
    hsdp = sim[(sim["method"] == "hsdp-adamw") & (sim["network"] == "1Gbit / 1ms")]
    mine = sim[(sim["variant"] == "flexdemo") & (sim["network"] == "1Gbit / 1ms")]
    per_seed = hsdp["time_to_target_s"].median() / mine["time_to_target_s"]
    assert fast["speedup_median"] == pytest.approx(per_seed.median())
    assert fast["speedup_min"] == pytest.approx(per_seed.min())


@pytest.mark.timeout(60)
def test_restart_skips_done_units_and_keeps_failures_recorded(
    config_file: Path, tmp_path: Path, calls: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "res"
    monkeypatch.setenv("FAKE_FAIL_UNIT", "flexdemo-s1")
    runs = _run(config_file, out)
    failed = runs[runs["unit"] == "flexdemo-s1"]
    # The failed unit stays in the table on every grid point, as not reached, with its error.
    assert len(failed) == 4
    assert set(failed["status"]) == {"failed"}
    assert not failed["reached"].any() and (failed["time_to_target_s"] == math.inf).all()
    assert "timed out" in failed["error"].iloc[0]
    assert json.loads((out / "failed" / "flexdemo-s1.json").read_text())["error"]
    assert len(_launched(calls)) == 8

    calls.unlink()
    _run(config_file, out)
    assert _launched(calls) == []  # done and failed units are both left alone

    monkeypatch.delenv("FAKE_FAIL_UNIT")
    runs = _run(config_file, out, retry_failed=True)
    assert _launched(calls) == ["flexdemo-s1"]
    assert set(runs["status"]) == {"done"}
    assert not (out / "failed" / "flexdemo-s1.json").exists()


@pytest.mark.timeout(60)
def test_debris_of_a_killed_unit_is_rerun(config_file: Path, tmp_path: Path, calls: Path) -> None:
    out = tmp_path / "res"
    _run(config_file, out)
    unit_dir = out / "units" / "hsdp-adamw-s0"
    (unit_dir / "run.json").unlink()  # as if killed before the launcher's final rename
    partial = unit_dir.parent / ".hsdp-adamw-s0.partial-123"
    partial.mkdir()  # the launcher's build folder of a killed run
    calls.unlink()
    runs = _run(config_file, out)
    assert _launched(calls) == ["hsdp-adamw-s0"]
    assert not partial.exists()
    assert set(runs["status"]) == {"done"}


@pytest.mark.timeout(60)
def test_output_folder_of_another_sweep_is_refused(config_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "res"
    _run(config_file, out)
    before = sorted(p.name for p in out.rglob("*"))
    other = sweep.load_config(config_file, ["grid.seeds=[0]"])
    with pytest.raises(ConfigError, match="holds a different sweep"):
        sweep.run_sweep(other, out, launcher=fake_launch, simulator=fake_simulate, progress=False)
    assert sorted(p.name for p in out.rglob("*")) == before
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="holds no sweep.json"):
        sweep.run_sweep(other, stranger, launcher=fake_launch, simulator=fake_simulate,
                        progress=False)


@pytest.mark.timeout(60)
def test_explicit_target_and_simulation_cache(config_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "res"
    cfg = sweep.load_config(config_file, ["target.val_loss=2.3"])
    runs = sweep.run_sweep(cfg, out, launcher=fake_launch, simulator=fake_simulate,
                           progress=False)
    assert (runs["target_val_loss"] == 2.3).all()
    # diloco learns slowly in the fake and never reaches 2.3 within 20 steps.
    diloco = runs[runs["method"] == "diloco"]
    assert not diloco["reached"].any()

    def broken(*_: object, **__: object) -> pd.DataFrame:
        raise AssertionError("the cached axis should have been used")

    again = sweep.collect(cfg, out, simulator=broken, progress=False)
    pd.testing.assert_frame_equal(again, runs)
    calls: list[int] = []

    def slower(run_dir: Path, target: ReplayTarget) -> Replay:
        calls.append(1)
        replay = fake_simulate(run_dir, target)
        axis = replay.frame
        return dataclasses.replace(replay, frame=axis.assign(step_time_s=axis["step_time_s"] * 2,
                                                             time_s=axis["time_s"] * 2))

    resimulated = sweep.run_sweep(cfg, out, launcher=broken, simulator=slower, resimulate=True,
                                  progress=False)
    # Every simulated row, and each validation point's own-compute replay.
    assert len(calls) == len(runs[runs["source"] == "sim"]) + (runs["source"] == "measured").sum()
    done = resimulated["reached"] & (resimulated["source"] == "sim")
    assert (resimulated.loc[done, "time_to_target_s"]
            == 2 * runs.loc[done, "time_to_target_s"]).all()
    # Another target only re-scores the finished runs: same folder, nothing retrained.
    looser = sweep.load_config(config_file, ["target.val_loss=4.0"])
    rescored = sweep.run_sweep(looser, out, launcher=broken, simulator=broken, progress=False)
    assert (rescored["target_val_loss"] == 4.0).all() and rescored["reached"].all()


@pytest.mark.timeout(60)
def test_submitit_debug_executor_runs_units(config_file: Path, tmp_path: Path, calls: Path) -> None:
    out = tmp_path / "res"
    cfg = sweep.load_config(config_file, ["grid.methods=['hsdp-adamw']", "grid.seeds=[0]",
                                          "validate=[]"])
    runs = sweep.run_sweep(cfg, out, executor="debug", launcher=fake_launch,
                           simulator=fake_simulate, progress=False)
    assert _launched(calls) == ["hsdp-adamw-s0"]
    assert set(runs["status"]) == {"done"} and len(runs) == 4
    assert (out / "submitit").is_dir()


@pytest.mark.timeout(60)
def test_cli_prints_markdown_summary(
    config_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch
) -> None:
    import experiments.sweep.executors as executors

    monkeypatch.setattr(executors, "default_launcher", lambda: fake_launch)
    import experiments.sweep.score as score

    monkeypatch.setattr(score, "_default_simulator", lambda: fake_simulate)
    out = tmp_path / "res"
    assert cli.main(["sweep", str(config_file), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| method |" in text and "10Mbit / 1ms" in text and "flexdemo" in text
    assert "Cost model vs wall-shaped real runs" in text
    assert cli.main(["sweep", str(config_file), "--out", str(out), "--dry-run"]) == 0
    assert "9 units, 4 network points" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_interrupted_sweep_resumes_where_it_stopped(
    config_file: Path, tmp_path: Path, calls: Path
) -> None:
    out = tmp_path / "res"
    seen: list[str] = []

    def interrupted(cfg, run_out, **kw):
        if len(seen) == 3:
            raise KeyboardInterrupt  # Ctrl-C (or a kill) in the middle of the fourth unit
        seen.append(cfg.extra["unit"])
        return fake_launch(cfg, run_out, **kw)

    cfg = sweep.load_config(config_file)
    with pytest.raises(KeyboardInterrupt):
        sweep.run_sweep(cfg, out, launcher=interrupted, simulator=fake_simulate, progress=False)
    meta = json.loads((out / "sweep.json").read_text())
    assert sorted(k for k, v in meta["units"].items() if v == "done") == sorted(seen)
    assert not (out / "runs.parquet").exists()  # nothing half-aggregated
    calls.unlink()
    runs = _run(config_file, out)
    assert len(_launched(calls)) == 9 - 3 and not set(_launched(calls)) & set(seen)
    assert set(runs["status"]) == {"done"}


@pytest.mark.timeout(60)
def test_baseline_fraction_target_is_the_baselines_loss_at_that_point(
    config_file: Path, tmp_path: Path
) -> None:
    from tests.experiments.sweep_fakes import EVAL_EVERY

    cfg = sweep.load_config(config_file, ["target.baseline_fraction=0.6"])
    runs = sweep.run_sweep(cfg, tmp_path / "res", launcher=fake_launch,
                           simulator=fake_simulate, progress=False)
    # 20 steps: the first evaluation at or after step 12, median over the baseline's seeds.
    step = next(s for s in range(12, 21) if s % EVAL_EVERY == 0)
    seeds = sorted(set(runs["seed"]))
    expected = float(np.median([fake_loss("hsdp-adamw", s, step) for s in seeds]))
    assert runs["target_val_loss"].iloc[0] == pytest.approx(expected)
    hsdp = runs[(runs["method"] == "hsdp-adamw") & (runs["source"] == "sim")]
    assert hsdp["reached"].all()
    with pytest.raises(ConfigError, match="not both"):
        sweep.load_config(config_file, ["target.baseline_fraction=0.6", "target.val_loss=2.0"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rule", [[], ["target.baseline_fraction=0.6"]])
def test_a_diverged_baseline_never_sets_the_target(config_file: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    rule: list[str]) -> None:
    from tests.experiments.sweep_fakes import EVAL_EVERY

    monkeypatch.setenv("FAKE_DIVERGE_UNIT", "hsdp-adamw-s1")
    cfg = sweep.load_config(config_file, rule)
    runs = sweep.run_sweep(cfg, tmp_path / "res", launcher=fake_launch,
                           simulator=fake_simulate, progress=False)
    # Seed 0 alone: seed 1's curve, cut at its divergence, would have set a looser target.
    if rule:
        step = next(s for s in range(12, 21) if s % EVAL_EVERY == 0)
        expected = fake_loss("hsdp-adamw", 0, step)
    else:
        expected = fake_loss("hsdp-adamw", 0, 20) * 1.02
    assert runs["target_val_loss"].iloc[0] == pytest.approx(expected)


@pytest.mark.timeout(60)
def test_a_unit_stopped_by_sigterm_reruns_on_resume(config_file: Path, tmp_path: Path,
                                                    calls: Path) -> None:
    from experiments.errors import Stopped
    from experiments.run.rank import raise_on_sigterm

    previous = raise_on_sigterm()  # what the real launcher installs around a run
    try:
        with pytest.raises(Stopped):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises in this thread at once
    finally:
        signal.signal(signal.SIGTERM, previous)

    def stopped_at_diloco(cfg, out, **kw):
        if cfg.method == "diloco":
            raise Stopped("stopped by SIGTERM")
        return fake_launch(cfg, out, **kw)

    out = tmp_path / "res"
    cfg = sweep.load_config(config_file)
    with pytest.raises(Stopped):  # the sweep stops too: it does not go on to the next unit
        sweep.run_sweep(cfg, out, launcher=stopped_at_diloco, simulator=fake_simulate,
                        progress=False)
    assert not (out / "failed").exists() or not any((out / "failed").iterdir())
    stopped = [u for u in _launched(calls) if u.startswith("diloco")]
    assert len(stopped) == 0 and not (out / sweep.runner.LOCK).exists()
    calls.unlink()
    runs = _run(config_file, out)  # a plain resume reruns it
    assert any(u.startswith("diloco") for u in _launched(calls))
    assert set(runs["status"]) == {"done"}


@pytest.mark.timeout(60)
def test_one_sweep_per_folder_at_a_time(config_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "res"
    _run(config_file, out)
    other = subprocess.Popen(["sleep", "60"])  # a live process holding the folder
    try:
        (out / sweep.runner.LOCK).write_text(f"{other.pid}\n")
        with pytest.raises(ConfigError, match=f"another sweep \\(pid {other.pid}\\) is running"):
            _run(config_file, out)
    finally:
        other.kill()
        other.wait()
    runs = _run(config_file, out)  # its holder is gone: the lock is taken over
    assert set(runs["status"]) == {"done"} and not (out / sweep.runner.LOCK).exists()


def _time_at(runs: pd.DataFrame, unit: str, lat: str) -> float:
    row = runs[(runs["unit"] == unit) & (runs["inter_lat"] == lat) & (runs["source"] == "sim")]
    return float(row["time_to_target_s"].iloc[0])


@pytest.mark.timeout(60)
def test_a_retrained_unit_is_replayed_anew_not_read_from_the_old_cache(
        config_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "res"
    before = _time_at(_run(config_file, out), "hsdp-adamw-s0", "1ms")
    shutil.rmtree(out / "units" / "hsdp-adamw-s0")  # the user deletes a unit and resumes
    monkeypatch.setenv("FAKE_BYTES_SCALE", "3")  # its new run sends three times the bytes
    after = _time_at(_run(config_file, out), "hsdp-adamw-s0", "1ms")
    assert after > 2 * before


@pytest.mark.timeout(60)
def test_points_with_like_labels_have_caches_of_their_own(config_file: Path,
                                                          tmp_path: Path) -> None:
    cfg = sweep.load_config(config_file, ["grid.inter_bw=['100Mbit']",
                                          "grid.inter_lat=['5µs', '5 s']"])
    assert len({net.slug for net in cfg.networks}) == 1  # both labels make one file name
    runs = sweep.run_sweep(cfg, tmp_path / "res", launcher=fake_launch, simulator=fake_simulate,
                           progress=False)
    # 3 calls a step at 5 s each: the slow point is seconds per step slower, not the same.
    assert _time_at(runs, "hsdp-adamw-s0", "5 s") > _time_at(runs, "hsdp-adamw-s0", "5µs") + 10
