"""Stand-ins for launch() and the sweep's replay: synthetic runs written and read, no training."""

from __future__ import annotations

import json
import math
import os
import sys
import types
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.config import RunConfig
from experiments.replay.target import ReplayTarget
from netsim.model import Replay

# Bytes per step each fake method sends across nodes; hsdp-adamw sends the most.
FAKE_BYTES = {"hsdp-adamw": 8e6, "flexdemo": 2e5, "demo": 4e5, "diloco": 8e6 / 5, "random": 1e5,
              "striding": 1e5, "none": 0.0, "gossip": 1e6}
COMPUTE_S = 0.1
STEPS = 20
EVAL_EVERY = 5
DIVERGED_AT = 10  # the step FAKE_DIVERGE_UNIT's loss stops being finite


class FakeRunFailed(RuntimeError):
    """What the fake launcher raises for units the test wants to fail."""


def fake_loss(method: str, seed: int, step: int) -> float:
    """A decreasing loss curve; hsdp-adamw learns fastest per step, the others a little slower."""
    rate = {"hsdp-adamw": 0.15, "flexdemo": 0.14, "demo": 0.11}.get(method, 0.08)
    return 2.0 + 3.0 * math.exp(-rate * step) + 0.01 * seed


def fake_degree(cfg: RunConfig) -> float:
    """Mean peers per node and round of a gossip run's graph (0 for every other method)."""
    if cfg.method != "gossip":
        return 0.0
    from flexdemo.graphs import degree_of, period

    rounds = range(period(cfg.graph, cfg.nodes))
    total = sum(degree_of(cfg.graph, cfg.nodes, i, t) for i in range(cfg.nodes) for t in rounds)
    return total / (cfg.nodes * len(rounds))


def fake_gossip_loss(degree: float, seed: int, step: int) -> float:
    """Gossip learns faster with more peers per round (the trend DBench reports)."""
    return 2.0 + 3.0 * math.exp(-(0.1 + 0.02 * degree) * step) + 0.01 * seed


def fake_variance(degree: float) -> float:
    """Replicas drift apart less the more peers they average with."""
    return 1e-6 / (1.0 + degree) ** 2


def fake_launch(cfg: RunConfig, out: Path, *, timeout_s: float | None = None, **_: object) -> Path:
    """Write steps.parquet, trace.parquet and run.json like the real launcher, all at the end."""
    out = Path(out)
    fail = os.environ.get("FAKE_FAIL_UNIT")
    if fail and cfg.extra.get("unit") == fail:
        raise FakeRunFailed(f"run timed out after {timeout_s} s")
    calls_path = os.environ.get("FAKE_CALLS")
    if calls_path:
        with open(calls_path, "a") as fh:
            fh.write(cfg.extra.get("unit", "?") + "\n")
    steps = np.arange(1, STEPS + 1)
    per_step = FAKE_BYTES[cfg.method] * float(os.environ.get("FAKE_BYTES_SCALE", "1"))
    bw = None if cfg.inter_bw is None else cfg.topology().inter.bandwidth
    comm = 0.0 if bw is None else per_step / bw
    degree = fake_degree(cfg)
    curve = [fake_gossip_loss(degree, cfg.seed, int(s)) if cfg.method == "gossip"
             else fake_loss(cfg.method, cfg.seed, int(s)) for s in steps]
    evaluated = steps % EVAL_EVERY == 0
    frame = pd.DataFrame({
        "step": steps,
        "wall_time_s": steps * (COMPUTE_S + comm),
        "loss": curve,
        "val_loss": np.where(evaluated, curve, np.nan),
        "replica_variance": np.where(evaluated, fake_variance(degree), np.nan),
        "consensus_distance": np.where(evaluated, 1e-3 / (1.0 + degree), np.nan),
        "inter_bytes_sent": per_step,
        "inter_bytes_received": per_step,
        "inter_calls": 3 if per_step else 0,
        "intra_bytes": 1e6,
        "compute_s": COMPUTE_S,
        "comm_s": comm,
    })
    meta = {"config": cfg.to_dict(), "final_val_loss": float(frame["val_loss"].dropna().iloc[-1]),
            "status": "done"}
    if cfg.extra.get("unit") == os.environ.get("FAKE_DIVERGE_UNIT"):
        # As a real run that diverges: its curve stops at the evaluation that saw it.
        frame = frame[frame["step"] <= DIVERGED_AT]
        meta.update(status="diverged", diverged_step=DIVERGED_AT, final_val_loss=None)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True)
    frame.to_parquet(tmp / "steps.parquet", index=False)
    _fake_trace(cfg, per_step).to_parquet(tmp / "trace.parquet")
    (tmp / "run.json").write_text(json.dumps(meta))
    os.replace(tmp, out)
    return out


def _fake_trace(cfg: RunConfig, per_step: float) -> pd.DataFrame:
    """Gossip: a send per peer and round; others: an all-reduce per step; one eval-phase send."""
    rows = []
    for step in range(1, STEPS + 1):
        for rank in range(cfg.nodes * cfg.gpus_per_node):
            if cfg.method == "gossip":
                from flexdemo.graphs import peers

                node = rank // cfg.gpus_per_node
                rows += [(rank, step, "send", True, "train", per_step)
                         for _ in peers(cfg.graph, cfg.nodes, node, step - 1)]
            else:
                rows.append((rank, step, "all_reduce", True, "train", per_step))
    rows.append((0, STEPS, "send", True, "eval", per_step))
    return pd.DataFrame(rows, columns=["rank", "step", "op", "inter", "phase", "bytes"])


def fake_simulate(run_dir: Path, target: ReplayTarget) -> Replay:
    """Step time = compute + bytes / bandwidth + latency per call, on the run's own topology."""
    cfg = RunConfig(**json.loads((Path(run_dir) / "run.json").read_text())["config"])
    topology = cfg.replace(inter_bw=target.inter_bw, inter_lat=target.inter_lat).topology()
    steps = pd.read_parquet(Path(run_dir) / "steps.parquet")
    step_time = (steps["compute_s"] + steps["inter_bytes_sent"] / topology.inter.bandwidth
                 + steps["inter_calls"] * topology.inter.latency)
    frame = pd.DataFrame({"step": steps["step"], "step_time_s": step_time,
                          "time_s": step_time.cumsum()})
    return Replay(frame, topology, recorded_topology=(cfg.nodes, cfg.gpus_per_node))


def ensure_units_module() -> None:
    """Give tests netsim.units parsing even before the netsim package ships it."""
    try:
        import netsim.units  # noqa: F401
        return
    except ImportError:
        pass
    mod = types.ModuleType("netsim.units")
    scale = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "mb/s": 1e6, "gb/s": 1e9}
    lat = {"us": 1e-6, "ms": 1e-3, "s": 1.0}

    def parse(text: str, table: dict[str, float], what: str) -> float:
        low = str(text).strip().lower()
        for unit in sorted(table, key=len, reverse=True):
            if low.endswith(unit):
                try:
                    return float(low[: -len(unit)]) * table[unit]
                except ValueError:
                    break
        raise ValueError(f"cannot parse {what} {text!r}")

    mod.parse_bandwidth = lambda t: parse(t, scale, "bandwidth")
    mod.parse_latency = lambda t: parse(t, lat, "latency")
    sys.modules["netsim.units"] = mod
