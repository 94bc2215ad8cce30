"""Trace records: the schema of trace.parquet and the per-rank TraceRecorder that fills it.

One row per event of one rank. kind "collective": an op on a group (issued at start_s, waited on
from wait_s, returned at end_s); kind "step": the span between begin_step and end_step; kind
"compute": an explicit compute interval (the recorder writes none; hand-made traces may); kind
"mark": a moment (start_s = end_s) in the step, op "unit_backward" when FSDP2 unit `unit`
finished its backward, op "backward" when the whole backward returned (what the optimizer step
waits for). A collective's `unit` names the unit whose backward mark it followed within that
backward (-1 outside one, and in traces written before the column: they have no marks). Times
are seconds on the recorder's clock (the shaping clock when shaping is installed, so wall or
virtual time). A combined trace is the concatenation of all ranks' frames; `comm_per_step` sums
either into the per-step communication figures the runs report.

A point-to-point message (op "send" or "recv") is a row of its own; `peer` names the global rank
at its other end (-1 for collectives, and for traces written before the column existed).

Every row carries a `phase`: "train" for the training loop, "eval" (or another name) for traffic
that must never be mixed into the training figures, such as evaluation. Traces written before the
column existed labelled evaluation traffic as step 0; `validate_trace` reads them that way.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import pandas as pd

from netsim.topology import Topology

__all__ = [
    "TRACE_COLUMNS",
    "KINDS",
    "TRAIN",
    "EVAL",
    "UNIT_BACKWARD",
    "BACKWARD",
    "TraceRecorder",
    "empty_trace",
    "validate_trace",
    "load_trace",
    "comm_per_step",
    "compute_outside_collectives",
    "waited_after_step",
]

# Column -> dtype. `bytes` is the payload the rank handed in; bytes_sent/received are wire bytes.
TRACE_COLUMNS: dict[str, str] = {
    "rank": "int64",
    "node": "int64",
    "local": "int64",
    "step": "int64",
    "seq": "int64",
    "kind": "object",
    "op": "object",
    "group": "object",
    "group_size": "int64",
    "peer": "int64",
    "inter": "bool",
    "algorithm": "object",
    "bytes": "int64",
    "bytes_sent": "float64",
    "bytes_received": "float64",
    "start_s": "float64",
    "wait_s": "float64",
    "end_s": "float64",
    "modeled_s": "float64",
    "phase": "object",
    "unit": "int64",
}
KINDS = ("compute", "collective", "step", "mark")
UNIT_BACKWARD = "unit_backward"  # mark op: one FSDP2 unit's backward ended
BACKWARD = "backward"  # mark op: the whole backward returned
TRAIN = "train"  # the training loop: the only phase the model replays and the runs count
EVAL = "eval"  # evaluation: recorded, but kept out of training figures
_REQUIRED = (
    "rank",
    "step",
    "kind",
    "op",
    "group",
    "inter",
    "algorithm",
    "bytes",
    "bytes_sent",
    "bytes_received",
    "start_s",
    "end_s",
)


def _group_key(ranks: Iterable[int]) -> str:
    """Canonical string for a group of global ranks, e.g. "0,2" (sorted, comma separated)."""
    return ",".join(str(int(r)) for r in sorted(ranks))


def empty_trace() -> pd.DataFrame:
    """A trace with the schema's columns and no rows."""
    return pd.DataFrame({c: pd.Series(dtype=t) for c, t in TRACE_COLUMNS.items()})


