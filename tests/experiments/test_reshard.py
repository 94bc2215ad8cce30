"""Re-shard on replay and the declared hardware profile of `flexbench simulate`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from experiments.cli import main
from experiments.config import RunConfig
from experiments.errors import ConfigError
from experiments.replay.engine import replay
from experiments.replay.recordings import read_run
from experiments.replay.reshard import reshard_trace, run_layout, shard_elements
from experiments.replay.target import ReplayTarget
from experiments.run.launch import launch

ROOT = Path(__file__).resolve().parents[2]
QUICK = ROOT / "results/quick-2026-11-30/units"  # recorded before run.json held the layout


def _per_rank_step(trace: pd.DataFrame) -> pd.Series:
    """Bytes rank 0 hands in per training step, per (op, inter)."""
    rows = trace[(trace["phase"] == "train") & (trace["kind"] == "collective")
                 & (trace["rank"] == 0)]
    return rows.groupby(["op", "inter"])["bytes"].sum() / rows["step"].nunique()


def test_shard_elements_pads_dim0_as_fsdp2_does():
    assert shard_elements([10, 3], 4) == 9  # ceil(10 / 4) = 3 rows of 3
    assert shard_elements([8, 3], 4) == 6
    assert shard_elements([], 8) == 1  # a scalar is one row


def _tiny_trace(g: int, units: list) -> pd.DataFrame:
    """One rank's step: a reduce-scatter and all-gather per unit, fp32, at g ranks per node."""
    rows = []
    for unit in units:
        shard = sum(shard_elements(s, g) for s in unit) * 4
        rows += [("reduce_scatter", False, shard * g), ("all_gather", False, shard),
                 ("all_reduce", True, shard)]
    return pd.DataFrame([{"rank": 0, "step": 1, "kind": "collective", "op": op, "inter": inter,
                          "bytes": nbytes, "phase": "train"} for op, inter, nbytes in rows])


def test_padded_units_resize_exactly():
    units = [[[10, 3], [5]], [[7, 2]]]
    cfg = RunConfig(method="hsdp-adamw", gpus_per_node=2)
    got = reshard_trace(_tiny_trace(2, units), cfg, (units, "given"), 4)
    assert got.trace["bytes"].tolist() == _tiny_trace(4, units)["bytes"].tolist()
    assert any("exact" in note for note in got.notes)


def test_hsdp_payload_per_node_is_the_model_at_any_ranks_per_node():
    run = read_run(QUICK / "hsdp-adamw-s0")
    layout = run_layout(run.meta, run.config)
    assert layout is not None and "derived" in layout[1]
    per_rank = _per_rank_step(reshard_trace(run.trace, run.config, layout, 8).trace)
    assert per_rank[("all_reduce", True)] * 8 == run.meta["params"] * 4  # no padding at 8


def test_flexdemo_top_k_scales_with_the_shard_and_says_it_is_approximate():
    run = read_run(QUICK / "flexdemo-s0")
    got = reshard_trace(run.trace, run.config, run_layout(run.meta, run.config), 8)
    before, after = _per_rank_step(run.trace), _per_rank_step(got.trace)
    assert after[("all_gather", True)] == pytest.approx(before[("all_gather", True)] / 4, rel=1e-3)
    assert any(note.startswith("approximate") for note in got.notes)


def test_flexdemo_dense_exchange_resizes_exactly_as_the_gradient_all_reduce():
    # The dense exchange all-reduces the whole shard's coefficients in bf16: 2 bytes per element
    # of the rank's shard, padding included, at any ranks per node (3: rows padded).
    units = [[[10, 3], [5]], [[7, 2]]]

    def trace(g: int) -> pd.DataFrame:
        shard = sum(shard_elements(s, g) for unit in units for s in unit)
        return pd.DataFrame([{"rank": 0, "step": 1, "kind": "collective", "op": "all_reduce",
                              "inter": True, "bytes": 2 * shard, "phase": "train"}])

    cfg = RunConfig(method="flexdemo", exchange="dense", gpus_per_node=2)
    got = reshard_trace(trace(2), cfg, (units, "given"), 3)
    assert got.trace["bytes"].tolist() == trace(3)["bytes"].tolist() == [2 * (12 + 2 + 6)]
    assert any("exact: inter-node all_reduce" in note for note in got.notes)
    assert not any(note.startswith("approximate") for note in got.notes)


