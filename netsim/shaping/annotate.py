"""netsim's collectives named in a torch.profiler trace with the fields torch's NCCL backend writes.

A netsim group is a Python process group: its collectives bypass the dispatcher's `c10d::` ops,
so a profile of a shaped job would show only the wrapped backend's anonymous work ("gloo:all_reduce"
on a worker thread, with no group). While a profiler runs, the funnel wraps each launch in a host
event "netsim::OP" whose arguments are the ones torch's NCCL backend gives its
`record_param_comms` events ("Collective name", "dtype", "In msg nelems", "Out msg nelems",
"Group size", "Process Group Ranks"), so a reader of profiles (`flexbench import-trace`, Holistic
Trace Analysis) sees which collective ran on which ranks; a rank's wait for a collective is a
"netsim::wait" event (Collective name "wait", as NCCL names its own), so a reader sees when the
rank stopped computing. Nothing is recorded without a profiler.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["EVENT_PREFIX", "COLLECTIVE_NAMES", "DTYPE_NAMES", "profiled", "waiting"]

EVENT_PREFIX = "netsim::"
# netsim's op -> the "Collective name" torch's backends write for it.
COLLECTIVE_NAMES = {
    "all_reduce": "allreduce", "all_gather": "allgather", "reduce_scatter": "reduce_scatter",
    "broadcast": "broadcast", "all_to_all": "all_to_all", "send": "send", "recv": "recv",
    "reduce": "reduce", "gather": "gather", "scatter": "scatter", "barrier": "barrier",
}  # fmt: skip
# torch dtype -> the c10 ScalarType name record_param_comms gives as "dtype".
DTYPE_NAMES = {
    torch.float32: "Float", torch.float64: "Double", torch.float16: "Half",
    torch.bfloat16: "BFloat16", torch.int64: "Long", torch.int32: "Int", torch.int16: "Short",
    torch.int8: "Char", torch.uint8: "Byte", torch.bool: "Bool",
}  # fmt: skip

# Private in torch (torch._C._profiler): a host event with keyword arguments, as inductor's
# kernels are annotated; older torch lacks it, and then nothing is annotated.
_EVENT = getattr(getattr(torch._C, "_profiler", None), "_RecordFunctionFast", None)


def _elements(tensors: Any) -> tuple[int, torch.dtype | None]:
    """Elements of a tensor or (nested) list of tensors, and the first one's dtype."""
    if tensors is None:
        return 0, None
    if isinstance(tensors, torch.Tensor):
        return tensors.numel(), tensors.dtype
    total, dtype = 0, None
    for t in tensors:
        n, d = _elements(t)
        total, dtype = total + n, dtype or d
    return total, dtype


def profiled(op: str, tensors: Any, ranks: list[int]) -> contextlib.AbstractContextManager:
    """The host event of one collective while a profiler runs (else nothing): `tensors` is what
    the funnel counts (the input; a scatter's output), `ranks` the group's global ranks."""
    if _EVENT is None or not torch._C._autograd._profiler_enabled():
        return contextlib.nullcontext()
    return _event(op, tensors, ranks)


@contextlib.contextmanager
def _event(op: str, tensors: Any, ranks: list[int]) -> Iterator[None]:
    elements, dtype = _elements(tensors)
    size = len(ranks)
    out = {"all_gather": elements * size, "reduce_scatter": elements // max(size, 1)}
    args = {
        "Collective name": COLLECTIVE_NAMES.get(op, op),
        "dtype": DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch.")),
        "In msg nelems": elements,
        "Out msg nelems": out.get(op, elements),
        "Group size": size,
        "Process Group Ranks": str(sorted(int(r) for r in ranks)),
    }
    with _EVENT(f"{EVENT_PREFIX}{op}", (), args):
        yield


def waiting() -> contextlib.AbstractContextManager:
    """The host event of a rank waiting for its collective while a profiler runs (else nothing)."""
    if _EVENT is None or not torch._C._autograd._profiler_enabled():
        return contextlib.nullcontext()
    return _EVENT(f"{EVENT_PREFIX}wait", (), {"Collective name": "wait"})
