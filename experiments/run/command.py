"""`flexbench run`: one run from flags, a TOML file and `--set` overrides, then a one-line summary.

    flexbench run --method flexdemo --nodes 2 --gpus-per-node 2 --steps 300 --out runs/flex
    flexbench run --config my.toml --set topk=16 --out runs/flex16

Every run setting is a flag of the same name (`--gpus-per-node`, `--stall-timeout`, ...) and a
`--set` key (`--set gpus_per_node=2`); `flexbench run --help` lists them with their meaning.
"""

from __future__ import annotations

import argparse
import os
import sys
import tomllib
from pathlib import Path
from typing import Any

from experiments.config import (
    ConfigError,
    RunConfig,
    add_run_arguments,
    parse_sets,
    run_arguments,
    run_flag,
)
from experiments.deadline import run_deadline
from experiments.errors import RunFailed
from experiments.io import check_output_folder
from experiments.run.launch import check_timeout, launch
from experiments.run_record import RunRecord
from experiments.sweep.spec import TOP_KEYS
from experiments.values import POSITIVE
from experiments.workloads import builtin_model
from netsim.sites import hierarchy_line

__all__ = ["check_against_model", "configure", "load_config", "main"]


def load_config(path: str | None, flags: dict[str, Any], sets: list[str],
                defaults: dict[str, Any] | None = None) -> RunConfig:
    """Defaults (RunConfig's, then `defaults`) < TOML file (its [run] table or top level) <
    the command line: explicit flags and --set overrides, which may not set one setting to two
    values."""
    data: dict[str, Any] = dict(defaults or {})
    if path:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise ConfigError(f"cannot read config {path!r}: {err}") from None
        data.update(_run_table(path, raw))
    given = {k: v for k, v in flags.items() if v is not None}
    overrides = parse_sets(sets)
    _check_flag_and_set(given, overrides)
    data.update(given)
    data.update(overrides)
    return RunConfig.from_dict(data).validate()


def _check_flag_and_set(flags: dict[str, Any], overrides: dict[str, Any]) -> None:
    """ConfigError for a setting given as a flag and as --set with two values."""
    for key in sorted(set(flags) & set(overrides)):
        if RunConfig.from_dict({key: overrides[key]}).to_dict()[key] != flags[key]:
            raise ConfigError(f"{run_flag(key)} {flags[key]} and --set {key}={overrides[key]} give "
                              f"{key} two values; give it once.")


def check_against_model(cfg: RunConfig) -> None:
    """ConfigError for knobs a built-in workload's model rules out, before any rank starts.

    streaming-diloco's fragments are runs of whole parameters (unless cut by element), so there
    can be no more of them than parameter tensors. A user's workload is built only inside the
    ranks, which refuse such a setting there (exit 1).
    """
    knobs = cfg.knob_values()
    fragments = knobs.get("num_fragments")
    if knobs.get("fragment_cut") == "elements":
        fragments = None  # any count up to the elements, which no model here falls below
    model = builtin_model(cfg.workload) if fragments is not None else None
    if model is None:
        return
    tensors = sum(1 for p in model.parameters() if p.requires_grad)
    if fragments > tensors:
        raise ConfigError(f"num_fragments={fragments} is more than the {tensors} parameter "
                          f"tensors of {cfg.workload}; fragments are runs of whole parameters, "
                          f"so use num_fragments <= {tensors} (or fragment_cut='elements').")


def _check_warmup_read(cfg: RunConfig) -> None:
    """ConfigError for a warm-up given to a run whose constant schedule reads none.

    RunConfig lets it pass, so that a sweep's shared warm-up stays valid for a method whose own
    schedule is constant; a single run given one asked for a warm-up it would not get."""
    default = RunConfig()
    given = [run_flag(name) for name in ("warmup", "warmup_steps")
             if getattr(cfg, name) != getattr(default, name)]
    if given and cfg.schedule == "constant":
        verb, them = ("sets", "it") if len(given) == 1 else ("set", "them")
        raise ConfigError(f"{' and '.join(given)} {verb} the warm-up of the warmup and cosine "
                          "schedules, and this run's schedule is constant; give --schedule "
                          f"warmup or cosine, or leave {them} out.")