class TraceRecorder:
    """Collects one rank's collectives, compute intervals and step spans; thread-safe."""

    def __init__(
        self,
        rank: int,
        topology: Topology | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank {rank!r} must be a non-negative integer.")
        self.rank = rank
        self.topology = topology
        self._t0 = time.perf_counter()
        self.clock: Callable[[], float] = clock or (lambda: time.perf_counter() - self._t0)
        self.step = 0
        self.phase = TRAIN
        self._step_start: float | None = None
        self._rows: list[dict] = []
        self._lock = threading.Lock()
        self._seq = 0
        self._unit = -1  # the FSDP2 unit whose backward ended last, within this backward

    # Layout of this rank; without a topology every rank counts as its own node.
    def _where(self) -> tuple[int, int]:
        if self.topology is None:
            return self.rank, 0
        return self.topology.node_of(self.rank), self.topology.local_of(self.rank)

    def _append(self, row: dict) -> dict:
        node, local = self._where()
        with self._lock:
            full = {
                "rank": self.rank,
                "node": node,
                "local": local,
                "step": self.step,
                "seq": self._seq,
                "kind": "compute",
                "op": "",
                "group": "",
                "group_size": 0,
                "peer": -1,
                "inter": False,
                "algorithm": "",
                "bytes": 0,
                "bytes_sent": 0.0,
                "bytes_received": 0.0,
                "start_s": math.nan,
                "wait_s": math.nan,
                "end_s": math.nan,
                "modeled_s": math.nan,
                "phase": self.phase,
                "unit": self._unit,
            }
            full.update(row)
            self._seq += 1
            self._rows.append(full)
        return full

    def begin_step(self, step: int, phase: str = TRAIN) -> None:
        """Start step `step` of `phase`: later records carry this step number and phase."""
        self.set_phase(phase)
        self.step = int(step)
        self._unit = -1
        self._step_start = self.clock()

    def set_phase(self, phase: str) -> None:
        """Label later records with `phase` (e.g. "eval" after a training step), step unchanged."""
        if not isinstance(phase, str) or not phase:
            raise ValueError(f'trace phase {phase!r} must be a non-empty name such as "eval".')
        self.phase = phase

    def end_step(self, step: int) -> None:
        """Close step `step`, recording its span as a kind="step" row."""
        if int(step) != self.step or self._step_start is None:
            raise ValueError(f"end_step({step!r}) does not match the open step {self.step!r}.")
        self._append({"kind": "step", "start_s": self._step_start, "end_s": self.clock()})
        self._step_start = None

    def mark_unit_backward(self, unit: int) -> None:
        """Record that FSDP2 unit `unit` finished its backward: later collectives belong to it."""
        if isinstance(unit, bool) or not isinstance(unit, int) or unit < 0:
            raise ValueError(f"FSDP2 unit {unit!r} must be a non-negative integer.")
        now = self.clock()
        with self._lock:
            self._unit = unit
        self._append({"kind": "mark", "op": UNIT_BACKWARD, "start_s": now, "end_s": now})

    def mark_backward(self) -> None:
        """Record that the whole backward returned: later collectives belong to no unit."""
        now = self.clock()
        with self._lock:
            self._unit = -1
        self._append({"kind": "mark", "op": BACKWARD, "start_s": now, "end_s": now})

    def record_collective(
        self,
        op: str,
        group: Iterable[int],
        inter: bool,
        algorithm: str,
        nbytes: int,
        bytes_sent: float,
        bytes_received: float,
        start: float,
        end: float = math.nan,
        wait: float = math.nan,
        modeled: float = math.nan,
        peer: int = -1,
    ) -> dict:
        """Record one collective or message of this rank; returns the row to fill in later.

        `peer` is the global rank at the other end of a send or recv (-1 for collectives).
        """
        ranks = list(group)
        return self._append(
            {
                "kind": "collective",
                "op": op,
                "group": _group_key(ranks),
                "group_size": len(ranks),
                "peer": int(peer),
                "inter": bool(inter),
                "algorithm": algorithm,
                "bytes": int(nbytes),
                "bytes_sent": float(bytes_sent),
                "bytes_received": float(bytes_received),
                "start_s": float(start),
                "wait_s": float(wait),
                "end_s": float(end),
                "modeled_s": float(modeled),
            }
        )

    def complete(self, row: dict, wait: float, end: float, modeled: float = math.nan) -> None:
        """Fill in when a recorded collective was waited on and when it returned."""
        with self._lock:
            row["wait_s"], row["end_s"], row["modeled_s"] = float(wait), float(end), float(modeled)

    def frame(self) -> pd.DataFrame:
        """All rows so far as a DataFrame with the trace schema."""
        with self._lock:
            rows = [dict(r) for r in self._rows]
        if not rows:
            return empty_trace()
        df = pd.DataFrame(rows, columns=list(TRACE_COLUMNS))
        return df.astype(TRACE_COLUMNS)



def validate_trace(df: pd.DataFrame) -> pd.DataFrame:
    """Check a trace against the schema and return it with schema dtypes; ValueError if corrupt."""
    if not isinstance(df, pd.DataFrame):
        raise ValueError(f"trace must be a pandas DataFrame, not {type(df).__name__}.")
    missing = [c for c in _REQUIRED if c not in df.columns]
    if missing:
        raise ValueError(f"trace is missing the columns {missing}; see netsim.trace.TRACE_COLUMNS.")
    if df.empty:
        raise ValueError("trace has no rows; record at least one step before simulating.")
    df = _fill_derived(df.copy())
    bad_kinds = set(df["kind"].unique()) - set(KINDS)
    if bad_kinds:
        raise ValueError(
            f"trace has unknown kinds {sorted(map(str, bad_kinds))}; allowed: {KINDS}."
        )
    try:
        df = df[list(TRACE_COLUMNS)].astype(TRACE_COLUMNS)
    except (TypeError, ValueError) as err:
        raise ValueError(f"trace columns do not have the schema's types ({err}).") from None
    _check_times(df)
    return df


def _fill_derived(df: pd.DataFrame) -> pd.DataFrame:
    """Fill the columns hand-made and older traces may lack, the way the recorder would."""
    if "node" not in df.columns:
        df["node"] = df["rank"]
    if "local" not in df.columns:
        df["local"] = 0
    if "seq" not in df.columns:
        df["seq"] = range(len(df))
    if "group_size" not in df.columns:
        df["group_size"] = [len(str(g).split(",")) if str(g) else 0 for g in df["group"]]
    if "peer" not in df.columns:
        df["peer"] = -1  # older traces did not name a message's other end
    for col in ("wait_s", "modeled_s"):
        if col not in df.columns:
            df[col] = math.nan
    if "unit" not in df.columns:
        df["unit"] = -1  # older traces recorded no FSDP2 units (and no marks)
    if "phase" not in df.columns:
        # Before the phase column, evaluation traffic was recorded as step 0.
        df["phase"] = [EVAL if s == 0 else TRAIN for s in df["step"]]
    return df


def _check_times(df: pd.DataFrame) -> None:
    """Raise ValueError for rows whose times, ranks or sizes cannot be right."""
    timed = df["kind"] != "collective"
    if df.loc[timed, ["start_s", "end_s"]].isna().any().any():
        raise ValueError("trace has compute or step rows without start_s/end_s times.")
    coll = df[~timed]
    if coll["start_s"].isna().any():
        raise ValueError("trace has collective rows without a start_s time.")
    done = coll.dropna(subset=["end_s"])
    if (done["end_s"] < done["start_s"] - 1e-9).any():
        raise ValueError("trace has rows whose end_s is before start_s.")
    if (df["rank"] < 0).any() or (df["bytes"] < 0).any():
        raise ValueError("trace has negative ranks or byte counts.")


def load_trace(path: str | os.PathLike) -> pd.DataFrame:
    """Read and validate a trace.parquet; ValueError if it is missing or unreadable."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"trace file {str(path)!r} does not exist.")
    try:
        df = pd.read_parquet(path)
    except Exception as err:  # pyarrow raises several types for a damaged file
        raise ValueError(f"trace file {str(path)!r} is not readable parquet ({err}).") from None
    return validate_trace(df)


_PER_STEP = ("inter_bytes_sent", "inter_bytes_received", "inter_calls", "intra_bytes", "comm_s")


def _covered(coll: pd.DataFrame) -> pd.Series:
    """Seconds each op adds to the union of its rank's inter-node op spans within a step."""
    inter = coll[coll["inter"].astype(bool)]
    start = inter["start_s"]
    end = inter["end_s"].fillna(start)  # never returned: no span, as before
    order = pd.DataFrame({"step": inter["step"], "rank": inter["rank"], "start": start,
                          "end": end}).sort_values(["step", "rank", "start"], kind="stable")
    keys = [order["step"], order["rank"]]
    # How far the earlier ops of the same (step, rank) already reach: only time past it is new.
    reach = order.groupby(keys)["end"].cummax().groupby(keys).shift(fill_value=-math.inf)
    added = (order["end"] - order["start"].where(order["start"] > reach, reach)).clip(lower=0.0)
    return added.reindex(coll.index, fill_value=0.0)


def waited_after_step(coll: pd.DataFrame, spans: pd.DataFrame) -> np.ndarray:
    """Which of the collectives `coll` were issued inside their step and waited on after it.

    `spans` are the trace's kind "step" rows. A method that overlaps its exchange with the next
    step (flexdemo-async) does this; ops issued outside their step's span (hand-made traces may
    time ops on another clock) and traces without step rows have none.
    """
    if spans.empty or coll.empty:
        return np.zeros(len(coll), dtype=bool)
    own = spans.set_index(["rank", "step"])[["start_s", "end_s"]].reindex(
        pd.MultiIndex.from_arrays([coll["rank"], coll["step"]]))
    begin, end = own["start_s"].to_numpy(), own["end_s"].to_numpy()
    issue = coll["start_s"].to_numpy()
    return ((issue >= begin - 1e-9) & (issue <= end + 1e-9)
            & (coll["wait_s"].to_numpy() > end + 1e-9))


def _as_waited(inter: pd.DataFrame, train: pd.DataFrame) -> pd.DataFrame:
    """Inter-node ops as their communication time counts: in their own step, or where waited.

    An op waited on after its own step ended (a method that overlaps its exchange with the next
    step, flexdemo-async) spent the time from its issue to that wait beside compute: only its
    blocked time, wait to return, counts, in the step of the same rank whose span holds the
    wait (none after the last step: a drain is off the training clock). Ops waited on within
    their step, ops not issued inside their step's span and traces without step rows are taken
    as they are.
    """
    spans = train[train["kind"] == "step"]
    late = waited_after_step(inter, spans)
    if not late.any():
        return inter
    out = inter.copy()
    rows = out.index[late]
    out.loc[rows, "start_s"] = out.loc[rows, "wait_s"]
    for rank, mine in out.loc[rows].groupby("rank"):
        ranked = spans[spans["rank"] == rank].sort_values("start_s")
        at = ranked["start_s"].searchsorted(mine["wait_s"].to_numpy(), side="right") - 1
        held = [i >= 0 and w <= ranked["end_s"].iloc[i] + 1e-9
                for i, w in zip(at, mine["wait_s"], strict=True)]
        out.loc[mine.index, "step"] = [int(ranked["step"].iloc[i]) if ok else -1
                                       for i, ok in zip(at, held, strict=True)]
    return out[out["step"] >= 0]


def comm_per_step(trace: pd.DataFrame) -> pd.DataFrame:
    """Communication of each training step: the one per-step summary of a trace.

    Takes one rank's frame or a combined trace (all ranks' frames concatenated) and returns one
    row per training step with `inter_bytes_sent`, `inter_bytes_received` and `intra_bytes`
    (wire bytes sent, summed over the trace's ranks), and `inter_calls` and `comm_s` (inter-node
    collectives, and the seconds in which at least one of them was between its issue and its
    return) of the busiest rank. Ops in flight together count once: gossip's concurrent
    messages to its neighbours take the span of the slowest, not the sum of all. An op waited
    on in a later step counts there, wait to return only (`_as_waited`). Only phase
    "train" counts (a trace older than the phase column reads as `validate_trace` reads it); a
    step without collectives has zeros.
    """
    if "phase" not in trace.columns:
        trace = _fill_derived(trace.copy())
    train = trace[trace["phase"] == TRAIN]
    coll = train[train["kind"] == "collective"]
    inter = coll["inter"].astype(bool)
    per_rank = coll.assign(
        inter_bytes_sent=coll["bytes_sent"].where(inter, 0.0),
        inter_bytes_received=coll["bytes_received"].where(inter, 0.0),
        inter_calls=inter.astype("int64"),
        intra_bytes=coll["bytes_sent"].where(~inter, 0.0),
    ).groupby(["step", "rank"])[list(_PER_STEP[:-1])].sum()
    # Bytes and calls belong to the step that issued them; time to the step that waited.
    waited = _as_waited(coll[inter], train)
    comm = _covered(waited).groupby([waited["step"], waited["rank"]]).sum().rename("comm_s")
    per_rank = per_rank.join(comm, how="outer").fillna(0.0)
    per_step = per_rank.groupby(level="step").agg(
        inter_bytes_sent=("inter_bytes_sent", "sum"),
        inter_bytes_received=("inter_bytes_received", "sum"),
        inter_calls=("inter_calls", "max"),
        intra_bytes=("intra_bytes", "sum"),
        comm_s=("comm_s", "max"),
    )
    steps = pd.Index(sorted(train["step"].unique()), name="step", dtype="int64")
    per_step = per_step.reindex(steps, fill_value=0)
    return per_step.astype({c: "float64" for c in _PER_STEP if c != "inter_calls"}).astype(
        {"inter_calls": "int64"}
    ).reset_index()


def compute_outside_collectives(trace: pd.DataFrame) -> pd.Series:
    """Per step, the slowest rank's time outside collectives, as the trace recorded it.

    Each rank's step span minus the spans of its collectives (spans issued and waited at once
    do not overlap): what a replay of that trace takes as compute.
    """
    steps = trace[trace["kind"] == "step"].set_index(["step", "rank"])
    span = steps["end_s"] - steps["start_s"]
    ops = trace[trace["kind"] == "collective"]
    blocked = (ops["end_s"] - ops["start_s"]).groupby([ops["step"], ops["rank"]]).sum()
    compute = span.sub(blocked.reindex(span.index, fill_value=0.0))
    return compute.groupby(level="step").max()
