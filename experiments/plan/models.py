"""Declared models: a built-in decoder by its sizes, named presets, or the user's own factory.

Every model is built on torch's meta device (shapes, no memory), and its FSDP2 units are the
ones `flexdemo.parallelize` would make: `flexdemo.shard_layout` (which calls
`flexdemo.hsdp.find_blocks`, the plan `parallelize` follows) lists them, blocks inner first,
then the root.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import flexdemo
from experiments.deadline import bounded, users_call, users_factory
from experiments.errors import ConfigError
from experiments.io import read_json
from experiments.workloads import WORKLOAD_NAMES, builtin_model

__all__ = ["GPT_KEYS", "MAX_PARAMS", "PRESETS", "DeclaredModel", "Decoder", "GPTSizes",
           "check_params", "declare_model", "shard_rows", "padded_shard_elements"]


@dataclass(frozen=True)
class GPTSizes:
    """The sizes of a Llama-shaped decoder (RMSNorm, grouped-query attention, SwiGLU MLP)."""

    dim: int
    layers: int
    heads: int
    vocab: int
    ffn: int
    tied: bool = False
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None: as many as heads."""
    bias: bool = False
    """Biases on the query, key and value projections (Qwen2's attention has them)."""
    source: str = ""
    """Where a preset's sizes come from (empty for sizes given on the command line)."""

    @property
    def params(self) -> int:
        """Parameters of the decoder these sizes build (tied embeddings once), exactly."""
        head = self.dim // self.heads
        kv = (self.kv_heads or self.heads) * head
        attention = self.dim * self.heads * head * 2 + self.dim * kv * 2
        bias = (self.heads * head + 2 * kv) if self.bias else 0
        layer = attention + bias + 3 * self.dim * self.ffn + 2 * self.dim  # + two RMSNorms
        return self.layers * layer + self.vocab * self.dim * (1 if self.tied else 2) + self.dim

    def spec(self) -> str:
        """The `gpt:` spec that declares these sizes."""
        kv = "" if self.kv_heads is None else f",kv_heads={self.kv_heads}"
        bias = ",bias=true" if self.bias else ""
        return (f"gpt:dim={self.dim},layers={self.layers},heads={self.heads},vocab={self.vocab},"
                f"ffn={self.ffn},tied={str(self.tied).lower()}{kv}{bias}")


# Sizes from each model's published config.json on the Hugging Face Hub (hidden_size,
# num_hidden_layers, num_attention_heads, num_key_value_heads, vocab_size, intermediate_size,
# tie_word_embeddings; attention_bias / Qwen2's qkv biases).
PRESETS: dict[str, GPTSizes] = {
    # https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json
    "llama3.2-1b": GPTSizes(2048, 16, 32, 128256, 8192, tied=True, kv_heads=8,
                            source="huggingface.co/meta-llama/Llama-3.2-1B config.json"),
    # https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json
    "llama3-8b": GPTSizes(4096, 32, 32, 128256, 14336, kv_heads=8,
                          source="huggingface.co/meta-llama/Meta-Llama-3-8B config.json"),
    # https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json
    "llama3-70b": GPTSizes(8192, 80, 64, 128256, 28672, kv_heads=8,
                           source="huggingface.co/meta-llama/Meta-Llama-3-70B config.json"),
    # https://huggingface.co/meta-llama/Llama-3.1-405B/blob/main/config.json
    "llama3.1-405b": GPTSizes(16384, 126, 128, 128256, 53248, kv_heads=8,
                              source="huggingface.co/meta-llama/Llama-3.1-405B config.json"),
    # https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json
    "mistral-7b": GPTSizes(4096, 32, 32, 32000, 14336, kv_heads=8,
                           source="huggingface.co/mistralai/Mistral-7B-v0.1 config.json"),
    # https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json
    "qwen2.5-7b": GPTSizes(3584, 28, 28, 152064, 18944, kv_heads=4, bias=True,
                           source="huggingface.co/Qwen/Qwen2.5-7B config.json"),
}

GPT_KEYS = ("dim", "layers", "heads", "vocab", "ffn", "tied", "kv_heads", "bias")
# The plan adds up a model's bytes in float64, exact to 2^53; its largest sum is the memory, 16
# bytes a parameter (fp32 master copy, gradient and AdamW's two moments).
BYTES_PER_PARAM = 16
MAX_PARAMS = 2**53 // BYTES_PER_PARAM
_REQUIRED = ("dim", "layers", "heads", "vocab", "ffn")
_FLAGS = ("tied", "bias")
_GPT_EXAMPLE = "gpt:dim=4096,layers=32,heads=32,vocab=128256,ffn=14336,tied=false"


