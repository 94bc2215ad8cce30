"""`parallelize` on models we did not write: a Llama-style model (layers in a ModuleDict, RoPE
buffers, tied embeddings) and a nanoGPT-shaped one, planned on one process and trained on
2 nodes x 2 gloo ranks against an unsharded AdamW reference."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule

from experiments.workloads import TinyCNN, TinyGPT
from flexdemo import build_mesh, parallelize
from flexdemo.hsdp import find_blocks
from tests.dist_utils import run_ranks

NODES, PER_NODE, LR, STEPS = 2, 2, 1e-2, 3
VOCAB, DIM, HEADS, LAYERS, SEQ = 32, 16, 2, 2, 8


def _rope(head_dim: int, seq: int, theta: float = 10000.0) -> torch.Tensor:
    """Complex rotations e^(i t f) of RoPE, as Meta's Llama precomputes them: (seq, head_dim/2)."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def _apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x (B, T, H, D) by the position's angles."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (B, T, H, D/2)
    return torch.view_as_real(pairs * freqs[None, :, None, :]).flatten(3).type_as(x)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    """Causal attention with rotary position embeddings and no biases."""

    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (w(x).view(B, T, HEADS, DIM // HEADS) for w in (self.wq, self.wk, self.wv))
        q, k = _apply_rope(q, freqs), _apply_rope(k, freqs)
        y = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, DIM))


class FeedForward(nn.Module):
    """SwiGLU MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm Llama block."""

    def __init__(self) -> None:
        super().__init__()
        self.attention, self.feed_forward = Attention(), FeedForward()
        self.attention_norm, self.ffn_norm = RMSNorm(DIM), RMSNorm(DIM)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), freqs)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Laid out like torchtitan's Llama: layers in a ModuleDict, a RoPE buffer, tied output."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): TransformerBlock() for i in range(LAYERS)})
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.output.weight = self.tok_embeddings.weight  # tied
        self.register_buffer("freqs_cis", _rope(DIM // HEADS, SEQ), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)  # (B, T, C)
        freqs = self.freqs_cis[: tokens.size(1)]
        for layer in self.layers.values():
            h = layer(h, freqs)
        return self.output(self.norm(h))  # (B, T, vocab)


class NanoGPTShaped(nn.Module):
    """nanoGPT's layout: a ModuleDict of mixed parts holding the block list, a tied head."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, DIM), wpe=nn.Embedding(SEQ, DIM),
            h=nn.ModuleList(nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, DIM))
                            for _ in range(3)),
            ln_f=nn.LayerNorm(DIM),
        ))
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.size(1)))
        for block in self.transformer.h:
            x = x + block(x)
        return self.lm_head(self.transformer.ln_f(x))


class TiedNoBlocks(nn.Module):
    """No container of blocks at all, embedding tied to the output: one group, the root."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.tok(idx))))


def _names(plan: list[tuple[str, nn.Module]]) -> list[str]:
    return [name for name, _ in plan]


@pytest.mark.timeout(30)
def test_blocks_are_found_in_models_of_any_layout() -> None:
    assert _names(find_blocks(Llama())) == ["layers.0", "layers.1"]
    assert _names(find_blocks(NanoGPTShaped())) == ["transformer.h.0", "transformer.h.1",
                                                   "transformer.h.2"]
    assert _names(find_blocks(TiedNoBlocks())) == []
    # Our own workloads keep exactly the groups they had: one per entry of `blocks`.
    gpt = TinyGPT(vocab=256, seq_len=16, dim=32, n_layer=3, n_head=2)
    assert _names(find_blocks(gpt)) == ["blocks.0", "blocks.1", "blocks.2"]
    assert _names(find_blocks(TinyCNN(10))) == ["blocks.0", "blocks.1", "blocks.2"]


@pytest.mark.timeout(30)
def test_blocks_given_by_list_or_predicate() -> None:
    model = Llama()
    layers = list(model.layers.values())
    by_type = find_blocks(model, lambda name, m: isinstance(m, TransformerBlock))
    assert _names(by_type) == ["layers.0", "layers.1"]
    assert _names(find_blocks(model, model.layers)) == ["layers.0", "layers.1"]
    # Nested blocks: the inner one is sharded before the block that holds it.
    nested = find_blocks(model, [layers[0], layers[0].feed_forward, layers[1]])
    assert _names(nested) == ["layers.0.feed_forward", "layers.0", "layers.1"]


@pytest.mark.parametrize(("blocks", "message"), [
    (lambda m: [m.layers], "cannot shard block 'layers': a ModuleDict has no forward"),
    (lambda m: [m.tok_embeddings], "block 'tok_embeddings' on its own: .* tied to 'output.weight'"),
    (lambda m: [nn.Linear(2, 2)], r"blocks\[0\] \(Linear\) is not a submodule of the model"),
    (lambda m: [m], "blocks lists the model itself"),
    (lambda m: "layers", "blocks must be a list of the model's submodules or a predicate"),
])
@pytest.mark.timeout(30)
def test_what_cannot_be_sharded_is_refused_in_one_sentence(blocks, message) -> None:
    model = Llama()
    with pytest.raises(ValueError, match=message):
        # The plan is refused before the mesh is looked at, so no process group is needed.
        parallelize(model, mesh=None, blocks=blocks(model))
    assert not any(isinstance(m, FSDPModule) for m in model.modules())
    with pytest.raises(ValueError, match="has no forward for FSDP2 to hook"):
        find_blocks(nn.ModuleDict({"a": nn.Linear(2, 2)}))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def _train_against_reference(rank: int, world: int, make) -> None:
    """Sharded AdamW steps match single-process AdamW on all ranks' batches concatenated."""
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)  # deepcopy keeps the tie
    mesh = build_mesh(NODES, PER_NODE)
    parallelize(model, mesh, inter_all_reduce=True)
    assert isinstance(model, FSDPModule)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    for step in range(STEPS):
        loss = _loss(model, _batch(step, rank))
        opt.zero_grad()
        loss.backward()
        opt.step()
        batches = [_batch(step, r) for r in range(world)]
        ref_loss = _loss(reference, tuple(torch.cat(parts) for parts in zip(*batches, strict=True)))
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        assert torch.allclose(mean / world, ref_loss.detach(), atol=1e-5), (step, mean, ref_loss)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p.full_tensor(), q, atol=1e-5, rtol=0), name


def _llama_on_ranks(rank: int, world: int) -> None:
    _train_against_reference(rank, world, Llama)
    torch.manual_seed(0)
    model = parallelize(Llama(), build_mesh(NODES, PER_NODE), inter_all_reduce=False)
    assert all(isinstance(layer, FSDPModule) for layer in model.layers.values())
    assert not isinstance(model.tok_embeddings, FSDPModule)
    assert model.output.weight is model.tok_embeddings.weight  # one parameter, in the root group
    with pytest.raises(ValueError, match="already parallelized"):
        parallelize(model, build_mesh(NODES, PER_NODE))
    _train_against_reference(rank, world, NanoGPTShaped)
    _train_against_reference(rank, world, TiedNoBlocks)


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_llama_style_model_trains_like_the_unsharded_reference() -> None:
    run_ranks(_llama_on_ranks, NODES * PER_NODE)
