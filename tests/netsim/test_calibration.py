"""Calibration: the fit, the file, the model on calibrated links, and the commands that use it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.cli import main
from experiments.replay.engine import replay
from experiments.replay.recordings import read_run
from experiments.replay.target import ReplayTarget
from experiments.run.rank import pin_to_core
from netsim import Link, Topology, kernel
from netsim.calibration import Calibration, Sample, fit_calibration, load_calibration

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "results" / "quick" / "units" / "flexdemo-s0"  # a committed, recorded run


def _replayed(**target: object):
    """The committed run replayed on `target`'s network."""
    return replay(read_run(RUN), ReplayTarget(**target))


def _samples(goodput: float, per_message_s: float) -> list[Sample]:
    """Exact timings of a link with the given overheads, over sizes, rates and ops."""
    out = []
    for op, steps in (("all_reduce", 2), ("all_gather", 1)):
        for rate in (2.5e6, 12.5e6):
            for size in (32 << 10, 256 << 10, 2 << 20):
                probe = Sample(op, size, rate, 0.001, steps, float(size), 1.0)
                seconds = probe.predicted(goodput, per_message_s)
                out.append(Sample(op, size, rate, 0.001, steps, float(size), seconds))
    return out


def test_fit_recovers_the_overheads_that_made_the_timings():
    cal = fit_calibration(_samples(0.93, 0.0012), "kernel", made="test")
    assert cal.goodput == pytest.approx(0.93, rel=1e-9)
    assert cal.per_message_s == pytest.approx(0.0012, rel=1e-9)
    assert cal.max_error() < 1e-9
    # With no overheads the fit says so: the model's own alpha-beta time.
    plain = fit_calibration(_samples(1.0, 0.0), "wall")
    assert plain.goodput == pytest.approx(1.0) and plain.per_message_s == pytest.approx(0.0)


def test_each_op_kind_timed_at_several_sizes_gets_a_fit_of_its_own():
    gather = [s for s in _samples(0.7, 0.003) if s.op == "all_gather"]
    reduce = [s for s in _samples(0.98, 0.001) if s.op == "all_reduce"]
    fitted_only = fit_calibration(gather + reduce, "kernel")
    assert fitted_only.op_costs() == () and "fitted, not applied" in fitted_only.describe()
    assert fitted_only.fit_for("all_gather") == (fitted_only.goodput, fitted_only.per_message_s)
    cal = fit_calibration(gather + reduce, "kernel", per_op=True)
    assert cal.ops == fitted_only.ops
    assert [op for op, *_ in cal.ops] == ["all_gather", "all_reduce"]
    assert cal.fit_for("all_gather") == pytest.approx((0.7, 0.003), rel=1e-9)
    assert cal.fit_for("all_reduce") == pytest.approx((0.98, 0.001), rel=1e-9)
    assert cal.fit_for("reduce_scatter") == (cal.goodput, cal.per_message_s)  # the shared fit
    assert 0.7 < cal.goodput < 0.98 and cal.max_error() < 1e-9
    assert ("per op kind, applied: all_gather 70.0%, +3.00 ms; all_reduce 98.0%, +1.00 ms"
            in cal.describe())
    # relative to the shared fit, as the model applies it on the calibrated link
    (_, gather_factor, gather_extra), _ = cal.op_costs()
    assert gather_factor == pytest.approx(0.7 / cal.goodput)
    assert gather_extra == pytest.approx(0.003 - cal.per_message_s)
    # an op timed at one size only is priced with the shared fit
    one_size = [s for s in gather if s.payload_bytes == 256 << 10 and s.rate_bps == 2.5e6]
    assert [op for op, *_ in fit_calibration(reduce + one_size, "kernel").ops] == ["all_reduce"]


