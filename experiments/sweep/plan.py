"""A sweep's units and its folder: which runs exist, where each lives, and how far it got.

    units/<unit>/         one launch() result: steps.parquet, trace.parquet, run.json
                          (an emulated unit: steps.parquet and run.json, no trace)
    failed/<unit>.json    the error of a unit that crashed, stalled or timed out

An emulated unit (`[emulate] nodes`) is a training unit at another node count, trained by
`flexbench run --emulate`: its settings are its recorded unit's with `nodes` changed (a knob of
its label, so `gossip[graph=ring,nodes=64]`), and its time axis is that recorded unit's trace
replayed at its node count.

A unit is done once its run.json exists, failed while its failure record exists, else pending.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.config import RunConfig, shared_for
from experiments.deadline import run_deadline
from experiments.errors import ConfigError
from experiments.scoring.variants import knob_label, variant_label
from experiments.sizes import LONG_S, Cost, Count, Term, check_work
from experiments.sweep.spec import (
    SCORE,
    NetworkPoint,
    SweepConfig,
    network_point,
    read_config,
    slug,
)

__all__ = ["Unit", "check_unit_count", "failure_path", "load_config", "unit_count",
           "unit_dir", "unit_state", "units_of"]

@dataclass
class Unit:
    """One launch(): a training run (shaping off) or a wall-shaped validation run."""

    id: str
    kind: str
    method: str
    knobs: dict[str, Any]
    seed: int
    config: RunConfig
    network: NetworkPoint | None = None
    recorded: Unit | None = None
    """An emulated unit's recorded unit, whose trace times it; None for a unit that records."""

    @property
    def emulated(self) -> bool:
        """Whether the unit is trained by the emulator (no time, no trace of its own)."""
        return self.recorded is not None

    @property
    def variant(self) -> str:
        """Method plus its knob values, e.g. 'flexdemo[topk=16]'; the row label of tables."""
        return variant_label(self.method, self.knobs)

    @property
    def cluster(self) -> str:
        """Nodes x ranks per node, e.g. '8x1': the shape a unit is compared within."""
        return f"{self.config.nodes}x{self.config.gpus_per_node}"


def load_config(path: Path | str, overrides: Iterable[str] = ()) -> SweepConfig:
    """Read a sweep TOML with its `--set` overrides and check every unit; ConfigError if bad."""
    cfg = read_config(path, overrides)
    # Building the units calls a user's workload factory: under the sweep's timeout_s.
    with run_deadline(cfg.timeout_s, command="sweep", stopped="before any unit ran"):
        if not units_of(cfg):  # builds and validates every unit's RunConfig
            raise ConfigError("the sweep grid is empty.")
    return cfg


# What listing a unit costs (measured on 2 cores: 10^4 units of quick.toml built and checked in
# 10 s, 2.2 kB each), with scoring each training unit at every network point (spec.SCORE): the
# bound on how many units a grid makes (experiments.sizes).
_UNIT = Cost("to build and check a unit's settings", bytes=2200, seconds=1e-3)


def unit_count(cfg: SweepConfig, *, training: bool = False) -> int:
    """How many units `units_of` makes (`training`: of those that record, each scored on every
    network point), counted from the grid's lists without making any."""
    train = sum((math.prod(len(v) for v in cfg.knobs.get(method, {}).values())
                 + sum(1 for m, _ in cfg.variants if m == method)) * len(cfg.seeds)
                for method in cfg.methods)
    return train if training else train * (1 + len(cfg.emulate_nodes)) + len(cfg.validate)


def check_unit_count(cfg: SweepConfig) -> None:
    """Refuse a grid of more units, or network points to score them at, than can be listed,
    checked and scored here (experiments.sizes)."""
    count = unit_count(cfg)
    units = Count("grid", count, "units", said=f"the grid's {count:,} units (methods x knob "
                  "values x seeds, with [emulate] and [[validate]])")
    training = Count("grid", unit_count(cfg, training=True), "training units")
    points = Count("grid", len(cfg.networks), "network points",
                   said=f"the grid's {len(cfg.networks):,} network points (inter_bw x "
                   "inter_lat)")
    check_work("the sweep's listing and scoring", [Term(_UNIT, (units,)),
                                                    Term(SCORE, (training, points))],
               budget_s=LONG_S, budget="a day, the longest a sweep is let start")


