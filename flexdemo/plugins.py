"""Methods from outside the package: ``module.path:factory`` made into a checked :class:`Method`.

A plug-in is a module of the user's own: a :class:`~flexdemo.replicators.Replicator` subclass,
its :class:`~flexdemo.knobs.Knobs` dataclass, and a factory taking no arguments that returns the
method's record, ``Method("ema", EMAReplicator, EMAKnobs(), ...)``: the record every built-in
method is. :func:`flexdemo.methods.method_record` resolves ``"my_pkg.my_module:make_method"``
with these two, once a process (every rank asks again): :func:`call_factory` imports the module
and calls the factory, :func:`check_record` checks what it returned; the record's name becomes
that path, the name a run records. Refused, in one ValueError sentence naming the plug-in's
file (and the line, where its own code raised):

- a module that cannot be imported, an attribute that is missing or not callable, a factory that
  raises or returns anything but a :class:`Method`;
- a record lacking a part: a replicator that is neither a built-in's name nor a Replicator
  subclass (None is plain AdamW, ``hsdp-adamw``'s), knobs that are not an instance of the
  replicator's ``knobs_type``, a learning rate that is no number > 0, wiring that is not
  true or false, a ``step`` that is not a :class:`~flexdemo.knobs.StepKnobs`;
- a knob of no known kind: each field of the knobs is declared int, float, bool or str, each
  optionally ``| None``, and its default is of that kind; or named as a step knob (``base``,
  ``sign``, ``beta1``: FlexDeMo's own);
- a knob the replicator never reads: its name appears nowhere in the modules of the
  replicator's class and its bases (outside the knobs' own classes), as an attribute
  (``self.beta``, ``knobs.beta``) or a string (``getattr(self, "beta")``). A module whose source
  cannot be read is not checked so.

Torch-free at import; checking a record imports the replicators (torch), as the plug-in does.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import math
import os
import textwrap
import traceback
from pathlib import Path
from typing import Any

from .knobs import Knobs, StepKnobs

__all__ = ["KNOB_TYPES", "call_factory", "check_record", "is_of_kind", "is_plugin", "knob_type",
           "replicator_reads"]

# The kinds a knob may be declared as (each optionally "| None").
KNOB_TYPES = ("int", "float", "bool", "str")

_HERE = Path(__file__).resolve().parent
_STDLIB = Path(os.__file__).resolve().parent


def is_plugin(name: object) -> bool:
    """Whether ``name`` has the form of a plug-in: ``module.path:factory``."""
    if not isinstance(name, str):
        return False
    module, sep, attr = name.partition(":")
    return bool(sep and module.strip() and attr.strip())


def call_factory(spec: str) -> tuple[Any, str]:
    """What the factory of plug-in ``spec`` returns, and where the factory is defined
    (FILE:LINE). ValueError, one sentence naming the plug-in's file (and the line of an error
    its own code raised), where it cannot be imported or called."""
    factory, where = _factory(spec)
    try:
        return factory(), where
    except Exception as err:  # the user's factory: show where in their code it failed
        raise ValueError(f"method {spec!r}: its factory ({where}) raised "
                         f"{type(err).__name__}: {err}{_users_line(err)}.") from err


def check_record(record: Any, who: str) -> None:
    """ValueError, one sentence starting with ``who``, on the first part of ``record`` a method
    cannot run with (the module docstring's list)."""
    cls = _replicator(record, who)
    knobs = record.knobs
    if not isinstance(knobs, cls.knobs_type):
        raise ValueError(f"{who}: its knobs are a {type(knobs).__name__}, but {cls.__name__} "
                         f"reads a {cls.knobs_type.__name__} (its knobs_type); give an instance "
                         "of it, or set knobs_type on the replicator.")
    _check_wiring(record, who)
    for f in dataclasses.fields(knobs):
        if f.name in StepKnobs.names():
            raise ValueError(f"{who}: knob {f.name!r} of {type(knobs).__name__} is named as "
                             f"FlexDeMo's own step knob {f.name}; rename it.")
        _check_kind(type(knobs), f.name, getattr(knobs, f.name), who)
    read = replicator_reads(cls, type(knobs))
    unread = [n for n in knobs.names() if read is not None and n not in read]
    if unread:
        raise ValueError(f"{who}: knob {unread[0]!r} of {type(knobs).__name__} is never read by "
                         f"{cls.__name__} (no .{unread[0]} in the module of its class or of a "
                         "base); read it in the replicator or remove it from the knobs.")


def _replicator(record: Any, who: str) -> type:
    """The record's replicator class: its own, or the built-in one it names."""
    from .replicators import REPLICATORS, Replicator

    rep = record.replicator
    if rep is None:
        raise ValueError(f"{who}: its record has no replicator; give a Replicator subclass "
                         "(a method without one is plain AdamW, which hsdp-adamw is).")
    if isinstance(rep, str):
        if rep not in REPLICATORS:
            raise ValueError(f"{who}: replicator={rep!r} is no built-in replicator; give a "
                             f"Replicator subclass or one of {', '.join(REPLICATORS)}.")
        return REPLICATORS[rep]
    if not (isinstance(rep, type) and issubclass(rep, Replicator)):
        raise ValueError(f"{who}: its replicator {rep!r} is not a subclass of "
                         "flexdemo.Replicator; give the class itself (not an instance).")
    return rep


def _check_wiring(record: Any, who: str) -> None:
    """The record's lr, wiring flags and step defaults are of their kinds."""
    lr = record.lr
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (
            math.isfinite(lr) and lr > 0):
        raise ValueError(f"{who}: its lr={lr!r} must be a finite number > 0.")
    for name in ("shards", "inter_all_reduce", "takes_sign", "gossips", "adapts"):
        value = getattr(record, name)
        if not isinstance(value, bool):
            raise ValueError(f"{who}: its {name}={value!r} must be true or false.")
    if not isinstance(record.step, StepKnobs):
        raise ValueError(f"{who}: its step={record.step!r} must be a flexdemo.StepKnobs.")


def knob_type(schema: type[Knobs], name: str) -> tuple[str | None, bool]:
    """The declared kind of knob ``name`` of ``schema`` (one of ``KNOB_TYPES``, None for any
    other annotation) and whether None is allowed."""
    parts = [p.strip() for p in _declared(schema, name).split("|")]
    rest = [p for p in parts if p != "None"]
    kind = rest[0] if len(rest) == 1 and rest[0] in KNOB_TYPES else None
    return kind, "None" in parts


def _declared(schema: type[Knobs], name: str) -> str:
    """Knob ``name``'s annotation as written: "float", "int | None", "list"."""
    declared = next(f.type for f in dataclasses.fields(schema) if f.name == name)
    if isinstance(declared, type):
        return declared.__name__
    return str(declared)


def is_of_kind(value: Any, kind: str) -> bool:
    """Whether ``value`` is a value of the declared knob kind ``kind`` (not None)."""
    if kind == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    allowed = {"int": (int,), "float": (int, float), "str": (str,)}[kind]
    return isinstance(value, allowed)


def _check_kind(schema: type[Knobs], name: str, default: Any, who: str) -> None:
    """Knob ``name`` is declared one of KNOB_TYPES, and its default is of that kind."""
    kind, optional = knob_type(schema, name)
    if kind is None:
        raise ValueError(f"{who}: knob {name!r} of {schema.__name__} is declared "
                         f"{_declared(schema, name)}; declare it {', '.join(KNOB_TYPES)}, each "
                         "optionally '| None'.")
    if default is None and optional or default is not None and is_of_kind(default, kind):
        return
    raise ValueError(f"{who}: knob {name!r} of {schema.__name__} is declared {kind} but "
                     f"its value is {default!r}, a {type(default).__name__}; give it a "
                     f"{kind}.")


@functools.cache
def replicator_reads(cls: type, schema: type[Knobs]) -> frozenset[str] | None:
    """Every name the modules of ``cls`` and its bases use as an attribute or write as a string,
    outside the classes of the knobs ``schema``, and those of the properties and methods of
    ``schema`` they use (DeMo reads ``arithmetic`` through ``arithmetic_used``): the knobs the
    replicator can read. None where a module's source cannot be read."""
    skip = {klass.__name__ for klass in schema.__mro__}
    names: set[str] = set()
    try:
        for module in dict.fromkeys(inspect.getmodule(k) for k in cls.__mro__ if k is not object):
            names |= _names_used(ast.parse(inspect.getsource(module)), skip)  # type: ignore[arg-type]
        helpers = {node.name: node for klass in schema.__mro__ if klass is not object
                   for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(klass))))
                   if isinstance(node, ast.FunctionDef)}
    except (OSError, TypeError, SyntaxError):
        return None
    used = [helpers.pop(n) for n in list(helpers) if n in names]
    while used:  # a helper the replicator uses reads what its body names, helpers included
        names |= _names_used(used.pop(), set())
        used += [helpers.pop(n) for n in list(helpers) if n in names]
    return frozenset(names)