def test_the_model_prices_a_calibrated_op_kind_at_its_own_goodput():
    # flexdemo's only inter-node op is its all-gather (its FSDP2 traffic stays inside the node).
    plain = _replayed(inter_bw="10Mbit", inter_lat="1ms")
    half_rate = _replayed(inter_bw="5Mbit", inter_lat="1ms")
    gathers_at_half = Calibration("wall", 1.0, 0.0, ops=(("all_gather", 0.5, 0.0),), per_op=True)
    reduces_at_half = Calibration("wall", 1.0, 0.0, ops=(("all_reduce", 0.5, 0.0),), per_op=True)
    not_applied = Calibration("wall", 1.0, 0.0, ops=(("all_gather", 0.5, 0.0),))
    for cal, expected in ((gathers_at_half, half_rate), (reduces_at_half, plain),
                          (not_applied, plain)):
        got = _replayed(inter_bw="10Mbit", inter_lat="1ms", calibration=cal)
        assert got.frame["time_s"].tolist() == pytest.approx(expected.frame["time_s"].tolist(),
                                                             rel=1e-12)
    # a per-message cost of its own adds one latency step per hop of that op
    slower = Calibration("wall", 1.0, 0.0, ops=(("all_gather", 1.0, 0.004),), per_op=True)
    got = _replayed(inter_bw="10Mbit", inter_lat="1ms", calibration=slower)
    later = _replayed(inter_bw="10Mbit", inter_lat="5ms")
    assert got.frame["time_s"].tolist() == pytest.approx(later.frame["time_s"].tolist(), rel=1e-12)


def test_fit_refuses_timings_that_do_not_grow_with_size():
    shrinking = [Sample("all_reduce", size, 2.5e6, 0.0, 2, float(size), seconds)
                 for size, seconds in ((1 << 10, 0.5), (1 << 20, 0.01))]
    with pytest.raises(ValueError, match="do not grow with message size"):
        fit_calibration(shrinking, "wall")
    flat = [Sample("all_reduce", size, 2.5e6, 0.0, 2, float(size), 0.01)
            for size in (1 << 10, 1 << 20)]
    with pytest.raises(ValueError, match="links were not shaped as configured"):
        fit_calibration(flat, "wall")
    with pytest.raises(ValueError, match="at least 2 samples"):
        fit_calibration(flat[:1], "wall")


def test_calibrated_links_and_topology():
    cal = Calibration("kernel", 0.9, 0.002)
    assert cal.link(Link("100Mbit", "1ms")) == Link(12.5e6 * 0.9, 0.003)
    topo = Topology.from_strings(3, 2, inter_bw="1Gbit", inter_lat="5ms",
                                 node_links=["2=10Mbit,20ms"])
    calibrated = cal.topology(topo)
    assert calibrated.inter == Link(125e6 * 0.9, 0.007)
    assert calibrated.node_link(2) == Link(1.25e6 * 0.9, 0.022)
    assert calibrated.intra == topo.intra  # intra-node links are never shaped
    # A negative cost (a full token bucket) never makes a latency negative.
    assert Calibration("kernel", 1.0, -0.004).link(Link("1Gbit", "1ms")).latency == 0.0


