"""`flexbench run`: launch the ranks of one run and write its results atomically.

On one machine the launcher spawns nodes x gpus-per-node ranks itself (gloo on CPU, one torch
thread each; nccl when there are enough GPUs). Under torchrun it runs the rank it is given:

    flexbench run --method flexdemo --nodes 2 --gpus-per-node 2 --steps 300 --out runs/flex
    torchrun --nnodes 2 --nproc-per-node 8 ... -m experiments.cli run --method flexdemo --nodes 2 \\
        --out runs/flex

Results land in OUT only when the run finished: rank 0 builds them in a sibling temp folder and
renames it. OUT/steps.parquet has one row per step (see docs/interfaces.md), OUT/trace.parquet
every collective and compute interval of every rank, OUT/run.json the full config, versions, git
commit and host.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
import tomllib
from datetime import timedelta
from pathlib import Path
from typing import Any

from experiments.config import ConfigError, RunConfig, parse_overrides

__all__ = ["launch", "RunFailed", "configure", "main", "load_config"]


class RunFailed(RuntimeError):
    """A run crashed or timed out; nothing was written to its output folder."""


def launch(cfg: RunConfig, out: Path | str, *, timeout_s: float | None = None,
           quiet: bool = False) -> Path:
    """Validate, run every rank of `cfg`, write OUT; on failure raise RunFailed, OUT untouched."""
    cfg.validate()
    out = Path(out)
    _check_out(out)
    if _under_torchrun():
        return _run_torchrun(cfg, out)
    return _run_spawned(cfg, out, timeout_s=timeout_s, quiet=quiet)


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"output folder {str(out)!r} already holds files; choose a new --out.")


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def _backend(cfg: RunConfig, local_ranks: int) -> str:
    import torch

    if cfg.backend != "auto":
        return cfg.backend
    enough_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks
    return "nccl" if enough_gpus else "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_spawned(cfg: RunConfig, out: Path, *, timeout_s: float | None, quiet: bool) -> Path:
    import torch.multiprocessing as mp

    tmp = _tmp_dir(out)
    backend = _backend(cfg, cfg.world_size)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    # forkserver imports torch and our modules once, then forks every rank from that warm
    # process: four cold interpreters would spend longer importing than a short run trains.
    mp.set_forkserver_preload(["experiments.train"])
    ctx = mp.start_processes(
        _spawned_rank, args=(cfg.to_dict(), backend, env, str(tmp), quiet),
        nprocs=cfg.world_size, join=False, start_method="forkserver",
    )
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=0.5):
            if deadline is not None and time.monotonic() > deadline:
                raise RunFailed(f"run timed out after {timeout_s:.0f} s")
    except mp.ProcessRaisedException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RunFailed(_last_line(str(err))) from None
    except mp.ProcessExitedException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RunFailed(f"a rank died: {err}") from None
    except BaseException:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _commit(tmp, out)


def _spawned_rank(rank: int, cfg_dict: dict, backend: str, env: dict, tmp: str, quiet: bool):
    import torch
    import torch.distributed as dist

    os.environ.update(env)
    cfg = RunConfig.from_dict(cfg_dict)
    torch.set_num_threads(cfg.threads_per_rank)
    if quiet:
        os.environ["TQDM_DISABLE"] = "1"
    dist.init_process_group(backend, rank=rank, world_size=cfg.world_size,
                            timeout=timedelta(minutes=10))
    try:
        _run_and_write(cfg, Path(tmp))
    finally:
        dist.destroy_process_group()


def _run_torchrun(cfg: RunConfig, out: Path) -> Path:
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    if world % cfg.nodes:
        raise ConfigError(
            f"torchrun world size {world} is not divisible by --nodes {cfg.nodes}."
        )
    cfg = cfg.replace(gpus_per_node=world // cfg.nodes)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.gpus_per_node))
    dist.init_process_group(_backend(cfg, local), timeout=timedelta(minutes=30))
    tmp = _tmp_dir(out)
    try:
        _run_and_write(cfg, tmp)
        dist.barrier()
        return _commit(tmp, out) if dist.get_rank() == 0 else out
    finally:
        dist.destroy_process_group()


def _tmp_dir(out: Path) -> Path:
    return out.parent / f".{out.name}.partial-{os.getpid()}"


def _commit(tmp: Path, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        out.rmdir()  # empty, checked before the run
    os.replace(tmp, out)
    return out


def _run_and_write(cfg: RunConfig, tmp: Path) -> None:
    """Every rank trains; rank 0 gathers the records and writes the files into tmp."""
    import torch.distributed as dist

    from experiments.train import run_rank

    result = run_rank(cfg)
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(result, gathered, dst=0)
    if dist.get_rank() == 0:
        tmp.mkdir(parents=True, exist_ok=True)
        write_run(cfg, gathered, tmp)


def write_run(cfg: RunConfig, results: list, folder: Path) -> None:
    """steps.parquet, trace.parquet and run.json from every rank's RankResult."""
    import pandas as pd

    from netsim.trace import TRAIN

    cfg = RunConfig.from_dict(results[0].config)
    per_rank = pd.concat(
        [pd.DataFrame(r.steps).assign(rank=r.rank) for r in results], ignore_index=True
    )
    steps = per_rank.groupby("step").agg(
        wall_time_s=("wall_time_s", "max"),  # a synchronous step ends when its slowest rank does
        loss=("loss", "mean"),
        val_loss=("val_loss", "mean"),
        step_s=("step_s", "max"),
    ).reset_index()
    trace = pd.concat([r.trace for r in results if r.trace is not None], ignore_index=True)
    trace = trace[trace["phase"] == TRAIN]  # evaluation traffic is its own phase
    comm = _comm_per_step(trace)
    steps = steps.merge(comm, on="step", how="left").fillna(
        {c: 0.0 for c in comm.columns if c != "step"}
    )
    for col in ("inter_bytes_sent", "inter_bytes_received", "intra_bytes"):
        steps[col] = steps[col] / cfg.nodes  # per node
    steps["compute_s"] = (steps["step_s"] - steps["comm_s"]).clip(lower=0.0)
    steps = steps.drop(columns="step_s")
    steps.to_parquet(folder / "steps.parquet", index=False)
    trace.to_parquet(folder / "trace.parquet", index=False)
    final = steps["val_loss"].dropna()
    meta = {
        "config": cfg.to_dict(),
        "world_size": cfg.world_size,
        "params": results[0].params,
        "final_val_loss": float(final.iloc[-1]) if len(final) else None,
        "train_time_s": float(steps["wall_time_s"].iloc[-1]),
        "inter_bytes_per_step": float(steps["inter_bytes_sent"].mean()),
        "intra_bytes_per_step": float(steps["intra_bytes"].mean()),
        **provenance(),
    }
    (folder / "run.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")


