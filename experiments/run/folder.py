"""A run's folder: checked before training, built beside OUT, committed by one rename.

OUT holds `steps.parquet`, `trace.parquet` and `run.json` (docs/interfaces.md). While a run is in
flight, its working folder `.OUT.partial-PID/` sits beside OUT and holds everything the ranks
share on this machine: the rendezvous file, one progress file and one result per rank, netsim's
NIC files, and `out/`, where the results are assembled. Only a finished run is renamed to OUT;
the working folder of a run whose launcher died is removed by the next launch into the same OUT.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from experiments.config import RunConfig
from experiments.errors import ConfigError
from experiments.io import check_output_folder, provenance
from netsim.processes import pid_alive
from netsim.trace import TRAIN, comm_per_step

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["PROFILE_DIR", "PROFILE_SUFFIX", "RankResult", "RunFolder", "read_rank_result",
           "write_emulated_run", "write_rank_result", "write_run"]

PROFILE_DIR = "profile"  # OUT's folder of torch.profiler traces (run --profile)
PROFILE_SUFFIX = ".pt.trace.json.gz"  # torch.profiler's and torchtitan's name for a trace


@dataclass
class RankResult:
    """What one rank hands back at the end of a run."""

    rank: int
    config: dict[str, Any]  # the run's config with every default filled in
    steps: list[dict[str, Any]] = field(default_factory=list)
    trace: Any = None  # pandas DataFrame from netsim's recorder
    params: int = 0
    diverged_step: int | None = None  # first step whose loss was not finite, on any rank
    layout: list | None = None  # FSDP2 units' parameter shapes (flexdemo.shard_layout), if sharded
    profile: bytes | None = None  # the rank's torch.profiler trace, gzipped JSON (run --profile)


class RunFolder:
    """OUT and the working folder beside it that a run builds its results in."""

    def __init__(self, out: Path | str, work: Path | str | None = None):
        """`work` defaults to this process's `.OUT.partial-PID` beside OUT."""
        self.out = Path(out)
        default = self.out.parent / f".{self.out.name}.partial-{os.getpid()}"
        self.work = Path(work) if work else default
        self.keep = False  # set when the results could not be assembled: discard() keeps them
        self.code: dict[str, Any] = {}
        """The versions and git state when the run started (`create`): the code it imported."""

    @property
    def build(self) -> Path:
        """Where the results are assembled before the rename to OUT."""
        return self.work / "out"

    @property
    def store(self) -> Path:
        """The rendezvous file of spawned ranks (a FileStore: no socket open to other hosts)."""
        return self.work / "store"

    def progress(self, rank: int) -> Path:
        """The file a rank's heartbeat rewrites at every step."""
        return self.work / f"progress-{rank}"

    def create(self) -> RunFolder:
        """Check OUT (no other live run writing it), remove dead launchers' working folders,
        make ours."""
        check_output_folder(self.out)
        live = [pid for _, pid in self._others() if pid_alive(pid)]
        if live:
            raise ConfigError(f"another run (pid {live[0]}) is writing {str(self.out)!r} now; "
                              "wait for it or choose another --out.")
        self.remove_dead()
        try:
            self.work.mkdir(parents=True)
        except OSError as err:
            raise ConfigError(f"output folder {str(self.out)!r} cannot be written: "
                              f"{err.strerror}.") from None
        # Taken now, not when run.json is written: a commit made while a long run trains is
        # not the code it runs.
        self.code = {k: v for k, v in provenance().items()
                     if k in ("versions", "git_commit", "git_dirty")}
        return self

    def remove_dead(self) -> None:
        """Remove the working folders beside OUT of launchers that are gone (a live one's stays)."""
        for other, pid in self._others():
            if not pid_alive(pid):
                shutil.rmtree(other, ignore_errors=True)

    def _others(self) -> Iterator[tuple[Path, int]]:
        """Other launchers' working folders for OUT, with their pids."""
        for other in self.out.parent.glob(f".{self.out.name}.partial-*"):
            pid = other.name.rpartition("-")[2]
            if other != self.work and pid.isdigit():
                yield other, int(pid)

    def commit(self) -> Path:
        """Rename the assembled results to OUT and remove the working folder."""
        if self.out.exists():
            self.out.rmdir()  # empty: checked before the run
        os.replace(self.build, self.out)
        self.discard()
        return self.out

    def discard(self) -> None:
        """Remove the working folder and everything in it (unless `keep` says it holds results)."""
        if not self.keep:
            shutil.rmtree(self.work, ignore_errors=True)


