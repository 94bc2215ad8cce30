"""Model factories that tests of `flexbench plan --model module:function` import."""

from __future__ import annotations

import torch
from torch import nn


class _Stack(nn.Module):
    """Three same-class blocks and a head: three FSDP2 units, then the root."""

    def __init__(self, device: str | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64, device=device) for _ in range(3))
        self.head = nn.Linear(64, 10, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The blocks, then the head."""
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def on_meta() -> nn.Module:
    """A model whose tensors land wherever the caller's default device says."""
    return _Stack()


def on_cpu() -> nn.Module:
    """A model that asks for real memory by name, past torch.device("meta")."""
    return _Stack(device="cpu")


def not_a_model() -> int:
    """Not an nn.Module."""
    return 3
