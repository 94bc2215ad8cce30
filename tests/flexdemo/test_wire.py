"""Single-process tests of the wire formats, flat chunking, schedules and reference deviations."""

import pytest
import torch

from flexdemo import (
    VALUE_FORMATS,
    DeMoReplicator,
    FlexDeMo,
    RandomReplicator,
    StridingReplicator,
    index_width,
    make_format,
    pack,
    pack_bits,
    packed_nbytes,
    plan_bucket,
    unpack,
    unpack_bits,
)


@pytest.mark.parametrize("width", [*range(1, 17), 20, 24, 31, 32])
@pytest.mark.parametrize("count", [1, 3, 8, 13, 64, 1001])
def test_bit_packing_round_trips_every_width_and_odd_counts(width, count):
    g = torch.Generator().manual_seed(width * 1000 + count)
    values = torch.randint(0, 2**width, (2, count), generator=g)
    values[0, 0] = 2**width - 1  # the largest value must survive the top bit
    packed = pack_bits(values, width)
    assert packed.dtype == torch.uint8 and packed.shape == (2, packed_nbytes(count, width))
    assert torch.equal(unpack_bits(packed, width, count), values)


def test_index_width_is_ceil_log2_of_the_chunk():
    assert [index_width(n) for n in (2, 5, 8, 64, 4096, 65536, 2**20 + 1)] == [1, 3, 3, 6, 12,
                                                                             16, 21]
    with pytest.raises(ValueError, match=r"^width=33 must be an integer in \[1, 32\]"):
        pack_bits(torch.zeros(3, dtype=torch.int64), 33)


def _picked(blocks: int = 7, k: int = 5, numel: int = 64):
    g = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(numel, generator=g)[:k] for _ in range(blocks)])
    vals = torch.randn(blocks, k, generator=g) * torch.logspace(-6, 0, blocks).unsqueeze(1)
    vals[2] = 0.0  # an all-zero chunk must not divide by a zero scale
    return idx, vals


def _through_the_wire(fmt, idx, vals, numel):
    """Encode, pack into a one-rank bucket, unpack and decode: what a receiver reads."""
    blocks, k = idx.shape
    tensors, read = fmt.encode(idx, vals, numel)
    segments, total = plan_bucket(fmt.specs(blocks, k, numel))
    views = unpack(pack(tensors, segments, total), segments)
    got_idx, got_vals = fmt.decode(views, blocks, k, numel, vals.dtype)
    return tensors, read, got_idx[0], got_vals[0], total


@pytest.mark.parametrize("name", VALUE_FORMATS)
def test_formats_round_trip_and_report_what_receivers_read(name):
    idx, vals = _picked()
    fmt = make_format(name, torch.bfloat16)
    _, read, got_idx, got_vals, _ = _through_the_wire(fmt, idx, vals, 64)
    assert torch.equal(got_idx, idx)
    expected = vals if read is None else read.to(vals.dtype)
    assert torch.equal(got_vals.to(vals.dtype), expected)
    assert torch.all(got_vals[2] == 0)


def test_quantizers_stay_within_their_step():
    idx, vals = _picked()
    scale = vals.abs().amax(1, keepdim=True)
    for name, bound in (("int8", 1 / 127), ("int2", 1 / 3)):
        _, read, *_ = _through_the_wire(make_format(name, torch.float32), idx, vals, 64)
        # Half a step of the max-abs scale, plus bf16's rounding of the scale itself.
        assert torch.all((read - vals).abs() <= scale * (bound + 2**-7) + 1e-12), name
    _, read, *_ = _through_the_wire(make_format("sign", torch.float32), idx, vals, 64)
    mean = vals.abs().mean(1, keepdim=True).to(torch.bfloat16).float()
    assert torch.equal(read.abs(), mean.expand_as(read))
    assert torch.all((read.sign() == vals.sign()) | (vals == 0))


