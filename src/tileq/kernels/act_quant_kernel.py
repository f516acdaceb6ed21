"""Triton kernels of activation quantization (launchers and torch references: ``act_quant.py``).

``_quantize_activation_kernel`` quantizes rows of x [M, K] with a per-row ('row'), per 1×GROUP_K
group ('group') or static per-tensor ('tensor') scale; ``_add_rmsnorm_quantize_kernel`` first
computes h = x + residual and transformers' RMSNorm of h, then quantizes the normalized row.

The math is the offline helper's (``tileq.quant.quantize_a``), bit for bit on finite data:
``amax = max |x|``, ``s = max(amax / QMAX, EPS)`` and ``y = clamp(x / s, -QMAX, QMAX)`` in fp32
with IEEE (round-to-nearest) divisions, then int8 rounds half to even and fp8/bf8 casts round to
nearest even. NaN policy: a row (a group, for 'group') holding NaN or ±inf gets a NaN scale and
q = 0, so a GEMM reading it makes that row's outputs NaN (docs/schemes.md section 4).

A program holds its values in registers as one or two "pieces", each a [R, C] tile (C a power of
two): element (r, c) of a piece starting at ``base`` is k = base + r * GROUP_K + c for groups (row
r of the piece is one group) and k = base + c for whole rows (R = 1). Two pieces cover a row of
K = 17408 as 16384 + 1024 elements instead of one 32768-element power of two (half of it idle).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import wait_upstream

_FLT_MAX = tl.constexpr(3.4028234663852886e38)
# 1.5 * 2**23: y + this, for |y| <= 2**22, rounds y to an integer (fp32 addition rounds to nearest
# even) and leaves it in the low mantissa bits, so the low byte of the sum's bits is the int8.
_ROUND_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _max_nan(a, b):
    # NaN-propagating maximum (max.NaN.f32): a NaN anywhere in a row reaches its amax.
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _nan_like(x):
    # A quiet NaN made from bits: a NaN constant would be a global that never equals itself.
    return tl.full(x.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _piece(base, R: tl.constexpr, C: tl.constexpr, GROUPED: tl.constexpr, GROUP_K: tl.constexpr, K):
    """Element offsets [R, C] and their validity for a piece starting at element ``base``."""
    r = tl.arange(0, R)[:, None]
    c = tl.arange(0, C)[None, :]
    if GROUPED:
        k = base + r * GROUP_K + c
        ok = (c < GROUP_K) & (k < K)
    else:
        k = base + r * C + c
        ok = k < K
    return k, ok


@triton.jit
def _to_f32(x, INTERPRETED: tl.constexpr):
    if INTERPRETED:
        if x.dtype == tl.bfloat16:
            # The interpreter's bf16 -> fp32 conversion mishandles subnormals; the bits are exact.
            return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _round_to(v, X_TYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 ``v`` rounded to x's dtype (nearest even), as torch rounds a bf16/fp16 result."""
    if X_TYPE == "bf16":
        if INTERPRETED:
            # The interpreter truncates fp32 -> bf16: round the bits to nearest even first.
            u = v.to(tl.uint32, bitcast=True)
            u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
            r = tl.where(v != v, v, u.to(tl.float32, bitcast=True))
            return r.to(tl.bfloat16)
        else:
            return v.to(tl.bfloat16)
    elif X_TYPE == "fp16":
        return v.to(tl.float16)
    else:
        return v


