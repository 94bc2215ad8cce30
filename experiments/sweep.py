"""Sweeps: methods x knobs x seeds trained once each, then timed on every network point.

    flexbench sweep experiments/configs/quick.toml                 # -> results/quick
    flexbench sweep experiments/configs/quick.toml --set grid.seeds=[0] --out results/q1
    flexbench sweep experiments/configs/paper.toml --executor slurm

Each (method, knobs, seed) trains for real with shaping off; its communication trace is then
replayed through netsim's SimPy model for every (inter_bw, inter_lat) point, and each evaluation's
val_loss is placed on that simulated time axis (for step-synchronous schemes the loss at step t
does not depend on the network, only the time at which step t ends does). `[[validate]]` points
also run for real with wall-clock shaping, and the report shows them next to the simulation.

Output folder layout (everything written atomically; a unit is done once its run.json exists):
    sweep.json            config, its fingerprint, versions, git commit, host, unit states
    units/<unit>/         one launch() result: steps.parquet, trace.parquet, run.json
    failed/<unit>.json    the error of a unit that crashed or timed out
    sim/<unit>/<net>.parquet  cached simulated time axis of one unit at one network point
    runs.parquet          one row per unit x network point x source ("sim" / "measured")
    speedups.parquet      per variant, network point and source: time-to-target and speed-up
                          over hsdp-adamw (median, min, max over seeds)
    steps.parquet         every unit's per-step rows with their keys and time axes
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import json
import math
import re
import shutil
import sys
import time
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm import tqdm

from experiments import metrics
from experiments.config import METHODS, ConfigError, RunConfig, parse_overrides
from experiments.executors import EXECUTORS, Job, execute
from experiments.io import check_output_folder, provenance, write_atomic

__all__ = [
    "NetworkPoint",
    "SweepConfig",
    "Unit",
    "collect",
    "configure",
    "load_config",
    "main",
    "run_sweep",
    "units_of",
]

TOP_KEYS = ("name", "timeout_s", "run", "grid", "target", "validate", "executor")
GRID_KEYS = ("methods", "inter_bw", "inter_lat", "seeds", "knobs")
# Fields a sweep sets per unit; they cannot also be knobs or base settings.
UNIT_FIELDS = ("method", "seed", "inter_bw", "inter_lat", "shaping", "extra")

Simulator = Callable[..., pd.DataFrame]


@dataclass(frozen=True)
class NetworkPoint:
    """One inter-node network setting: human labels and the parsed bytes/s and seconds."""

    inter_bw: str
    inter_lat: str
    inter_bw_bps: float
    inter_lat_s: float

    @property
    def label(self) -> str:
        """Column header for tables, e.g. '100Mbit / 20ms'."""
        return f"{self.inter_bw} / {self.inter_lat}"

    @property
    def slug(self) -> str:
        """File-name-safe form of the label."""
        return _slug(f"{self.inter_bw}_{self.inter_lat}")


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

    @property
    def variant(self) -> str:
        """Method plus its knob values, e.g. 'flexdemo[topk=16]'; the row label of tables."""
        return _variant(self.method, self.knobs)


@dataclass
class SweepConfig:
    """A parsed, validated sweep file (after --set overrides)."""

    name: str
    run: dict[str, Any]
    methods: list[str]
    networks: list[NetworkPoint]
    seeds: list[int]
    knobs: dict[str, dict[str, list[Any]]]
    target: float | None
    validate: list[dict[str, Any]]
    timeout_s: float | None
    executor: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)

    def fingerprint(self) -> str:
        """Hash of everything that decides the runs (not where they run, nor how they are scored).

        The target only scores finished runs, so a folder can be re-scored with another one.
        """
        body = {k: v for k, v in self.raw.items() if k not in ("executor", "timeout_s", "target")}
        text = json.dumps(body, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- config parsing


def load_config(path: Path | str, overrides: Iterable[str] = ()) -> SweepConfig:
    """Read a sweep TOML, apply `--set key=value` overrides, validate; ConfigError on bad input."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"sweep config {str(path)!r} does not exist.")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"sweep config {str(path)!r} is not valid TOML: {err}.") from None
    raw.setdefault("name", path.stem)
    for key, value in parse_overrides(list(overrides)).items():
        _set_dotted(raw, key, _parse_value(value))
    return parse_config(raw)


