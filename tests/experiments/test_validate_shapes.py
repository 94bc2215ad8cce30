"""validate-sim's shapes: parsing, the default of one core per rank, host contention, and the
calibration it finds or makes for this machine."""

import json

import pytest

from experiments.cli import main
from experiments.errors import ConfigError
from experiments.replay import calibrate as calibrate_module
from experiments.replay.calibrate import cache_path, machine_calibration, this_machine
from experiments.replay.validate import (
    DEFAULT_EXTRAPOLATIONS,
    default_shape,
    host_contention,
    parse_shape,
)
from netsim.calibration import Sample, fit_calibration


def test_shapes_parse_and_bad_ones_are_refused_in_one_sentence():
    assert parse_shape("2x2") == (2, 2) and parse_shape(" 4 x 1 ") == (4, 1)
    for bad in ("2", "1x4", "2x0", "2x2x2", "axb", ""):
        with pytest.raises(ConfigError, match="is not NODESxRANKS"):
            parse_shape(bad)
    assert [tuple(map(parse_shape, p.split(":"))) for p in DEFAULT_EXTRAPOLATIONS] == [
        ((2, 2), (4, 1)), ((2, 1), (2, 2)), ((2, 2), (3, 1))]


def test_default_shape_leaves_one_core_per_rank():
    assert default_shape(2) == (2, 1)
    assert default_shape(1) == (2, 1)  # never fewer than one rank per node
    assert default_shape(8) == (2, 4)


def test_host_contention_follows_the_busiest_pinned_core():
    # Rank r on core r mod 2: 2x2 and 4x1 put two ranks on each core; 3x1 two on core 0.
    assert host_contention((2, 2), (4, 1), cores=2) == 1.0
    assert host_contention((2, 2), (3, 1), cores=2) == 1.0
    assert host_contention((2, 1), (2, 2), cores=2) == 2.0
    assert host_contention((2, 2), (2, 1), cores=2) == 0.5
    assert host_contention((2, 2), (4, 2), cores=8) == 1.0  # one rank per core either way


@pytest.mark.parametrize("argv, words", [
    (["--extrapolate", "2x2"], "is not FROM:TO"),
    (["--extrapolate", "2x2:1x4"], "'1x4' is not NODESxRANKS"),
    (["--shape", "3"], "'3' is not NODESxRANKS"),
    (["--shape", "2x1", "--extrapolate"], "cannot be combined"),
    (["--set", "nodes=3"], "--set nodes is taken from the shapes"),
])
def test_validate_sim_refuses_bad_shapes_before_any_run(tmp_path, capsys, argv, words):
    out = tmp_path / "v.csv"
    assert main(["validate-sim", *argv, "--out", str(out)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and words in err[0], err
    assert not out.exists()


def _fit(machine: str):
    samples = [Sample("all_reduce", size, 2.5e6, 0.0, 2, float(size), 2 * 0.001 + size / 2.5e6)
               for size in (32 << 10, 2 << 20)]
    return fit_calibration(samples, "wall", "test", machine)


def test_machine_calibration_finds_this_machines_file(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    mine = tmp_path / "wall.json"
    mine.write_text(_fit(this_machine()).to_json())
    found, how = machine_calibration("wall", search=[mine])
    assert how.startswith(f"found {mine}") and found.machine == this_machine()
    assert found.per_message_s == pytest.approx(0.001)


def test_machine_calibration_skips_another_machines_and_makes_one(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    foreign = tmp_path / "wall.json"
    foreign.write_text(_fit("elsewhere, 64 cores").to_json())
    made = []

    def measured(shaping, rates, payloads, *args):
        # Stands in for the two-rank measurement (tests/netsim/test_calibration.py runs it).
        made.append((shaping, rates, payloads))
        return _fit(this_machine())

    monkeypatch.setattr(calibrate_module, "calibrate", measured)
    _, how = machine_calibration("wall", search=[foreign])
    assert len(made) == 1 and how == f"made now on this machine, kept in {cache_path('wall')}"
    # The one it made is found the next time, without measuring again.
    _, again = machine_calibration("wall", search=[foreign])
    assert len(made) == 1 and again.startswith(f"found {cache_path('wall')}")


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_the_loopback_link_is_measured_once_per_machine_and_then_found(tmp_path, monkeypatch):
    from experiments.replay.calibrate import machine_loopback

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    measured, how = machine_loopback()  # two real unshaped gloo ranks on loopback
    assert measured.bandwidth > 1e6 and measured.latency >= 0.0
    assert "measured now" in how and cache_path("loopback").is_file()
    found, again = machine_loopback()
    assert found == measured and f"found in {cache_path('loopback')}" in again
    stale = json.loads(cache_path("loopback").read_text()) | {"machine": "elsewhere"}
    cache_path("loopback").write_text(json.dumps(stale))
    assert "measured now" in machine_loopback()[1]  # another machine's file is not this one's


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_the_loopback_link_of_a_shape_times_every_nodes_group_at_once(tmp_path, monkeypatch):
    from experiments.replay.calibrate import machine_loopback

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # 2 nodes x 2 ranks: two groups of two, each all-gathering into its own 2-shard buffer (a
    # group of the wrong size fails the collective), kept apart from the 1x2 link in the cache
    link, how = machine_loopback((2, 2))
    assert link.bandwidth > 1e6 and link.latency >= 0.0
    assert "loopback gloo at 2x2" in how and "measured now" in how
    assert cache_path("loopback-2x2").is_file() and not cache_path("loopback").exists()
    found, again = machine_loopback((2, 2))
    assert found == link and f"found in {cache_path('loopback-2x2')}" in again
