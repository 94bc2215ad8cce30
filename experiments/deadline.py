"""The run's timeout over the user's code that the launcher calls itself, before any rank starts.

`flexbench run --timeout` ends hung ranks from the launcher's loop, but the workload check calls
the user's module, factory, model() and batch() in the launcher's own main thread, which nothing
watches: `run_deadline` states the deadline there and `bounded` runs one such call under it.

A SIGALRM timer rather than a watcher thread: its handler raises inside the hung call, so the
call really stops (a thread could only be abandoned, still running and holding its memory in a
sweep that goes on to its next unit) and the traceback points at the user's line. Signal
handlers can only be set in the main thread and the timer is Unix's, so elsewhere the call runs
unbounded, as it did before. Torch-free.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from experiments.errors import RunFailed, users_location

__all__ = ["DeadlinePassed", "bounded", "run_deadline"]

_T = TypeVar("_T")

# The deadlines in force, innermost last: (time.monotonic() at which it passes, its seconds).
_DEADLINES: list[tuple[float, float]] = []

# The least a timer is armed for: setitimer(0) would disarm it instead.
_SOONEST_S = 1e-3


class DeadlinePassed(BaseException):
    """The run's deadline passed inside a bounded call.

    A BaseException, as KeyboardInterrupt is, so that a user's `except Exception` around the
    hung line cannot swallow it.
    """


@contextmanager
def run_deadline(seconds: float | None) -> Iterator[None]:
    """Within the block, `bounded` calls stop ``seconds`` from now (None: never)."""
    if seconds is None:
        yield
        return
    _DEADLINES.append((time.monotonic() + seconds, seconds))
    try:
        yield
    finally:
        _DEADLINES.pop()


def bounded(what: str, call: Callable[[], _T]) -> _T:
    """``call()``, stopped at the run's deadline with RunFailed naming ``what`` and the line."""
    if not _DEADLINES or not _can_alarm():
        return call()
    end, seconds = _DEADLINES[-1]
    remaining = max(end - time.monotonic(), _SOONEST_S)
    outer, _ = signal.getitimer(signal.ITIMER_REAL)
    if outer and outer <= remaining:
        return call()  # someone else's timer (pytest-timeout's) fires first: theirs to handle
    previous = signal.signal(signal.SIGALRM, _expire)
    started = time.monotonic()
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, remaining)
            return call()
        finally:
            # Disarmed inside the outer try, so that an alarm landing just as the call
            # returns is still caught below rather than escaping as a traceback.
            signal.setitimer(signal.ITIMER_REAL, 0)
    except DeadlinePassed as err:
        raise RunFailed(f"{what} did not return within the run's timeout of {seconds:g} s "
                        f"(it was still running{users_location(err)}); the run was stopped "
                        "before any rank started and nothing was written.") from None
    finally:
        signal.signal(signal.SIGALRM, previous)
        if outer:  # give the outer timer back what it had left
            left = outer - (time.monotonic() - started)
            signal.setitimer(signal.ITIMER_REAL, max(left, _SOONEST_S))


def _expire(signum: int, frame: object) -> None:
    raise DeadlinePassed


def _can_alarm() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