def parse_config(raw: dict[str, Any]) -> SweepConfig:
    """Validate a sweep dict (as read from TOML) into a SweepConfig."""
    _known("sweep config", raw, TOP_KEYS)
    name = raw.get("name", "sweep")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise ConfigError(f"name must be letters, digits, '.', '_' or '-', got {name!r}.")
    run = _table(raw, "run")
    for key in UNIT_FIELDS:
        if key in run:
            raise ConfigError(f"run.{key} is set per unit by the sweep; put it in [grid] instead.")
    RunConfig.from_dict(run)  # unknown keys and bad types fail here, naming the key
    grid = _table(raw, "grid")
    _known("[grid]", grid, GRID_KEYS)
    methods = _nonempty_list(grid, "methods", str)
    for method in methods:
        if method not in METHODS:
            raise ConfigError(f"unknown method {method!r} in grid.methods; choose from "
                              f"{', '.join(METHODS)}.")
    bws = _nonempty_list(grid, "inter_bw", str)
    lats = _nonempty_list(grid, "inter_lat", str)
    networks = [_network(bw, lat) for bw in bws for lat in lats]
    seeds = _nonempty_list(grid, "seeds", int)
    knobs = _knobs(grid.get("knobs", {}), methods)
    target = _target(raw.get("target"))
    timeout = raw.get("timeout_s")
    if timeout is not None and (not _is_number(timeout) or timeout <= 0):
        raise ConfigError(f"timeout_s must be a positive number of seconds, got {timeout!r}.")
    executor = _table(raw, "executor")
    if executor.get("kind", "local") not in EXECUTORS:
        raise ConfigError(f"unknown executor.kind {executor['kind']!r}; choose one of "
                          f"{', '.join(EXECUTORS)}.")
    validate = raw.get("validate", [])
    if not isinstance(validate, list) or not all(isinstance(v, dict) for v in validate):
        raise ConfigError("validate must be a list of [[validate]] tables.")
    cfg = SweepConfig(
        name=name, run=run, methods=methods, networks=networks, seeds=seeds, knobs=knobs,
        target=target, validate=validate, timeout_s=timeout, executor=executor, raw=raw,
    )
    units = units_of(cfg)  # builds and validates every unit's RunConfig
    if target is None and "hsdp-adamw" not in methods:
        raise ConfigError("without [target] val_loss the target comes from hsdp-adamw; add "
                          "'hsdp-adamw' to grid.methods or set target.val_loss.")
    if not units:
        raise ConfigError("the sweep grid is empty.")
    return cfg


