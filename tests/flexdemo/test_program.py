"""A replicator's program (flexdemo/program.py): what each built-in one says, step by step."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from flexdemo.build import has_program, program_of
from flexdemo.knobs import DeMoKnobs, PowerSGDKnobs, ReduceKnobs, StreamingDiLoCoKnobs
from flexdemo.methods import RECORDS, Method, method_record
from flexdemo.program import OPS, Op, Program
from flexdemo.replicators import (
    DeMoReplicator,
    FullReplicator,
    GossipReplicator,
    PowerSGDReplicator,
    ReduceReplicator,
    StreamingDiLoCoReplicator,
)
from flexdemo.replicators.powersgd import plan_powersgd
from flexdemo.replicators.reduce import reduce_payloads

SHAPES = [(64, 32), (64,), (32, 16), (16,)]


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_the_program_module_imports_without_torch():
    code = "import sys, flexdemo.program; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_an_op_of_an_unknown_kind_is_one_sentence():
    with pytest.raises(ValueError) as err:
        Op("all_to_some", 8)
    assert str(err.value) == (f"op='all_to_some' is unknown; use one of {', '.join(OPS)}.")


def test_every_method_has_a_program_and_the_full_replicator_none():
    assert all(has_program(record) for record in RECORDS)
    assert not has_program(Method("full-sync", "full"))
    assert FullReplicator.program(FullReplicator.knobs_type(), SHAPES, 2) is None
    assert program_of(method_record("hsdp-adamw"), ReduceKnobs(), SHAPES, 2).posts(1) == []


def test_demo_with_delay_waits_on_the_previous_replicating_step():
    knobs = DeMoKnobs(delay=1, lookahead=False, replicate_every=2)
    program = DeMoReplicator.program(knobs, SHAPES, 4)
    assert (program.period, program.exchanges) == (2, 1)
    assert [program.posts(s) != [] for s in range(1, 5)] == [False, True, False, True]
    assert program.waits(2) == [] and program.waits(4) == [2] and program.waits(3) == []


def test_powersgd_runs_its_all_reduces_one_after_another_from_its_start():
    knobs = PowerSGDKnobs(powersgd_rank=2, powersgd_start=3)
    program = PowerSGDReplicator.program(knobs, SHAPES, 2)
    assert program.steady_from == 4 and program.posts(5) == []
    whole = [Op("all_reduce", 4 * sum(math.prod(s) for s in SHAPES))]
    assert program.blocking(3) == whole
    plan = plan_powersgd(SHAPES, knobs)
    assert program.blocking(4) == [Op("all_reduce", 4 * n) for n in
                                   (plan.whole_numel, plan.p_numel, plan.q_numel)]
    assert "first 3 step(s)" in program.notes()[0]


def test_an_int8_reduce_is_an_all_to_all_then_an_all_gather_every_step():
    program = ReduceReplicator.program(ReduceKnobs(reduce_format="int8"), SHAPES, 4)
    (a2a, a2a_bytes), (gather, block) = reduce_payloads(SHAPES, "int8", 4)
    assert (a2a, gather) == ("all_to_all", "all_gather") and a2a_bytes == 4 * block
    assert program.blocking(7) == [Op(a2a, a2a_bytes), Op(gather, block)]
    assert program.state_bytes == 3 * a2a_bytes


def test_streaming_posts_a_fragment_tau_steps_before_it_waits_on_it():
    knobs = StreamingDiLoCoKnobs(sync_every=8, num_fragments=2, fragment_sync_delay=1)
    program = StreamingDiLoCoReplicator.program(knobs, SHAPES, 2)
    posted = {s: [op.key for op in program.posts(s)] for s in range(1, 9)}
    assert {s: k for s, k in posted.items() if k} == {3: [0], 7: [1]}
    assert program.waits(4) == [0] and program.waits(8) == [1] and program.waits(3) == []
    assert sum(sum(e.values()) for e in (program.unit_elements(3)[0],
                                         program.unit_elements(7)[1])) == sum(
        math.prod(s) for s in SHAPES)


def test_gossip_messages_name_the_replicas_at_the_other_end():
    knobs = GossipReplicator.knobs_type(graph="ring")
    program = GossipReplicator.program(knobs, SHAPES, 4, node=1)
    ops = program.posts(1)
    assert sorted((op.op, op.peer) for op in ops) == [("recv", 0), ("recv", 2), ("send", 0),
                                                      ("send", 2)]
    assert program.waits(1) == [op.key for op in ops] and program.ends_step
    exact = GossipReplicator.program(GossipReplicator.knobs_type(graph="complete"), SHAPES, 4)
    assert exact.posts(1) == [] and [op.op for op in exact.blocking(1)] == ["all_reduce"]


def test_a_program_with_no_replicas_to_exchange_with_still_states_its_memory():
    program = program_of(method_record("diloco"), method_record("diloco").knobs, SHAPES, 1)
    assert isinstance(program, Program) and program.state_bytes == 2 * 4 * sum(
        math.prod(s) for s in SHAPES)