@pytest.mark.parametrize("name,nbytes", [
    ("fp32", 35 * (2 + 4)), ("bf16", 35 * (2 + 2)),
    # 35 indices at 6 bits pad to 40 (30 bytes); scales are one bf16 per chunk.
    ("bf16-packed", 30 + 70), ("int8", 30 + 35 + 14), ("int2", 30 + 10 + 14),
    ("sign", 30 + 5 + 14),
])
def test_bucket_bytes_per_format(name, nbytes):
    idx, vals = _picked()
    *_, total = _through_the_wire(make_format(name, torch.bfloat16), idx, vals, 64)
    assert total == nbytes + (-nbytes % 4)


def _tiny(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Linear(10, 6))


def _grads(model: torch.nn.Module, step: int) -> list[torch.Tensor]:
    model.zero_grad()
    g = torch.Generator().manual_seed(step)
    model(torch.randn(4, 12, generator=g)).pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("name", ["bf16", "bf16-packed", "int8", "int2", "sign"])
@pytest.mark.parametrize("chunking", ["block", "flat"])
def test_error_feedback_sent_plus_kept_equals_fp32(name, chunking):
    # Two replicators over the same momentum: fp32 sends it exactly, `name` rounds or
    # quantizes; what it sends plus what it keeps must be exactly what fp32 sent and kept.
    # Both in the fast arithmetic, whose momentum is the DCT coefficients compared here.
    params = [p.detach() for p in _tiny().parameters()]
    grads = _grads(_tiny(), 0)
    reps = []
    for fmt in ("fp32", name):
        rep = DeMoReplicator(topk=3, chunk=8, decay=0.9, value_format=fmt, chunking=chunking,
                             arithmetic="fast")
        rep.setup(params, None, 2)  # two replicas, but no collective is called here
        rep.decay_and_add(grads, [0.01] * len(grads))
        picked = rep.dct_topk()
        wire = rep.to_wire(picked)
        rep.remove_sent(picked, wire)
        reps.append((rep, picked, wire))
    (ref, ref_picked, _), (rep, picked, wire) = reps
    for n, (g_ref, g) in enumerate(zip(ref.groups, rep.groups, strict=True)):
        (idx, vals), (_, read) = picked[n], wire[n]
        sent = torch.zeros_like(g.delta).scatter_(1, idx, read.to(vals.dtype))
        ref_idx, ref_vals = ref_picked[n]
        ref_sent = torch.zeros_like(g_ref.delta).scatter_(1, ref_idx, ref_vals)
        assert torch.allclose(g.delta + sent, g_ref.delta + ref_sent, atol=1e-9, rtol=0)
        assert not torch.equal(sent, ref_sent)  # the format did lose something to feed back


def test_flat_chunking_cuts_the_flattened_shard():
    model = _tiny()
    opt = FlexDeMo(model.parameters(), lr=0.01, compression_topk=3, compression_chunk=8,
                   chunking="flat")
    # W1 120 -> 15 chunks of 8; b1 10 -> 2 of 5; W2 60 -> 10 of 6; b2 6 -> 1 of 6.
    assert [(g.c1, g.c2, g.num_blocks) for g in opt.replicator.groups] == [
        (1, 5, 2), (1, 6, 11), (1, 8, 15)]


def _deltas(rep) -> list[torch.Tensor]:
    if isinstance(rep, DeMoReplicator):
        return [g.delta.clone() for g in rep.groups]
    return [d.clone() for d in rep.delta]


@pytest.mark.parametrize("make", [
    lambda **kw: DeMoReplicator(topk=2, chunk=4, replicate_every=2, **kw),
    lambda **kw: RandomReplicator(rate=0.5, replicate_every=2, **kw),
    lambda **kw: StridingReplicator(rate=0.5, chunk=4, skip_every=1, **kw),
])
def test_non_replicating_steps_leave_the_momentum_untouched(make):
    model = _tiny()
    opt = FlexDeMo(model.parameters(), lr=0.01, replicator=make())
    before = [p.detach().clone() for p in model.parameters()]
    grads = _grads(model, 0)
    opt.step()  # step 1 is off the schedule
    assert all(torch.count_nonzero(d) == 0 for d in _deltas(opt.replicator))
    for p, b, g in zip(model.parameters(), before, grads, strict=True):
        assert torch.allclose(p.detach(), b - 0.01 * g.sign())  # the local gradient's sign step
    folded_model = _tiny()
    folded = FlexDeMo(folded_model.parameters(), lr=0.01, replicator=make(fold_skipped=True))
    _grads(folded_model, 0)
    folded.step()
    assert any(torch.count_nonzero(d) > 0 for d in _deltas(folded.replicator))


