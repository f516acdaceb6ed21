"""Every catalog family through the Triton kernels (the interpreter on CPU) against the reference.

Shapes are odd on purpose: M, N, K off every tile multiple, a K tail inside a group. Expected
values are far above the tolerance (check_close refuses an all-zero or tiny reference).
"""

import pytest
import torch

import tileq
from tileq.kernels.config import TileConfig
from tileq.catalog.families import catalog, family_spec
from tileq.catalog.names import parse_family
from tileq.commands import selftest_family
from tileq.dtypes import OperandType as T
from tileq.problem import ProblemSpec, ScaleKind, Scheme
from tileq.testing import check_close, make_args

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("family", [f.name for f in catalog()])
def test_family_matches_reference(family):
    st = selftest_family(parse_family(family), DEVICE)
    assert st["ref_max"] > 100 * 1e-3


def run_both(spec, **kw):
    args = make_args(spec, seed=spec.m + spec.n + spec.k, device=DEVICE, **kw)
    if spec.out_dtype == torch.float16 and args.a_scale is not None:
        args.a_scale = args.a_scale * 1e-3  # keep int8/fp8 sums inside fp16's range (65504)
    got = args.call(tileq.gemm, backend="triton")
    want = args.call(tileq.gemm, backend="reference")
    return check_close(got, want, spec.out_dtype)


@pytest.mark.parametrize("group_k", [64, 128, 256])
@pytest.mark.parametrize("fam", ["abquant_fp8xfp8_rcr_prefill", "bquant_fp8xi4_rcr_decode",
                                 "aquant_i4xfp8_crr_preshufflequant", "abquant_i8xi8_rrr_prefill"])
def test_group_sizes_with_partial_last_group(fam, group_k):
    spec = family_spec(parse_family(fam), 68 if "decode" not in fam else 6, 70, 300 + group_k // 2,
                       group_k=group_k, out_dtype=torch.float32)
    run_both(spec)


@pytest.mark.parametrize("group_n", [1, 128])
def test_bquant_group_n(group_n):
    spec = ProblemSpec(m=70, n=300, k=256, a_type=T.BF16, b_type=T.I4, layout="rcr",
                       scheme=Scheme.BQUANT, a_scale_kind=ScaleKind.NONE,
                       b_scale_kind=ScaleKind.GROUP, group_n=group_n, out_dtype=torch.float32)
    run_both(spec)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fam", ["rowcol_i8xi8_rcr_prefill", "tensor_fp8xfp8_ccr_decode",
                                 "abquant_fp8xfp8_rcr_decode"])
def test_epilogue_acc_bias_out_dtypes(fam, out_dtype):
    spec = family_spec(parse_family(fam), 33 if "decode" in fam else 77, 65, 129, out_dtype=out_dtype)
    run_both(spec, bias=True, acc=True)


@pytest.mark.parametrize("m,n,k", [(1, 70, 300), (16, 70, 1), (2, 1, 64), (65, 3, 5)])
def test_edge_shapes(m, n, k):
    for fam in ("rowcol_i8xi8_rcr", "rowcol_fp8xfp8_rcr", "rowcol_bf16xi8_rrr"):
        pipeline = "decode" if m <= 64 else "prefill"
        spec = family_spec(parse_family(f"{fam}_{pipeline}"), m, n, k, out_dtype=torch.float32)
        run_both(spec, bias=True)


def test_padded_leading_dimensions():
    for fam in ("rowcol_i8xi8_rcr_prefill", "bquant_fp8xi4_rcr_decode", "aquant_i4xfp8_crr_decode",
                "rowcol_fp8xfp8_ccr_prefill"):
        f = parse_family(fam)
        m = 70 if f.pipeline != "decode" else 6
        spec = family_spec(f, m, 70, 256, out_dtype=torch.float32)
        run_both(spec, pad=10)


def test_split_k_is_deterministic_and_correct(monkeypatch):
    """A forced split over K (workspace + fixed-order reduction) matches the reference, twice."""
    import tileq.dispatch.heuristic as h

    spec = family_spec(parse_family("abquant_fp8xfp8_rcr_decode"), 3, 70, 1024, out_dtype=torch.float32)
    args = make_args(spec, seed=5, device=DEVICE, bias=True)
    want = args.call(tileq.gemm, backend="reference")
    forced = TileConfig(16, 64, 128, 4, 2, split_k=4)
    monkeypatch.setattr(h, "heuristic_config", lambda *a, **k: forced)
    import tileq.dispatch.gemm as gemm
    import tileq.dispatch.plan as plan

    plan._gemm_cached.cache_clear()
    monkeypatch.setattr(gemm, "heuristic_config", lambda *a, **k: forced)
    text = args.call(tileq.explain, backend="triton")
    assert "split_k=4" in text
    y1 = args.call(tileq.gemm, backend="triton")
    y2 = args.call(tileq.gemm, backend="triton")
    plan._gemm_cached.cache_clear()
    check_close(y1, want, torch.float32)
    assert torch.equal(y1, y2)


