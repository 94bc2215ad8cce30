"""Model after model in one set of 4 gloo ranks (2 nodes x 2), each on a fresh mesh: FlexDeMo
takes the replicate group and refuses a group that mixes shards, for Hugging Face models and our
own. DTensor's sharding propagation caches specs by value, so a later model's parameters carry
an earlier model's mesh objects wherever their shapes were seen before (some, all or none of
them); the layout check must see one layout there, not several."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from experiments.workloads import TinyGPT
from flexdemo import DeMoReplicator, FlexDeMo, build_mesh, parallelize, shard_group
from tests.dist_utils import run_ranks

pytest.importorskip("transformers", reason="the Hugging Face models need transformers "
                                           "(the dev extra installs it)")

NODES, PER_NODE, VOCAB, SEQ, STEPS = 2, 2, 256, 16, 2
MIXES = "hold other shards of this rank's parameters"
DIFFERENT = "sharded on different meshes or placements"


def _llama(tied: bool) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
        tie_word_embeddings=tied))


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                      n_positions=SEQ))


def _hf_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _next_byte_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])  # (B, T-1, vocab)
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


# In this order: Llama untied meets the tied one's shapes (all its meshes earlier ones), GPT-2
# and TinyGPT some (a mix of earlier and fresh meshes in one model).
MODELS = [
    ("llama tied", lambda: _llama(True), _hf_loss),
    ("llama untied", lambda: _llama(False), _hf_loss),
    ("gpt2", _gpt2, _hf_loss),
    ("tiny-gpt", lambda: TinyGPT(vocab=VOCAB, seq_len=SEQ, dim=64, n_layer=2, n_head=4),
     _next_byte_loss),
]


def _flexdemo(params: list[nn.Parameter], group: dist.ProcessGroup) -> FlexDeMo:
    return FlexDeMo(params, lr=1e-3, replicator=DeMoReplicator(topk=32, chunk=64, decay=0.999),
                    base="sign", replication_group=group)


def _refusal(build) -> str:
    try:
        build()
    except ValueError as err:
        return str(err)
    raise AssertionError("no ValueError")


def _train(name: str, model: nn.Module, opt: torch.optim.Optimizer, loss_fn, rank: int) -> None:
    """STEPS steps on this rank's own tokens: every loss finite, every rank's shards moved."""
    before = [p.to_local().clone() for p in model.parameters()]
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        loss = loss_fn(model, torch.randint(0, VOCAB, (2, SEQ), generator=g))
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert math.isfinite(loss.item()), f"{name}: loss {loss.item()} at step {step}"
    after = [p.to_local() for p in model.parameters()]
    moved = sum(not torch.equal(b, a) for b, a in zip(before, after, strict=True))
    assert moved > 0, f"{name}: no parameter moved in {STEPS} steps"


def _body(rank: int, world: int) -> None:
    torch.manual_seed(0)
    copies = [rank % PER_NODE + n * PER_NODE for n in range(NODES)]
    for name, make, loss_fn in MODELS:
        model, mesh = make(), build_mesh(NODES, PER_NODE)
        parallelize(model, mesh, inter_all_reduce=False)
        params = list(model.parameters())
        for wrong in (dist.group.WORLD, shard_group(mesh)):
            message = _refusal(lambda: _flexdemo(params, wrong))  # noqa: B023 (called at once)
            assert MIXES in message, f"{name}: {message}"
        derived = FlexDeMo(params, replicator="demo").replication_group  # none given
        assert sorted(dist.get_process_group_ranks(derived)) == copies, name
        opt = _flexdemo(params, mesh.get_group("replicate"))
        assert sorted(dist.get_process_group_ranks(opt.replication_group)) == copies, name
        _train(name, model, opt, loss_fn, rank)
        # The same architecture as HSDP with AdamW between FlexDeMo models, as a sweep runs it.
        model, mesh = make(), build_mesh(NODES, PER_NODE)
        parallelize(model, mesh)
        _train(name, model, torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn, rank)

    # Genuinely different layouts in one optimizer are still refused: a model sharded inside the
    # node next to a layer sharded over all 4 ranks.
    model = parallelize(_gpt2(), build_mesh(NODES, PER_NODE), inter_all_reduce=False)
    flat = nn.Linear(8, 8)
    fully_shard(flat, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("shard",)))
    params = [*model.parameters(), *flat.parameters()]
    assert DIFFERENT in _refusal(lambda: FlexDeMo(params, replicator="demo"))


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_models_built_one_after_another_each_take_their_replicate_group():
    run_ranks(_body, NODES * PER_NODE)
