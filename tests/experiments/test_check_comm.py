"""check-comm: comparison logic, exit codes and baseline updates (with a stand-in measurement)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from experiments import check_comm, cli

BASE = {
    "flexdemo": {"inter_bytes_sent": 1000.0, "inter_bytes_received": 1000.0, "inter_calls": 2.0,
                 "intra_bytes": 5000.0},
    "hsdp-adamw": {"inter_bytes_sent": 90000.0, "inter_bytes_received": 90000.0,
                   "inter_calls": 4.0, "intra_bytes": 5000.0},
}


def _with(method: str, figure: str, value: float) -> dict[str, dict[str, float]]:
    out = {m: dict(v) for m, v in BASE.items()}
    out[method][figure] = value
    return out


@pytest.mark.timeout(10)
def test_growth_beyond_one_percent_fails_and_smaller_does_not() -> None:
    rows, failures = check_comm.compare(BASE, _with("flexdemo", "inter_bytes_sent", 1010.0))
    assert failures == []  # exactly +1.0% is allowed
    rows, failures = check_comm.compare(BASE, _with("flexdemo", "inter_bytes_sent", 1011.0))
    assert len(failures) == 1 and "flexdemo: inter_bytes_sent grew" in failures[0]
    flagged = [r for r in rows if r["verdict"] == "FAIL"]
    assert flagged[0]["change"] == "+1.1%"
    _, failures = check_comm.compare(BASE, _with("hsdp-adamw", "inter_calls", 5.0))
    assert failures and "inter_calls" in failures[0]


@pytest.mark.timeout(10)
def test_less_traffic_fails_new_methods_pass_lost_methods_fail() -> None:
    # A method that silently stops communicating must not pass as a win.
    rows, failures = check_comm.compare(BASE, _with("flexdemo", "intra_bytes", 10.0))
    assert failures == ["flexdemo: intra_bytes fell from 5,000 to 10 (-99.8%)"]
    _, failures = check_comm.compare(BASE, _with("flexdemo", "inter_bytes_sent", 990.0))
    assert failures == []  # exactly -1.0% is allowed
    _, failures = check_comm.compare(BASE, _with("hsdp-adamw", "inter_calls", 0.0))
    assert failures and "inter_calls fell" in failures[0]
    more = {**BASE, "demo": dict(BASE["flexdemo"])}
    rows, failures = check_comm.compare(BASE, more)
    assert failures == [] and {r["verdict"] for r in rows if r["method"] == "demo"} == {"new"}
    _, failures = check_comm.compare(BASE, {"flexdemo": BASE["flexdemo"]})
    assert failures == ["hsdp-adamw: missing from this run (it is in the baseline)"]
    # Growing from zero is growth too.
    zero = _with("flexdemo", "inter_calls", 0.0)
    _, failures = check_comm.compare(zero, BASE)
    assert failures and "inter_calls" in failures[0]


@pytest.mark.timeout(10)
def test_render_is_an_aligned_table() -> None:
    rows, _ = check_comm.compare(BASE, _with("flexdemo", "inter_bytes_sent", 2000.0))
    text = check_comm.render(rows)
    lines = text.splitlines()
    assert lines[0].split() == ["method", "figure", "baseline", "now", "change", "verdict"]
    assert any("1,000" in line and "2,000" in line and "+100.0%" in line and "FAIL" in line
               for line in lines)
    assert len(lines) == 1 + 2 * len(check_comm.FIGURES)


def _fake(values: dict[str, dict[str, float]]):
    def measurer(methods, settings):
        assert settings == check_comm.SETTINGS
        return {m: values[m] for m in methods if m in values}
    return measurer


@pytest.mark.timeout(30)
def test_cli_update_then_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "baselines" / "comm.json"
    monkeypatch.setattr(check_comm, "measure", _fake(BASE))
    monkeypatch.setattr(check_comm, "METHODS", ("flexdemo", "hsdp-adamw"))
    args = ["check-comm", "--baseline", str(path), "--method", "flexdemo", "hsdp-adamw"]
    assert cli.main(["check-comm", "--baseline", str(path), "--update"]) == 0
    saved = json.loads(path.read_text())
    assert saved["methods"] == BASE and saved["settings"] == check_comm.SETTINGS
    assert cli.main(args) == 0
    assert "every method sends what its baseline does" in capsys.readouterr().out

    monkeypatch.setattr(check_comm, "measure", _fake(_with("hsdp-adamw", "intra_bytes", 6000.0)))
    assert cli.main(args) == 1
    captured = capsys.readouterr()
    assert "hsdp-adamw: intra_bytes grew from 5,000 to 6,000" in captured.err
    # Without --method every baseline method must still be there.
    monkeypatch.setattr(check_comm, "measure", _fake({"flexdemo": BASE["flexdemo"]}))
    assert cli.main(["check-comm", "--baseline", str(path)]) == 1
    assert "hsdp-adamw: missing" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_cli_bad_input_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(check_comm, "measure", _fake(BASE))
    missing = tmp_path / "none.json"
    assert cli.main(["check-comm", "--baseline", str(missing)]) == 2
    assert "no baseline at" in capsys.readouterr().err
    assert cli.main(["check-comm", "--baseline", str(missing), "--method", "sgd"]) == 2
    assert "unknown method 'sgd'" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"settings": {"steps": 99}, "methods": BASE}))
    assert cli.main(["check-comm", "--baseline", str(other)]) == 2
    assert "recorded with other settings" in capsys.readouterr().err
    assert not missing.exists()


@pytest.mark.timeout(10)
def test_judge_handles_missing_figures() -> None:
    assert check_comm._judge(math.nan, 5.0, 0.01) == ("new", "new")
    assert check_comm._judge(5.0, math.nan, 0.01) == ("missing", "FAIL")


@pytest.mark.timeout(10)
def test_committed_baseline_covers_every_method_with_current_settings() -> None:
    path = Path(__file__).resolve().parents[2] / check_comm.DEFAULT_BASELINE
    if not path.exists():
        pytest.skip(f"{check_comm.DEFAULT_BASELINE} has not been recorded yet")
    data = json.loads(path.read_text())
    assert data["settings"] == check_comm.SETTINGS, "re-record with `flexbench check-comm --update`"
    from experiments.config import METHODS

    assert set(data["methods"]) == set(METHODS)
    for method, figures in data["methods"].items():
        assert set(figures) == set(check_comm.FIGURES), method
        assert all(v >= 0 and math.isfinite(v) for v in figures.values()), method
    # Full sync sends the most across nodes; the FlexDeMo family far less.
    sent = {m: f["inter_bytes_sent"] for m, f in data["methods"].items()}
    assert sent["hsdp-adamw"] > 10 * sent["flexdemo"] and sent["none"] == 0


@pytest.mark.timeout(30)
def test_update_of_some_methods_merges_and_a_failed_method_keeps_its_row(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "comm.json"
    monkeypatch.setattr(check_comm, "measure", _fake(BASE))
    assert cli.main(["check-comm", "--baseline", str(path), "--update",
                     "--method", "flexdemo", "hsdp-adamw"]) == 2  # nothing to merge into yet
    assert "record every method first" in capsys.readouterr().err and not path.exists()
    monkeypatch.setattr(check_comm, "measure", _fake({**BASE, "demo": BASE["flexdemo"]}))
    monkeypatch.setattr(check_comm, "METHODS", ("flexdemo", "demo", "hsdp-adamw"))
    assert cli.main(["check-comm", "--baseline", str(path), "--update"]) == 0

    # Re-recording flexdemo alone changes its row and keeps the others'.
    monkeypatch.setattr(check_comm, "measure", _fake(_with("flexdemo", "intra_bytes", 7000.0)))
    assert cli.main(["check-comm", "--baseline", str(path), "--update",
                     "--method", "flexdemo"]) == 0
    saved = json.loads(path.read_text())["methods"]
    assert set(saved) == {"flexdemo", "demo", "hsdp-adamw"}
    assert saved["flexdemo"]["intra_bytes"] == 7000.0 and saved["demo"] == BASE["flexdemo"]

    # A method whose run fails keeps its old row, and the update fails.
    monkeypatch.setattr(check_comm, "measure", _fake({"flexdemo": BASE["flexdemo"]}))
    assert cli.main(["check-comm", "--baseline", str(path), "--update",
                     "--method", "flexdemo", "hsdp-adamw"]) == 1
    assert "failed to run and were not re-recorded: hsdp-adamw" in capsys.readouterr().err
    saved = json.loads(path.read_text())["methods"]
    assert saved["hsdp-adamw"] == BASE["hsdp-adamw"] and saved["flexdemo"] == BASE["flexdemo"]


@pytest.mark.timeout(30)
def test_a_partial_update_over_other_settings_is_refused(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"settings": {"steps": 99}, "methods": BASE}))
    monkeypatch.setattr(check_comm, "measure", _fake(BASE))
    assert cli.main(["check-comm", "--baseline", str(other), "--update",
                     "--method", "flexdemo"]) == 2
    assert "without --method" in capsys.readouterr().err
    assert json.loads(other.read_text())["settings"] == {"steps": 99}  # untouched
