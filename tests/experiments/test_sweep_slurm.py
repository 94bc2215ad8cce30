"""`flexbench sweep --executor slurm` against a real one-node Slurm started on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest

from tests.slurm_cluster import SlurmCluster, missing_binaries

ROOT = Path(__file__).resolve().parents[2]

SWEEP = """
name = "{name}"
timeout_s = 240

[run]
workload = "{workload}"
nodes = 2
gpus_per_node = 1
steps = {steps}
eval_every = {steps}

[grid]
methods = ["hsdp-adamw"]
inter_bw = ["1Gbit"]
inter_lat = ["1ms"]
seeds = {seeds}

[executor]
kind = "slurm"
cpus_per_task = 1
"""

# A workload that builds where the sweep checks it and breaks inside a Slurm job.
BROKEN = """
import os

from experiments.workloads import make_workload


def make():
    if "SLURM_JOB_ID" in os.environ:
        raise RuntimeError("this workload is broken on purpose")
    return make_workload("lm-tiny")
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A one-node Slurm cluster (munged, slurmctld, slurmd), started once for this module's
    tests and stopped after the last of them."""
    missing = missing_binaries()
    if missing:
        pytest.skip(f"Slurm is not installed (no {', '.join(missing)}): "
                    "apt-get install slurm-wlm munge")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except RuntimeError:
        cluster.stop()
        raise
    yield cluster
    cluster.stop()


def _env(slurm: SlurmCluster | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    env.pop("SLURM_CONF", None)
    return {**env, **(slurm.env if slurm else {})}


def _write(tmp: Path, name: str, *, steps: int, seeds: str = "[0]",
           workload: str = "lm-tiny") -> Path:
    path = tmp / f"{name}.toml"
    path.write_text(SWEEP.format(name=name, steps=steps, seeds=seeds, workload=workload))
    return path


def _sweep(config: Path, out: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "experiments.cli", "sweep", str(config), "--out", str(out),
         "--executor", "slurm"],
        cwd=config.parent, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc: subprocess.Popen, slurm: SlurmCluster, timeout: float) -> tuple[int, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the sweep did not end in {timeout:g} s\n{err[-3000:]}\n{slurm.logs()}")
    return proc.returncode, out + err


@pytest.mark.slurm
@pytest.mark.dist
@pytest.mark.timeout(240)
def test_slurm_sweep_runs_two_units_as_jobs_and_scores_them(slurm, tmp_path):
    config = _write(tmp_path, "two", steps=1, seeds="[0, 1]")
    out = tmp_path / "out"
    code, text = _finish(_sweep(config, out, _env(slurm)), slurm, 200)
    assert code == 0, text[-3000:]
    runs = pd.read_parquet(out / "runs.parquet")
    assert sorted(runs["unit"]) == ["hsdp-adamw-s0", "hsdp-adamw-s1"]
    assert list(runs["status"]) == ["done", "done"] and runs["final_val_loss"].notna().all()
    for unit in runs["unit"]:
        # Each unit ran inside a Slurm job, not in the sweep's own process.
        assert json.loads((out / "units" / unit / "run.json").read_text())["host"]
    logs = list((out / "submitit").glob("*_log.out"))
    assert len(logs) == 2, sorted(p.name for p in (out / "submitit").iterdir())


def _wait_for_ranks(out: Path, proc: subprocess.Popen, deadline_s: float) -> None:
    """Until a rank of the unit's run reports progress: the job is running and training."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if list((out / "units").glob(".*.partial-*/progress-*")):
            return
        if proc.poll() is not None:
            pytest.fail(f"the sweep ended before its unit trained: {proc.stderr.read()[-2000:]}")
        time.sleep(0.2)
    pytest.fail(f"no rank reported progress in {deadline_s:g} s")


@pytest.mark.slurm
@pytest.mark.dist
@pytest.mark.timeout(240)
def test_scancel_leaves_the_running_unit_pending_and_resume_reruns_it(slurm, tmp_path):
    config = _write(tmp_path, "cancel", steps=20)
    out = tmp_path / "out"
    env = _env(slurm)
    proc = _sweep(config, out, env)
    _wait_for_ranks(out, proc, 90)
    jobs = slurm.run("squeue", "-h", "-o", "%i %T").stdout.split("\n")
    running = [line.split()[0] for line in jobs if line.endswith("RUNNING")]
    assert len(running) == 1, jobs
    assert slurm.run("scancel", running[0]).returncode == 0
    code, text = _finish(proc, slurm, 90)
    assert code == 1 and "did not finish: hsdp-adamw-s0" in text, text[-3000:]
    state = json.loads((out / "sweep.json").read_text())["units"]
    assert state == {"hsdp-adamw-s0": "pending"}, text[-3000:]
    assert not (out / "failed").exists() or not list((out / "failed").iterdir())
    code, text = _finish(_sweep(config, out, env), slurm, 150)
    assert code == 0, text[-3000:]
    assert json.loads((out / "sweep.json").read_text())["units"] == {"hsdp-adamw-s0": "done"}


@pytest.mark.slurm
@pytest.mark.dist
@pytest.mark.timeout(240)
def test_a_unit_that_fails_in_its_job_is_recorded_failed_with_its_log(slurm, tmp_path):
    (tmp_path / "broken_workload.py").write_text(BROKEN)
    config = _write(tmp_path, "broken", steps=1, workload="broken_workload:make")
    out = tmp_path / "out"
    env = {**_env(slurm), "PYTHONPATH": f"{ROOT}:{tmp_path}"}
    code, text = _finish(_sweep(config, out, env), slurm, 150)
    assert code == 1 and "did not finish: hsdp-adamw-s0" in text, text[-3000:]
    record = json.loads((out / "failed" / "hsdp-adamw-s0.json").read_text())
    assert "broken on purpose" in record["error"], record
    log = Path(record["log"])
    assert log.is_file() and log.is_relative_to(out / "submitit"), record
    runs = pd.read_parquet(out / "runs.parquet")
    assert list(runs["status"]) == ["failed"] and "broken on purpose" in runs["error"][0]


@pytest.mark.slurm
@pytest.mark.dist
@pytest.mark.timeout(120)
def test_slurm_executor_without_a_reachable_slurm_is_one_sentence(tmp_path):
    config = _write(tmp_path, "nowhere", steps=2)
    out = tmp_path / "out"
    # No Slurm client on PATH at all: only this Python's own folder.
    env = {**_env(None), "PATH": str(Path(sys.executable).parent)}
    code, text = _finish_plain(_sweep(config, out, env), 60)
    assert code == 2, text
    lines = text.strip().splitlines()
    assert len(lines) == 1 and "sbatch" in lines[0] and "Traceback" not in text, text
    assert not out.exists()


@pytest.mark.slurm
@pytest.mark.dist
@pytest.mark.timeout(120)
def test_slurm_executor_with_a_controller_that_does_not_answer_is_one_sentence(tmp_path):
    if missing_binaries():
        pytest.skip("Slurm's client programs are not installed")
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=nowhere\nSlurmctldHost=nowhere(127.0.0.1)\nSlurmctldPort=9\n"
                    "NodeName=nowhere CPUs=1\nPartitionName=debug Nodes=ALL Default=YES\n")
    config = _write(tmp_path, "nowhere", steps=2)
    out = tmp_path / "out"
    env = {**_env(None), "SLURM_CONF": str(conf)}
    code, text = _finish_plain(_sweep(config, out, env), 90)
    assert code == 2, text
    lines = text.strip().splitlines()
    assert len(lines) == 1 and "controller" in lines[0] and "Traceback" not in text, text
    assert not out.exists()


def _finish_plain(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out + err
