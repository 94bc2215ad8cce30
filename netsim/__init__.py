"""netsim: links, topologies, collective costs, process-group shaping, traces, SimPy model.

Names are imported from their module on first use (PEP 562), so that the torch-free parts
(``units``, ``topology``, ``costs``, ``trace``, ``model``) are read without torch: `flexbench
report` and `sweep --dry-run` parse units and topologies but never shape a process group.
"""

from __future__ import annotations

import importlib
from typing import Any

# Name -> the module that defines it ("" for a submodule named like the name).
_WHERE = {
    "shaping": "",
    "collective_time": "costs", "collective_volume": "costs",
    "hierarchical_all_reduce_time": "costs", "point_to_point_time": "costs",
    "ring_all_gather_time": "costs", "ring_all_reduce_time": "costs",
    "ring_reduce_scatter_time": "costs",
    "MODEL_NOTE": "model", "SharedLink": "model", "simulate": "model",
    "Link": "topology", "Topology": "topology", "ring_nic_share": "topology",
    "EVAL": "trace", "TRACE_COLUMNS": "trace", "TRAIN": "trace", "TraceRecorder": "trace",
    "comm_per_step": "trace", "load_trace": "trace", "validate_trace": "trace",
    "format_bandwidth": "units", "parse_bandwidth": "units", "parse_latency": "units",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    """Import the module defining ``name`` on first use and keep the name here."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'netsim' has no attribute {name!r}")
    if module:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
    else:
        value = importlib.import_module(f".{name}", __name__)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names and this module's own."""
    return sorted(set(globals()) | set(__all__))
