"""Bad input to `flexbench import-trace`: one sentence each, exit 2, nothing written."""

from __future__ import annotations

import gzip
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from experiments.cli import main

DDP = Path(__file__).resolve().parents[1] / "data" / "traces" / "hta-ddp-2xa100" / \
    "nccl_data.json.gz"


def _edited(tmp_path: Path, name: str, edit) -> Path:
    """A copy of the real DDP trace with `edit(data)` applied, gzipped as torch writes it."""
    with gzip.open(DDP, "rt") as f:
        data = json.load(f)
    edit(data)
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump(data, f)
    return path


def _drop(names) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        data["traceEvents"] = [e for e in data["traceEvents"] if not names(e)]
    return edit


def _info(**changes) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        data["distributedInfo"] = {**data["distributedInfo"], **changes}
    return edit


def _refused(tmp_path, capsys, traces: list[Path], flags=("--gpus-per-node", "1")) -> str:
    out = tmp_path / "run"
    code = main(["import-trace", *map(str, traces), *flags, "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    assert not out.exists() and not list(tmp_path.glob(".run.partial-*"))
    return err


def test_a_file_that_is_not_a_trace(tmp_path, capsys):
    text = tmp_path / "notes.json"
    text.write_text("these are my notes\n")
    err = _refused(tmp_path, capsys, [text])
    assert "is not a torch.profiler trace: it does not read as JSON" in err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"data": [1, 2]}))
    assert "is not a torch.profiler trace: it has no traceEvents list" in \
        _refused(tmp_path, capsys, [other])


def test_a_trace_without_steps(tmp_path, capsys):
    trace = _edited(tmp_path, "a/r0.json.gz",
                    _drop(lambda e: str(e.get("name", "")).startswith("ProfilerStep#")))
    assert "holds no training steps (no ProfilerStep#N)" in _refused(tmp_path, capsys, [trace])


def test_a_trace_without_collectives(tmp_path, capsys):
    def communication(e: dict) -> bool:
        name = str(e.get("name", ""))
        return (name == "record_param_comms" or name.startswith(("nccl", "c10d::"))
                or "Collective name" in e.get("args", {}))

    trace = _edited(tmp_path, "a/r0.json.gz", _drop(communication))
    assert "hold no collective in their steps" in _refused(tmp_path, capsys, [trace])


def test_a_trace_of_a_job_of_one_rank(tmp_path, capsys):
    trace = _edited(tmp_path, "a/r0.json.gz", _info(world_size=1))
    assert "is the one rank of a job of one (world_size 1)" in \
        _refused(tmp_path, capsys, [trace])


def test_ranks_of_two_different_runs(tmp_path, capsys):
    twice = tmp_path / "b" / "again.json.gz"
    twice.parent.mkdir()
    shutil.copy(DDP, twice)
    err = _refused(tmp_path, capsys, [DDP, twice])
    assert "are both rank 0: ranks of two different runs" in err
    wider = _edited(tmp_path, "c/r1.json.gz", _info(rank=1, world_size=4))
    err = _refused(tmp_path, capsys, [DDP, wider])
    assert "world of 2" in err and "world of 4" in err and "ranks of two different runs" in err
    later = _edited(tmp_path, "d/r1.json.gz", _shift_steps(_info(rank=1)))
    assert "ranks of two different runs or profiling windows" in \
        _refused(tmp_path, capsys, [DDP, later])


def _shift_steps(then) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        then(data)
        for e in data["traceEvents"]:
            name = str(e.get("name", ""))
            if name.startswith("ProfilerStep#"):
                e["name"] = f"ProfilerStep#{int(name[13:]) + 100}"
    return edit


@pytest.mark.parametrize("per_node", ["3", "4"])
def test_a_rank_count_gpus_per_node_does_not_divide(tmp_path, capsys, per_node):
    err = _refused(tmp_path, capsys, [DDP], ("--gpus-per-node", per_node))
    assert f"--gpus-per-node {per_node} does not divide the traced world of 2 ranks" in err


def test_a_world_too_large_to_copy_its_traced_rank_into(tmp_path, capsys):
    trace = _edited(tmp_path, "a/r0.json.gz", _info(world_size=10**9))
    err = _refused(tmp_path, capsys, [trace])
    assert err.startswith("flexbench import-trace: error: the traces' world of 1,000,000,000 "
                          "ranks: the import would hold about") and "ranks fit" in err
