"""The built-in workloads' budgets, torch-free: the workloads use them, and a sweep's dry run
estimates a unit whose steps are its workload's own from them."""

from __future__ import annotations

__all__ = ["BUILTIN_BUDGETS"]

# (steps, batch size, evaluate every) of each built-in workload.
BUILTIN_BUDGETS = {"lm-tiny": (300, 16, 25), "lm-small": (2000, 16, 100),
                   "vision-tiny": (200, 32, 20)}
