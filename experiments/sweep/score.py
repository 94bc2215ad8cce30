"""Scoring a sweep: every finished unit timed on every network point, then time-to-target.

    sim/<unit>/<net>-<key>.parquet  cached simulated time axis of one unit at one network
                          point; the key is a hash of what the axis depends on (the run's
                          run.json and trace, the exact link values, the model's source), so a
                          retrained unit, another point with a like label or a changed model
                          never reads a stale axis
    runs.parquet          one row per unit x network point x source ("sim" / "measured"), with
                          the unit's cluster, graph, graph degree and replica spread (`describe`);
                          a measured row also its own-compute replay (`report.validation`)
    speedups.parquet      per variant, network point and source: time-to-target and speed-up
                          over hsdp-adamw, paired by seed, with brackets (`speedups.speedups`;
                          `flexbench report` rewrites it from runs.parquet)
    steps.parquet         every unit's per-step rows with their keys and time axes

Every unit is replayed at its own recorded cluster shape (only the network point changes), so
its time to target uses its own loss curve and no loss rule (`experiments.replay.loss_curve`)
applies. An emulated unit (`[emulate] nodes`) is the one replayed at another node count: its
recorded unit's trace at the emulated unit's node count (`ReplayTarget(nodes=N)`), with
the emulated unit's own loss curve there; it measured no bytes (those columns are NaN), its
graph degree is its graphs' at N, and its cluster (N x 1) is scored against the baseline
emulated at N.

A diverged run (run.json status "diverged") and a failed unit count as never reaching the target.
Each unit is scored against the baseline of its own cluster when hsdp-adamw runs on several
(`targets`); `baseline_cluster` names the one it was scored against.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
from tqdm import tqdm

from experiments.io import run_digest, write_atomic
from experiments.report import validation
from experiments.run_record import RunRecord
from experiments.scoring import speedups
from experiments.scoring.targets import time_to_target
from experiments.sweep.describe import run_columns, unit_columns
from experiments.sweep.plan import Unit, failure_path, unit_dir, unit_state, units_of
from experiments.sweep.spec import NetworkPoint, SweepConfig
from experiments.sweep.targets import baseline_clusters, final_val_loss, targets

if TYPE_CHECKING:  # the model (SimPy) loads only when a unit is replayed, not to score caches
    from experiments.replay.target import ReplayTarget
    from netsim.model import Replay

log = logging.getLogger(__name__)

__all__ = ["KEY_COLUMNS", "Simulator", "collect", "parquet_bytes"]

# (run folder, target) -> the Replay there: `experiments.replay.engine.replay` of the folder's run.
Simulator = Callable[[Path, "ReplayTarget"], "Replay"]

KEY_COLUMNS = ["unit", "kind", "method", "variant", "knobs", "seed", "nodes", "cluster", "graph",
               "network", "inter_bw", "inter_lat", "inter_bw_bps", "inter_lat_s", "source",
               "on_grid"]


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
    compare = baseline_clusters(train)
    goals = targets(cfg, out, train)
    rows: list[dict[str, Any]] = []
    step_frames: list[pd.DataFrame] = []
    work = [(u, net, "sim") for u in train for net in _sim_points(cfg, units, u)]
    work += [(u, u.network, "measured") for u in units if u.kind == "validate"]
    for unit, net, source in tqdm(work, desc="timing", unit="point", disable=not progress):
        on_grid = net in cfg.networks  # validation-only points stay out of the headline table
        base = compare.get(unit.cluster)
        row, steps = _time_unit(out, unit, net, source, goals[base], simulate, on_grid)
        row["baseline_cluster"] = base
        rows.append(row)
        if steps is not None:
            step_frames.append(steps)
    checks = {u.id: u for u in units if u.kind == "validate"}

    def own_axis(run_dir: Path, **_: str) -> pd.DataFrame:
        """A validate unit replayed with its own compute at its own point (cached alike)."""
        unit = checks[Path(run_dir).name]
        return _simulated_axis(out, unit, unit.network, simulate)

    runs = validation.own_compute(out, pd.DataFrame(rows), own_axis)
    runs["sweep"] = cfg.name
    _warn_unreached(runs)
    write_atomic(out / "runs.parquet", parquet_bytes(runs))
    all_steps = pd.concat(step_frames, ignore_index=True) if step_frames else pd.DataFrame()
    write_atomic(out / "steps.parquet", parquet_bytes(all_steps))
    write_atomic(out / "speedups.parquet", parquet_bytes(speedups.sweep_speedups(runs)))
    return runs

def _warn_unreached(runs: pd.DataFrame) -> None:
    """Say which trained variants never reach their target (the loss per step is network-free)."""
    trained = runs[(runs["source"] == "sim") & (runs["status"] == "done")
                   & runs["target_val_loss"].notna()]
    if trained.empty:
        return
    per = trained.groupby("variant", sort=False).agg(reached=("reached", "any"),
                                                      target=("target_val_loss", "first"))
    missing = per[~per["reached"]]
    if len(missing):
        log.warning("never reached within its budget: %s.", ", ".join(
            f"{v} (target val_loss {t:.4f})" for v, t in missing["target"].items()))


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
        "knobs": json.dumps(unit.knobs, sort_keys=True), "seed": unit.seed, **unit_columns(unit),
        "network": net.label, "inter_bw": net.inter_bw, "inter_lat": net.inter_lat,
        "inter_bw_bps": net.link.bandwidth, "inter_lat_s": net.link.latency, "source": source,
        "on_grid": on_grid,
        "status": unit_state(out, unit), "error": None, "target_val_loss": target,
        "time_to_target_s": math.inf, "reached": False, "final_val_loss": math.nan,
        "final_time_s": math.nan, "steps": 0, "inter_bytes_per_step": math.nan,
        "inter_bytes_received_per_step": math.nan, "inter_calls_per_step": math.nan,
        "diverged": False,
        "intra_bytes_per_step": math.nan, "graph_degree": math.nan,
        "replica_variance": math.nan, "consensus_distance": math.nan, "run_digest": None,
    }
    run_dir = unit_dir(out, unit)
    if row["status"] == "failed":
        row["error"] = json.loads(failure_path(out, unit).read_text()).get("error")
    if row["status"] != "done":
        return row, None  # kept as "not reached": a failed run is never dropped
    row["run_digest"] = run_digest(run_dir)  # `report` checks the run is still the one scored
    steps = pd.read_parquet(run_dir / "steps.parquet").sort_values("step")
    if source == "sim":
        try:
            axis = _simulated_axis(out, unit, net, simulate)
        except Exception as err:  # a model error at one point must not lose the others
            row.update(status="sim-failed", error=f"{type(err).__name__}: {err}")
            return row, None
        steps = steps.merge(axis[["step", "step_time_s", "time_s"]], on="step", how="left")
        if unit.emulated and steps.dropna(subset=["val_loss"])["time_s"].isna().any():
            row.update(status="sim-failed", error=f"the replay of {unit.recorded.id} covers "
                       f"fewer steps than {unit.id} trained")
            return row, None
    else:
        steps = steps.assign(time_s=steps["wall_time_s"],
                             step_time_s=steps["wall_time_s"].diff().fillna(steps["wall_time_s"]))
    diverged = RunRecord.load(run_dir).diverged
    ttt = time_to_target(steps["time_s"], steps["val_loss"], target) \
        if not (math.isnan(target) or diverged) else math.inf
    evals = steps.dropna(subset=["val_loss"])
    row.update(
        diverged=diverged,
        time_to_target_s=ttt,
        reached=bool(math.isfinite(ttt)),
        final_val_loss=final_val_loss(run_dir),
        final_time_s=float(steps["time_s"].iloc[-1]) if len(steps) else math.nan,
        steps=int(steps["step"].max()) if len(steps) else 0,
        evaluations=len(evals),
        inter_bytes_per_step=_mean(steps, "inter_bytes_sent"),
        inter_bytes_received_per_step=_mean(steps, "inter_bytes_received"),
        inter_calls_per_step=_mean(steps, "inter_calls"),
        intra_bytes_per_step=_mean(steps, "intra_bytes"),
        **run_columns(run_dir, steps, unit.config.nodes),
    )
    keys = {k: row[k] for k in KEY_COLUMNS}
    # A run's own per-step `graph` (the graph Ada or gossip mixed on) would clash with the unit
    # key of the same name, which names the unit's fixed graph.
    steps = steps.rename(columns={"graph": "step_graph"})
    return row, steps.assign(**keys)

def _mean(steps: pd.DataFrame, column: str) -> float:
    """A per-step figure's mean; NaN where the run measured none (an emulated run)."""
    return float(steps[column].mean()) if column in steps.columns else math.nan


