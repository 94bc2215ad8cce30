"""The learning-rate schedule every method follows: the base lr's multiplier at each step.

Torch-free, so that the rule is tested (and checked against closed forms) without torch; the
training loop hands :func:`lr_factor` to ``torch.optim.lr_scheduler.LambdaLR``, which sets each
parameter group's lr before every step, and every optimizer reads its step's lr from there
(FlexDeMo's base step, DiLoCo's inner AdamW step, gossip's and Ada's local one).
"""

from __future__ import annotations

import math

__all__ = ["FLOOR", "lr_factor", "warmup_count"]

FLOOR = 0.1
"""Where cosine ends, as a fraction of the base lr (the run's last steps still learn)."""


def warmup_count(total: int, warmup: float, warmup_steps: int | None) -> int:
    """Steps of linear warm-up: ``warmup_steps`` when given, else ``warmup`` of ``total``.

    At least 1: a warm-up of one step starts at the full lr, i.e. none.
    """
    warm = round(warmup * total) if warmup_steps is None else warmup_steps
    return max(1, warm)


def lr_factor(step: int, total: int, schedule: str, warm: int) -> float:
    """Multiplier of the base lr at 0-based ``step`` of ``total``, with ``warm`` warm-up steps.

    constant: 1. warmup: (step + 1) / warm over the first ``warm`` steps, then 1. cosine: the
    same warm-up, then FLOOR + (1 - FLOOR) (1 + cos(pi p)) / 2 with p = (step - warm) /
    (total - warm), from 1 down to FLOOR at the last step.
    """
    if schedule == "constant":
        return 1.0
    if schedule not in ("warmup", "cosine"):
        raise ValueError(f"schedule={schedule!r} is unknown; use constant, warmup or cosine.")
    if step < warm:
        return (step + 1) / warm
    if schedule == "warmup":
        return 1.0
    progress = (step - warm) / max(1, total - warm)
    return FLOOR + (1.0 - FLOOR) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