class DecoderBlock(nn.Module):
    """One pre-norm decoder layer: grouped-query causal attention, then a SwiGLU MLP."""

    def __init__(self, sizes: GPTSizes) -> None:
        super().__init__()
        head = sizes.dim // sizes.heads
        self.heads, self.kv_heads = sizes.heads, sizes.kv_heads or sizes.heads
        self.attention_norm = nn.RMSNorm(sizes.dim)
        self.wq = nn.Linear(sizes.dim, sizes.heads * head, bias=sizes.bias)
        self.wk = nn.Linear(sizes.dim, self.kv_heads * head, bias=sizes.bias)
        self.wv = nn.Linear(sizes.dim, self.kv_heads * head, bias=sizes.bias)
        self.wo = nn.Linear(sizes.heads * head, sizes.dim, bias=False)
        self.ffn_norm = nn.RMSNorm(sizes.dim)
        self.w1 = nn.Linear(sizes.dim, sizes.ffn, bias=False)
        self.w2 = nn.Linear(sizes.ffn, sizes.dim, bias=False)
        self.w3 = nn.Linear(sizes.dim, sizes.ffn, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer on (batch, tokens, dim) activations (no rotary embedding: sizes only)."""
        b, t, _ = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(b, t, self.heads, -1).transpose(1, 2)
        k = self.wk(h).view(b, t, self.kv_heads, -1).transpose(1, 2)
        v = self.wv(h).view(b, t, self.kv_heads, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.kv_heads != self.heads)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Decoder(nn.Module):
    """A Llama-shaped decoder-only language model of the given sizes."""

    def __init__(self, sizes: GPTSizes) -> None:
        super().__init__()
        weight = torch.empty(sizes.vocab, sizes.dim)
        if weight.device.type != "meta":
            nn.init.normal_(weight)  # nn.Embedding's own initialization
        # On the meta device (shapes only) the normal_ is skipped: torch's first meta normal_
        # imports its compiler, seconds of a plan's start-up.
        self.tok_embeddings = nn.Embedding(sizes.vocab, sizes.dim, _weight=weight)
        self.layers = nn.ModuleList(DecoderBlock(sizes) for _ in range(sizes.layers))
        self.norm = nn.RMSNorm(sizes.dim)
        self.output = None if sizes.tied else nn.Linear(sizes.dim, sizes.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of (batch, tokens) token ids."""
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        if self.output is None:
            return x @ self.tok_embeddings.weight.T
        return self.output(x)


@dataclass(frozen=True)
class DeclaredModel:
    """A model's FSDP2 units as `flexdemo.parallelize` would wrap it, and where it came from."""

    spec: str
    """The --model value."""
    source: str
    """What the model is, in words (printed with the plan's assumptions)."""
    units: tuple[tuple[tuple[int, ...], ...], ...]
    """Per FSDP2 unit, blocks inner first then the root: its parameters' shapes."""
    shapes: tuple[tuple[int, ...], ...] = ()
    """Every parameter's shape in ``model.parameters()`` order (the optimizer's order)."""
    unit_of: tuple[int, ...] = ()
    """The FSDP2 unit of each of ``shapes`` (an index into ``units``)."""

    @property
    def params(self) -> int:
        """Parameters of the model (tied ones once)."""
        return sum(self.unit_params(u) for u in range(len(self.units)))

    def unit_params(self, unit: int) -> int:
        """Parameters of one FSDP2 unit."""
        return sum(math.prod(s) for s in self.units[unit])

    def describe(self) -> str:
        """One line: the model, its parameter count and its FSDP2 units."""
        return (f"model: {self.source}; {self.params:,} parameters ({self.params / 1e9:.3g}B) in "
                f"{len(self.units)} FSDP2 units ({len(self.units) - 1} blocks, then the root)")


def shard_rows(rows: int, shards: int, index: int) -> int:
    """Rows of dim 0 that FSDP2 gives shard `index` of `shards` (torch.chunk: the last may be
    short or empty)."""
    chunk = math.ceil(rows / shards)
    return max(0, min(rows, (index + 1) * chunk) - index * chunk)


def padded_shard_elements(shape: tuple[int, ...], shards: int) -> int:
    """Elements of one rank's padded FSDP2 shard: ceil(dim0 / shards) rows (what it sends)."""
    shape = tuple(shape) or (1,)
    return math.ceil(shape[0] / shards) * math.prod(shape[1:])


def declare_model(spec: str) -> DeclaredModel:
    """The model `spec` names: a built-in workload, a preset, `gpt:...` sizes or `module:function`.

    ConfigError (one sentence) on an unknown name, bad sizes, a factory that fails or one whose
    parameters are not on the meta device.
    """
    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"--model {spec!r} is empty; {_KNOWN}.")
    if spec in WORKLOAD_NAMES:
        with torch.device("meta"):
            model = builtin_model(spec)
        return _declared(spec, model, f"built-in workload {spec}'s model")
    if spec in PRESETS:
        sizes = PRESETS[spec]
        return _declared(spec, _build_decoder(sizes), f"preset {spec} ({sizes.spec()}, sizes "
                         f"from {sizes.source})")
    if spec.startswith("gpt:"):
        sizes = parse_gpt(spec)
        return _declared(spec, _build_decoder(sizes), f"built-in decoder {sizes.spec()}")
    if spec.endswith(".json"):
        return _declared(spec, _from_hf_config(spec), f"Hugging Face config {spec} built by "
                         "transformers on the meta device")
    if ":" in spec:
        return _declared(spec, _from_factory(spec), f"factory {spec} built on the meta device")
    raise ConfigError(f"--model {spec!r} is unknown; {_KNOWN}.")


