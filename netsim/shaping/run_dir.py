"""The per-run folder that holds a node's shared NIC files, and the cleanup of stale ones.

A node's rank processes share its NIC through small files, so they must agree on one folder:
- given explicitly (`install(run_dir=...)` or the NETSIM_RUN_DIR environment variable), the folder
  belongs to whoever made it (the launcher), which also removes it; netsim only adds files;
- otherwise it is `<tmp>/netsim-run-<run token>`: every rank derives the same name from the run
  token agreed through the default store. The rank that creates it writes its host and pid into
  an `owner` file and removes the folder at close; a later start on the same host removes such
  folders whose owner process is gone (a run that crashed before closing).
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

from netsim.processes import pid_alive

__all__ = ["ENV_VAR", "PREFIX", "RunDir", "clean_stale_run_dirs", "pid_alive"]

ENV_VAR = "NETSIM_RUN_DIR"
PREFIX = "netsim-run-"
_OWNER = "owner"
_GRACE_S = 60.0  # a folder this young may be between mkdir and its owner file: never stale


class RunDir:
    """Where one Shaper keeps its shared NIC files; removes the folder at close if it made it."""

    def __init__(
        self, path: str | os.PathLike | None = None, base: str | os.PathLike | None = None
    ) -> None:
        explicit = path if path is not None else os.environ.get(ENV_VAR) or None
        self.explicit = explicit is not None
        self.base = Path(base) if base is not None else Path(tempfile.gettempdir())
        self._path: Path | None = Path(explicit) if explicit is not None else None
        self._owned = False
        if not self.explicit:
            clean_stale_run_dirs(self.base)

    @property
    def owned(self) -> bool:
        """Whether this process created the folder (and so removes it at close)."""
        return self._owned

    def path(self, token: str) -> Path:
        """The folder, created on first use; the default name comes from the shared run token."""
        if self._path is None:
            self._path = self.base / f"{PREFIX}{token}"
        if self.explicit:
            self._path.mkdir(parents=True, exist_ok=True)
        elif not self._owned and not self._path.is_dir():
            self._claim(self._path)
        return self._path

    def _claim(self, path: Path) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir()
        except FileExistsError:
            return  # another rank of this node made it first: it owns the folder
        self._owned = True
        tmp = path / f".{_OWNER}.{os.getpid()}"
        tmp.write_text(f"{socket.gethostname()} {os.getpid()}\n")
        os.replace(tmp, path / _OWNER)

    def close(self) -> None:
        """Remove the folder if this process created it (open files stay usable until closed)."""
        if self._owned and self._path is not None:
            shutil.rmtree(self._path, ignore_errors=True)
        self._owned = False


def _owner_alive(folder: Path) -> bool | None:
    """True/False for an owner process on this host; None if it lives elsewhere or is unknown."""
    try:
        host, pid = (folder / _OWNER).read_text().split()
    except (OSError, ValueError):
        return None
    if host != socket.gethostname():
        return None
    # A pid we cannot read is kept: better a stale folder than someone else's removed.
    return pid_alive(int(pid)) if pid.isdigit() else True


def clean_stale_run_dirs(base: str | os.PathLike | None = None) -> list[Path]:
    """Remove our run folders in `base` (default: the temp dir) whose owner process is gone."""
    base = Path(base) if base is not None else Path(tempfile.gettempdir())
    removed = []
    try:
        candidates = [p for p in base.iterdir() if p.name.startswith(PREFIX) and p.is_dir()]
    except OSError:
        return removed
    for folder in candidates:
        alive = _owner_alive(folder)
        if alive is None:
            # No readable owner: stale only if its creator had ample time to write one.
            try:
                young = time.time() - folder.stat().st_mtime < _GRACE_S
            except OSError:
                continue
            if young or (folder / _OWNER).exists():
                continue
        elif alive:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed
