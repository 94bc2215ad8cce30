"""A method from a module of the user's own is the record a built-in method is, checked part by
part, and every refusal is one sentence naming the plug-in's file."""

from __future__ import annotations

import dataclasses
import itertools
import textwrap
from pathlib import Path

import pytest
import torch

from flexdemo import RECORDS, build_optimizer, method_record
from flexdemo.plugins import check_record, is_plugin

# A replicator and its knobs, as a user writes them: the replicas' mean gradient, scaled.
_PLUGIN = '''
from dataclasses import dataclass

from flexdemo import Knobs, Method, Replicator


@dataclass(frozen=True)
class ScaleKnobs(Knobs):
    scale: float = 1.0


class ScaledMean(Replicator):
    name = "scaled-mean"
    knobs_type = ScaleKnobs

    def replicate(self, grads, lrs, stats):
        return [g * self.scale for g in self._all_reduce_mean(grads, stats)]

{body}
'''

_FRESH = itertools.count()
_BODY_LINE = _PLUGIN.split("{body}")[0].count("\n") + 1  # the body's first line in the file


def _plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str,
            head: str = _PLUGIN) -> tuple[str, Path]:
    """``body`` written into a new module of its own name on sys.path: (its spec, its file)."""
    name = f"user_method_{next(_FRESH)}_{tmp_path.name.replace('-', '_')}"
    path = tmp_path / f"{name}.py"
    path.write_text(head.format(body=textwrap.dedent(body)))
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{name}:make", path


def test_every_built_in_record_passes_the_plug_in_checks_with_its_class():
    """The built-in methods are plug-ins too: each record, its replicator given as the class
    itself, is a record a user could return (every knob read, every kind declared)."""
    checked = 0
    for record in RECORDS:
        if record.replicator is None:  # plain AdamW: the one method without a replicator
            continue
        as_plugin = dataclasses.replace(record, replicator=record.replicator_type)
        check_record(as_plugin, record.name)
        checked += 1
    assert checked == len(RECORDS) - 1


def test_a_plug_in_resolves_to_its_record_named_by_its_path(tmp_path, monkeypatch):
    spec, _ = _plugin(tmp_path, monkeypatch, '''
        def make():
            return Method("mine", ScaledMean, ScaleKnobs(scale=0.5), lr=0.01, takes_sign=False)
        ''')
    assert is_plugin(spec) and not is_plugin("flexdemo") and not is_plugin("x:")
    record = method_record(spec)
    assert record.name == spec and record.replicator.__name__ == "ScaledMean"
    assert method_record(spec) is record  # resolved once a process
    assert record.takes == ("scale", "base", "beta1")
    assert record.resolved({}) == {"scale": 0.5, "base": None, "beta1": None}
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = build_optimizer(spec, model, None, scale=2.0)  # no group: one replica
    assert type(opt.replicator).__name__ == "ScaledMean" and opt.replicator.scale == 2.0
    assert opt.param_groups[0]["lr"] == 0.01
    model(torch.ones(2, 4)).sum().backward()
    before = model.weight.detach().clone()
    opt.step()  # sign-SGD on twice the gradient: every entry moves by lr
    assert torch.allclose((before - model.weight.detach()).abs(), torch.full((3, 4), 0.01))
    with pytest.raises(ValueError, match=rf"^method '{spec}' does not read topk; it takes "):
        build_optimizer(spec, model, None, topk=8)


def test_a_plug_in_may_be_a_built_in_replicator_at_defaults_of_its_own(tmp_path, monkeypatch):
    spec, _ = _plugin(tmp_path, monkeypatch, '''
        from flexdemo.knobs import DiLoCoKnobs

        def make():
            return Method("slow-diloco", "diloco", DiLoCoKnobs(outer_lr=0.5, diloco_h=10),
                          takes_sign=False)
        ''')
    opt = build_optimizer(spec, torch.nn.Linear(4, 3), None)
    assert type(opt.replicator).__name__ == "DiLoCoReplicator"
    assert (opt.replicator.outer_lr, opt.replicator.diloco_h) == (0.5, 10)


