"""Compute at another shape: the optimizer phase follows the shard, forward+backward stays."""

import pytest

from experiments.config import RunConfig
from experiments.replay.compute_rules import shape_compute
from experiments.replay.engine import replay
from experiments.replay.recordings import read_run
from experiments.replay.reshard import run_layout, shard_elements
from experiments.replay.target import ComputeBasis, ReplayTarget

# A 2 x 2 lm-tiny recording with FSDP2 and "backward" marks (the overlap sweep's).
MARKED = "results/overlap/units/flexdemo-s0"


def _units() -> list:
    config = RunConfig(method="flexdemo", workload="lm-tiny", gpus_per_node=2)
    return run_layout({}, config)[0]


def test_the_optimizer_phase_scales_with_the_shards_element_count():
    units = _units()
    config = RunConfig(method="flexdemo", workload="lm-tiny", nodes=2, gpus_per_node=2)
    target = config.replace(gpus_per_node=8)
    found = shape_compute(config, units, 2, target, marks=True)
    elements = lambda g: sum(shard_elements(s, g) for u in units for s in u)  # noqa: E731
    assert found.phase_scale == (1.0, pytest.approx(elements(8) / elements(2)))
    assert 0.24 < found.phase_scale[1] < 0.26  # ~2/8, FSDP2's padding aside
    assert "optimizer step x0.25" in found.notes[0] and "forward+backward" in found.notes[0]


def test_no_rule_where_nothing_changes_a_shard_and_a_stated_one_without_marks():
    units = _units()
    flex = RunConfig(method="flexdemo", workload="lm-tiny", nodes=2, gpus_per_node=2)
    assert shape_compute(flex, units, 2, flex, marks=True).phase_scale is None
    demo = flex.replace(method="demo")  # every rank a whole replica: no shard to shrink
    assert shape_compute(demo, None, 2, demo.replace(gpus_per_node=8), True).notes == ()
    unmarked = shape_compute(flex, units, 2, flex.replace(gpus_per_node=8), marks=False)
    assert unmarked.phase_scale is None and 'no "backward" marks' in unmarked.notes[0]


def test_demos_decode_at_another_node_count_is_stated_not_modeled():
    flex = RunConfig(method="flexdemo", workload="lm-tiny", nodes=2, gpus_per_node=2)
    found = shape_compute(flex, _units(), 2, flex.replace(nodes=64), marks=True)
    assert found.phase_scale is None
    assert "decode of every node's top-k" in found.notes[0] and "not modeled" in found.notes[0]
    hsdp = flex.replace(method="hsdp-adamw")
    assert shape_compute(hsdp, _units(), 2, hsdp.replace(nodes=64), marks=True).notes == ()


def test_a_replay_at_more_ranks_per_node_shortens_only_the_optimizer_phase():
    run = read_run(MARKED)
    same = replay(run, ReplayTarget(inter_bw="1Gbit", inter_lat="1ms", gpus_per_node=2))
    wider = replay(run, ReplayTarget(inter_bw="1Gbit", inter_lat="1ms", gpus_per_node=4))
    assert same.phases is None and same.compute_rules == ()
    ratio = sum(shard_elements(s, 4) for u in _units() for s in u) / sum(
        shard_elements(s, 2) for u in _units() for s in u)
    fb, opt = wider.phases.recorded_s
    assert wider.phases.replayed_s == pytest.approx((fb, opt * ratio))
    assert "optimizer step x0.5" in wider.compute_rules[0]


def test_a_profiles_optimizer_phase_is_scaled_from_its_own_shard_to_the_targets():
    run = read_run(MARKED)
    fb, opt = 0.05, 0.01  # as if profiled at 1 rank per node (a whole model's optimizer step)
    replayed = replay(run, ReplayTarget(inter_bw="1Gbit", gpus_per_node=4,
                                        compute=ComputeBasis(phases=(fb, opt), phases_at=1)))
    ratio = sum(shard_elements(s, 4) for u in _units() for s in u) / sum(
        shard_elements(s, 1) for u in _units() for s in u)
    assert replayed.phases.replayed_s == pytest.approx((fb, opt * ratio))
    assert "as profiled" in replayed.compute_rules[0] and "at 4 over 1 ranks" in \
        replayed.compute_rules[0]
