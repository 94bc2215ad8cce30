"""Shaping real gloo process groups: results, byte counts, delays, NIC sharing, virtual clock."""

import gc
import json
import os
import socket
import subprocess
import time
import weakref

import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from netsim import Topology, TraceRecorder, comm_per_step, shaping, simulate
from netsim.shaping import run_dir, work
from netsim.trace import compute_outside_collectives
from tests.dist_utils import init_loopback, spawn, threads_after_exits
from tests.timing import SleepLog


def _init(rank: int, world: int, store: str) -> None:
    init_loopback(rank, world, store)
    torch.manual_seed(0)


def _spawn(fn, world: int, tmp_path) -> list[dict]:
    spawn(fn, (world, str(tmp_path / "store"), str(tmp_path)), world)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def _summary(rec: TraceRecorder) -> list[dict]:
    """The recorder's per-step figures, as the runs report them (JSON-ready)."""
    figures = ["inter_bytes_sent", "inter_bytes_received", "inter_calls", "intra_bytes"]
    per_step = comm_per_step(rec.frame())[figures].astype(object)
    return per_step.to_dict("records")


def _two_rank_modes(rank: int, world: int, store: str, out: str) -> None:
    _init(rank, world, store)
    topo = Topology.from_strings(2, 1, "80Mbit", "10ms")  # 10 MB/s, 10 ms
    results = {}
    for mode in ("off", "wall", "virtual"):
        rec = TraceRecorder(rank)
        shaper = shaping.install(topo, mode, rec, run_dir=out)
        group = dist.new_group([0, 1], backend=shaping.BACKEND)
        dist.barrier()
        holds = SleepLog().install(work)  # the sleeps the shaper's wait() asks for
        try:
            clock0, wall0 = shaping.clock(), time.perf_counter()
            for step in range(3):
                rec.begin_step(step)
                time.sleep(0.03)  # "compute"
                x = torch.full((250_000,), float(rank + 1))  # 1 MB
                dist.all_reduce(x, group=group)
                rec.end_step(step)
            clock, wall = shaping.clock() - clock0, time.perf_counter() - wall0
        finally:
            holds.remove()
        results[mode] = {
            "clock": clock,
            "wall": wall,
            "held": holds.total(),
            "offset": shaper.offset,  # the virtual clock's lead over the wall clock
            "value": x[0].item(),
            "summary": _summary(rec),
            "modeled": rec.frame().query("kind == 'collective'")["modeled_s"].tolist(),
        }
        frames = [None] * world
        dist.all_gather_object(frames, rec.frame())
        trace = pd.concat(frames)
        # The model replays the shaped run's trace: it should predict what the run measured.
        results[mode]["predicted"] = simulate(trace, topo).frame["time_s"].iloc[-1]
        results[mode]["compute"] = compute_outside_collectives(trace).sum()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)
    shaping.teardown()


@pytest.mark.dist
@pytest.mark.timing
@pytest.mark.timeout(120)
def test_wall_shaping_delays_and_virtual_clock_agrees(tmp_path):
    results = _spawn(_two_rank_modes, 2, tmp_path)
    modeled_one = 2 * 0.01 + 1e6 / 1e7  # ring all-reduce of 1 MB over 2 ranks: 0.12 s
    total = 3 * (0.03 + modeled_one)
    for res in results:
        for mode in ("off", "wall", "virtual"):
            assert res[mode]["value"] == 3.0
            assert (
                res[mode]["summary"]
                == [
                    {
                        "inter_bytes_sent": 1e6,
                        "inter_bytes_received": 1e6,
                        "inter_calls": 1,
                        "intra_bytes": 0.0,
                    }
                ]
                * 3
            )
            # The model replays the trace: the compute the trace recorded (however long a
            # loaded machine made it) plus 3 modeled all-reduces, in every mode.
            predicted = res[mode]["compute"] + 3 * modeled_one
            assert res[mode]["predicted"] == pytest.approx(predicted, abs=0.02), (mode, res)
            assert res[mode]["compute"] >= 3 * 0.03 * 0.98  # the sleeps really were recorded
        assert res["wall"]["modeled"] == pytest.approx([modeled_one] * 3, abs=0.01)
        # Wall: the rank really waited the modeled 3 x 0.15 s (load only adds to that)...
        assert res["wall"]["wall"] >= total * 0.98
        # ...and the shaper asked for no more sleep than the model's 3 x 0.12 s (it sleeps until
        # the modeled finish, counted from the op's start, not for the modeled time on top of
        # the real op). Off and virtual never sleep.
        assert 0 < res["wall"]["held"] <= 3 * modeled_one + 1e-3, res["wall"]
        assert res["off"]["held"] == 0 and res["virtual"]["held"] == 0
        # In wall and off mode the shaping clock is the wall clock; off mode models nothing.
        assert res["wall"]["offset"] == 0 and res["off"]["offset"] == 0
        assert all(m != m for m in res["off"]["modeled"])  # NaN: nothing was modeled
        # Virtual: the clock reaches at least the modeled total, without waiting for it.
        assert res["virtual"]["clock"] >= total * 0.98
        assert res["virtual"]["offset"] > 0