def units_of(cfg: SweepConfig) -> list[Unit]:
    """Every unit of the sweep: training units first, then validation units."""
    check_unit_count(cfg)
    units: list[Unit] = []
    by_key: dict[tuple[str, str, int], Unit] = {}
    for method in cfg.methods:
        variants = [v for m, v in cfg.variants if m == method]
        for knobs in _combinations(cfg.knobs.get(method, {})) + variants:
            for seed in cfg.seeds:
                unit = _unit("train", cfg, method, knobs, seed, None)
                units.append(unit)
                by_key[(method, knob_label(knobs), seed)] = unit
    units += [_emulated_unit(cfg, unit, nodes) for nodes in cfg.emulate_nodes
              for unit in list(by_key.values())]
    for i, entry in enumerate(cfg.validate):
        units.append(_validate_unit(cfg, entry, i, by_key))
    dupes = sorted(i for i, n in Counter(u.id for u in units).items() if n > 1)
    if dupes:
        raise ConfigError(f"two units share the id {dupes[0]!r}; remove the duplicate entry.")
    return units

def _combinations(knobs: dict[str, list[Any]]) -> list[dict[str, Any]]:
    combos: list[dict[str, Any]] = [{}]
    for name, values in knobs.items():
        combos = [{**c, name: v} for c in combos for v in values]
    return combos

def _unit(
    kind: str,
    cfg: SweepConfig,
    method: str,
    knobs: dict[str, Any],
    seed: int,
    network: NetworkPoint | None,
) -> Unit:
    label = knob_label(knobs)
    base = f"{method}{'-' + label if label else ''}-s{seed}"
    unit_id = slug(base if network is None else f"{base}-{network.slug}")
    # [run] knobs apply to the methods that read them; [grid.knobs.<method>] are that method's.
    shared = shared_for(method, cfg.run.to_dict())
    changes: dict[str, Any] = {**shared, **knobs, "method": method, "seed": seed}
    if network is None:
        changes.update(shaping="off", inter_bw=None)
    else:
        changes.update(shaping="wall", inter_bw=network.inter_bw, inter_lat=network.inter_lat)
    changes["extra"] = {"sweep": cfg.name, "unit": unit_id, "kind": kind}
    try:
        run_cfg = RunConfig.from_dict(changes).validate()
    except ConfigError as err:
        raise ConfigError(f"unit {unit_id}: {err}") from None
    return Unit(unit_id, kind, method, knobs, seed, run_cfg, network)

def _emulated_unit(cfg: SweepConfig, recorded: Unit, nodes: int) -> Unit:
    """`recorded` at `nodes` nodes, trained by the emulator and timed by its recorded trace."""
    unit = _unit("train", cfg, recorded.method, {**recorded.knobs, "nodes": nodes}, recorded.seed,
                 None)
    unit.id = slug(f"{unit.id}-emulated")
    unit.config = unit.config.replace(extra={**unit.config.extra, "unit": unit.id,
                                             "emulated": True, "recorded_unit": recorded.id})
    unit.recorded = recorded
    return unit

def _validate_unit(
    cfg: SweepConfig, entry: dict[str, Any], index: int, trained: dict[tuple[str, str, int], Unit]
) -> Unit:
    where = f"validate[{index}]"
    entry = dict(entry)
    for key in ("method", "inter_bw", "inter_lat"):
        if key not in entry:
            raise ConfigError(f"{where} needs {key!r} (and optionally seed and knob values).")
    method = entry.pop("method")
    if method not in cfg.methods:
        raise ConfigError(f"{where}: method {method!r} is not in grid.methods "
                          f"({', '.join(cfg.methods)}); validation compares with its trained run.")
    seed = entry.pop("seed", cfg.seeds[0])
    for key in ("inter_bw", "inter_lat"):
        if not isinstance(entry[key], str):
            # str() would make 100 the string "100", a bandwidth in bytes/s nobody meant.
            raise ConfigError(f"{where}.{key} must be a string with its unit, such as "
                              f"\"100Mbit\" or \"20ms\", got {entry[key]!r}.")
    network = network_point(entry.pop("inter_bw"), entry.pop("inter_lat"))
    grid_knobs = cfg.knobs.get(method, {})
    knobs = {name: entry.pop(name, values[0]) for name, values in grid_knobs.items()}
    if entry:
        raise ConfigError(f"{where}: unknown key {sorted(entry)[0]!r}; allowed: method, seed, "
                          f"inter_bw, inter_lat{''.join(', ' + k for k in grid_knobs)}.")
    if (method, knob_label(knobs), seed) not in trained:
        raise ConfigError(f"{where}: no trained unit for {variant_label(method, knobs)} seed "
                          f"{seed}; seed and knob values must come from [grid].")
    return _unit("validate", cfg, method, knobs, seed, network)

def unit_dir(out: Path, unit: Unit) -> Path:
    """The folder a unit's run is written to."""
    return out / "units" / unit.id

def failure_path(out: Path, unit: Unit) -> Path:
    """The failure record of a unit."""
    return out / "failed" / f"{unit.id}.json"

def unit_state(out: Path, unit: Unit) -> str:
    """done, failed or pending, from what is on disk."""
    if (unit_dir(out, unit) / "run.json").exists():
        return "done"
    if failure_path(out, unit).exists():
        return "failed"
    return "pending"
