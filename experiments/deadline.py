"""A command's timeout over the user's code it calls itself, and the one rule for that code.

`flexbench run --timeout` ends hung ranks from the launcher's loop, but the workload check calls
the user's module, factory, model() and batch() in the launcher's own main thread, which nothing
watches; `flexbench plan` calls a model factory the same way. `run_deadline` states the deadline
there and `bounded` runs one such call under it; `users_call` is how the user's code is called:
under the deadline, and any escape from it (an exception, or a `sys.exit` inside it) reported
as its failure with the user's file and line (KeyboardInterrupt goes on as an interrupt).

A SIGALRM timer rather than a watcher thread: its handler raises inside the hung call, so the
call really stops (a thread could only be abandoned, still running and holding its memory in a
sweep that goes on to its next unit) and the traceback points at the user's line. Signal
handlers can only be set in the main thread and the timer is Unix's, so elsewhere the call runs
unbounded, as it did before. Torch-free.
"""

from __future__ import annotations

import importlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from experiments.errors import ConfigError, RunFailed, users_location

__all__ = ["DeadlinePassed", "bounded", "run_deadline", "users_call", "users_factory"]

_T = TypeVar("_T")


@dataclass(frozen=True)
class _Deadline:
    end: float
    """time.monotonic() at which it passes."""
    seconds: float
    command: str
    """Whose timeout it is, in the refusal: "run", "plan"."""
    stopped: str
    """What stopping at it spared, in the refusal: "before any rank started"."""


# The deadlines in force, innermost last.
_DEADLINES: list[_Deadline] = []

# The least a timer is armed for: setitimer(0) would disarm it instead.
_SOONEST_S = 1e-3


class DeadlinePassed(BaseException):
    """The run's deadline passed inside a bounded call.

    A BaseException, as KeyboardInterrupt is, so that a user's `except Exception` around the
    hung line cannot swallow it.
    """


@contextmanager
def run_deadline(seconds: float | None, *, command: str = "run",
                 stopped: str = "before any rank started") -> Iterator[None]:
    """Within the block, `bounded` calls stop ``seconds`` from now (None: never); the refusal
    names the ``command``'s timeout and says it was stopped ``stopped``."""
    if seconds is None:
        yield
        return
    _DEADLINES.append(_Deadline(time.monotonic() + seconds, seconds, command, stopped))
    try:
        yield
    finally:
        _DEADLINES.pop()


def bounded(what: str, call: Callable[[], _T]) -> _T:
    """``call()``, stopped at the run's deadline with RunFailed naming ``what`` and the line."""
    if not _DEADLINES or not _can_alarm():
        return call()
    deadline = _DEADLINES[-1]
    remaining = max(deadline.end - time.monotonic(), _SOONEST_S)
    outer, _ = signal.getitimer(signal.ITIMER_REAL)
    # Someone else's timer (pytest-timeout's) that fires first is theirs to handle; an outer
    # bounded call's (ours) is taken over, so that the refusal names the innermost call.
    if outer and outer <= remaining and signal.getsignal(signal.SIGALRM) is not _expire:
        return call()
    remaining = min(remaining, outer) if outer else remaining
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
        stopped = f" {deadline.stopped}" if deadline.stopped else ""
        raise RunFailed(f"{what} did not return within the {deadline.command}'s timeout of "
                        f"{deadline.seconds:g} s (it was still running{users_location(err)}); "
                        f"the {deadline.command} was stopped{stopped} and nothing was "
                        "written.") from None
    finally:
        signal.signal(signal.SIGALRM, previous)
        if outer:  # give the outer timer back what it had left
            left = outer - (time.monotonic() - started)
            signal.setitimer(signal.ITIMER_REAL, max(left, _SOONEST_S))


def users_call(what: str, call: Callable[[], _T], *, who: str | None = None) -> _T:
    """``call()`` of the user's code, under the deadline (`bounded`, naming ``what``); whatever
    escapes it but an interrupt is ConfigError: "WHO raised TYPE: MESSAGE at FILE:LINE." (or
    "WHO called sys.exit(CODE) at FILE:LINE"; ``who`` defaults to ``what``), so that a command
    refuses it as bad input rather than ending with it, or with its exit status."""
    who = what if who is None else who
    try:
        return bounded(what, call)
    except RunFailed:
        raise  # the deadline passed inside it: said by bounded
    except SystemExit as err:  # sys.exit() inside the user's code is not the command's exit
        raise ConfigError(f"{who} called sys.exit({err.code!r}){users_location(err)}; it must "
                          "return (or raise) instead.") from None
    except Exception as err:
        raise ConfigError(f"{who} raised {type(err).__name__}: {err}"
                          f"{users_location(err)}.") from None


def users_factory(spec: str, label: str, returns: str) -> Callable[[], Any]:
    """The callable a ``module:attr`` spec names, its module imported under the deadline;
    ConfigError (one sentence, ``label`` first) when it cannot be found or is not callable, or
    when importing the module fails inside it (its file and line)."""
    module_name, _, attr = spec.partition(":")
    try:
        target: Any = bounded(f"{label}: importing {module_name!r}",
                              lambda: importlib.import_module(module_name))
    except RunFailed:
        raise
    except SystemExit as err:  # sys.exit() at the module's top level
        raise ConfigError(f"{label}: importing {module_name!r} called sys.exit({err.code!r})"
                          f"{users_location(err)}; a module must not exit.") from None
    except ImportError as err:
        if err.name != module_name.split(".")[0] and users_location(err):  # raised inside it
            raise ConfigError(f"{label}: importing {module_name!r} raised "
                              f"{type(err).__name__}: {err}{users_location(err)}.") from None
        raise ConfigError(f"{label}: cannot import module {module_name!r} ({err}); install it "
                          "or put its folder on PYTHONPATH.") from None
    except Exception as err:  # the user's module failed while it ran: show where
        raise ConfigError(f"{label}: importing {module_name!r} raised "
                          f"{type(err).__name__}: {err}{users_location(err)}.") from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{label}: cannot find {attr!r}: module {module_name!r} has no "
                              f"attribute {attr!r}; give module:function of a function that "
                              f"returns {returns}.")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{label} is a {type(target).__name__}, not a factory: it must be "
                          f"callable with no arguments and return {returns}.")
    return target


def _expire(signum: int, frame: object) -> None:
    raise DeadlinePassed


def _can_alarm() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
