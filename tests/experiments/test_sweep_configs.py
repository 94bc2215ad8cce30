"""The shipped sweep configs parse and describe what their comments promise."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments import sweep
from experiments.config import METHODS
from experiments.errors import ConfigError
from experiments.workloads import WORKLOAD_NAMES

CONFIGS = Path(__file__).resolve().parents[2] / "experiments" / "configs"


@pytest.mark.timeout(30)
def test_quick_config_is_the_promised_grid() -> None:
    cfg = sweep.load_config(CONFIGS / "quick.toml")
    assert cfg.name == "quick"
    assert cfg.methods == ["hsdp-adamw", "flexdemo", "demo", "diloco"]
    bws = sorted({n.link.bandwidth for n in cfg.networks})
    assert bws[0] == pytest.approx(10e6 / 8) and bws[-1] == pytest.approx(10e9 / 8)
    assert sorted({n.link.latency for n in cfg.networks}) == pytest.approx([0.001, 0.02])
    assert len(cfg.seeds) == 2
    units = sweep.units_of(cfg)
    checks = [u for u in units if u.kind == "validate"]
    assert 1 <= len(checks) <= 2
    assert all(u.config.shaping == "wall" and u.network in cfg.networks for u in checks)
    assert {u.config.workload for u in units} == {"lm-tiny"}


@pytest.mark.timeout(30)
def test_paper_config_runs_as_is_on_lm_small() -> None:
    cfg = sweep.load_config(CONFIGS / "paper.toml")
    units = sweep.units_of(cfg)
    assert {u.config.workload for u in units} == {"lm-small"}
    assert cfg.executor["kind"] == "slurm"
    assert {u.config.nodes for u in units} == {4}
    assert "flexdemo[topk=8]" in {u.variant for u in units}


SWEEPS = sorted(CONFIGS.glob("*.toml"))
# Site files (netsim.sites: [[site]] tables, for `--topology`) have a folder of their own and a
# test of their own (tests/netsim/test_sites.py).
TOPOLOGIES = sorted((CONFIGS.parent / "topologies").glob("*.toml"))


@pytest.mark.parametrize("path", TOPOLOGIES, ids=lambda p: p.name)
def test_a_topology_given_to_sweep_is_named_a_topology_for_topology(path: Path) -> None:
    with pytest.raises(ConfigError, match=r"is a topology \(a site file\), not a sweep "
                       r"config: give it to flexbench simulate, compare or run as --topology"):
        sweep.load_config(path)


def test_the_sweep_configs_hold_no_topology() -> None:
    assert TOPOLOGIES and not [p.name for p in SWEEPS if "[[site]]" in p.read_text()]


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
@pytest.mark.timeout(30)
def test_every_shipped_config_loads_with_known_workloads_and_methods(path: Path) -> None:
    cfg = sweep.load_config(path)  # validates every unit's run config
    units = sweep.units_of(cfg)
    assert units and set(cfg.methods) <= set(METHODS)
    assert {u.config.workload for u in units} <= set(WORKLOAD_NAMES)
    assert {u.config.method for u in units} <= set(METHODS)


@pytest.mark.timeout(30)
def test_decentralized_config_is_the_promised_study() -> None:
    cfg = sweep.load_config(CONFIGS / "decentralized.toml")
    units = sweep.units_of(cfg)
    gossip = [u for u in units if u.method == "gossip"]
    assert {u.config.graph for u in gossip} == {"ring", "torus", "exponential",
                                                "one-peer-exponential", "complete"}
    assert {u.cluster for u in units} == {"4x1", "8x1"}
    assert {u.cluster for u in units if u.method == "hsdp-adamw"} == {"4x1", "8x1"}
    assert {u.cluster for u in units if u.method == "ada"} == {"4x1", "8x1"}
    assert len(cfg.seeds) == 2 and len(units) == (5 + 1 + 1) * 2 * 2
    assert len({n.inter_bw for n in cfg.networks}) == 2 and len(cfg.networks) == 2
    # Derived per node count from the baseline, not a fixed number.
    assert cfg.target is None and cfg.target_fraction is not None


@pytest.mark.timeout(30)
def test_standard_config_is_the_quick_grid_with_five_seeds() -> None:
    quick = sweep.load_config(CONFIGS / "quick.toml")
    standard = sweep.load_config(CONFIGS / "standard.toml")
    assert len(standard.seeds) >= 5
    assert standard.methods == quick.methods and standard.networks == quick.networks
    assert standard.knobs == quick.knobs and standard.target_fraction == quick.target_fraction
    assert standard.target is None  # derived from the baseline's own seeds, never set by hand
    for field in ("workload", "nodes", "steps"):
        assert getattr(sweep.units_of(standard)[0].config, field) == getattr(
            sweep.units_of(quick)[0].config, field)
    # The quick sweep trains one rank per node and evaluates every 10 steps to stay within
    # minutes on 2 cores; the standard sweep keeps 2 ranks per node (sharded) and evaluates
    # every 5 steps, as results/standard was recorded.
    assert (sweep.units_of(quick)[0].config.gpus_per_node,
            sweep.units_of(standard)[0].config.gpus_per_node) == (1, 2)


@pytest.mark.timeout(30)
def test_dry_run_estimate_is_steps_times_the_references_seconds_per_step(tmp_path: Path) -> None:
    import json

    from experiments.sweep.estimate import estimate_text

    cfg = sweep.load_config(CONFIGS / "standard.toml")
    units = sweep.units_of(cfg)
    reference = tmp_path / "ref"
    for method, seconds in (("hsdp-adamw", 30.0), ("flexdemo", 60.0)):
        run = reference / "units" / f"{method}-s0" / "run.json"
        run.parent.mkdir(parents=True)
        config = {"method": method, "workload": "lm-tiny", "nodes": 2, "gpus_per_node": 2,
                  "steps": 100}
        run.write_text(json.dumps({"config": config, "train_time_s": seconds}))
    # 0.3 s/step and 0.6 s/step; demo and diloco take the median of the two, 0.45 s/step.
    per_method = {"hsdp-adamw": 0.3, "flexdemo": 0.6, "demo": 0.45, "diloco": 0.45}
    expected = sum(per_method[u.method] * u.config.steps for u in units)
    text = estimate_text(units, tmp_path / "out", reference)
    assert text.startswith(f"{len(units)} unit(s) to run, about {expected / 60:.0f} min")
    assert f"; {2 * len(cfg.seeds)} unit(s) of a method it lacks" in text  # demo and diloco
    assert "no estimate" in estimate_text(units, tmp_path / "out", tmp_path / "empty")
    quick = Path(__file__).resolve().parents[2] / "results" / "quick"
    if quick.is_dir():  # a finished sweep: nothing left to train
        done = sweep.units_of(sweep.load_config(CONFIGS / "quick.toml"))
        assert estimate_text(done, quick).startswith("every unit is done")


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
@pytest.mark.timeout(60)
def test_every_shipped_config_dry_runs_into_a_new_folder(path: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    from experiments.cli import main

    assert main(["sweep", str(path), "--dry-run", "--out", str(tmp_path / "new")]) == 0
    assert "unit(s) to run" in capsys.readouterr().out
    assert not (tmp_path / "new").exists()  # a dry run writes nothing


@pytest.mark.timeout(30)
def test_the_estimate_of_units_on_the_workloads_own_budget_uses_that_budget(
        tmp_path: Path) -> None:
    import json

    from experiments.sweep.estimate import estimate_text
    from experiments.workload_budgets import BUILTIN_BUDGETS

    units = [u for u in sweep.units_of(sweep.load_config(CONFIGS / "frontier.toml"))
             if u.method == "hsdp-adamw"]
    assert units and all(u.config.steps is None for u in units)  # frontier leaves steps unset
    run = tmp_path / "ref" / "units" / "hsdp-adamw-s0" / "run.json"
    run.parent.mkdir(parents=True)
    config = {"method": "hsdp-adamw", "workload": "lm-tiny", "nodes": 2, "gpus_per_node": 2,
              "steps": 100}
    run.write_text(json.dumps({"config": config, "train_time_s": 60.0}))
    minutes = len(units) * 0.6 * BUILTIN_BUDGETS["lm-tiny"][0] / 60
    assert estimate_text(units, tmp_path / "out", tmp_path / "ref").startswith(
        f"{len(units)} unit(s) to run, about {minutes:.0f} min")