@triton.jit
def _float8_bits(y, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """Interpreter only: the float8 (MBITS mantissa bits, exponent bias BIAS) encoding of a finite
    fp32 ``y`` within the format's range, rounded to nearest even. (The interpreter's own fp8
    conversion rounds ties away from zero and can carry into the exponent wrongly.)"""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    u = bits & 0x7FFFFFFF
    DROP: tl.constexpr = 23 - MBITS
    r = u + ((1 << (DROP - 1)) - 1) + ((u >> DROP) & 1)
    normal = (r >> DROP) - ((127 - BIAS) << MBITS)
    # Below the smallest normal the grid is uniform, steps of 2**(1 - BIAS - MBITS): scale to
    # integers (exact, a power of two) and round half to even.
    small = tl.abs(y) < 2.0 ** (1 - BIAS)
    a = tl.where(small, tl.abs(y), 0.0) * (2.0 ** (BIAS - 1 + MBITS))
    sub = ((a + _ROUND_MAGIC) - _ROUND_MAGIC).to(tl.int32)
    enc = tl.where(small, sub, normal)
    return (enc | sign).to(tl.uint8)


@triton.jit
def _encode(y, OUT_TYPE: tl.constexpr, QMAX: tl.constexpr, INTERPRETED: tl.constexpr):
    """Saturate a finite fp32 ``y`` to [-QMAX, QMAX] and convert it to the output type."""
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if OUT_TYPE == "i8":
        # Half to even without F2I (a quarter-rate conversion on sm_90): one full-rate add.
        return (y + _ROUND_MAGIC).to(tl.int32, bitcast=True).to(tl.int8)
    elif OUT_TYPE == "fp8":
        if INTERPRETED:
            return _float8_bits(y, 3, 7).to(tl.float8e4nv, bitcast=True)
        else:
            return y.to(tl.float8e4nv)  # cvt.rn.satfinite.e4m3x2.f32 on sm_89+
    else:
        if INTERPRETED:
            return _float8_bits(y, 2, 15).to(tl.float8e5, bitcast=True)
        else:
            return y.to(tl.float8e5)  # cvt.rn.satfinite.e5m2x2.f32


@triton.jit
def _divide(v, s, INTERPRETED: tl.constexpr):
    """``v / s`` rounded to nearest (IEEE), as torch divides on CPU and GPU; ``s`` broadcasts."""
    if INTERPRETED:
        return v / tl.broadcast_to(s, v.shape)  # numpy's float32 division is IEEE
    else:
        # Markstein's correction: with rcp = RN(1/s) and y0 = RN(v * rcp), e = y0 * s - v is
        # exact in an fma and RN(y0 - e * rcp) = RN(v / s) (no over/underflow: |v / s| <= QMAX-ish,
        # s >= 1e-12; checked against IEEE division on 8e7 pairs, tests/test_act_quant.py).
        # Three full-rate ops per element instead of div.rn's ~8 and its slow-path branch.
        # e is computed as y0 * s - v, not v - y0 * s, so that v = -0.0 keeps its sign.
        rcp = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)  # once per row / group
        s = tl.broadcast_to(s, v.shape)
        rcp = tl.broadcast_to(rcp, v.shape)
        y0 = v * rcp
        e = tl.fma(y0, s, -v)
        return tl.fma(-e, rcp, y0)


@triton.jit
def _scale_of(amax, QMAX: tl.constexpr, EPS: tl.constexpr):
    """(scale, non-finite flag) from a NaN-propagating amax; the scale is NaN where flagged."""
    bad = ~(amax <= _FLT_MAX)
    s = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32)), EPS)
    return tl.where(bad, _nan_like(s), s), bad


@triton.jit
def _abs_max(v, INTERPRETED: tl.constexpr):
    """fp32 NaN-propagating max |v| along axis 1. ``v`` is the loaded bf16/fp16 data: widening
    |v| only inside the reduction keeps the row packed in registers until it is quantized (the
    sm_90 build of a 17408-wide bf16 row in 16 warps: 44 registers, against 91 when the row was
    widened to fp32 right after the load)."""
    if INTERPRETED:
        v = _to_f32(v, INTERPRETED)  # the interpreter holds bf16 as raw uint16
    return tl.reduce(tl.abs(v).to(tl.float32), 1, _max_nan)


