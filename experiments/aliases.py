"""Old spellings of renamed flags: hidden, still read, each saying which spelling to use.

    flag = parser.add_argument("--step-compute", type=POSITIVE.arg)
    add_old_spelling(parser, "--step-time", flag)  # `--step-time 0.1` still works, says so

One concept has one name in every command (`--step-compute`, `--method`, `--skip-steps`); an
old spelling stays readable for a while, out of `--help`, and names its successor on stderr.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["add_old_spelling"]


class _OldSpelling(argparse.Action):
    """Store into the new flag's destination, after one line saying which spelling to use."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(f"{parser.prog}: {option_string} is spelled {self.new} now; use that.",
              file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_old_spelling(container: Any, old: str, new: argparse.Action) -> argparse.Action:
    """Add `old` to `container` (a parser or group) as a hidden spelling of flag `new`."""
    return container.add_argument(old, dest=new.dest, type=new.type, nargs=new.nargs,
                                  metavar=new.metavar, action=_OldSpelling,
                                  new=new.option_strings[0], default=argparse.SUPPRESS,
                                  help=argparse.SUPPRESS)
