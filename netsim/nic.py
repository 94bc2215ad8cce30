"""Reservation timelines for NICs and links; a node's NIC can be shared by its rank processes."""

from __future__ import annotations

import fcntl
import os
import struct
import threading
from pathlib import Path

__all__ = ["Timeline", "fair_share_finishes"]

_FORMAT = "<dd"  # egress free-at, ingress free-at (seconds on the shared time base)


class Timeline:
    """FIFO reservation timeline of a full-duplex link: each direction serves one flow at a time.

    With `path`, the two free-at times live in a small file guarded by fcntl locks, so the separate
    processes of one node see one NIC. Concurrent transfers then queue behind each other, which
    gives the same total completion time as fair sharing of the bandwidth.
    """

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self._lock = threading.Lock()
        self._free = [0.0, 0.0]
        self._fd: int | None = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def reserve(self, start: float, sent: float, received: float, bandwidth: float) -> float:
        """Book `sent`/`received` bytes at `bandwidth` from `start`; returns when both are done."""
        return max(self.reserve_each(start, sent, received, bandwidth))

    def reserve_each(
        self, start: float, sent: float, received: float, bandwidth: float
    ) -> tuple[float, float]:
        """Book like `reserve`; returns when the sent and when the received bytes are done."""
        with self._lock:
            if self._fd is None:
                return self._book(self._free, start, sent, received, bandwidth)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                raw = os.pread(self._fd, struct.calcsize(_FORMAT), 0)
                free = list(struct.unpack(_FORMAT, raw)) if len(raw) == 16 else [0.0, 0.0]
                finish = self._book(free, start, sent, received, bandwidth)
                os.pwrite(self._fd, struct.pack(_FORMAT, *free), 0)
                return finish
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    @staticmethod
    def _book(
        free: list[float], start: float, sent: float, received: float, bw: float
    ) -> tuple[float, float]:
        done = [start, start]
        for direction, nbytes in enumerate((sent, received)):
            if nbytes <= 0:
                continue
            begin = max(start, free[direction])
            free[direction] = done[direction] = begin + nbytes / bw
        return done[0], done[1]

    def close(self) -> None:
        """Release the shared file handle."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def fair_share_finishes(begins: list[float], sizes: list[float], bandwidth: float) -> list[float]:
    """When each flow ends if flows in flight share `bandwidth` equally (processor sharing).

    Flow i starts at begins[i] with sizes[i] bytes; a rank sending to two neighbours at once
    moves each message at half the rate, so both end together.
    """
    if len(begins) != len(sizes):
        raise ValueError(f"{len(begins)} flow starts do not match {len(sizes)} flow sizes.")
    if not bandwidth > 0:
        raise ValueError(f"bandwidth {bandwidth!r} bytes/s must be positive.")
    finishes = [float(b) for b in begins]  # an empty flow ends where it starts
    flows = [i for i, n in enumerate(sizes) if n > 0]
    if not flows:
        return finishes
    # Times relative to the first start: absolute clock readings (~1e9 s) would eat the bytes.
    t0 = min(begins[i] for i in flows)
    pending = sorted((begins[i] - t0, i) for i in flows)
    left = {i: float(sizes[i]) for i in flows}
    for i, end in _share(pending, left, bandwidth).items():
        finishes[i] = t0 + end
    return finishes


def _share(pending: list[tuple[float, int]], left: dict[int, float],
           bandwidth: float) -> dict[int, float]:
    """End of each flow (time since the first start); pending: (start, flow), sorted by start."""
    ends: dict[int, float] = {}
    active: list[int] = []
    now = 0.0
    while pending or active:
        while pending and pending[0][0] <= now:
            active.append(pending.pop(0)[1])
        if not active:
            now = pending[0][0]
            continue
        now = _advance(now, pending, active, left, bandwidth / len(active), ends)
    return ends


def _advance(now: float, pending: list[tuple[float, int]], active: list[int],
             left: dict[int, float], rate: float, ends: dict[int, float]) -> float:
    """Move every active flow at `rate` to the next arrival or end, whichever is first; the time.

    Flows that end are moved from `active` to `ends`.
    """
    smallest = min(left[i] for i in active)
    if pending and pending[0][0] < now + smallest / rate:
        moved = rate * (pending[0][0] - now)  # a newcomer arrives before anyone is done
        now = pending[0][0]
    else:
        moved = smallest
        now += smallest / rate
        # The smallest flows end now by construction: no rounding sliver may keep them.
        for i in [i for i in active if left[i] <= smallest * (1 + 1e-12)]:
            ends[i] = now
            active.remove(i)
    for i in active:
        left[i] -= moved
    return now