def _comm_per_step(trace):
    """Per step: bytes summed over ranks, calls and inter-node wait time of the busiest rank."""
    coll = trace[trace["kind"] == "collective"]
    inter = coll["inter"].astype(bool)
    per_rank = coll.assign(
        inter_bytes_sent=coll["bytes_sent"].where(inter, 0.0),
        inter_bytes_received=coll["bytes_received"].where(inter, 0.0),
        inter_calls=inter.astype(int),
        intra_bytes=coll["bytes_sent"].where(~inter, 0.0),
        comm_s=(coll["end_s"] - coll["start_s"]).where(inter, 0.0),
    ).groupby(["step", "rank"])[
        ["inter_bytes_sent", "inter_bytes_received", "inter_calls", "intra_bytes", "comm_s"]
    ].sum()
    return per_rank.groupby(level="step").agg(
        inter_bytes_sent=("inter_bytes_sent", "sum"),
        inter_bytes_received=("inter_bytes_received", "sum"),
        inter_calls=("inter_calls", "max"),
        intra_bytes=("intra_bytes", "sum"),
        comm_s=("comm_s", "max"),
    ).reset_index()


def provenance() -> dict[str, Any]:
    """Versions, git commit (and whether the tree was dirty) and host, for every run and sweep."""
    import importlib.metadata as md

    versions = {"python": platform.python_version()}
    for name in ("torch", "pandas", "simpy", "submitit", "flexbench"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "versions": versions,
        "git_commit": _git("rev-parse", "HEAD") or None,
        "git_dirty": None if status is None else bool(status),
        "host": {"name": socket.gethostname(), "platform": platform.platform(),
                 "cpus": os.cpu_count()},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _git(*args: str) -> str | None:
    """Output of a git command run beside this package; None outside a checkout."""
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()

def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else text


def load_config(path: str | None, flags: dict[str, Any], sets: list[str]) -> RunConfig:
    """Defaults < TOML file (its [run] table or top level) < explicit flags < --set overrides."""
    data: dict[str, Any] = {}
    if path:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise ConfigError(f"cannot read config {path!r}: {err}") from None
        data.update(raw.get("run", raw))
    data.update({k: v for k, v in flags.items() if v is not None})
    data.update(parse_overrides(sets))
    return RunConfig.from_dict(data).validate()


_FLAGS = (
    ("method", str, "training scheme: flexdemo, demo, hsdp-adamw, diloco, random, striding, none"),
    ("workload", str, "lm-tiny or vision-tiny"),
    ("nodes", int, "number of nodes (replicas)"),
    ("gpus-per-node", int, "ranks per node (FSDP2 shards across them)"),
    ("steps", int, "optimizer steps (default: the workload's budget)"),
    ("lr", float, "learning rate (default: the method's tuned value)"),
    ("seed", int, "seed for init, data order and random replication"),
    ("batch-size", int, "per-rank micro-batch"),
    ("eval-every", int, "steps between validation evaluations"),
    ("topk", int, "FlexDeMo: DCT coefficients kept per chunk"),
    ("chunk", int, "FlexDeMo: DCT chunk size"),
    ("decay", float, "FlexDeMo: momentum decay in [0, 1)"),
    ("weight-decay", float, "decoupled weight decay"),
    ("value-dtype", str, "FlexDeMo wire values: bf16 or fp32"),
    ("diloco-h", int, "DiLoCo inner steps"),
    ("outer-lr", float, "DiLoCo outer learning rate"),
    ("outer-momentum", float, "DiLoCo outer momentum"),
    ("replicate-every", int, "replicate every k-th step"),
    ("inter-bw", str, "inter-node bandwidth, e.g. 100Mbit, 1Gbit, 25GB/s"),
    ("inter-lat", str, "inter-node latency, e.g. 10ms, 200us"),
    ("shaping", str, "off (count only), wall (really wait) or virtual (modeled clock)"),
    ("backend", str, "auto, gloo or nccl"),
)


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of `flexbench run`."""
    parser.add_argument("--out", required=True, help="output folder (must be new or empty)")
    parser.add_argument("--config", help="TOML file with run settings (its [run] table)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any run setting; repeatable")
    parser.add_argument("--no-sign", dest="sign", action="store_const", const=False,
                        help="FlexDeMo: do not take sign() of the update")
    parser.add_argument("--timeout", type=float, help="seconds before the run is stopped")
    for name, kind, help_text in _FLAGS:
        parser.add_argument(f"--{name}", type=kind, help=help_text)


def main(args: argparse.Namespace) -> int:
    """Run `flexbench run`."""
    flags = {name.replace("-", "_"): getattr(args, name.replace("-", "_")) for name, _, _ in _FLAGS}
    flags["sign"] = args.sign
    cfg = load_config(args.config, flags, args.set)
    try:
        out = launch(cfg, args.out, timeout_s=args.timeout)
    except RunFailed as err:
        print(f"flexbench run: failed: {err}", file=sys.stderr)
        return 1
    if os.environ.get("RANK", "0") != "0":
        return 0  # under torchrun only rank 0 writes and reports
    summary = json.loads((out / "run.json").read_text())
    print(
        f"wrote {out}: final val_loss {summary['final_val_loss']:.4f}, "
        f"{summary['train_time_s']:.1f} s, "
        f"{summary['inter_bytes_per_step'] / 1e3:.1f} kB inter-node per step per node"
    )
    return 0