def test_m_zero_launches_nothing():
    spec = family_spec(parse_family("rowcol_i8xi8_rcr_decode"), 0, 70, 64)
    args = make_args(spec, device=DEVICE)
    y = args.call(tileq.gemm, backend="triton")
    assert y.shape == (0, 70)


def test_fast_accum_option_for_fp8():
    spec = family_spec(parse_family("rowcol_fp8xfp8_rcr_prefill"), 70, 64, 300, out_dtype=torch.float32)
    args = make_args(spec, seed=9, device=DEVICE)
    want = args.call(tileq.gemm, backend="reference")
    got = args.call(tileq.gemm, backend="triton", fast_accum=True)
    check_close(got, want, torch.float32)
    assert "fast-accum" in args.call(tileq.explain, backend="triton", fast_accum=True)
    assert "promoted to f32 per K tile" in args.call(tileq.explain, backend="triton")
    # int8 has nothing to speed up: the flag is accepted and has no effect on the plan
    i8 = family_spec(parse_family("rowcol_i8xi8_rcr_prefill"), 70, 64, 300)
    a8 = make_args(i8, device=DEVICE)
    assert "fast-accum" not in a8.call(tileq.explain, backend="triton", fast_accum=True)


@pytest.mark.parametrize("family", [f.name for f in catalog()])
def test_swapped_kernel_matches_reference(family):
    """C^T = B^T A^T: operands, scales (group rows from B's column groups), acc_in, bias and the
    transposed store, with and without a split over K."""
    from dataclasses import replace

    from tileq.commands import selftest_shape
    from tileq.dispatch.plan import execute, make_plan, with_config
    from tileq.problem import build_problem

    fam = parse_family(family)
    m, n, k = selftest_shape(fam)
    spec = family_spec(fam, m, n, k, out_dtype=torch.float32)
    args = make_args(spec, seed=len(family), device=DEVICE, bias=True, acc=True)
    want = args.call(tileq.gemm, backend="reference")
    problem = args.call(build_problem)
    base = make_plan(problem.spec, torch.device(DEVICE), backend="triton")
    for split_k in (1, 2):
        cfg = replace(base.config, swap_ab=True, split_k=split_k, block_m=64,
                      block_n=16 if fam.pipeline == "decode" else 64)
        check_close(execute(with_config(base, cfg), problem), want, torch.float32)


@pytest.mark.parametrize("fam", ["bquant_fp8xi4_rcr_decode", "bquant_bf8xi4_rcr_prefill",
                                 "aquant_i4xfp8_rcr_decode", "bquant_fp8xi4_rcr_prefill"])
@pytest.mark.parametrize("k", [256, 260])
@pytest.mark.parametrize("swap", [False, True])
def test_int4_word_path(fam, k, swap):
    """fp8 x int4 packed along K reads 16-bit words (four dots per K tile): full and partial
    K tiles, both orientations, against the reference."""
    from tileq.kernels.launch import i4_words_path
    from tileq.dispatch.plan import make_plan, with_config

    f = parse_family(fam)
    spec = family_spec(f, 6 if f.pipeline == "decode" else 40, 72, k, out_dtype=torch.float32)
    cfg = TileConfig(64 if swap else 16, 16 if swap else 32, 128, 4, 2, swap_ab=swap)
    assert i4_words_path(spec, cfg)
    plan = with_config(make_plan(spec, torch.device(DEVICE), backend="triton", pipeline=f.pipeline), cfg)
    args = make_args(spec, seed=k, device=DEVICE)
    from tileq.dispatch.plan import execute
    from tileq.problem import build_problem

    got = execute(plan, args.call(build_problem))
    check_close(got, args.call(tileq.gemm, backend="reference"), spec.out_dtype)


def test_int4_word_path_needs_even_address():
    """int4 storage at an odd address cannot be read as 16-bit words: the byte path runs, and the
    result is still right."""
    from tileq.dtypes import PackedInt4

    spec = family_spec(parse_family("bquant_fp8xi4_rcr_decode"), 5, 40, 256, out_dtype=torch.float32)
    args = make_args(spec, seed=3, device=DEVICE)
    w = args.b  # logical [K, N] packed along K: data is the transpose of a contiguous [N, K/2]
    rows = w.data.t()
    shifted = torch.empty(rows.numel() + 1, dtype=torch.uint8, device=DEVICE)[1:].view(rows.shape)
    shifted.copy_(rows)
    assert shifted.data_ptr() % 2 == 1
    from tileq.kernels.launch import i4_storage_word_aligned

    assert not i4_storage_word_aligned(shifted.t(), shifted.stride(0))
    args.b = PackedInt4(shifted.t(), w.shape, w.packed_dim)
    check_close(args.call(tileq.gemm, backend="triton"), args.call(tileq.gemm, backend="reference"),
                spec.out_dtype)
