"""Runs end cleanly: bad input is one sentence, divergence is a result, stalls end the run,
nothing listens beyond loopback, and a sweep killed with -9 resumes to a clean run's rows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from experiments.cli import main

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "results" / "quick" / "units" / "flexdemo-s0"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "PYTHONPATH": str(ROOT)}


def _bad_inputs(tmp: Path) -> list[tuple[list[str], str]]:
    """(argv, words the sentence must hold) for every bad input the issue found."""
    a_file = tmp / "a_file"
    a_file.write_text("mine")
    a_dir = tmp / "a_dir"
    a_dir.mkdir()
    run_x = tmp / "run_x.toml"
    run_x.write_text('run = "x"\n')
    listed = tmp / "list.json"
    listed.write_text("[1, 2]\n")
    beside = tmp / "beside.toml"
    beside.write_text('steps = 5\n[run]\nnodes = 2\n')
    a_bool = tmp / "bool.toml"
    a_bool.write_text('[run]\nlr = true\n')
    out = str(tmp / "out")
    sim = ["simulate", str(RECORDED), "--inter-bw", "1Gbit"]
    return [
        (["run", "--out", out, "--lr", "inf"], "--lr: must be a finite number > 0, got 'inf'"),
        (["run", "--out", out, "--weight-decay", "nan"], "--weight-decay: must be a finite"),
        (["run", "--out", out, "--outer-lr", "-1"], "argument --outer-lr"),
        (["run", "--out", out, "--stall-timeout", "0"], "argument --stall-timeout"),
        (["run", "--out", str(a_file / "sub")], "is a file, not a folder"),
        (["run", "--out", str(a_file)], "is a file; choose a folder"),
        (["run", "--out", "/proc/flexbench-cannot-write-here"], "cannot be"),
        (["run", "--out", out, "--config", str(run_x)], "'run' must be a table"),
        (["run", "--out", out, "--config", str(ROOT / "experiments/configs/quick.toml")],
         "it looks like a sweep file; run it with `flexbench sweep`"),
        (["run", "--out", out, "--config", str(beside)], "has steps beside its [run] table"),
        (["run", "--out", out, "--config", str(a_bool)], "lr must be of type float | None, got "
         "True"),
        (["run", "--out", out, "--method", "hsdp-adamw", "--topk", "7"],
         "method 'hsdp-adamw' does not read topk"),
        (["run", "--out", out, "--nodes", "100000", "--gpus-per-node", "1"],
         "100000 ranks cannot be spawned on this machine"),
        (["run", "--out", out, "--seed", "-1"], "argument --seed: must be an integer from 0 to"),
        (["run", "--out", out, "--seed", str(2**40)], "--seed: must be an integer from 0 to"),
        (["sweep", str(ROOT / "experiments/configs/quick.toml"), "--out", out, "--set",
          "executor.timeout_mn=5"], "[executor]: Unknown executor 'timeout'"),
        ([*sim, "--out", str(a_dir)], "is a folder"),
        ([*sim, "--out", str(a_file / "x.csv")], "is a file, not a folder"),
        ([*sim, "--out", str(tmp / "s.csv"), "--target", "-1"], "--target: must be a finite"),
        ([*sim, "--out", str(tmp / "s.csv"), "--target", "nan"], "--target: must be a finite"),
        ([*sim, "--out", str(tmp / "s.csv"), "--steps", "1000000000"],
         "--steps 1000000000 is more than a replay runs here"),
        (["sweep", str(ROOT / "experiments/configs/quick.toml"), "--out", str(a_file)],
         "is a file; choose a folder"),
        (["check-comm", "--baseline", str(listed)], "no 'methods' table"),
        (["simulate", str(RECORDED), "--inter-bw", "1Gbit", "--out",
          str(RECORDED / "trace.parquet")], "which this command reads; write it elsewhere"),
        (["simulate", str(RECORDED), "--inter-bw", "1Gbit", "--out",
          str(RECORDED / "sub" / "x.csv")], "which this command reads"),
    ]


@pytest.mark.parametrize("case", range(25))
def test_bad_input_is_one_sentence_nothing_written(tmp_path, capsys, case):
    cases = _bad_inputs(tmp_path)
    assert len(cases) == 25
    argv, words = cases[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(argv) != 0
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.count("\n") == 0 and words in err, err
    assert "Traceback" not in captured.err + captured.out
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written
    assert list((tmp_path / "a_dir").iterdir()) == []
    assert sorted(p.name for p in RECORDED.iterdir()) == ["run.json", "steps.parquet",
                                                          "trace.parquet"]


def test_a_one_node_recording_is_not_replayed_on_more_nodes(tmp_path, capsys):
    import json
    import shutil

    one = tmp_path / "one-node"
    shutil.copytree(RECORDED, one)
    meta = json.loads((one / "run.json").read_text())
    meta["config"].update(nodes=1)
    (one / "run.json").write_text(json.dumps(meta))
    assert main(["simulate", str(one), "--inter-bw", "1Kbit", "--nodes", "64",
                 "--out", str(tmp_path / "s.csv")]) == 2
    err = capsys.readouterr().err
    assert "was recorded on 1 node: it has no inter-node traffic to replay on 64 nodes" in err
    assert not (tmp_path / "s.csv").exists()


@pytest.mark.dist
def test_diverging_run_ends_normally_with_status_diverged(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["run", "--out", str(out), "--method", "hsdp-adamw", "--lr", "1e30",
               "--workload", "vision-tiny", "--nodes", "2", "--gpus-per-node", "1",
               "--steps", "12", "--eval-every", "3"])
    assert rc == 0
    assert "diverged at step" in capsys.readouterr().out
    meta = json.loads((out / "run.json").read_text())
    assert meta["status"] == "diverged" and meta["final_val_loss"] is None
    assert 1 <= meta["diverged_step"] <= 12
    steps = pd.read_parquet(out / "steps.parquet")
    # Every rank stopped at the first evaluation that saw the divergence.
    assert steps["step"].max() < 12 and steps["step"].max() % 3 == 0


def _start(argv: list[str], tmp: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "experiments.cli", *argv], cwd=ROOT, env=ENV, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )


def _progress(out: Path, world: int, deadline_s: float) -> dict[int, tuple[int, int]]:
    """Wait until every rank of the run building OUT has finished a step: {rank: (pid, step)}."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        seen = {}
        for work in out.parent.glob(f".{out.name}.partial-*"):
            for rank in range(world):
                try:
                    pid, step, _ = (work / f"progress-{rank}").read_text().split()[:3]
                except (OSError, ValueError):
                    continue
                seen[rank] = (int(pid), int(step))
        if len(seen) == world and min(s for _, s in seen.values()) >= 2:
            return seen
        time.sleep(0.2)
    raise AssertionError(f"the run did not reach step 2 within {deadline_s} s")