def _four_ranks(rank: int, world: int, store: str, out: str) -> None:
    _init(rank, world, store)
    topo = Topology.from_strings(2, 2, "80Mbit", "0ms")  # 2 nodes x 2, one NIC per node
    rec = TraceRecorder(rank)
    shaper = shaping.install(topo, "wall", rec, run_dir=out)
    shards = [dist.new_group(r, backend=shaping.BACKEND) for r in ([0, 1], [2, 3])]
    reps = [dist.new_group(r, backend=shaping.BACKEND) for r in ([0, 2], [1, 3])]
    shard, rep = shards[rank // 2], reps[rank % 2]
    res: dict = {}
    rec.begin_step(0)
    x = torch.full((1000,), float(rank + 1))  # 4000 bytes
    dist.all_reduce(x, group=rep)
    res["all_reduce"] = x[0].item()
    gathered = torch.empty(2000)
    dist.all_gather_into_tensor(gathered, torch.full((1000,), float(rank)), group=rep)
    res["all_gather"] = [gathered[0].item(), gathered[1000].item()]
    scattered = torch.empty(1000)
    dist.reduce_scatter_tensor(scattered, torch.arange(2000, dtype=torch.float32), group=rep)
    res["reduce_scatter"] = [scattered[0].item(), scattered[-1].item()]
    y = torch.full((1000,), float(rank))
    dist.all_reduce(y, group=shard)
    res["intra"] = y[0].item()
    z = funcol.wait_tensor(funcol.all_gather_tensor(torch.full((10,), float(rank)), 0, rep))
    res["funcol"] = z.tolist()
    rec.end_step(0)
    # Step 1: both replicate groups of a node send 1 MB at once through that node's one NIC.
    rec.begin_step(1)
    dist.barrier()
    dist.all_reduce(torch.ones(250_000), group=rep)
    rec.end_step(1)
    frame = rec.frame().query("kind == 'collective'")
    res["rows"] = frame[
        ["step", "op", "group", "inter", "algorithm", "bytes", "bytes_sent", "modeled_s", "start_s"]
    ].to_dict("records")
    res["t0"] = shaper.t0  # wall mode: start_s + t0 is the op's issue time on the wall clock
    res["summary"] = _summary(rec)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(res, fh)
    shaping.teardown()


@pytest.mark.dist
@pytest.mark.timing
@pytest.mark.timeout(120)
def test_four_ranks_results_byte_counts_and_shared_nic(tmp_path):
    results = _spawn(_four_ranks, 4, tmp_path)
    for rank, res in enumerate(results):
        partner = rank + 2 if rank < 2 else rank - 2
        assert res["all_reduce"] == rank + 1 + partner + 1
        assert res["all_gather"] == [float(min(rank, partner)), float(max(rank, partner))]
        half = 0 if rank < 2 else 1000  # group rank 0 gets the first half, summed over 2 ranks
        assert res["reduce_scatter"] == [2.0 * half, 2.0 * (half + 999)]
        node_base = rank // 2 * 2
        assert res["intra"] == float(node_base + node_base + 1)
        assert res["funcol"] == [float(min(rank, partner))] * 10 + [float(max(rank, partner))] * 10
        step0 = [r for r in res["rows"] if r["step"] == 0]
        by_op = {(r["op"], r["inter"]): r for r in step0}
        rep_group = ",".join(map(str, sorted([rank, partner])))
        assert by_op[("all_reduce", True)]["group"] == rep_group
        assert by_op[("all_reduce", True)]["bytes_sent"] == 4000  # 2(p-1)/p * n, p = 2
        gathers = [r for r in step0 if r["op"] == "all_gather"]
        assert sorted(r["bytes_sent"] for r in gathers) == [40, 4000]  # (p-1) * n_in
        rs = by_op[("reduce_scatter", True)]
        assert (rs["algorithm"], rs["bytes"], rs["bytes_sent"]) == ("allreduce", 8000, 8000)
        intra = by_op[("all_reduce", False)]
        assert intra["group"] == f"{node_base},{node_base + 1}"
        assert intra["modeled_s"] is None or intra["modeled_s"] != intra["modeled_s"]  # NaN
        assert res["summary"][0] == {
            "inter_bytes_sent": 16040.0,
            "inter_bytes_received": 16040.0,
            "inter_calls": 4,
            "intra_bytes": 4000.0,
        }
    # Step 1: each node's two ranks sent 1 MB (0.1 s at 10 MB/s) through the node's one NIC. Each
    # op starts when its pair has issued it (the later stamp); the rank that books the NIC
    # first gets it for 0.1 s, the other queues behind it. How far apart the pairs issue is up
    # to the machine's load, so the expectation is computed from the recorded issue times.
    # This catches a NIC that is not shared (both 0.1 s while the issues overlap), a booking
    # that ignores the queue, or one that books more than the bytes.
    issued = {}  # replicate group -> its op's modeled start, on the wall clock
    modeled = {}  # (rank, group) -> modeled seconds
    for rank, res in enumerate(results):
        for r in res["rows"]:
            if r["step"] == 1 and r["op"] == "all_reduce":
                issued[r["group"]] = max(issued.get(r["group"], 0.0), r["start_s"] + res["t0"])
                modeled[rank, r["group"]] = r["modeled_s"]
    one = 1e6 / 1e7
    for node in (0, 1):
        mine = {g: modeled[rank, g] for rank, g in modeled if rank // 2 == node}
        assert len(mine) == 2
        (a, begin_a), (b, begin_b) = ((g, issued[g]) for g in sorted(mine))
        # First booked a, then b queues behind it: or the other way round.
        orders = [(one, max(begin_b, begin_a + one) + one - begin_b),
                  (max(begin_a, begin_b + one) + one - begin_a, one)]
        got = (mine[a], mine[b])
        assert any(got == pytest.approx(want, abs=1e-3) for want in orders), (got, orders)


def _gloo_threads(wait_s: float = 0.0) -> int:
    """Threads of gloo backends alive in this process (named pt_gloo_runloop, gloo_tcp_loop);
    with `wait_s`, once none is left or after that long."""
    return sum("gloo" in name for name in threads_after_exits(wait_s))


def _close_releases(rank: int, world: int, store: str, out: str) -> None:
    _init(rank, world, store)
    topo = Topology.from_strings(2, 1, "800Mbit", "0ms")
    before = _gloo_threads()
    shaper = shaping.install(topo, "wall", TraceRecorder(rank))  # default run folder
    group = dist.new_group([0, 1], backend=shaping.BACKEND)
    dist.all_reduce(torch.ones(10), group=group)
    folder = shaper.run_dir.path(shaper.run_token())
    inners = [weakref.ref(inner) for _, inner in group._inners.values()]
    res = {"folder": str(folder), "folder_existed": folder.is_dir(), "owned": shaper.run_dir.owned}
    res["threads_added"] = _gloo_threads() - before
    dist.barrier()  # nobody closes while a peer still runs an op on the group
    shaping.uninstall()
    gc.collect()
    res["groups_left"] = len(shaper.groups())
    res["inners_alive"] = sum(ref() is not None for ref in inners)
    try:  # the clock the training loop reads is gone with the Shaper
        shaping.clock()
        res["installed"] = True
    except ValueError:
        res["installed"] = False
    try:
        dist.all_reduce(torch.ones(1), group=group)
        res["after_close"] = "ran"
    except ValueError as err:
        res["after_close"] = str(err)
    dist.barrier()
    res["folder_exists_after"] = folder.exists()
    dist.destroy_process_group()
    # gloo's shutdown() does not join its threads: they end when the last holder of the group
    # lets go. Nothing of netsim's may be that holder, so dropping the caller's handle suffices.
    del group
    gc.collect()
    res["gloo_threads_left"] = _gloo_threads(wait_s=5.0)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(res, fh)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_uninstall_releases_every_inner_group_and_the_run_folder(tmp_path):
    results = _spawn(_close_releases, 2, tmp_path)
    for res in results:
        assert res["folder_existed"] and not res["folder_exists_after"]
        assert res["threads_added"] > 0  # the wrapped gloo backend runs threads ...
        assert res["gloo_threads_left"] == 0  # ... which end once the group's holders let go
        assert res["groups_left"] == 0 and res["inners_alive"] == 0
        assert not res["installed"]
        assert "was closed" in res["after_close"]
    assert results[0]["folder"] == results[1]["folder"]  # one node: both ranks shared it
    assert sorted(r["owned"] for r in results) == [False, True]  # one made it and removed it


def _write_owner(folder, host, pid):
    folder.mkdir()
    (folder / "owner").write_text(f"{host} {pid}\n")


def test_stale_run_folders_of_dead_owners_are_cleaned_at_the_next_start(tmp_path):
    host = socket.gethostname()
    dead = subprocess.Popen(["true"])
    dead.wait()
    _write_owner(tmp_path / f"{run_dir.PREFIX}dead", host, dead.pid)
    _write_owner(tmp_path / f"{run_dir.PREFIX}alive", host, os.getpid())
    _write_owner(tmp_path / f"{run_dir.PREFIX}elsewhere", "another-host", dead.pid)
    (tmp_path / f"{run_dir.PREFIX}young").mkdir()  # between mkdir and its owner file
    old = tmp_path / f"{run_dir.PREFIX}ownerless"
    old.mkdir()
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    (tmp_path / "netsim-other").mkdir()  # not ours by name
    shaper = shaping.Shaper(Topology.from_strings(2, 1), "off")
    shaper.run_dir = run_dir.RunDir(base=tmp_path)  # a start that cleans tmp_path
    left = sorted(p.name.removeprefix(run_dir.PREFIX) for p in tmp_path.iterdir())
    assert left == ["alive", "elsewhere", "netsim-other", "young"]


def test_explicit_run_folder_is_used_and_left_to_its_maker(tmp_path, monkeypatch):
    folder = tmp_path / "run"
    monkeypatch.setenv(shaping.ENV_VAR, str(folder))
    explicit = run_dir.RunDir()
    assert explicit.path("token") == folder and folder.is_dir() and not explicit.owned
    explicit.close()
    assert folder.is_dir()  # the launcher made it, the launcher removes it
    monkeypatch.delenv(shaping.ENV_VAR)
    default = run_dir.RunDir(base=tmp_path)
    made = default.path("abc")
    assert made.name == f"{run_dir.PREFIX}abc" and default.owned
    assert (made / "owner").read_text().split() == [socket.gethostname(), str(os.getpid())]
    joiner = run_dir.RunDir(base=tmp_path)
    assert joiner.path("abc") == made and not joiner.owned
    default.close()
    assert not made.exists()


def test_a_wall_clock_step_during_a_hold_does_not_shorten_it(tmp_path):
    # The shaper agrees on times through the wall clock, which NTP may set forward at any
    # moment; the hold itself runs on the monotonic clock, so the op still takes its modeled
    # time. No process group: a work of no real ops, modeled to finish 0.2 s after its issue.
    from netsim.shaping.shaper import Shaper

    shaper = Shaper(Topology.from_strings(2, 1, inter_bw="100Mbit"), mode="wall",
                    run_dir=tmp_path)
    clock = SleepLog().install(work)
    try:
        issued, start = shaper.now(), time.monotonic()
        held = work.ShapedWork(shaper, [], lambda begin: begin + 0.2, None, issued,
                               issued_mono=start)
        clock.wall_step_s = 3600.0  # set forward an hour after the issue
        assert not held.is_completed()
        held.wait()
        assert time.monotonic() - start >= 0.2
        assert held.is_completed() and clock.requested  # it slept, the hour notwithstanding
    finally:
        clock.remove()
        shaper.close()
