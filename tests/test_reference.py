"""The reference against an independent float64 dequantize-then-matmul, every scheme x pair x layout."""

import itertools

import pytest
import torch

import tileq
from tileq.catalog.families import canonical_scale_kinds
from tileq.dtypes import LEGAL_PAIRS, OperandType as T
from tileq.problem import LAYOUTS, ProblemSpec, ScaleKind, ScaleLayout, Scheme
from tileq.quant import unpack_int4
from tileq.testing import make_args


def dense(x):
    if isinstance(x, tileq.PackedInt4):
        return unpack_int4(x).double()
    return x.float().double()


def independent(spec, args):
    """Dequantize both operands in float64 (scales applied elementwise), then matmul."""
    a, b = dense(args.a), dense(args.b)
    m, n, k = spec.m, spec.n, spec.k
    sa, sb = args.a_scale, args.b_scale
    a_full = torch.ones(m, k, dtype=torch.float64)
    b_full = torch.ones(k, n, dtype=torch.float64)
    if spec.a_scale_kind is ScaleKind.SCALAR:
        a_full *= float(sa)
    elif spec.a_scale_kind is ScaleKind.VECTOR:
        a_full *= sa.double().reshape(m, 1)
    elif spec.a_scale_kind is ScaleKind.GROUP:
        a_full *= sa.double().repeat_interleave(spec.group_k, dim=1)[:, :k]
    if spec.b_scale_kind is ScaleKind.SCALAR:
        b_full *= float(sb)
    elif spec.b_scale_kind is ScaleKind.VECTOR:
        b_full *= sb.double().reshape(1, n)
    elif spec.b_scale_kind is ScaleKind.GROUP:
        full = sb.double().repeat_interleave(spec.group_k, dim=0)[:k]
        b_full *= full.repeat_interleave(spec.group_n, dim=1)[:, :n]
    y = (a * a_full) @ (b * b_full)
    acc = args.kwargs.get("acc")
    if acc is not None:
        # acc_in joins the raw accumulator, so the epilogue scales apply to it as well.
        s = torch.ones(m, n, dtype=torch.float64)
        if spec.a_scale_kind in (ScaleKind.SCALAR, ScaleKind.VECTOR):
            s *= sa.double().reshape(-1, 1) if sa.dim() else float(sa)
        if spec.b_scale_kind in (ScaleKind.SCALAR, ScaleKind.VECTOR):
            s *= sb.double().reshape(1, -1) if sb.dim() else float(sb)
        y = y + acc.double() * s
    if args.kwargs.get("bias") is not None:
        y = y + args.kwargs["bias"].double()
    return y


def specs():
    out = []
    for scheme in Scheme:
        for (a, b) in sorted(LEGAL_PAIRS, key=str):
            sa, sb, gn = canonical_scale_kinds(scheme, a, b)
            for layout in LAYOUTS:
                out.append((scheme, a, b, layout, sa, sb, gn))
    return out


def _even_for_int4(spec_kw):
    """int4 needs an even extent along its packed (unit-stride) dimension."""
    m, n, k = spec_kw["m"], spec_kw["n"], spec_kw["k"]
    a, b, layout = spec_kw["a_type"], spec_kw["b_type"], spec_kw["layout"]
    if a is T.I4 and (k if layout[0] == "r" else m) % 2:
        return False
    if b is T.I4 and (n if layout[1] == "r" else k) % 2:
        return False
    return True


SHAPES = [(3, 5, 127), (17, 96, 200), (64, 130, 384), (1, 1, 1), (1, 5, 64), (17, 1, 128),
          (2, 6, 200), (18, 34, 256)]


@pytest.mark.parametrize("scheme,a,b,layout,sa,sb,gn", specs(), ids=lambda v: str(v))
def test_reference_matches_float64(scheme, a, b, layout, sa, sb, gn):
    ran = 0
    for (m, n, k), group_k in itertools.product(SHAPES, (128, 64)):
        kw = dict(m=m, n=n, k=k, a_type=a, b_type=b, layout=layout, scheme=scheme,
                  a_scale_kind=sa, b_scale_kind=sb, group_k=group_k, group_n=gn,
                  out_dtype=torch.float32)
        if not _even_for_int4(kw):
            continue
        spec = ProblemSpec(**kw, has_bias=(m % 2 == 1), has_acc=(n % 2 == 0))
        args = make_args(spec, seed=m * 1000 + n + k)
        got = args.call(tileq.gemm, backend="reference").double()
        want = independent(spec, args)
        scale = want.abs().max().item()
        assert scale > 1.0, "expected values must be far above the tolerance"
        err = (got - want).abs().max().item() / scale
        assert err < 1e-5, (spec, err)
        ran += 1
    assert ran >= 4


@pytest.mark.parametrize("scheme", list(Scheme))
def test_zero_size_shapes(scheme):
    for m, n, k in [(0, 5, 64), (3, 0, 64), (0, 0, 0), (4, 6, 0)]:
        sa, sb, gn = canonical_scale_kinds(scheme, T.I8 if scheme is not Scheme.AQUANT else T.FP8,
                                            T.I8 if scheme is not Scheme.AQUANT else T.FP8)
        a_t = T.FP8 if scheme is Scheme.AQUANT else (T.FP8 if scheme is Scheme.ABQUANT else T.I8)
        spec = ProblemSpec(m=m, n=n, k=k, a_type=a_t, b_type=a_t, layout="rcr", scheme=scheme,
                           a_scale_kind=sa, b_scale_kind=sb, group_n=gn)
        args = make_args(spec)
        y = args.call(tileq.gemm)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        if m and n:
            assert torch.all(y == 0)  # K = 0: the empty sum


def test_preshuffled_and_rowmajor_scales_agree():
    spec = ProblemSpec(m=33, n=40, k=300, a_type=T.FP8, b_type=T.FP8, layout="rcr",
                       scheme=Scheme.AQUANT, a_scale_kind=ScaleKind.GROUP,
                       b_scale_kind=ScaleKind.NONE, out_dtype=torch.float32)
    args = make_args(spec, seed=3)
    pre = args.a_scale.t().contiguous().t()
    assert pre.stride() == (1, 33)
    y1 = tileq.gemm(args.a, args.b, args.a_scale, None, scheme="aquant", out_dtype=torch.float32)
    y2 = tileq.gemm(args.a, args.b, pre, None, scheme="aquant", out_dtype=torch.float32)
    assert torch.equal(y1, y2)
    plan = tileq.explain(args.a, args.b, pre, None, scheme="aquant", backend="reference")
    assert "preshuffled" in plan


def test_int8_products_are_exact():
    gen = torch.Generator().manual_seed(1)
    a = torch.full((5, 1000), -128, dtype=torch.int8)
    b = torch.full((1000, 7), -128, dtype=torch.int8)
    y = tileq.gemm(a, b, 1.0, 1.0, scheme="tensor", out_dtype=torch.float32)
    assert torch.all(y == 16384 * 1000)
    a = torch.randint(-128, 128, (9, 513), generator=gen, dtype=torch.int8)
    b = torch.randint(-128, 128, (513, 11), generator=gen, dtype=torch.int8)
    acc = torch.randint(-1000, 1000, (9, 11), generator=gen, dtype=torch.int32)
    y = tileq.gemm(a, b, 1.0, 1.0, scheme="rowcol", out_dtype=torch.float32, acc=acc)
    exact = a.long() @ b.long() + acc.long()
    assert torch.equal(y, exact.float())
