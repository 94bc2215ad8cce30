"""A flag means the same in every command that has it: one concept, one name, one kind of value.

Every `flexbench` command's parser is built here (nothing is started). A long flag that two
commands both take must take the same kind of value in both (`experiments.values.Kind`, a
quantity, or text), so `--warmup` cannot be a fraction in one command and a count of steps in
another. The old spellings of renamed flags (`experiments.aliases`) are hidden from `--help`
and left out: they exist to say which name to use.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from experiments import cli
from experiments.values import Kind, Quantity


def _kind(action: argparse.Action) -> str:
    """The kind of value a flag takes: its checked kind's words, a switch, or text."""
    if action.nargs == 0:
        return "switch"
    bound = getattr(action.type, "__self__", None)  # Kind.arg, Quantity.arg: the kind itself
    if isinstance(bound, Kind):
        return bound.text
    if isinstance(bound, Quantity):
        return bound.unit
    return "text"


def _flags() -> dict[str, dict[str, str]]:
    """Per long flag, per command that takes it (not as a hidden old spelling): its kind."""
    found: dict[str, dict[str, str]] = defaultdict(dict)
    for command in cli.COMMANDS:
        parser = cli.build_parser([command])
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        for action in sub.choices[command]._actions:
            if action.help == argparse.SUPPRESS:
                continue
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help":
                    found[flag][command] = _kind(action)
    return found


def test_a_flag_takes_one_kind_of_value_in_every_command():
    mixed = {flag: by for flag, by in _flags().items()
             if len({kind for kind in by.values() if kind != "text"}) > 1}
    assert not mixed, "; ".join(f"{flag}: {by}" for flag, by in mixed.items())


def test_a_concept_has_one_name_across_commands():
    flags = _flags()
    assert "--step-time" not in flags and "--methods" not in flags  # old spellings, hidden
    assert {"simulate", "compare", "plan"} <= set(flags["--step-compute"])
    assert {"run", "plan", "validate-sim", "check-comm"} <= set(flags["--method"])


def test_an_old_spelling_is_read_and_names_the_new_one(capsys):
    parser = cli.build_parser(["check-comm"])
    args = parser.parse_args(["check-comm", "--methods", "flexdemo"])
    assert args.method == ["flexdemo"]
    assert "--methods is spelled --method now; use that." in capsys.readouterr().err
