"""Test tiers: a test that starts Python processes (ranks, launchers, CLIs) carries `dist`.

`pytest -m "not dist"` is then the fast loop. The marker is checked, not trusted: a test that
starts a Python process without it fails, naming itself, so the fast loop stays process-free.
"""

from __future__ import annotations

import multiprocessing.process
import subprocess
import sys

import pytest


def _is_python(args) -> bool:
    words = [args] if isinstance(args, str | bytes) else list(args)
    return any(str(w) == sys.executable or "python" in str(w).rsplit("/", 1)[-1]
               or "torchrun" in str(w) for w in words)


@pytest.fixture(autouse=True)
def _dist_marker_is_true(request, monkeypatch):
    """Fail a test that starts a Python process but is not marked `dist`."""
    started: list[str] = []
    popen_init = subprocess.Popen.__init__
    process_start = multiprocessing.process.BaseProcess.start

    def watched_popen(self, args, *rest, **kwargs):
        if _is_python(args):
            started.append(" ".join(map(str, args if not isinstance(args, str) else [args]))[:80])
        popen_init(self, args, *rest, **kwargs)

    def watched_start(self):
        started.append(f"multiprocessing {self.name}")
        process_start(self)

    monkeypatch.setattr(subprocess.Popen, "__init__", watched_popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", watched_start)
    yield
    if started and request.node.get_closest_marker("dist") is None:
        pytest.fail(f"{request.node.nodeid} starts Python processes ({started[0]}) but is not "
                    "marked @pytest.mark.dist", pytrace=False)
