"""`flexbench compare`: its prediction at a grid point is the sweep's table; its refusals."""

from __future__ import annotations

import json
import math
import shutil
import statistics
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from experiments import cli
from experiments.errors import ConfigError
from experiments.replay import compare, compare_cli
from experiments.scoring import speedups, step_noise

ROOT = Path(__file__).resolve().parents[2]
QUICK = ROOT / "results" / "quick"
pytestmark = pytest.mark.skipif(not (QUICK / "runs.parquet").exists(),
                                reason="needs the committed results/quick sweep")


def _compare(*argv: str) -> compare.Comparison:
    """The comparison `flexbench compare ARGV` prints (one network)."""
    args = cli.build_parser(["compare", *argv]).parse_args(["compare", *argv])
    (target,) = compare_cli.grid_targets(args)
    return compare.compare(compare_cli.question_of(args), target)


@pytest.mark.timeout(120)
def test_at_a_grid_point_compare_equals_the_sweeps_table(capsys: pytest.CaptureFixture) -> None:
    result = _compare(str(QUICK), "--inter-bw", "100Mbit", "--inter-lat", "20ms")
    runs = pd.read_parquet(QUICK / "runs.parquet")
    sim = runs[(runs["source"] == "sim") & (runs["network"] == "100Mbit / 20ms")]
    mine = result.runs.set_index(["variant", "seed"])["time_to_target_s"]
    theirs = sim.set_index(["variant", "seed"])["time_to_target_s"]
    assert len(mine) == len(theirs) == 10  # 4 methods and a variant, 2 seeds each
    pd.testing.assert_series_equal(mine.sort_index(), theirs.sort_index(), rtol=1e-12,
                                   check_names=False)
    assert result.target == pytest.approx(sim["target_val_loss"].iloc[0], rel=1e-12)
    # The same numbers make the same table as the sweep's summary.
    table = speedups.speedups(sim, by=("network",)).set_index("variant")
    ranked = result.table.set_index("variant")
    for column in ("ttt_median_s", "ttt_low_s", "ttt_high_s", "speedup_median", "speedup_low",
                   "speedup_high"):
        pd.testing.assert_series_equal(ranked[column].sort_index(), table[column].sort_index(),
                                       rtol=1e-12)
    # Ranked fastest first; the sentence names the first and its speed-up with its bracket.
    assert list(result.table["ttt_median_s"]) == sorted(result.table["ttt_median_s"])
    first = result.table.iloc[0]
    assert result.sentence.startswith(f"{first['variant']} first, "
                                      f"{first['speedup_median']:.2f}× [")
    assert any("range (min–max), not an interval" in a for a in result.assumptions)


def _copy_runs(tmp_path: Path, *units: str) -> list[Path]:
    copies = []
    for unit in units:
        copies.append(tmp_path / unit)
        shutil.copytree(QUICK / "units" / unit, copies[-1])
    return copies


def _edit_run(path: Path, **changes: object) -> None:
    meta = json.loads((path / "run.json").read_text())
    for key, value in changes.items():
        if key == "workload":
            meta["config"]["workload"] = value
        else:
            meta[key] = value
    (path / "run.json").write_text(json.dumps(meta))


@pytest.mark.timeout(120)
def test_a_diverged_run_is_a_miss_named_in_the_output(tmp_path: Path) -> None:
    runs = _copy_runs(tmp_path, "hsdp-adamw-s0", "hsdp-adamw-s1", "flexdemo-s0", "flexdemo-s1")
    _edit_run(runs[3], status="diverged")
    result = _compare(*map(str, runs), "--inter-bw", "10Mbit", "--inter-lat", "1ms")
    flex = result.runs[result.runs["variant"] == "flexdemo"].set_index("seed")
    assert flex.loc[1, "time_to_target_s"] == math.inf and flex.loc[0, "reached"]
    # Its median over two seeds is inf: it ranks last, though it is 7x faster on seed 0 here.
    assert list(result.table["variant"]) == ["hsdp-adamw", "flexdemo"]
    assert any("flexdemo-s1 diverged" in a and "miss (inf)" in a for a in result.assumptions)
    # No sweep and no --target: the baseline's rule, said.
    finals = [json.loads((r / "run.json").read_text())["final_val_loss"] for r in runs[:2]]
    assert result.target == pytest.approx(statistics.median(finals) * 1.02)
    assert "median final val_loss over its 2 run(s) + 2%" in result.target_rule


