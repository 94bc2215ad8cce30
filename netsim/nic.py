"""Reservation timelines for NICs and links; a node's NIC can be shared by its rank processes."""

from __future__ import annotations

import fcntl
import os
import struct
import threading
from pathlib import Path

__all__ = ["Timeline"]

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
    def _book(free: list[float], start: float, sent: float, received: float, bw: float) -> float:
        finish = start
        for direction, nbytes in enumerate((sent, received)):
            if nbytes <= 0:
                continue
            begin = max(start, free[direction])
            free[direction] = begin + nbytes / bw
            finish = max(finish, free[direction])
        return finish

    def close(self) -> None:
        """Release the shared file handle."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
