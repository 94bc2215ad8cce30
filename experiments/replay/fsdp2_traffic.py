"""FSDP2's intra-node traffic added to a recording of one rank per node, for a replay of more.

A rank alone in its node has nothing to shard with: its trace holds no intra-node collective.
At G > 1 ranks per node FSDP2 (as `flexdemo.hsdp.parallelize` sets it up: every block its own
unit, resharded after forward; the root unit kept gathered through the backward) issues, per
rank and training step:

- in the forward, an all-gather of each unit's shard (the root's first, then every block's);
- in the backward, an all-gather of each block's shard before its backward (the root's stays);
- after each unit's backward, a reduce-scatter of its gradients (input: G shards).

`add_fsdp2_traffic` writes these ops into the trace as a recording of the target shape would
hold them: forward all-gathers at the step's start, a block's backward all-gather just before
its "unit_backward" mark, its reduce-scatter just after; everything later moves by their time,
so no recorded compute is lost. Their bytes are those of the recording's one-rank shards (the
whole unit), which `reshard.reshard_trace` resizes for G exactly; their time is the collective
on the given link (`netsim.costs`), what the model also charges with intra="model". A trace
without "unit_backward" marks cannot place them: it is refused (ValueError, one sentence).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from experiments.replay.reshard import shard_elements
from netsim import Link
from netsim.costs import collective_volume, default_algorithm
from netsim.trace import TRAIN, UNIT_BACKWARD

__all__ = ["add_fsdp2_traffic", "fsdp2_note"]

_ITEMSIZE = 4  # bytes of an fp32 parameter: parallelize sets no mixed precision
# Order of an inserted op against a recorded row at the same moment: before it, or after it.
_BEFORE, _ROW, _AFTER = -1, 0, 1
_TIMES = ("start_s", "wait_s", "end_s")
# A moment and its order, compared as a pair (time first) when sorting and searching.
_KEY = [("t", float), ("o", int)]


def _one_op(rank: int, step: int, op: str, unit: int, nbytes: int, seconds: float, at: float,
            order: int, backend: str) -> dict:
    """An inserted op, waited on at once, as CPU gloo does (its times are set later)."""
    return {"rank": rank, "step": step, "kind": "collective", "op": op, "group": str(rank),
            "group_size": 1, "peer": -1, "inter": False,
            "algorithm": default_algorithm(op, backend), "bytes": nbytes, "bytes_sent": 0.0,
            "bytes_received": 0.0, "modeled_s": np.nan, "phase": TRAIN, "unit": unit,
            "_at": at, "_order": order, "_seconds": seconds}


def _unit_ops(units: list, g_new: int, link: Link) -> list[tuple[int, float, float]]:
    """Per unit: (recorded bytes, all-gather seconds, reduce-scatter seconds) at g_new."""
    out = []
    for unit in units:
        whole = sum(shard_elements(s, 1) for s in unit) * _ITEMSIZE
        shard = sum(shard_elements(s, g_new) for s in unit) * _ITEMSIZE
        gather = collective_volume("all_gather", g_new, shard).time(link)
        scatter = collective_volume("reduce_scatter", g_new, shard * g_new).time(link)
        out.append((whole, gather, scatter))
    return out


def _inserted(trace: pd.DataFrame, units: list, g_new: int, link: Link,
              backend: str) -> list[dict]:
    """The FSDP2 ops of every rank's training steps, at their recorded moments."""
    sizes = _unit_ops(units, g_new, link)
    root = len(units) - 1  # shard_layout lists the blocks inner first, the root last
    train = trace[trace["phase"] == TRAIN]
    rows: list[dict] = []
    for row in train[train["kind"] == "step"].itertuples():
        rank, step, begin = int(row.rank), int(row.step), float(row.start_s)
        for unit in [root, *range(root)]:  # forward: the root's parameters first
            nbytes, gather, _ = sizes[unit]
            rows.append(_one_op(rank, step, "all_gather", -1, nbytes, gather, begin, _AFTER,
                                backend))
    marks = train[(train["kind"] == "mark") & (train["op"] == UNIT_BACKWARD)]
    for row in marks.itertuples():
        rank, step, unit, at = int(row.rank), int(row.step), int(row.unit), float(row.start_s)
        nbytes, gather, scatter = sizes[unit]
        if unit != root:
            rows.append(_one_op(rank, step, "all_gather", -1, nbytes, gather, at, _BEFORE,
                                backend))
        rows.append(_one_op(rank, step, "reduce_scatter", unit, nbytes, scatter, at, _AFTER,
                            backend))
    return rows