_KNOWN = (f"use a preset ({', '.join(PRESETS)}), a built-in workload "
          f"({', '.join(WORKLOAD_NAMES)}), {_GPT_EXAMPLE}, your own module:function or a "
          "Hugging Face config.json")


def parse_gpt(spec: str) -> GPTSizes:
    """The sizes of a `gpt:key=value,...` spec (ConfigError, one sentence, on a bad one)."""
    given: dict[str, int | bool] = {}
    for part in spec.removeprefix("gpt:").split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in GPT_KEYS:
            raise ConfigError(f"--model {spec!r}: {part!r} is not a size; give key=value pairs "
                              f"with keys {', '.join(GPT_KEYS)}, as {_GPT_EXAMPLE}.")
        if key in given:
            raise ConfigError(f"--model {spec!r} gives {key} twice; give each size once.")
        given[key] = _gpt_value(spec, key, value.strip())
    missing = [k for k in _REQUIRED if k not in given]
    if missing:
        raise ConfigError(f"--model {spec!r} lacks {', '.join(missing)}; a gpt model needs "
                          f"{', '.join(_REQUIRED)}, as {_GPT_EXAMPLE}.")
    sizes = GPTSizes(**given)  # type: ignore[arg-type]
    kv = sizes.kv_heads or sizes.heads
    if sizes.dim % sizes.heads or sizes.heads % kv:
        raise ConfigError(f"--model {spec!r}: dim={sizes.dim} must be a multiple of "
                          f"heads={sizes.heads}, and heads a multiple of kv_heads={kv}.")
    check_params(spec, sizes.params)
    return sizes


def check_params(spec: str, params: int) -> None:
    """Refuse a model of more parameters than the planner adds up exactly (`MAX_PARAMS`)."""
    if params > MAX_PARAMS:
        raise ConfigError(f"--model {spec!r} would hold {params:,} parameters ({params:.3g}); "
                          f"the planner builds layouts up to {MAX_PARAMS:,} ({MAX_PARAMS:.3g}): "
                          f"it adds up {BYTES_PER_PARAM} bytes a parameter in float64, exact to "
                          "2^53.")


def _gpt_value(spec: str, key: str, value: str) -> int | bool:
    if key in _FLAGS:
        if value.lower() not in ("true", "false"):
            raise ConfigError(f"--model {spec!r}: {key}={value!r} must be true or false.")
        return value.lower() == "true"
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"--model {spec!r}: {key}={value!r} must be a whole number >= 1.")
    return int(value)


def _build_decoder(sizes: GPTSizes) -> nn.Module:
    with torch.device("meta"):  # shapes only: a 405B model costs no memory
        return Decoder(sizes)


def _from_hf_config(spec: str) -> nn.Module:
    """A Hugging Face config.json's causal language model, built by transformers on meta."""
    read_json(spec, "--model")  # transformers names neither the file nor a key given twice
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"--model {spec!r}: reading a Hugging Face config.json needs the "
                          "optional transformers package, which is not installed; install it "
                          "or give the sizes as gpt:dim=...,layers=....") from None

    def build() -> nn.Module:
        config = transformers.AutoConfig.from_pretrained(spec)
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config)

    try:  # a config of millions of layers is stopped at the plan's --timeout
        return bounded(f"--model {spec!r}: building it with transformers", build)
    except (OSError, ValueError) as err:
        raise ConfigError(f"--model {spec!r} is not a config.json transformers can build: "
                          f"{err}") from None


def _from_factory(spec: str) -> nn.Module:
    """The user's factory called under torch.device("meta") and the plan's --timeout; its
    parameters checked."""
    label = f"--model {spec!r}"
    factory = users_factory(spec, label, "an nn.Module")

    def build() -> nn.Module:
        with torch.device("meta"):  # tensors made without an explicit device land on meta
            return factory()

    model = users_call(f"{label}: its factory", build, who=f"{label}: the factory")
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {spec!r} returned a {type(model).__name__}; the factory must "
                          "return an nn.Module.")
    for name, param in model.named_parameters():
        if not param.is_meta:
            raise ConfigError(f"--model {spec!r}: parameter {name!r} was made on "
                              f"{param.device}, not on the meta device the planner builds under; "
                              "create it without an explicit device= so that "
                              'torch.device("meta") places it.')
    return model


def _declared(spec: str, model: nn.Module, source: str) -> DeclaredModel:
    try:
        layout = flexdemo.shard_layout(model)
    except ValueError as err:
        raise ConfigError(f"--model {spec!r}: {err}") from None
    units = tuple(tuple(tuple(shape) for shape in unit) for unit in layout)
    check_params(spec, sum(math.prod(shape) for unit in units for shape in unit))
    return DeclaredModel(spec, source, units, tuple(tuple(p.shape) for p in model.parameters()),
                         tuple(flexdemo.parameter_units(model)))

