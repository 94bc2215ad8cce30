"""`flexbench report` and `flexbench sweep --dry-run` do not import torch (each in a new Python)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1"}


def _torch_free(argv: list[str], cwd: Path) -> None:
    """Run the CLI on ``argv`` in a new interpreter; it must exit 0 without importing torch."""
    code = ("import sys; from experiments.cli import main; rc = main(sys.argv[1:]); "
            "assert rc == 0, rc; assert 'torch' not in sys.modules, 'torch was imported'")
    done = subprocess.run([sys.executable, "-c", code, *argv], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_sweep_dry_run_validates_every_unit_without_torch(tmp_path):
    _torch_free(["sweep", str(ROOT / "experiments" / "configs" / "quick.toml"), "--dry-run",
                 "--out", str(tmp_path / "quick")], tmp_path)
    assert not (tmp_path / "quick").exists()  # a dry run writes nothing


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_report_reads_a_sweep_without_torch(tmp_path):
    # report writes its figures and summary into the sweep folder: a copy keeps results/ as is.
    copy = tmp_path / "quick"
    shutil.copytree(ROOT / "results" / "quick", copy)
    _torch_free(["report", str(copy)], tmp_path)
    assert (copy / "summary.md").exists()
