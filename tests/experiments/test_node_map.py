"""`flexbench compare` over several node counts and bandwidths: the map, its node-count
crossovers, gossip/Ada methods left out with their reason, and its refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from experiments import cli
from experiments.scoring import crossings

ROOT = Path(__file__).resolve().parents[2]
DECENTRALIZED = ROOT / "results" / "decentralized" / "units"
UNITS = ["hsdp-adamw-nodes=4-s0", "hsdp-adamw-nodes=4-s1", "ada-nodes=4-s0", "ada-nodes=4-s1"]
needs_units = pytest.mark.skipif(not all((DECENTRALIZED / u).is_dir() for u in UNITS),
                                 reason="needs results/decentralized")


def _law(steps: int, compute_s: float, per_node_s: float):
    """Time to target of a method whose step costs compute plus a link time growing with N."""
    return lambda nodes: steps * (compute_s + per_node_s * nodes)


@pytest.mark.parametrize(("method", "baseline", "expected"), [
    # 60 (0.2 + 0.005 N) = 50 (0.3 + 0.004 N): N = 3 / 0.1 = 30, equal there, slower above.
    (_law(60, 0.2, 0.005), _law(50, 0.3, 0.004), 30),
    # 70 (0.1 + 0.01 N) = 100 (0.2 + 0.002 N): N = 13 / 0.5 = 26, faster from 27 on (above).
    (_law(100, 0.2, 0.002), _law(70, 0.1, 0.01), 27),
    # 10 + 0.5 N = 30.3 + 0.1 N at N = 50.75: the method is slower from node 51 on.
    (lambda n: 10 + 0.5 * n, lambda n: 30.3 + 0.1 * n, 51),
])
def test_the_node_count_crossover_of_two_step_time_laws_is_its_closed_form(
    method, baseline, expected: int
) -> None:
    calls: list[int] = []

    def counted(n: int) -> float:
        calls.append(n)
        return method(n)

    found = crossings.crossover_nodes(counted, baseline, 2, 512)
    assert found == expected
    # The first node count of the order at 512: the one before it still has the other order.
    assert (method(found) < baseline(found)) == (method(512) < baseline(512))
    assert (method(found - 1) < baseline(found - 1)) != (method(512) < baseline(512))
    assert len(calls) <= 2 + math.ceil(math.log2(510))  # a bisection, not a scan


def test_no_node_count_crossover_when_one_law_wins_everywhere() -> None:
    assert crossings.crossover_nodes(_law(50, 0.1, 0.001), _law(60, 0.2, 0.001), 2, 512) is None


def _map(tmp_path: Path, *extra: str) -> tuple[int, Path]:
    out = tmp_path / "map.json"
    argv = ["compare", *(str(DECENTRALIZED / u) for u in UNITS), "--nodes", "4", "8",
            "--inter-bw", "10Mbit", "1Gbit", "--inter-lat", "1ms", "--target", "3.2",
            "--loss-scaling", "linear-to-critical-batch:512", "--out", str(out),
            "--out", str(tmp_path / "map.csv"), "--out", str(tmp_path / "crossover_nodes.png"),
            *extra]
    return cli.main(argv), out


@pytest.mark.timeout(300)
@needs_units
def test_an_ada_method_is_left_out_where_no_recording_has_the_node_count(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    code, out = _map(tmp_path)
    assert code == 0
    printed = capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["loss_scaling"] == "linear-to-critical-batch:512"
    assert "--loss-scaling linear-to-critical-batch:512" in record["title"]
    assert "--loss-scaling linear-to-critical-batch:512" in printed.splitlines()[0]
    cells = pd.DataFrame(record["cells"]).set_index(["nodes", "inter_bw"])
    assert len(cells) == 4
    for bw in ("10Mbit", "1Gbit"):
        # At 4 nodes ada is recorded: timed and ranked; at 8 it has no loss curve.
        assert cells.loc[(4, bw), "left_out"] == ""
        assert {cells.loc[(4, bw), "first"], cells.loc[(4, bw), "runner_up"]} == {
            "ada", "hsdp-adamw"}
        reason = cells.loc[(8, bw), "left_out"]
        assert reason.startswith("ada: the loss of ada depends on its node count")
        assert "recordings are at 4 nodes, not 8" in reason
        assert cells.loc[(8, bw), "first"] == "hsdp-adamw"
        assert cells.loc[(8, bw), "verdict"] == "alone"
        assert f"left out at 8 nodes, {bw}: ada: the loss of ada" in printed
    table = pd.read_csv(tmp_path / "map.csv")
    assert set(table["loss_scaling"]) == {"linear-to-critical-batch:512"}
    assert (tmp_path / "crossover_nodes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(300)
@needs_units
def test_a_cell_of_the_map_is_the_single_network_comparison(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    code, out = _map(tmp_path)
    assert code == 0
    cell = pd.DataFrame(json.loads(out.read_text())["cells"]).set_index(
        ["nodes", "inter_bw"]).loc[(4, "10Mbit")]
    single = tmp_path / "one.json"
    assert cli.main(["compare", *(str(DECENTRALIZED / u) for u in UNITS), "--nodes", "4",
                     "--inter-bw", "10Mbit", "--inter-lat", "1ms", "--target", "3.2",
                     "--loss-scaling", "linear-to-critical-batch:512",
                     "--out", str(single)]) == 0
    first = json.loads(single.read_text())["first"]
    for key in ("first", "runner_up", "verdict", "margin_median", "margin_low", "margin_high"):
        assert cell[key] == first[key], key


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("flags", "words"), [
    (["--nodes", "2", "2", "--inter-bw", "1Gbit"], "--nodes lists a value twice"),
    (["--nodes", "2", "8", "--inter-bw", "1Gbit", "fast"], "'fast'"),
    (["--nodes", "2", "0", "--inter-bw", "1Gbit"],
     "argument --nodes: must be an integer >= 1, got '0'"),
    (["--nodes", "2", "8", "--topology", str(ROOT / "experiments/topologies/sites.toml")],
     "--topology fixes the node count"),
    (["--inter-bw", "1Gbit", "--out", "OUT.png"], "a figure is drawn for a map"),
    (["--nodes", "2", "8", "--inter-bw", "1Gbit", "--out", "OUT.pdf"], "must end in"),
])
def test_bad_map_flags_are_one_sentence_and_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture, flags: list[str], words: str
) -> None:
    flags = [f.replace("OUT", str(tmp_path / "m")) for f in flags]
    argv = ["compare", str(DECENTRALIZED / UNITS[0]), *flags, "--out", str(tmp_path / "m.csv")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(300)
@needs_units
def test_a_cell_where_no_method_can_be_timed_stays_blank_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "ada.json"
    assert cli.main(["compare", *(str(DECENTRALIZED / u) for u in UNITS[2:]), "--nodes", "4",
                     "8", "--inter-bw", "1Gbit", "--target", "3.2", "--out", str(out)]) == 0
    cells = pd.DataFrame(json.loads(out.read_text())["cells"]).set_index("nodes")
    assert cells.loc[4, "first"] == "ada" and cells.loc[4, "left_out"] == ""
    assert pd.isna(cells.loc[8, "first"]) and cells.loc[8, "verdict"] == "none"
    assert "recordings are at 4 nodes, not 8" in cells.loc[8, "left_out"]
    assert "left out at 8 nodes, 1Gbit: ada:" in capsys.readouterr().out


@pytest.mark.timeout(300)
@needs_units
def test_with_step_noise_the_map_decides_on_the_widened_brackets(tmp_path: Path) -> None:
    code, out = _map(tmp_path, "--step-noise")
    assert code == 0
    record = json.loads(out.read_text())
    timed = [c for c in record["cells"] if c["runner_up"] is not None]
    assert timed and {c["decided_by"] for c in timed} == {"seeds and step-time variation"}
    assert any("the time brackets that decided: seeds and step-time variation" in n
               for n in record["notes"])