def _parse_value(text: str) -> Any:
    """A --set value as TOML ('[0, 1]', '50', 'true', '"x"'); anything else is a plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {part!r} is not a table.")
        node = child
    node[parts[-1]] = value


def _known(where: str, table: dict[str, Any], allowed: Iterable[str]) -> None:
    allowed = tuple(allowed)
    for key in table:
        if key not in allowed:
            raise ConfigError(f"unknown key {key!r} in {where}; allowed: {', '.join(allowed)}.")


def _table(raw: dict[str, Any], key: str) -> dict[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"[{key}] must be a table, got {value!r}.")
    return value


def _nonempty_list(grid: dict[str, Any], key: str, kind: type) -> list[Any]:
    value = grid.get(key)
    if value is None:
        raise ConfigError(f"grid.{key} is missing; give a non-empty list.")
    if not isinstance(value, list):
        value = [value]  # a single value is a one-point axis
    if not value:
        raise ConfigError(f"grid.{key} is empty; give at least one value.")
    for item in value:
        if not isinstance(item, kind) or isinstance(item, bool):
            raise ConfigError(f"grid.{key} takes {kind.__name__} values, got {item!r}.")
    if len(set(map(str, value))) != len(value):
        raise ConfigError(f"grid.{key} lists a value twice: {value!r}.")
    return list(value)


def _network(bw: str, lat: str) -> NetworkPoint:
    from netsim.units import parse_bandwidth, parse_latency

    try:
        bps = parse_bandwidth(bw)
    except ValueError as err:
        raise ConfigError(f"inter_bw {bw!r} does not parse: {err}") from None
    try:
        lat_s = parse_latency(lat)
    except ValueError as err:
        raise ConfigError(f"inter_lat {lat!r} does not parse: {err}") from None
    return NetworkPoint(bw, lat, float(bps), float(lat_s))


def _knobs(table: Any, methods: list[str]) -> dict[str, dict[str, list[Any]]]:
    if not isinstance(table, dict):
        raise ConfigError(f"grid.knobs must be a table of [grid.knobs.<method>], got {table!r}.")
    fields = {f.name for f in dataclasses.fields(RunConfig)} - set(UNIT_FIELDS)
    out: dict[str, dict[str, list[Any]]] = {}
    for method, knobs in table.items():
        if method not in METHODS:
            raise ConfigError(f"grid.knobs.{method}: unknown method {method!r}; choose from "
                              f"{', '.join(METHODS)}.")
        if method not in methods:
            continue  # knobs of a method dropped from the grid (e.g. by --set) are moot
        if not isinstance(knobs, dict):
            raise ConfigError(f"grid.knobs.{method} must be a table, got {knobs!r}.")
        out[method] = {}
        for name, values in knobs.items():
            if name not in fields:
                raise ConfigError(f"grid.knobs.{method}.{name} is not a run setting; known: "
                                  f"{', '.join(sorted(fields))}.")
            values = values if isinstance(values, list) else [values]
            if not values:
                raise ConfigError(f"grid.knobs.{method}.{name} is empty; give at least one value.")
            out[method][name] = values
    return out


def _target(table: Any) -> float | None:
    if table is None:
        return None
    if not isinstance(table, dict):
        raise ConfigError(f"[target] must be a table with val_loss, got {table!r}.")
    _known("[target]", table, ("val_loss",))
    value = table.get("val_loss")
    if value is None:
        return None
    if not _is_number(value) or not math.isfinite(value):
        raise ConfigError(f"target.val_loss must be a number, got {value!r}.")
    return float(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# --------------------------------------------------------------------------- units


def units_of(cfg: SweepConfig) -> list[Unit]:
    """Every unit of the sweep: training units first, then validation units."""
    units: list[Unit] = []
    by_key: dict[tuple[str, str, int], Unit] = {}
    for method in cfg.methods:
        for knobs in _combinations(cfg.knobs.get(method, {})):
            for seed in cfg.seeds:
                unit = _unit("train", cfg, method, knobs, seed, None)
                units.append(unit)
                by_key[(method, _knob_label(knobs), seed)] = unit
    for i, entry in enumerate(cfg.validate):
        units.append(_validate_unit(cfg, entry, i, by_key))
    ids = [u.id for u in units]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
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
    label = _knob_label(knobs)
    base = f"{method}{'-' + label if label else ''}-s{seed}"
    unit_id = _slug(base if network is None else f"{base}-{network.slug}")
    changes: dict[str, Any] = {**cfg.run, **knobs, "method": method, "seed": seed}
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
    network = _network(str(entry.pop("inter_bw")), str(entry.pop("inter_lat")))
    grid_knobs = cfg.knobs.get(method, {})
    knobs = {name: entry.pop(name, values[0]) for name, values in grid_knobs.items()}
    if entry:
        raise ConfigError(f"{where}: unknown key {sorted(entry)[0]!r}; allowed: method, seed, "
                          f"inter_bw, inter_lat{''.join(', ' + k for k in grid_knobs)}.")
    if (method, _knob_label(knobs), seed) not in trained:
        raise ConfigError(f"{where}: no trained unit for {_variant(method, knobs)} seed {seed}; "
                          "seed and knob values must come from [grid].")
    return _unit("validate", cfg, method, knobs, seed, network)


def _knob_label(knobs: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in knobs.items())


def _variant(method: str, knobs: dict[str, Any]) -> str:
    label = _knob_label(knobs)
    return f"{method}[{label}]" if label else method


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", text)


# --------------------------------------------------------------------------- running


def run_sweep(
    cfg: SweepConfig,
    out: Path,
    *,
    executor: str | None = None,
    launcher: Callable[..., Any] | None = None,
    simulator: Simulator | None = None,
    retry_failed: bool = False,
    resimulate: bool = False,
    progress: bool = True,
) -> pd.DataFrame:
    """Run every unit not yet done, then time them on all network points; returns runs.parquet."""
    out = Path(out)
    units = units_of(cfg)
    _claim(cfg, out)
    if resimulate and (out / "sim").exists():
        # The cached axes are derived data; a changed cost model must recompute them.
        shutil.rmtree(out / "sim")
    kind = executor or cfg.executor.get("kind", "local")
    pending = [u for u in units if _state(out, u) == "pending"
               or (retry_failed and _state(out, u) == "failed")]
    jobs = [Job(u.id, u.config.to_dict(), _unit_dir(out, u), _failure_path(out, u))
            for u in pending]
    params = {k: v for k, v in cfg.executor.items() if k not in ("kind", "folder")}
    folder = Path(cfg.executor.get("folder", out / "submitit"))
    bar = tqdm(total=len(jobs), desc=f"sweep {cfg.name}", unit="run", disable=not progress)
    failures = 0
    try:
        results = execute(jobs, kind=kind, timeout_s=cfg.timeout_s, launcher=launcher,
                          folder=folder, params=params)
        for result in results:
            failures += not result.ok
            bar.update(1)
            bar.set_postfix_str(f"{result.unit_id} {'ok' if result.ok else 'FAILED'}"
                                f"{f', {failures} failed' if failures else ''}")
            if not result.ok:
                tqdm.write(f"unit {result.unit_id} failed: {result.error}", file=sys.stderr)
    finally:
        bar.close()
        _write_sweep_json(cfg, out, units)
    return collect(cfg, out, simulator=simulator, progress=progress)


def _claim(cfg: SweepConfig, out: Path) -> None:
    """Refuse an output folder that holds another sweep; otherwise record this one there."""
    meta = out / "sweep.json"
    if meta.exists():
        try:
            old = json.loads(meta.read_text())
        except json.JSONDecodeError:
            raise ConfigError(f"{meta} is not readable JSON; choose another --out.") from None
        if old.get("fingerprint") != cfg.fingerprint():
            raise ConfigError(
                f"output folder {str(out)!r} holds a different sweep ({old.get('name')!r}, "
                f"fingerprint {old.get('fingerprint')}, this one {cfg.fingerprint()}); "
                "choose another --out."
            )
        return
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"output folder {str(out)!r} is not empty and holds no sweep.json; "
                          "choose an empty or new --out.")
    _write_sweep_json(cfg, out, units_of(cfg))


def _write_sweep_json(cfg: SweepConfig, out: Path, units: list[Unit]) -> None:
    meta = out / "sweep.json"
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if meta.exists():
        created = json.loads(meta.read_text()).get("created", created)
    body = {
        "name": cfg.name,
        "fingerprint": cfg.fingerprint(),
        "config": cfg.raw,
        "created": created,
        "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **{k: v for k, v in provenance().items() if k != "created"},
        "units": {u.id: _state(out, u) for u in units},
    }
    write_atomic(meta, json.dumps(body, indent=2, default=str))


def _unit_dir(out: Path, unit: Unit) -> Path:
    return out / "units" / unit.id


def _failure_path(out: Path, unit: Unit) -> Path:
    return out / "failed" / f"{unit.id}.json"


def _state(out: Path, unit: Unit) -> str:
    if (_unit_dir(out, unit) / "run.json").exists():
        return "done"
    if _failure_path(out, unit).exists():
        return "failed"
    return "pending"


# --------------------------------------------------------------------------- collecting

KEY_COLUMNS = ["unit", "kind", "method", "variant", "knobs", "seed", "network", "inter_bw",
               "inter_lat", "inter_bw_bps", "inter_lat_s", "source", "on_grid"]


def collect(
    cfg: SweepConfig,
    out: Path,
    *,
    simulator: Simulator | None = None,
    progress: bool = True,
) -> pd.DataFrame:
    """Time every finished unit on every network point and write runs.parquet and steps.parquet."""
    out = Path(out)
    units = units_of(cfg)
    simulate = simulator or _default_simulator()
    train = [u for u in units if u.kind == "train"]
    target = cfg.target
    if target is None:
        finals = pd.DataFrame(
            [{"method": u.method, "final_val_loss": _final_val_loss(_unit_dir(out, u))}
             for u in train if u.method == metrics.BASELINE and _state(out, u) == "done"],
            columns=["method", "final_val_loss"],
        )
        try:
            target = metrics.default_target(finals)
        except ValueError as err:
            tqdm.write(f"warning: {err} Every time-to-target is reported as not reached.",
                       file=sys.stderr)
            target = math.nan
    rows: list[dict[str, Any]] = []
    step_frames: list[pd.DataFrame] = []
    work = [(u, net, "sim") for u in train for net in _sim_points(cfg, units, u)]
    work += [(u, u.network, "measured") for u in units if u.kind == "validate"]
    for unit, net, source in tqdm(work, desc="timing", unit="point", disable=not progress):
        on_grid = net in cfg.networks  # validation-only points stay out of the headline table
        row, steps = _time_unit(out, unit, net, source, target, simulate, on_grid)
        rows.append(row)
        if steps is not None:
            step_frames.append(steps)
    runs = pd.DataFrame(rows)
    runs["sweep"] = cfg.name
    write_atomic(out / "runs.parquet", _parquet_bytes(runs))
    all_steps = pd.concat(step_frames, ignore_index=True) if step_frames else pd.DataFrame()
    write_atomic(out / "steps.parquet", _parquet_bytes(all_steps))
    table = metrics.speedups(runs, by=("source", "network", "inter_bw_bps", "inter_lat_s"))
    write_atomic(out / "speedups.parquet", _parquet_bytes(table))
    return runs


def _sim_points(cfg: SweepConfig, units: list[Unit], train: Unit) -> list[NetworkPoint]:
    """The grid's points plus any validation point of the same method, knobs and seed."""
    points = list(cfg.networks)
    for u in units:
        if (u.kind == "validate" and u.variant == train.variant and u.seed == train.seed
                and u.network not in points):
            points.append(u.network)
    return points


