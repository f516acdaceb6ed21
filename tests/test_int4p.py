"""Prepacked int4 weights (tileq.prepacked): the i4p1 layout bit for bit, and the kernel against a
float64 reference on odd shapes. On a CPU the kernel runs in Triton's interpreter (its plain-op
conversion); on a GPU (TILEQ_TEST_GPU=1) the same tests run the inline-PTX conversion. The sm_90
build test compiles the real kernel on the CPU and checks the K loop it gets."""

from dataclasses import replace
import os
import re
import subprocess

import pytest
import torch

import tileq
from tileq import api_prepacked
from tileq.api_prepacked import describe_prepacked, linear_prepacked
from tileq.device import for_arch
from tileq.dispatch import int4 as rules
from tileq.dispatch.int4 import default_config
from tileq.dispatch.thresholds import for_arch as thresholds_for
from tileq.errors import DTypeError, ShapeError
from tileq.kernels.int4p import prefill_launch as pl
from tileq.kernels.int4p.config import X_TYPES, Int4pConfig
from tileq.prepacked import BLOCK_K, PrepackedInt4, prepack_int4, prepacked_values, unprepack_int4
from tileq.quant import pack_int4, unpack_int4

DEV = "cuda" if os.environ.get("TILEQ_TEST_GPU") == "1" and torch.cuda.is_available() else "cpu"
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
T = thresholds_for("sm_90")  # the INT4_* routing numbers (dispatch/thresholds.py)
SM90 = for_arch("sm_90")  # an sm_90 GPU's facts (132 SMs)


def sm90_with(num_sms: int):
    """An sm_90 GPU with ``num_sms`` SMs."""
    return replace(SM90, num_sms=num_sms)


# The routing rules below the Triton-version gate, as on a Triton the Gluon kernels were tested
# with (conftest.tested_triton); test_prefill_gate_on_the_installed_triton checks the gate itself.
pytestmark = pytest.mark.usefixtures("tested_triton")


def test_prefill_gate_on_the_installed_triton(monkeypatch):
    """The installed Triton, unpinned: a tested version gives the Gluon prefill kernel its calls;
    any other runs them another way, the plan naming the version that refused the kernel."""
    from tileq.device import triton_version
    from tileq.dispatch import gluon

    monkeypatch.setattr(gluon, "triton_version", triton_version)
    installed = triton_version()
    text = describe_prepacked(512, 5120, 5120, torch.bfloat16)
    if installed in gluon.GLUON_TRITON_VERSIONS:
        assert text.startswith("bquant_bf16xi4p_rcr_prefill__gluon_"), text
        return
    assert text.startswith("dequant+cublas"), text
    assert (f"not the Gluon prefill kernel: Gluon kernels are tested with Triton "
            f"{', '.join(gluon.GLUON_TRITON_VERSIONS)} only, this is {installed})") in text, text
    # (W4A8 at 100 tokens: the fused fp8 build where the kernel runs, test_w4a8_decode_casts_...)
    assert "__gluon_" not in describe_prepacked(100, 4096, 4096, torch.float8_e4m3fn)


# ----------------------------------------------------------------------------- layout


