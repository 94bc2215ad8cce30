"""Workloads: a model, its data and its default budget, all offline.

- `lm-tiny`: a byte-level decoder-only transformer (0.87M parameters) trained on the Python
  standard library's own source (it ships with every interpreter), fixed file order, last 10%
  held out for validation.
- `lm-small`: the same model class at GPU size (38M parameters, 256-byte context) on a larger
  slice of the same corpus (the standard library's source tree, 16 MB).
- `vision-tiny`: a small CNN on scikit-learn's bundled 8x8 digits images.
- `my_pkg.my_module:make_workload`: your own. ``make_workload`` is called with no arguments and
  returns an object that follows `Workload` (below); `make_workload(name)` here resolves it and
  says in one sentence what is missing. It is called once where the config is validated and once
  in every rank, so keep it cheap (read local files, load big data lazily in ``batch``); where
  the config is validated the run's --timeout bounds it (`experiments.deadline`).

Every rank draws its own micro-batch for step t from a generator seeded by (seed, step, rank), so a
run is reproducible and the global batch is the concatenation of the ranks' batches.
"""

from __future__ import annotations

import functools
import gzip
import importlib
import importlib.util
import math
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from experiments.deadline import users_call, users_factory
from experiments.errors import ConfigError
from experiments.workload_budgets import BUILTIN_BUDGETS

__all__ = ["Workload", "BuiltinWorkload", "make_workload", "check_workload", "WORKLOAD_NAMES",
           "builtin_model",
           "TinyGPT", "TinyCNN"]

# Bytes of stdlib source used by lm-tiny: enough text for a few hundred steps without repeats.
_LM_CORPUS_BYTES = 2_000_000
# lm-small reads the whole source tree (about 20-30 MB on a full CPython install) up to this cap.
_LM_SMALL_CORPUS_BYTES = 16_000_000
# TinyGPT sizes of the language-model workloads.
_GPT_SIZES = {
    "lm-tiny": {"dim": 128, "n_layer": 4, "n_head": 4},
    "lm-small": {"dim": 512, "n_layer": 12, "n_head": 8},
}


class Workload(Protocol):
    """What a run needs from a workload; built-in or yours, `make_workload` checks these."""

    default_steps: int
    """Optimizer steps when the run does not say."""
    default_batch_size: int
    """Per-rank micro-batch when the run does not say."""
    default_eval_every: int
    """Steps between validation evaluations when the run does not say."""

    def model(self) -> nn.Module:
        """A freshly initialized model (the caller seeds torch first so all ranks agree)."""
        ...

    def batch(self, step: int, rank: int, batch_size: int, seed: int) -> tuple[torch.Tensor, ...]:
        """Training micro-batch of one rank at one step, a function of its arguments only."""
        ...

    def val_batches(self, n: int, batch_size: int) -> list[tuple[torch.Tensor, ...]]:
        """The same n validation batches on every rank and in every run."""
        ...

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Scalar mean loss of the model on one batch (what backward() is called on)."""
        ...


_PROTOCOL_METHODS = ("model", "batch", "val_batches", "loss")
_PROTOCOL_DEFAULTS = ("default_steps", "default_batch_size", "default_eval_every")
_PROTOCOL_TEXT = ("model(), batch(step, rank, batch_size, seed), val_batches(n, batch_size), "
                  "loss(model, batch) and the positive integers default_steps, "
                  "default_batch_size, default_eval_every")


@dataclass
class BuiltinWorkload:
    """The built-in workloads: a model factory, a batch sampler and the defaults."""

    name: str
    default_steps: int
    default_batch_size: int
    default_eval_every: int
    train_data: torch.Tensor
    val_data: torch.Tensor
    seq_len: int = 0
    """Context length of a language model; 0 for the image classifier."""
    n_classes: int = 0
    gpt: dict[str, int] = field(default_factory=dict)
    """TinyGPT sizes (dim, n_layer, n_head) of a language model."""

    def model(self) -> nn.Module:
        """A freshly initialized model (caller seeds torch first so all ranks agree)."""
        if self.seq_len:
            return TinyGPT(vocab=256, seq_len=self.seq_len, **self.gpt)
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
        if self.seq_len:
            starts = torch.randint(0, data.numel() - self.seq_len - 1, (batch_size,), generator=gen)
            window = starts[:, None] + torch.arange(self.seq_len + 1)
            tokens = data[window].long()  # (B, T+1)
            return tokens[:, :-1], tokens[:, 1:]
        idx = torch.randint(0, data.size(0), (batch_size,), generator=gen)
        images, labels = data[idx, :-1], data[idx, -1].long()
        return images.view(-1, 1, 8, 8), labels


def _language_model(name: str, text: torch.Tensor, seq_len: int) -> BuiltinWorkload:
    split = int(0.9 * text.numel())
    steps, batch_size, eval_every = BUILTIN_BUDGETS[name]
    return BuiltinWorkload(
        name, default_steps=steps, default_batch_size=batch_size, default_eval_every=eval_every,
        train_data=text[:split], val_data=text[split:], seq_len=seq_len, gpt=_GPT_SIZES[name],
    )


def _lm_tiny() -> BuiltinWorkload:
    return _language_model("lm-tiny", _stdlib_text(_LM_CORPUS_BYTES), seq_len=64)


def _lm_small() -> BuiltinWorkload:
    text = _stdlib_text(_LM_SMALL_CORPUS_BYTES, recursive=True)
    return _language_model("lm-small", text, seq_len=256)


def _vision_tiny() -> BuiltinWorkload:
    table = _digits_table()
    table[:, :-1] /= 16.0  # pixel values 0..16 -> [0, 1]
    split = 1500  # fixed split: the file's order is fixed
    steps, batch_size, eval_every = BUILTIN_BUDGETS["vision-tiny"]
    return BuiltinWorkload(
        "vision-tiny", default_steps=steps, default_batch_size=batch_size,
        default_eval_every=eval_every,
        train_data=table[:split], val_data=table[split:], n_classes=10,
    )


# The built-ins' models without their data: a replay derives a recorded run's FSDP2 layout from
# them (on the meta device) without reading a corpus.
_BUILTIN_MODELS: dict[str, Callable[[], nn.Module]] = {
    "lm-tiny": lambda: TinyGPT(vocab=256, seq_len=64, **_GPT_SIZES["lm-tiny"]),
    "lm-small": lambda: TinyGPT(vocab=256, seq_len=256, **_GPT_SIZES["lm-small"]),
    "vision-tiny": lambda: TinyCNN(n_classes=10),
}


def builtin_model(name: str) -> nn.Module | None:
    """A built-in workload's model, built without its data (None for other workloads)."""
    factory = _BUILTIN_MODELS.get(name)
    return factory() if factory is not None else None