def _names_used(tree: ast.AST, skip: set[str]) -> set[str]:
    """Attribute names and string constants in ``tree``, outside the classes named in ``skip``."""
    found: set[str] = set()
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ClassDef) and node.name in skip:
            continue
        if isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.add(node.value)
        found |= _names_used(node, skip)
    return found


def _factory(spec: str) -> tuple[Any, str]:
    """The plug-in's factory and where it is defined (FILE:LINE, else its module's file)."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        if err.name != module_name.split(".")[0] and _users_line(err):  # raised inside it
            raise ValueError(f"method {spec!r}: importing {module_name!r} raised "
                             f"{type(err).__name__}: {err}{_users_line(err)}.") from err
        raise ValueError(f"method {spec!r}: cannot import module {module_name!r} ({err}); "
                         "install it or put its folder on PYTHONPATH.") from None
    except Exception as err:  # the user's module failed while it ran: show where
        raise ValueError(f"method {spec!r}: importing {module_name!r} raised "
                         f"{type(err).__name__}: {err}{_users_line(err)}.") from err
    file = getattr(module, "__file__", None) or module_name
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"method {spec!r}: module {module_name!r} ({file}) has no "
                             f"attribute {attr!r}.")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"method {spec!r} ({file}) is a {type(target).__name__}, not a "
                         "factory: it must be callable with no arguments and return a "
                         "flexdemo.Method.")
    code = getattr(target, "__code__", None)
    where = f"{code.co_filename}:{code.co_firstlineno}" if code is not None else file
    return target, where


def _users_line(err: BaseException) -> str:
    """" at FILE:LINE" of the innermost place of ``err`` in the plug-in's code (outside this
    package, the standard library and installed packages), or "" (as
    ``experiments.errors.users_location``, for callers of flexdemo alone)."""
    if isinstance(err, SyntaxError) and err.filename and _is_users(err.filename):
        return f" at {err.filename}:{err.lineno}"
    frames = [f for f in traceback.extract_tb(err.__traceback__) if _is_users(f.filename)]
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def _is_users(path: str) -> bool:
    if path.startswith("<"):
        return False
    resolved = Path(path).resolve()
    return not (resolved.is_relative_to(_HERE) or resolved.is_relative_to(_STDLIB)
                or "site-packages" in resolved.parts)