@pytest.mark.parametrize("n,k", [(1, 2), (3, 512), (5, 1000), (64, 1536), (7, 130)])
def test_prepack_roundtrip_is_exact(n, k):
    torch.manual_seed(n * k)
    v = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    pk = pack_int4(v, dim=1)
    p = prepack_int4(pk)
    assert p.data.dtype == torch.int32 and p.data.shape == (n, -(-k // BLOCK_K) * 64)
    assert torch.equal(unprepack_int4(p).data, pk.data)
    assert torch.equal(prepack_int4(v).data, p.data)  # int values and PackedInt4 agree
    vals = prepacked_values(p)
    assert torch.equal(vals[:, :k], v) and not bool(vals[:, k:].any())


def test_prepack_matches_the_documented_bit_positions():
    # value at k is (k % 13) - 6: identifies k modulo 13 in every nibble checked below
    k = 1024
    v = ((torch.arange(k) % 13) - 6).to(torch.int8).view(1, k)
    words = prepack_int4(v).data[0].tolist()

    def nib(word, s):
        return ((word & 0xFFFFFFFF) >> (4 * s)) & 15

    for b in range(2):
        for c in (0, 1, 2, 37, 62, 63):
            w = words[64 * b + c]
            for q in range(4):
                base = 512 * b + (256 if c % 2 else 0) + 64 * q + (c - c % 2)
                assert nib(w, q) - 8 == (base % 13) - 6
                assert nib(w, 4 + q) - 8 == ((base + 1) % 13) - 6


def test_prepack_refusals():
    with pytest.raises(DTypeError):
        prepack_int4(torch.full((2, 4), 9, dtype=torch.int8))
    with pytest.raises(ShapeError):
        prepack_int4(pack_int4(torch.zeros(4, 2, dtype=torch.int8), dim=0))  # packed along N
    with pytest.raises(DTypeError):
        PrepackedInt4(torch.zeros(2, 64, dtype=torch.int64), (2, 512))
    with pytest.raises(ShapeError):
        PrepackedInt4(torch.zeros(2, 64, dtype=torch.int32), (2, 513))  # needs 128 words
    p = prepack_int4(torch.zeros(1, 100, dtype=torch.int8))
    bad = p.data.clone()
    bad[0, -1] = 0  # nibbles 0 = value -8 in the padding
    with pytest.raises(ShapeError, match="padding"):
        unprepack_int4(PrepackedInt4(bad, p.shape))


# ----------------------------------------------------------------------------- kernel


def _reference(x, v, w_scale, x_scale, bias, group_k):
    n, k = v.shape
    if w_scale.numel() == 1:
        s = w_scale.double().reshape(1, 1)
    elif w_scale.dim() == 2 and w_scale.shape[0] > 1:
        s = w_scale.double().repeat_interleave(group_k, 0)[:k].t()
    else:
        s = w_scale.double().reshape(n, 1)
    xd = x.double()
    if x_scale is not None:
        xd = xd * x_scale.double().reshape(-1, 1)
    y = xd @ (v.double() * s).t()
    return y + bias.double() if bias is not None else y


CASES = [
    # m, n, k, x dtype, group_k (0: per-channel), split_k
    (1, 64, 512, torch.bfloat16, 128, 1),
    (3, 70, 1000, torch.bfloat16, 128, 2),
    (5, 130, 1536, torch.float16, 256, 1),
    (17, 64, 600, torch.bfloat16, 0, 1),
    (2, 96, 1024, torch.float8_e4m3fn, 128, 2),
    (33, 64, 512, torch.float8_e5m2, 0, 1),
    (65, 72, 640, torch.bfloat16, 128, 1),
    (4, 200, 1024, torch.bfloat16, 128, -1),  # -1: two warpgroups, 128 weight rows per program
]


def _decode_problem(m, n, k, xt, gk, seed):
    """(v, w, x, ws, xs): int4 values [N, K], their prepacked weight on DEV, activations of type
    ``xt``, group (gk > 0) or per-channel (0) weight scales, per-token scales for fp8."""
    torch.manual_seed(seed)
    v = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    w = prepack_int4(v).to(DEV)
    x = torch.randn(m, k).to(xt)
    ws = torch.rand(-(-k // gk), n) + 0.5 if gk else torch.rand(n) + 0.5
    xs = torch.rand(m) + 0.5 if xt in FP8 else None
    return v, w, x, ws, xs


@pytest.mark.parametrize("m,n,k,xt,gk,split", CASES)
def test_kernel_matches_reference(m, n, k, xt, gk, split):
    v, w, x, ws, xs = _decode_problem(m, n, k, xt, gk, m + n + k)
    bias = torch.randn(n)
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    cfg = Int4pConfig(bm, split, 2) if split > 0 else Int4pConfig(bm, 1, 2, warps=8)
    d = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    y = linear_prepacked(d(x), w, d(xs), d(ws), bias=d(bias), group_k=gk or 128, config=cfg,
                         out_dtype=torch.float32)
    want = _reference(x, v, ws, xs, bias, gk or 128)
    err = float((y.cpu().double() - want).abs().max() / want.abs().max())
    assert err < 2e-6, err
    y16 = linear_prepacked(d(x), w, d(xs), d(ws), bias=d(bias), group_k=gk or 128, config=cfg)
    assert y16.dtype == (xt if xt not in FP8 else torch.bfloat16)
    assert float((y16.cpu().double() - want).abs().max() / want.abs().max()) < 1e-2


@pytest.mark.parametrize("xt", FP8)
def test_w4a8_decode_casts_activations_on_large_weights(xt, monkeypatch):
    """fp8 activations on the decode kernel run the W4A16 kernel after an exact cast to bf16
    above W4A8_CAST_MAX_M tokens, and at fewer where the weight has cast_min_bytes(m) of int4
    (75 MB up to 16 tokens, 40 MB at 17-32) or more; else the fp8 kernel converting to fp16;
    explain says which; results match the reference either way."""
    big_n, big_k = 28672, 8192  # 117 MB of int4
    mid_n, mid_k = 14336, 4096  # 29 MB
    cap = T.INT4_W4A8_CAST_MAX_M
    assert cap == 32 and rules.cast_min_bytes(16) == T.INT4_W4A8_CAST_MIN_BYTES
    assert rules.cast_min_bytes(17) == T.INT4_W4A8_CAST_MIN_BYTES_32 < T.INT4_W4A8_CAST_MIN_BYTES
    assert "cast to bf16 first: 117.4 MB of int4 >= 75 MB" in describe_prepacked(1, big_n, big_k, xt)
    assert describe_prepacked(1, big_n, big_k, xt).startswith("bquant_bf16xi4p_rcr_decode__")
    assert "cast to bf16" in describe_prepacked(cap, big_n, big_k, xt)
    assert "cast to bf16 first: 58.7 MB of int4 >= 40 MB" in describe_prepacked(24, 2 * mid_n, mid_k, xt)
    assert "cast" not in describe_prepacked(16, 2 * mid_n, mid_k, xt)
    for m in (1, 16, 17, cap):  # (up to the cap the weight's size decides)
        text = describe_prepacked(m, mid_n, mid_k, xt)
        assert text.startswith(f"bquant_{X_TYPES[xt]}xi4p_rcr_decode__") and "_h16" in text, text
        assert "cast" not in text and "converted to fp16" in text, text
    # (from 33 tokens the Gluon kernel: e4m3 with group scales on its fp8 build, e5m2 cast to bf16)
    fused = xt == torch.float8_e4m3fn
    assert describe_prepacked(100, 4096, 4096, xt).startswith(
        f"bquant_{'fp8' if fused else 'bf16'}xi4p_rcr_prefill__gluon_")
    assert "cast" not in describe_prepacked(1, big_n, big_k)  # bf16 activations: nothing to cast
    cfg = Int4pConfig(16, 1, 2)
    assert "cast" not in describe_prepacked(1, big_n, big_k, xt, config=cfg)  # a given config: as called
    torch.manual_seed(7)
    m, n, k = 3, 70, 1000
    v = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    w = prepack_int4(v).to(DEV)
    x = (torch.randn(m, k) * 40).to(xt)
    xs, ws = torch.rand(m) + 0.5, torch.rand(-(-k // 128), n) + 0.5
    want = _reference(x, v, ws, xs, None, 128)
    results = {}
    for threshold in (0, T.INT4_W4A8_CAST_MIN_BYTES):
        monkeypatch.setattr(T, "INT4_W4A8_CAST_MIN_BYTES", threshold)
        monkeypatch.setattr(api_prepacked, "_LAUNCHES", {})  # (a launch is kept per call signature)
        assert ("cast to bf16" in describe_prepacked(m, n, k, xt)) == (threshold == 0)
        y = linear_prepacked(x.to(DEV), w, xs.to(DEV), ws.to(DEV), out_dtype=torch.float32)
        assert float((y.cpu().double() - want).abs().max() / want.abs().max()) < 2e-6
        results[threshold] = y
    assert torch.equal(results[0], results[T.INT4_W4A8_CAST_MIN_BYTES])


@pytest.mark.parametrize("m,n,k,gk,split", [(3, 70, 1000, 128, 2), (5, 130, 1536, 256, 1), (1, 64, 4096, 128, 2),
                                           (4, 66, 2500, 128, 1),
                                           (2, 72, 1024, 0, 1)])
def test_scale_ahead_config_matches_reference(m, n, k, gk, split):
    """Group scales loaded one K tile ahead (SCALE_AHEAD): the same sums, K tails, split-K (a
    split's next K tile lies SPLIT_K tiles on), group_k 256; per-channel scales ignore it."""
    torch.manual_seed(m + k)
    v = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    ws = torch.rand(-(-k // gk), n) + 0.5 if gk else torch.rand(n) + 0.5
    x = torch.randn(m, k).to(torch.bfloat16)
    cfg = Int4pConfig(16, split, 2, scale_ahead=True)
    assert cfg.tag.endswith("_pf_swap") and Int4pConfig.parse_tag(cfg.tag) == cfg
    y = linear_prepacked(x.to(DEV), prepack_int4(v).to(DEV), None, ws.to(DEV), group_k=gk or 128, config=cfg,
                         out_dtype=torch.float32)
    want = _reference(x, v, ws, None, None, gk or 128)
    assert float((y.cpu().double() - want).abs().max() / want.abs().max()) < 2e-6, cfg.tag


@pytest.mark.parametrize("xt", FP8)
@pytest.mark.parametrize("m,n,k,split", [(3, 70, 1000, 1), (16, 130, 1536, 2), (1, 64, 4096, 2)])
def test_fp16_conversion_of_fp8_activations_matches_reference(xt, m, n, k, split):
    """Int4pConfig(fp16=True): the decode kernel converts fp8 activations (e4m3, e5m2) to fp16
    instead of bf16 and runs an fp16 wgmma; every product is exact either way, so fp32 outputs
    match the reference as tightly; its tag ('_h16') names another binary; 16-bit activations
    refuse it (bf16 values are not all fp16 values)."""
    from tileq.kernels.int4p.config import kernel_ct

    torch.manual_seed(m + n + k)
    v = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    w = prepack_int4(v).to(DEV)
    x = (torch.randn(m, k) * 40).to(xt)
    xs, ws = torch.rand(m) + 0.5, torch.rand(-(-k // 128), n) + 0.5
    cfg = Int4pConfig(16, split, 2, fp16=True)
    assert cfg.tag.endswith("_h16_swap") and Int4pConfig.parse_tag(cfg.tag) == cfg
    assert kernel_ct("fp8", cfg) == "fp16" and kernel_ct("fp8", Int4pConfig(16)) == "bf16"
    y = linear_prepacked(x.to(DEV), w, xs.to(DEV), ws.to(DEV), config=cfg, out_dtype=torch.float32)
    want = _reference(x, v, ws, xs, None, 128)
    assert float((y.cpu().double() - want).abs().max() / want.abs().max()) < 2e-6
    with pytest.raises(ValueError, match="fp8 activations"):
        linear_prepacked(torch.randn(m, k).to(torch.bfloat16).to(DEV), w, None, ws.to(DEV), config=cfg)


@pytest.mark.parametrize("m,n,k,xt,gk,split,bias", [(3, 70, 1000, torch.bfloat16, 128, 2, True),
                                                     (16, 130, 2048, torch.float16, 0, 4, False),
                                                     (20, 64, 1536, torch.bfloat16, 128, 3, True),
                                                     (2, 96, 1024, torch.float8_e4m3fn, 128, 2, True)])
def test_in_kernel_splitk_sum_matches_the_reduction_kernel(m, n, k, xt, gk, split, bias):
    """Int4pConfig(fixup=True): the last program of each tile sums the split-K partials in slab
    order, so the output is bit for bit the reduction kernel's (bias in the first slab, the
    activations' scales in each), call after call (the tile counters go back to zero); its tag
    ('_fx') names another binary and needs a split."""
    from tileq.kernels import buffers as kbuf

    v, w, x, ws, xs = _decode_problem(m, n, k, xt, gk, m + n + split)
    b = torch.randn(n) if bias else None
    d = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    bm = 16 if m <= 16 else 32
    plain, fixed = Int4pConfig(bm, split, 2), Int4pConfig(bm, split, 2, fixup=True)
    assert fixed.tag.endswith("_fx_swap") and Int4pConfig.parse_tag(fixed.tag) == fixed
    assert Int4pConfig(bm, 1, 2, fixup=True).tag == Int4pConfig(bm, 1, 2).tag  # (no split: nothing to sum)
    with pytest.raises(ValueError, match="needs a split"):
        Int4pConfig.parse_tag("m64n16k512_w4_s2_fx_swap")
    for out_dtype in (torch.float32, torch.bfloat16):
        want = linear_prepacked(d(x), w, d(xs), d(ws), bias=d(b), group_k=gk or 128, config=plain,
                                out_dtype=out_dtype)
        for _ in range(2):
            got = linear_prepacked(d(x), w, d(xs), d(ws), bias=d(b), group_k=gk or 128, config=fixed,
                                   out_dtype=out_dtype)
            assert torch.equal(got, want)
    if DEV != "cpu":  # (on a CPU each call makes its own zeroed counters)
        assert not any(int(c.count_nonzero()) for c in kbuf._COUNTERS.values())
    ref = _reference(x, v, ws, xs, b, gk or 128)
    y = linear_prepacked(d(x), w, d(xs), d(ws), bias=d(b), group_k=gk or 128, config=fixed, out_dtype=torch.float32)
    assert float((y.cpu().double() - ref).abs().max() / ref.abs().max()) < 2e-6


@pytest.mark.parametrize("m,n,k,xt,gk,cfg,sms", [
    (1, 577, 1104, torch.bfloat16, 128, Int4pConfig(16, 1, 2, 4, 128, streamk=True), 2),  # 8 programs, 30 units
    (5, 300, 2048, torch.float16, 0, Int4pConfig(16, 1, 2, streamk=True), 1),  # 3 programs: whole tiles too
    (20, 200, 1600, torch.bfloat16, 128, Int4pConfig(32, 1, 2, streamk=True), 1),  # 32-token tiles
    (3, 129, 700, torch.bfloat16, 256, Int4pConfig(16, 1, 3, streamk=True), 50),  # a program per unit
    (2, 96, 1024, torch.float8_e4m3fn, 128, Int4pConfig(16, 1, 2, 4, 168, True, True, streamk=True), 1),
    (18, 130, 2048, torch.bfloat16, 128, Int4pConfig(16, 1, 2, 4, 168, True, streamk=True), 2)])  # 2 token tiles
def test_streamk_decode_matches_reference(monkeypatch, m, n, k, xt, gk, cfg, sms):
    """Int4pConfig(streamk=True): a program per slot of ``sms`` SMs (``per_sm`` each), each
    streaming a contiguous range of (tile, K block) units; tiles shared by programs are summed in
    program order by the last to arrive. Against the float64 reference on odd shapes (ranges that
    start and end inside tiles, whole tiles between, one unit per program, two token tiles, group
    and per-channel scales, fp8 activations with token scales, bias), the same bits call after
    call (the tile counters back to zero); '_stk' in the tag, no split with it."""
    from tileq import device
    from tileq.kernels import buffers as kbuf

    monkeypatch.setattr(device, "facts", lambda dev: sm90_with(sms))
    monkeypatch.setattr(api_prepacked, "_LAUNCHES", {})  # (a launch's program count is made for its SM count)
    v, w, x, ws, xs = _decode_problem(m, n, k, xt, gk, m + n + sms)
    b = torch.randn(n)
    d = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    assert cfg.tag.endswith("_stk_swap") and Int4pConfig.parse_tag(cfg.tag) == cfg
    y = linear_prepacked(d(x), w, d(xs), d(ws), bias=d(b), group_k=gk or 128, config=cfg, out_dtype=torch.float32)
    want = _reference(x, v, ws, xs, b, gk or 128)
    assert float((y.cpu().double() - want).abs().max() / want.abs().max()) < 2e-6
    again = linear_prepacked(d(x), w, d(xs), d(ws), bias=d(b), group_k=gk or 128, config=cfg,
                             out_dtype=torch.float32)
    assert torch.equal(again, y)
    if DEV != "cpu":  # (on a CPU each call makes its own zeroed counters)
        assert not any(int(c.count_nonzero()) for c in kbuf._COUNTERS.values())
    with pytest.raises(ValueError, match="stream-K"):
        Int4pConfig(16, 2, 2, streamk=True)
    with pytest.raises(ValueError, match="stream-K"):
        Int4pConfig.parse_tag("m64n16k512_w4_s2_sk2_fx_stk_swap")


def test_register_capped_config_matches_reference():
    # maxnreg=128 (four programs per SM) makes ptxas spill a few registers: still exact.
    torch.manual_seed(5)
    m, n, k = 5, 130, 2048
    v = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    ws = torch.rand(k // 128, n) + 0.5
    x = torch.randn(m, k).to(torch.bfloat16)
    for cfg in (Int4pConfig(16, 2, 2, 4, 128), Int4pConfig(16, 1, 3, 4, 128)):
        y = linear_prepacked(x.to(DEV), prepack_int4(v).to(DEV), None, ws.to(DEV), config=cfg,
                             out_dtype=torch.float32)
        want = _reference(x, v, ws, None, None, 128)
        assert float((y.cpu().double() - want).abs().max() / want.abs().max()) < 2e-6, cfg.tag


def test_linear_routes_prepacked_weights_and_agrees_with_packed():
    torch.manual_seed(3)
    n, k, m = 96, 768, 4
    v = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    ws = (torch.rand(k // 128, n) + 0.5).to(DEV)
    x = torch.randn(2, m, k).to(torch.bfloat16).to(DEV)  # leading dims are kept
    y = tileq.linear(x, prepack_int4(v).to(DEV), None, ws, scheme="bquant", out_dtype=torch.float32)
    assert y.shape == (2, m, n)
    want = _reference(x.reshape(-1, k).cpu(), v, ws.cpu(), None, None, 128).view(2, m, n)
    assert float((y.cpu().double() - want).abs().max() / want.abs().max()) < 2e-6
    with pytest.raises(DTypeError, match="scheme"):
        tileq.linear(x, prepack_int4(v).to(DEV), None, ws, scheme="abquant")
    with pytest.raises(DTypeError, match="tileq.linear"):  # gemm's B is [K, N]: not a Linear weight
        tileq.gemm(x[0], prepack_int4(v).to(DEV), None, ws, scheme="bquant")


def test_kernel_refusals():
    w = prepack_int4(torch.zeros(64, 256, dtype=torch.int8))
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    with pytest.raises(ShapeError):
        linear_prepacked(torch.zeros(2, 255, dtype=torch.bfloat16), w, None, torch.ones(2, 64))
    with pytest.raises(ShapeError):
        linear_prepacked(x, w, None, torch.ones(3, 64))  # 256 / 128 = 2 groups
    with pytest.raises(ShapeError, match="group_k"):
        linear_prepacked(x, w, None, torch.ones(4, 64), group_k=64)
    with pytest.raises(DTypeError, match="x_scale"):
        linear_prepacked(x.to(torch.float8_e4m3fn), w, None, torch.ones(2, 64))
    with pytest.raises(DTypeError, match="x_scale"):
        linear_prepacked(x, w, torch.ones(2), torch.ones(2, 64))
    with pytest.raises(DTypeError):
        linear_prepacked(x.float(), w, None, torch.ones(2, 64))


def test_dequantize_is_exact_and_prefill_takes_it():
    from tileq.kernels.int4p.dequant import dequantize_prepacked

    DEQUANT_MIN_M = T.INT4_DEQUANT_MIN_M
    torch.manual_seed(11)
    n, k = 37, 1100  # K not a multiple of 512: the last block is partial
    v = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    w = prepack_int4(v).to(DEV)
    ones = torch.ones(n, device=DEV)
    got = dequantize_prepacked(w.data, n, k, ones, "vector", (0, 1), 128, torch.bfloat16)
    assert torch.equal(got.cpu().float(), v.float())  # values are exact in bf16
    ws = torch.rand(-(-k // 128), n) + 0.5
    got = dequantize_prepacked(w.data, n, k, ws.to(DEV), "group", (n, 1), 128, torch.float16)
    want = (v.float() * ws.repeat_interleave(128, 0)[:k].t()).half()
    assert torch.equal(got.cpu(), want)
    # From DEQUANT_MIN_M tokens linear_prepacked takes a prefill path (on a CPU: W4A16 dequantize +
    # matmul, W4A8 the fp8 GEMM on the values; bf16-level agreement, not the fused kernel's).
    m = DEQUANT_MIN_M + 3
    for xt in (torch.bfloat16, torch.float8_e4m3fn):
        x = torch.randn(m, k).to(xt)
        xs = torch.rand(m) + 0.5 if xt in FP8 else None
        bias = torch.randn(n)
        d = lambda t: None if t is None else t.to(DEV)  # noqa: E731
        y = linear_prepacked(d(x), w, d(xs), d(ws), bias=d(bias))
        want = _reference(x, v, ws, xs, bias, 128)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        assert float((y.cpu().double() - want).abs().max() / want.abs().max()) < 1e-2
    assert describe_prepacked(m, n, k).startswith("dequant+cublas")
    assert describe_prepacked(1, n, k).startswith("bquant_bf16xi4p_rcr_decode__m64n16k512")


def _w4a8_scales(kind, n, k, group_k):
    gk = -(-k // group_k)
    return {"group": torch.rand(gk, n) * 0.02 + 0.01, "vector": torch.rand(n) * 0.02 + 0.01,
            "scalar": torch.tensor(0.015)}[kind]


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_out_is_checked_on_every_path(x_dtype):
    """out= of the wrong dtype or shape is an error whichever path runs the call (here the prefill
    paths: W4A8 the fp8 GEMM on the values, W4A16 dequantize + cuBLAS on a CPU, the Gluon kernel
    on an sm_90 GPU); the right one is written in place."""
    from tileq.errors import DTypeError, ShapeError

    m, n, k = T.INT4_DEQUANT_MIN_M, 24, 512
    torch.manual_seed(2)
    w = prepack_int4(torch.randint(-8, 8, (n, k), dtype=torch.int8)).to(DEV)
    x = torch.randn(m, k).to(x_dtype).to(DEV)
    sx = torch.ones(m, device=DEV) if x_dtype in FP8 else None
    sw = torch.ones(n, device=DEV)
    with pytest.raises(DTypeError, match="out"):
        linear_prepacked(x, w, sx, sw, out=torch.empty(m, n, device=DEV))
    with pytest.raises(ShapeError, match="out"):
        linear_prepacked(x, w, sx, sw, out=torch.empty(m, n + 1, dtype=torch.bfloat16, device=DEV))
    out = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
    y = linear_prepacked(x, w, sx, sw, out=out)
    assert y.data_ptr() == out.data_ptr() and torch.equal(y, linear_prepacked(x, w, sx, sw))


@pytest.mark.parametrize("x_dtype", FP8)
def test_dequantize_values_to_fp8_is_exact(x_dtype):
    """The values alone (w_kind 'none') in e4m3 and e5m2: -8..7 are exact in both."""
    from tileq.kernels.int4p.dequant import dequantize_prepacked

    torch.manual_seed(3)
    n, k = 37, 1100
    v = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    w = prepack_int4(v).to(DEV)
    got = dequantize_prepacked(w.data, n, k, None, "none", (0, 0), 128, x_dtype)
    assert got.dtype == x_dtype and torch.equal(got.cpu().float(), v.float())
    with pytest.raises(ValueError):
        dequantize_prepacked(w.data, n, k, torch.ones(n, device=DEV), "none", (0, 1), 128, x_dtype)


def _bits(t):
    """The raw bits of a tensor (signed zeros and every rounding compared)."""
    return t.cpu().contiguous().view({1: torch.uint8, 2: torch.int16}[t.element_size()])


def _same_rounding(got, want32, dtype):
    """got (dtype) is want32 (fp32) rounded to dtype, bit for bit: to nearest even as the GPU
    converts and torch does. Triton's interpreter converts fp32 to bf16 by truncation (its
    software conversion); on a CPU a bf16 value may be that one instead."""
    ok = _bits(got) == _bits(want32.to(dtype))
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        ok |= _bits(got) == (want32.contiguous().view(torch.int32) >> 16).to(torch.int16)
    return bool(ok.all())


_DEQUANT_CASES = [(torch.bfloat16, "group"), (torch.float16, "group"), (torch.bfloat16, "vector"),
                  (torch.float16, "vector"), (torch.bfloat16, "scalar"), (torch.float16, "scalar"),
                  (torch.bfloat16, "none"), (torch.float16, "none"), (torch.float8_e4m3fn, "none"),
                  (torch.float8_e5m2, "none")]


@pytest.mark.parametrize("n,k", [(37, 1000), (64, 640), (5, 130), (70, 1536), (1, 512)])
@pytest.mark.parametrize("dtype,w_kind", _DEQUANT_CASES)
def test_dequantize_matches_the_values_bit_for_bit(n, k, dtype, w_kind):
    """dequantize_prepacked against v.float() * scale rounded to dtype, from the int4 values
    themselves: every output type and scale kind, N not a multiple of the rows per program,
    K not a multiple of 512 (the padding words are not written out, group scales past K are not
    read) and more than one 512 block. Negative scales: zeros keep their sign."""
    from tileq.kernels.int4p.dequant import dequantize_prepacked

    torch.manual_seed(n * 7 + k)
    v = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    v[0, : min(k, 16)] = torch.arange(-8, 8)[: min(k, 16)].to(torch.int8)  # every value
    w = prepack_int4(v).to(DEV)
    gk = -(-k // 128)
    ws = {"group": torch.randn(gk, n), "vector": torch.randn(n), "scalar": torch.randn(()), "none": None}[w_kind]
    strides = {"group": (n, 1), "vector": (0, 1), "scalar": (0, 0), "none": (0, 0)}[w_kind]
    full = {"group": lambda s: s.repeat_interleave(128, 0)[:k].t(), "vector": lambda s: s[:, None],
            "scalar": lambda s: s, "none": lambda s: 1.0}[w_kind](ws)
    want = v.float() * full
    got = dequantize_prepacked(w.data, n, k, None if ws is None else ws.to(DEV), w_kind, strides, 128, dtype)
    assert got.dtype == dtype and got.shape == (n, k)
    assert _same_rounding(got, want, dtype), (got.cpu().float() - want).abs().max()


@pytest.mark.parametrize("group_k", [128, 256, 384, 512, 1024, 64, 96])
@pytest.mark.parametrize("transposed", [False, True])
def test_dequantize_group_scales_of_every_width(group_k, transposed):
    """Group scales of any multiple of 128 (a group can start at every 128 of K, at every 256,
    once per 512 block or less often; 64 and 96 too, which linear_prepacked refuses),
    [K/group_k, N] contiguous or transposed, K ending inside a group; bit for bit."""
    from tileq.kernels.int4p.dequant import dequantize_prepacked

    torch.manual_seed(group_k)
    n, k = 33, 1700
    v = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    w = prepack_int4(v).to(DEV)
    gk = -(-k // group_k)
    ws = torch.rand(gk, n) + 0.25
    sw = ws.t().contiguous().t() if transposed else ws
    for dtype in (torch.bfloat16, torch.float16):
        got = dequantize_prepacked(w.data, n, k, sw.to(DEV), "group", (sw.stride(0), sw.stride(1)), group_k, dtype)
        want = v.float() * ws.repeat_interleave(group_k, 0)[:k].t()
        assert _same_rounding(got, want, dtype), (group_k, dtype)


@pytest.mark.parametrize("w_kind", ["group", "vector", "scalar"])
@pytest.mark.parametrize("x_kind", ["vector", "scalar"])
def test_w4a8_fp8_prefill_runs_tileqs_fp8_gemm(w_kind, x_kind):
    """Fp8PrefillLaunch through the Triton kernels (the interpreter on CPU): the int4 values as
    fp8, group scales by scheme bquant (groups of one column), the others by rowcol; per-token or
    per-tensor activation scales, bias; against the float64 reference."""
    from tileq.dispatch.plan import make_plan
    from tileq.dispatch.prepacked import inner_spec
    from tileq.kernels.int4p.fp8_prefill import Fp8PrefillLaunch
    from tileq.kernels.int4p.spec import PrepackedSpec

    torch.manual_seed(5)
    m, n, k, group_k = 7, 40, 640, 256 if w_kind == "group" else 128
    v = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    w = prepack_int4(v).to(DEV)
    sw = _w4a8_scales(w_kind, n, k, group_k)
    x = (torch.randn(m, k) * 50).clamp(-400, 400).to(torch.float8_e4m3fn)
    sx = torch.rand(m) + 0.5 if x_kind == "vector" else torch.tensor(0.7)
    bias = torch.randn(n)
    spec = inner_spec(PrepackedSpec(m, n, k, "fp8", x_kind, w_kind, torch.bfloat16, group_k, True))
    plan = make_plan(spec, torch.device(DEV), backend="triton")
    launch = Fp8PrefillLaunch(n, k, w_kind, x_kind, group_k, torch.bfloat16, x.dtype, plan)
    assert launch.scheme == ("bquant" if w_kind == "group" else "rowcol")
    y = launch(x.to(DEV), w.data, sx.to(DEV), sw.to(DEV), bias.to(DEV))
    want = _reference(x, v, sw, sx, bias, group_k)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert float((y.cpu().double() - want).abs().max() / want.abs().max()) < 1e-2


def test_w4a8_prefill_takes_the_fp8_gemm():
    """W4A8 from INT4_DEQUANT_MIN_M tokens where the Gluon prefill kernel does not take the call:
    the fp8 GEMM on the int4 values (bquant for group scales, rowcol for per-channel ones), through
    linear_prepacked, against the reference; describe says so."""
    DEQUANT_MIN_M = T.INT4_DEQUANT_MIN_M
    f8 = torch.float8_e4m3fn
    big = T.INT4_W4A8_MAX_M  # (below, an sm_90 GPU runs the Gluon kernel on the activations cast to bf16)
    torch.manual_seed(9)
    m, n, k = DEQUANT_MIN_M + 1, 24, 512
    v = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    w = prepack_int4(v).to(DEV)
    sw = _w4a8_scales("group", n, k, 128)
    x = (torch.randn(m, k) * 50).clamp(-400, 400).to(f8)
    sx = torch.rand(m) + 0.5
    want = _reference(x, v, sw, sx, None, 128)
    text = describe_prepacked(big, 4096, 4096, f8)
    assert text.startswith("dequant-fp8+tileq") and "bquant GEMM" in text
    assert "rowcol GEMM" in describe_prepacked(big, 4096, 4096, f8, w_scale="vector")
    assert describe_prepacked(DEQUANT_MIN_M, 4096, 4096).startswith("bquant_bf16xi4p_rcr_prefill__gluon")
    # (on the CPU the Gluon kernel serves nothing: from DEQUANT_MIN_M tokens the fp8 GEMM)
    assert describe_prepacked(DEQUANT_MIN_M, 4096, 4096, f8, device=torch.device("cpu")).startswith(
        "dequant-fp8+tileq")
    below = describe_prepacked(33, 4096, 4096, f8, device=torch.device("cpu"))
    assert below.startswith("bquant_bf16xi4p_rcr_decode__") and "fp8 activations cast to bf16 first" in below
    y = linear_prepacked(x.to(DEV), w, sx.to(DEV), sw.to(DEV))
    assert float((y.cpu().double() - want).abs().max() / want.abs().max()) < 1e-2


def test_default_config_covers_the_gpu():
    assert default_config(1, 5120, 17408).split_k > 1  # 80 row tiles on 132 SMs
    assert default_config(1, 28672, 8192).split_k == 1
    assert default_config(64, 4096, 4096).bm == 32 and default_config(16, 4096, 4096).stages == 3


@pytest.mark.parametrize("m, n, k, tag", [
    # programs = 64-row tiles x split-K (the partials summed in the kernel, _fx): up to 2 per SM
    # (264 on 132 SMs) three stages,
    (16, 7168, 5120, "m64n16k512_w4_s3_sk2_r168_pf_fx_swap"),        # 224 programs
    (16, 8192, 28672, "m64n16k512_w4_s3_sk2_r168_pf_fx_swap"),       # 256
    (1, 3072, 4096, "m64n16k512_w4_s3_sk4_r168_pf_fx_swap"),         # 192
    # up to 3 per SM two stages; uncapped configs load group scales one K tile ahead under a
    # 168-register cap (_r168_pf),
    (1, 6144, 4096, "m64n16k512_w4_s2_sk4_r168_pf_fx_swap"),         # 384
    (4, 6144, 4096, "m64n16k512_w4_s2_sk4_r168_pf_fx_swap"),
    (16, 5120, 17408, "m64n16k512_w4_s2_sk4_r168_pf_fx_swap"),       # 320
    # up to 4 per SM two stages under the 128-register cap: at M > 1 without split-K only,
    (1, 28672, 8192, "m64n16k512_w4_s2_r128_swap"),       # 448
    (16, 28672, 8192, "m64n16k512_w4_s2_r128_swap"),
    # at M = 1 K split further while four per SM hold the programs (a 16-token split-K tile
    # under the cap lost at M = 16, so M > 1 keeps the 1.5-waves split and three stages),
    (1, 8192, 28672, "m64n16k512_w4_s2_sk4_r128_fx_swap"),   # 512
    (16, 8192, 28672, "m64n16k512_w4_s3_sk2_r168_pf_fx_swap"),
    (1, 3584, 18944, "m64n16k512_w4_s2_sk8_r128_fx_swap"),   # 448
    (8, 3584, 18944, "m64n16k512_w4_s3_sk4_r168_pf_fx_swap"),        # 224
    # beyond four per SM: capped at M = 1, three stages above.
    (1, 34816, 5120, "m64n16k512_w4_s2_r128_swap"),       # 544
    (16, 34816, 5120, "m64n16k512_w4_s3_r168_pf_swap"),
    (32, 28672, 8192, "m64n32k512_w4_s2_swap"),           # 32-token tiles: not this rule
])
def test_decode_rule_picks_stages_and_the_register_cap_by_programs_per_sm(m, n, k, tag):
    decode_rule = rules.decode_rule

    cfg, why = decode_rule(m, n, k, streamk=False)  # (the bands; stream-K for wave tails below)
    assert cfg.tag == tag, why
    assert cfg.fixup == ("the partials summed in the kernel" in why) == (cfg.split_k > 1)
    full = decode_rule(m, n, k)[0]
    assert default_config(m, n, k) == full and decode_rule(m, n, k, "fp16")[0] == full
    assert full == cfg or full.streamk
    programs = -(-n // 64) * -(-m // cfg.bm) * cfg.split_k
    assert f"{programs} programs" in why
    if cfg.bm == 16:
        per_sm = {(3, 168): 2, (2, 168): 3, (2, 128): 4}[(cfg.stages, cfg.maxnreg)]
        assert programs <= per_sm * 132 or "over 4 per SM" in why
        assert ("registers capped at 128" in why) == (cfg.maxnreg == 128)
        assert cfg.scale_ahead == (cfg.maxnreg == 168) == ("group scales one K tile ahead" in why)
    # fp8 activations take the M = 1 branches at every decode M (their own sweep), except that
    # beyond four programs per SM only M = 1 keeps the cap; converted to fp16
    fp8, fp8_why = decode_rule(m, n, k, "fp8")
    assert decode_rule(m, n, k, "bf8")[0] == fp8
    assert fp8.fp16 and fp8_why.endswith("fp8 converted to fp16"), fp8_why
    if m > 16:
        assert fp8 == replace(cfg, fp16=True)
    else:
        at_one, one_why = decode_rule(1, n, k, streamk=False)
        if m > 1 and "over 4 per SM" in one_why:
            assert fp8 == Int4pConfig(16, at_one.split_k, 3, maxnreg=168, scale_ahead=True, fp16=True), fp8_why
        else:
            assert fp8 == replace(at_one, fp16=True), fp8_why


def test_decode_rule_scales_with_the_number_of_sms():
    decode_rule = rules.decode_rule

    # 448 programs: four per SM on 132 SMs; on 114 SMs (H100 PCIe) 456 slots still hold them,
    # on 100 SMs they do not: three stages at M = 16, still capped at M = 1.
    assert decode_rule(16, 28672, 8192, facts=sm90_with(114))[0].maxnreg == 128
    assert decode_rule(16, 28672, 8192, facts=sm90_with(100), streamk=False)[0] == \
        Int4pConfig(16, 1, 3, maxnreg=168, scale_ahead=True)
    assert decode_rule(1, 28672, 8192, facts=sm90_with(100), streamk=False)[0] == Int4pConfig(16, 1, 2, 4, 128)
    # (448 tiles on 100 SMs: 1.12 waves of four per SM at M = 1, 2.24 of two at M = 16: stream-K)
    assert decode_rule(1, 28672, 8192, facts=sm90_with(100))[0].streamk
    assert decode_rule(16, 28672, 8192, facts=sm90_with(100))[0] == \
        Int4pConfig(16, 1, 3, maxnreg=168, scale_ahead=True, streamk=True)


@pytest.mark.parametrize("m,n,k,x_type,streamk", [
    (1, 36864, 7168, "bf16", True),    # 576 tiles, four per SM: 1.09 waves
    (1, 37888, 3584, "fp16", True),    # 592: 1.12
    (1, 28672, 8192, "bf16", False),   # 448: under one wave
    (1, 65536, 5120, "bf16", False),   # 1024: 1.94 waves
    (8, 36864, 7168, "bf16", True),    # two per SM (three stages): 2.18 waves
    (24, 34816, 5120, "bf16", True),   # 32-token tiles, two per SM: 2.06 waves
    (1, 36864, 7168, "fp8", False),    # W4A8's fp8 kernel: not measured faster with it
    (1, 4096, 14336, "bf16", False),   # split over K: not this rule
])
def test_decode_rule_takes_streamk_for_a_wave_tail(m, n, k, x_type, streamk):
    """Stream-K where an unsplit config's tiles leave the last wave of its band at most a quarter
    full (16-bit activations): two programs per SM (three stages, 168 registers, scales ahead; 32-
    token tiles two stages), and the reason says so."""
    cfg, why = rules.decode_rule(m, n, k, x_type)
    assert cfg.streamk == streamk and ("stream-K" in why) == streamk, why
    if streamk:
        assert cfg.per_sm == 2 and cfg.split_k == 1 and f"at most {T.INT4_DECODE_STREAMK_TAIL} full" in why
        assert cfg == (Int4pConfig(16, 1, 3, 4, 168, True, streamk=True) if m <= 16 else
                       Int4pConfig(32, 1, 2, streamk=True))


# ----------------------------------------------------------------------------- sm_90 build


def test_sm90_build_converts_in_registers_without_shared_round_trips():
    """The words reach the wgmma A fragment with no data movement after the shared-memory load
    (no layout conversion, no store back to shared memory), and the K loop has the expected
    conversion: 4 LOP3 + 4 packed subtractions per two words, 32 m64n16k16 wgmmas in four dots
    per 512 of K, no spills (compiled for sm_90 on the CPU, no interpreter)."""
    import json
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root / "src")
    for ct in ("bf16", "fp16"):
        proc = subprocess.run([sys.executable, "-m", "tileq", "sass", "--prepacked", ct, "16",
                               "group", "--json", "--out", "/tmp/tileq-sass-test"], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        ttgir = r["ttgir"]
        # The words come from shared memory straight into the conversion, and the converted
        # operands reach the dots without a layout conversion or a store to shared memory.
        assert "tensor<64x64xi32" in r["inline_asm"], r["inline_asm"]
        assert "ttg.convert_layout" not in ttgir.split("scf.for", 1)[1].split("scf.yield", 1)[0]
        assert not any("local_alloc %" in ln and "64x128x" in ln for ln in ttgir.splitlines())
        assert ttgir.count("ttng.warp_group_dot ") == 4  # four 128-wide dots per 512 of K
        ops = r["loop_ops"]
        assert ops.get("HGMMA") == 32, ops
        assert ops.get("HADD2") == 128 and ops.get("LOP3", 0) >= 128, ops
        assert ops.get("PRMT", 0) == 0 and ops.get("STS", 0) <= 8, ops  # no shuffles, no round trips
        assert r["kernel_ops"].get("LDL", 0) == 0 and r["kernel_ops"].get("STL", 0) == 0, r["kernel_ops"]


def test_sm90_build_converts_fp8_activations_to_fp16_in_one_instruction():
    """Int4pConfig(fp16=True) compiled for sm_90 on the CPU: the fp8 activations become fp16 in one
    cvt per two values (F2FP) with no detour through fp32 (no F2F) and no byte shuffles (PRMT),
    for e4m3 and e5m2; the K loop is at most 670 instructions (the bf16 conversion: 753-785)."""
    import json
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root / "src")
    for ct in ("fp8e4nv", "fp8e5"):  # (the decode rule's capped config for fp8 activations)
        counts = {}
        for extra in ([], ["--fp16"]):
            proc = subprocess.run([sys.executable, "-m", "tileq", "sass", "--prepacked", ct, "16",
                                   "group", "--maxnreg", "128", *extra, "--json", "--out",
                                   f"/tmp/tileq-sass-test-{os.getpid()}"], env=env, capture_output=True, text=True,
                                  timeout=300)
            assert proc.returncode == 0, proc.stderr[-3000:]
            counts[bool(extra)] = json.loads(proc.stdout.strip().splitlines()[-1])
        h16, bf16 = counts[True], counts[False]
        ops = h16["loop_ops"]
        assert ops.get("F2F", 0) == 0 and ops.get("PRMT", 0) == 0 and ops.get("F2FP") == 32, ops
        assert ops.get("HGMMA") == 32 and ops.get("HADD2") == 128, ops
        assert h16["loop"] <= 670 < bf16["loop"], (h16["loop"], bf16["loop"])
        # (capped at 128 registers ptxas spills a little, as for the bf16 build: none in the loop's stores)
        assert h16["registers"] <= 128 and ops.get("STL", 0) == 0 and ops.get("LDL", 0) <= 2, ops


def test_sm90_build_of_the_streamk_decode_kernel():
    """Stream-K builds (Int4pConfig(streamk=True)) for sm_90 on the CPU at the decode rule's three
    occupancy bands: within the register cap of the band (four programs per SM at 128, three at
    168 with two stages, two with three stages), the K loop's 32 wgmmas, the in-kernel sum's
    atomic count, and no spills where the band is not capped at 128 (capped, ptxas spills a few
    values: two more local loads per K tile than without stream-K, and two stores)."""
    import json
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root / "src")
    for extra, cap in ((["--stages", "2", "--maxnreg", "128"], 128),
                       (["--stages", "2", "--maxnreg", "168", "--scale-ahead"], 168),
                       (["--stages", "3", "--maxnreg", "168", "--scale-ahead"], 168)):
        proc = subprocess.run([sys.executable, "-m", "tileq", "sass", "--prepacked", "bf16", "16",
                               "group", *extra, "--streamk", "--json", "--out", f"/tmp/tileq-sass-test-{os.getpid()}"],
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        ops, all_ops = r["loop_ops"], r["kernel_ops"]
        assert r["registers"] <= cap and ops.get("HGMMA") == 32 and all_ops.get("ATOMG", 0) >= 1, (r["registers"], ops)
        if cap == 128:  # (sm_90 build: 4 local loads and 2 stores per K tile, 15 / 17 in the kernel)
            assert ops.get("STL", 0) <= 4 and all_ops.get("STL", 0) <= 24, all_ops
        else:
            assert all_ops.get("STL", 0) == 0 and all_ops.get("LDL", 0) == 0, all_ops


def test_sm90_build_of_the_register_capped_config_spills_little():
    """The configs the decode rule caps at 128 registers (two stages, split-K 1 and > 1), compiled
    for sm_90 on the CPU: four programs fit an SM (128 registers, 48 KB of shared memory), the K
    loop keeps its 32 wgmmas and conversion, and ptxas's spills cost at most two local loads and
    no local stores per K tile (what the H200 sweep measured; more would void the rule's bands)."""
    import json
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root / "src")
    for split in ("1", "4"):
        args = ["--prepacked", "bf16", "16", "group", "--stages", "2", "--split-k", split, "--maxnreg", "128",
                "--json", "--out", "/tmp/tileq-sass-test"]
        proc = subprocess.run([sys.executable, "-m", "tileq", "sass", *args], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        assert r["registers"] <= 128 and 4 * r["shared"] <= 228 * 1024, (r["registers"], r["shared"])
        ops = r["loop_ops"]
        assert ops.get("HGMMA") == 32 and ops.get("HADD2") == 128, ops
        assert ops.get("LDL", 0) <= 2 and ops.get("STL", 0) == 0, ops


def test_explain_prepacked_names_the_kernel_or_the_prefill_path():
    import contextlib
    import io
    from types import SimpleNamespace

    from tileq.cli import main

    def explain(*args):  # the tileq command's entry point, in this process (the CLI tests run it in a new one)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["explain", "--prepacked", "--scheme", "bquant", "--b", "int4", *args])
        return SimpleNamespace(returncode=rc or 0, stdout=out.getvalue(), stderr=err.getvalue())

    out = explain("--a", "bf16", "--m", "1", "--n", "7168", "--k", "5120")  # Qwen3-14B qkv: tuned
    assert out.returncode == 0, out.stderr
    assert ("bquant_bf16xi4p_rcr_decode__m64n16k512_w4_s3_sk2_r168_pf_swap_sm90" in out.stdout
            and "(tuned table)" in out.stdout), out.stdout
    assert "split-K 2 (partials summed by a second kernel)" in out.stdout, out.stdout  # (as it was measured)
    out = explain("--a", "bf16", "--m", "1", "--n", "3072", "--k", "4096")
    assert "bquant_bf16xi4p_rcr_decode__m64n16k512_w4_s3_sk4_r168_pf_fx_swap_sm90" in out.stdout
    assert ("(heuristic: 192 programs (48 row tiles x split-K 4), up to 2 per SM: three stages; group scales "
            "one K tile ahead (168 registers); the partials summed in the kernel)") in out.stdout, out.stdout
    assert "split-K 4 (partials summed in the kernel by each tile's last program)" in out.stdout, out.stdout
    out = explain("--a", "bf16", "--m", "1", "--n", "3584", "--k", "18944")  # the rule's register cap
    assert "bquant_bf16xi4p_rcr_decode__m64n16k512_w4_s2_sk8_r128_fx_swap_sm90" in out.stdout, out.stdout
    assert "registers capped at 128 (heuristic: 448 programs" in out.stdout, out.stdout
    # ... which compiled code cannot carry: the line after names the uncapped twin it runs there
    assert ("compiled: under torch.compile bquant_bf16xi4p_rcr_decode__m64n16k512_w4_s3_sk8_pf_fx_swap_sm90 "
            "(no register cap") in out.stdout, out.stdout
    out = explain("--a", "bf16", "--m", "8", "--n", "36864", "--k", "7168")  # a wave tail: stream-K
    assert "bquant_bf16xi4p_rcr_decode__m64n16k512_w4_s3_r168_pf_stk_swap_sm90" in out.stdout, out.stdout
    assert "stream-K: 2 programs per SM" in out.stdout and "2.18 waves of 2 per SM" in out.stdout, out.stdout
    out = explain("--a", "fp8", "--m", "1024", "--n", "5120", "--k", "17408")
    assert out.returncode == 0 and "dequant-fp8+tileq" in out.stdout and "bquant GEMM" in out.stdout, out.stdout
    out = explain("--a", "bf16", "--m", "512", "--n", "5120", "--k", "5120")
    assert out.returncode == 0 and "bquant_bf16xi4p_rcr_prefill__gluon_w128t256k512_ws2x64_sm90" in out.stdout
    assert "1 waves of 256-token tiles (x 1.7) against 2 of 128-token ones" in out.stdout, out.stdout
    assert "the next slice while" not in out.stdout  # (256-token tiles: no overlap)
    out = explain("--a", "bf16", "--m", "128", "--n", "5120", "--k", "5120")
    assert "int4 converted in registers (the next slice while this one's wgmmas run)" in out.stdout, out.stdout
    out = explain("--a", "bf16", "--m", "512", "--n", "5120", "--k", "17408")  # (stream-K)
    assert out.returncode == 0 and "bquant_bf16xi4p_rcr_prefill__gluon_w128t256k512_stk_ws2x64_sm90" in out.stdout
    assert "stream-K: 0 whole tiles of 256 tokens, then 21 of the other 2720" in out.stdout, out.stdout
    out = explain("--a", "int8", "--m", "1", "--n", "64", "--k", "128")
    assert out.returncode != 0 and "--prepacked: expected" in out.stderr


def test_selftest_prepacked_pass():
    from tileq.commands import prepacked_pass

    assert prepacked_pass(DEV) == 0  # tileq selftest runs this after the catalog families


def test_tuned_table_configs_parse_and_serve_only_their_sizes():
    import json
    from importlib import resources

    from tileq.dispatch.int4 import config_for
    from tileq.dispatch.tuned import INT4_DECODE_TABLE, int4_decode_table

    doc = json.loads(resources.files("tileq.dispatch").joinpath(INT4_DECODE_TABLE).read_text())
    assert doc["arch"] == "sm_90" and "H200" in doc["about"]
    table = int4_decode_table()
    assert len(table) == len(doc["entries"]) > 0
    for e in doc["entries"]:
        cfg = table[(e["n"], e["k"], e["m"])]
        assert cfg.tag == e["config"] and cfg.bm == 16 and e["us"] < 0.97 * e["heuristic_us"]
        m = 1 if e["m"] == 1 else 9
        assert config_for(m, e["n"], e["k"]) == (cfg, "tuned table")
        fp8, source = config_for(m, e["n"], e["k"], "fp8")
        assert fp8 == default_config(m, e["n"], e["k"], x_type="fp8") and source.startswith("heuristic: ")
        assert config_for(33, e["n"], e["k"])[1].startswith("heuristic: ")
    assert config_for(1, 4096, 3072)[1].startswith("heuristic: ")  # not in the table
    for bad in ("m64n16k256_w4_s2_swap", "m128n16k512_w4_s2_swap"):
        with pytest.raises(ValueError):
            Int4pConfig.parse_tag(bad)


# ----------------------------------------------------------------------------- Gluon prefill


def test_prefill_path_choice():
    """From DEQUANT_MIN_M tokens: the Gluon kernel for W4A16 on an sm_90 GPU (with group scales
    below GROUP_SCALE_MAX_M), W4A8 the fp8 GEMM on the values, dequantize + cuBLAS otherwise,
    each with its reason."""

    assert describe_prepacked(512, 5120, 5120).startswith("bquant_bf16xi4p_rcr_prefill__gluon_")
    assert describe_prepacked(512, 5120, 5120, torch.float16).startswith("bquant_fp16xi4p_rcr_prefill__gluon_")
    w4a8 = describe_prepacked(200, 5120, 5120, torch.float8_e4m3fn)
    assert w4a8.startswith("bquant_fp8xi4p_rcr_prefill__gluon_") and "its fp8 build" in w4a8
    w4a8 = describe_prepacked(200, 5120, 5120, torch.float8_e4m3fn, w_scale="vector")
    assert w4a8.startswith("rowcol_bf16xi4p_rcr_prefill__gluon_") and "fp8 activations cast to bf16 first" in w4a8
    big8 = T.INT4_W4A8_MAX_M
    assert describe_prepacked(big8, 5120, 5120, torch.float8_e4m3fn, w_scale="vector").startswith("dequant-fp8+tileq")
    for x_dtype, path, why in ((torch.float8_e4m3fn, "dequant-fp8+tileq", "W4A8 from 256 tokens: the fp8 GEMM"),
                               (torch.bfloat16, "dequant+cublas", "multiple of 8")):
        text = describe_prepacked(300, 5120, 1100, x_dtype)
        assert text.startswith(path) and why in text, text
    assert "a compiled kernel on a GPU" in describe_prepacked(512, 5120, 5120, device=torch.device("cpu"))
    cpu = torch.device("cpu")
    assert rules.unserved(512, 5120, "bf16", "none", "group", torch.float32, device=cpu) == "bf16/fp16 outputs only"
    assert "(W4A16)" in rules.unserved(512, 5120, "bf16", "vector", "group", torch.bfloat16, device=cpu)
    assert "(W4A8)" in rules.unserved(512, 5120, "fp8", "none", "group", torch.bfloat16, device=cpu)
    # Group scales: dequantize + cuBLAS from GROUP_SCALE_MAX_M tokens; per-channel: the kernel.
    big = T.INT4_GROUP_SCALE_MAX_M
    assert "measured faster" in describe_prepacked(big, 5120, 5120)
    assert describe_prepacked(big, 5120, 5120, w_scale="vector").startswith("rowcol_bf16xi4p_rcr_prefill__gluon_")


def test_256_token_tiles_from_256_tokens(monkeypatch):
    """From T256_MIN_M (256) tokens the 256-token tile where its waves cost less (TILE256_COST of a
    128-token tile's); with group scales only below GROUP_T256_MAX_M (dequantize + cuBLAS
    otherwise); never with a TMA store or an activation scale."""

    assert T.INT4_T256_MIN_M == 256
    assert rules.tokens_for(255, 8192) == 128 and rules.tokens_for(1024, 8192) == 256  # 4 waves against 2
    assert rules.tokens_for(1024, 5120) == 128  # 3 waves against 2 (x 1.7)
    assert rules.tokens_for(256, 8192) == 128  # 1 wave either way
    assert rules.tokens_for(512, 5120) == 256 and rules.tokens_for(512, 4096) == 128  # 160 / 128 tiles of 128
    # below T256_THIN_MAX_M not where the last 256-token tile holds fewer than 128 tokens (Qwen3-14B
    # qkv at 288-352 tokens: 168 / 112 tiles of 128 / 256)
    assert [rules.tokens_for(m, 7168) for m in (288, 383, 384)] == [128, 128, 256]
    assert T.INT4_T256_THIN_MAX_M == 512 and rules.tokens_for(544, 4096) == 256  # (from 512 as before)
    assert rules.prefill_tiling(320, 7168, 5120) == (128, 1)
    assert rules.streamk_for(320, 7168, 5120, 128, 1) == (128, True)
    # an activation scale (W4A8) keeps 128-token tiles: the 256-token build with one spilled
    assert rules.tokens_for(512, 5120, x_scale=True) == 128
    assert rules.prefill_tiling(512, 5120, 5120, x_scale=True) == (128, 1)
    assert rules.tokens_for(4096, 5120) == 256
    text = describe_prepacked(1024, 8192, 28672)  # Llama-70B down, group scales
    assert text.startswith("bquant_bf16xi4p_rcr_prefill__gluon_w128t256k512_ws2x64_sm90"), text
    assert "2 waves of 256-token tiles (x 1.7) against 4 of 128-token ones" in text, text
    assert describe_prepacked(1024, 5120, 5120).startswith("dequant+cublas")
    assert describe_prepacked(T.INT4_GROUP_T256_MAX_M, 8192, 28672).startswith("dequant+cublas")
    chan = describe_prepacked(4096, 5120, 5120, w_scale="vector")
    assert chan.startswith("rowcol_bf16xi4p_rcr_prefill__gluon_w128t256k512_ws2x64_sm90"), chan
    with pytest.raises(ValueError, match="no TMA store"):
        pl.constexprs("bf16", "group", 128, False, True, 256)
    with pytest.raises(ValueError, match="no activation scale"):
        pl.constexprs("bf16", "group", 128, False, False, 256, 1, "vector")


def test_stream_k_choice():
    """streamk_for: W4A16 from 128 to 1023 tokens, stream-K where its cost (whole tiles' K blocks +
    per + STREAMK_OVERHEAD) beats the plan's waves x K blocks per item by STREAMK_MARGIN, with the
    token tile of the cheaper cost; never for W4A8 or outside that range; explain names it."""

    # Mistral-24B down at 512 tokens: 80 tiles of 256 tokens x 64 K blocks in one wave against
    # 39 + 3 blocks per SM with stream-K
    assert rules.prefill_tiling(512, 5120, 32768) == (256, 1)
    assert rules.streamk_for(512, 5120, 32768, 256, 1) == (256, True)
    assert rules.plan_cost(512, 5120, 32768, 256, 1) == 64 * T.INT4_TILE256_COST
    assert rules.streamk_cost(512, 5120, 32768, 256) == (39 + T.INT4_STREAMK_OVERHEAD) * T.INT4_TILE256_COST
    assert rules.streamk_for(512, 5120, 32768, 256, 1, x_scale=True) == (256, False)
    assert rules.streamk_for(1024, 5120, 32768, 256, 1) == (256, False)  # (STREAMK_MAX_M)
    assert rules.streamk_for(100, 34816, 5120, 128, 1) == (128, False)  # (below 128 tokens)
    # Qwen3-14B gate_up at 128 tokens: 272 tiles in 3 waves of 10 blocks; stream-K 132 whole tiles
    # then 11 units: 24 against 30
    assert rules.streamk_for(128, 34816, 5120, 128, 1) == (128, True)
    # Qwen3-14B o at 512 tokens: 80 tiles of 256 in one wave of 10 blocks (17 with the tile's cost)
    # against (7 + 3) x 1.7 x 1.1: not enough
    assert rules.streamk_for(512, 5120, 5120, 256, 1) == (256, False)
    # DeepSeek-V3 down at 200 tokens: 112 tiles of 128 tokens in one wave of 36 blocks; 256-token
    # stream-K (from STREAMK_T256_MIN_M) 56 x 36 units, 16 per SM: (16 + 3) x 1.7 x 1.1 = 35.5
    assert T.INT4_STREAMK_T256_MIN_M == 129
    assert rules.prefill_tiling(200, 7168, 18432) == (128, 1)
    assert rules.streamk_for(200, 7168, 18432, 128, 1) == (256, True)
    assert rules.streamk_for(128, 7168, 18432, 128, 2)[0] == 128  # (the plan splits K 2 ways)
    text = describe_prepacked(512, 5120, 32768)
    assert text.startswith("bquant_bf16xi4p_rcr_prefill__gluon_w128t256k512_stk_ws2x64_sm90"), text
    assert "stream-K: 0 whole tiles of 256 tokens, then 39 of the other 5120" in text, text
    assert describe_prepacked(512, 5120, 32768, torch.float8_e4m3fn).startswith("dequant-fp8+tileq")


def test_prefill_kernel_below_dequant_min_m():
    """Below DEQUANT_MIN_M tokens the Gluon kernel takes a call from MIN_M (33) tokens when its
    64-token tiling has the tiles to fill the SMs (0.65 x SMs, 0.5 x from 128 tokens: the decode
    kernel splits K, this one does not); the token tile with fewer waves (a 64-token tile at 0.8
    of a 128-token one's cost)."""
    assert not rules.prefers(32, 34816) and rules.prefers(33, 34816)
    assert rules.prefers(48, 11008) and not rules.prefers(48, 10880)  # 86 / 85 tiles
    assert not rules.prefers(96, 5120) and rules.prefers(128, 5120)  # 80 tiles either way
    assert not rules.prefers(128, 4096) and rules.prefers(192, 4096)  # 64 / 96 tiles
    assert rules.tokens_for(48, 34816) == rules.tokens_for(64, 34816) == 64
    assert rules.tokens_for(96, 7168) == 64  # 112 tiles (one wave) against 56
    assert rules.tokens_for(96, 34816) == 128  # 544 tiles: 5 waves x 0.8 against 3
    assert rules.tokens_for(192, 7168) == 128 and rules.tokens_for(300, 4096) == 128
    text = describe_prepacked(48, 34816, 5120)
    assert text.startswith("bquant_bf16xi4p_rcr_prefill__gluon_w128t64k512_ws2x64_sm90") and "272 tiles" in text
    # 40 tiles of 64 tokens: too few for prefers(), few enough for the split over K (plan)
    text = describe_prepacked(64, 5120, 17408)
    assert text.startswith("bquant_bf16xi4p_rcr_prefill__gluon_w128t64k512_sk3_ws2x64_sm90"), text
    assert "40 tiles of 64 tokens" in text and "split over K 3 ways" in text
    # W4A8 follows the same choice: with group scales the kernel's fp8 build (fused_for), else its
    # activations cast to bf16
    assert describe_prepacked(48, 34816, 5120, torch.float8_e4m3fn).startswith("bquant_fp8xi4p_rcr_prefill__gluon_")
    # (the 16-bit build with the activations' scale is another binary: '_xs')
    assert describe_prepacked(48, 34816, 5120, torch.float8_e5m2).startswith(
        "bquant_bf16xi4p_rcr_prefill__gluon_w128t64k512_ws2x64_xs_sm90")
    assert describe_prepacked(32, 34816, 5120, torch.float8_e4m3fn).startswith("bquant_bf16xi4p_rcr_decode__")
    assert describe_prepacked(16, 34816, 5120).startswith("bquant_bf16xi4p_rcr_decode__")


def test_prefill_plan_routes_narrow_weights_to_the_split():
    """plan(): the split over K where the tiling leaves a third of the SMs idle (at most 0.65 x
    SMs tiles) and split_for finds one; else the unsplit kernel where prefers() (or from
    DEQUANT_MIN_M tokens), else the decode kernel (None)."""

    assert rules.prefill_tiling(32, 5120, 17408) is None  # below MIN_M: the decode kernel
    assert rules.prefill_tiling(48, 5120, 17408) == (64, 3)  # 40 tiles
    assert rules.prefill_tiling(48, 4608, 3584) == (64, 3)  # 36 tiles, 7 K blocks: ranges of 2-3
    assert rules.prefill_tiling(48, 11008, 4096) == (64, 1)  # 86 tiles: over 0.65 x SMs, prefers()
    assert rules.prefill_tiling(48, 10880, 1024) is None  # 85 tiles but 2 K blocks; not prefers()
    assert rules.prefill_tiling(96, 5120, 17408) == (128, 3)  # a 128-token tile once split
    assert rules.prefill_tiling(128, 8192, 28672) == (128, 2)  # 64 tiles
    assert rules.prefill_tiling(128, 11008, 4096) == (128, 1)  # 86 tiles: unsplit
    assert rules.prefill_tiling(256, 3584, 18944) == (128, 7)  # 56 tiles, 37 blocks
    assert rules.prefill_tiling(256, 4608, 3584) == (128, 1)  # 7 blocks: under four per range above 128 tokens
    assert rules.prefill_tiling(256, 7168, 18432) == (128, 1)  # 112 tiles: over 0.65 x SMs
    assert rules.prefill_tiling(4096, 5120, 5120) == (256, 1) and rules.prefill_tiling(512, 5120, 5120) == (256, 1)
    assert rules.prefill_tiling(512, 4096, 5120) == (128, 1)
    assert rules.prefill_tiling(48, 5120, 17408, sm90_with(100)) == (64, 5) and rules.prefill_tiling(48, 11008, 4096, sm90_with(200)) == (64, 2)


def test_prefill_split_choice_and_names():
    """The prefill kernel's split over K: only for grids of fewer tiles than SMs, the split with
    the fewest K blocks in a row (waves x blocks per range), at least two 512-wide K blocks per
    range (four above 128 tokens); its own name."""

    assert rules.split_for(4096, 5120, 5120, 128) == 1  # 1280 tiles
    # 80 tiles on 132 SMs, K = 17408 has 34 blocks: 2 -> 160 items (2 waves x 17 blocks = 34),
    # 3 -> 240 (2 x 12 = 24), 6 -> 480 (4 x 6 = 24), 8 -> 640 (5 x 5 = 25): 3 (the smaller of a tie)
    assert rules.split_for(256, 5120, 17408, 128) == 3
    # 56 tiles, 36 blocks: 2 -> 112 items (1 wave x 18), 7 -> 392 (3 waves x 6 = 18, one range empty)
    assert rules.split_for(48, 7168, 18432, 64) == 2
    assert rules.split_for(256, 5120, 2048, 128) == 1  # 4 blocks: 2 ways gives 2 waves of half K
    assert rules.split_for(128, 5120, 2048, 128) == 2  # 40 tiles: 80 items, one wave
    assert rules.split_for(128, 5120, 1024, 128) == 1  # 2 blocks
    assert rules.split_for(256, 4608, 3584, 128) == 1 and rules.split_for(128, 4608, 3584, 128) == 3
    assert pl.kernel_name("bf16", "group", 64, 3) == "bquant_bf16xi4p_rcr_prefill__gluon_w128t64k512_sk3_ws2x64_sm90"
    with pytest.raises(ValueError, match="no TMA store"):
        pl.constexprs("bf16", "group", 128, False, True, 64, 2)


def test_prefill_path_on_a_gpu(monkeypatch):
    """unserved() for a CUDA device of an H200's / an L40S's facts, compiled (not interpreted),
    with TILEQ_GLUON unset or 0; on the interpreter never."""
    from tileq import settings
    from tileq.device import ARCHS, DeviceFacts

    monkeypatch.delenv("TILEQ_GLUON", raising=False)
    cuda = torch.device("cuda", 0)
    compiled = replace(settings.current(), interpreted=False)
    args = (512, 5120, "bf16", "none", "group", torch.bfloat16)
    assert rules.unserved(*args, facts=SM90, device=cuda, switches=compiled) is None
    assert rules.unserved(*args, facts=SM90, device=cuda, switches=replace(compiled, interpreted=True)) == \
        "a compiled kernel on a GPU"
    monkeypatch.setenv("TILEQ_GLUON", "0")
    off = replace(settings.current(), interpreted=False)
    assert "TILEQ_GLUON=0" in rules.unserved(*args, facts=SM90, device=cuda, switches=off)
    l40s = DeviceFacts(ARCHS["sm_89"], 142, ARCHS["sm_89"].smem_bytes, "L40S")
    assert rules.unserved(*args, facts=l40s, device=cuda, switches=compiled) == \
        "Gluon kernels are sm_90 only, this is sm_89"


def _sm90_build(compile_line: str, name: str) -> dict:
    """Compile a kernel for sm_90 in a fresh process without the interpreter (``compile_line``
    binds ``k`` to Triton's compiled kernel): its SASS (nvdisasm), resource usage (cuobjdump),
    shared memory, PTX and TTGIR."""
    import json
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root / "src")
    code = ("import json, pathlib, subprocess, torch, triton\n"
            f"{compile_line}\n"
            f"p = pathlib.Path('/tmp/tileq-{name}-{os.getpid()}.cubin'); p.write_bytes(k.asm['cubin'])\n"
            "b = pathlib.Path(triton.__file__).parent / 'backends' / 'nvidia' / 'bin'\n"
            "sass = subprocess.run([str(b / 'nvdisasm'), '-c', str(p)], capture_output=True, text=True).stdout\n"
            "use = subprocess.run([str(b / 'cuobjdump'), '-res-usage', str(p)], capture_output=True, text=True).stdout\n"
            "print(json.dumps(dict(sass=sass, usage=use, shared=k.metadata.shared, ptx=k.asm['ptx'], "
            "ttgir=k.asm['ttgir'])))\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _prefill_build(ct, w_kind, bias, tma_store, tokens=128, split=1, x_scale="none", streamk=False, overlap=None):
    """The prefill kernel's sm_90 build; ``overlap`` None: as the plan has it (``rules.overlap_for``)."""
    if overlap is None:
        overlap = rules.overlap_for(ct, tokens)
    r = _sm90_build("from tileq.kernels.int4p.prefill_launch import compile_sm90\n"
                    f"k = compile_sm90({ct!r}, {w_kind!r}, 128, {bias}, {tma_store}, {tokens}, {split}, {x_scale!r}, "
                    f"streamk={streamk}, overlap={overlap})", "i4p-prefill")
    sass = r["sass"]
    r["ops"] = {o: len(re.findall(r"\b" + o + r"\b", sass)) for o in
                ("HGMMA", "QGMMA", "F2FP", "LDS", "STS", "LDL", "STL", "HMUL2", "HADD2", "PRMT", "SHFL", "UTMALDG",
                 "UTMASTG", "ATOMG", "RED")}
    r["ops"]["DEPBAR"] = sass.count("WARPGROUP.DEPBAR")
    return r


@pytest.mark.parametrize("ct,w_kind,bias,tma_store,tokens,split,x_scale,streamk", [
    ("bf16", "group", True, True, 128, 1, "none", False), ("fp16", "vector", False, True, 128, 1, "none", False),
    ("bf16", "group", False, False, 128, 1, "none", False),
    ("bf16", "group", True, True, 64, 1, "none", False), ("fp16", "vector", False, False, 64, 1, "none", False),
    ("bf16", "group", True, False, 64, 3, "none", False),  # fp32 partials
    ("fp16", "scalar", False, False, 128, 2, "none", False),
    ("bf16", "group", True, True, 128, 1, "vector", False),  # W4A8
    ("bf16", "vector", False, False, 64, 2, "scalar", False),
    ("bf16", "group", True, False, 256, 1, "none", False), ("fp16", "vector", False, False, 256, 1, "none", False),
    ("bf16", "group", True, True, 128, 1, "none", True), ("bf16", "vector", False, False, 256, 1, "none", True),
    ("bf16", "group", False, False, 256, 1, "none", True), ("bf16", "group", False, True, 64, 1, "none", True)])
def test_sm90_prefill_build(ct, w_kind, bias, tma_store, tokens, split, x_scale, streamk):
    """The Gluon prefill kernel compiled for sm_90 on the CPU (128-, 64- and 256-token tiles,
    split over K or stream-K, W4A8's token scales in the epilogue): per
    consumer and 512 of K, 32 m64n{BT}k16 wgmmas with the converted weights as register operands (the words reach them
    with no layout conversion: the only shared loads are the words' 16 and the only shared
    stores the epilogue's), 128 packed subtractions (and 128 packed scale multiplies for group
    scales), no spills and no serialized wgmmas (ptxas waits only where the code does)."""
    r = _prefill_build(ct, w_kind, bias, tma_store, tokens, split, x_scale, streamk)
    ops = r["ops"]
    assert ops["HGMMA"] == 2 * 32, ops
    # The only layout conversions are renamings asserted trivial when the kernel is traced: the
    # joined word halves to the words' layout, the converted values to the identical
    # dot-operand layout (the SASS counts below show that nothing moves).
    conversions = [ln for ln in r["ttgir"].splitlines() if "ttg.convert_layout" in ln]
    ty = {"bf16": "bf16", "fp16": "f16"}[ct]
    assert conversions and all(re.search(r"64x64xi32, #linear\d*> -> tensor<64x64xi32, #linear\d*>", ln)
                               or re.search(rf"64x64x{ty}, #linear\d*> -> tensor<64x64x{ty}, #ttg.dot_op", ln)
                               for ln in conversions), conversions[:3]
    assert ops["LDS"] <= 2 * 16 + 1 and ops["STS"] <= 4, ops
    assert ops["HADD2"] == 2 * 128 and ops["HMUL2"] == (2 * 128 if w_kind == "group" else 0), ops
    # (the masked-store epilogue extracts 16-bit halves for its scattered stores: PRMTs there)
    assert (ops["PRMT"] == 0 or not tma_store) and ops["SHFL"] == 0 and ops["LDL"] == 0 and ops["STL"] == 0, ops
    assert ops["DEPBAR"] <= 16, ops  # one wait per 128-wide slice and consumer, not per wgmma
    assert ops["UTMALDG"] >= 2 and ops["UTMASTG"] == (2 if tma_store else 0), ops
    assert "STACK:0" in r["usage"] and "LOCAL:0" in r["usage"]
    assert r["shared"] <= 232448


@pytest.mark.parametrize("w_kind,tma_store,tokens,split,streamk", [
    ("group", True, 64, 1, False), ("group", False, 64, 3, False), ("vector", True, 128, 1, False),
    ("group", False, 128, 1, True)])
def test_sm90_prefill_build_overlaps_conversion_and_wgmma(w_kind, tma_store, tokens, split, streamk):
    """overlap (16-bit build, the default): per consumer and 512 of K, slices 0-2 wait with two wgmma groups
    left in flight (the next slice converts meanwhile, into a second set of A registers) and
    slice 3 waits for all; no wgmma serialized by ptxas, no spills; 256-token tiles and the fp8
    build refuse it (the former spilled)."""

    assert rules.overlap_for("bf16", tokens) and not rules.overlap_for("bf16", 256)  # (the default)
    assert not rules.overlap_for("fp8", 64)
    r = _prefill_build("bf16", w_kind, False, tma_store, tokens, split, "none", streamk)
    sass = r["sass"]
    assert r["ops"]["HGMMA"] == 2 * 32 and r["ops"]["LDL"] == 0 and r["ops"]["STL"] == 0, r["ops"]
    waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x\d)", sass)
    assert waits.count("0x2") == 2 * 3 and waits.count("0x0") == 2 * 1, waits
    assert "STACK:0" in r["usage"] and "LOCAL:0" in r["usage"]
    plain = _prefill_build("bf16", w_kind, False, tma_store, tokens, split, "none", streamk, overlap=False)
    assert re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x\d)", plain["sass"]) == ["0x0"] * 8  # (without: every slice)
    for ct, tokens_ in (("bf16", 256), ("fp8", 64)):
        with pytest.raises(ValueError, match="overlap"):
            pl.constexprs(ct, "group", 128, False, False, tokens_, 1, "vector" if ct == "fp8" else "none",
                               overlap=True)


@pytest.mark.parametrize("bias,tma_store,tokens,split,x_scale,streamk", [
    (False, True, 128, 1, "vector", False), (True, False, 128, 1, "vector", False),
    (False, False, 128, 3, "vector", False), (True, True, 64, 1, "scalar", False),
    (False, True, 128, 1, "vector", True)])
def test_sm90_fused_w4a8_build(bias, tma_store, tokens, split, x_scale, streamk):
    """The fused W4A8 build (W4A8 below 256 tokens with group scales) compiled for sm_90 on
    the CPU: per consumer and 512 of K, 16 fp8 wgmmas m64n{BT}k32 with the e4m3 weights as
    register operands (the conversions to the dot-operand layout are renamings), 128 packed
    subtractions and 128 cvt to e4m3x2 per consumer and block, one wait per 128-wide slice, no
    spills; per-channel scales are refused (their build spilled)."""
    r = _prefill_build("fp8", "group", bias, tma_store, tokens, split, x_scale, streamk)
    ops = r["ops"]
    assert ops["QGMMA"] == 2 * 16 and ops["HGMMA"] == 0, ops
    conversions = [ln for ln in r["ttgir"].splitlines() if "ttg.convert_layout" in ln]
    assert conversions and all(re.search(r"64x64xi32, #linear\d*> -> tensor<64x64xi32, #linear\d*>", ln)
                               or re.search(r"64x64xf8E4M3FN, #linear\d*> -> tensor<64x64xf8E4M3FN, #ttg.dot_op", ln)
                               for ln in conversions), conversions[:3]
    assert ops["HADD2"] == 2 * 128 and ops["F2FP"] >= 2 * 128, ops
    assert ops["SHFL"] == 0, ops
    assert ops["UTMASTG"] == (2 if tma_store else 0), ops
    assert r["shared"] <= 232448

    with pytest.raises(ValueError, match="group scales"):
        pl.constexprs("fp8", "vector", 128, False, True, 128, 1, "vector")
    # one wait per slice and consumer (the wgmmas are not serialized), no spills; checked last: on
    # an untested Triton a miss is a skip
    _assert_lean(r, max_waits=16)


def _assert_lean(build, max_waits):
    """A Gluon build without spills and with at most ``max_waits`` wgmma waits. On a Triton the
    Gluon kernels were not tested with (tileq runs none there: dispatch.gluon) a miss is reported
    as a skip naming the version."""
    from tileq.device import triton_version
    from tileq.dispatch.gluon import GLUON_TRITON_VERSIONS

    ops, usage = build["ops"], build["usage"]
    misses = []
    if ops["LDL"] or ops["STL"] or "STACK:0" not in usage or "LOCAL:0" not in usage:
        misses.append(f"spills ({ops['LDL']} LDL, {ops['STL']} STL)")
    if ops["DEPBAR"] > max_waits:
        misses.append(f"{ops['DEPBAR']} wgmma waits (serialized: at most {max_waits} expected)")
    if misses and triton_version() not in GLUON_TRITON_VERSIONS:
        pytest.skip(f"on Triton {triton_version()}, on which tileq runs no Gluon kernel (tested with Triton "
                    f"{', '.join(GLUON_TRITON_VERSIONS)} only): {'; '.join(misses)}")
    assert not misses, (misses, ops)


def test_w4a8_fused_build_routing():
    """W4A8 with group scales and e4m3 activations takes the Gluon kernel's fp8 build below
    INT4_W4A8_MAX_M where the plan gives it the call (fused_for), and a little above on wide or
    deep weights; per-channel scales keep their paths."""
    f8 = torch.float8_e4m3fn
    assert rules.fused_for(255, "fp8", "group", 5120, 5120)
    assert not rules.fused_for(256, "fp8", "group", 5120, 5120)
    assert not rules.fused_for(100, "bf8", "group", 5120, 5120)
    assert not rules.fused_for(100, "fp8", "vector", 5120, 5120)
    # up to FUSED_WIDE_N_MAX_M (288) on weights with N >= 16384, FUSED_WIDE_MAX_M (256) with K >= 8192
    assert rules.fused_for(256, "fp8", "group", 16384, 4096)
    assert rules.fused_for(256, "fp8", "group", 5120, 8192)
    assert not rules.fused_for(256, "fp8", "group", 16383, 8191)
    assert rules.fused_for(288, "fp8", "group", 16384, 4096)
    assert not rules.fused_for(289, "fp8", "group", 28672, 8192)
    assert not rules.fused_for(257, "fp8", "group", 8192, 28672)
    assert not rules.fused_for(256, "fp8", "vector", 28672, 8192)
    text = describe_prepacked(256, 5120, 17408, f8)
    assert text.startswith("bquant_fp8xi4p_rcr_prefill__gluon_w128t128k512_sk3_ws2x64_sm90"), text
    rule = "on weights with N >= 16384 up to 288 tokens, with K >= 8192 up to 256"
    assert f"from 256 tokens only {rule}" in text, text
    assert describe_prepacked(280, 28672, 4096, f8).startswith("bquant_fp8xi4p_rcr_prefill__gluon_w128t128k512_")
    assert describe_prepacked(280, 5120, 17408, f8).startswith("dequant-fp8+tileq")
    assert describe_prepacked(300, 28672, 4096, f8).startswith("dequant-fp8+tileq")
    assert describe_prepacked(256, 5120, 5120, f8).startswith("dequant-fp8+tileq")
    assert describe_prepacked(200, 5120, 5120, f8).startswith("bquant_fp8xi4p_rcr_prefill__gluon_")
    assert describe_prepacked(1024, 5120, 5120, f8).startswith("dequant-fp8+tileq")
    assert describe_prepacked(48, 5120, 17408, f8).startswith("bquant_fp8xi4p_rcr_prefill__gluon_w128t64k512_sk3")
    chan = describe_prepacked(1024, 5120, 5120, f8, w_scale="vector")
    assert chan.startswith("dequant-fp8+tileq") and "W4A8 from 256 tokens" in chan
    assert describe_prepacked(1024, 5120, 5120).startswith("dequant+cublas")  # (W4A16, group scales)


@pytest.mark.parametrize("dtype,w_kind", [("bfloat16", "group"), ("float16", "vector"), ("float8_e4m3fn", "none"),
                                          ("float8_e5m2", "none")])
def test_sm90_build_of_the_dequantize_kernel(dtype, w_kind):
    """The dequantize kernel compiled for sm_90 on the CPU (no interpreter), as launched for
    aligned N and K: each thread loads its row's words 16 bytes at a time and stores 16 bytes
    at a time, nothing goes through shared or local memory, and the conversion is what
    dequant.py describes: per value one LOP3 and one FADD (and the scale's FMUL), one conversion
    per pair to 16 bits; for fp8 one LOP3, one packed subtraction and one conversion per pair."""
    import collections

    r = _sm90_build(f"from tileq.kernels.int4p.dequant import compile_sm90\nk = compile_sm90(torch.{dtype}, {w_kind!r})",
                    f"dequant-{dtype}-{w_kind}")
    full = collections.Counter()  # opcode with its modifiers -> count
    for ln in r["sass"].splitlines():
        if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln):
            body = re.sub(r"^@!?U?P\w+\s+", "", ln.split("*/", 1)[1].strip())
            full[body.split()[0].rstrip(";")] += 1
    ops = collections.Counter()
    for op, count in full.items():
        ops[op.split(".")[0]] += count
    values = {"bfloat16": 64, "float16": 64}.get(dtype, 128)  # per thread: ROWS x 512 / 256 threads
    words = values // 8
    # The words: 16-byte loads only (the scales' loads are scalar); 16-byte stores only.
    assert full.get("LDG.E.128") == words // 4 and r["ptx"].count("ld.global.v4") == words // 4, full
    assert ops["LDG"] - full["LDG.E.128"] == {"group": 4, "vector": 1, "none": 0}[w_kind], full
    assert full.get("STG.E.128") == 8 and ops["STG"] == 8, full
    assert not any(ops[o] for o in ("LDS", "STS", "LDSM", "STSM", "BAR", "LDL", "STL")), ops
    assert r["shared"] == 0 and "STACK:0" in r["usage"] and "LOCAL:0" in r["usage"], r["usage"]
    if w_kind == "none":
        assert ops["HADD2"] == values // 2 and ops["F2FP"] == values // 2 and ops["LOP3"] <= values // 2 + 8, ops
    else:
        assert ops["FADD"] == values and ops["FMUL"] == values and ops["F2FP"] == values // 2, ops
        assert ops["LOP3"] <= values + 16 and ops["I2F"] + ops["I2FP"] == 0, ops
    total = sum(c for o, c in ops.items() if o != "NOP")
    assert total <= (2.5 if w_kind == "none" else 6.5) * values, (total, ops)


GPU = pytest.mark.skipif(DEV != "cuda" or not torch.cuda.is_available()
                         or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90 GPU")


def _w4a16_problem(m, n, k, seed, device="cuda"):
    """int4 values [N, K], their prepacked weight, group-128 scales and bf16 activations."""
    torch.manual_seed(seed)
    v = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    w = prepack_int4(v).to(device)
    ws = (torch.rand(-(-k // 128), n) * 0.02 + 0.01).to(device)
    x = torch.randn(m, k, device=device).to(torch.bfloat16)
    return v, w, ws, x


@pytest.fixture
def prefill_launches(monkeypatch):
    """Counts the Gluon prefill kernel's launches."""
    real = pl._gl()["kernel"]
    calls = []

    class Counting:
        def __getitem__(self, grid):
            calls.append(grid)
            return real[grid]

    monkeypatch.setitem(pl._gl(), "kernel", Counting())
    api_prepacked._LAUNCHES.clear()
    yield calls
    api_prepacked._LAUNCHES.clear()


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(256, 64, 512), (300, 577, 1104), (1000, 4000, 4096), (1021, 384, 2560)])
@pytest.mark.parametrize("xt,gk", [(torch.bfloat16, 128), (torch.float16, 256), (torch.bfloat16, 0),
                                   (torch.bfloat16, -1)])
def test_gpu_prefill_kernel_matches_reference(m, n, k, xt, gk, prefill_launches):
    """Odd M (token tiles past M), N (weight rows past N; N = 577 takes the masked stores), K tails
    inside a 512 block (zero words, TMA-zeroed activations); group scales of 128 and 256,
    per-channel (gk 0) and per-tensor (gk -1) scales; bias."""
    torch.manual_seed(m + n + k)
    v = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    w = prepack_int4(v).to("cuda")
    if gk > 0:
        ws = torch.rand(-(-k // gk), n) * 0.02 + 0.01
    elif gk == 0:
        ws = torch.rand(n) * 0.02 + 0.01
    else:
        ws = torch.tensor(0.013)
    x = torch.randn(m, k).to(xt)
    bias = torch.randn(n)
    y = linear_prepacked(x.cuda(), w, None, ws.cuda(), bias=bias.cuda(), group_k=max(gk, 128))
    torch.cuda.synchronize()
    assert len(prefill_launches) == 1
    want = _reference(x, v, ws, None, bias, max(gk, 128))
    assert y.dtype == xt and y.shape == (m, n)
    # Group scales are applied to the 16-bit values (one rounding each, as the dequantize path);
    # per-channel and per-tensor scales in fp32 after the product.
    err = float((y.cpu().double() - want).abs().max() / want.abs().max())
    assert err < (1e-2 if gk > 0 else 5e-3), err


def _forced_prefill(m, n, k, gk, seed, tokens, split=1, streamk=False, x_dtype=torch.bfloat16, overlap=None):
    """A GluonPrefillLaunch forced to a token tile (and split) for CPU-made operands: int4 values,
    their prepacked weight on the GPU, group (gk > 0), per-channel (0) or per-tensor (-1) scales,
    bf16 activations and a bias (dequantize + cuBLAS as the fallback); ``overlap`` None: as the
    plan has it."""
    from tileq.device import facts
    from tileq.kernels.int4p.dequant import DequantLaunch

    torch.manual_seed(seed)
    v = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    w = prepack_int4(v).to("cuda")
    if gk > 0:
        ws = torch.rand(-(-k // gk), n) * 0.02 + 0.01
        kind, strides = "group", (ws.stride(0), ws.stride(1))
    elif gk == 0:
        ws = torch.rand(n) * 0.02 + 0.01
        kind, strides = "vector", (0, 1)
    else:
        ws = torch.tensor(0.013)
        kind, strides = "scalar", (0, 0)
    x = torch.randn(m, k).to(x_dtype)
    bias = torch.randn(n)
    fallback = DequantLaunch(n, k, kind, "none", strides, max(gk, 128), x_dtype, x_dtype)
    cuda = torch.device("cuda")
    if overlap is None:
        overlap = rules.overlap_for({torch.bfloat16: "bf16", torch.float16: "fp16"}[x_dtype], tokens)
    launch = pl.GluonPrefillLaunch(m, n, k, x_dtype, x_dtype, kind, strides, max(gk, 128), True, cuda, fallback,
                                   tokens=tokens, num_sms=facts(cuda).num_sms, overlap=overlap, split=split,
                                   streamk=streamk)
    return launch, v, w, ws, x, bias


def _check_forced_prefill(launch, v, w, ws, x, bias, gk, prefill_launches):
    """One launch of a forced prefill kernel against the reference (group scales 1e-2, others
    5e-3); its output."""
    y = launch(x.cuda(), w.data, None, ws.cuda(), bias.cuda())
    torch.cuda.synchronize()
    assert len(prefill_launches) == 1
    want = _reference(x, v, ws, None, bias, max(gk, 128))
    err = float((y.cpu().double() - want).abs().max() / want.abs().max())
    assert err < (1e-2 if gk > 0 else 5e-3), err
    return y


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(17, 577, 1104), (64, 4000, 4096), (100, 384, 2560), (33, 1024, 512)])
@pytest.mark.parametrize("gk", [128, 0, -1])
@pytest.mark.parametrize("tokens", [64, 128, 256])
def test_gpu_prefill_token_tiles_at_small_m(m, n, k, gk, tokens, prefill_launches):
    """Both token tiles of the Gluon prefill kernel at M below its default range (64: M = 100 in
    two tiles, the second mostly past M; 128: one tile mostly past M), odd N (577: masked stores),
    K tails; group, per-channel and per-tensor scales; bias."""
    launch, v, w, ws, x, bias = _forced_prefill(m, n, k, gk, m + n + k + tokens, tokens)
    assert launch.name.endswith(f"__gluon_w128t{tokens}k512_ws2x64_sm90")
    _check_forced_prefill(launch, v, w, ws, x, bias, gk, prefill_launches)


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(300, 577, 1104), (1000, 4000, 4096), (2049, 1024, 5120)])
@pytest.mark.parametrize("gk", [128, 0])
def test_gpu_prefill_256_token_tiles(m, n, k, gk, prefill_launches):
    """256-token tiles (masked stores) at prefill sizes: odd M and N, K tails; group and
    per-channel scales; bias."""
    launch, v, w, ws, x, bias = _forced_prefill(m, n, k, gk, m + n + k, 256)
    assert launch.name.endswith("__gluon_w128t256k512_ws2x64_sm90") and True not in launch.calls
    _check_forced_prefill(launch, v, w, ws, x, bias, gk, prefill_launches)


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,split", [(100, 577, 1104, 3), (100, 577, 1104, 4), (256, 1024, 4096, 2),
                                         (33, 384, 2560, 5)])
@pytest.mark.parametrize("gk", [128, 0, -1])
def test_gpu_prefill_split_k(m, n, k, split, gk, prefill_launches):
    """The prefill kernel split over K: fp32 partials per K range (the bias from the first), summed
    in order; K = 1104 in four ranges leaves the last one empty (its zeros written); odd N, K
    tails; group, per-channel and per-tensor scales."""
    launch, v, w, ws, x, bias = _forced_prefill(m, n, k, gk, m + n + k + split, 64, split)
    y = _check_forced_prefill(launch, v, w, ws, x, bias, gk, prefill_launches)
    assert torch.equal(launch(x.cuda(), w.data, None, ws.cuda(), bias.cuda()), y)  # the same sums, in order


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,tokens,split,streamk", [(40, 577, 1104, 64, 1, False), (100, 5120, 5120, 64, 3, False),
                                                        (200, 4001, 2560, 128, 1, False),
                                                        (300, 5120, 5120, 128, 1, True), (1030, 1024, 512, 128, 1, False)])
@pytest.mark.parametrize("gk", [128, 0, -1])
def test_gpu_prefill_overlap(m, n, k, tokens, split, streamk, gk, prefill_launches):
    """overlap: each consumer converts its next slice while this slice's wgmmas run: the same
    chain of wgmmas in the same order, so bit for bit the result without it (and the reference's);
    64- and 128-token tiles, split over K, stream-K, K tails, odd N, all scale kinds, bias."""
    launch, v, w, ws, x, bias = _forced_prefill(m, n, k, gk, m + n + k, tokens, split, streamk, overlap=True)
    assert launch.overlap
    y = _check_forced_prefill(launch, v, w, ws, x, bias, gk, prefill_launches)
    plain = _forced_prefill(m, n, k, gk, m + n + k, tokens, split, streamk, overlap=False)[0]
    assert not plain.overlap
    assert torch.equal(plain(x.cuda(), w.data, None, ws.cuda(), bias.cuda()), y)


def _replays_bit_for_bit(call, out, want):
    """``call()`` (writing ``out``) run once, captured in a CUDA graph and replayed three times
    into a zeroed ``out``: each replay gives ``want`` bit for bit, and the kernels summing their
    partials themselves leave every tile counter at zero."""
    from tileq.kernels import buffers as kbuf

    call()  # (compiled before the capture)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    for _ in range(3):
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
    assert not any(int(c.count_nonzero()) for c in kbuf._COUNTERS.values())


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 36864, 7168), (12, 35840, 5120), (24, 37888, 3584), (3, 4001, 2000)])
def test_gpu_streamk_decode_as_routed_and_in_a_cuda_graph(m, n, k):
    """The decode rule's stream-K (wave-tail weights at M = 1, 12 and 24; an odd small weight
    forced) on the GPU's own SM count: against the float64 reference, the same bits call after
    call and replayed in a CUDA graph (its partials and counters in the stream's buffers), the
    counters back to zero."""
    v, w, x, ws, _ = _decode_problem(m, n, k, torch.bfloat16, 128, m + n)
    cfg = rules.config_for(m, n, k)[0] if n > 30000 else Int4pConfig(16, 1, 3, 4, 168, True, streamk=True)
    assert cfg.streamk, cfg
    xc, wsc = x.cuda(), ws.cuda()
    y = linear_prepacked(xc, w, None, wsc, config=cfg, out_dtype=torch.float32)
    want = _reference(x, v, ws, None, None, 128)
    assert float((y.cpu().double() - want).abs().max() / want.abs().max()) < 2e-6
    assert torch.equal(linear_prepacked(xc, w, None, wsc, config=cfg, out_dtype=torch.float32), y)
    out = torch.empty_like(y)
    _replays_bit_for_bit(lambda: linear_prepacked(xc, w, None, wsc, config=cfg, out_dtype=torch.float32, out=out),
                         out, y)


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,tokens", [(256, 5120, 5120, 128), (300, 577, 1104, 128), (512, 4001, 7168, 256),
                                          (100, 3000, 9000, 64), (1030, 5120, 5120, 128), (700, 1024, 512, 128),
                                          (2100, 3000, 1536, 256), (4096, 5120, 1024, 128)])
@pytest.mark.parametrize("gk,xt", [(128, torch.bfloat16), (0, torch.bfloat16), (-1, torch.float16)])
def test_gpu_prefill_stream_k(m, n, k, tokens, gk, xt, prefill_launches):
    """Stream-K: data-parallel tiles for all full waves but the last (M = 1030 and 4096), the rest
    shared out by K blocks, every program the same number; tiles shared by programs summed from
    their fp32 slabs by the fix-up, the others stored by the kernel (TMA or masked stores). Shapes
    where a program covers less than one tile (K = 9000 in 18 blocks), several tiles (K = 512: one
    block per tile), odd M and N, K tails; group, per-channel and per-tensor scales; bias in the
    first K block's partial. Run twice: the same bits."""
    launch, v, w, ws, x, bias = _forced_prefill(m, n, k, gk, m + n + k + tokens, tokens, streamk=True, x_dtype=xt)
    assert launch.name.endswith(f"__gluon_w128t{tokens}k512_stk_ws2x64_sm90"), launch.name
    y = _check_forced_prefill(launch, v, w, ws, x, bias, gk, prefill_launches)
    assert torch.equal(launch(x.cuda(), w.data, None, ws.cuda(), bias.cuda()), y)


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("w_scale", ["group", "vector"])
@pytest.mark.parametrize("m,n,k,tile", [(200, 11008, 4096, "t128"), (200, 7168, 18432, "t256")])
def test_gpu_stream_k_is_routed(w_scale, m, n, k, tile, prefill_launches):
    """linear_prepacked takes stream-K where streamk_for picks it (200 tokens x an 11008 x 4096
    weight: 172 tiles, 14 against 16 blocks per SM; x a 7168 x 18432 weight: 256-token tiles, the
    rows past M zero-filled): one launch of the prefill kernel (and the fix-up) matching the
    reference."""
    assert f"_w128{tile}k512_stk_" in describe_prepacked(m, n, k, w_scale=w_scale, device=torch.device("cuda"))
    torch.manual_seed(7)
    v = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    w = prepack_int4(v).to("cuda")
    ws = torch.rand(k // 128, n) * 0.02 + 0.01 if w_scale == "group" else torch.rand(n) * 0.02 + 0.01
    x = torch.randn(m, k).to(torch.bfloat16)
    y = linear_prepacked(x.cuda(), w, None, ws.cuda())
    assert len(prefill_launches) == 1
    want = _reference(x, v, ws, None, None, 128)
    assert float((y.cpu().double() - want).abs().max() / want.abs().max()) < 1e-2


@GPU
@pytest.mark.gpu
def test_gpu_small_m_takes_the_prefill_kernel(prefill_launches):
    """48 tokens on 11008 weight rows (86 tiles of 64 tokens): linear_prepacked runs the Gluon
    kernel's 64-token tile, and matches the reference."""
    m, n, k = 48, 11008, 1536
    v, w, ws, x = _w4a16_problem(m, n, k, seed=11)
    y = linear_prepacked(x, w, None, ws)
    torch.cuda.synchronize()
    assert len(prefill_launches) == 1
    want = _reference(x.cpu(), v, ws.cpu(), None, None, 128)
    assert float((y.cpu().double() - want).abs().max() / want.abs().max()) < 1e-2


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("m", [40, 100, 300])
def test_gpu_narrow_weights_take_the_split(m, prefill_launches):
    """1000 weight rows (8 tiles): linear_prepacked runs the Gluon kernel split over K (plan), with
    a bias, and matches the reference; a second call gives the same bits."""

    n, k = 1000, 3584 if m <= 128 else 9216
    tokens, split = rules.prefill_tiling(m, n, k, sm90_with(torch.cuda.get_device_properties(0).multi_processor_count))
    assert split > 1
    assert f"_sk{split}_" in describe_prepacked(m, n, k, device=torch.device("cuda"))
    v, w, ws, x = _w4a16_problem(m, n, k, seed=m)
    bias = torch.randn(n, device="cuda")
    y = linear_prepacked(x, w, None, ws, bias=bias)
    torch.cuda.synchronize()
    assert len(prefill_launches) == 1
    want = _reference(x.cpu(), v, ws.cpu(), None, bias.cpu(), 128)
    assert float((y.cpu().double() - want).abs().max() / want.abs().max()) < 1e-2
    assert torch.equal(linear_prepacked(x, w, None, ws, bias=bias), y)


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,xt,x_kind,w_kind", [
    (40, 1000, 3584, torch.float8_e4m3fn, "vector", "group"),  # split over K, 64-token tiles
    (100, 1000, 3584, torch.float8_e5m2, "vector", "vector"),  # split, 128-token tiles
    (250, 4000, 1104, torch.float8_e4m3fn, "vector", "group"),  # unsplit, a K tail
    (200, 4001, 2560, torch.float8_e4m3fn, "scalar", "scalar"),  # per-tensor scales, masked stores
    (48, 34816, 1024, torch.float8_e4m3fn, "vector", "group")])  # the unsplit 64-token tiling (prefers)
def test_gpu_w4a8_takes_the_prefill_kernel(m, n, k, xt, x_kind, w_kind, prefill_launches):
    """W4A8 from 33 tokens to W4A8_MAX_M - 1: linear_prepacked runs the Gluon kernel, its fp8 build
    for e4m3 with group scales (rules.fused_for), else on the activations cast to bf16, the
    token scales and a bias in its epilogue (one launch of it, describe says which), and matches
    the reference; a second call gives the same bits."""

    assert T.INT4_PREFILL_MIN_M <= m < T.INT4_W4A8_MAX_M
    text = describe_prepacked(m, n, k, xt, w_scale=w_kind, device=torch.device("cuda"))
    fused = xt == torch.float8_e4m3fn and w_kind == "group"
    assert ("its fp8 build" if fused else "activations cast to bf16 first") in text, text
    torch.manual_seed(m + n)
    v = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    w = prepack_int4(v).to("cuda")
    sw = _w4a8_scales(w_kind, n, k, 128)
    x = (torch.randn(m, k) * 50).clamp(-400, 400).to(xt)
    sx = torch.rand(m) + 0.5 if x_kind == "vector" else torch.tensor(0.75)
    bias = torch.randn(n)
    y = linear_prepacked(x.cuda(), w, sx.cuda(), sw.cuda(), bias=bias.cuda())
    torch.cuda.synchronize()
    assert len(prefill_launches) == 1
    want = _reference(x, v, sw, sx, bias, 128)
    assert float((y.cpu().double() - want).abs().max() / want.abs().max()) < 1e-2
    assert torch.equal(linear_prepacked(x.cuda(), w, sx.cuda(), sw.cuda(), bias=bias.cuda()), y)


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("w_kind", ["group", "vector"])
def test_gpu_w4a8_fp8_prefill(w_kind):
    """W4A8 on the GPU from W4A8_MAX_M tokens:
    linear_prepacked writes the values as fp8 and runs tileq's fp8 GEMM (bquant with one-column
    groups, or rowcol), bias, odd N; matches the reference."""

    assert "dequant-fp8+tileq" in describe_prepacked(T.INT4_W4A8_MAX_M, 1000, 3584, torch.float8_e4m3fn,
                                                     w_scale=w_kind, device=torch.device("cuda"))
    torch.manual_seed(13)
    m, n, k = T.INT4_W4A8_MAX_M + 1, 1000, 3584  # (below, the Gluon kernel takes W4A8)
    v = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    w = prepack_int4(v).to("cuda")
    sw = _w4a8_scales(w_kind, n, k, 128)
    x = (torch.randn(m, k) * 50).clamp(-400, 400).to(torch.float8_e4m3fn)
    sx = torch.rand(m) + 0.5
    bias = torch.randn(n)
    y = linear_prepacked(x.cuda(), w, sx.cuda(), sw.cuda(), bias=bias.cuda())
    want = _reference(x, v, sw, sx, bias, 128)
    assert float((y.cpu().double() - want).abs().max() / want.abs().max()) < 1e-2


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("cast_min_bytes", [None, 0])
def test_gpu_w4a8_decode_both_fp8_types_and_the_cast(cast_min_bytes, monkeypatch):
    """W4A8 decode on the GPU with e4m3 then e5m2 activations of one shape (one config): each
    matches its reference (the launch's pointer dtypes keep the two compiled kernels apart), on
    the kernel's own fp8 conversion or, with the cast threshold at 0, cast to bf16 first."""
    if cast_min_bytes is not None:
        monkeypatch.setattr(T, "INT4_W4A8_CAST_MIN_BYTES", cast_min_bytes)
    monkeypatch.setattr(api_prepacked, "_LAUNCHES", {})  # (a launch is kept per call signature)
    torch.manual_seed(17)
    n, k = 1000, 3584
    v = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    w = prepack_int4(v).to("cuda")
    sw = _w4a8_scales("group", n, k, 128)
    for m in (1, 16):
        for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            x = (torch.randn(m, k) * 50).clamp(-400, 400).to(dtype)
            sx = torch.rand(m) + 0.5
            path = describe_prepacked(m, n, k, dtype, device=torch.device("cuda"))
            assert ("cast to bf16" in path) == (cast_min_bytes == 0), path
            y = linear_prepacked(x.cuda(), w, sx.cuda(), sw.cuda())
            want = _reference(x, v, sw, sx, None, 128)
            assert float((y.cpu().double() - want).abs().max() / want.abs().max()) < 1e-2, (m, dtype)


def _replay_in_graph(call, x, out):
    """``call()`` captured in a CUDA graph, then replayed on fresh activations in ``x`` with
    ``out`` filled with NaN first."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    x.copy_(torch.randn(x.shape, device="cuda").to(x.dtype))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()


@GPU
@pytest.mark.gpu
def test_gpu_prefill_out_graphs_and_fallback(prefill_launches):
    """out= (TMA stores into it), CUDA-graph capture and replay on fresh inputs, and an unaligned
    activation pointer handed to dequantize + cuBLAS."""
    m, n, k = 512, 1024, 2048
    v, w, ws, x = _w4a16_problem(m, n, k, seed=5)
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    y = linear_prepacked(x, w, None, ws, out=out)
    assert y.data_ptr() == out.data_ptr() and len(prefill_launches) == 1
    check = lambda xx: float((out.double() - _reference(xx.cpu(), v, ws.cpu(), None, None, 128).cuda()).abs().max())  # noqa: E731
    assert check(x) < 1e-2 * float(out.double().abs().max())
    _replay_in_graph(lambda: linear_prepacked(x, w, None, ws, out=out), x, out)
    assert check(x) < 1e-2 * float(out.double().abs().max())
    buf = torch.empty(m * k + 8, dtype=torch.bfloat16, device="cuda")
    xu = buf[1:1 + m * k].view(m, k)
    xu.copy_(x)
    before = len(prefill_launches)
    yu = linear_prepacked(xu, w, None, ws)
    assert len(prefill_launches) == before  # the dequantize path ran
    assert float((yu.double() - out.double()).abs().max()) < 1e-2 * float(out.double().abs().max())


@GPU
@pytest.mark.gpu
def test_gpu_stream_k_in_a_cuda_graph(prefill_launches):
    """Stream-K (routed: 200 tokens x 11008 x 4096) into out=, captured in a CUDA graph and
    replayed on fresh activations: the workspace and the fix-up launch are captured too; the
    replay equals a direct call bit for bit."""
    m, n, k = 200, 11008, 4096
    assert "_stk_" in describe_prepacked(m, n, k, device=torch.device("cuda"))
    v, w, ws, x = _w4a16_problem(m, n, k, seed=9)
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    linear_prepacked(x, w, None, ws, out=out)
    _replay_in_graph(lambda: linear_prepacked(x, w, None, ws, out=out), x, out)
    want = _reference(x.cpu(), v, ws.cpu(), None, None, 128)
    assert float((out.cpu().double() - want).abs().max() / want.abs().max()) < 1e-2
    assert torch.equal(linear_prepacked(x, w, None, ws), out)


@GPU
@pytest.mark.gpu
def test_gpu_prefill_direct_launches(monkeypatch):
    """Later calls skip Triton's JIT launch: the same results, and a kept handle."""
    from tileq.kernels import direct

    monkeypatch.delenv("TILEQ_DIRECT_LAUNCH", raising=False)
    api_prepacked._LAUNCHES.clear()
    m, n, k = 700, 1024, 1536
    v, w, ws, x = _w4a16_problem(m, n, k, seed=9)
    first = linear_prepacked(x, w, None, ws)
    want = _reference(x.cpu(), v, ws.cpu(), None, None, 128)
    assert float((first.cpu().double() - want).abs().max() / want.abs().max()) < 1e-2
    for _ in range(3):
        assert torch.equal(linear_prepacked(x, w, None, ws), first)
    kernel = pl._gl()["kernel"]
    assert any(key[1] is kernel for key in direct._HANDLES)
    api_prepacked._LAUNCHES.clear()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the reduction runs a Triton kernel on CPU tensors")
def test_prefill_launcher_split(monkeypatch):
    """The launcher split over K, against a stand-in kernel on CPU tensors: no TMA store, the
    fp32 [split, M, N] workspace as the kernel's output, then the ordered split-K reduction of
    the portable kernels reading that layout (checked on a filled workspace)."""
    from tileq.testing import KernelRecorder

    rec = KernelRecorder()
    monkeypatch.setitem(pl._gl(), "kernel", rec)
    m, n, k, split = 100, 577, 1104, 3
    torch.manual_seed(4)
    w = prepack_int4(torch.randint(-8, 8, (n, k), dtype=torch.int8))
    ws = torch.rand(-(-k // 128), n) * 0.02 + 0.01
    x = torch.randn(m, k).to(torch.bfloat16)
    launch = pl.GluonPrefillLaunch(m, n, k, torch.bfloat16, torch.bfloat16, "group",
                                   (ws.stride(0), ws.stride(1)), 128, False, torch.device("cpu"), None,
                                   tokens=64, num_sms=132, overlap=True, split=split)
    assert launch.name == "bquant_bf16xi4p_rcr_prefill__gluon_w128t64k512_sk3_ws2x64_sm90"
    launch(x, w.data, None, ws, None)
    (grid, args, kwargs), = rec.calls
    assert args[2] is None and kwargs["TMA_STORE"] is False and kwargs["SPLIT"] == split
    work = args[3]
    assert work.dtype == torch.float32 and work.numel() >= split * m * n
    assert grid == (min(132, 2 * 5 * split),)
    parts = torch.randn(split, m, n)
    work.view(-1)[:split * m * n].copy_(parts.view(-1))
    out = torch.empty(m, n, dtype=torch.bfloat16)
    launch.reduce((work, out), False)
    want = parts[0] + parts[1] + parts[2]
    # (within one bf16 step: the interpreter's cast may round differently from torch's)
    assert torch.all((out.float() - want).abs() <= want.abs() * 2 ** -7 + 1e-6)


@pytest.mark.parametrize("tiles,k,sms", [(80, 5120, 132), (160, 5120, 132), (5, 9000, 132), (300, 512, 132),
                                         (7, 1024, 3), (544, 5120, 132), (264, 3584, 132), (2048, 5120, 132)])
def test_stream_k_schedule_covers_every_unit_once(tiles, k, sms):
    """The stream-K layout (streamk.schedule / segments, the kernel's walk in Python): whole
    tiles for all full waves but the last (data-parallel, program p every sms-th), then every
    (tile, K block) unit of the rest in exactly one program, ``per`` per program (the last
    ones fewer or none); a tile's programs have ranks 0 .. count - 1 in K order, ``slabs`` is the
    largest count and ``shared`` the tiles with more than one."""
    from tileq.kernels.int4p import streamk

    s = streamk.schedule(tiles, k, sms)
    kb = streamk.k_blocks(k)
    assert s.dp % sms == 0 and (s.dp == 0 or tiles - s.dp >= sms or tiles % sms == 0)
    assert s.units == (tiles - s.dp) * kb and s.per == max(-(-s.units // sms), 1)
    seen = {}
    for p in range(sms):
        segs = streamk.segments(p, s)
        assert sum(b - a for _, a, b, _ in segs) - (s.dp // sms) * kb == max(min(s.per, s.units - p * s.per), 0)
        for t, a, b, r in segs:
            assert 0 <= a < b <= kb
            seen.setdefault(t, []).append((a, b, r))
    assert sorted(seen) == list(range(tiles))
    counts = []
    for t, parts in seen.items():
        parts.sort()
        assert [r for _, _, r in parts] == list(range(len(parts)))
        assert parts[0][0] == 0 and parts[-1][1] == kb and all(parts[i][1] == parts[i + 1][0]
                                                               for i in range(len(parts) - 1))
        if t >= s.dp:
            counts.append(len(parts))
        else:
            assert len(parts) == 1
    assert s.slabs == max(counts, default=1) and s.shared == sum(c > 1 for c in counts)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the fix-up kernel on CPU tensors")
@pytest.mark.parametrize("m,n,k,tokens,sms", [(300, 577, 2560, 128, 4), (100, 384, 5120, 64, 7), (64, 200, 9000, 64, 3),
                                              (700, 1000, 1536, 64, 5)])
def test_stream_k_fixup_sums_shared_tiles(m, n, k, tokens, sms):
    """The fix-up kernel (interpreted) on a workspace filled as the kernel fills it: per program
    and tile, the sum of its K blocks' contributions, in C where the program holds the whole tile,
    else in slab ``rank``; C then holds every tile's full sum (the shared ones within a bf16
    step)."""
    from tileq.kernels.int4p import streamk

    tiles = pl.tiles(m, n, tokens)
    s = streamk.schedule(tiles, k, sms)
    kb = streamk.k_blocks(k)
    torch.manual_seed(m + n)
    part = torch.randn(kb, m, n)  # the contribution of each K block
    npm, npn = -(-m // tokens), -(-n // 128)

    def region(t):  # tiles.grouped_tile in plain Python
        group = pl.GROUP_M * npn
        first = (t // group) * pl.GROUP_M
        size = min(npm - first, pl.GROUP_M)
        pm, pn = first + (t % group) % size, (t % group) // size
        return slice(pm * tokens, (pm + 1) * tokens), slice(pn * 128, (pn + 1) * 128)

    work = torch.full((s.slabs, m, n), float("nan"))
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    for p in range(sms):
        for t, a, b, r in streamk.segments(p, s):
            rows, cols = region(t)
            value = part[a:b, rows, cols].sum(0)
            if a == 0 and b == kb:
                out[rows, cols] = value.to(torch.bfloat16)
            else:
                work[r, rows, cols] = value
    assert s.shared > 0
    streamk._sum_shared_tiles_kernel[(sms - 1, -(-tokens // streamk.SUM_TOKENS))](
        work, out, m, n, n, s.per, kb, s.dp, s.units, npm, npn, BT=tokens, GROUP_M=pl.GROUP_M,
        BLOCK_T=streamk.SUM_TOKENS, SLABS=s.slabs)
    want = part.sum(0)
    assert not out.isnan().any()
    assert torch.all((out.float() - want).abs() <= want.abs() * 2 ** -7 + 1e-5)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="its fallback runs the dequantize kernel on CPU "
                    "tensors (the interpreter)")
def test_prefill_launcher_descriptors(monkeypatch):
    """The Gluon prefill launcher against a stand-in kernel on CPU tensors: the words as two-box
    [128, 32] tiles of the [N, K/8] storage, the activations as [128, 64] tiles, the output
    through TMA when its rows are 16-byte aligned and with masked stores otherwise, the grid;
    an activation base pointer TMA cannot take runs the dequantize path instead."""
    from tileq.kernels.int4p.dequant import DequantLaunch
    from tileq.testing import KernelRecorder

    rec = KernelRecorder()
    monkeypatch.setitem(pl._gl(), "kernel", rec)
    torch.manual_seed(3)
    m, n, k = 300, 577, 1104
    v = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    w = prepack_int4(v)
    ws = torch.rand(-(-k // 128), n) * 0.02 + 0.01
    x = torch.randn(m, k).to(torch.bfloat16)
    fallback = DequantLaunch(n, k, "group", "none", (ws.stride(0), ws.stride(1)), 128, torch.bfloat16,
                             torch.bfloat16)
    launch = pl.GluonPrefillLaunch(m, n, k, torch.bfloat16, torch.bfloat16, "group",
                                   (ws.stride(0), ws.stride(1)), 128, False, torch.device("cpu"), fallback,
                                   tokens=128, num_sms=132, overlap=True)
    assert launch.name == "bquant_bf16xi4p_rcr_prefill__gluon_w128t128k512_ws2x64_sm90"
    launch(x, w.data, None, ws, None)
    (grid, args, kwargs), = rec.calls
    w_desc, x_desc, c_desc, out = args[:4]
    assert (w_desc.shape, w_desc.strides, w_desc.block_shape) == ([n, 3 * 64], [192, 1], [128, 32])
    assert (x_desc.shape, x_desc.strides, x_desc.block_shape) == ([m, k], [k, 1], [128, 64])
    assert c_desc is None and kwargs["TMA_STORE"] is False  # 577 bf16 = 1154-byte rows
    assert args[6] is None and kwargs["X_SCALE"] == "none"  # (W4A16: no token scales)
    assert grid == (min(132, 3 * 5),) and args[7] is None  # (no workspace)
    assert args[8:] == (m, n, k, n, n, 1, 0, 0)
    assert (kwargs["W_SCALE"], kwargs["GROUP_K"], kwargs["BT"], kwargs["WS"], kwargs["XS"]) == ("group", 128, 128, 2, 8)
    assert kwargs["maxnreg"] == 168 and "mul.rn.bf16x2" in kwargs["ASM0"]
    n2 = 576  # 16-byte rows: TMA stores through a [128, 64] box
    launch2 = pl.GluonPrefillLaunch(m, n2, k, torch.bfloat16, torch.bfloat16, "vector", (0, 1), 128, True,
                                    torch.device("cpu"), fallback, tokens=128, num_sms=132, overlap=True)
    launch2(x, prepack_int4(v[:n2]).data, None, torch.ones(n2), torch.zeros(n2))
    _, args, kwargs = rec.calls[-1]
    assert kwargs["TMA_STORE"] is True and args[2].block_shape == [128, 64] and "mul.rn" not in kwargs["ASM0"]
    # An activation base pointer off 16 bytes: dequantize + cuBLAS computes the same function.
    buf = torch.empty(m * k + 8, dtype=torch.bfloat16)
    xu = buf[1:1 + m * k].view(m, k)
    xu.copy_(x)
    before = len(rec.calls)
    y = launch(xu, w.data, None, ws, None)
    assert len(rec.calls) == before
    want = _reference(x, v, ws, None, None, 128)
    assert float((y.double() - want).abs().max() / want.abs().max()) < 1e-2


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,bias", [(40, 1000, 3584, False), (300, 4000, 1104, True), (1030, 5120, 5120, False),
                                        (2048, 4001, 2560, True)])
def test_gpu_w4a8_fused_kernel(m, n, k, bias, prefill_launches):
    """The fused fp8 build of the Gluon prefill kernel on an H200 (routed below INT4_W4A8_MAX_M, as
    at 40 tokens; forced above with the tiling the plan would give it) matches the reference on
    the unpacked weight: split over K at 40 tokens, a K tail, masked stores (N = 4001), the bias;
    one launch; a second call gives the same bits."""
    from tileq.device import facts
    from tileq.kernels.int4p.dequant import DequantLaunch

    cuda, f8 = torch.device("cuda"), torch.float8_e4m3fn
    routed = m < T.INT4_W4A8_MAX_M
    if routed:
        assert "its fp8 build" in describe_prepacked(m, n, k, f8, device=cuda)
    torch.manual_seed(m + n)
    v = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    w = prepack_int4(v).to("cuda")
    sw = _w4a8_scales("group", n, k, 128)
    x = (torch.randn(m, k) * 50).clamp(-400, 400).to(f8)
    sx = torch.rand(m) + 0.5
    b = torch.randn(n) if bias else None
    want = _reference(x, v, sw, sx, b, 128)
    xc, sxc, swc, bc = x.to(cuda), sx.to(cuda), sw.to(cuda), None if b is None else b.to(cuda)
    if routed:
        def run():
            return linear_prepacked(xc, w, sxc, swc, bias=bc)
    else:
        sms = facts(cuda).num_sms
        tokens, split = rules.prefill_tiling(m, n, k, sm90_with(sms), x_scale=True)
        strides = (swc.stride(0), swc.stride(1))
        fallback = DequantLaunch(n, k, "group", "vector", strides, 128, torch.bfloat16, f8)
        launch = pl.GluonPrefillLaunch(m, n, k, f8, torch.bfloat16, "group", strides, 128, b is not None, cuda,
                                       fallback, tokens=tokens, num_sms=sms, overlap=rules.overlap_for("fp8", tokens),
                                       split=split, x_kind="vector", sx_stride=sxc.stride(0), fused=True)
        assert launch.name.startswith("bquant_fp8xi4p_rcr_prefill__gluon_")

        def run():
            return launch(xc, w.data, sxc, swc, bc)
    y = run()
    assert len(prefill_launches) == 1
    assert float((y.cpu().double() - want).abs().max() / want.abs().max()) < 1e-2
    assert torch.equal(run(), y)
