"""The toolkit's own errors, importable from every room without torch."""

from __future__ import annotations

__all__ = ["ConfigError", "RunFailed", "Stopped"]


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the value and what is allowed."""


class RunFailed(RuntimeError):
    """A run crashed, stalled or timed out; nothing was written to its output folder."""


class Stopped(RunFailed):
    """A run was stopped from outside (SIGTERM): not a result, and not a failure of the run."""