@triton.jit
def _quantize_store(q_row, k, ok, v, s, bad, OUT_TYPE: tl.constexpr, QMAX: tl.constexpr,
                    INTERPRETED: tl.constexpr):
    y = _divide(_to_f32(v, INTERPRETED), s, INTERPRETED)
    y = tl.where(bad, 0.0, y)  # a flagged row/group stores q = 0 (its scale is NaN)
    tl.store(q_row + k, _encode(y, OUT_TYPE, QMAX, INTERPRETED), mask=ok)


@triton.jit
def _static_scale(scale_ptr, scale_val):
    """The calibrated scale (from memory, so a graph replay reads its current value) and whether
    it is unusable (not a positive finite number: then every row's scale is NaN)."""
    if scale_ptr is None:
        # (fp32 as Triton's launcher passes a Python float; inductor, launching it, passes fp64)
        st = tl.cast(scale_val, tl.float32) + tl.zeros([1], tl.float32)
    else:
        st = tl.load(scale_ptr + tl.arange(0, 1)).to(tl.float32)
    return st, ~((st > 0.0) & (st <= _FLT_MAX))


@triton.jit
def _finish_pieces(q_row, s_row, stride_sg, K, pid_g, kh, okh, vh, kt, okt, vt,
                   GRANULARITY: tl.constexpr, OUT_TYPE: tl.constexpr, QMAX: tl.constexpr,
                   EPS: tl.constexpr, GROUP_K: tl.constexpr, HR: tl.constexpr, TR: tl.constexpr,
                   st, st_bad, INTERPRETED: tl.constexpr):
    """Scales and q of a program's pieces (head; tail when TR > 0), stored."""
    ah = _abs_max(vh, INTERPRETED)  # [HR]
    if GRANULARITY == "group":
        n_groups = tl.cdiv(K, GROUP_K)
        sh, bh = _scale_of(ah, QMAX, EPS)
        _quantize_store(q_row, kh, okh, vh, sh[:, None], bh[:, None], OUT_TYPE, QMAX, INTERPRETED)
        gh = pid_g * HR + tl.arange(0, HR)
        tl.store(s_row + gh * stride_sg, sh, mask=gh < n_groups)
        if TR > 0:
            at = _abs_max(vt, INTERPRETED)
            s_t, bt = _scale_of(at, QMAX, EPS)
            _quantize_store(q_row, kt, okt, vt, s_t[:, None], bt[:, None], OUT_TYPE, QMAX,
                            INTERPRETED)
            g_t = pid_g * HR + HR + tl.arange(0, TR)
            tl.store(s_row + g_t * stride_sg, s_t, mask=g_t < n_groups)
    else:
        amax = ah  # [1]
        if TR > 0:
            amax = _max_nan(amax, _abs_max(vt, INTERPRETED))
        if GRANULARITY == "row":
            s, bad = _scale_of(amax, QMAX, EPS)
            s_out = s
        else:  # 'tensor': the calibrated scale; NaN for a row holding a non-finite value
            s = tl.where(st_bad, 1.0, st)  # an unusable scale is not divided by (q = 0 anyway)
            bad = ~(amax <= _FLT_MAX) | st_bad
            s_out = tl.where(bad, _nan_like(s), s)
        _quantize_store(q_row, kh, okh, vh, s[:, None], bad[:, None], OUT_TYPE, QMAX, INTERPRETED)
        if TR > 0:
            _quantize_store(q_row, kt, okt, vt, s[:, None], bad[:, None], OUT_TYPE, QMAX,
                            INTERPRETED)
        tl.store(s_row + tl.arange(0, 1), s_out)


