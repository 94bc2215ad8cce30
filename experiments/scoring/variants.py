"""A method and the knobs it sets as one label: the name a variant goes by in every table."""

from __future__ import annotations

from typing import Any

__all__ = ["knob_label", "variant_label"]


def knob_label(knobs: dict[str, Any]) -> str:
    """Knob values as one label, e.g. 'topk=16,chunk=32'."""
    return ",".join(f"{k}={v}" for k, v in knobs.items())

def variant_label(method: str, knobs: dict[str, Any]) -> str:
    """Method plus knob values, e.g. 'flexdemo[topk=16]'."""
    label = knob_label(knobs)
    return f"{method}[{label}]" if label else method
