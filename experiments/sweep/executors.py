"""Where sweep units run: one at a time on this machine, or as Slurm jobs through submitit.

A unit is one `launch()` call. Locally units run strictly one after another, because a unit
already spawns nodes x gpus ranks and two at once would oversubscribe a small machine. With
submitit every pending unit becomes one job (a job array on Slurm); the job itself calls
`run_unit`, which records its own failure, so a job that dies on a remote node still leaves a
readable record behind on the shared file system.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.errors import Stopped
from experiments.io import write_atomic

EXECUTORS = ("local", "slurm", "debug")

Launcher = Callable[..., Any]

__all__ = ["EXECUTORS", "Job", "UnitResult", "execute", "run_unit"]


@dataclass
class Job:
    """One unit to run: its id, its RunConfig as a dict, and the directory launch() fills."""

    unit_id: str
    config: dict[str, Any]
    out_dir: Path
    failure_path: Path


@dataclass
class UnitResult:
    """What came of one unit: ok, or the error that stopped it."""

    unit_id: str
    ok: bool
    error: str | None = None
    seconds: float = 0.0


def default_launcher() -> Launcher:
    """The real launcher, imported only when a unit actually runs."""
    from experiments.run.launch import launch

    return launch


def run_unit(job: Job, timeout_s: float | None, launcher: Launcher | None = None) -> UnitResult:
    """Run one unit; on any crash or timeout write its failure record instead of raising."""
    launch = launcher or default_launcher()
    from experiments.config import RunConfig

    start = time.monotonic()
    out_dir = Path(job.out_dir)
    if _slurm_task_rank() > 0:
        # Every task of a multi-node job runs its rank; rank 0 alone writes and records.
        try:
            launch(RunConfig.from_dict(job.config), out_dir, timeout_s=timeout_s)
        except Exception as err:
            return UnitResult(job.unit_id, False, f"{type(err).__name__}: {err}")
        return UnitResult(job.unit_id, True, None, time.monotonic() - start)
    if out_dir.exists() and not (out_dir / "run.json").exists():
        # Leftover of a killed attempt: without run.json it is not a result, only debris.
        shutil.rmtree(out_dir)
    from experiments.run.folder import RunFolder

    # The build folders of killed launchers go; a live one's (another sweep's) stays.
    RunFolder(out_dir).remove_dead()
    try:
        kwargs: dict[str, Any] = {"timeout_s": timeout_s}
        if "quiet" in inspect.signature(launch).parameters:
            kwargs["quiet"] = True  # per-rank progress bars would drown the sweep's own bar
        launch(RunConfig.from_dict(job.config), out_dir, **kwargs)
        if not (out_dir / "run.json").exists():
            raise RuntimeError(f"the launcher returned but wrote no {out_dir / 'run.json'}")
    except Stopped:
        raise  # stopped from outside: the unit stays pending, to run again on resume
    except Exception as err:  # any crash of one unit must not stop the sweep
        message = f"{type(err).__name__}: {err}".strip()
        record = {
            "unit": job.unit_id,
            "error": message,
            "traceback": traceback.format_exc(limit=20),
            "seconds": time.monotonic() - start,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        write_atomic(job.failure_path, json.dumps(record, indent=2))
        return UnitResult(job.unit_id, False, message, time.monotonic() - start)
    Path(job.failure_path).unlink(missing_ok=True)  # a retry that worked supersedes the failure
    return UnitResult(job.unit_id, True, None, time.monotonic() - start)


def _slurm_task_rank() -> int:
    """In a multi-task Slurm job from submitit, export torchrun-style variables; return the rank.

    launch() then sees RANK / WORLD_SIZE / MASTER_ADDR and runs just this task's rank, which is
    how one unit spans several real nodes. Outside such a job this returns 0 and changes nothing.
    """
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm" or int(os.environ.get("SLURM_NTASKS", 1)) < 2:
        return 0
    from submitit.helpers import TorchDistributedEnvironment

    # Keep every GPU visible: the launcher picks the device from LOCAL_RANK itself.
    env = TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    return int(env.rank)


def execute(
    jobs: Sequence[Job],
    *,
    kind: str = "local",
    timeout_s: float | None = None,
    launcher: Launcher | None = None,
    folder: Path | None = None,
    params: dict[str, Any] | None = None,
) -> Iterator[UnitResult]:
    """Run jobs with the chosen executor, yielding each result as it is known."""
    if kind not in EXECUTORS:
        raise ValueError(f"unknown executor {kind!r}; choose one of {', '.join(EXECUTORS)}.")
    if kind == "local":
        for job in jobs:
            yield run_unit(job, timeout_s, launcher)
        return
    yield from _submitit(jobs, kind, timeout_s, launcher, folder, params or {})


def _submitit(
    jobs: Sequence[Job],
    kind: str,
    timeout_s: float | None,
    launcher: Launcher | None,
    folder: Path | None,
    params: dict[str, Any],
) -> Iterator[UnitResult]:
    """Submit every job through submitit (Slurm, or its in-process debug cluster) and collect."""
    import submitit

    if not jobs:
        return
    if folder is None:
        raise ValueError("the submitit executors need a folder for their logs.")
    cluster = "debug" if kind == "debug" else "slurm"
    executor = submitit.AutoExecutor(folder=folder, cluster=cluster)
    settings = dict(params)
    if timeout_s is not None:
        # The scheduler's limit leaves room for start-up; launch() enforces the real timeout.
        settings.setdefault("timeout_min", max(1, int(timeout_s // 60) + 5))
    if settings:
        executor.update_parameters(**settings)
    with executor.batch():
        submitted = [executor.submit(run_unit, job, timeout_s, launcher) for job in jobs]
    for job, handle in zip(jobs, submitted, strict=True):
        try:
            yield handle.result()
        except Exception as err:  # the job itself died (preempted, killed, lost node)
            message = f"job {getattr(handle, 'job_id', '?')} failed: {type(err).__name__}: {err}"
            record = {"unit": job.unit_id, "error": message}
            write_atomic(job.failure_path, json.dumps(record, indent=2))
            yield UnitResult(job.unit_id, False, message)