@triton.jit
def _quantize_activation_kernel(
    x_ptr, q_ptr, s_ptr, scale_ptr,
    scale_val, K, stride_xm, stride_sm, stride_sg,
    GRANULARITY: tl.constexpr, OUT_TYPE: tl.constexpr, QMAX: tl.constexpr, EPS: tl.constexpr,
    GROUP_K: tl.constexpr, HR: tl.constexpr, HC: tl.constexpr, TR: tl.constexpr,
    TC: tl.constexpr, LOOP_C: tl.constexpr, INTERPRETED: tl.constexpr, PDL: tl.constexpr = False,
):
    """Grid (M, programs along K): program (m, g) quantizes row m's groups g*HR .. g*HR+HR-1
    ('group') or the whole row m ('row', 'tensor'). q is contiguous [M, K]; the scale of row m,
    group j lives at s_ptr + m * stride_sm + j * stride_sg. PDL: launched with programmatic
    dependent launch, it waits for the previous kernel before its first load (x, a calibrated
    scale) and its first store (q and s may be scratch that kernel still reads)."""
    if PDL:
        wait_upstream()
    m = tl.program_id(0).to(tl.int64)
    pid_g = tl.program_id(1)
    x_row = x_ptr + m * stride_xm
    q_row = q_ptr + m * K
    s_row = s_ptr + m * stride_sm
    st = 1.0
    st_bad = False
    if GRANULARITY == "tensor":
        st, st_bad = _static_scale(scale_ptr, scale_val)
    if LOOP_C > 0:
        # Rows too long for registers ('row'/'tensor', K > 32768): pass 1 finds amax, pass 2
        # re-reads the row (from L2) and quantizes it.
        acc = tl.zeros([1, LOOP_C], tl.float32)
        for k0 in range(0, K, LOOP_C):
            k, ok = _piece(k0, 1, LOOP_C, False, 1, K)
            v = _to_f32(tl.load(x_row + k, mask=ok, other=0.0), INTERPRETED)
            acc = _max_nan(acc, tl.abs(v))
        amax = tl.reduce(acc, 1, _max_nan)
        if GRANULARITY == "row":
            s, bad = _scale_of(amax, QMAX, EPS)
            s_out = s
        else:
            s = tl.where(st_bad, 1.0, st)
            bad = ~(amax <= _FLT_MAX) | st_bad
            s_out = tl.where(bad, _nan_like(s), s)
        for k0 in range(0, K, LOOP_C):
            k, ok = _piece(k0, 1, LOOP_C, False, 1, K)
            v = _to_f32(tl.load(x_row + k, mask=ok, other=0.0), INTERPRETED)
            _quantize_store(q_row, k, ok, v, s[:, None], bad[:, None], OUT_TYPE, QMAX, INTERPRETED)
        tl.store(s_row + tl.arange(0, 1), s_out)
    else:
        GROUPED: tl.constexpr = GRANULARITY == "group"
        if GROUPED:
            base = pid_g * (HR * GROUP_K)
            tail = base + HR * GROUP_K
        else:
            base = 0
            tail = HC
        kh, okh = _piece(base, HR, HC, GROUPED, GROUP_K, K)
        vh = tl.load(x_row + kh, mask=okh, other=0.0)
        kt, okt, vt = kh, okh, vh  # placeholders when there is no tail piece
        if TR > 0:
            kt, okt = _piece(tail, TR, TC, GROUPED, GROUP_K, K)
            vt = tl.load(x_row + kt, mask=okt, other=0.0)
        _finish_pieces(q_row, s_row, stride_sg, K, pid_g, kh, okh, vh, kt, okt, vt,
                       GRANULARITY, OUT_TYPE, QMAX, EPS, GROUP_K, HR, TR, st, st_bad, INTERPRETED)