def add_fsdp2_traffic(trace: pd.DataFrame, units: list, g_new: int, link: Link,
                      backend: str = "gloo") -> pd.DataFrame:
    """A one-rank-per-node `trace` with FSDP2's intra-node ops at `g_new` ranks per node added.

    `units` is the run's FSDP2 layout (`reshard.run_layout`); each op takes its time on `link`
    and every recorded moment after it moves by that much (module docstring). ValueError (one
    sentence) for a trace of more than one rank per node or without "unit_backward" marks.
    """
    if int(trace["local"].max()) != 0:
        raise ValueError("FSDP2's intra-node traffic is added only to a recording of one rank "
                         "per node; this one has more, and its own.")
    train = trace[trace["phase"] == TRAIN]
    if not ((train["kind"] == "mark") & (train["op"] == UNIT_BACKWARD)).any():
        raise ValueError('the trace has no "unit_backward" marks to place FSDP2\'s reduce-'
                         "scatters at (recorded before runs marked them); record it again.")
    added = pd.DataFrame(_inserted(trace, units, g_new, link, backend))
    shifted = trace.copy()
    for rank, ops in added.groupby("rank"):
        ops = ops.sort_values(["_at", "_order"], kind="stable")
        keys = np.array(list(zip(ops["_at"], ops["_order"], strict=True)), dtype=_KEY)
        done = np.concatenate([[0.0], np.cumsum(ops["_seconds"].to_numpy())])
        mine = shifted["rank"] == rank
        for column in _TIMES:  # a recorded moment moves by every op inserted before it
            times = shifted.loc[mine, column].to_numpy()
            before = np.searchsorted(keys, np.array([(t, _ROW) for t in times], dtype=_KEY))
            shifted.loc[mine, column] = times + done[before]
        # An op ends where the next one inserted at its moment starts, and where the recorded
        # row after it now starts, exactly: start + seconds could round one ulp off either, and
        # the replay would see a gap (a compute item) that only some nodes' programs hold.
        at = ops["_at"].to_numpy()
        start = at + done[:-1]
        added.loc[ops.index, "start_s"] = start
        added.loc[ops.index, "wait_s"] = start
        added.loc[ops.index, "end_s"] = at + done[1:]
    added = added.drop(columns=["_at", "_order", "_seconds"])
    added["node"], added["local"], added["seq"] = added["rank"], 0, -1
    merged = pd.concat([shifted, added[shifted.columns]], ignore_index=True)
    merged = merged.sort_values(["rank", "step", "start_s"], kind="stable", ignore_index=True)
    merged["seq"] = merged.groupby("rank").cumcount()
    return merged


def fsdp2_note(g_new: int, link: Link) -> str:
    """The payload rule line of a replay that added FSDP2's intra-node traffic."""
    return (f"the recording has one rank per node: FSDP2's intra-node traffic at {g_new} ranks "
            "per node added from the layout (per step an all-gather of every unit in the "
            "forward, of every block before its backward, a reduce-scatter after each unit's "
            f"backward), each timed on the intra link ({link.bandwidth * 8 / 1e9:.4g} Gbit/s, "
            f"{link.latency * 1e6:.3g} us a message)")
