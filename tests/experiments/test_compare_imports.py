"""`flexbench compare` loads what it uses, and prints the README's table to the digit.

The README's quick start quotes `flexbench compare results/standard --inter-bw 200Mbit
--inter-lat 30ms --same-compute all`; run in a fresh interpreter, it must print those table
lines exactly and load no module of the sweep, the report's figures or the kernel shaper.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STANDARD = ROOT / "results" / "standard"
ARGV = ["compare", "results/standard", "--inter-bw", "200Mbit", "--inter-lat", "30ms",
        "--same-compute", "all"]
NOT_LOADED = ("experiments.sweep", "experiments.report.figures", "netsim.kernel")

_PROGRAM = """
import json, sys
from experiments import cli
status = cli.main({argv!r})
print("LOADED " + json.dumps(sorted(m for m in sys.modules
                                    if m.split(".")[0] in ("experiments", "netsim"))))
sys.exit(status)
"""


def _readme_table() -> list[str]:
    """The table rows the README quotes under its compare command."""
    text = (ROOT / "README.md").read_text()
    block = text[text.index("$ flexbench " + " ".join(ARGV)):]
    block = block[:block.index("```")]
    return [line for line in block.splitlines() if re.match(r"(rank |\d+ )", line)]


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.skipif(not (STANDARD / "runs.parquet").exists(), reason="needs results/standard")
def test_compare_loads_no_sweep_report_or_kernel_module_and_prints_the_readmes_table() -> None:
    done = subprocess.run([sys.executable, "-c", _PROGRAM.format(argv=ARGV)], cwd=ROOT,
                          capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    loaded = json.loads(next(line for line in lines if line.startswith("LOADED "))[7:])
    wrong = [m for m in loaded if m.startswith(NOT_LOADED)]
    assert not wrong, f"flexbench compare loaded {', '.join(wrong)}"
    assert "experiments.replay.compare" in loaded  # the check sees what was loaded
    table = [line for line in lines if re.match(r"(rank |\d+ )", line)]
    assert table == _readme_table()