def write_rank_result(result: RankResult, folder: Path) -> None:
    """A rank's records as files in the working folder (the launcher reads them back)."""
    import pandas as pd

    stem = folder / f"rank{result.rank}"
    pd.DataFrame(result.steps).to_parquet(f"{stem}.steps.parquet", index=False)
    if result.trace is not None:
        result.trace.to_parquet(f"{stem}.trace.parquet", index=False)
    if result.profile is not None:
        Path(f"{stem}{PROFILE_SUFFIX}").write_bytes(result.profile)
    meta = {"rank": result.rank, "config": result.config, "params": result.params,
            "diverged_step": result.diverged_step, "layout": result.layout}
    Path(f"{stem}.json.tmp").write_text(json.dumps(meta))
    os.replace(f"{stem}.json.tmp", f"{stem}.json")  # written last: its presence means complete


def read_rank_result(folder: Path, rank: int) -> RankResult:
    """The RankResult that `write_rank_result` left in `folder` for `rank`."""
    import pandas as pd

    stem = folder / f"rank{rank}"
    meta = json.loads(Path(f"{stem}.json").read_text())
    trace_file = Path(f"{stem}.trace.parquet")
    profile = Path(f"{stem}{PROFILE_SUFFIX}")
    return RankResult(
        rank=rank, config=meta["config"], params=meta["params"],
        diverged_step=meta["diverged_step"], layout=meta.get("layout"),
        steps=pd.read_parquet(f"{stem}.steps.parquet").to_dict("records"),
        trace=pd.read_parquet(trace_file) if trace_file.exists() else None,
        profile=profile.read_bytes() if profile.exists() else None,
    )


