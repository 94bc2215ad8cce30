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
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.errors import ConfigError, Stopped
from experiments.io import write_atomic

EXECUTORS = ("local", "slurm", "debug")

Launcher = Callable[..., Any]

__all__ = ["EXECUTORS", "Job", "UnitResult", "check_reachable", "execute", "run_unit"]

STOPPED = "stopped by SIGTERM (scancel or preemption): it stays pending, to run again on resume"


@dataclass
class Job:
    """One unit to run: its id, its RunConfig as a dict, and the directory launch() fills."""

    unit_id: str
    config: dict[str, Any]
    out_dir: Path
    failure_path: Path
    emulated: bool = False
    """Trained by `experiments.run.emulate.emulate` (one process) instead of the launcher."""


@dataclass
class UnitResult:
    """What came of one unit: ok, the error that failed it, or stopped (left pending)."""

    unit_id: str
    ok: bool
    error: str | None = None
    seconds: float = 0.0
    stopped: bool = False


def check_reachable(kind: str) -> None:
    """Refuse the slurm executor, in one sentence, when no Slurm controller answers here."""
    if kind != "slurm":
        return
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        raise ConfigError("--executor slurm needs Slurm's client programs (sbatch, sinfo) on "
                          "PATH and there are none; install Slurm (Debian: slurm-wlm) or use "
                          "--executor local.")
    try:
        # sinfo alone retries an absent config file for a minute; a live controller answers at once.
        done = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True,
                              timeout=20)
    except subprocess.TimeoutExpired:
        done = subprocess.CompletedProcess([], 1, "", "no answer in 20 s")
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or ["no message"])[-1].strip()
        raise ConfigError(f"--executor slurm: no Slurm controller answers here (sinfo: "
                          f"{said.removeprefix('sinfo: ')}); check SLURM_CONF or use "
                          "--executor local.")


def default_launcher() -> Launcher:
    """The real launcher, imported only when a unit actually runs."""
    from experiments.run.launch import launch

    return launch


def _emulator() -> Launcher:
    """The emulator, for emulated units: a launcher's signature, one process."""
    from experiments.run.emulate import emulate

    return emulate


def run_unit(job: Job, timeout_s: float | None, launcher: Launcher | None = None) -> UnitResult:
    """Run one unit; on any crash or timeout write its failure record instead of raising."""
    launch = _emulator() if job.emulated else launcher or default_launcher()
    from experiments.config import RunConfig

    start = time.monotonic()
    out_dir = Path(job.out_dir)
    if _slurm_task_rank() > 0:
        # Every task of a multi-node job runs its rank; rank 0 alone writes and records. An
        # emulated unit is one process: rank 0's.
        if job.emulated:
            return UnitResult(job.unit_id, True, None, time.monotonic() - start)
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
        if _in_slurm_job():
            # The job was cancelled, not the sweep: tell the sweep, which goes on, and record
            # nothing, so the unit stays pending.
            return UnitResult(job.unit_id, False, STOPPED, time.monotonic() - start, stopped=True)
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
        log = _job_log()
        if log is not None:
            traceback.print_exc(file=sys.stderr)  # the whole story in the job's own log
            record["log"] = log
        write_atomic(job.failure_path, json.dumps(record, indent=2))
        return UnitResult(job.unit_id, False, message, time.monotonic() - start)
    Path(job.failure_path).unlink(missing_ok=True)  # a retry that worked supersedes the failure
    return UnitResult(job.unit_id, True, None, time.monotonic() - start)


def _in_slurm_job() -> bool:
    """Whether this process is a unit's job that submitit started on Slurm."""
    return os.environ.get("SUBMITIT_EXECUTOR") == "slurm"


def _job_log() -> str | None:
    """The path of this submitit job's error log, or None outside a submitit job."""
    if "SUBMITIT_EXECUTOR" not in os.environ:
        return None
    try:
        import submitit

        return str(submitit.JobEnvironment().paths.stderr)
    except Exception:  # an environment submitit cannot read: the record goes without it
        return None


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
    yield from _collect(list(zip(jobs, submitted, strict=True)), cluster == "slurm")


def _collect(waiting: list[tuple[Job, Any]], slurm: bool) -> Iterator[UnitResult]:
    """Yield each job's result as it ends, in the order they end.

    submitit learns that a job ended without a result (cancelled, killed) from sacct; a cluster
    without accounting answers it nothing, so the queue itself is read too: a job that has left
    squeue and wrote no result has ended, and scontrol still knows how.
    """
    gone: dict[str, int] = {}
    last_queue = 0.0
    while waiting:
        queue = None
        if slurm and time.monotonic() - last_queue > 5:
            queue, last_queue = _queued(), time.monotonic()
        for pair in list(waiting):
            job, handle = pair
            job_id = str(getattr(handle, "job_id", "?"))
            if queue is not None and job_id not in queue:
                gone[job_id] = gone.get(job_id, 0) + 1
            # Twice out of the queue: once may be the moment between submission and listing.
            ended = handle.done() or gone.get(job_id, 0) >= 2
            if ended:
                waiting.remove(pair)
                yield _outcome(job, handle, slurm)
        if waiting:
            time.sleep(1)


def _queued() -> set[str] | None:
    """Ids of the jobs Slurm still lists (every array task on its own), or None if unknown."""
    try:
        done = subprocess.run(["squeue", "-h", "-r", "-o", "%i"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return set(done.stdout.split()) if done.returncode == 0 else None


def _outcome(job: Job, handle: Any, slurm: bool) -> UnitResult:
    """The result a job left, or, when it left none, a failure record or (cancelled) pending."""
    try:
        return handle.result()
    except Exception as err:  # the job itself died (preempted, killed, lost node)
        job_id = getattr(handle, "job_id", "?")
        state = _slurm_state(str(job_id)) if slurm else ""
        if state.startswith("CANCELLED"):
            return UnitResult(job.unit_id, False, f"job {job_id} was cancelled: {STOPPED}",
                              stopped=True)
        first = (str(err).strip().splitlines() or [""])[0]
        message = f"job {job_id} failed{f' ({state})' if state else ''}: {type(err).__name__}: "
        record = {"unit": job.unit_id, "error": message + first}
        paths = getattr(handle, "paths", None)
        if paths is not None:
            record["log"] = str(paths.stderr)
        write_atomic(job.failure_path, json.dumps(record, indent=2))
        return UnitResult(job.unit_id, False, record["error"])


def _slurm_state(job_id: str) -> str:
    """A job's state from the controller (scontrol, then sacct), or "" when neither knows."""
    for argv in (["scontrol", "show", "job", "-o", job_id],
                 ["sacct", "-n", "-X", "-P", "-o", "State", "-j", job_id]):
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode != 0 or not done.stdout.strip():
            continue
        if argv[0] == "sacct":
            return done.stdout.split()[0]
        for word in done.stdout.split():
            if word.startswith("JobState="):
                return word.removeprefix("JobState=")
    return ""
