"""What torch writes for a collective, in netsim's words: op names, element types, field names.

Three writers name collectives in a trace: torch's `record_param_comms` events and (since about
PyTorch 2.1) its NCCL kernels carry the fields "Collective name", "dtype", "In msg nelems",
"Out msg nelems", "Group size" and "Process Group Ranks"; netsim's own groups write the same
fields on "netsim::OP" events; a backend that writes none (gloo) leaves the dispatcher's
`c10d::OP_` host op, whose input shapes and types say the rest.
"""

from __future__ import annotations

import math
import re
from typing import Any

__all__ = ["FIELDS", "NETSIM_PREFIX", "c10d_op", "collective_op", "element_size",
           "elements_of", "is_nccl_kernel", "worker_names"]

FIELDS = ("Collective name", "dtype", "In msg nelems", "Out msg nelems", "Group size",
          "Process Group Ranks")
NETSIM_PREFIX = "netsim::"

# torch's "Collective name" (and the c10d op's name without c10d:: and the trailing _) -> netsim.
_OPS = {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce", "all_reduce": "all_reduce",
    "allgather": "all_gather", "_allgather_base": "all_gather", "all_gather": "all_gather",
    "allgather_into_tensor": "all_gather", "allgather_into_tensor_coalesced": "all_gather",
    "allgather_coalesced": "all_gather", "all_gather_into_tensor": "all_gather",
    "_reduce_scatter_base": "reduce_scatter", "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast": "broadcast", "all_to_all": "all_to_all", "alltoall": "all_to_all",
    "alltoall_base": "all_to_all", "all_to_allv": "all_to_all", "send": "send", "recv": "recv",
    "recv_any_source": "recv", "reduce": "reduce", "gather": "gather", "scatter": "scatter",
    "barrier": "barrier",
}  # fmt: skip
# What gloo's worker thread calls the work of each netsim op ("gloo:all_reduce"): gloo runs
# reduce_scatter_tensor as an all-reduce.
_WORKER = {"all_reduce": ("all_reduce",), "all_gather": ("all_gather",),
           "reduce_scatter": ("reduce_scatter", "all_reduce"), "broadcast": ("broadcast",),
           "all_to_all": ("all_to_all", "alltoall_base"), "send": ("send",), "recv": ("recv",),
           "reduce": ("reduce",), "gather": ("gather",), "scatter": ("scatter",),
           "barrier": ("barrier",)}
# Bytes per element of the c10 ScalarType names ("Float") and the C++ type names shapes carry.
_SIZES = {
    "float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2,
    "bfloat16": 2, "c10::bfloat16": 2, "c10::half": 2, "long": 8, "int64": 8, "long int": 8,
    "int": 4, "int32": 4, "short": 2, "int16": 2, "short int": 2, "char": 1, "int8": 1,
    "signed char": 1, "byte": 1, "uint8": 1, "unsigned char": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "c10::float8_e4m3fn": 1, "c10::float8_e5m2": 1,
}  # fmt: skip
# The dispatcher's op (c10d::allreduce_) and the NCCL backend's own host annotation
# (nccl:all_reduce), which older profilers give the shapes and some collectives no c10d op.
_C10D = re.compile(r"^(?:c10d::|nccl:)(\w+?)_?$")


def collective_op(name: str) -> str | None:
    """netsim's op for torch's "Collective name" (None: not a collective, such as "wait")."""
    return _OPS.get(str(name).strip().lower())


def c10d_op(event_name: str) -> str | None:
    """netsim's op of a host op "c10d::allreduce_" or "nccl:all_reduce" (None: no collective)."""
    found = _C10D.match(event_name)
    return collective_op(found.group(1)) if found else None


def worker_names(op: str) -> tuple[str, ...]:
    """The names gloo's worker thread gives the work of `op` ("gloo:all_reduce", ...)."""
    return tuple(f"gloo:{name}" for name in _WORKER.get(op, (op,)))


def element_size(dtype: str) -> int | None:
    """Bytes per element of a dtype as a trace writes it ("Float", "c10::BFloat16"), or None."""
    return _SIZES.get(str(dtype).strip().lower())


def elements_of(dims: Any) -> int | None:
    """Elements of the first tensor in an "Input Dims" entry ([[8, 4]], or a TensorList's
    [[[8, 4]]]), None where it has no shape (a scalar's [] or a TensorList recorded empty)."""
    if not isinstance(dims, list) or not dims:
        return None
    first = dims[0]
    while isinstance(first, list) and first and isinstance(first[0], list):
        first = first[0]  # a TensorList: its first tensor
    if not isinstance(first, list) or not first:
        return None
    if not all(isinstance(d, int) for d in first):
        return None
    return math.prod(first)


def is_nccl_kernel(name: str) -> bool:
    """Whether a GPU kernel is NCCL's (ncclKernel_*, ncclDevKernel_*)."""
    return name.lower().startswith("nccl")
