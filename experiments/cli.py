"""The `flexbench` command: one subcommand per module, each with `configure()` and `main()`.

    flexbench run --method flexdemo --nodes 2 --gpus-per-node 2 --workload lm-tiny --out runs/x
    flexbench simulate runs/x --inter-bw 1Gbit --inter-lat 20ms --out sim.csv
    flexbench calibrate --shaping wall --out calibration.json
    flexbench compare results/quick --inter-bw 200Mbit --inter-lat 30ms --out cmp.json
    flexbench validate-sim --calibration calibration.json
    flexbench import-trace outputs/profile_traces/iteration_10 --gpus-per-node 8 --out runs/mine
    flexbench profile-compute --workload lm-small --method flexdemo --out profile.json
    flexbench plan --model llama3-8b --method hsdp-adamw flexdemo --nodes 4 --gpus-per-node 8 \
        --gpu h100 --batch 2 --seq 4096 --inter-bw 1Gbit:400Gbit:12 --inter-lat 5ms --out p.csv
    flexbench sweep experiments/configs/quick.toml
    flexbench report results/quick
    flexbench check-comm
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from typing import NoReturn

from experiments.errors import Stopped
from experiments.logs import configure_logging

# name -> (module, one-line help); a module is imported only when its command runs.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("experiments.run.command", "train one method on nodes x ranks, write its results"),
    "simulate": ("experiments.replay.simulate",
                 "replay a run's communication trace on another network"),
    "compare": ("experiments.replay.compare_cli",
                "rank the methods of recorded runs or a sweep by time to target on one network"),
    "validate-sim": ("experiments.replay.validate", "compare the cost model with shaped real runs"),
    "calibrate": ("experiments.replay.calibrate", "fit the model's goodput and per-message cost"),
    "import-trace": ("experiments.traces.command",
                     "read per-rank torch.profiler traces of a data-parallel job as a run folder"),
    "profile-compute": ("experiments.replay.compute_profile",
                        "time a step's compute phases on this machine's device, for simulate"),
    "plan": ("experiments.plan.command",
             "step time, utilization, bytes and memory of methods on a declared model and "
             "cluster"),
    "sweep": ("experiments.sweep.cli", "methods x networks x seeds: time-to-target-loss"),
    "report": ("experiments.report.figures", "figures and tables from a sweep's results"),
    "check-comm": ("experiments.check_comm", "fail when a method sends more bytes"),
}


# A negative quantity with or without its unit ("-5ms", "-1e3", "-inf"): no flag starts so.
_NEGATIVE = re.compile(r"^-(\.?\d|inf)", re.IGNORECASE)


# The flags a parse has stored, with their values; removed from the namespace it returns.
_GIVEN = "_flags_given"


class _StoreOnce(argparse.Action):
    """argparse's plain store, refusing a flag given twice with two values (argparse keeps
    the last without a word)."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        """Store `values`, unless this flag was given other values before in this parse."""
        given = vars(namespace).setdefault(_GIVEN, {})
        if given.get(self.dest, values) != values:
            raise argparse.ArgumentError(self, f"given twice, {_shown(given[self.dest])} and "
                                               f"{_shown(values)}; give it once.")
        given[self.dest] = values
        setattr(namespace, self.dest, values)


class _SwitchOnce(argparse.BooleanOptionalAction):
    """`--flag`/`--no-flag`, refusing both in one command line (argparse keeps the last)."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        """Store the switch, unless its opposite was given before in this parse."""
        given = vars(namespace).setdefault(_GIVEN, {})
        value = not str(option_string).startswith("--no-")
        if given.get(self.dest, value) != value:
            raise argparse.ArgumentError(self, f"given both ways, {self.option_strings[0]} and "
                                               f"{self.option_strings[1]}; give one.")
        given[self.dest] = value
        super().__call__(parser, namespace, values, option_string)


def _shown(values: object) -> str:
    return " ".join(map(str, values)) if isinstance(values, list) else str(values)


class Parser(argparse.ArgumentParser):
    """argparse with a refusal of one line: the command, the flag, what it takes (exit 2)."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        """argparse's parser, whose plain flags refuse being given twice (`_StoreOnce`)."""
        super().__init__(*args, **kwargs)
        for name in (None, "store"):
            self.register("action", name, _StoreOnce)

    def add_argument(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        """argparse's, a switch (`BooleanOptionalAction`) refusing to be given both ways."""
        if kwargs.get("action") is argparse.BooleanOptionalAction:
            kwargs["action"] = _SwitchOnce
        return super().add_argument(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
        """argparse's, without the record of the flags given."""
        namespace, extras = super().parse_known_args(args, namespace)
        vars(namespace).pop(_GIVEN, None)
        return namespace, extras

    def _parse_optional(self, arg_string: str):  # type: ignore[no-untyped-def]
        """A negative value is a value (`--inter-lat -5ms`), refused by the flag's own check
        rather than taken for an unknown flag (argparse reads only bare numbers so)."""
        if _NEGATIVE.match(arg_string):
            return None
        return super()._parse_optional(arg_string)

    def error(self, message: str) -> NoReturn:
        """Print ``PROG: error: MESSAGE`` alone (the usage is one --help away) and exit 2."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The top-level parser; only the chosen subcommand's module is imported."""
    parser = Parser(prog="flexbench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(module).configure(p)
            p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `flexbench` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # --help (0) or a refused flag (2, said in one line)
        return stop.code if isinstance(stop.code, int) else 2
    configure_logging()
    try:
        status = int(importlib.import_module(args._module).main(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return status
    except ValueError as err:  # ConfigError and netsim's unit errors: one sentence, exit 2
        print(f"flexbench {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of the output left (`| head`): stop, as a pipe's
        # writer does on SIGPIPE; what is still buffered goes nowhere, not to a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Stopped as err:  # SIGTERM: what was running stays to be rerun on resume
        print(f"flexbench {args.command}: {err}", file=sys.stderr)
        return 143


if __name__ == "__main__":
    sys.exit(main())
