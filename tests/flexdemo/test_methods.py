"""The method records are the one source of a method's facts; each replicator owns its knobs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flexdemo import (
    METHODS,
    RECORDS,
    REPLICATORS,
    DeMoReplicator,
    build_mesh,
    build_optimizer,
    method_record,
    parallelize,
)
from flexdemo.knobs import DeMoKnobs
from netsim import shaping
from netsim.processes import init_process_group

ROOT = Path(__file__).resolve().parents[2]


def _tiny():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Linear(10, 6))


def test_every_record_builds_its_replicator_at_its_defaults():
    assert METHODS == tuple(m.name for m in RECORDS)
    for record in RECORDS:
        if record.replicator is None:  # plain AdamW: only the knob that rewires it
            assert record.takes == ("reduce_format",) and record.inter_all_reduce
            continue
        cls = REPLICATORS[record.replicator]
        assert type(record.knobs) is cls.knobs_type, record.name
        opt = build_optimizer(record.name, _tiny(), None)  # no process group: one replica
        assert opt.replicator.knobs == record.knobs, record.name
        assert opt.param_groups[0]["lr"] == record.lr
        for name in record.knobs.names():  # every knob is an attribute of the replicator
            assert name in cls.knobs_type.aliases or hasattr(opt.replicator, name), name


def test_hsdp_adamw_builds_on_a_one_rank_gloo_group(tmp_path):
    record = method_record("hsdp-adamw")
    with pytest.raises(ValueError, match=r"^method='hsdp-adamw' needs a \(replicate, shard\) "):
        build_optimizer("hsdp-adamw", _tiny(), None)
    init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                       world_size=1)
    try:
        mesh = build_mesh(1, 1)
        model = parallelize(_tiny(), mesh, inter_all_reduce=record.inter_all_reduce)
        assert type(build_optimizer("hsdp-adamw", model, mesh)) is torch.optim.AdamW
    finally:
        shaping.teardown()


def test_flexdemo_and_demo_differ_only_in_their_records():
    flex, demo = method_record("flexdemo"), method_record("demo")
    assert flex.replicator == demo.replicator == "demo"
    assert (flex.knobs.topk, flex.knobs.chunking, flex.knobs.value_format) == (4, "flat",
                                                                             "bf16-packed")
    assert demo.knobs == DeMoKnobs() and (flex.shards, demo.shards) == (True, False)
    rep = build_optimizer("flexdemo", _tiny(), None, topk=8, value_format="int8").replicator
    assert (rep.topk, rep.chunking, rep.format.name) == (8, "flat", "int8")


def test_the_flexdemo_family_shares_its_defaults_and_takes_another_decay():
    for name in ("flexdemo", "flexdemo-async", "flexdemo-adamw"):
        assert method_record(name).resolved({})["decay"] == 0.999
        assert method_record(name).resolved({"decay": 0.9})["decay"] == 0.9
    assert build_optimizer("flexdemo", _tiny(), None, decay=0.9).replicator.decay == 0.9


@pytest.mark.parametrize(("method", "knobs", "words"), [
    ("hsdp-adamw", {"topk": 4}, "method 'hsdp-adamw' does not read topk; it takes "
                                "reduce_format."),
    ("gossip", {"chunk": 4, "decay": 0.5},
     "method 'gossip' does not read chunk, decay; it takes replicate_every, graph, base, "
     "beta1."),
    ("none", {"replicate_every": 2}, "method 'none' does not read replicate_every; it takes "
                                     "base, sign, beta1."),
])
def test_a_knob_the_method_does_not_read_is_refused(method, knobs, words):
    with pytest.raises(ValueError) as err:
        build_optimizer(method, _tiny(), None, **knobs)
    assert str(err.value) == words


def test_one_check_per_knob_for_replicator_and_run_alike():
    # The flat-chunk bound is written once, in DeMoKnobs: the replicator and a method meet it.
    words = "topk=65 is larger than a flat chunk of chunk=64 elements"
    for make in (lambda: DeMoReplicator(topk=65, chunking="flat"),
                 lambda: DeMoKnobs(topk=65, chunking="flat"),
                 lambda: method_record("flexdemo").settings({"topk": 65})):
        with pytest.raises(ValueError, match="^" + words):
            make()
    with pytest.raises(ValueError, match="^DeMoKnobs has no knob 'rate'; it takes "):
        DeMoReplicator(rate=0.5)


def test_value_dtype_is_an_alias_of_the_float_of_the_default_format():
    fp32 = {"value_dtype": "fp32"}
    assert method_record("flexdemo").settings(fp32)[0].value_format == "fp32-packed"
    assert method_record("demo").settings(fp32)[0].value_format == "fp32"
    assert DeMoReplicator(value_dtype=torch.float32).format.name == "fp32"  # the reference's
    assert method_record("demo").settings({**fp32, "value_format": "sign"})[0].value_format \
        == "sign"


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_records_knobs_and_run_config_import_without_torch():
    code = ("import sys; import flexdemo.methods, flexdemo.knobs, experiments.config; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
