"""The toolkit's own errors, importable from every room without torch."""

from __future__ import annotations

import os
import traceback
from pathlib import Path

__all__ = ["ConfigError", "RunFailed", "Stopped", "is_users_file", "users_location"]

_OURS = Path(__file__).resolve().parents[1]
_STDLIB = Path(os.__file__).resolve().parent
_PACKAGES = ("experiments", "netsim", "flexdemo")


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the value and what is allowed."""


class RunFailed(RuntimeError):
    """A run crashed, stalled or timed out; nothing was written to its output folder."""


class Stopped(RunFailed):
    """A run was stopped from outside (SIGTERM): not a result, and not a failure of the run."""


def is_users_file(path: str) -> bool:
    """Whether a traceback frame's file is the user's own: not flexbench, the standard library
    or an installed package."""
    resolved = Path(path).resolve()
    ours = any(resolved.is_relative_to(_OURS / pkg) for pkg in _PACKAGES)
    return not (ours or "site-packages" in resolved.parts or resolved.is_relative_to(_STDLIB)
                or path.startswith("<"))


def users_location(err: BaseException) -> str:
    """" at FILE:LINE" of the innermost place in the user's own code that `err` passed, or ""."""
    if isinstance(err, SyntaxError) and err.filename and is_users_file(err.filename):
        return f" at {err.filename}:{err.lineno}"
    frames = [f for f in traceback.extract_tb(err.__traceback__) if is_users_file(f.filename)]
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
