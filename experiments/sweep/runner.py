"""Running a sweep: claim the folder, run every pending unit, record states, then collect.

Units run through an executor (`experiments.sweep.executors`: one at a time here, or Slurm jobs); a
unit that fails is recorded and the sweep goes on. Rerunning the same command resumes: done units
are kept, debris of a killed unit is removed and the unit runs again.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm import tqdm

from experiments.errors import ConfigError
from experiments.io import exclusive, provenance, write_atomic
from experiments.run_record import RunRecord
from experiments.sweep.executors import Job, check_reachable, execute
from experiments.sweep.plan import Unit, failure_path, unit_dir, unit_state, units_of
from experiments.sweep.score import Simulator, collect
from experiments.sweep.spec import SweepConfig

log = logging.getLogger(__name__)

__all__ = ["LOCK", "run_sweep"]

LOCK = ".lock"  # in the sweep folder while a sweep runs there: its pid

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
    _check_done_units(out, units)
    if any(unit_state(out, u) != "done" for u in units):
        check_reachable(executor or cfg.executor.get("kind", "local"))  # before anything is written
    _claim(cfg, out)
    with exclusive(out / LOCK, "sweep"):
        return _run_units(cfg, out, units, executor=executor, launcher=launcher,
                          simulator=simulator, retry_failed=retry_failed, resimulate=resimulate,
                          progress=progress)


def _check_done_units(out: Path, units: list[Unit]) -> None:
    """ConfigError for a unit taken as done (its run.json is there) whose other files are not:
    scoring would stop at it, and re-training it would throw its record away."""
    for unit in units:
        if unit_state(out, unit) != "done":
            continue
        missing = RunRecord.missing_file(unit_dir(out, unit))
        if missing is not None:
            raise ConfigError(f"unit {unit.id} in {str(out)!r} is half there: its run.json is, "
                              f"its {missing} is not; remove {str(unit_dir(out, unit))!r} to "
                              "train it again.")


def _run_units(cfg: SweepConfig, out: Path, units: list[Unit], *, executor: str | None,
               launcher: Callable[..., Any] | None, simulator: Simulator | None,
               retry_failed: bool, resimulate: bool, progress: bool) -> pd.DataFrame:
    """The sweep itself, with its folder held: the pending units, then the scoring."""
    if resimulate and (out / "sim").exists():
        # The cached axes are derived data; a changed cost model must recompute them.
        shutil.rmtree(out / "sim")
    kind = executor or cfg.executor.get("kind", "local")
    from experiments.run.folder import RunFolder

    for unit in units:
        # A sweep killed between a unit's commit and the removal of its working folder leaves
        # that folder beside a finished unit, which no rerun of the unit would clean.
        RunFolder(unit_dir(out, unit)).remove_dead()
    pending = [u for u in units if unit_state(out, u) == "pending"
               or (retry_failed and unit_state(out, u) == "failed")]
    jobs = [Job(u.id, u.config.to_dict(), unit_dir(out, u), failure_path(out, u), u.emulated)
            for u in pending]
    params = {k: v for k, v in cfg.executor.items() if k not in ("kind", "folder")}
    folder = Path(cfg.executor.get("folder", out / "submitit"))
    bar = tqdm(total=len(jobs), desc=f"sweep {cfg.name}", unit="run", disable=not progress)
    try:
        _follow(execute(jobs, kind=kind, timeout_s=cfg.timeout_s, launcher=launcher,
                        folder=folder, params=params), bar)
    finally:
        bar.close()
        _write_sweep_json(cfg, out, units)
    return collect(cfg, out, simulator=simulator, progress=progress)


def _follow(results: Iterable[Any], bar: tqdm) -> None:
    """Advance the sweep's bar as units end, naming each; log the stopped and the failed."""
    failures = 0
    for result in results:
        failures += not (result.ok or result.stopped)
        bar.update(1)
        said = "ok" if result.ok else "stopped" if result.stopped else "FAILED"
        bar.set_postfix_str(f"{result.unit_id} {said}"
                            f"{f', {failures} failed' if failures else ''}")
        if result.stopped:
            log.warning("unit %s %s", result.unit_id, result.error)
        elif not result.ok:
            log.warning("unit %s failed: %s", result.unit_id, result.error)

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
        "units": {u.id: unit_state(out, u) for u in units},
    }
    write_atomic(meta, json.dumps(body, indent=2, default=str))