_REFUSALS = [
    ("raise RuntimeError('no GPU here')\n",
     "importing '{mod}' raised RuntimeError: no GPU here at {file}:"),
    ("def make(:\n", "importing '{mod}' raised SyntaxError: "),
    ("make_method = None\n", "module '{mod}' ({file}) has no attribute 'make'."),
    ("make = 3\n", "method '{spec}' ({file}) is a int, not a factory"),
    ("def make():\n    return {}['replicator']\n",
     "its factory ({file}:{line}) raised KeyError: 'replicator' at {file}:{next}."),
    ("def make():\n    return {'name': 'mine'}\n",
     "its factory ({file}:{line}) returned a dict; it must return a flexdemo.Method"),
    ("def make():\n    return Method('mine', None)\n",
     "({file}:{line}): its record has no replicator; give a Replicator subclass"),
    ("def make():\n    return Method('mine', ScaledMean(), ScaleKnobs())\n",
     "its replicator <", "is not a subclass of flexdemo.Replicator"),
    ("def make():\n    return Method('mine', int, ScaleKnobs())\n",
     "its replicator <class 'int'> is not a subclass of flexdemo.Replicator"),
    ("def make():\n    return Method('mine', 'scaled', ScaleKnobs())\n",
     "replicator='scaled' is no built-in replicator"),
    ("def make():\n    return Method('mine', ScaledMean, Knobs())\n",
     "its knobs are a Knobs, but ScaledMean reads a ScaleKnobs (its knobs_type)"),
    ("def make():\n    return Method('mine', ScaledMean, ScaleKnobs(scale='big'))\n",
     "knob 'scale' of ScaleKnobs is declared float but its value is 'big', a str"),
    ("def make():\n    return Method('mine', ScaledMean, ScaleKnobs(), lr=-1.0)\n",
     "its lr=-1.0 must be a finite number > 0."),
    ("def make():\n    return Method('mine', ScaledMean, ScaleKnobs(), shards='yes')\n",
     "its shards='yes' must be true or false."),
]


@pytest.mark.parametrize(("body", "words"), [(b, w) for b, *w in _REFUSALS])
def test_a_plug_in_that_cannot_be_used_is_one_sentence_naming_its_file(
        body, words, tmp_path, monkeypatch):
    spec, path = _plugin(tmp_path, monkeypatch, body)
    with pytest.raises(ValueError) as err:
        method_record(spec)
    message = str(err.value)
    assert message.startswith(f"method '{spec}'") and "\n" not in message, message
    assert str(path) in message, message
    for word in words:
        word = word.format(mod=spec.split(":")[0], file=path, spec=spec, line=_BODY_LINE,
                           next=_BODY_LINE + 1)
        assert word in message, message


_KNOBS_HEAD = '''
from dataclasses import dataclass

from flexdemo import Knobs, Method, Replicator

{body}

def make():
    return Method("mine", Mine, MineKnobs())
'''


@pytest.mark.parametrize(("body", "words"), [
    ('''
     @dataclass(frozen=True)
     class MineKnobs(Knobs):
         scale: float = 1.0
         spread: float = 0.1

     class Mine(Replicator):
         knobs_type = MineKnobs

         def replicate(self, grads, lrs, stats):
             return [g * self.scale for g in grads]
     ''', "knob 'spread' of MineKnobs is never read by Mine (no .spread in the module of its "
          "class or of a base)"),
    ('''
     @dataclass(frozen=True)
     class MineKnobs(Knobs):
         sizes: list = (1, 2)

     class Mine(Replicator):
         knobs_type = MineKnobs
     ''', "knob 'sizes' of MineKnobs is declared list; declare it int, float, bool, str"),
    ('''
     @dataclass(frozen=True)
     class MineKnobs(Knobs):
         sign: bool = True

     class Mine(Replicator):
         knobs_type = MineKnobs
     ''', "knob 'sign' of MineKnobs is named as FlexDeMo's own step knob sign; rename it."),
])
def test_knobs_of_no_kind_or_never_read_are_refused(body, words, tmp_path, monkeypatch):
    spec, path = _plugin(tmp_path, monkeypatch, body, head=_KNOBS_HEAD)
    with pytest.raises(ValueError) as err:
        method_record(spec)
    assert str(path) in str(err.value) and words in str(err.value), str(err.value)


def test_a_knob_read_only_through_a_property_of_its_knobs_is_read(tmp_path, monkeypatch):
    """DeMo reads arithmetic through DeMoKnobs.arithmetic_used: a replicator reading a knob
    through its knobs' own property reads it."""
    spec, _ = _plugin(tmp_path, monkeypatch, '''
        @dataclass(frozen=True)
        class MineKnobs(Knobs):
            scale: float = 1.0
            boost: bool = False

            @property
            def factor(self) -> float:
                return self.scale * (2.0 if self.boost else 1.0)

        class Mine(Replicator):
            knobs_type = MineKnobs

            def replicate(self, grads, lrs, stats):
                return [g * self.knobs.factor for g in grads]
        ''', head=_KNOBS_HEAD)
    assert method_record(spec).resolved({"boost": True})["boost"] is True


def test_a_missing_module_says_how_to_make_it_importable():
    with pytest.raises(ValueError, match=r"^method 'no_such_pkg\.mod:make': cannot import module "
                                         r"'no_such_pkg\.mod' \(No module named 'no_such_pkg'\); "
                                         r"install it or put its folder on PYTHONPATH\.$"):
        method_record("no_such_pkg.mod:make")
    with pytest.raises(ValueError, match=r"^method='sgd' is unknown; use one of flexdemo, .*, or "
                                         r"your own as module\.path:factory\.$"):
        method_record("sgd")
