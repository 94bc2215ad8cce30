"""The shipped sweep configs parse and describe what their comments promise."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments import sweep
from experiments.config import ConfigError

CONFIGS = Path(__file__).resolve().parents[1] / "experiments" / "configs"


@pytest.mark.timeout(30)
def test_quick_config_is_the_promised_grid() -> None:
    cfg = sweep.load_config(CONFIGS / "quick.toml")
    assert cfg.name == "quick"
    assert cfg.methods == ["hsdp-adamw", "flexdemo", "demo", "diloco"]
    bws = sorted({n.inter_bw_bps for n in cfg.networks})
    assert bws[0] == pytest.approx(10e6 / 8) and bws[-1] == pytest.approx(10e9 / 8)
    assert sorted({n.inter_lat_s for n in cfg.networks}) == pytest.approx([0.001, 0.02])
    assert len(cfg.seeds) == 2
    units = sweep.units_of(cfg)
    checks = [u for u in units if u.kind == "validate"]
    assert 1 <= len(checks) <= 2
    assert all(u.config.shaping == "wall" and u.network in cfg.networks for u in checks)
    assert {u.config.workload for u in units} == {"lm-tiny"}


@pytest.mark.timeout(30)
def test_paper_config_is_complete_apart_from_its_gpu_workload() -> None:
    with pytest.raises(ConfigError, match="unknown workload 't5-base'"):
        sweep.load_config(CONFIGS / "paper.toml")
    cfg = sweep.load_config(CONFIGS / "paper.toml", ["run.workload=lm-tiny"])
    assert cfg.executor["kind"] == "slurm"
    assert {u.config.nodes for u in sweep.units_of(cfg)} == {4}
    assert "flexdemo[topk=8]" in {u.variant for u in sweep.units_of(cfg)}