_BUILTIN: dict[str, Callable[[], BuiltinWorkload]] = {
    "lm-tiny": _lm_tiny, "lm-small": _lm_small, "vision-tiny": _vision_tiny,
}
WORKLOAD_NAMES = tuple(_BUILTIN)


def make_workload(name: str) -> Workload:
    """The workload a name stands for: a built-in one, or what a ``module:factory`` path returns.

    Raises ConfigError, in one sentence naming what is missing, when the name is unknown, the
    module or attribute does not exist, or the object lacks part of the `Workload` protocol.
    """
    factory = _factory(name)
    workload = users_call(f"workload {name!r}: its factory", factory,
                          who=f"workload {name!r}: the factory")
    _check_protocol(name, workload)
    return workload


@functools.lru_cache(maxsize=32)
def check_workload(name: str) -> None:
    """Raise ConfigError unless `make_workload(name)` works; a process checks each name once."""
    if name not in _BUILTIN:  # built-in ones read local files and are tested
        _check_outputs(name, make_workload(name))


def _check_outputs(name: str, workload: Workload) -> None:
    """What the ranks will call returns what they expect: a module, and batches of tensors.

    Calls `model()` and one `batch()` here, once, so a wrong type is one sentence before any
    rank starts rather than an error inside all of them.
    """
    who = f"workload {name!r}: calling it"
    model = users_call(f"workload {name!r}: its model()", workload.model, who=who)
    batch = users_call(f"workload {name!r}: its batch()",
                       lambda: workload.batch(step=0, rank=0, batch_size=2, seed=0), who=who)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"workload {name!r}: model() returned a {type(model).__name__}; it must "
                          "return a torch.nn.Module.")
    if not (isinstance(batch, tuple | list) and batch
            and all(isinstance(x, torch.Tensor) for x in batch)):
        raise ConfigError(f"workload {name!r}: batch() returned a {type(batch).__name__}; it must "
                          "return a tuple of tensors, such as (inputs, targets).")


def _factory(name: str) -> Callable[[], Any]:
    """The zero-argument callable that builds the named workload."""
    if name in _BUILTIN:
        return _BUILTIN[name]
    module_name, sep, attr = name.partition(":")
    if not (sep and module_name and attr):
        raise ConfigError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOAD_NAMES)} "
                          "or give your own as module.path:factory.")
    return users_factory(name, f"workload {name!r}", "a workload")


def _check_protocol(name: str, workload: Any) -> None:
    missing = [f"{m}()" for m in _PROTOCOL_METHODS if not callable(getattr(workload, m, None))]
    for attr in _PROTOCOL_DEFAULTS:
        value = getattr(workload, attr, None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            missing.append(attr)
    if missing:
        raise ConfigError(f"workload {name!r} returned a {type(workload).__name__} without "
                          f"{', '.join(missing)}; a workload has {_PROTOCOL_TEXT}.")


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


def _stdlib_text(limit: int, recursive: bool = False) -> torch.Tensor:
    """Bytes of the standard library's .py files in sorted path order, as uint8.

    Top-level files only by default (lm-tiny); ``recursive`` walks the packages too.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in _stdlib_files(root, recursive):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    blob = b"".join(chunks)[:limit]
    if len(blob) < 100_000:
        raise RuntimeError(f"found only {len(blob)} bytes of Python source under {root}.")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def _stdlib_files(root: Path, recursive: bool) -> list[Path]:
    """The .py files under the stdlib folder, without installed third-party packages."""
    if not recursive:
        return sorted(root.glob("*.py"))
    packages = [d for d in root.iterdir()
                if d.is_dir() and d.name not in ("site-packages", "dist-packages")]
    return sorted([*root.glob("*.py"), *(p for d in packages for p in d.rglob("*.py"))])


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