def _time_unit(
    out: Path,
    unit: Unit,
    net: NetworkPoint,
    source: str,
    target: float,
    simulate: Simulator,
    on_grid: bool,
) -> tuple[dict[str, Any], pd.DataFrame | None]:
    """One runs.parquet row (and its per-step rows) for a unit at a network point."""
    row: dict[str, Any] = {
        "unit": unit.id, "kind": unit.kind, "method": unit.method, "variant": unit.variant,
        "knobs": json.dumps(unit.knobs, sort_keys=True), "seed": unit.seed,
        "network": net.label, "inter_bw": net.inter_bw, "inter_lat": net.inter_lat,
        "inter_bw_bps": net.inter_bw_bps, "inter_lat_s": net.inter_lat_s, "source": source,
        "on_grid": on_grid,
        "status": _state(out, unit), "error": None, "target_val_loss": target,
        "time_to_target_s": math.inf, "reached": False, "final_val_loss": math.nan,
        "final_time_s": math.nan, "steps": 0, "inter_bytes_per_step": math.nan,
        "inter_bytes_received_per_step": math.nan, "inter_calls_per_step": math.nan,
        "diverged": False,
        "intra_bytes_per_step": math.nan,
    }
    run_dir = _unit_dir(out, unit)
    if row["status"] == "failed":
        row["error"] = json.loads(_failure_path(out, unit).read_text()).get("error")
    if row["status"] != "done":
        return row, None  # kept as "not reached": a failed run is never dropped
    steps = pd.read_parquet(run_dir / "steps.parquet").sort_values("step")
    if source == "sim":
        try:
            axis = _simulated_axis(out, unit, net, simulate)
        except Exception as err:  # a model error at one point must not lose the others
            row.update(status="sim-failed", error=f"{type(err).__name__}: {err}")
            return row, None
        steps = steps.merge(axis[["step", "step_time_s", "time_s"]], on="step", how="left")
    else:
        steps = steps.assign(time_s=steps["wall_time_s"],
                             step_time_s=steps["wall_time_s"].diff().fillna(steps["wall_time_s"]))
    diverged = _run_status(run_dir) == "diverged"
    ttt = metrics.time_to_target(steps["time_s"], steps["val_loss"], target) \
        if not (math.isnan(target) or diverged) else math.inf
    evals = steps.dropna(subset=["val_loss"])
    row.update(
        diverged=diverged,
        time_to_target_s=ttt,
        reached=bool(math.isfinite(ttt)),
        final_val_loss=_final_val_loss(run_dir),
        final_time_s=float(steps["time_s"].iloc[-1]) if len(steps) else math.nan,
        steps=int(steps["step"].max()) if len(steps) else 0,
        evaluations=len(evals),
        inter_bytes_per_step=float(steps["inter_bytes_sent"].mean()),
        inter_bytes_received_per_step=float(steps["inter_bytes_received"].mean()),
        inter_calls_per_step=float(steps["inter_calls"].mean()),
        intra_bytes_per_step=float(steps["intra_bytes"].mean()),
    )
    keys = {k: row[k] for k in KEY_COLUMNS}
    return row, steps.assign(**keys)


