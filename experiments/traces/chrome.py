"""One rank's torch.profiler Chrome trace, read and checked: its events, rank, groups and device.

torch.profiler (and torchtitan's `--profiling.enable_profiling`, which calls it) writes one JSON
file per rank, plain or gzipped: `traceEvents` (complete events "X" with `ts` and `dur` in
microseconds, on host threads or on a GPU's streams), and beside them `distributedInfo` (the
rank, world size, backend and, in newer versions, every process group the rank belongs to) and
`deviceProperties` (the GPUs). `read_rank(path)` reads one such file, or refuses it in one
sentence naming the file.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from experiments.errors import ConfigError

__all__ = ["DEVICE_CATEGORIES", "RankFile", "Event", "trace_files", "read_rank"]

# Event categories a GPU's streams carry (the rest are host threads').
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"})
# What a folder given as TRACE holds: torch.profiler's own names and torchtitan's.
_TRACE_NAMES = ("*.json", "*.json.gz")


@dataclass(frozen=True)
class Event:
    """One complete event: where it ran, when (seconds on the rank's clock) and its arguments."""

    name: str
    cat: str
    tid: Any
    start: float
    end: float
    args: dict

    @property
    def on_device(self) -> bool:
        """Whether it ran on a GPU stream (a kernel, a copy, the device side of an annotation)."""
        return self.cat in DEVICE_CATEGORIES


@dataclass
class RankFile:
    """What one rank's trace file holds."""

    path: Path
    rank: int
    world_size: int
    backend: str
    device: str
    """The GPU's name (deviceProperties), or "cpu" for a trace without device events."""
    devices: int
    """GPUs the rank's host lists (deviceProperties); 0 on a CPU-only host."""
    groups: list[tuple[int, ...]]
    """The process groups the rank belongs to (distributedInfo's pg_config), ranks sorted."""
    descriptions: dict[tuple[int, ...], str]
    """A group's description where the trace names one (torchtitan: mesh_tp, mesh_dp_shard)."""
    events: list[Event] = field(default_factory=list)


def trace_files(paths: list[str]) -> list[Path]:
    """The trace files named: files as given, a folder's *.json and *.json.gz (not deeper)."""
    found: list[Path] = []
    for text in paths:
        path = Path(text)
        if path.is_dir():
            inside = sorted({p for pattern in _TRACE_NAMES for p in path.glob(pattern)})
            if not inside:
                raise ConfigError(f"folder {text!r} holds no trace (*.json or *.json.gz); give "
                                  "the folder torch.profiler wrote its per-rank files into.")
            found += inside
        elif path.is_file():
            found.append(path)
        else:
            raise ConfigError(f"trace {text!r} does not exist.")
    return found


def _load(path: Path) -> Any:
    """The file's JSON, gzipped or plain (ConfigError, one sentence, for anything else)."""
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        return json.loads(raw)
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{str(path)!r} is not a torch.profiler trace: it does not read as "
                          f"JSON, plain or gzipped ({err}).") from None


def _info(data: dict, path: Path) -> dict:
    """distributedInfo, which older profilers wrote as a Python dict's text."""
    info = data.get("distributedInfo")
    if isinstance(info, str):
        try:
            info = json.loads(info.replace("'", '"'))
        except json.JSONDecodeError:
            info = None
    if not isinstance(info, dict) or "rank" not in info:
        raise ConfigError(f"{str(path)!r} names no rank (its distributedInfo is missing): "
                          "profile a job whose process group was initialized when the "
                          "profiler started.")
    return info


def _device(data: dict) -> tuple[str, int]:
    """The first GPU's name and how many the host lists ("cpu", 0 without any)."""
    props = data.get("deviceProperties")
    if isinstance(props, str):  # older profilers: a Python list's text
        names = re.findall(r"'name': '([^']+)'", props)
        return (names[0], len(names)) if names else ("cpu", 0)
    if isinstance(props, list) and props and isinstance(props[0], dict):
        return str(props[0].get("name", "cpu")), len(props)
    return "cpu", 0


def _groups(info: dict) -> tuple[list[tuple[int, ...]], dict[tuple[int, ...], str]]:
    groups, names = [], {}
    for pg in info.get("pg_config") or []:
        ranks = pg.get("ranks") if isinstance(pg, dict) else None
        if isinstance(ranks, list) and ranks and all(isinstance(r, int) for r in ranks):
            key = tuple(sorted(ranks))
            if key not in groups:
                groups.append(key)
            names.setdefault(key, str(pg.get("pg_desc", "")))
    return groups, names


def _events(raw: list, path: Path) -> list[Event]:
    """The complete ("X") events, times in seconds."""
    events = []
    for e in raw:
        if not isinstance(e, dict) or e.get("ph") != "X" or e.get("cat") == "Trace":
            continue  # "Trace": the profiler's own span over the whole window
        try:
            start, dur = float(e["ts"]), float(e.get("dur", 0.0))
        except (KeyError, TypeError, ValueError):
            continue
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        events.append(Event(str(e.get("name", "")), str(e.get("cat", "")), e.get("tid"),
                            start * 1e-6, (start + max(dur, 0.0)) * 1e-6, args))
    if not events:
        raise ConfigError(f"{str(path)!r} is not a torch.profiler trace: it holds no complete "
                          "events.")
    return events


def read_rank(path: Path) -> RankFile:
    """One rank's trace file, read and checked (ConfigError, one sentence, naming the file)."""
    data = _load(path)
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ConfigError(f"{str(path)!r} is not a torch.profiler trace: it has no traceEvents "
                          "list.")
    info = _info(data, path)
    try:
        rank, world = int(info["rank"]), int(info.get("world_size", 0))
    except (TypeError, ValueError):
        raise ConfigError(f"{str(path)!r}: its distributedInfo rank {info.get('rank')!r} is "
                          "not a whole number.") from None
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"{str(path)!r} says rank {rank} of a world of {world}; a rank must "
                          "lie in 0..world_size-1.")
    groups, names = _groups(info)
    device, devices = _device(data)
    return RankFile(path, rank, world, str(info.get("backend", "")), device, devices, groups,
                    names, _events(data["traceEvents"], path))
