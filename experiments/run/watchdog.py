"""Stalled ranks end the run: each rank beats a progress file, the launcher watches them all.

A rank rewrites its file (`pid step beats`, fixed width, in place) whenever it makes progress;
the launcher notes when each file last changed. A rank that is silent for the stall timeout ends
the run. Its peers fall silent too as soon as they wait for it in a collective, so the rank that
is named is, in order: one the OS reports stopped or dead, then the one at the lowest step, then
the one silent the longest.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

__all__ = ["STARTUP_S", "Heartbeat", "RankStalled", "Watchdog"]

# The least silence allowed before a rank's first step (imports, rendezvous, model building).
STARTUP_S = 300.0

_WIDTH = 64


class RankStalled(RuntimeError):
    """Some rank made no progress for the stall timeout."""


class Heartbeat:
    """The rank side: `beat(step)` records progress in the rank's progress file."""

    def __init__(self, path: Path | str):
        """Open (create) the rank's progress file and record the first beat."""
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        self._beats = 0
        self.beat(0)

    def beat(self, step: int) -> None:
        """Progress at `step`: one in-place write of a few bytes."""
        self._beats += 1
        line = f"{os.getpid()} {step} {self._beats}".ljust(_WIDTH - 1) + "\n"
        os.pwrite(self._fd, line.encode(), 0)

    def close(self) -> None:
        """Close the file (it stays for the launcher)."""
        os.close(self._fd)


class Watchdog:
    """The launcher side: raise RankStalled when a rank's beats stop for `stall_s` seconds."""

    def __init__(self, paths: list[Path], stall_s: float):
        """Watch one progress file per rank."""
        self.paths, self.stall_s = paths, stall_s
        self._seen: list[tuple[int, int, int] | None] = [None] * len(paths)
        self._changed: list[float] = [math.inf] * len(paths)

    def check(self) -> None:
        """Read every progress file; raise RankStalled naming the stalled rank and its step."""
        now = time.monotonic()
        for rank, path in enumerate(self.paths):
            beat = _read(path)
            if beat is not None and beat != self._seen[rank]:
                self._seen[rank], self._changed[rank] = beat, now
        if all(math.isinf(t) for t in self._changed):
            return  # no rank has started yet: the process server is still importing torch
        # A rank that has not beaten yet is timed from the first beat of any rank.
        first = min(self._changed)
        self._changed = [first if math.isinf(t) else t for t in self._changed]
        silent = [r for r in range(len(self.paths)) if now - self._changed[r] > self._limit(r)]
        if not silent:
            return
        rank = self._culprit(silent)
        seen = self._seen[rank]
        where = "before its first step" if seen is None or seen[1] == 0 else f"after step {seen[1]}"
        raise RankStalled(
            f"rank {rank} made no progress for {self._limit(rank):g} s ({where}); the run was "
            f"stopped (raise --stall-timeout if its steps are really that slow)."
        )

    def _culprit(self, silent: list[int]) -> int:
        """The rank to name, given the ranks silent past their limit.

        A peer that waits on a stopped rank can fall silent first (its last beat came a moment
        before the stopped rank's), so a rank the OS reports stopped is a suspect either way.
        """
        stopped = [r for r, seen in enumerate(self._seen) if seen is not None and _stopped(seen[0])]
        return min({*silent, *stopped}, key=self._suspicion)

    def _limit(self, rank: int) -> float:
        """How long `rank` may be silent: longer before its first step, which has to import,
        join the group and build the model (seconds more on a loaded machine)."""
        seen = self._seen[rank]
        started = seen is not None and seen[1] > 0
        return self.stall_s if started else max(self.stall_s, STARTUP_S)

    def _suspicion(self, rank: int) -> tuple[int, int, float]:
        seen = self._seen[rank]
        stopped = seen is not None and _stopped(seen[0])
        return (0 if stopped else 1, seen[1] if seen else -1, self._changed[rank])


def _read(path: Path) -> tuple[int, int, int] | None:
    try:
        pid, step, beats = Path(path).read_text().split()[:3]
        return int(pid), int(step), int(beats)
    except (OSError, ValueError):
        return None  # not written yet, or caught mid-write: read again next time


def _stopped(pid: int) -> bool:
    """Whether the OS reports `pid` stopped, traced or dead (Linux /proc; False elsewhere)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return Path("/proc/self").exists()  # with /proc, a missing entry means the rank is gone
    state = stat.rpartition(")")[2].split()[0]
    return state in ("T", "t", "Z", "X")