def test_unsharded_demo_keeps_its_payloads():
    run = read_run(QUICK / "demo-chunking=flat_topk=4-s0")
    got = reshard_trace(run.trace, run.config, None, 8)
    assert got.trace is run.trace and "does not shard" in got.notes[0]


def _user_workload_run(tmp_path: Path) -> Path:
    run = tmp_path / "user"
    shutil.copytree(QUICK / "hsdp-adamw-s0", run)
    meta = json.loads((run / "run.json").read_text())
    meta["config"]["workload"] = "mine.models:build"
    (run / "run.json").write_text(json.dumps(meta))
    return run


def test_unknown_layout_refuses_in_one_sentence(tmp_path, capsys):
    run = _user_workload_run(tmp_path)
    with pytest.raises(ConfigError, match="no parameter layout"):
        replay(read_run(run), ReplayTarget(inter_bw="1Gbit", gpus_per_node=8))
    out = tmp_path / "s.csv"
    argv = ["simulate", str(run), "--inter-bw", "1Gbit", "--gpus-per-node", "8", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--gpus-per-node 2" in err and not out.exists()
    # The same shape needs no layout.
    assert main([*argv[:4], "--out", str(out)]) == 0


def test_declared_compute_models_intra_links_and_says_so(tmp_path, capsys):
    sim = ["simulate", str(QUICK / "hsdp-adamw-s0"), "--inter-bw", "100Gbit", "--inter-lat",
           "1ms"]
    assert main([*sim, "--out", str(tmp_path / "a.csv")]) == 0
    plain = capsys.readouterr().out
    assert "intra-node:" not in plain  # a same-shape replay prints as it always did
    assert main([*sim, "--compute-scale", "0.02", "--out", str(tmp_path / "b.csv")]) == 0
    declared = capsys.readouterr().out
    assert "compute: declared: x0.02" in declared
    assert "intra-node: modeled on 800 Gbit/s (100 GB/s), 5 us a message (NVLink-class" in declared
    assert "inter-node: modeled" in declared
    assert main([*sim, "--compute-scale", "0.02", "--intra", "recorded",
                 "--out", str(tmp_path / "c.csv")]) == 0
    assert "intra-node: measured" in capsys.readouterr().out
    step = {name: pd.read_csv(tmp_path / name)["step_time_s"].median() for name in
            ("b.csv", "c.csv")}
    assert step["b.csv"] < step["c.csv"] / 3  # the CPU loopback dominated the scaled step


def test_intra_link_flag_with_recorded_intra_is_refused(tmp_path, capsys):
    argv = ["simulate", str(QUICK / "hsdp-adamw-s0"), "--inter-bw", "1Gbit", "--intra",
            "recorded", "--intra-bw", "400GB/s", "--out", str(tmp_path / "s.csv")]
    assert main(argv) == 2
    assert "--intra-bw prices modeled intra-node links" in capsys.readouterr().err


def _recorded(tmp_path: Path, method: str, per_node: int) -> Path:
    cfg = RunConfig(method=method, workload="lm-tiny", nodes=2, gpus_per_node=per_node,
                    steps=2, eval_every=1000, batch_size=2, seed=0)
    return launch(cfg, tmp_path / f"{method}-g{per_node}", timeout_s=400, quiet=True)


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("method", "per_node", "rel"), [
    ("hsdp-adamw", 4, 0.0),
    ("hsdp-adamw", 3, 0.0),  # 3: lm-tiny's 128-row tensors are padded
    ("flexdemo", 4, 0.01),  # its top-k payload scales with the shard only approximately
])
def test_replayed_2x2_moves_what_a_real_run_of_the_target_records(tmp_path, method, per_node, rel):
    small, real = _recorded(tmp_path, method, 2), _recorded(tmp_path, method, per_node)
    run = read_run(small)
    assert run.meta["layout"]  # new runs record their FSDP2 layout
    layout = run_layout(run.meta, run.config)
    replayed = reshard_trace(run.trace, run.config, layout, per_node).trace
    got, want = _per_rank_step(replayed), _per_rank_step(read_run(real).trace)
    assert list(got.index) == list(want.index)
    for kind in want.index:
        exact = not kind[1] or rel == 0.0  # FSDP2's intra-node payloads are always exact
        assert got[kind] == pytest.approx(want[kind], rel=0.0 if exact else rel), kind


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("method", ["hsdp-adamw", "flexdemo"])
def test_a_one_rank_per_node_recording_gets_the_fsdp2_traffic_a_real_2x2_records(tmp_path,
                                                                                  method):
    from experiments.replay.fsdp2_traffic import add_fsdp2_traffic
    from netsim import Link
    from netsim.model import compute_phases

    alone, real = _recorded(tmp_path, method, 1), _recorded(tmp_path, method, 2)
    run = read_run(alone)
    layout = run_layout(run.meta, run.config)
    link = Link(1e9, 1e-4)
    added = add_fsdp2_traffic(run.trace, layout[0], 2, link)
    resized = reshard_trace(added, run.config, layout, 2).trace
    target = read_run(real).trace
    # Per step, rank 0 hands in what a real 2 x 2 rank does (flexdemo's top-k to within 1%).
    got, want = _per_rank_step(resized), _per_rank_step(target)
    assert list(got.index) == list(want.index)
    for kind in want.index:
        exact = not kind[1] or method == "hsdp-adamw"
        assert got[kind] == pytest.approx(want[kind], rel=0.0 if exact else 0.01), kind
    order = lambda t: t[(t["rank"] == 0) & (t["step"] == 2) & (t["kind"] == "collective")  # noqa: E731
                        & ~t["inter"]][["op", "bytes"]].values.tolist()
    assert sorted(order(resized)) == sorted(order(target))
    # No recorded compute is lost: every gap moved by the ops inserted before it.
    assert compute_phases(added) == pytest.approx(compute_phases(run.trace), rel=1e-9)
    step = added[(added["kind"] == "step") & (added["rank"] == 0)]
    original = run.trace[(run.trace["kind"] == "step") & (run.trace["rank"] == 0)]
    inserted = added[(added["rank"] == 0) & (added["kind"] == "collective") & ~added["inter"]]
    per_step = (inserted["end_s"] - inserted["start_s"]).groupby(inserted["step"]).sum()
    grown = (step["end_s"] - step["start_s"]).to_numpy() - (
        original["end_s"] - original["start_s"]).to_numpy()
    assert grown == pytest.approx(per_step.to_numpy(), rel=1e-9)