def test_random_replicator_sends_rate_of_a_1d_tensor():
    params = [torch.zeros(1000), torch.zeros(40, 25)]
    rep = RandomReplicator(rate=0.1)
    rep.setup(params, None, 2)
    for _ in range(3):
        rows = rep._selection()
        sent = [r.numel() * rep._rows(p).shape[1] for r, p in zip(rows, params, strict=True)]
        assert sent == [100, 4 * 25]


def test_sign_false_steps_by_lr_times_momentum_not_lr_squared():
    lr = 0.1
    for chunking in ("block", "flat"):
        model = _tiny()
        before = [p.detach().clone() for p in model.parameters()]
        opt = FlexDeMo(model.parameters(), lr=lr, compression_topk=2, compression_chunk=4,
                       sign=False, chunking=chunking)
        grads = _grads(model, 0)
        opt.step()
        # One replica: the whole momentum lr * grad is the update, applied once: plain SGD.
        for p, b, g in zip(model.parameters(), before, grads, strict=True):
            assert torch.allclose(p.detach(), b - lr * g, atol=1e-6), chunking
    # Off the schedule the update is the bare gradient: the base multiplies by lr as usual.
    model = _tiny()
    before = [p.detach().clone() for p in model.parameters()]
    opt = FlexDeMo(model.parameters(), lr=lr, sign=False,
                   replicator=RandomReplicator(replicate_every=2))
    grads = _grads(model, 0)
    opt.step()
    for p, b, g in zip(model.parameters(), before, grads, strict=True):
        assert torch.allclose(p.detach(), b - lr * g, atol=1e-6)


@pytest.mark.parametrize("make,needle", [
    (lambda: DeMoReplicator(chunking="rows"), "chunking='rows' is unknown; use one of block"),
    (lambda: DeMoReplicator(value_format="int4"),
     "value_format='int4' is unknown; use one of fp32"),
    (lambda: DeMoReplicator(topk=65, chunk=64, chunking="flat"),
     "topk=65 is larger than a flat chunk of chunk=64 elements"),
    (lambda: FlexDeMo(_tiny().parameters(), chunking="diagonal"), "chunking='diagonal'"),
    (lambda: FlexDeMo(_tiny().parameters(), replicator="random", chunking="flat"),
     "chunking='flat' only applies to replicator='demo'"),
])
def test_bad_wire_input_is_one_clear_sentence(make, needle):
    with pytest.raises(ValueError, match="^" + needle) as err:
        make()
    assert "\n" not in str(err.value) and str(err.value).endswith(".")


def test_defaults_keep_todays_layout():
    rep = DeMoReplicator()
    assert (rep.chunking, rep.format.name, rep.fold_skipped) == ("block", "bf16", False)
    rep.setup([torch.zeros(128, 64)], None, 2)
    # Two 64x64 blocks x 32: int16 indices and bf16 values, 4 bytes per coefficient.
    assert rep.bucket_bytes == 2 * 32 * 4


@pytest.mark.parametrize("kwargs,needle", [
    ({"chunking": "rows"}, "chunking='rows' is unknown"),
    ({"value_format": "int4"}, "value_format='int4' is unknown"),
    ({"chunking": "flat", "topk": 65}, "topk=65 is larger than a flat chunk"),
    ({"value_dtype": "fp16"}, "value_dtype='fp16' is unknown; use one of bf16, fp32."),
])
def test_run_config_checks_the_wire_knobs(kwargs, needle):
    # The replicator's schema (flexdemo.knobs.DeMoKnobs) is the one check, run and library alike.
    from experiments.config import RunConfig
    from experiments.errors import ConfigError

    with pytest.raises(ConfigError, match="^" + needle):
        RunConfig(**kwargs).validate()
    RunConfig(chunking="flat", topk=4, value_format="sign").validate()
