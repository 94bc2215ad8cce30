"""What every run and sweep records of where it ran."""

from __future__ import annotations

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
