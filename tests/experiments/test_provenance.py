"""What every run and sweep records of where it ran."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from experiments.io import cpu_model, provenance


def test_provenance_names_the_commit_and_the_cpu_model() -> None:
    info = provenance()
    # None only outside a git checkout
    assert info["git_commit"] is None or re.fullmatch(r"[0-9a-f]{40}", info["git_commit"])
    assert info["host"]["cpus"] >= 1
    assert info["host"]["cpu"] == cpu_model()


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="reads Linux's /proc/cpuinfo")
def test_the_cpu_model_is_the_one_proc_cpuinfo_names() -> None:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    names = {line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")}
    if not names:
        pytest.skip("this machine's /proc/cpuinfo names no model (some ARM kernels)")
    assert cpu_model() in names


@pytest.mark.timeout(120)
def test_a_run_records_the_commit_it_started_on(tmp_path: Path, monkeypatch) -> None:
    # A commit made while a long run trains is not the code the run imported: run.json names
    # the commit and tree of the run's start.
    import experiments.run.folder as folder_module
    from experiments.config import RunConfig
    from experiments.run.emulate import emulate

    calls = []

    def changing() -> dict:
        calls.append(1)
        return {**provenance(), "git_commit": ("a" if len(calls) == 1 else "b") * 40,
                "git_dirty": len(calls) > 1}

    monkeypatch.setattr(folder_module, "provenance", changing)
    cfg = RunConfig(method="hsdp-adamw", nodes=2, gpus_per_node=1, workload="vision-tiny",
                    steps=2, eval_every=2)
    out = emulate(cfg, tmp_path / "run", quiet=True)
    meta = json.loads((out / "run.json").read_text())
    assert len(calls) == 2  # at the start and when run.json was written
    assert meta["git_commit"] == "a" * 40 and meta["git_dirty"] is False