@pytest.mark.timeout(120)
def test_run_folders_of_one_method_with_other_knobs_are_variants(tmp_path: Path) -> None:
    runs = _copy_runs(tmp_path, "hsdp-adamw-s0", "flexdemo-s0")
    tuned = tmp_path / "flexdemo-decay"
    shutil.copytree(runs[1], tuned)
    meta = json.loads((tuned / "run.json").read_text())
    meta["config"]["decay"] = 0.9  # its trace stays the default's: only the label is tested
    (tuned / "run.json").write_text(json.dumps(meta))
    result = _compare(*map(str, [*runs, tuned]), "--inter-bw", "10Mbit", "--inter-lat", "1ms",
                      "--target", "2.9")
    # Labelled as a sweep labels its variants; the run with every default keeps the bare name.
    assert sorted(result.runs["variant"]) == ["flexdemo", "flexdemo[decay=0.9]", "hsdp-adamw"]
    assert set(result.runs["method"]) == {"flexdemo", "hsdp-adamw"}


@pytest.mark.timeout(120)
def test_seeds_of_one_variant_trained_with_another_lr_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    runs = _copy_runs(tmp_path, "hsdp-adamw-s0", "flexdemo-s0", "flexdemo-s1")
    meta = json.loads((runs[2] / "run.json").read_text())
    meta["config"]["lr"] = 0.0013
    (runs[2] / "run.json").write_text(json.dumps(meta))
    status = cli.main(["compare", *map(str, runs), "--inter-bw", "10Mbit", "--inter-lat", "1ms"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1
    assert "are both flexdemo but train with lr 0.001 and 0.0013" in err
    # The same lr on both seeds is one variant's two seeds, as before.
    meta["config"]["lr"] = json.loads((runs[1] / "run.json").read_text())["config"]["lr"]
    (runs[2] / "run.json").write_text(json.dumps(meta))
    result = _compare(*map(str, runs), "--inter-bw", "10Mbit", "--inter-lat", "1ms")
    assert sorted(result.runs["seed"][result.runs["variant"] == "flexdemo"]) == [0, 1]


@pytest.mark.timeout(120)
def test_a_declared_compute_scale_is_said_once_not_once_per_run(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    runs = _copy_runs(tmp_path, "hsdp-adamw-s0", "hsdp-adamw-s1", "flexdemo-s0", "flexdemo-s1")
    status = cli.main(["compare", *map(str, runs), "--inter-bw", "10Mbit", "--inter-lat", "1ms",
                       "--compute-scale", "0.1"])
    out, err = capsys.readouterr()
    assert status == 0
    assert out.count("recorded compute x0.1 (declared") == 1
    assert "compute scaled by" not in err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["bad-bandwidth", "bad-latency", "workloads", "not-a-run",
                                  "same-seed", "out-suffix", "no-target", "two-bases"])
def test_compare_refuses_in_one_sentence_and_writes_nothing(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    runs = _copy_runs(tmp_path, "hsdp-adamw-s0", "flexdemo-s0")
    net = ["--inter-bw", "200Mbit", "--inter-lat", "30ms"]
    out = tmp_path / "out" / "cmp.json"
    extra: list[str] = []
    if case == "bad-bandwidth":
        net[1] = "200Mbitz"
    elif case == "bad-latency":
        net[3] = "thirty"
    elif case == "workloads":
        _edit_run(runs[1], workload="lm-small")
    elif case == "not-a-run":
        (tmp_path / "empty").mkdir()
        runs.append(tmp_path / "empty")
    elif case == "same-seed":
        runs.append(tmp_path / "again")
        shutil.copytree(runs[0], runs[-1])
    elif case == "out-suffix":
        out = tmp_path / "out" / "cmp.txt"
    elif case == "no-target":
        runs = runs[1:]
    elif case == "two-bases":  # --same-compute rescales recorded compute; --step-compute sets it
        extra = ["--same-compute", "method", "--step-compute", "0.01"]
    status = cli.main(["compare", *map(str, runs), *net, "--out", str(out), *extra])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert err.startswith("flexbench compare: error: ") and len(err.splitlines()) == 1
    assert not out.exists() and not out.parent.exists()


@pytest.mark.timeout(120)
def test_a_failed_sweep_unit_is_a_miss_not_dropped(tmp_path: Path) -> None:
    copy = tmp_path / "quick"
    shutil.copytree(QUICK, copy, ignore=shutil.ignore_patterns("figures", "sim"))
    runs = pd.read_parquet(copy / "runs.parquet")
    runs.loc[runs["unit"] == "diloco-s1", "status"] = "failed"
    runs.to_parquet(copy / "runs.parquet")
    shutil.rmtree(copy / "units" / "diloco-s1")
    result = _compare(str(copy), "--inter-bw", "10Mbit", "--inter-lat", "1ms")
    diloco = result.runs[result.runs["variant"] == "diloco"].set_index("seed")
    assert diloco.loc[1, "time_to_target_s"] == math.inf and diloco.loc[0, "reached"]
    # Fastest on seed 0 by far, yet its median over two seeds is a miss: it ranks last.
    assert result.table["variant"].iloc[-1] == "diloco"
    assert any("diloco-s1: failed in the sweep: counted as a miss (inf)" in a
               for a in result.assumptions)


DECENTRALIZED = ROOT / "results" / "decentralized" / "units" / "hsdp-adamw-nodes=4-s0"


def _slowed_copy(tmp_path: Path, name: str, factor: float, **config: object) -> Path:
    """The 4x1 hsdp-adamw recording (one rank per node: no intra-node collective) with every
    recorded time x `factor`: the same run on a machine that computed `factor` times slower."""
    path = tmp_path / name
    shutil.copytree(DECENTRALIZED, path)
    trace = pd.read_parquet(path / "trace.parquet")
    trace[["start_s", "wait_s", "end_s"]] *= factor
    trace.to_parquet(path / "trace.parquet", index=False)
    steps = pd.read_parquet(path / "steps.parquet")
    steps[["wall_time_s", "compute_s", "comm_s"]] *= factor
    steps.to_parquet(path / "steps.parquet", index=False)
    meta = json.loads((path / "run.json").read_text())
    meta["config"].update(config)
    (path / "run.json").write_text(json.dumps(meta))
    return path


@pytest.mark.timeout(120)
@pytest.mark.skipif(not DECENTRALIZED.is_dir(), reason="needs results/decentralized")
def test_a_pair_differing_only_in_compute_ranks_equal_on_one_basis(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    fast = _slowed_copy(tmp_path, "fast", 1.0)
    slow = _slowed_copy(tmp_path, "slow", 1.5, method="diloco")  # another method's label
    net = ["--inter-bw", "100Mbit", "--inter-lat", "10ms", "--target", "2.9"]
    own = _compare(str(fast), str(slow), *net)
    times = own.runs.set_index("variant")["time_to_target_s"]
    assert times["diloco"] > 1.05 * times["hsdp-adamw"]  # the load alone decides this ranking
    assert own.compute_basis.startswith("compute basis: each run's own recorded compute")
    # One seed each: a method's median is its own compute, so "method" changes nothing.
    mine = _compare(str(fast), str(slow), *net, "--same-compute", "method")
    pd.testing.assert_series_equal(mine.runs["time_to_target_s"], own.runs["time_to_target_s"],
                                   rtol=1e-9)
    same = _compare(str(fast), str(slow), *net, "--same-compute", "all")
    times = same.runs.set_index("variant")["time_to_target_s"]
    assert times["diloco"] == pytest.approx(times["hsdp-adamw"], rel=1e-9)
    assert same.first["verdict"] == "tie"
    recorded = pd.read_parquet(fast / "steps.parquet")["compute_s"].median()
    basis = statistics.median([recorded, 1.5 * recorded])
    assert f"one compute per step for every run, {basis:.4g} s" in same.compute_basis
    # The basis is printed above the table and written with it.
    out = tmp_path / "cmp.json"
    assert cli.main(["compare", str(fast), str(slow), *net, "--same-compute", "all",
                     "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[1] == same.compute_basis and printed[2].startswith("rank")
    assert json.loads(out.read_text())["compute_basis"] == same.compute_basis


@pytest.mark.timeout(120)
@pytest.mark.skipif(not DECENTRALIZED.is_dir(), reason="needs results/decentralized")
def test_same_compute_method_puts_a_methods_seeds_on_their_median(tmp_path: Path) -> None:
    seed0 = _slowed_copy(tmp_path, "s0", 1.0)
    seed1 = _slowed_copy(tmp_path, "s1", 2.0, seed=1)
    net = ["--inter-bw", "1Gbit", "--inter-lat", "10ms", "--target", "2.9"]
    own = _compare(str(seed0), str(seed1), *net).runs.set_index("seed")["time_to_target_s"]
    assert own[1] > 1.2 * own[0]
    result = _compare(str(seed0), str(seed1), *net, "--same-compute", "method")
    times = result.runs.set_index("seed")["time_to_target_s"]
    assert times[0] == pytest.approx(times[1], rel=1e-9)
    assert own[0] < times[0] < own[1]
    recorded = pd.read_parquet(seed0 / "steps.parquet")["compute_s"].median()
    assert f"(hsdp-adamw {1.5 * recorded:.4g} s)" in result.compute_basis


def _noisy_copy(tmp_path: Path, name: str, sigma: float, seed: int) -> Path:
    """The 4x1 hsdp-adamw recording with its compute per step replaced by a known spread:
    its median plus sigma x a fixed standard normal draw per step (the trace left as is)."""
    path = _slowed_copy(tmp_path, name, 1.0, seed=seed)
    steps = pd.read_parquet(path / "steps.parquet")
    z = np.random.default_rng(3).standard_normal(len(steps))
    steps["compute_s"] = steps["compute_s"].median() + sigma * z
    steps.to_parquet(path / "steps.parquet", index=False)
    return path


@pytest.mark.timeout(120)
@pytest.mark.skipif(not DECENTRALIZED.is_dir(), reason="needs results/decentralized")
def test_step_noise_widens_the_bracket_by_the_recorded_spread(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    sigma = 0.02
    runs = [str(_noisy_copy(tmp_path, f"s{s}", sigma, s)) for s in (0, 1)]
    net = ["--inter-bw", "100Mbit", "--inter-lat", "10ms", "--target", "2.9"]
    plain = _compare(*runs, *net).table.iloc[0]
    assert plain["ttt_low_s"] == plain["ttt_high_s"]  # two identical recordings: no seed spread
    noisy = _compare(*runs, *net, "--step-noise")
    row = noisy.table.iloc[0]
    assert row["ttt_median_s"] == plain["ttt_median_s"]  # the recorded replay is unchanged
    steps = pd.read_parquet(runs[0] + "/steps.parquet")
    k = int(steps.loc[steps["val_loss"] <= 2.9, "step"].iloc[0]) + 1  # steps up to the target
    spread = steps["compute_s"].std(ddof=0) * math.sqrt(k)
    # Two seeds: from the lower seed's 2.5% to the higher's 97.5%, about +-1.96 sd each side.
    assert row["ttt_high_s"] - row["ttt_low_s"] == pytest.approx(2 * 1.96 * spread, rel=0.3)
    assert row["ttt_low_s"] < row["ttt_median_s"] < row["ttt_high_s"]
    assert noisy.assumptions[-1] == step_noise.note()
    out = tmp_path / "cmp.csv"
    assert cli.main(["compare", *runs, *net, "--step-noise", "--out", str(out)]) == 0
    assert step_noise.note() in capsys.readouterr().out
    assert pd.read_csv(out)["ttt_high_s"].iloc[0] == pytest.approx(row["ttt_high_s"])


@pytest.mark.skipif(not DECENTRALIZED.is_dir(), reason="needs results/decentralized")
def test_step_noise_refuses_a_run_without_compute_per_step(tmp_path: Path) -> None:
    path = _slowed_copy(tmp_path, "r", 1.0)
    steps = pd.read_parquet(path / "steps.parquet")
    steps.drop(columns=["compute_s"]).to_parquet(path / "steps.parquet", index=False)
    with pytest.raises(ConfigError, match="no finite compute per step"):
        _compare(str(path), "--inter-bw", "1Gbit", "--target", "2.9", "--step-noise")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("setting", "other"), [
    ("lr", 0.0013), ("schedule", "cosine"), ("warmup", 0.2), ("warmup_steps", 5),
    ("batch_size", 8), ("weight_decay", 0.1)])
def test_run_folders_of_one_variant_with_another_training_setting_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture, setting: str, other: object
) -> None:
    runs = _copy_runs(tmp_path, "hsdp-adamw-s0", "flexdemo-s0", "flexdemo-s1")
    meta = json.loads((runs[2] / "run.json").read_text())
    first = json.loads((runs[1] / "run.json").read_text())["config"]
    meta["config"]["schedule"] = "warmup"  # both seeds warm up, so the warm-up is read
    first["schedule"] = "warmup"
    meta["config"][setting] = other
    (runs[2] / "run.json").write_text(json.dumps(meta))
    _edit_run(runs[1], config=first)
    status = cli.main(["compare", *map(str, runs), "--inter-bw", "10Mbit", "--inter-lat", "1ms",
                       "--out", str(tmp_path / "out" / "cmp.json")])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1, err
    assert f"are both flexdemo but train with {setting} {first[setting]!r} and {other!r}" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(120)
def test_a_warm_up_under_a_constant_schedule_does_not_split_a_variant(tmp_path: Path) -> None:
    runs = _copy_runs(tmp_path, "hsdp-adamw-s0", "flexdemo-s0", "flexdemo-s1")
    meta = json.loads((runs[2] / "run.json").read_text())
    assert meta["config"]["schedule"] == "constant"  # which reads no warm-up
    meta["config"]["warmup"] = 0.2
    (runs[2] / "run.json").write_text(json.dumps(meta))
    result = _compare(*map(str, runs), "--inter-bw", "10Mbit", "--inter-lat", "1ms")
    assert sorted(result.runs["seed"][result.runs["variant"] == "flexdemo"]) == [0, 1]


def _compute_scaled(path: Path, factor: float) -> None:
    """The run's recorded compute per step x `factor` (its other columns as recorded)."""
    steps = pd.read_parquet(path / "steps.parquet")
    steps["compute_s"] *= factor
    steps.to_parquet(path / "steps.parquet", index=False)


@pytest.mark.timeout(120)
def test_recorded_computes_apart_by_over_a_fifth_are_warned_of(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    runs = _copy_runs(tmp_path, "hsdp-adamw-s0", "flexdemo-s0")
    medians = [pd.read_parquet(r / "steps.parquet")["compute_s"].median() for r in runs]
    net = ["--inter-bw", "10Mbit", "--inter-lat", "1ms", "--target", "2.9"]

    def warned(*extra: str) -> list[str]:
        assert cli.main(["compare", *map(str, runs), *net, *extra]) == 0
        return [line for line in capsys.readouterr().err.splitlines() if "differs by" in line]

    # As recorded (a few percent apart): no warning.
    assert max(medians) / min(medians) - 1 < compare.COMPUTE_SPREAD
    assert warned() == []
    # 15% apart: below the line, silent.
    _compute_scaled(runs[1], 1.15 * medians[0] / medians[1])
    assert warned() == []
    # 30% apart: one line naming both runs and the spread.
    _compute_scaled(runs[1], 1.30 / 1.15)
    lines = warned()
    assert len(lines) == 1 and "differs by 30%" in lines[0], lines
    assert "hsdp-adamw-s0" in lines[0] and "flexdemo-s0" in lines[0]
    # On one basis (or a declared compute) the recorded spread no longer enters: silent.
    assert warned("--same-compute", "all") == []
    assert warned("--same-compute", "method") == []
    assert warned("--step-compute", "0.1") == []


DECENTRALIZED_UNITS = ROOT / "results" / "decentralized" / "units"
EMULATED = ROOT / "results" / "decentralized-emulated" / "units"
GOSSIP_AT_16 = ["--nodes", "16", "--gpus-per-node", "1", "--inter-bw", "1Gbit", "--inter-lat",
                "10ms", "--target", "2.7"]


@pytest.mark.skipif(not (EMULATED / "gossip-lm-tiny-nodes=16_graph=ring-s0").exists(),
                    reason="needs the committed results/decentralized-emulated units")
@pytest.mark.timeout(120)
def test_loss_from_times_gossip_at_an_emulated_node_count_as_simulate_does(
        tmp_path: Path) -> None:
    graphs = ("ring", "one-peer-exponential")
    real = [str(DECENTRALIZED_UNITS / f"gossip-nodes=4_graph={g}-s0") for g in graphs]
    emulated = [str(EMULATED / f"gossip-lm-tiny-nodes=16_graph={g}-s0") for g in graphs]
    # Without a loss at 16 nodes, gossip's time there is refused.
    with pytest.raises(ConfigError, match="give one at 16 nodes with --loss-from"):
        _compare(*real, *GOSSIP_AT_16)
    result = _compare(*real, *GOSSIP_AT_16, *(a for e in emulated for a in ("--loss-from", e)))
    times = result.runs.set_index("run")["time_to_target_s"]
    for graph, trace, curve in zip(graphs, real, emulated, strict=True):
        out = tmp_path / f"{graph}.csv"
        assert cli.main(["simulate", trace, *GOSSIP_AT_16, "--loss-from", curve,
                         "--out", str(out)]) == 0
        simulated = json.loads(out.with_suffix(".loss.json").read_text())
        assert simulated["loss_curve_emulated"] is True
        assert times[trace] == pytest.approx(simulated["time_to_target_s"], rel=1e-12)
    assert any(f"loss curve from {emulated[0]} (16 x 1, emulated" in a
               for a in result.assumptions)


@pytest.mark.skipif(not (EMULATED / "gossip-lm-tiny-nodes=16_graph=ring-s1").exists(),
                    reason="needs the committed results/decentralized-emulated units")
def test_a_loss_from_run_no_compared_run_goes_with_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out" / "cmp.json"
    status = cli.main(["compare", str(DECENTRALIZED_UNITS / "gossip-nodes=4_graph=ring-s0"),
                       *GOSSIP_AT_16, "--out", str(out), "--loss-from",
                       str(EMULATED / "gossip-lm-tiny-nodes=16_graph=ring-s1")])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1
    assert "is gossip seed 1, and no compared run is" in err
    assert not out.parent.exists()