def _run_table(path: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The run settings of a TOML file: its [run] table, or its top level when it has none.

    Nothing is read half: keys beside a [run] table, or a sweep file's tables, are refused.
    """
    if "run" not in raw:
        sweep_keys = sorted(k for k in raw if k in TOP_KEYS)
        if sweep_keys:  # RunConfig.from_dict would call them unknown, not say what they are
            raise ConfigError(f"config {path!r} has {', '.join(sweep_keys)}, which belong to a "
                              "sweep file (run it with `flexbench sweep`); a run file holds "
                              "run settings, at its top level or in [run].")
        return raw  # unknown keys are refused by RunConfig.from_dict
    table = raw["run"]
    if not isinstance(table, dict):
        raise ConfigError(f"config {path!r}: 'run' must be a table of run settings "
                          f"([run]), got {table!r}.")
    beside = sorted(k for k in raw if k != "run")
    if beside:
        hint = (" it looks like a sweep file; run it with `flexbench sweep`"
                if "grid" in raw else " put every run setting inside [run]")
        raise ConfigError(f"config {path!r} has {', '.join(beside)} beside its [run] table, "
                          f"which `flexbench run` would not read;{hint}.")
    return table


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of `flexbench run`."""
    parser.add_argument("--out", required=True, help="output folder (must be new or empty)")
    parser.add_argument("--config", help="TOML file with run settings (its [run] table)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any run setting; repeatable")
    parser.add_argument("--timeout", type=POSITIVE.arg, help="seconds before the run is stopped")
    parser.add_argument("--emulate", action="store_true",
                        help="train the nodes' replicas as threads of this process (one rank a "
                             "node, --gpus-per-node 1 by default): the loss per step of a real "
                             "run, no time measured and no trace (docs/replay.md)")
    add_run_arguments(parser)


def _print_site_shaping(cfg: RunConfig) -> None:
    """What shaping on sites assumed (nothing without a site file or without shaping)."""
    if cfg.topology_file is None or cfg.shaping == "off":
        return
    if cfg.shaping == "kernel":
        print(f"shaped on the sites of {cfg.topology_file} (kernel): tbf at each site's uplink, "
              "downlink and inside rate; the collectives are gloo's own (a flat ring over all "
              "nodes, not hierarchical), while a replay of this run assumes hierarchical ones")
        return
    sites = cfg.topology().sites
    print(f"shaped on the sites of {cfg.topology_file} ({cfg.shaping}): {hierarchy_line(sites)}; "
          "other groups and messages on the sites' flat view (the slowest uplink or downlink at "
          "the site ring's one-way latency)")


def _emulated(cfg: RunConfig, args: argparse.Namespace) -> int:
    """`flexbench run --emulate`: the run in one process, then its one-line summary."""
    from experiments.run.emulate import emulate, unused_settings

    unused = [run_flag(name) for name in unused_settings(cfg)]
    if unused and cfg.shaping == "off":  # a shaped one is refused as such by `emulate`
        raise ConfigError(f"--emulate measures no time, models no network and starts no ranks "
                          f"of its own, so {', '.join(unused)} would be recorded without being "
                          "used; leave them out.")

    try:
        out = emulate(cfg, args.out, timeout_s=args.timeout)
    except RunFailed as err:
        print(f"flexbench run: failed: {err}", file=sys.stderr)
        return 1
    summary = RunRecord.load(out).meta
    if summary["status"] == "diverged":
        print(f"wrote {out} (emulated): the run diverged at step {summary['diverged_step']}")
        return 0
    print(f"wrote {out} (emulated, {cfg.nodes} replicas): final val_loss "
          f"{summary['final_val_loss']:.4f}; no time or bytes measured")
    return 0


def main(args: argparse.Namespace) -> int:
    """Run `flexbench run`."""
    check_timeout(args.timeout)
    # Before the user's workload is called: a bad --out costs one sentence, not a factory's run.
    check_output_folder(args.out, what="--out",
                        reads=[p for p in (args.config, args.topology_file) if p is not None])
    try:
        # Validating a "module:factory" workload calls the user's code, which may hang.
        with run_deadline(args.timeout):
            cfg = load_config(args.config, run_arguments(args), args.set,
                              {"gpus_per_node": 1} if args.emulate else None)
        check_against_model(cfg)
        _check_warmup_read(cfg)
        if args.emulate:
            return _emulated(cfg, args)
        out = launch(cfg, args.out, timeout_s=args.timeout)
    except RunFailed as err:
        print(f"flexbench run: failed: {err}", file=sys.stderr)
        return 1
    if os.environ.get("RANK", "0") != "0":
        return 0  # under torchrun only rank 0 writes and reports
    _print_site_shaping(cfg)
    summary = RunRecord.load(out).meta
    if summary["status"] == "diverged":
        print(f"wrote {out}: the run diverged at step {summary['diverged_step']} (the loss "
              f"stopped being finite); run.json records status 'diverged'")
        return 0
    print(
        f"wrote {out}: final val_loss {summary['final_val_loss']:.4f}, "
        f"{summary['train_time_s']:.1f} s, "
        f"{summary['inter_bytes_per_step'] / 1e3:.1f} kB inter-node per step per node"
    )
    return 0
