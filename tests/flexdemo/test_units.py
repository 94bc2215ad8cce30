"""Single-process tests of the flexdemo building blocks: transform, codec, wire, validation."""

import io
import math

import pytest
import torch

from flexdemo import (
    METHODS,
    BlockLayout,
    DeMoReplicator,
    DiLoCoReplicator,
    FlexDeMo,
    RandomReplicator,
    StridingReplicator,
    build_optimizer,
    dct_chunked,
    dct_matrix,
    idct_chunked,
    index_dtype,
    largest_divisor_at_most,
    mean_decode,
    pack,
    plan_bucket,
    topk_encode,
    unpack,
)
from flexdemo.codec import decode_indices, encode_indices, topk_indices


def _dct_by_sum(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal DCT-II of the last dim written out as the textbook sum (float64)."""
    n = x.shape[-1]
    out = torch.zeros_like(x, dtype=torch.float64)
    for k in range(n):
        scale = math.sqrt(1.0 / n) if k == 0 else math.sqrt(2.0 / n)
        basis = torch.tensor([math.cos(math.pi * (2 * i + 1) * k / (2 * n)) for i in range(n)],
                             dtype=torch.float64)
        out[..., k] = scale * (x.double() * basis).sum(-1)
    return out


@pytest.mark.parametrize("n", [1, 5, 6, 7, 12])
def test_dct_matrix_is_orthonormal_dct2(n):
    c = dct_matrix(n, torch.float64)
    assert torch.allclose(c @ c.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    x = torch.randn(3, n, dtype=torch.float64)
    assert torch.allclose(x @ c.T, _dct_by_sum(x), atol=1e-12)


def test_largest_divisor():
    assert [largest_divisor_at_most(n, 64) for n in (1, 64, 100, 1024, 97, 384)] == \
        [1, 64, 50, 64, 1, 64]
    assert largest_divisor_at_most(30, 7) == 6


def _blocks(x: torch.Tensor, lay: BlockLayout) -> torch.Tensor:
    """(num_blocks, c1, c2) copy of ``x`` cut into blocks, row-major by block."""
    m = x.reshape(lay.rows // lay.c1, lay.c1, lay.cols // lay.c2, lay.c2)
    return m.permute(0, 2, 1, 3).reshape(-1, lay.c1, lay.c2)


@pytest.mark.parametrize("shape,chunk", [((10, 12), 6), ((7,), 3), ((9, 15), 5), ((30,), 64),
                                         ((4, 3, 5), 6), ((12, 20), 64)])
def test_chunked_dct_is_the_per_block_transform_and_round_trips(shape, chunk):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64)
    lay = BlockLayout.for_shape(shape, chunk)
    natural = dct_chunked(x.reshape(lay.rows, lay.cols), lay.c1, lay.c2)
    # Every block transformed by hand: C1 @ B @ C2^T, where the natural layout puts it.
    c1, c2 = dct_matrix(lay.c1, torch.float64), dct_matrix(lay.c2, torch.float64)
    want = c1 @ _blocks(x, lay) @ c2.T
    assert torch.allclose(_blocks(natural, lay), want, atol=1e-12)
    # Orthonormal: energy is preserved, and the inverse gives x back.
    assert torch.allclose(natural.pow(2).sum(), x.pow(2).sum())
    assert torch.allclose(idct_chunked(natural, lay.c1, lay.c2), x.reshape(lay.rows, lay.cols),
                          atol=1e-12)
    # from_blocks is the inverse of the cut.
    back = lay.from_blocks(_blocks(x, lay), torch.empty(lay.rows, lay.cols, dtype=x.dtype))
    assert torch.equal(back, x.reshape(lay.rows, lay.cols))


def test_chunk_sizes_are_largest_divisors():
    lay = BlockLayout.for_shape((10, 12), 6)
    assert (lay.c1, lay.c2, lay.num_blocks) == (5, 6, 4)
    lay = BlockLayout.for_shape((30,), 7)
    assert (lay.c1, lay.c2, lay.num_blocks) == (1, 6, 5)


@pytest.mark.parametrize("n,k", [(4096, 32), (16384, 32), (64, 32), (30, 5), (1024, 200)])
def test_topk_matches_dense_sort(n, k):
    torch.manual_seed(1)
    x = torch.randn(17, n)
    idx, vals = topk_encode(x, k)
    want = x.abs().topk(k, dim=1).indices.sort(1).values
    assert torch.equal(idx.sort(1).values, want)
    assert torch.equal(vals, x.gather(1, idx))
    assert torch.equal(topk_indices(x, k).sort(1).values, want)


def test_mean_decode_matches_dense_mean_over_contributors():
    torch.manual_seed(2)
    rows, numel, ranks, k = 6, 20, 3, 7
    idx = torch.stack([torch.randperm(numel)[:k] for _ in range(rows * ranks)]).view(ranks, rows, k)
    vals = torch.randn(ranks, rows, k)
    got = mean_decode(idx.permute(1, 0, 2).reshape(rows, -1),
                      vals.permute(1, 0, 2).reshape(rows, -1), numel)
    total = torch.zeros(rows, numel)
    count = torch.zeros(rows, numel)
    for r in range(ranks):
        dense = torch.zeros(rows, numel).scatter_(1, idx[r], vals[r])
        total += dense
        count += torch.zeros(rows, numel).scatter_(1, idx[r], 1.0)
    want = torch.where(count > 0, total / count.clamp_min(1), torch.zeros(()))
    assert torch.allclose(got, want, atol=1e-6)
    # Same as DeMo's scatter_reduce(mean, include_self=False).
    ref = torch.zeros(rows, numel).scatter_reduce(
        1, idx.permute(1, 0, 2).reshape(rows, -1), vals.permute(1, 0, 2).reshape(rows, -1),
        "mean", include_self=False)
    assert torch.allclose(got, ref, atol=1e-6)


def test_index_codec_round_trips_full_range():
    assert index_dtype(65536) == torch.int16 and index_dtype(65537) == torch.int32
    idx = torch.tensor([[0, 1, 32767, 32768, 65535]])
    wire = encode_indices(idx, 65536)
    assert wire.dtype == torch.int16 and torch.equal(decode_indices(wire), idx)
    wire = encode_indices(idx * 2, 200000)
    assert wire.dtype == torch.int32 and torch.equal(decode_indices(wire), idx * 2)


def test_pack_unpack_round_trip():
    torch.manual_seed(3)
    tensors = [torch.randint(-5, 5, (3, 5), dtype=torch.int16), torch.randn(3, 5).bfloat16(),
               torch.randn(7), torch.randint(0, 9, (2, 3), dtype=torch.int32),
               torch.randn(1, 1).bfloat16()]
    segments, total = plan_bucket([(tuple(t.shape), t.dtype) for t in tensors])
    raw = sum(t.numel() * t.element_size() for t in tensors)
    assert total % 4 == 0 and raw <= total < raw + 4
    buf = pack(tensors, segments, total)
    assert buf.dtype == torch.uint8 and buf.numel() == total
    for got, want in zip(unpack(buf, segments), tensors, strict=True):
        assert torch.equal(got[0], want)
    # Two ranks' buckets stacked, as all_gather_into_tensor returns them.
    other = [t * 2 for t in tensors]
    both = torch.stack([buf, pack(other, segments, total)])
    for got, a, b in zip(unpack(both, segments), tensors, other, strict=True):
        assert torch.equal(got[0], a) and torch.equal(got[1], b)


def _tiny():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Linear(10, 6))


@pytest.mark.parametrize("kwargs,needle", [
    ({"compression_topk": 0}, "compression_topk=0"),
    ({"compression_topk": -3}, "compression_topk=-3"),
    ({"compression_chunk": 0}, "compression_chunk=0"),
    ({"compression_decay": 1.0}, "compression_decay=1.0"),
    ({"compression_decay": -0.1}, "compression_decay=-0.1"),
    ({"replicator": "pigeon"}, "replicator='pigeon'"),
    ({"base": "lion"}, "base='lion'"),
    ({"replicator": DeMoReplicator(), "compression_topk": 8}, "compression_topk=8"),
])
def test_bad_input_is_one_clear_value_error(kwargs, needle):
    with pytest.raises(ValueError, match="^" + needle.replace("(", r"\(") ) as err:
        FlexDeMo(_tiny().parameters(), **kwargs)
    assert str(err.value).count(".") >= 1 and "\n" not in str(err.value)


@pytest.mark.parametrize("make,needle", [
    (lambda: DeMoReplicator(topk=0), "topk=0"),
    (lambda: DeMoReplicator(decay=1.0), "decay=1.0"),
    (lambda: DeMoReplicator(value_dtype=torch.int8), "value_dtype=torch.int8"),
    (lambda: DeMoReplicator(replicate_every=0), "replicate_every=0"),
    (lambda: DeMoReplicator(skip_every=0), "skip_every=0"),
    (lambda: RandomReplicator(rate=0.0), "rate=0.0"),
    (lambda: StridingReplicator(chunk=0), "chunk=0"),
    (lambda: DiLoCoReplicator(diloco_h=0), "diloco_h=0"),
    (lambda: DiLoCoReplicator(outer_lr=0.0), "outer_lr=0.0"),
    (lambda: DiLoCoReplicator(outer_momentum=1.0), "outer_momentum=1.0"),
])
def test_replicators_check_their_own_knobs(make, needle):
    with pytest.raises(ValueError, match="^" + needle) as err:
        make()
    assert "\n" not in str(err.value)


def test_schedules_belong_to_the_replicators():
    every2 = DeMoReplicator(replicate_every=2, skip_every=6)
    assert [every2.replicates_on(s) for s in range(1, 7)] == [False, True, False, True, False,
                                                              False]
    diloco = DiLoCoReplicator(diloco_h=3)
    assert [diloco.replicates_on(s) for s in range(1, 7)] == [False, False, True] * 2
    opt = FlexDeMo(_tiny().parameters(), lr=0.1, replicator=DiLoCoReplicator())
    assert (opt.base.name, opt.sign) == ("adamw", False)  # DiLoCo's inner optimizer


def test_diloco_inner_steps_are_plain_adamw_and_refuse_the_sign_knob():
    opt = build_optimizer("diloco", _tiny(), None, lr=0.1, diloco_h=7)
    assert (opt.base.name, opt.sign, opt.replicator.diloco_h) == ("adamw", False, 7)
    with pytest.raises(ValueError, match="^method 'diloco' does not read sign; it takes "
                                         "diloco_h, outer_lr, outer_momentum, outer_format, "
                                         "base, beta1.$"):
        build_optimizer("diloco", _tiny(), None, lr=0.1, sign=True, diloco_h=7)
    opt = build_optimizer("demo", _tiny(), None, lr=0.1, topk=5)
    assert (opt.base.name, opt.sign, opt.replicator.topk) == ("sign", True, 5)


def test_unknown_method_is_rejected():
    with pytest.raises(ValueError, match=r"^method='sgd' is unknown; use one of flexdemo"):
        build_optimizer("sgd", _tiny(), None, lr=0.1)
    assert "flexdemo" in METHODS and "hsdp-adamw" in METHODS


def test_single_replica_sends_nothing_and_applies_whole_momentum():
    model = _tiny()
    before = [p.detach().clone() for p in model.parameters()]
    opt = FlexDeMo(model.parameters(), lr=0.01, compression_topk=2, compression_chunk=4)
    model(torch.randn(4, 12)).pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    assert opt.last_step_comm == {"bytes_sent": 0, "bytes_received": 0, "calls": 0}
    for p, b, g in zip(model.parameters(), before, grads, strict=True):
        # One replica: delta = lr*grad is sent whole, so the update is -lr*sign(grad).
        assert torch.allclose(p.detach(), b - 0.01 * g.sign(), atol=1e-6)


@pytest.mark.parametrize("replicator", [DeMoReplicator, RandomReplicator, StridingReplicator,
                                        lambda: DiLoCoReplicator(diloco_h=2)])
def test_state_dict_survives_torch_save_with_weights_only(replicator):
    model = _tiny()
    opt = FlexDeMo(model.parameters(), lr=0.01, replicator=replicator())
    for _ in range(3):
        model.zero_grad()
        model(torch.randn(4, 12)).pow(2).sum().backward()
        opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    fresh = FlexDeMo(_tiny().parameters(), lr=0.5, replicator=replicator())
    fresh.load_state_dict(loaded)
    assert fresh.steps == 3 and fresh.param_groups[0]["lr"] == 0.01
    for a, b in zip(_flat_tensors(fresh.state_dict()), _flat_tensors(opt.state_dict()),
                    strict=True):
        assert torch.equal(a, b)


def _flat_tensors(state):
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for k in sorted(state) for t in _flat_tensors(state[k])]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _flat_tensors(v)]
    return []


def test_method_defaults_fill_only_what_is_not_given():
    from flexdemo import method_record

    def wire(method, **given):
        values = method_record(method).resolved(given)
        return values["topk"], values["chunking"], values["value_format"]

    assert wire("flexdemo") == (4, "flat", "bf16-packed")
    assert wire("flexdemo", value_dtype="fp32") == (4, "flat", "fp32-packed")
    assert wire("demo") == (32, "block", "bf16")  # DeMo's own setting
    assert wire("demo", value_dtype="fp32") == (32, "block", "fp32")
    assert wire("flexdemo", topk=32, chunking="block", value_format="bf16") == (32, "block",
                                                                              "bf16")
    # value_dtype only picks the float of the default format: a format given as well wins.
    assert wire("flexdemo", value_dtype="fp32", value_format="int8")[2] == "int8"


def test_largest_divisor_counts_down_as_the_divisor_walk_does():
    def walk(n: int, target: int) -> int:  # every divisor pair up to sqrt(n)
        pairs = [(i, n // i) for i in range(1, int(n**0.5) + 1) if n % i == 0]
        return max([d for pair in pairs for d in pair if d <= target], default=1)

    for n in (2, 3, 97, 128, 1000, 4095, 65536, 10**8 + 7, 7 * 64 * 1_000_003):
        for target in (1, 2, 7, 64, 100, 10**5):
            assert largest_divisor_at_most(n, target) == walk(n, target), (n, target)
