"""Process groups that end with the run: no gloo thread outlives teardown into interpreter exit
(where one that takes the GIL aborts the process)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist

from netsim import shaping
from tests.dist_utils import init_loopback, shaped_world, spawn, threads_after_exits, train_step

_ROOT = Path(__file__).resolve().parents[2]

# A fresh interpreter (pytest's own has imported torch's modules long before): join a one-rank
# gloo world, take an optimizer step (torch.optim imports torch._dynamo, which imports
# torch.distributed.nn.functional), destroy the group, print the threads still running.
_SCRIPT = textwrap.dedent("""
    import gc, os, sys
    import torch
    import torch.distributed as dist
    from netsim.processes import init_process_group

    init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    param = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([param])
    param.grad = torch.ones(3)
    opt.step()
    dist.all_reduce(param.grad)
    dist.destroy_process_group()
    gc.collect()
    from tests.dist_utils import threads_after_exits
    print(",".join(threads_after_exits()))
""")


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc (Linux)")
def test_no_gloo_thread_outlives_destroy_process_group(tmp_path):
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / "store")], cwd=_ROOT,
                         capture_output=True, text=True, timeout=100, check=True)
    threads = out.stdout.strip().splitlines()[-1].split(",")
    # gloo's worker threads (pt_gloo_runloop) and its socket loop (gloo_tcp_loop) end only when
    # the group is freed; alive here, they would run on into interpreter shutdown.
    assert not [t for t in threads if "gloo" in t], threads


def _train_then_teardown(rank: int, world: int, store: str, out: str) -> None:
    init_loopback(rank, world, store)
    recorder, model, mesh, opt = shaped_world(rank, 2, 1, "flexdemo")  # FSDP2, DTensors
    train_step(model, opt, recorder, rank, 0)
    del recorder, model, mesh, opt  # the caller's handles; teardown frees what else holds groups
    dist.barrier()
    shaping.teardown()
    Path(out, f"rank{rank}.txt").write_text(",".join(threads_after_exits()))


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc (Linux)")
def test_teardown_ends_every_gloo_thread_of_an_fsdp2_run(tmp_path):
    spawn(_train_then_teardown, (2, str(tmp_path / "store"), str(tmp_path)), 2)
    for rank in range(2):
        threads = (tmp_path / f"rank{rank}.txt").read_text().split(",")
        # DTensor's sharding cache and the run's cycles held the mesh's groups before teardown.
        assert not [t for t in threads if "gloo" in t], threads
