"""Tests of tileq.quant: int4 packing, block quantization bounds, contract-shaped wrappers."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tileq.dtypes import OperandType, PackedInt4
from tileq.errors import DTypeError, ScaleError, ShapeError
from tileq.quant import (
    QMAX,
    dequantize,
    dequantize_a,
    dequantize_b,
    int32_overflow_k_limit,
    is_preshuffled,
    pack_int4,
    preshuffle_scale,
    quantize,
    quantize_a,
    quantize_b,
    quantize_weight,
    unpack_int4,
    unshuffle_scale,
)

I8, I4, FP8, BF8 = OperandType.I8, OperandType.I4, OperandType.FP8, OperandType.BF8
ALL = (I8, I4, FP8, BF8)

# Round-to-nearest error of one element, in units of its scale: |x/s - q| <= rel*|x/s| + abs.
# int: half a step. e4m3: 3 mantissa bits -> 2**-4 relative; subnormal spacing 2**-9 -> 2**-10.
# e5m2: 2 mantissa bits -> 2**-3 relative; subnormal spacing 2**-16 -> 2**-17.
ROUNDING = {I8: (0.0, 0.5), I4: (0.0, 0.5), FP8: (2.0**-4, 2.0**-10), BF8: (2.0**-3, 2.0**-17)}
FP_SLACK = 1e-5  # fp32 division and multiplication, relative


def rand_int4(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 8, shape, generator=g, dtype=torch.int8)


def rand_float(shape, seed=0):
    """Normal values whose magnitude varies by row and column, so per-block scales matter."""
    g = torch.Generator().manual_seed(seed)
    R, C = shape
    mag = torch.exp(2 * torch.randn(R, 1, generator=g)) * torch.exp(torch.randn(1, C, generator=g))
    return torch.randn(R, C, generator=g) * mag


def assert_within_bound(x, deq, scale_full, otype):
    """Elementwise rounding bound; also proves the values are far above it (not all zeros)."""
    rel, ab = ROUNDING[otype]
    bound = rel * x.abs() + ab * scale_full
    bound = bound * (1 + FP_SLACK) + FP_SLACK * x.abs()
    err = (x - deq).abs()
    assert torch.isfinite(deq).all()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"
    # The coarsest bounds: int4 half a step is amax/14, e5m2 rounds to 1/8 of the value.
    assert x.abs().max() > 5 * bound.max()
    assert deq.abs().max() > 0.5 * x.abs().max()


def full_scale(scale, block, shape):
    """Reference per-element scale, written independently of the module (gather by block index)."""
    R, C = shape
    br, bc = block[0] or R, block[1] or C
    grid_rows = 1 if block[0] is None else math.ceil(R / br)
    s2d = scale.reshape(grid_rows, -1)  # 0-d, [M], [N] and 2-D scales alike
    return s2d[torch.arange(R) // br][:, torch.arange(C) // bc]


# ----------------------------------------------------------------------------- pack / unpack


def test_pack_hand_computed_bytes():
    assert pack_int4(torch.tensor([[-8, 7]])).data.tolist() == [[0x0F]]
    assert pack_int4(torch.tensor([[1, -1]])).data.tolist() == [[0x97]]
    # Along dim 0 the pair is a column; element 2j (the top one) is the high nibble.
    p = pack_int4(torch.tensor([[1], [-1]]), dim=0)
    assert p.data.tolist() == [[0x97]] and p.packed_dim == 0 and p.shape == (2, 1)


@pytest.mark.parametrize("dim", [0, 1, -1, -2])
def test_pack_round_trip_and_layout(dim):
    x = rand_int4((6, 10), seed=dim + 5)
    p = pack_int4(x, dim=dim)
    d = dim % 2
    assert p.shape == (6, 10) and p.packed_dim == d
    assert p.data.dtype == torch.uint8
    assert p.data.numel() * 2 == x.numel()  # half the bytes of the logical element count
    assert p.data.stride(d) == 1
    assert p.data.shape[d] == x.shape[d] // 2
    u = unpack_int4(p)
    assert u.dtype == torch.int8 and torch.equal(u, x)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64])
def test_pack_accepts_any_int_dtype(dtype):
    x = rand_int4((4, 8), seed=3)
    assert torch.equal(pack_int4(x.to(dtype)).data, pack_int4(x).data)


def test_unpack_sliced_buffers():
    x = rand_int4((6, 16), seed=7)
    wide = pack_int4(x, dim=1)
    cols = PackedInt4(wide.data[:, :3], (6, 6), 1)  # leading dimension 8 > 3 bytes
    assert not cols.data.is_contiguous()
    assert torch.equal(unpack_int4(cols), x[:, :6])
    y = rand_int4((16, 5), seed=8)
    tall = pack_int4(y, dim=0)
    rows = PackedInt4(tall.data[2:5, :], (6, 5), 0)  # leading dimension 8 > 3 bytes
    assert not rows.data.is_contiguous()
    assert torch.equal(unpack_int4(rows), y[4:10, :])


@settings(max_examples=50, deadline=None)
@given(
    rows=st.integers(0, 9),
    half=st.integers(0, 9),
    dim=st.sampled_from([0, 1]),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_round_trip_property(rows, half, dim, seed):
    shape = (2 * half, rows) if dim == 0 else (rows, 2 * half)
    x = rand_int4(shape, seed=seed)
    p = pack_int4(x, dim=dim)
    assert p.data.numel() * 2 == x.numel()
    assert torch.equal(unpack_int4(p), x)
    assert torch.equal(unpack_int4(p.t()), x.t())  # transposing moves no bytes


def test_pack_refusals():
    with pytest.raises(ShapeError, match=r"x: expected an even extent along dim 1.*\(2, 3\)"):
        pack_int4(torch.zeros(2, 3, dtype=torch.int8))
    with pytest.raises(ShapeError, match=r"x: expected an even extent along dim 0"):
        pack_int4(torch.zeros(3, 2, dtype=torch.int8), dim=0)
    with pytest.raises(ScaleError, match=r"x: expected int4 values in \[-8, 7\], got min -9, max 8"):
        pack_int4(torch.tensor([[-9, 8]]))
    with pytest.raises(DTypeError, match=r"x: expected an integer tensor"):
        pack_int4(torch.zeros(2, 2))
    with pytest.raises(ShapeError, match=r"dim: expected 0, 1, -1 or -2"):
        pack_int4(torch.zeros(2, 2, dtype=torch.int8), dim=2)
    with pytest.raises(DTypeError, match=r"p: expected a tileq.PackedInt4"):
        unpack_int4(torch.zeros(2, 2, dtype=torch.uint8))


# ----------------------------------------------------------------------------- quantize bounds


@pytest.mark.parametrize("otype", ALL)
@pytest.mark.parametrize("block", [(None, None), (1, None), (None, 1), (1, 128), (128, 128), (5, 7)])
def test_quantize_bound_partial_blocks(otype, block):
    x = rand_float((37, 200), seed=11)  # 200 = 128 + a partial group of 72
    q, s = quantize(x, otype, block=block)
    assert s.dtype == torch.float32
    br, bc = block[0] or 37, block[1] or 200
    assert s.shape == (math.ceil(37 / br), math.ceil(200 / bc))
    if otype is I4:
        assert isinstance(q, PackedInt4) and q.shape == (37, 200) and q.packed_dim == 1
    else:
        assert q.dtype == otype.torch_dtype and q.shape == (37, 200)
    deq = dequantize(q, s, block=block)
    assert deq.dtype == torch.float32
    assert_within_bound(x, deq, full_scale(s, block, x.shape), otype)


@settings(max_examples=50, deadline=None)
@given(
    otype=st.sampled_from(ALL),
    rows=st.integers(1, 24),
    cols=st.integers(1, 24),
    br=st.one_of(st.none(), st.integers(1, 30)),
    bc=st.one_of(st.none(), st.integers(1, 30)),
    seed=st.integers(0, 2**31 - 1),
)
def test_quantize_bound_property(otype, rows, cols, br, bc, seed):
    if otype is I4:
        cols = 2 * cols
    x = rand_float((rows, cols), seed=seed) + 1e-3  # +1e-3: no exactly-zero block
    q, s = quantize(x, otype, block=(br, bc))
    deq = dequantize(q, s, block=(br, bc))
    rel, ab = ROUNDING[otype]
    sf = full_scale(s, (br, bc), x.shape)
    bound = (rel * x.abs() + ab * sf) * (1 + FP_SLACK) + FP_SLACK * x.abs()
    assert ((x - deq).abs() <= bound).all()
    # scale = amax(|block|) / QMAX, so some element of every block hits +-QMAX (up to rounding);
    # int4's GPTQ grid (scale = amax / 7.5, q in [-8, 7]) puts it on 7 or -8.
    qv = unpack_int4(q) if otype is I4 else q
    if otype is I4:
        assert qv.float().abs().max() in (7.0, 8.0) and qv.min() >= -8 and qv.max() <= 7
    else:
        assert (qv.float().abs().max() - QMAX[otype]).abs() <= 1e-3 * QMAX[otype]


def test_quantize_int_rounding_is_half_to_even():
    # amax 127 -> scale 1 exactly, so q = round(x): 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -0.5 -> 0
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5]])
    q, s = quantize(x, "int8")
    assert s.item() == 1.0
    assert q.tolist() == [[127, 0, 2, 2, 0, -2]]


def test_quantize_int_range_is_symmetric():
    q, _ = quantize(torch.tensor([[-1.0, 1.0, 0.3]]), I8)
    assert q.tolist() == [[-127, 127, 38]]
    p, _ = quantize(torch.tensor([[-1.0, 1.0]]), I4)
    assert unpack_int4(p).tolist() == [[-7, 7]]


@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16, torch.float64])
def test_quantize_any_float_input(src):
    x = rand_float((8, 16), seed=2).to(src)
    q, s = quantize(x, FP8, block=(1, None))
    assert s.dtype == torch.float32
    assert_within_bound(x.float(), dequantize(q, s, block=(1, None)), s.expand(8, 16), FP8)


def test_pack_dim_follows_unit_stride():
    x = rand_float((6, 4), seed=4)
    assert quantize(x, I4)[0].packed_dim == 1
    xt = rand_float((4, 6), seed=4).t()  # stride(0) == 1
    p, s = quantize(xt, I4)
    assert p.packed_dim == 0 and p.data.stride(0) == 1
    assert_within_bound(xt, dequantize(p, s), s.expand(6, 4), I4)
    assert quantize(x, I4, pack_dim=0)[0].packed_dim == 0
    with pytest.raises(ShapeError, match=r"x: expected an even extent along dim 0.*\(5, 4\)"):
        quantize(rand_float((5, 4)), I4, pack_dim=0)
    with pytest.raises(ShapeError, match=r"x: expected an even extent along dim 1"):
        quantize(rand_float((4, 5)), "int4")


# ----------------------------------------------------------------------------- edge values


@pytest.mark.parametrize("otype", ALL)
def test_all_zero_block_gets_eps(otype):
    x = rand_float((4, 256), seed=5)
    x[:, :128] = 0
    q, s = quantize_a(x, otype, granularity="group")
    assert (s[:, 0] == 1e-12).all() and (s[:, 1] > 1e-6).all()
    deq = dequantize_a(q, s)
    assert torch.isfinite(deq).all() and (deq[:, :128] == 0).all()
    q0, s0 = quantize(torch.zeros(2, 4), otype, eps=1e-6)
    assert (s0 == torch.tensor(1e-6)).all() and (dequantize(q0, s0) == 0).all()


@pytest.mark.parametrize("otype", [FP8, BF8])
def test_huge_values_saturate(otype):
    big = torch.finfo(torch.float32).max
    x = torch.tensor([[big, -big, big / 3, 1.0]])
    q, s = quantize(x, otype)
    assert not torch.isnan(q.float()).any()
    assert q.float().abs().max() == QMAX[otype]
    deq = dequantize(q, s)
    assert torch.isfinite(deq).all()
    assert (deq[0, :3].abs() > 0.8 * big / 3).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_refused(bad):
    x = torch.ones(3, 4)
    x[1, 2] = bad
    with pytest.raises(ScaleError, match=r"^x: expected finite values"):
        quantize(x, I8)
    with pytest.raises(ScaleError, match=r"^a: expected finite values"):
        quantize_a(x, FP8, granularity="row")
    with pytest.raises(ScaleError, match=r"^w: expected finite values"):
        quantize_weight(x, FP8, granularity="col")


def test_fp64_overflowing_fp32_refused():
    with pytest.raises(ScaleError, match=r"^x: expected finite values \(in fp32\).*1 inf"):
        quantize(torch.tensor([[1e300, 1.0]], dtype=torch.float64), FP8)


def test_quantize_refusals():
    x = torch.ones(4, 4)
    with pytest.raises(DTypeError, match=r"dtype: expected a quantized type.*got bf16"):
        quantize(x, "bf16")
    with pytest.raises(DTypeError, match=r"dtype: expected a quantized type.*got fp16"):
        quantize(x, torch.float16)
    with pytest.raises(DTypeError, match=r"dtype: expected one of"):
        quantize(x, "int3")
    with pytest.raises(DTypeError, match=r"x: expected a floating-point tensor"):
        quantize(x.to(torch.int8), I8)
    with pytest.raises(ShapeError, match=r"x: expected a 2-D tensor, got shape \(4,\)"):
        quantize(torch.ones(4), I8)
    with pytest.raises(ShapeError, match=r"block: expected"):
        quantize(x, I8, block=(0, None))
    for eps in (0.0, 1e-45, float("inf"), float("nan")):
        with pytest.raises(ScaleError, match=r"eps: expected a finite number >= 1.17"):
            quantize(x, I8, eps=eps)
    with pytest.raises(ScaleError, match=r"granularity: expected one of 'tensor', 'row', 'group'"):
        quantize_a(x, I8, granularity="col")
    with pytest.raises(ScaleError, match=r"granularity: expected one of 'tensor', 'col', 'group'"):
        quantize_b(x, I8, granularity="row")
    with pytest.raises(ShapeError, match=r"group_k: expected a positive int"):
        quantize_a(x, I8, granularity="group", group_k=0)


def test_torch_dtype_names_accepted():
    x = rand_float((4, 4))
    assert quantize(x, torch.int8)[0].dtype == torch.int8
    assert quantize(x, torch.float8_e5m2)[0].dtype == torch.float8_e5m2
    assert quantize(x, "fp8")[0].dtype == torch.float8_e4m3fn


def test_empty_inputs():
    q, s = quantize_a(torch.zeros(0, 8), I8, granularity="tensor")
    assert q.shape == (0, 8) and s.shape == ()
    q, s = quantize_a(torch.zeros(0, 8), I4, granularity="row")
    assert q.shape == (0, 8) and s.shape == (0,)
    assert dequantize_a(q, s).shape == (0, 8)
    q, s = quantize_b(torch.zeros(8, 0), FP8, granularity="group")
    assert s.shape == (1, 0) and dequantize_b(q, s).shape == (8, 0)


# ----------------------------------------------------------------------------- wrappers


@pytest.mark.parametrize("otype", ALL)
@pytest.mark.parametrize(
    "granularity, shape, block",
    [("tensor", (), (None, None)), ("row", (37,), (1, None)), ("group", (37, 2), (1, 128))],
)
def test_quantize_a_shapes_and_bounds(otype, granularity, shape, block):
    a = rand_float((37, 200), seed=12)
    q, s = quantize_a(a, otype, granularity=granularity)
    assert s.shape == shape and s.dtype == torch.float32
    deq = dequantize_a(q, s)
    assert_within_bound(a, deq, full_scale(s, block, a.shape), otype)


@pytest.mark.parametrize("otype", ALL)
@pytest.mark.parametrize(
    "granularity, group_n, shape, block",
    [
        ("tensor", 128, (), (None, None)),
        ("col", 128, (130,), (None, 1)),
        ("group", 128, (2, 2), (128, 128)),
        ("group", 1, (2, 130), (128, 1)),
    ],
)
def test_quantize_b_shapes_and_bounds(otype, granularity, group_n, shape, block):
    b = rand_float((200, 130), seed=13)
    q, s = quantize_b(b, otype, granularity=granularity, group_n=group_n)
    assert s.shape == shape and s.dtype == torch.float32
    deq = dequantize_b(q, s)  # group_n inferred from s.shape[1]
    assert_within_bound(b, deq, full_scale(s, block, b.shape), otype)


@pytest.mark.parametrize("otype", [I8, FP8, BF8, I4])
@pytest.mark.parametrize(
    "granularity, group_n, shape, block",
    [
        ("tensor", 128, (), (None, None)),
        ("col", 128, (200,), (None, 1)),
        ("group", 128, (2, 2), (128, 128)),
        ("group", 1, (2, 200), (128, 1)),
    ],
)
def test_quantize_weight_feeds_logical_b(otype, granularity, group_n, shape, block):
    w = rand_float((200, 130), seed=14)  # nn.Linear weight [N=200, K=130]
    qw, s = quantize_weight(w, otype, granularity=granularity, group_n=group_n)
    assert qw.shape == (200, 130) and s.shape == shape
    if otype is I4:
        assert isinstance(qw, PackedInt4) and qw.packed_dim == 1  # packed along K
        assert qw.data.is_contiguous() and qw.data.shape == (200, 65)
        assert qw.t().packed_dim == 0  # the logical B [K, N] is packed along K: layout 'c'
    else:
        assert qw.is_contiguous() and qw.dtype == otype.torch_dtype
    deq = dequantize_b(qw.t(), s)
    assert deq.shape == (130, 200)
    assert_within_bound(w.t(), deq, full_scale(s, block, (130, 200)), otype)


def test_quantize_weight_odd_k_int4_refused():
    with pytest.raises(ShapeError, match=r"w: expected an even extent along dim 1.*\(4, 5\)"):
        quantize_weight(torch.ones(4, 5), I4, granularity="col")


def test_rank1_a_scale_scales_rows_when_m_equals_n():
    q = torch.ones(4, 4, dtype=torch.int8)
    q[:, 0] = 2  # not symmetric, so rows and columns are told apart
    s = torch.tensor([1.0, 10.0, 100.0, 1000.0])
    expected_rows = q.float() * s[:, None]
    wrong_cols = q.float() * s[None, :]
    assert not torch.equal(expected_rows, wrong_cols)
    assert torch.equal(dequantize_a(q, s), expected_rows)
    assert torch.equal(dequantize_a(q, s[:, None]), expected_rows)
    # and a rank-1 b scale scales columns
    assert torch.equal(dequantize_b(q, s), wrong_cols)
    assert torch.equal(dequantize_b(q, s[None, :]), wrong_cols)


def test_scalar_scale_forms():
    q = torch.full((3, 5), 2, dtype=torch.int8)
    for s in (torch.tensor(1.5), torch.tensor([1.5]), torch.tensor([[1.5]]), torch.tensor(1.5).half()):
        assert (dequantize_a(q, s) == 3.0).all()
        assert (dequantize_b(q, s) == 3.0).all()
        assert (dequantize(q, s) == 3.0).all()


def test_dequantize_refusals():
    q = torch.ones(4, 200, dtype=torch.int8)
    with pytest.raises(ShapeError, match=r"scale: expected a scalar, \(M,\).*M=4, Gk=2.*got \(4, 3\)"):
        dequantize_a(q, torch.ones(4, 3))
    with pytest.raises(ShapeError, match=r"scale: expected a scalar, \(N,\).*got \(3,\)"):
        dequantize_b(q.t(), torch.ones(3))
    with pytest.raises(ShapeError, match=r"scale: expected shape \(1, 2\)"):
        dequantize(q, torch.ones(2, 2), block=(None, 128))
    with pytest.raises(DTypeError, match=r"scale: expected dtype float32"):
        dequantize(q, torch.ones(1, dtype=torch.int32))
    with pytest.raises(DTypeError, match=r"q: expected .*wrap packed int4"):
        dequantize(q.to(torch.uint8), torch.ones(()))


def test_explicit_group_n_for_dequantize_b():
    b = rand_float((200, 130), seed=15)
    q, s = quantize_b(b, I8, granularity="group", group_n=64)
    assert s.shape == (2, 3)
    with pytest.raises(ShapeError, match=r"group_n=128"):
        dequantize_b(q, s)  # inferred 128 does not fit [2, 3]
    assert_within_bound(b, dequantize_b(q, s, group_n=64), full_scale(s, (128, 64), b.shape), I8)


# ----------------------------------------------------------------------------- scale layout, int32


def test_preshuffle_round_trip():
    s = torch.randn(5, 3)
    p = preshuffle_scale(s)
    assert p.shape == (5, 3) and p.stride() == (1, 5) and torch.equal(p, s)
    assert is_preshuffled(p) and not is_preshuffled(s)
    u = unshuffle_scale(p)
    assert u.stride() == (3, 1) and torch.equal(u, s)
    assert preshuffle_scale(torch.randn(5, 1)).stride() == (1, 5)
    assert is_preshuffled(preshuffle_scale(torch.randn(5, 1)))
    assert unshuffle_scale(preshuffle_scale(torch.randn(5, 1))).stride() == (1, 1)
    assert not is_preshuffled(preshuffle_scale(torch.randn(1, 3)))  # one row: no order to tell
    assert not is_preshuffled(torch.randn(5))
    with pytest.raises(ShapeError, match=r"s: expected a 2-D tensor"):
        preshuffle_scale(torch.randn(5))


def test_int32_overflow_k_limit():
    assert int32_overflow_k_limit(I8, I8) == 131071
    assert int32_overflow_k_limit("int8", "int4") == 2**31 // 1024 - 1
    k = int32_overflow_k_limit(I8, I8)
    assert k * 128 * 128 <= 2**31 - 1 < (k + 1) * 128 * 128
    with pytest.raises(DTypeError, match=r"b: expected an integer operand type"):
        int32_overflow_k_limit(I8, FP8)


# ----------------------------------------------------------------------------- device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("otype", ALL)
def test_cuda_keeps_device_and_matches_cpu(otype):
    w = rand_float((64, 200), seed=16)
    qc, sc = quantize_weight(w, otype, granularity="group")
    qg, sg = quantize_weight(w.cuda(), otype, granularity="group")
    assert sg.device.type == "cuda" and qg.device.type == "cuda"
    if otype is I4:
        assert torch.equal(qg.data.cpu(), qc.data)
    else:
        assert torch.equal(qg.cpu().float(), qc.float())
    torch.testing.assert_close(sg.cpu(), sc, rtol=0, atol=0)
    deq = dequantize_b(qg.t(), sg)
    assert deq.device.type == "cuda"
    torch.testing.assert_close(deq.cpu(), dequantize_b(qc.t(), sc), rtol=0, atol=0)
    p = preshuffle_scale(torch.randn(5, 3, device="cuda"))
    assert p.device.type == "cuda" and p.stride() == (1, 5)
