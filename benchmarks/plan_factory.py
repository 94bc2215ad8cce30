"""A user's model factory for `flexbench plan --model benchmarks.plan_factory:llama70b`.

Plain torch modules at Llama 3 70B's sizes (8192 wide, 80 layers, 64 heads, 8 key-value heads,
a 28672-wide SwiGLU MLP, a 128256-token vocabulary, untied), built with torch's own default
initialization, as a user's code would be: the planner calls it under torch.device("meta").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DIM, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 8192, 80, 64, 8, 28672, 128256


class Block(nn.Module):
    """One decoder layer's parameters: attention with grouped keys and values, a SwiGLU MLP."""

    def __init__(self) -> None:
        super().__init__()
        kv = DIM // HEADS * KV_HEADS
        self.attention_norm = nn.RMSNorm(DIM)
        self.wq, self.wk = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, kv, bias=False)
        self.wv, self.wo = nn.Linear(DIM, kv, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.ffn_norm = nn.RMSNorm(DIM)
        self.w1, self.w3 = nn.Linear(DIM, FFN, bias=False), nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer on (batch, tokens, dim) activations (no rotary embedding)."""
        b, t, _ = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(b, t, HEADS, -1).transpose(1, 2)
        k = self.wk(h).view(b, t, KV_HEADS, -1).transpose(1, 2)
        v = self.wv(h).view(b, t, KV_HEADS, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, DIM))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Model(nn.Module):
    """Embedding, the layers, a final norm and the output head."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of (batch, tokens) token ids."""
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def llama70b() -> nn.Module:
    """The 70B model (70,553,706,496 parameters)."""
    return Model()