@pytest.mark.dist
@pytest.mark.timing
def test_stalled_rank_ends_the_run_with_one_sentence(tmp_path):
    out = tmp_path / "run"
    stall_s = 15.0  # well above any step or start-up on a loaded 2-core machine
    proc = _start(["run", "--out", str(out), "--method", "flexdemo", "--workload", "vision-tiny",
                   "--steps", "100000", "--eval-every", "100000",
                   "--stall-timeout", str(stall_s)], tmp_path)
    try:
        ranks = _progress(out, 4, deadline_s=120)
        os.kill(ranks[1][0], signal.SIGSTOP)
        # Only a guard against a watchdog that never fires: how soon it fires after the limit
        # is up to the machine's load, so the test reads the limit the watchdog applied instead.
        _, err = proc.communicate(timeout=stall_s + 120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "rank 1 made no progress" in lines[0], err
    # The stall timeout, not the start-up allowance (300 s), was applied: rank 1 had made steps.
    assert f"for {stall_s:g} s (after step " in lines[0], err
    assert list(tmp_path.iterdir()) == []  # nothing at --out, no working folder left


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie waiting to be reaped has stopped running)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.dist
def test_ranks_die_with_a_launcher_killed_by_sigkill(tmp_path):
    if not Path("/proc/self/stat").exists():
        pytest.skip("needs Linux /proc")
    out = tmp_path / "run"
    proc = _start(["run", "--out", str(out), "--method", "flexdemo", "--workload", "vision-tiny",
                   "--steps", "100000", "--eval-every", "100000"], tmp_path)
    try:
        ranks = [pid for pid, _ in _progress(out, 4, deadline_s=120).values()]
        os.kill(proc.pid, signal.SIGKILL)  # the launcher alone: no cleanup code of ours runs
        proc.wait(timeout=30)
        end = time.monotonic() + 30
        while any(_running(pid) for pid in ranks) and time.monotonic() < end:
            time.sleep(0.1)
        assert not [pid for pid in ranks if _running(pid)], "ranks outlived their launcher"
    finally:
        if proc.poll() is None or any(_running(pid) for pid in ranks):
            os.killpg(proc.pid, signal.SIGKILL)


