"""Workloads: a model, its data and its default budget, all offline and small.

- `lm-tiny`: a byte-level decoder-only transformer trained on the Python standard library's own
  source (it ships with every interpreter), fixed file order, last 10% held out for validation.
- `vision-tiny`: a small CNN on scikit-learn's bundled 8x8 digits images.

Every rank draws its own micro-batch for step t from a generator seeded by (seed, step, rank), so a
run is reproducible and the global batch is the concatenation of the ranks' batches.
"""

from __future__ import annotations

import gzip
import importlib.util
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Workload", "make_workload", "WORKLOAD_NAMES", "TinyGPT", "TinyCNN"]

WORKLOAD_NAMES = ("lm-tiny", "vision-tiny")

# Bytes of stdlib source used by lm-tiny: enough text for a few hundred steps without repeats.
_LM_CORPUS_BYTES = 2_000_000


@dataclass
class Workload:
    """A model factory, a batch sampler and the defaults of one workload."""

    name: str
    default_steps: int
    default_batch_size: int
    default_eval_every: int
    train_data: torch.Tensor
    val_data: torch.Tensor
    seq_len: int = 0
    n_classes: int = 0

    def model(self) -> nn.Module:
        """A freshly initialized model (caller seeds torch first so all ranks agree)."""
        if self.name == "lm-tiny":
            return TinyGPT(vocab=256, seq_len=self.seq_len, dim=128, n_layer=4, n_head=4)
        return TinyCNN(n_classes=self.n_classes)

    def batch(self, step: int, rank: int, batch_size: int, seed: int) -> tuple[torch.Tensor, ...]:
        """Training micro-batch of one rank at one step."""
        gen = torch.Generator().manual_seed(_mix(seed, step, rank))
        return self._sample(self.train_data, batch_size, gen)

    def val_batches(self, n: int, batch_size: int) -> list[tuple[torch.Tensor, ...]]:
        """A fixed validation set: the same batches on every rank and in every run."""
        gen = torch.Generator().manual_seed(1234)
        return [self._sample(self.val_data, batch_size, gen) for _ in range(n)]

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Mean cross-entropy of the model on a batch."""
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def _sample(self, data: torch.Tensor, batch_size: int, gen: torch.Generator):
        if self.name == "lm-tiny":
            starts = torch.randint(0, data.numel() - self.seq_len - 1, (batch_size,), generator=gen)
            window = starts[:, None] + torch.arange(self.seq_len + 1)
            tokens = data[window].long()  # (B, T+1)
            return tokens[:, :-1], tokens[:, 1:]
        idx = torch.randint(0, data.size(0), (batch_size,), generator=gen)
        images, labels = data[idx, :-1], data[idx, -1].long()
        return images.view(-1, 1, 8, 8), labels


def make_workload(name: str) -> Workload:
    """Load the data of a named workload (cheap: local files only)."""
    if name == "lm-tiny":
        text = _stdlib_text(_LM_CORPUS_BYTES)
        split = int(0.9 * text.numel())
        return Workload(
            name, default_steps=300, default_batch_size=16, default_eval_every=25,
            train_data=text[:split], val_data=text[split:], seq_len=64,
        )
    if name == "vision-tiny":
        table = _digits_table()
        table[:, :-1] /= 16.0  # pixel values 0..16 -> [0, 1]
        split = 1500  # fixed split: the file's order is fixed
        return Workload(
            name, default_steps=200, default_batch_size=32, default_eval_every=20,
            train_data=table[:split], val_data=table[split:], n_classes=10,
        )
    raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOAD_NAMES)}.")


def _digits_table() -> torch.Tensor:
    """scikit-learn's bundled digits as a (1797, 65) table: 64 pixels, then the label.

    Read straight from the file scikit-learn ships: importing sklearn costs each rank seconds.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("vision-tiny reads scikit-learn's bundled digits: install scikit-learn.")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, "rt") as f:
        rows = [[float(v) for v in line.split(",")] for line in f if line.strip()]
    return torch.tensor(rows, dtype=torch.float32)


def _stdlib_text(limit: int) -> torch.Tensor:
    """Bytes of the standard library's top-level .py files in sorted order, as uint8."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    blob = b"".join(chunks)[:limit]
    if len(blob) < 100_000:
        raise RuntimeError(f"found only {len(blob)} bytes of Python source under {root}.")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def _mix(*values: int) -> int:
    """A 63-bit seed from a few integers (stable across runs and platforms)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v + 0x9E3779B97F4A7C15 + (h << 6) + (h >> 2))) & 0x7FFFFFFFFFFFFFFF
    return h


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then an MLP."""

    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)  # each (B, T, C)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """A nanoGPT-shaped byte-level language model."""

    def __init__(self, vocab: int, seq_len: int, dim: int, n_layer: int, n_head: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                # GPT-2's scaled init of the projections that write into the residual stream
                residual = name.endswith(("proj.weight", "out.weight"))
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer) if residual else 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, vocab)


class TinyCNN(nn.Module):
    """Two conv layers and a linear classifier for 8x8 digits."""

    def __init__(self, n_classes: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([
            nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.GELU()),            # (B, 32, 8, 8)
            nn.Sequential(nn.Conv2d(32, 64, 3, padding=1), nn.GELU(), nn.MaxPool2d(2)),  # 4x4
            nn.Sequential(nn.Flatten(), nn.Linear(64 * 16, 128), nn.GELU()),
        ])
        self.head = nn.Linear(128, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)