def _simulated_axis(out: Path, unit: Unit, net: NetworkPoint, simulate: Simulator) -> pd.DataFrame:
    """The unit's simulated time axis at one network point, cached on disk."""
    cache = out / "sim" / unit.id / f"{net.slug}.parquet"
    if cache.exists():
        return pd.read_parquet(cache)
    axis = simulate(_unit_dir(out, unit), inter_bw_bps=net.inter_bw_bps,
                    inter_lat_s=net.inter_lat_s)
    missing = {"step", "step_time_s", "time_s"} - set(axis.columns)
    if missing:
        raise ValueError(f"the simulator returned no {sorted(missing)} columns")
    write_atomic(cache, _parquet_bytes(axis))
    return axis


def _run_status(run_dir: Path) -> str:
    """run.json's status: done, or diverged (a finished run whose loss stopped being finite)."""
    try:
        return str(json.loads((run_dir / "run.json").read_text()).get("status", "done"))
    except (OSError, ValueError):
        return "done"


def _final_val_loss(run_dir: Path) -> float:
    """run.json's final_val_loss, else the last evaluated val_loss in steps.parquet."""
    try:
        value = json.loads((run_dir / "run.json").read_text()).get("final_val_loss")
        if value is not None and math.isfinite(float(value)):
            return float(value)
    except (OSError, ValueError, TypeError):
        pass
    steps = pd.read_parquet(run_dir / "steps.parquet")
    evals = steps["val_loss"].dropna()
    return float(evals.iloc[-1]) if len(evals) else math.nan


