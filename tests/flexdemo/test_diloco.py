"""diloco's outer_format and local-sgd, its record with an outer SGD of lr 1 and no momentum."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from flexdemo import FlexDeMo, build_optimizer, method_record
from flexdemo.knobs import DiLoCoKnobs
from flexdemo.replicators import DiLoCoReplicator
from flexdemo.replicators.diloco import outer_payload
from flexdemo.wire import all_reduce_bytes
from tests.dist_utils import run_ranks

LR = 0.01
STEPS = 9


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _set_grads(params: list[torch.Tensor], step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)  # every replica its own gradients
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _expected_bytes(fmt: str, numel: int, ranks: int) -> int:
    """Per-rank bytes of one sync, from the documented closed form (docs/methods.md)."""
    if fmt in ("fp32", "bf16"):
        return 2 * (ranks - 1) * numel * (4 if fmt == "fp32" else 2) // ranks  # ring all-reduce
    codes = numel if fmt == "int8" else math.ceil(numel / 8) * 4  # 4-bit: groups of 8 codes
    return (ranks - 1) * math.ceil((codes + 4) / 4) * 4  # all-gather of codes + fp32 scale


class _DiLoCoBefore(DiLoCoReplicator):
    """diloco's outer sync as it was before outer_format: one fp32 all-reduce, Nesterov SGD."""

    def setup(self, params, group, ranks):
        super().setup(params, group, ranks)
        self.outer = torch.optim.SGD(self.anchor, lr=self.outer_lr,
                                     momentum=self.outer_momentum, nesterov=True)

    def after_update(self, params, stats):
        pseudo = self._all_reduce_mean(
            [a - p for a, p in zip(self.anchor, params, strict=True)], stats)
        for a, g in zip(self.anchor, pseudo, strict=True):
            a.grad = g
        self.outer.step()
        for a, p in zip(self.anchor, params, strict=True):
            a.grad = None
            p.copy_(a)


def test_local_sgd_is_diloco_with_an_outer_sgd_of_lr_one_and_no_momentum():
    local, diloco = method_record("local-sgd"), method_record("diloco")
    assert local.replicator == diloco.replicator == "diloco"
    assert local.knobs == DiLoCoKnobs(outer_lr=1.0, outer_momentum=0.0)
    assert local.takes == diloco.takes and not local.takes_sign
    opt = build_optimizer("local-sgd", _model(), None)
    assert (opt.base.name, opt.sign, opt.replicator.outer.defaults["nesterov"]) == \
        ("adamw", False, False)


def test_outer_payload_is_the_closed_form_per_format():
    assert outer_payload([30, 18], 4) == ("all_reduce", 4 * 48)  # fp32: as it always was
    for fmt in ("fp32", "bf16", "int8", "4bit"):
        op, nbytes = outer_payload([30, 18], outer_format=fmt)
        assert op == ("all_reduce" if fmt in ("fp32", "bf16") else "all_gather")
        want = _expected_bytes(fmt, 48, 2)
        assert (all_reduce_bytes(nbytes, 2) if op == "all_reduce" else nbytes) == want, fmt


def test_an_unknown_outer_format_is_one_sentence():
    with pytest.raises(ValueError) as err:
        method_record("diloco").settings({"outer_format": "fp16"})
    assert str(err.value) == "outer_format='fp16' is unknown; use one of fp32, bf16, int8, 4bit."


# -- two gloo ranks ----------------------------------------------------------------------------
def _run(rep: DiLoCoReplicator, rank: int, before_sync: list | None = None) -> tuple[list, list]:
    """Parameters after every step, and the per-step comm, of ``rep`` on this rank's grads."""
    params = list(_model().parameters())
    opt = FlexDeMo(params, lr=LR, replicator=rep)
    if before_sync is not None:  # the parameters each sync starts from
        after = rep.after_update

        def spied(shards, stats):
            before_sync.append([s.clone() for s in shards])
            after(shards, stats)

        rep.after_update = spied
    history, comm = [], []
    for s in range(1, STEPS + 1):
        _set_grads(params, s, rank)
        opt.step()
        history.append([p.detach().clone() for p in params])
        comm.append(opt.last_step_comm)
    return history, comm


def _check_local_sgd(rank: int, world: int) -> None:
    starts: list = []
    knobs, _ = method_record("local-sgd").settings({"diloco_h": 3})
    local, _ = _run(DiLoCoReplicator(knobs), rank, starts)
    diloco, _ = _run(DiLoCoReplicator(diloco_h=3, outer_lr=1.0, outer_momentum=0.0), rank)
    for s, (a, b) in enumerate(zip(local, diloco, strict=True), start=1):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), (rank, s)  # bit for bit
    # ... and a sync leaves every replica at the mean of the replicas' parameters.
    for k, s in enumerate(range(3, STEPS + 1, 3)):
        for x, start in zip(local[s - 1], starts[k], strict=True):
            total = start.clone()
            dist.all_reduce(total)
            torch.testing.assert_close(x, total / world, rtol=0, atol=1e-6)


def _check_fp32_unchanged(rank: int, world: int) -> None:
    now, now_comm = _run(DiLoCoReplicator(diloco_h=3), rank)
    before, before_comm = _run(_DiLoCoBefore(diloco_h=3), rank)
    assert now_comm == before_comm
    for s, (a, b) in enumerate(zip(now, before, strict=True), start=1):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), (rank, s)


def _check_formats(rank: int, world: int) -> None:
    numel = sum(p.numel() for p in _model().parameters())
    for fmt in ("fp32", "bf16", "int8", "4bit"):
        history, comm = _run(DiLoCoReplicator(diloco_h=3, outer_format=fmt), rank)
        for s, (params, c) in enumerate(zip(history, comm, strict=True), start=1):
            want = _expected_bytes(fmt, numel, world) if s % 3 == 0 else 0
            assert c == {"bytes_sent": want, "bytes_received": want,
                         "calls": int(s % 3 == 0)}, (fmt, s)
            if s % 3 == 0:  # every replica at the same parameters after a sync
                for p in params:
                    both = [torch.empty_like(p) for _ in range(world)]
                    dist.all_gather(both, p)
                    assert torch.equal(both[0], both[1]), (fmt, s)


def _two_ranks(rank: int, world: int) -> None:
    _check_local_sgd(rank, world)
    _check_fp32_unchanged(rank, world)
    _check_formats(rank, world)


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_local_sgd_fp32_and_formats_on_two_ranks():
    run_ranks(_two_ranks, 2)
