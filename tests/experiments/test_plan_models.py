"""Declared models for `flexbench plan`: sizes, presets, factories and their FSDP2 units."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import flexdemo
from experiments.errors import ConfigError
from experiments.plan.hardware import GPUS, given_compute, gpu, rule_compute
from experiments.plan.models import (
    PRESETS,
    Decoder,
    declare_model,
    padded_shard_elements,
    parse_gpt,
    shard_rows,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("name", "params"), [
    # The parameter counts the model cards publish, to the parameter.
    ("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496),
    ("llama3.1-405b", 405_853_388_800), ("mistral-7b", 7_241_732_096),
    ("llama3.2-1b", 1_235_814_400), ("qwen2.5-7b", 7_615_616_512),
])
def test_presets_have_their_published_parameter_counts(name, params):
    model = declare_model(name)
    assert model.params == params
    assert len(model.units) == PRESETS[name].layers + 1  # every layer a unit, then the root


def test_lm_tiny_units_are_the_recorded_layout():
    recorded = json.loads((ROOT / "results/quick/units/hsdp-adamw-s0/run.json").read_text())
    model = declare_model("lm-tiny")
    assert [[list(s) for s in unit] for unit in model.units] == recorded["layout"]
    assert model.params == recorded["params"]


def test_gpt_units_are_parallelize_s():
    sizes = parse_gpt("gpt:dim=64,layers=3,heads=4,vocab=100,ffn=128,tied=true,kv_heads=2")
    with torch.device("meta"):
        module = Decoder(sizes)
    declared = declare_model(sizes.spec())
    assert [[list(s) for s in unit] for unit in declared.units] == flexdemo.shard_layout(module)
    names = [name for name, _ in flexdemo.hsdp.find_blocks(module)]
    assert names == ["layers.0", "layers.1", "layers.2"]
    # Tied: the embedding is the output too, counted once, and no output layer.
    assert declared.units[-1] == ((100, 64), (64,))


def test_untied_adds_the_output_layer():
    tied = declare_model("gpt:dim=64,layers=2,heads=4,vocab=100,ffn=128,tied=true")
    untied = declare_model("gpt:dim=64,layers=2,heads=4,vocab=100,ffn=128,tied=false")
    assert untied.params - tied.params == 100 * 64


def test_a_factory_is_built_on_meta():
    model = declare_model("tests.experiments.plan_factories:on_meta")
    assert len(model.units) == 4 and model.params == 3 * (64 * 64 + 64) + 64 * 10 + 10


@pytest.mark.parametrize(("spec", "words"), [
    ("llama9-1t", "is unknown"),
    ("gpt:dim=64,layers=2,heads=4,vocab=100", "lacks ffn"),
    ("gpt:dim=64,layers=2,heads=5,vocab=100,ffn=8", "multiple of heads"),
    ("gpt:dim=64,layers=0,heads=4,vocab=100,ffn=8", "layers='0'"),
    ("gpt:dim=64,layers=2,heads=4,vocab=100,ffn=8,tied=maybe", "true or false"),
    ("gpt:dim=64,depth=2", "is not a size"),
    ("tests.experiments.plan_factories:on_cpu", "not on the meta device"),
    ("tests.experiments.plan_factories:not_a_model", "returned a int"),
    ("tests.experiments.plan_factories:missing", "cannot find"),
])
def test_bad_models_are_one_sentence(spec, words):
    with pytest.raises(ConfigError, match=words) as err:
        declare_model(spec)
    assert str(err.value).count(". ") == 0


def test_a_hugging_face_config_needs_transformers(tmp_path):
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama"}')
    try:
        import transformers  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="needs the optional transformers package"):
            declare_model(str(config))
    else:
        pytest.skip("transformers is installed: the refusal does not apply")


def test_shards_follow_torch_chunk():
    assert [shard_rows(10, 4, j) for j in range(4)] == [3, 3, 3, 1]
    assert [shard_rows(2, 4, j) for j in range(4)] == [1, 1, 0, 0]
    assert padded_shard_elements((10, 3), 4) == 9


def test_compute_by_the_rule():
    device = gpu("H100")
    compute = rule_compute([1_000, 3_000], device, 0.5, 2, 1024)
    expected = 6 * 4_000 * 2 * 1024 / (device.peak_flops * 0.5)
    assert compute.total_s == pytest.approx(expected)
    assert sum(compute.backward_s) == pytest.approx(2 * sum(compute.forward_s))
    assert compute.forward_s[1] == pytest.approx(3 * compute.forward_s[0])
    assert "6 x N x tokens" in compute.rule
    assert given_compute([1, 1], 0.3).total_s == pytest.approx(0.3)


@pytest.mark.parametrize("mfu", [0, -0.1, 1.5])
def test_mfu_outside_zero_one_is_refused(mfu):
    with pytest.raises(ConfigError, match="--mfu"):
        rule_compute([1], GPUS["a100"], mfu, 1, 1)


def test_unknown_gpu_is_refused():
    with pytest.raises(ConfigError, match="h100"):
        gpu("v100")


def test_a_hugging_face_config_is_the_presets_model(tmp_path):
    # Llama-3.2-1B's published config.json (its sizes): transformers builds it on the meta device
    # and the plan groups it as the preset of the same sizes (1,235,814,400 parameters).
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
        "intermediate_size": 8192, "num_attention_heads": 32, "num_hidden_layers": 16,
        "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True,
        "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05}))
    declared, preset = declare_model(str(config)), declare_model("llama3.2-1b")
    assert declared.params == preset.params == 1_235_814_400
    assert sorted(map(sorted, declared.units)) == sorted(map(sorted, preset.units))
    assert "Hugging Face config" in declared.source and "meta device" in declared.source
