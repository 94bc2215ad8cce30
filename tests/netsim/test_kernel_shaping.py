"""`--shaping kernel`: namespaces, tbf-shaped veth links, goodput, refusals, cleanup.

Tests that make namespaces skip, with the reason, where this process cannot (not root, no
iproute2, a kernel without network namespaces); the refusals run everywhere.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from netsim import kernel
from netsim.kernel_probe import measure_goodput
from netsim.units import parse_bandwidth
from tests.timing import assert_link_goodput

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "PYTHONPATH": str(ROOT)}
_REASON = kernel.unavailable_reason()
needs_kernel = pytest.mark.skipif(_REASON is not None, reason=f"kernel shaping: {_REASON}")
SMALL_RUN = ["--method", "hsdp-adamw", "--workload", "vision-tiny", "--nodes", "2",
             "--gpus-per-node", "1", "--steps", "3", "--shaping", "kernel",
             "--inter-bw", "20Mbit"]


def _small_run(*changes: str) -> list[str]:
    """SMALL_RUN with some of its flags given other values (FLAG VALUE pairs; a flag it lacks
    is added): the command line refuses a flag given twice."""
    args = list(SMALL_RUN)
    for flag, value in zip(changes[::2], changes[1::2], strict=True):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    return args


def _flexbench(args: list[str], env: dict | None = None, prefix: tuple[str, ...] = (),
               timeout: float = 240) -> tuple[subprocess.CompletedProcess, int]:
    """Run the CLI in a child; its result and pid (the pid its namespaces are named after)."""
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "experiments.cli", *args],
                            env=env or ENV, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), proc.pid


def _left_behind(*pids: int) -> list[str]:
    """Namespaces still named after any of `pids`."""
    return [n for n in kernel.our_namespaces() if int(n.split("-")[1]) in pids]


def _nothing_written(out: Path) -> None:
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.partial-*"))


@pytest.mark.dist
@pytest.mark.timing
@needs_kernel
@pytest.mark.timeout(180)
def test_two_namespaces_at_20mbit_move_a_known_payload_at_20mbit():
    rate = parse_bandwidth("20Mbit")
    result = measure_goodput(rate, payload=4 << 20, repeats=5, nodes=2, timeout_s=150)
    # What TCP/IP framing, ACKs and gloo leave of the link (95-100% at MTU 9000 here).
    assert_link_goodput(result)
    # Both directions of both links carried the payload: the shaping sits on both veth ends.
    for name, sent in result["qdisc_sent_bytes"].items():
        assert sent >= 5 * result["wire_bytes_each_way"], (name, result)
    assert _left_behind(os.getpid()) == []


@pytest.mark.dist
@needs_kernel
@pytest.mark.timeout(60)
def test_a_started_process_runs_in_its_nodes_namespace_with_the_rendezvous_env():
    net = kernel.KernelNetwork(2, kernel.TcSettings(parse_bandwidth("20Mbit")))
    # Field 6 of /proc/PID/stat is the session id; `ip netns exec` execs the shell in place.
    script = ("ip netns identify; ip -o -4 addr show dev eth0; "
              "echo $MASTER_ADDR $MASTER_PORT $GLOO_SOCKET_IFNAME $FLEXBENCH_TEST; "
              "cut -d' ' -f6 /proc/$$/stat")
    with net:
        proc = net.start(1, ["sh", "-c", script], env={**ENV, "FLEXBENCH_TEST": "kept"},
                         stdout=subprocess.PIPE, text=True)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    name, addr, env, session = out.strip().splitlines()
    assert name == net.namespace(1)
    assert f" {net.address(1)}/24 " in addr and net.address(0) not in addr
    assert env.split() == [net.address(0), str(kernel.MASTER_PORT), kernel.INTERFACE, "kept"]
    assert int(session) == proc.pid  # a session of its own: kernel.stop kills it as a group
    assert _left_behind(os.getpid()) == []


def _probe_ranks(net: kernel.KernelNetwork, nodes: list[int]) -> None:
    """Rank k of netsim.kernel_probe in node nodes[k]: 1 MiB all-reduced twice; all exit 0."""
    env = {**ENV, "WORLD_SIZE": str(len(nodes)), "TORCH_CPP_LOG_LEVEL": "ERROR"}
    argv = [sys.executable, "-m", "netsim.kernel_probe", "--rank", "--payload", str(1 << 20),
            "--repeats", "2"]
    procs = [net.start(node, argv, env={**env, "RANK": str(k)}, stdout=subprocess.PIPE)
             for k, node in enumerate(nodes)]
    try:
        for p in procs:
            p.communicate(timeout=90)
            assert p.returncode == 0
    finally:
        kernel.stop(procs)


@pytest.mark.dist
@needs_kernel
@pytest.mark.timeout(120)
def test_same_namespace_ranks_talk_over_loopback_not_the_shaped_link():
    net = kernel.KernelNetwork(1, kernel.TcSettings(parse_bandwidth("20Mbit")))
    with net:
        _probe_ranks(net, nodes=[0, 0])
        sent = net.sent_bytes()
    # Gloo bound both ranks to eth0's address, yet 2 MiB went over lo: eth0 saw only the
    # kernel's own few hundred bytes of IPv6 neighbour discovery.
    assert sent["n0"] < 64 * 1024, sent
    assert _left_behind(os.getpid()) == []


@pytest.mark.dist
@needs_kernel
@pytest.mark.timeout(300)
def test_kernel_run_2x2_writes_its_tc_settings_and_leaves_no_namespace(tmp_path):
    out = tmp_path / "run"
    res, pid = _flexbench(["run", "--out", str(out), *_small_run("--gpus-per-node", "2")])
    assert res.returncode == 0, res.stderr
    meta = json.loads((out / "run.json").read_text())
    assert meta["shaping"] == "kernel" and meta["config"]["shaping"] == "kernel"
    assert meta["kernel"]["rate_bit_s"] == 20_000_000 and meta["kernel"]["qdisc"] == "tbf"
    steps = pd.read_parquet(out / "steps.parquet")
    assert len(steps) == 3 and (steps["inter_bytes_sent"] > 0).all()  # netsim still counts
    trace = pd.read_parquet(out / "trace.parquet")
    assert set(trace["rank"]) == {0, 1, 2, 3}
    assert _left_behind(pid) == []


_FAILING = '''
from experiments.workloads import make_workload


class Failing:
    """vision-tiny whose rank 1 raises at step 2."""

    def __init__(self):
        self.inner = make_workload("vision-tiny")
        for name in ("default_steps", "default_batch_size", "default_eval_every"):
            setattr(self, name, getattr(self.inner, name))

    def model(self):
        return self.inner.model()

    def batch(self, step, rank, batch_size, seed):
        if step == 2 and rank == 1:
            raise RuntimeError("injected failure at step 2")
        return self.inner.batch(step, rank, batch_size, seed)

    def val_batches(self, n, batch_size):
        return self.inner.val_batches(n, batch_size)

    def loss(self, model, batch):
        return self.inner.loss(model, batch)


def make():
    return Failing()
'''


@pytest.mark.dist
@needs_kernel
@pytest.mark.timeout(240)
def test_a_run_failing_midway_writes_nothing_and_leaves_no_namespace(tmp_path):
    (tmp_path / "failing_workload.py").write_text(textwrap.dedent(_FAILING))
    env = {**ENV, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    out = tmp_path / "run"
    args = ["run", "--out", str(out), *_small_run("--workload", "failing_workload:make")]
    res, pid = _flexbench(args, env=env)
    assert res.returncode == 1
    assert "rank 1: RuntimeError: injected failure at step 2" in res.stderr
    _nothing_written(out)
    assert _left_behind(pid) == []


@needs_kernel
@pytest.mark.timeout(60)
def test_stale_namespaces_of_dead_launchers_go_and_live_or_foreign_ones_stay():
    dead = subprocess.Popen(["true"])
    dead.wait()
    alive = subprocess.Popen(["sleep", "60"])
    names = [f"{kernel.PREFIX}{dead.pid}-abc123-n0", f"{kernel.PREFIX}{alive.pid}-abc123-hub",
             f"other-{dead.pid}-abc123-n0"]
    try:
        for name in names:
            subprocess.run(["ip", "netns", "add", name], check=True)
        removed = kernel.clean_stale()
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert removed == [names[0]]
        assert names[1] in listed and names[2] in listed
    finally:
        alive.kill()
        alive.wait()
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _refused(tmp_path: Path, extra: list[str], env: dict | None = None,
             prefix: tuple[str, ...] = ()) -> str:
    """Run with a bad setting; check exit 2, one line, nothing written, no namespace; the line."""
    out = tmp_path / "run"
    res, pid = _flexbench(["run", "--out", str(out), *_small_run(*extra)], env=env,
                          prefix=prefix, timeout=120)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    _nothing_written(out)
    if shutil.which("ip"):
        assert _left_behind(pid) == []
    return lines[0]


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_latency_the_kernel_cannot_add_is_refused(tmp_path):
    if _REASON is None and kernel.has_netem():
        pytest.skip("this kernel has netem, so kernel shaping adds the latency")
    line = _refused(tmp_path, ["--inter-lat", "10ms"])
    if _REASON is None:
        assert "netem" in line and "'10ms'" in line
    else:
        assert "--shaping kernel needs" in line  # privileges are checked first


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_kernel_shaping_without_privileges_is_refused(tmp_path):
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not on the PATH: the tools are checked before "
                    "the privileges")
    if os.geteuid() != 0:
        line = _refused(tmp_path, [])
    elif shutil.which("setpriv"):
        # Root, but with CAP_NET_ADMIN and CAP_SYS_ADMIN gone from the bounding set: after
        # exec, root keeps only what the bounding set allows.
        drop = ("setpriv", "--bounding-set=-net_admin,-sys_admin",
                "--inh-caps=-net_admin,-sys_admin")
        line = _refused(tmp_path, [], prefix=drop)
    else:
        pytest.skip("running as root without setpriv: cannot drop the privileges to test")
    assert "needs root" in line and "CAP_NET_ADMIN" in line


@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra, words", [
    (["--inter-bw", "none"], "needs an inter-node bandwidth"),
    (["--backend", "nccl"], "runs gloo ranks"),
])
@pytest.mark.dist
def test_kernel_shaping_settings_that_cannot_work_are_refused(tmp_path, extra, words):
    assert words in _refused(tmp_path, extra)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_kernel_shaping_under_torchrun_is_refused(tmp_path):
    env = {**ENV, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29999"}
    assert "under torchrun" in _refused(tmp_path, [], env=env)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_validate_sim_with_kernel_shaping_refuses_a_latency_before_any_run(tmp_path):
    if _REASON is None and kernel.has_netem():
        pytest.skip("this kernel has netem, so kernel shaping adds the latency")
    res, _ = _flexbench(["validate-sim", "--shaping", "kernel", "--inter-lat", "5ms",
                         "--out", str(tmp_path / "v.csv")], timeout=60)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert "validate-sim: error:" in lines[0]
    assert not (tmp_path / "v.csv").exists()
