"""netsim: links, topologies, collective costs, process-group shaping, traces, SimPy model.

Only ``netsim.shaping`` (the process-group backend) needs torch; it is imported on first use, so
the cost model, units and topologies load without it.
"""

import importlib
from typing import Any

from netsim.costs import (
    collective_time,
    collective_volume,
    hierarchical_all_reduce_time,
    point_to_point_time,
    ring_all_gather_time,
    ring_all_reduce_time,
    ring_reduce_scatter_time,
)
from netsim.model import MODEL_NOTE, Replay, ReplayOptions, SharedLink, simulate
from netsim.topology import Link, Topology, ring_nic_share
from netsim.trace import (
    EVAL,
    TRACE_COLUMNS,
    TRAIN,
    TraceRecorder,
    comm_per_step,
    load_trace,
    validate_trace,
)
from netsim.units import format_bandwidth, parse_bandwidth, parse_latency

__all__ = [
    "shaping",
    "Link",
    "Topology",
    "ring_nic_share",
    "parse_bandwidth",
    "parse_latency",
    "format_bandwidth",
    "collective_time",
    "collective_volume",
    "ring_all_gather_time",
    "ring_reduce_scatter_time",
    "ring_all_reduce_time",
    "hierarchical_all_reduce_time",
    "point_to_point_time",
    "simulate",
    "ReplayOptions",
    "Replay",
    "SharedLink",
    "MODEL_NOTE",
    "TraceRecorder",
    "TRACE_COLUMNS",
    "TRAIN",
    "EVAL",
    "comm_per_step",
    "load_trace",
    "validate_trace",
]


def __getattr__(name: str) -> Any:
    """``netsim.shaping`` on first use (it imports torch)."""
    if name == "shaping":
        return importlib.import_module("netsim.shaping")
    raise AttributeError(f"module 'netsim' has no attribute {name!r}")
