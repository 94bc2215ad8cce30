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

Modules: `spec` (the sweep file), `plan` (units and their folders), `runner` (running them),
`score` (timing and scoring: `collect`), `targets` (each unit's target: hsdp-adamw on the same
cluster when it runs on several), `describe` (per-unit columns: cluster, graph, degree, replica
spread), `cli` (the command).
"""

from __future__ import annotations

from experiments.lazy import lazy_names

# Name -> the module that defines it, imported on first use (PEP 562): importing the package
# (or one of its modules) loads nothing else.
_WHERE = {
    "Unit": "plan",
    "load_config": "plan",
    "units_of": "plan",
    "run_sweep": "runner",
    "collect": "score",
    "NetworkPoint": "spec",
    "SweepConfig": "spec",
}

__all__ = sorted(_WHERE)


__getattr__, __dir__ = lazy_names(__name__, _WHERE)
