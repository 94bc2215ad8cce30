"""Progress bars of replay loops (experiments.logs.progress): on stderr where it is a terminal and
the loop outlasts PROGRESS_DELAY_S, never under TQDM_DISABLE, never for a loop that ends first.

The delay is set to 0 (or to an hour) rather than waited for, so nothing here depends on how
fast this machine replays.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest

from experiments import cli, logs

ROOT = Path(__file__).resolve().parents[2]
QUICK = ROOT / "results" / "quick"


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal, as tqdm asks before drawing."""

    def isatty(self) -> bool:
        return True


def _on_terminal(monkeypatch: pytest.MonkeyPatch) -> _Terminal:
    """stderr a terminal, bars on and shown at once. Set inside the test: pytest puts its own
    stderr back between a fixture's setup and the test's call."""
    screen = _Terminal()
    monkeypatch.setattr("sys.stderr", screen)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    monkeypatch.setattr(logs, "PROGRESS_DELAY_S", 0.0)
    return screen


def _loop(n: int = 3) -> None:
    for _ in logs.progress(range(n), total=n, desc="replays", unit="run"):
        pass


def test_a_bar_is_drawn_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = _on_terminal(monkeypatch)
    _loop()
    assert "replays:   0%" in terminal.getvalue() and "0/3 [" in terminal.getvalue()


@pytest.mark.parametrize("value", ["1", "true", "yes"])
def test_tqdm_disable_turns_it_off(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    terminal = _on_terminal(monkeypatch)
    monkeypatch.setenv("TQDM_DISABLE", value)
    _loop()
    assert terminal.getvalue() == ""


def test_a_loop_that_ends_before_the_delay_draws_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = _on_terminal(monkeypatch)
    monkeypatch.setattr(logs, "PROGRESS_DELAY_S", 3600.0)
    _loop()
    assert terminal.getvalue() == ""


def test_no_bar_where_stderr_is_not_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    _on_terminal(monkeypatch)
    plain = io.StringIO()
    monkeypatch.setattr("sys.stderr", plain)
    _loop()
    assert plain.getvalue() == ""


@pytest.mark.timeout(120)
@pytest.mark.skipif(not (QUICK / "runs.parquet").exists(),
                    reason="needs the committed results/quick sweep")
def test_compare_of_run_folders_draws_its_bar(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = _on_terminal(monkeypatch)
    runs = []
    for unit in ("hsdp-adamw-s0", "flexdemo-s0"):
        runs.append(tmp_path / unit)
        shutil.copytree(QUICK / "units" / unit, runs[-1])
    argv = ["compare", *map(str, runs), "--inter-bw", "10Mbit", "--inter-lat", "1ms",
            "--target", "2.9"]
    assert cli.main(argv) == 0
    assert "compare:   0%" in terminal.getvalue() and "0/2 [" in terminal.getvalue()
    # The same comparison under TQDM_DISABLE: the warnings and notes only, no bar.
    monkeypatch.setenv("TQDM_DISABLE", "1")
    terminal.seek(0)
    terminal.truncate()
    assert cli.main(argv) == 0
    assert "compare:" not in terminal.getvalue()