def test_file_round_trip_and_clear_refusals(tmp_path):
    cal = fit_calibration(_samples(0.95, 0.0005), "wall", made="here")
    path = tmp_path / "cal.json"
    cal.save(path)
    again = load_calibration(path, shaping="wall")
    assert again == cal
    assert json.loads(path.read_text())["max_fit_error"] < 1e-9
    with pytest.raises(ValueError, match="fitted under wall shaping, not kernel"):
        load_calibration(path, shaping="kernel")
    with pytest.raises(ValueError, match="does not exist; write one with `flexbench calibrate"):
        load_calibration(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot be read as JSON"):
        load_calibration(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text('{"goodput": 1}')
    with pytest.raises(ValueError, match="is not a netsim-calibration/1 file"):
        load_calibration(tmp_path / "other.json")
    body = json.loads(path.read_text())
    older = {k: v for k, v in body.items() if k != "ops"}  # a file from before fits per op
    (tmp_path / "older.json").write_text(json.dumps(older))
    assert load_calibration(tmp_path / "older.json").ops == cal.ops != ()
    body["goodput"] = -1
    (tmp_path / "damaged.json").write_text(json.dumps(body))
    with pytest.raises(ValueError, match="is damaged"):
        load_calibration(tmp_path / "damaged.json")


def test_simulate_on_calibrated_links_is_slower_by_the_fitted_overheads():
    plain = _replayed(inter_bw="10Mbit", inter_lat="1ms")
    cal = Calibration("wall", 0.5, 0.0)
    slow = _replayed(inter_bw="10Mbit", inter_lat="1ms", calibration=cal)
    half_rate = _replayed(inter_bw="5Mbit", inter_lat="1ms")
    # Goodput 50% is exactly half the rate, and the note says what was assumed.
    assert slow.frame["time_s"].tolist() == pytest.approx(half_rate.frame["time_s"].tolist(),
                                                          rel=1e-12)
    assert slow.frame["time_s"].iloc[-1] > plain.frame["time_s"].iloc[-1]
    assert "calibrated for wall shaping: goodput 50.0%" in slow.note
    assert slow.topology.inter.bandwidth == 0.5 * plain.topology.inter.bandwidth == 0.625e6


def test_cli_reads_the_file_and_refuses_a_bad_one(tmp_path, capsys):
    path = tmp_path / "cal.json"
    fit_calibration(_samples(0.9, 0.001), "kernel").save(path)
    out = tmp_path / "sim.csv"
    assert main(["simulate", str(RUN), "--inter-bw", "100Mbit", "--calibration", str(path),
                 "--out", str(out)]) == 0
    assert "links calibrated for kernel shaping: goodput 90.0%" in capsys.readouterr().out
    bad = tmp_path / "sim2.csv"
    assert main(["simulate", str(RUN), "--inter-bw", "100Mbit", "--calibration",
                 str(tmp_path / "nope.json"), "--out", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0] and not bad.exists()
    # validate-sim refuses a file of the other shaping mode before any run starts.
    assert main(["validate-sim", "--shaping", "wall", "--calibration", str(path)]) == 2
    assert "fitted under kernel shaping, not wall" in capsys.readouterr().err
    assert main(["validate-sim", "--recordings", "0"]) == 2
    assert "argument --recordings: must be an integer >= 1, got '0'" in capsys.readouterr().err


def _calibrate(tmp_path: Path, shaping: str) -> Calibration:
    out = tmp_path / f"{shaping}.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.cli", "calibrate", "--shaping", shaping, "--rates",
         "100Mbit", "--payloads", "4096", "4194304", "--repeats", "3", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"calibrated for {shaping} shaping" in proc.stdout
    cal = load_calibration(out, shaping=shaping)
    # Two ops x two sizes, each timed for real: positive times, the alpha-beta terms of 2 ranks.
    # The sizes lie 1024x apart (0.3 ms and 336 ms on the link), so that a loaded machine's
    # hiccups in a median of 3 cannot flatten the fit's slope: at 1 MB, small messages stretched
    # by 30 ms under two busy processes made it imply 1.5 times the rate, which is refused.
    assert [(s.op, s.payload_bytes) for s in cal.samples] == [
        ("all_reduce", 4096), ("all_reduce", 4194304), ("all_gather", 4096),
        ("all_gather", 4194304)]
    assert all(s.measured_s > 0 and s.wire_bytes == s.payload_bytes for s in cal.samples)
    return cal


@pytest.mark.dist
@pytest.mark.timing
def test_calibrate_wall(tmp_path):
    cal = _calibrate(tmp_path, "wall")
    # netsim's shaper holds each op to at least its modeled time: never faster than the rate.
    # Guaranteed, not hoped for: the hold runs on the monotonic clock that perf_counter reads
    # (a wall-clock step cannot shorten it), from the op's issue, after calibrate's clock
    # started. The one slack is rounding: modeled times are wall-clock timestamps near 1.8e9 s,
    # whose float steps are 0.24 us.
    assert all(s.measured_s >= s.wire_bytes / s.rate_bps - 1e-6 for s in cal.samples)


@pytest.mark.skipif(kernel.unavailable_reason() is not None,
                    reason=f"kernel shaping unavailable: {kernel.unavailable_reason()}")
@pytest.mark.dist
@pytest.mark.timing
def test_calibrate_kernel(tmp_path):
    _calibrate(tmp_path, "kernel")
    assert not [n for n in kernel.our_namespaces() if int(n.split("-")[1]) == os.getpid()]


@pytest.mark.dist
def test_pin_to_core_picks_rank_mod_cores():
    cores = sorted(os.sched_getaffinity(0))
    code = ("import os, sys; from experiments.run.rank import pin_to_core; "
            "pin_to_core(int(sys.argv[1])); print(sorted(os.sched_getaffinity(0)))")
    for rank in range(len(cores) + 1):
        out = subprocess.run([sys.executable, "-c", code, str(rank)], cwd=ROOT, text=True,
                             capture_output=True, check=True).stdout
        assert json.loads(out) == [cores[rank % len(cores)]]
    assert callable(pin_to_core)