def _simulated_axis(out: Path, unit: Unit, net: NetworkPoint, simulate: Simulator) -> pd.DataFrame:
    """The unit's simulated time axis at one network point, cached on disk by content.

    An emulated unit's is its recorded unit's trace replayed at the emulated node count."""
    recorded = unit.recorded or unit
    if unit_state(out, recorded) != "done":
        raise ValueError(f"its recorded unit {recorded.id} has no finished run to replay")
    key = hashlib.sha256(run_digest(unit_dir(out, recorded)).encode())
    key.update(repr((net.link.bandwidth, net.link.latency)).encode())  # exact, not the label
    if unit.emulated:  # a recorded unit's key stays what it was: its cached axes still hold
        key.update(f"nodes={unit.config.nodes}".encode())
    key.update(_model_digest().encode())
    cache = out / "sim" / unit.id / f"{net.slug}-{key.hexdigest()[:16]}.parquet"
    if cache.exists():
        return pd.read_parquet(cache)
    from experiments.replay.target import ReplayTarget

    target = ReplayTarget(inter_bw=net.inter_bw, inter_lat=net.inter_lat,
                          nodes=unit.config.nodes if unit.emulated else None)
    axis = simulate(unit_dir(out, recorded), target).frame
    missing = {"step", "step_time_s", "time_s"} - set(axis.columns)
    if missing:
        raise ValueError(f"the simulator returned no {sorted(missing)} columns")
    write_atomic(cache, parquet_bytes(axis))
    return axis

@functools.lru_cache(maxsize=1)
def _model_digest() -> str:
    """A hash of the replay's own code (netsim and the experiments' replay): its version."""
    import experiments.replay
    import netsim

    roots = [Path(netsim.__file__).parent, Path(experiments.replay.__file__).parent]
    digest = hashlib.sha256()
    for path in sorted(p for root in roots for p in root.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()



def _default_simulator() -> Simulator:
    """The one replay, of a unit's folder (loaded when a unit is first replayed)."""
    from experiments.replay.engine import replay
    from experiments.replay.recordings import read_run

    return lambda run_dir, target: replay(read_run(run_dir), target)

def parquet_bytes(frame: pd.DataFrame) -> bytes:
    """A frame as Parquet file bytes (for write_atomic)."""
    buf = io.BytesIO()
    frame.to_parquet(buf, index=False)
    return buf.getvalue()
