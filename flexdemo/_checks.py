"""Input checks shared by the optimizer and the replicators: one clear sentence per bad value.

Torch-free at import (the knob schemas use it while a run's settings are checked).
"""

from __future__ import annotations


def check(ok: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``ok``."""
    if not ok:
        raise ValueError(message)


def int_at_least(name: str, value: object, low: int) -> None:
    """``value`` must be an integer (not a bool) of at least ``low``."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    word = "a positive integer" if low == 1 else f"an integer >= {low}"
    check(ok, f"{name}={value!r} must be {word}.")


def in_unit_interval(name: str, value: object, *, closed_low: bool, closed_high: bool) -> None:
    """``value`` must be a number in [0, 1] with the given ends open or closed."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        ok = (value >= 0.0 if closed_low else value > 0.0) and \
             (value <= 1.0 if closed_high else value < 1.0)
    interval = ("[" if closed_low else "(") + "0, 1" + ("]" if closed_high else ")")
    check(ok, f"{name}={value!r} must lie in {interval}.")


def float_dtype(name: str, value: object) -> None:
    """``value`` must be a floating-point ``torch.dtype``."""
    import torch  # here, not at the top: the other checks run without torch

    check(isinstance(value, torch.dtype) and value.is_floating_point,
          f"{name}={value!r} must be a floating-point torch.dtype.")
