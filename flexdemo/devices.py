"""Which backend a run's default group gets, and which device a small tensor needs to cross a group.

Two decisions, made here only, so that a GPU run cannot hand a CPU tensor to a CUDA-only group
("No backend type associated with device type cpu"):

- ``backend_for(requested, cuda_devices, local_ranks)``: the string for
  ``dist.init_process_group``. With CUDA it is ``"cpu:gloo,cuda:nccl"``: the default group, and
  every group later made from it, has a backend per device, so side-channel scalars may stay on
  the CPU while the model's collectives run on NCCL.
- ``side_channel_device(group, preferred)``: the device a side-channel tensor (evaluation loss,
  divergence flag, replica spread, Ada's probe) must be on to cross ``group``: ``preferred``
  (where the tensor already is) when the group has a backend for it, else the CPU when it has
  one, else the group's first device (a group made with plain ``"nccl"``).

``backend_for`` is torch-free; ``side_channel_device`` only reads the group it is given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["BACKENDS", "MIXED", "backend_for", "side_channel_device", "visible_cuda_devices"]

BACKENDS = ("auto", "gloo", "nccl")
"""What a run may ask for; ``auto`` is nccl when every local rank has a GPU, else gloo."""

MIXED = "cpu:gloo,cuda:nccl"
"""The default group's backend with CUDA: gloo for CPU tensors, nccl for CUDA ones."""


def backend_for(requested: str, cuda_devices: int, local_ranks: int) -> str:
    """The ``init_process_group`` backend for ``requested`` with ``cuda_devices`` visible here.

    ``gloo`` stays gloo; ``nccl`` (and ``auto`` when every one of ``local_ranks`` has its own
    GPU) becomes :data:`MIXED`. ValueError for ``nccl`` without a GPU or an unknown request.
    """
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {requested!r}.")
    if requested == "gloo":
        return "gloo"
    if requested == "nccl" and cuda_devices < 1:
        raise ValueError("backend 'nccl' needs a CUDA device and none is visible here; "
                         "use backend auto or gloo.")
    if requested == "nccl" or (cuda_devices >= local_ranks >= 1):
        return MIXED
    return "gloo"


def visible_cuda_devices() -> int:
    """How many CUDA devices this process sees (0 without CUDA); imports torch."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _default_group() -> Any:
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_group()


def side_channel_device(group: Any = None,
                        preferred: torch.device | str | None = None) -> torch.device:
    """The device a small tensor must be on to cross ``group`` (None: the default group)."""
    import torch

    pg = _default_group() if group is None else group
    # A ProcessGroup lists the device types it has a backend for (one per device type given
    # to init_process_group / new_group); netsim's shaped groups register theirs the same way.
    types = {torch.device(d).type: torch.device(d) for d in getattr(pg, "_device_types", [])}
    if preferred is not None and torch.device(preferred).type in types:
        return torch.device(preferred)
    if not types or "cpu" in types:
        # No backend registered yet (torch then lazily makes a CPU one) or a CPU one: the CPU
        # spares a device copy of a few scalars.
        return torch.device("cpu")
    return next(iter(types.values()))
