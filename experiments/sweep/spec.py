"""The sweep file: a typed, validated SweepConfig from TOML and `--set key=value` overrides.

A sweep file has a `[run]` table (any RunConfig setting, the same names as `flexbench run`'s
flags), a `[grid]` (methods, inter_bw, inter_lat, seeds, per-method `[grid.knobs.METHOD]` and
`[[grid.variants]]`: one method at fixed settings, trained beside its plain runs), an
optional `[target]`, `[[validate]]` points, `[emulate]` node counts (each training unit's
loss curve emulated there, timed by replaying the unit's own trace at that count) and an
`[executor]`. Overrides use dotted keys into
that tree: `--set run.steps=50`, `--set grid.seeds=[0]`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import tempfile
import tomllib
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from experiments.config import KNOBS, RunConfig, is_plugin, method_of, parse_sets
from experiments.errors import ConfigError
from experiments.sizes import LONG_S, Cost, Count, Term, check_work
from experiments.sweep.executors import EXECUTORS
from experiments.values import AT_LEAST_ZERO, COUNT, POSITIVE, POSITIVE_INT, SEED, UNIT_OPEN_LOW
from flexdemo.methods import BASELINE

if TYPE_CHECKING:
    from netsim.topology import Link

__all__ = ["GRID_KEYS", "SCORE", "TOP_KEYS", "UNIT_FIELDS", "NetworkPoint", "SweepConfig",
           "network_point", "parse_config", "read_config", "slug"]

# Scoring a training unit at a network point replays its trace there: about 0.1 s for quick's
# 100 steps on 2 cores (experiments.sizes bounds the grid by it).
SCORE = Cost("to replay a training unit at a network point", seconds=0.1)

TOP_KEYS = ("name", "timeout_s", "run", "grid", "target", "validate", "emulate", "executor")

GRID_KEYS = ("methods", "inter_bw", "inter_lat", "seeds", "knobs", "variants")

UNIT_FIELDS = ("method", "seed", "inter_bw", "inter_lat", "shaping", "extra")


@dataclass(frozen=True)
class NetworkPoint:
    """One inter-node network setting: its human labels and the link they make."""

    inter_bw: str
    inter_lat: str
    link: Link
    """The inter-node link in bytes/s and seconds, as `RunConfig.topology()` parses the labels."""

    @property
    def label(self) -> str:
        """Column header for tables, e.g. '100Mbit / 20ms'."""
        return f"{self.inter_bw} / {self.inter_lat}"

    @property
    def slug(self) -> str:
        """File-name-safe form of the label."""
        return slug(f"{self.inter_bw}_{self.inter_lat}")


@dataclass
class SweepConfig:
    """A parsed, validated sweep file (after --set overrides)."""

    name: str
    run: RunConfig
    """The [run] table: every unit's settings before the grid sets its own."""
    methods: list[str]
    networks: list[NetworkPoint]
    seeds: list[int]
    knobs: dict[str, dict[str, list[Any]]]
    variants: list[tuple[str, dict[str, Any]]]
    """[[grid.variants]]: (method, its fixed settings), each trained beside the plain method."""
    target: float | None
    """An explicit target val_loss ([target] val_loss); None derives it from the baseline."""
    target_fraction: float | None
    """[target] baseline_fraction: the baseline's val_loss at this fraction of its steps."""
    validate: list[dict[str, Any]]
    timeout_s: float | None
    executor: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)
    emulate_nodes: list[int] = field(default_factory=list)
    """[emulate] nodes: the node counts each training unit is also emulated at."""

    def fingerprint(self) -> str:
        """Hash of everything that decides the runs (not where they run, nor how they are scored).

        The target only scores finished runs, so a folder can be re-scored with another one;
        [emulate] only adds units beside the recorded ones, so a sweep can gain node counts.
        """
        body = {k: v for k, v in self.raw.items()
                if k not in ("executor", "timeout_s", "target", "emulate")}
        text = json.dumps(body, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_config(path: Path | str, overrides: Iterable[str] = ()) -> SweepConfig:
    """Read a sweep TOML and apply `--set key=value` overrides; ConfigError on bad input.

    Its units are checked by `experiments.sweep.plan.load_config`, which callers use.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"sweep config {str(path)!r} does not exist.")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"sweep config {str(path)!r} is not valid TOML: {err}.") from None
    if "site" in raw and "grid" not in raw:
        raise ConfigError(f"{str(path)!r} is a topology (a site file), not a sweep config: give "
                          "it to flexbench simulate, compare or run as --topology "
                          f"{str(path)!r}.")
    raw.setdefault("name", path.stem)
    for key, value in parse_sets(list(overrides)).items():
        _set_dotted(raw, key, value)
    return parse_config(raw, str(path))

def parse_config(raw: dict[str, Any], source: str = "the sweep config") -> SweepConfig:
    """Validate a sweep dict (as read from TOML, from the file `source`) into a SweepConfig."""
    _top_keys(raw)
    name = raw.get("name", "sweep")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise ConfigError(f"name must be letters, digits, '.', '_' or '-', got {name!r}.")
    run = _table(raw, "run")
    for key in UNIT_FIELDS:
        if key in run:
            raise ConfigError(f"run.{key} is set per unit by the sweep; put it in [grid] instead.")
    if "topology_file" in run:
        raise ConfigError("run.topology_file: a sweep scores its runs on the grid's inter_bw x "
                          "inter_lat points, and sites are not built into sweeps; replay the "
                          "sweep's runs with flexbench simulate --topology instead.")
    grid = _table(raw, "grid")
    methods, networks, seeds, knobs = _grid(grid)
    variants = _variants(grid.get("variants", []), methods)
    _plugin_knobs_in_run(run, methods)
    target, fraction = _target(raw.get("target"), source)
    timeout = raw.get("timeout_s")
    if timeout is not None:  # leaving timeout_s out is how a sweep says "no limit"
        POSITIVE.check("timeout_s", timeout)
    executor = _executor(raw)
    validate = raw.get("validate", [])
    if not isinstance(validate, list) or not all(isinstance(v, dict) for v in validate):
        raise ConfigError("validate must be a list of [[validate]] tables.")
    cfg = SweepConfig(
        name=name, run=RunConfig.from_dict(run),  # unknown keys and bad types fail here
        methods=methods, networks=networks, seeds=seeds, knobs=knobs, variants=variants,
        target=target, target_fraction=fraction, validate=validate, timeout_s=timeout,
        executor=executor, raw=raw,
    )
    cfg.emulate_nodes = _emulate(raw, cfg, source)
    _unread_run_knobs(run, methods)
    if target is None and BASELINE not in methods:
        raise ConfigError(f"without [target] val_loss the target comes from {BASELINE}; add "
                          f"{BASELINE!r} to grid.methods or set target.val_loss.")
    return cfg

def _emulate(raw: dict[str, Any], cfg: SweepConfig, source: str) -> list[int]:
    """[emulate] nodes: node counts every training unit is emulated at (`flexbench run
    --emulate`), each needing what an emulated run needs and one rank a node."""
    from experiments.run.emulate import emulation_problem

    if "emulate" not in raw:
        return []
    table = _table(raw, "emulate")
    _known("[emulate]", table, ("nodes",))
    if "nodes" not in table:  # an [emulate] of nothing is a table half-written, not no table
        raise ConfigError(f"[emulate] in {source!r} has no nodes; give the node counts to "
                          "emulate at, such as nodes = [8, 16], or remove the table.")
    nodes = [POSITIVE_INT.check("emulate.nodes", n) for n in _nonempty_list(table, "nodes", int,
                                                                            "emulate")]
    if cfg.run.gpus_per_node != 1:
        raise ConfigError(f"[emulate] trains one replica a node, so its units' recordings must "
                          f"have one rank a node too; set run.gpus_per_node = 1 (it is "
                          f"{cfg.run.gpus_per_node}).")
    for n in nodes:
        if n == cfg.run.nodes:
            raise ConfigError(f"emulate.nodes lists {n}, the recorded units' own node count; "
                              "give only other node counts.")
    for method in cfg.methods:
        problem = emulation_problem(method_of(method), is_plugin(method))
        if problem is not None:
            raise ConfigError(f"[emulate] of grid.methods: {problem}")
    gridded = [m for m, knobs in cfg.knobs.items() if "nodes" in knobs]
    gridded += [m for m, settings in cfg.variants if "nodes" in settings]
    if gridded:
        raise ConfigError(f"[emulate] and a nodes setting of {gridded[0]} in [grid] do not mix "
                          "(an emulated unit's node count is its own); drop one of them.")
    return nodes

def _top_keys(raw: dict[str, Any]) -> None:
    """Only a sweep file's own keys at its top; a run setting there belongs in [run]."""
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    for key in raw:
        if key not in TOP_KEYS and key in fields:
            raise ConfigError(f"{key!r} is a run setting, which a sweep file takes in its [run] "
                              f"table; its top level holds {', '.join(TOP_KEYS)}.")
    _known("sweep config", raw, TOP_KEYS)

def _unread_run_knobs(run: dict[str, Any], methods: list[str]) -> None:
    """A [run] knob must be read by some method of the grid.

    Each unit keeps only the [run] knobs its method reads (`shared_for`), so a knob no method
    reads would be dropped from every unit without a word.
    """
    readers = {name for m in methods for name in method_of(m).takes}
    for name in run:
        if name in KNOBS and name not in readers:
            raise ConfigError(f"run.{name} is read by none of grid.methods "
                              f"({', '.join(methods)}); remove it or add a method that reads it.")

def _plugin_knobs_in_run(run: dict[str, Any], methods: list[str]) -> None:
    """A plug-in's own knob belongs in its [grid.knobs] table: [run] is every method's."""
    for name in run:
        owner = next((m for m in methods if is_plugin(m) and name not in KNOBS
                      and name in method_of(m).takes), None)
        if owner is not None:
            raise ConfigError(f"run.{name} is a knob of {owner} alone; give it in "
                              f'[grid.knobs."{owner}"].')

def _grid(grid: dict[str, Any]) -> tuple[list[str], list[NetworkPoint], list[int],
                                         dict[str, dict[str, list[Any]]]]:
    """[grid]: its methods, network points (every bandwidth x latency), seeds and knobs."""
    _known("[grid]", grid, GRID_KEYS)
    methods = _nonempty_list(grid, "methods", str)
    for method in methods:
        _known_method("grid.methods", method)
    bws = _nonempty_list(grid, "inter_bw", str)
    lats = _nonempty_list(grid, "inter_lat", str)
    points = len(bws) * len(lats)  # bounded before any is made: each training unit is scored
    check_work("the sweep's scoring", [Term(SCORE, (Count(
        "grid", points, "network points", said=f"the grid's {points:,} network points "
        "(inter_bw x inter_lat)"),))], budget_s=LONG_S, budget="a day, the longest a sweep is "
        "let start")
    networks = [network_point(bw, lat) for bw in bws for lat in lats]
    seeds = [SEED.check("grid.seeds", seed) for seed in _nonempty_list(grid, "seeds", int)]
    return methods, networks, seeds, _knobs(grid.get("knobs", {}), methods)

def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = _key_parts(key)
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {part!r} is not a table.")
        node = child
    node[parts[-1]] = value

def _key_parts(key: str) -> list[str]:
    """The parts of a dotted --set key, read as TOML reads one: a quoted part may hold dots
    and colons (`grid.knobs."my_pkg.mod:make".momentum`)."""
    try:
        node: Any = tomllib.loads(f"{key} = 0")
    except tomllib.TOMLDecodeError:
        return key.split(".")
    parts = []
    while isinstance(node, dict):
        parts.append(next(iter(node)))
        node = node[parts[-1]]
    return parts

def _executor(raw: dict[str, Any]) -> dict[str, Any]:
    """The [executor] table, every key checked now rather than when the units are submitted.

    Besides `kind` and `folder` it holds submitit parameters (`timeout_min`, `slurm_partition`,
    ...); submitit itself checks their names and types, so a typo is refused before any work.
    """
    executor = _table(raw, "executor")
    if executor.get("kind", "local") not in EXECUTORS:
        raise ConfigError(f"unknown executor.kind {executor['kind']!r}; choose one of "
                          f"{', '.join(EXECUTORS)}.")
    folder = executor.get("folder", "")
    if not isinstance(folder, str):
        raise ConfigError(f"executor.folder must be a path as a string, got {folder!r}.")
    params = {k: v for k, v in executor.items() if k not in ("kind", "folder")}
    if params:
        _executor_numbers(params)
        import submitit

        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated spellings still work
            try:
                submitit.AutoExecutor(folder=tmp, cluster="debug").update_parameters(**params)
            except (NameError, ValueError, TypeError, AssertionError) as err:
                first = str(err).strip().splitlines()[0]
                raise ConfigError(f"[executor]: {first}") from None
    return executor


def _executor_numbers(params: dict[str, Any]) -> None:
    """Numbers of [executor] are finite and not booleans, which submitit lets through.

    submitit checks its shared parameters with isinstance, and True is an int to Python: a
    `timeout_min = true` would ask Slurm for one minute.
    """
    from submitit import AutoExecutor

    typed = AutoExecutor._typed_parameters()  # the shared parameters' types, as submitit checks
    for key, value in params.items():
        number = typed.get(key) in (int, float)
        if number or isinstance(value, (int, float)) and not isinstance(value, bool):
            kind = (POSITIVE_INT if key in _AT_LEAST_ONE else
                    COUNT if typed.get(key) is int else AT_LEAST_ZERO)
            kind.check(f"executor.{key}", value)


# A job of none of these cannot run. Zero is meaningful elsewhere: Slurm reads timeout_min 0
# as no limit and mem_gb 0 as all of the node's memory; gpus_per_node 0 asks for none.
_AT_LEAST_ONE = ("nodes", "cpus_per_task", "tasks_per_node")

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

def _nonempty_list(grid: dict[str, Any], key: str, kind: type,
                   table: str = "grid") -> list[Any]:
    value = grid.get(key)
    if value is None:
        raise ConfigError(f"{table}.{key} is missing; give a non-empty list.")
    if not isinstance(value, list):
        value = [value]  # a single value is a one-point axis
    if not value:
        raise ConfigError(f"{table}.{key} is empty; give at least one value.")
    for item in value:
        if not isinstance(item, kind) or isinstance(item, bool):
            raise ConfigError(f"{table}.{key} takes {kind.__name__} values, got {item!r}.")
    if len(set(map(str, value))) != len(value):
        raise ConfigError(f"{table}.{key} lists a value twice: {value!r}.")
    return list(value)

def network_point(bw: str, lat: str) -> NetworkPoint:
    """A grid or validation point; its labels parsed as a run parses them (ConfigError if bad)."""
    return NetworkPoint(bw, lat, RunConfig(inter_bw=bw, inter_lat=lat).topology().inter)

def _known_method(where: str, method: Any) -> None:
    """ConfigError naming ``where`` unless ``method`` is a built-in method or a usable plug-in."""
    try:
        method_of(method)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None


def _check_setting(where: str, name: str, method: str | None = None) -> None:
    """A grid may set any run setting but those every unit gets from the sweep (UNIT_FIELDS),
    and the knobs of its plug-in ``method``."""
    fields = {f.name for f in dataclasses.fields(RunConfig)} - set(UNIT_FIELDS) - {
        "plugin_knobs"}
    if name in fields or is_plugin(method) and name in method_of(method).takes:
        return
    own = f", and {method}'s knobs" if is_plugin(method) else ""
    raise ConfigError(f"{where} is not a run setting; known: {', '.join(sorted(fields))}{own}.")

def _knobs(table: Any, methods: list[str]) -> dict[str, dict[str, list[Any]]]:
    if not isinstance(table, dict):
        raise ConfigError(f"grid.knobs must be a table of [grid.knobs.<method>], got {table!r}.")
    out: dict[str, dict[str, list[Any]]] = {}
    for method, knobs in table.items():
        _known_method(f"grid.knobs.{method}", method)
        if not isinstance(knobs, dict):
            raise ConfigError(f"grid.knobs.{method} must be a table, got {knobs!r}.")
        # Names are checked even for a method left out of the grid, so that a typo is found
        # before the method is put back.
        for name in knobs:
            _check_setting(f"grid.knobs.{method}.{name}", name, method)
        if method not in methods:
            continue  # knobs of a method dropped from the grid (e.g. by --set) are moot
        out[method] = {}
        for name, values in knobs.items():
            values = values if isinstance(values, list) else [values]
            if not values:
                raise ConfigError(f"grid.knobs.{method}.{name} is empty; give at least one value.")
            out[method][name] = values
    return out

def _variants(table: Any, methods: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """[[grid.variants]]: a method of the grid at fixed run settings, e.g. flexdemo at decay 0.9.

    Unlike a [grid.knobs] list, which labels every unit of its method, a variant adds units
    labelled by their settings (flexdemo[decay=0.9]) and leaves the plain method's as they are.
    """
    if not isinstance(table, list) or not all(isinstance(v, dict) for v in table):
        raise ConfigError("grid.variants must be a list of [[grid.variants]] tables.")
    out: list[tuple[str, dict[str, Any]]] = []
    for i, entry in enumerate(table):
        where = f"grid.variants[{i}]"
        settings = dict(entry)
        method = settings.pop("method", None)
        if method not in methods:
            raise ConfigError(f"{where}.method must be one of grid.methods "
                              f"({', '.join(methods)}), got {method!r}.")
        if not settings:
            raise ConfigError(f"{where} sets nothing but the method; give the settings that "
                              "make it a variant, e.g. decay = 0.9.")
        for name, value in settings.items():
            _check_setting(f"{where}.{name}", name, method)
            if isinstance(value, (list, dict)):
                raise ConfigError(f"{where}.{name} must be one value, got {value!r}; a list of "
                                  "values belongs in [grid.knobs.<method>].")
        out.append((method, settings))
    return out

def _target(table: Any, source: str) -> tuple[float | None, float | None]:
    """([target] val_loss, [target] baseline_fraction); one of them when the table is there."""
    if table is None:
        return None, None
    if not isinstance(table, dict):
        raise ConfigError(f"[target] must be a table with val_loss or baseline_fraction, got "
                          f"{table!r}.")
    _known("[target]", table, ("val_loss", "baseline_fraction"))
    if not table:  # read as no table, the target would come from the baseline unasked
        raise ConfigError(f"[target] in {source!r} has neither val_loss nor "
                          "baseline_fraction; give one, or remove the table to derive the "
                          "target from the baseline.")
    value, fraction = table.get("val_loss"), table.get("baseline_fraction")
    if value is not None and fraction is not None:
        raise ConfigError("[target] takes val_loss or baseline_fraction, not both.")
    if value is not None:
        POSITIVE.check("target.val_loss", value)
    if fraction is not None:
        UNIT_OPEN_LOW.check("target.baseline_fraction", fraction)
    return (None if value is None else float(value),
            None if fraction is None else float(fraction))

def slug(text: str) -> str:
    """A file-name-safe form of `text`."""
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", text)