def _default_simulator() -> Simulator:
    from experiments.simulate import simulate_run

    return simulate_run


def _parquet_bytes(frame: pd.DataFrame) -> bytes:
    buf = io.BytesIO()
    frame.to_parquet(buf, index=False)
    return buf.getvalue()


# --------------------------------------------------------------------------- CLI


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of `flexbench sweep`."""
    parser.add_argument("config", type=Path, help="sweep TOML, e.g. experiments/configs/quick.toml")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default results/<name>)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="override a setting, e.g. run.steps=50 or grid.seeds=[0]")
    parser.add_argument("--executor", choices=EXECUTORS, default=None,
                        help="local (default: one unit at a time), slurm, or debug (submitit)")
    parser.add_argument("--retry-failed", action="store_true",
                        help="run units that failed before again")
    parser.add_argument("--resimulate", action="store_true",
                        help="drop the cached simulated time axes (after a cost-model change)")
    parser.add_argument("--dry-run", action="store_true", help="list the units and stop")


def main(args: argparse.Namespace) -> int:
    """Run `flexbench sweep`."""
    cfg = load_config(args.config, args.overrides)
    out = args.out or Path("results") / cfg.name
    check_output_folder(out, what="sweep folder", must_be_empty=False)  # a sweep resumes in it
    units = units_of(cfg)
    if args.dry_run:
        for u in units:
            where = "" if u.network is None else f" @ {u.network.label} (wall)"
            print(f"{u.kind:8s} {u.id}{where}")
        print(f"{len(units)} units, {len(cfg.networks)} network points -> {out}")
        return 0
    runs = run_sweep(cfg, out, executor=args.executor, retry_failed=args.retry_failed,
                     resimulate=args.resimulate)
    print(metrics.summary_markdown(runs))
    failed = sorted(set(runs.loc[runs["status"] != "done", "unit"]))
    if failed:
        print(f"{len(failed)} unit(s) did not finish: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