def test_fsdp2_traffic_is_added_only_to_one_rank_per_node_recordings_with_marks():
    from experiments.replay.fsdp2_traffic import add_fsdp2_traffic
    from netsim import Link

    run = read_run(QUICK / "hsdp-adamw-s0")  # 2 x 2: it has FSDP2's traffic of its own
    units = run_layout(run.meta, run.config)[0]
    with pytest.raises(ValueError, match="only to a recording of one rank per node"):
        add_fsdp2_traffic(run.trace, units, 4, Link(1e9, 0.0))
    alone = run.trace[run.trace["local"] == 0].assign(
        rank=lambda t: t["node"], local=0, group="0")  # one rank per node, and no marks
    with pytest.raises(ValueError, match='no "unit_backward" marks'):
        add_fsdp2_traffic(alone, units, 4, Link(1e9, 0.0))


@pytest.mark.parametrize("unit", ["diloco-s0", "flexdemo-s0"])
def test_added_fsdp2_traffic_keeps_every_nodes_compute_whatever_the_clocks_offset(unit):
    from experiments.replay.fsdp2_traffic import add_fsdp2_traffic
    from netsim import Link
    from netsim.model import compute_phases

    # results/quick trains one rank a node. An inserted op must end exactly where the next row
    # starts: one ulp of rounding left a gap (a compute item) in some nodes' programs only, so
    # the replay's node set changed and 0.3% of diloco's compute went missing (offset 0).
    run = read_run(ROOT / "results/quick/units" / unit)
    units = run_layout(run.meta, run.config)[0]
    for offset in (0.0, 0.1, 1.7, 1.8e9 + 0.3):
        trace = run.trace.assign(**{c: run.trace[c] + offset
                                    for c in ("start_s", "wait_s", "end_s")})
        added = add_fsdp2_traffic(trace, units, 2, Link(1e9, 1e-4))
        assert compute_phases(added) == pytest.approx(compute_phases(trace), rel=1e-9), offset