@triton.jit
def _residual_add(x_row, r_row, h_row, k, ok, X_TYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """h = x + residual in x's dtype (stored to h_row), or x without residual."""
    x = tl.load(x_row + k, mask=ok, other=0.0)
    if r_row is None:
        return x
    else:
        x = _to_f32(x, INTERPRETED)
        r = _to_f32(tl.load(r_row + k, mask=ok, other=0.0), INTERPRETED)
        h = _round_to(x + r, X_TYPE, INTERPRETED)  # torch adds bf16/fp16 in fp32 and rounds once
        tl.store(h_row + k, h, mask=ok)
        return h


@triton.jit
def _rms_scaled(h, rstd, w_ptr, k, ok, X_TYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """weight * (h * rstd).to(x dtype), the product rounded to x's dtype: transformers'
    LlamaRMSNorm / Qwen3RMSNorm."""
    h = _to_f32(h, INTERPRETED)
    w = _to_f32(tl.load(w_ptr + k, mask=ok, other=0.0), INTERPRETED)
    n = _to_f32(_round_to(h * rstd, X_TYPE, INTERPRETED), INTERPRETED)
    return _round_to(n * w, X_TYPE, INTERPRETED)  # in x's dtype: converted when quantized


@triton.jit
def _add_rmsnorm_quantize_kernel(
    x_ptr, r_ptr, w_ptr, h_ptr, q_ptr, s_ptr,
    eps, K, stride_xm, stride_rm, stride_sm, stride_sg,
    GRANULARITY: tl.constexpr, X_TYPE: tl.constexpr, OUT_TYPE: tl.constexpr,
    QMAX: tl.constexpr, EPS: tl.constexpr, GROUP_K: tl.constexpr, HR: tl.constexpr,
    HC: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr, INTERPRETED: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Grid (M,): program m holds row m in registers (one or two pieces), computes
    h = x + residual (stored to h_ptr, contiguous [M, K]; no residual: h = x, nothing stored),
    normed = weight * (h * rsqrt(mean(h**2) + eps)).to(x dtype), and quantizes normed as
    ``_quantize_activation_kernel`` does ('row' or 'group'). PDL: waits for the previous kernel
    before its first load and store, as ``_quantize_activation_kernel``."""
    if PDL:
        wait_upstream()
    m = tl.program_id(0).to(tl.int64)
    GROUPED: tl.constexpr = GRANULARITY == "group"
    x_row = x_ptr + m * stride_xm
    h_row = h_ptr
    r_row = r_ptr
    if r_ptr is not None:
        r_row = r_ptr + m * stride_rm
        h_row = h_ptr + m * K
    kh, okh = _piece(0, HR, HC, GROUPED, GROUP_K, K)
    hh = _residual_add(x_row, r_row, h_row, kh, okh, X_TYPE, INTERPRETED)
    hf = _to_f32(hh, INTERPRETED)
    sumsq = tl.sum(tl.sum(hf * hf, 1), 0)
    kt, okt, ht = kh, okh, hh
    if TR > 0:
        if GROUPED:
            tail = HR * GROUP_K
        else:
            tail = HC
        kt, okt = _piece(tail, TR, TC, GROUPED, GROUP_K, K)
        ht = _residual_add(x_row, r_row, h_row, kt, okt, X_TYPE, INTERPRETED)
        tf = _to_f32(ht, INTERPRETED)
        sumsq += tl.sum(tl.sum(tf * tf, 1), 0)
    # mean = sum / K and 1 / sqrt(var + eps), each rounded to nearest (torch's CPU mean divides;
    # torch.rsqrt on a GPU is approximate, so the reference uses 1 / sqrt as well).
    var = tl.math.div_rn(sumsq, K * 1.0)
    rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(var + tl.cast(eps, tl.float32)))  # (eps: as scale_val above)
    vh = _rms_scaled(hh, rstd, w_ptr, kh, okh, X_TYPE, INTERPRETED)
    vt = vh
    if TR > 0:
        vt = _rms_scaled(ht, rstd, w_ptr, kt, okt, X_TYPE, INTERPRETED)
    _finish_pieces(q_ptr + m * K, s_ptr + m * stride_sm, stride_sg, K, 0, kh, okh, vh, kt, okt, vt,
                   GRANULARITY, OUT_TYPE, QMAX, EPS, GROUP_K, HR, TR, 1.0, False, INTERPRETED)