def _listening_sockets(pids: set[int]) -> list[str]:
    """Local addresses of the TCP sockets in LISTEN state that these processes hold."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(fields[1])
    return found


def _process_tree(root: int) -> set[int]:
    """`root` and every process descended from it (Linux /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    return tree


def _is_loopback(hex_address: str) -> bool:
    ip = hex_address.split(":")[0]
    if len(ip) == 8:  # IPv4, little-endian: 127.x.x.x ends in 7F
        return ip.endswith("7F")
    return ip in ("00000000000000000000000001000000",  # ::1
                  "0000000000000000FFFF00000100007F")  # ::ffff:127.0.0.1


@pytest.mark.dist
def test_spawned_run_listens_on_loopback_only(tmp_path):
    if not Path("/proc/net/tcp").exists():
        pytest.skip("needs Linux /proc to list sockets")
    out = tmp_path / "run"
    proc = _start(["run", "--out", str(out), "--method", "hsdp-adamw", "--workload",
                   "vision-tiny", "--steps", "100000", "--eval-every", "100000"], tmp_path)
    try:
        ranks = _progress(out, 4, deadline_s=120)
        pids = {pid for pid, _ in ranks.values()} | _process_tree(proc.pid)
        assert len(pids) >= 6  # the launcher, its process server and four ranks at least
        listening = _listening_sockets(pids)
        assert all(_is_loopback(a) for a in listening), listening
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


SWEEP = """
name = "killed"
[run]
workload = "vision-tiny"
nodes = 2
gpus_per_node = 1
steps = 6
eval_every = 3
[grid]
methods = ["hsdp-adamw", "flexdemo", "demo"]
inter_bw = ["100Mbit"]
inter_lat = ["1ms"]
seeds = [0]
[target]
val_loss = 2.0
"""
SAME = ["unit", "step", "loss", "val_loss", "inter_bytes_sent", "inter_bytes_received",
        "inter_calls", "intra_bytes"]


def _sweep(config: Path, out: Path) -> subprocess.Popen:
    return _start(["sweep", str(config), "--out", str(out)], out.parent)


@pytest.mark.dist
def test_sweep_killed_with_sigkill_resumes_to_the_rows_of_a_clean_run(tmp_path):
    config = tmp_path / "killed.toml"
    config.write_text(SWEEP)
    clean = _sweep(config, tmp_path / "clean")
    assert clean.wait(timeout=280) == 0, clean.stderr.read()
    killed = tmp_path / "killed"
    proc = _sweep(config, killed)
    try:  # kill -9 the whole sweep (launcher, process server, ranks) in its second unit
        end = time.monotonic() + 240
        while len(list((killed / "units").glob("*/run.json"))) < 1:
            assert time.monotonic() < end and proc.poll() is None, "first unit never finished"
            time.sleep(0.1)
        while not list(killed.glob("units/.*.partial-*/progress-1")):
            assert time.monotonic() < end and proc.poll() is None, "second unit never started"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    again = _sweep(config, killed)
    assert again.wait(timeout=280) == 0, again.stderr.read()
    for name in ("steps.parquet", "runs.parquet"):
        a = pd.read_parquet(tmp_path / "clean" / name)
        b = pd.read_parquet(killed / name)
        cols = [c for c in SAME if c in a.columns]
        key = [c for c in ("unit", "step") if c in cols]
        a, b = (x[cols].sort_values(key).reset_index(drop=True) for x in (a, b))
        pd.testing.assert_frame_equal(a, b)  # bit-identical losses and bytes
    assert not list(killed.glob("units/.*"))  # no debris of the killed unit


def test_socket_check_sees_a_listener_on_all_interfaces():
    if not Path("/proc/net/tcp").exists():
        pytest.skip("needs Linux /proc to list sockets")
    import socket

    with socket.socket() as wide, socket.socket() as local:
        wide.bind(("0.0.0.0", 0))
        wide.listen()
        local.bind(("127.0.0.1", 0))
        local.listen()
        found = _listening_sockets({os.getpid()})
    assert sorted(_is_loopback(a) for a in found) == [False, True]


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_a_run_that_cannot_be_written_keeps_its_results_and_says_where(tmp_path, monkeypatch):
    import errno

    from experiments.config import RunConfig
    from experiments.errors import RunFailed
    from experiments.run import launch as launch_module

    def disk_full(results, folder, extra=None):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(launch_module, "write_run", disk_full)
    out = tmp_path / "run"
    cfg = RunConfig(method="hsdp-adamw", workload="vision-tiny", nodes=2, gpus_per_node=1,
                    steps=2, eval_every=2)
    with pytest.raises(RunFailed, match="could not be written .No space left on device.; "
                                        "every rank's results are kept in") as info:
        launch_module.launch(cfg, out, quiet=True)
    kept = Path(str(info.value).rpartition(" in ")[2].strip(".'"))
    assert not out.exists() and (kept / "rank0.json").exists() and (kept / "rank1.json").exists()
