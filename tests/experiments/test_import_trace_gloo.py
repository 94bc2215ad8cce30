"""A user's own gloo job, profiled as torch.profiler profiles it, imports: its groups, which the
trace does not name, are found; pipeline- and tensor-parallel jobs are refused by name."""

from __future__ import annotations

import re

import pytest

from experiments.cli import main
from experiments.replay.recordings import read_run
from experiments.run_record import RunRecord
from tests.experiments.gloo_jobs import SHARD, STEPS, profile_jobs


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    return profile_jobs(tmp_path_factory.mktemp("gloo"))


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_plain_gloo_fsdp_job_imports_with_its_groups_found(jobs, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["import-trace", str(jobs / "fsdp"), "--gpus-per-node", "2",
                 "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "inferred: ranks and group size of 36 collectives (c10d ops" in said
    assert "element counts and types of 36 collectives: from their c10d ops' input" in said
    run = read_run(out)
    coll = run.trace[run.trace["kind"] == "collective"]
    assert sorted(coll["step"].unique()) == list(range(1, STEPS + 1))
    # Per rank and step: an all-gather of its shard, a reduce-scatter of the gathered gradient,
    # an all-reduce of the shard, all over the 4 ranks of 2 nodes, fp32 (the all-reduce's type
    # from gloo's own work: its c10d op names a TensorList).
    for _, ops in coll.groupby(["rank", "step"]):
        by_op = ops.set_index("op")
        assert sorted(ops["op"]) == ["all_gather", "all_reduce", "reduce_scatter"]
        assert (ops["group"] == "0,1,2,3").all() and ops["inter"].all()
        assert by_op.loc["all_gather", "bytes"] == SHARD * 4 == by_op.loc["all_reduce", "bytes"]
        assert by_op.loc["reduce_scatter", "bytes"] == 4 * SHARD * 4
    assert RunRecord.load(out).imported["timeline"] == "host"


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_groups_a_gloo_trace_cannot_tell_apart_are_refused(jobs, tmp_path, capsys):
    # HSDP on plain gloo: every rank all-gathers alike at the same moment, in its node's group
    # or (as far as the trace can tell) across nodes; the trace names no group.
    out = tmp_path / "run"
    assert main(["import-trace", str(jobs / "hsdp"), "--gpus-per-node", "2",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    # Which op is refused first depends on timing: an op whose like ran a moment apart on a
    # rank of one candidate group is told apart, and the next one alike is refused instead (an
    # all-reduce's candidates are the world's group too).
    assert re.search(r"rank (\d)'s (all_gather|reduce_scatter|all_reduce) of \d+ float "
                     r"elements in ProfilerStep#\d could have run on any of "
                     r"\[(\[0, 1, 2, 3\], )?\[(\d, \d)\], \[(\d, \d)\]\]", err), err
    assert err.count("\n") == 0 and not out.exists()


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("job", "words"), [
    ("pipeline", "point to point"), ("tensor", "all-reduces 512 float elements in "
                                              "ProfilerStep#1's forward")])
def test_pipeline_and_tensor_parallel_jobs_are_refused_by_their_collective(jobs, tmp_path,
                                                                           capsys, job, words):
    out = tmp_path / "run"
    assert main(["import-trace", str(jobs / job), "--gpus-per-node", "2",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and words in err and "not imported" in err
    assert not out.exists()