def write_run(results: list[RankResult], folder: Path,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """steps.parquet, trace.parquet and run.json (plus `extra` entries) from every rank's result."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = RunConfig.from_dict(results[0].config)
    steps, trace = _steps_and_trace(results, cfg)
    steps.to_parquet(folder / "steps.parquet", index=False)
    trace.to_parquet(folder / "trace.parquet", index=False)
    _write_profiles(results, folder)
    meta = _run_meta(results, cfg, steps, extra)
    (folder / "run.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return meta


def _write_profiles(results: list[RankResult], folder: Path) -> None:
    """Each rank's torch.profiler trace (run --profile) as OUT/profile/rankR.pt.trace.json.gz."""
    profiled = [r for r in results if r.profile is not None]
    if not profiled:
        return
    (folder / PROFILE_DIR).mkdir()
    for result in profiled:
        (folder / PROFILE_DIR / f"rank{result.rank}{PROFILE_SUFFIX}").write_bytes(result.profile)


def write_emulated_run(results: list[RankResult], folder: Path,
                       extra: dict[str, Any]) -> dict[str, Any]:
    """steps.parquet and run.json of an emulated run: no trace, no time, no byte counts.

    Its steps table has the real run's loss columns; wall_time_s and compute_s are NaN (nothing
    was timed), and run.json's train_time_s and byte totals are None.
    """
    folder.mkdir(parents=True, exist_ok=True)
    cfg = RunConfig.from_dict(results[0].config)
    steps = _steps(results)
    steps["compute_s"] = math.nan
    steps = steps.drop(columns="step_s")
    steps.to_parquet(folder / "steps.parquet", index=False)
    meta = _run_meta(results, cfg, steps, extra)
    meta.update(train_time_s=None, inter_bytes_per_step=None, intra_bytes_per_step=None)
    (folder / "run.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return meta


def _steps(results: list[RankResult]) -> pd.DataFrame:
    """One row a step: the ranks' records combined (losses averaged, the slowest rank's time)."""
    import pandas as pd

    per_rank = pd.concat(
        [pd.DataFrame(r.steps).assign(rank=r.rank) for r in results], ignore_index=True
    )
    if "graph" not in per_rank:  # results of a rank that predates the column
        per_rank["graph"] = None
    steps = per_rank.groupby("step").agg(
        wall_time_s=("wall_time_s", "max"),  # a synchronous step ends when its slowest rank does
        loss=("loss", "mean"),
        val_loss=("val_loss", "mean"),
        step_s=("step_s", "max"),
        # Every rank computed the same totals at an evaluation (NaN between evaluations).
        replica_variance=("replica_variance", "mean"),
        consensus_distance=("consensus_distance", "mean"),
        # The gossip graph of the step's round: all ranks gossip on the same one (Ada agrees
        # on it); a string, so taken, not averaged. Missing for methods without a graph.
        graph=("graph", "first"),
    ).reset_index()
    # Strings, missing where a step has no graph: astype("str") alone turns None into the
    # string "None" on pandas 2 (pandas 3's str dtype keeps it missing).
    graph = steps["graph"]
    steps["graph"] = graph.astype("str").where(graph.notna())
    return steps


def _steps_and_trace(results: list[RankResult],
                     cfg: RunConfig) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The run's steps table (one row a step, its communication per node) and training trace."""
    import pandas as pd

    steps = _steps(results)
    trace = pd.concat([r.trace for r in results if r.trace is not None], ignore_index=True)
    trace = trace[trace["phase"] == TRAIN]  # evaluation traffic is measured apart
    comm = comm_per_step(trace)
    steps = steps.merge(comm, on="step", how="left").fillna(
        {c: 0.0 for c in comm.columns if c != "step"}
    )
    for col in ("inter_bytes_sent", "inter_bytes_received", "intra_bytes"):
        steps[col] = steps[col] / cfg.nodes  # per node
    steps["compute_s"] = (steps["step_s"] - steps["comm_s"]).clip(lower=0.0)
    return steps.drop(columns="step_s"), trace


def _run_meta(results: list[RankResult], cfg: RunConfig, steps: pd.DataFrame,
              extra: dict[str, Any] | None) -> dict[str, Any]:
    """run.json's entries: the config, the outcome, totals, provenance, then `extra`."""
    final = steps["val_loss"].dropna()
    diverged = [r.diverged_step for r in results if r.diverged_step is not None]
    final_loss = float(final.iloc[-1]) if len(final) else None
    return {
        "config": cfg.to_dict(),
        "world_size": cfg.world_size,
        "params": results[0].params,
        # What re-sharding on replay needs: the sizes FSDP2 shards (None: the method does not).
        "layout": results[0].layout,
        "status": "diverged" if diverged else "done",
        "diverged_step": min(diverged) if diverged else None,
        # A diverged run has no final loss, even when its last evaluation came before the loss
        # stopped being finite (JSON has no NaN either).
        "final_val_loss": final_loss if not diverged and final_loss is not None
        and math.isfinite(final_loss) else None,
        "train_time_s": float(steps["wall_time_s"].iloc[-1]),
        # An emulated run counts no bytes (write_emulated_run): None there.
        "inter_bytes_per_step": _mean(steps, "inter_bytes_sent"),
        "intra_bytes_per_step": _mean(steps, "intra_bytes"),
        **provenance(),
        **(extra or {}),
    }


def _mean(steps: pd.DataFrame, column: str) -> float | None:
    """The mean of a steps column, None where the table has no such column."""
    return float(steps[column].mean()) if column in steps else None
